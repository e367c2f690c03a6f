"""Angle-fused rotation kernel vs the float64 loop over dense Givens transitions.

On a CPU machine the kernel runs through the Triton interpreter (conftest sets TRITON_INTERPRET=1),
so the shapes stay tiny. Tolerances: float32 accumulates in float32 over T <= 48 steps of L <= 6
layers, so 2e-5 abs / 1e-4 rel; bfloat16 rounds the outputs (and the stored h the backward reads)
to 8 bits, so 3e-2.
"""
import pytest
import torch

import mingru
from mingru import naive
from mingru.dispatch import ScanFallback

rotation = pytest.importorskip("mingru.kernels.rotation")
pytestmark = pytest.mark.usefixtures("triton_mode")

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _inputs(B, T, n, k, L, dtype, with_h0, decay=(0.3, 0.95), seed=0, with_scale=False):
    """Angles ~ N(0, 1.5^2) (all four quadrants), decays uniform in `decay`, u and h0 ~ N(0, 1);
    with_scale: a fifth input, the scale of the odd components, uniform in (-1, 1) (a tanh's range)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = decay
    xs = [torch.randn(B, T, n, L, k // 2, generator=g) * 1.5,
          lo + (hi - lo) * torch.rand(B, T, n, generator=g),
          torch.randn(B, T, n, k, generator=g)]
    xs.append(torch.randn(B, n, k, generator=g) if with_h0 else None)
    if with_scale:
        xs.append(2 * torch.rand(B, T, n, generator=g) - 1)
    return [None if x is None else x.to(dtype) for x in xs]


def _run(fn, inputs, cotangent):
    """h = fn(*inputs) and the gradients of <h, cotangent> w.r.t. every tensor input."""
    inputs = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
    h = fn(*inputs)
    given = [x for x in inputs if x is not None]
    return h, torch.autograd.grad(h, given, cotangent.to(h.device, h.dtype))


def _check(inputs, tol):
    g = torch.Generator().manual_seed(1)
    cotangent = torch.randn(inputs[2].shape, generator=g, dtype=torch.float64)
    h, grads = _run(mingru.rotation_recurrence, inputs, cotangent)
    ref_inputs = [None if x is None else x.double() for x in inputs]
    h_ref, grads_ref = _run(naive.rotation_recurrence_naive, ref_inputs, cotangent)
    assert h.dtype == inputs[2].dtype and all(d.dtype == h.dtype for d in grads)
    names = ["h", "d_angles", "d_decay", "d_u"] + ["d_h0"] * (inputs[3] is not None) + ["d_scale"] * (len(inputs) > 4)
    assert len(names) == 1 + len(grads)
    for name, got, want in zip(names, (h, *grads), (h_ref, *grads_ref)):
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{name}: {m}")


def _case(B, T, n, k, L, h0, dtype):
    return pytest.param(B, T, n, k, L, h0, dtype,
                        id=f"B{B}-T{T}-n{n}-k{k}-L{L}-{'h0' if h0 else 'zero_h0'}-{str(dtype)[6:]}")


CASES = (
    # every block size with every layer count the mixers use (1: RotationMinGRU, 2·rounds: Givens)
    [_case(2, 5, 3, k, L, True, torch.float32) for k in (2, 4, 8, 16) for L in (1, 2, 6)]
    + [_case(2, 33, 3, 8, 6, True, torch.float32), _case(2, 33, 2, 4, 2, False, torch.float32),
       _case(1, 1, 2, 16, 1, True, torch.float32), _case(2, 1, 3, 2, 6, False, torch.float32),
       _case(2, 5, 3, 4, 6, False, torch.float32), _case(1, 5, 2, 16, 2, False, torch.float32)]
    + [_case(2, 33, 3, 2, 1, True, torch.bfloat16), _case(2, 5, 3, 8, 6, True, torch.bfloat16),
       _case(1, 5, 2, 16, 2, False, torch.bfloat16), _case(2, 1, 2, 4, 1, False, torch.bfloat16)]
)


@pytest.mark.parametrize("B,T,n,k,L,with_h0,dtype", CASES)
def test_matches_naive(B, T, n, k, L, with_h0, dtype, device):
    _check([None if x is None else x.to(device) for x in _inputs(B, T, n, k, L, dtype, with_h0)], TOL[dtype])


SCALED = ([_case(2, 5, 3, k, L, h0, torch.float32) for k in (2, 4, 8) for L in (1, 2) for h0 in (True, False)]
          + [_case(2, 33, 3, 2, 1, True, torch.float32), _case(2, 33, 3, 2, 1, True, torch.bfloat16),
             _case(1, 5, 2, 16, 3, False, torch.bfloat16)])


@pytest.mark.parametrize("B,T,n,k,L,with_h0,dtype", SCALED)
def test_scaled_matches_naive(B, T, n, k, L, with_h0, dtype, device):
    """h_t = decay_t G_t diag(1, s_t, 1, s_t, ...) h_{t-1} + u_t: RotationMinGRU's transition at k = 2, L = 1."""
    inputs = _inputs(B, T, n, k, L, dtype, with_h0, seed=5, with_scale=True)
    _check([None if x is None else x.to(device) for x in inputs], TOL[dtype])


def test_scaled_gradcheck_float64(device):
    inputs = _inputs(1, 4, 2, 4, 2, torch.float64, with_h0=True, seed=6, with_scale=True)
    inputs = [x.to(device).requires_grad_() for x in inputs]
    assert torch.autograd.gradcheck(mingru.rotation_recurrence, inputs, fast_mode=True)


