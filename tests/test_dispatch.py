"""The dispatch seam: modes read at call time, one warning per process, no silent downgrade."""
import subprocess
import sys
import warnings

import pytest
import torch

import mingru
from mingru import dispatch


def _inputs():
    return torch.rand(2, 5, 3), torch.randn(2, 5, 3)


def test_unknown_mode_is_a_value_error(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "fast")
    with pytest.raises(ValueError, match="MINGRU_SCAN='fast'.*auto, eager, triton"):
        mingru.linear_scan(*_inputs())


def test_mode_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "eager")
    assert mingru.scan_mode() == "eager"
    monkeypatch.setenv("MINGRU_SCAN", " Triton ")
    assert mingru.scan_mode() == "triton"
    monkeypatch.delenv("MINGRU_SCAN")
    assert mingru.scan_mode() == "auto"


def test_using_sets_the_mode_for_a_block_and_restores_it(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "triton")
    with dispatch.using("eager"):
        assert mingru.scan_mode() == "eager"
    assert mingru.scan_mode() == "triton"
    monkeypatch.delenv("MINGRU_SCAN")
    with pytest.raises(ValueError, match="mode='fast'"), dispatch.using("fast"):
        pass
    assert "MINGRU_SCAN" not in __import__("os").environ


def test_auto_on_cpu_is_eager_without_warning(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "auto")
    monkeypatch.setattr(dispatch, "triton_impl", lambda name: pytest.fail("auto on CPU must not load kernels"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mingru.linear_scan(*_inputs())


def _declining(name):
    def impl(*args):
        raise dispatch.ScanFallback("k = 3 is outside the envelope")
    return impl


def test_triton_mode_raises_instead_of_downgrading(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "triton_impl", _declining)
    with pytest.raises(RuntimeError, match="MINGRU_SCAN=triton: linear_scan.*k = 3 is outside"):
        mingru.linear_scan(*_inputs())


def test_triton_mode_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need CUDA.*TRITON_INTERPRET=1"):
        mingru.linear_scan(*_inputs())


def test_fallback_warns_once_per_process_and_runs_eager(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "auto")
    monkeypatch.setattr(dispatch, "_warned", False)
    monkeypatch.setattr(dispatch, "triton_impl", _declining)
    cuda_like = type("FakeCuda", (), {"type": "cuda"})()
    a, b = _inputs()
    a_fake = type("T", (), {"device": cuda_like, "numel": lambda self: 1})()
    with pytest.warns(RuntimeWarning, match="runs the eager scan.*once per process"):
        out1 = dispatch.dispatch("linear_scan", lambda x, y: mingru.scans.linear_scan(a, b), a_fake, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out2 = dispatch.dispatch("matrix_scan", lambda x, y: mingru.scans.linear_scan(a, b), a_fake, b)
    torch.testing.assert_close(out1, out2)


def test_missing_backend_is_a_fallback(monkeypatch):
    monkeypatch.setitem(dispatch.TRITON_IMPLS, "linear_scan", "mingru.no_such_module:f")
    with pytest.raises(dispatch.ScanFallback, match="unavailable"):
        dispatch.triton_impl("linear_scan")


def test_import_mingru_does_not_import_triton():
    code = "import sys, mingru; mingru.MinGRU(4, 8); print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_op_has_a_registered_kernel_entry():
    for name in ["linear_scan", "linear_recurrence", "parallel_scan_log", "gated_recurrence",
                 "gated_recurrence_stacked", "signed_recurrence_stacked", "matrix_scan",
                 "matrix_affine_scan", "matrix_recurrence", "rotation_recurrence"]:
        assert name in dispatch.TRITON_IMPLS and hasattr(mingru, name)


SMALL = {"linear_scan": dict(B=2, T=5, D=3), "linear_recurrence": dict(B=2, T=5, D=3, h0=True),
         "parallel_scan_log": dict(B=2, T=5, D=3), "gated_recurrence": dict(B=2, T=5, D=3),
         "gated_recurrence_stacked": dict(B=2, T=5, D=3), "signed_recurrence_stacked": dict(B=2, T=5, D=3),
         "matrix_scan": dict(B=2, T=5, n=2),
         "matrix_affine_scan": dict(B=2, T=5, n=2, k=4, v=2), "matrix_recurrence": dict(B=2, T=5, n=2, k=4, v=2, h0=True),
         "rotation_recurrence": dict(B=2, T=5, n=2, k=4, L=2, h0=True)}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_eager_fast_path_matches_the_registered_op(name, triton_mode, device):
    """Eager calls skip the custom-op dispatcher (an autograd.Function over the same launchers);
    torch.compile traces the registered mingru::<name> op. Both must give the same values and grads."""
    from mingru.bench import cases
    inputs = [None if x is None else x.requires_grad_() for x in cases.op_inputs(name, SMALL[name], device=device)]
    dispatch.triton_impl(name)  # imports the kernel module, which registers the op
    results = []
    for fn in (getattr(mingru, name), getattr(torch.ops.mingru, name)):
        outs = cases.outputs(fn, inputs)
        leaves = [x for x in inputs if x is not None]
        grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
        results.append(outs + grads)
    for fast, registered in zip(*results):
        torch.testing.assert_close(fast, registered, rtol=0, atol=0)


def test_tracers_see_the_registered_op(triton_mode, device):
    """Under a tracer (make_fx here; dynamo, export and fake tensors alike) the entry point must call
    the registered op, whose launches go through wrap_triton, never the eager path's raw launches."""
    from torch.fx.experimental.proxy_tensor import make_fx
    dispatch.triton_impl("linear_scan")
    a, b = torch.rand(2, 5, 3, device=device), torch.randn(2, 5, 3, device=device)
    graph = make_fx(lambda a, b: mingru.linear_scan(a, b))(a, b)
    assert "mingru.linear_scan" in graph.code


def test_eager_calls_launch_without_the_tracing_wrapper(triton_mode, device, monkeypatch):
    """wrap_triton's traced launch path costs host time on every call; eager calls must reach the
    launchers with it off, as triton_op's own eager implementation does (tracers:
    test_tracers_see_the_registered_op)."""
    from torch._library.triton import is_wrap_triton_enabled
    from mingru.kernels import diagonal
    dispatch.triton_impl("linear_scan")
    seen = []
    real = diagonal.launch
    monkeypatch.setattr(diagonal, "launch", lambda *a, **k: seen.append(is_wrap_triton_enabled()) or real(*a, **k))
    a, b = (torch.rand(2, 5, 3, device=device, requires_grad=True) for _ in range(2))
    A, Bc = mingru.linear_scan(a, b)
    (A + Bc).sum().backward()
    assert seen == [False, False]  # forward and backward launches


def test_first_compile_imports_the_kernels_while_tracing():
    """A fresh process whose first kernel lookup is inside torch.compile(fullgraph=True): the kernel
    modules are imported during tracing, with no graph break and no warm-up call. (The kernels
    themselves cannot run under the compiler on the interpreter; tests/test_gpu.py runs them.)"""
    pytest.importorskip("triton")
    code = (
        "import sys, torch\n"
        "from mingru import dispatch\n"
        "assert 'triton' not in sys.modules\n"
        "def f(x):\n"
        "    return x + dispatch.triton_impl('matrix_scan').__name__.count('matrix_scan')\n"
        "print(torch.compile(f, fullgraph=True, backend='eager')(torch.zeros(2)).tolist(),\n"
        "      sorted(m for m in sys.modules if m.startswith('mingru.kernels.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("]", 1)[0] == "[1.0, 1.0"
    assert all(m in out.stdout for m in ("diagonal", "matrix", "rotation"))


def test_local_steps_never_take_the_sequence_parallel_route(monkeypatch, eager_mode):
    """A scan over the caller's time axis goes to the sequence-parallel route when one is set; a step
    inside a larger computation (local=True, such as the delta rule's chunk chain) does not."""
    routed = []
    monkeypatch.setattr(dispatch, "sequence_parallel_route", lambda name, *args: routed.append(name) or "routed")
    a, b = torch.rand(1, 3, 2), torch.rand(1, 3, 2)
    assert dispatch.dispatch("linear_scan", mingru.scans.linear_scan, a, b) == "routed"
    A, Bc = dispatch.dispatch("linear_scan", mingru.scans.linear_scan, a, b, local=True)
    torch.testing.assert_close(Bc, mingru.scans.linear_scan(a, b)[1])
    assert routed == ["linear_scan"]
