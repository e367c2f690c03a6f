"""GPU-only checks (skipped without CUDA): torch.compile over every mixer and opcheck of every op.

The interpreter cannot run these: fake tensors would reach it. `make test` on the device runs them.
"""
import pytest
import torch

import mingru

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MIXERS = {
    "MinGRU": lambda: mingru.MinGRU(32, 64),
    "SignedMinGRU": lambda: mingru.SignedMinGRU(32, 64),
    "RotationMinGRU": lambda: mingru.RotationMinGRU(32, 64),
    "GivensMinGRU": lambda: mingru.GivensMinGRU(32, 64),
    "GivensMinGRU-generic": lambda: mingru.GivensMinGRU(32, 64, fused=False),
}


@pytest.mark.parametrize("name", list(MIXERS))
def test_compile_fullgraph_matches_eager(name, monkeypatch):
    import mingru.kernels.diagonal, mingru.kernels.matrix, mingru.kernels.rotation  # noqa: F401,E401
    torch.manual_seed(0)
    model = MIXERS[name]().cuda()
    x = torch.randn(4, 100, 32, device="cuda", requires_grad=True)
    monkeypatch.setenv("MINGRU_SCAN", "eager")
    want = model(x)
    (gx_want,) = torch.autograd.grad(want.square().sum(), x)
    monkeypatch.setenv("MINGRU_SCAN", "triton")
    got = torch.compile(model, fullgraph=True)(x)
    (gx_got,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gx_got, gx_want, atol=1e-3, rtol=1e-3)


def _op_args():
    r = lambda *s: torch.randn(*s, device="cuda", requires_grad=True)  # noqa: E731
    p = lambda *s: (torch.rand(*s, device="cuda") * 0.9 + 0.05).requires_grad_()  # noqa: E731
    return {
        "linear_scan": (r(2, 37, 24), r(2, 37, 24)),
        "linear_recurrence": (p(2, 37, 24), r(2, 37, 24), r(2, 24)),
        "parallel_scan_log": (-p(2, 37, 24), r(2, 38, 24)),
        "matrix_scan": (r(2, 37, 3, 2, 2) * 0.5, r(2, 37, 3, 2)),
        "matrix_affine_scan": (r(2, 37, 3, 4, 4) * 0.4, r(2, 37, 3, 4, 2)),
        "matrix_recurrence": (r(2, 37, 3, 4, 4) * 0.4, r(2, 37, 3, 4, 2), r(2, 3, 4, 2)),
        "rotation_recurrence": (r(2, 37, 3, 6, 4), p(2, 37, 3), r(2, 37, 3, 8), r(2, 3, 8)),
    }


@pytest.mark.parametrize("name", [
    "linear_scan", "linear_recurrence", "parallel_scan_log", "matrix_scan", "matrix_affine_scan",
    "matrix_recurrence", "rotation_recurrence"])
def test_opcheck(name):
    from mingru.dispatch import triton_impl
    triton_impl(name)  # imports the module that registers the op
    args = [a.detach().requires_grad_() for a in _op_args()[name]]
    torch.library.opcheck(getattr(torch.ops.mingru, name).default, args)