def test_strided_views_like_the_mixer_passes(device):
    """Angles, decay and u as slices of one projection (as GivensMinGRU makes them), h0 transposed."""
    B, T, n, k, L = 2, 7, 3, 8, 4
    g = torch.Generator().manual_seed(2)
    proj = torch.randn(B, T, n * L * k // 2 + n + n * k, generator=g)
    angles, decay, u = proj.split([n * L * k // 2, n, n * k], dim=-1)
    decay.sigmoid_()
    inputs = [angles.reshape(B, T, n, L, k // 2), decay, u.reshape(B, T, n, k),
              torch.randn(B, k, n, generator=g).transpose(1, 2)]
    assert not any(x.is_contiguous() for x in inputs)
    _check([x.to(device) for x in inputs], TOL[torch.float32])


def test_gradcheck_float64(device):
    inputs = _inputs(1, 4, 2, 4, 3, torch.float64, with_h0=True, seed=3)
    inputs = [x.to(device).requires_grad_() for x in inputs]
    assert torch.autograd.gradcheck(mingru.rotation_recurrence, inputs, fast_mode=True)


def test_large_angles_stay_accurate_and_huge_ones_bounded(device):
    """The kernel's float32 sine and cosine: angles of ~1e5 to ~1e6 radians still match the float64
    loop (forward and gradients), and angles of 1e20, where no float32 angle means anything, give
    bounded states (the clipped remainder) instead of overflowing polynomials."""
    inputs = _inputs(2, 5, 3, 4, 2, torch.float32, with_h0=True, seed=7)
    inputs[0] = inputs[0] * 4e5
    _check([x.to(device) for x in inputs], dict(atol=1e-4, rtol=1e-4))
    inputs[0] = torch.sign(inputs[0]) * 1e20
    h = mingru.rotation_recurrence(*[x.to(device) for x in inputs]).cpu()
    bound = inputs[3].norm(dim=-1) + inputs[2].norm(dim=-1).sum(1)  # rotations keep norms, decay < 1
    assert h.isfinite().all() and (h.norm(dim=-1) <= bound[:, None] * (1 + 1e-5)).all()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_angle_gives_non_finite_states_from_its_step_on(bad, device):
    """The clip of the reduced angle keeps NaN (and inf reduces to NaN): no bad angle comes out as
    a finite rotation."""
    inputs = [x.to(device) for x in _inputs(2, 5, 3, 4, 2, torch.float32, with_h0=True, seed=5)]
    inputs[0][:, 2, 1, 0, 0] = bad
    h = mingru.rotation_recurrence(*inputs).cpu()
    assert h[:, :2].isfinite().all() and h[:, 2:, 0].isfinite().all()
    assert h[:, 2:, 1].isnan().any(-1).all()


def test_strong_decay_gradients_stay_exact_where_division_explodes(device):
    """decay ~ 0.05 over T = 48: the stored-state backward keeps float32 accuracy, while undoing each
    step with its inverse transition (h_{t-1} = G_t^T (h_t - u_t) / decay_t) multiplies the rounding
    error of h by ~20 per step, past any tolerance within a few dozen steps."""
    B, T, n, k, L = 1, 48, 2, 4, 2
    inputs = _inputs(B, T, n, k, L, torch.float32, with_h0=True, decay=(0.04, 0.06), seed=4)
    _check([x.to(device) for x in inputs], TOL[torch.float32])

    angles, decay, u, h0 = inputs
    h = mingru.rotation_recurrence(*[x.to(device) for x in inputs]).cpu()
    G = naive.givens_matrices_naive(angles, torch.ones_like(decay)).float()
    back = h[:, -1]
    for t in range(T - 1, 0, -1):  # division-based reversal, what the kernel must not do
        back = (G[:, t].transpose(-1, -2) @ ((back - u[:, t]) / decay[:, t, :, None]).unsqueeze(-1)).squeeze(-1)
    h_ref = naive.rotation_recurrence_naive(*inputs)
    assert not (back.double() - h_ref[:, 0]).abs().max() < 1e3


def test_saves_only_what_the_backward_reads(device):
    """angles, decay, h0 and the output h: no copy of u, no k x k transitions."""
    angles, decay, u, h0 = [x.to(device).requires_grad_() for x in _inputs(2, 5, 3, 8, 6, torch.float32, True)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        h = mingru.rotation_recurrence(angles, decay, u, h0)
    assert sum(x.numel() for x in saved) == angles.numel() + decay.numel() + h0.numel() + h.numel()
    assert all(x.data_ptr() != u.data_ptr() for x in saved)


@pytest.mark.parametrize("k,L", [(3, 2), (6, 2), (4, 17), (32, 1)], ids=lambda v: str(v))
def test_outside_envelope_raises_scan_fallback(k, L, device):
    angles, decay, u, _ = _inputs(1, 3, 2, 2 * (k // 2), L, torch.float32, False)
    u = torch.randn(1, 3, 2, k)
    with pytest.raises(ScanFallback):
        rotation.rotation_recurrence(angles.to(device), decay.to(device), u.to(device), None)


def test_triton_mode_refuses_instead_of_downgrading(device):
    angles, decay, u, _ = _inputs(1, 3, 2, 6, 2, torch.float32, False)
    with pytest.raises(RuntimeError, match="k = 6: the kernels are compiled for k in"):
        mingru.rotation_recurrence(angles.to(device), decay.to(device), u.to(device))
