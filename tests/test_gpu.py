"""GPU-only checks (skipped without CUDA): torch.compile over every mixer and op, opcheck of every op.

The interpreter cannot run these: fake tensors would reach it. `make test` on the device runs them.
The compile checks run in a fresh process each, so the compiled call is the first thing that
touches the kernels: a first `torch.compile(..., fullgraph=True)` must work without a warm-up.
"""
import os
import subprocess
import sys

import pytest
import torch

import mingru

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MIXERS = {
    "MinGRU": lambda: mingru.MinGRU(32, 64),
    "SignedMinGRU": lambda: mingru.SignedMinGRU(32, 64),
    "SignedMinGRU-coupled": lambda: mingru.SignedMinGRU(32, 64, coupled=True),
    "RotationMinGRU": lambda: mingru.RotationMinGRU(32, 64),
    "GivensMinGRU": lambda: mingru.GivensMinGRU(32, 64),
    "GivensMinGRU-generic": lambda: mingru.GivensMinGRU(32, 64, fused=False),
    "DeltaMinGRU": lambda: mingru.DeltaMinGRU(32, 64),  # d_k = 16, T = 100: chosen by shape (the fused form)
    # T = 100: two chunks, the kernels' solve and chain; T = 50 one chunk, the carried form's inverse kernel
    "DeltaMinGRU-chunked": lambda: mingru.DeltaMinGRU(32, 64, fused=False),
    "DeltaMinGRU-one-chunk": lambda: mingru.DeltaMinGRU(32, 64, fused=False),
    "DeltaMinGRU-fused": lambda: mingru.DeltaMinGRU(32, 64, fused=True),  # two chunks in the fused form's kernels
    "DeltaMinGRU-fused-nh2": lambda: mingru.DeltaMinGRU(32, 64, nh=2, chunk_size=32, fused=True),  # 4 chunks
}
LENGTH = {"DeltaMinGRU-one-chunk": 50}  # T of a mixer's input (100 unless named here)
OPS = ["linear_scan", "linear_recurrence", "parallel_scan_log", "gated_recurrence", "gated_recurrence_stacked",
       "signed_recurrence_stacked", "matrix_scan", "matrix_affine_scan", "matrix_recurrence", "rotation_recurrence"]
# the diagonal ops over T = 300 with two lanes: the planner splits time, so they run the single pass
SPLIT = [f"{op}@T300" for op in OPS[:6]]
# float32 throughout; the kernels and the eager reference sum in different orders
TOL = dict(atol=1e-4, rtol=1e-4)
GRAD_TOL = dict(atol=1e-3, rtol=1e-3)  # rtol times the gradient's largest entry (normwise)


def _op_args(T=37):
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    p = lambda *s: torch.rand(*s, device="cuda") * 0.9 + 0.05  # noqa: E731
    args = {
        "linear_scan": (r(2, T, 24), r(2, T, 24)),
        "linear_recurrence": (p(2, T, 24), r(2, T, 24), r(2, 24)),
        "parallel_scan_log": (-p(2, T, 24), r(2, T + 1, 24)),
        "gated_recurrence": (r(2, T, 24), r(2, T, 24), p(2, 24)),
        "gated_recurrence_stacked": (r(2, T, 48), p(2, 24), r(48)),
        "signed_recurrence_stacked": (r(2, T, 72), r(2, 24), r(72)),
        "matrix_scan": (r(2, T, 3, 2, 2) * 0.5, r(2, T, 3, 2)),
        "matrix_affine_scan": (r(2, T, 3, 4, 4) * 0.4, r(2, T, 3, 4, 2)),
        "matrix_recurrence": (r(2, T, 3, 4, 4) * 0.4, r(2, T, 3, 4, 2), r(2, 3, 4, 2)),
        "rotation_recurrence": (r(2, T, 3, 6, 4), p(2, T, 3), r(2, T, 3, 8), r(2, 3, 8)),
    }
    return {name: [x.requires_grad_() for x in xs] for name, xs in args.items()}


def _case(name):
    """(function, inputs, leaves the gradients are taken for) of a mixer or an op."""
    torch.manual_seed(0)
    if name in MIXERS:
        model = MIXERS[name]().cuda()
        x = torch.randn(4, LENGTH.get(name, 100), 32, device="cuda", requires_grad=True)
        return model, [x], [x, *model.parameters()]
    op, _, T = name.partition("@T")
    inputs = _op_args(int(T or 37))[op]
    return getattr(mingru, op), inputs, inputs


def _outputs_and_grads(fn, inputs, leaves):
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    grads = torch.autograd.grad(outs, leaves, [torch.cos(o.detach()) for o in outs])
    return [t.detach().clone() for t in outs + list(grads)]  # clones: CUDA graphs reuse their outputs


def compile_first(mode, names):
    """In a fresh process: compile each case (fullgraph) before anything else runs the kernels, run it
    forward and backward (three times under CUDA graphs: warm-up, record, replay), then compare each
    run with the eager reference."""
    assert not any(m.startswith("mingru.kernels") for m in sys.modules), "kernels already imported"
    for name in names:
        fn, inputs, leaves = _case(name)
        os.environ["MINGRU_SCAN"] = "triton"
        compiled = torch.compile(fn, fullgraph=True, mode=None if mode == "default" else mode)
        runs = []
        for _ in range(3 if mode == "reduce-overhead" else 1):
            torch.compiler.cudagraph_mark_step_begin()
            runs.append(_outputs_and_grads(compiled, inputs, leaves))
        os.environ["MINGRU_SCAN"] = "eager"
        want = _outputs_and_grads(fn, inputs, leaves)
        n_out = len(want) - len(leaves)
        for got in runs:
            for i, (g, w) in enumerate(zip(got, want)):
                # gradients normwise: a weight gradient sums B*T products in a different order
                tol = TOL if i < n_out else dict(atol=GRAD_TOL["atol"] + GRAD_TOL["rtol"] * w.abs().max().item(), rtol=0)
                torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{name}: {m}")
        print(name, "ok")


def _in_fresh_process(mode, names):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), mode, ",".join(names)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-6000:]
    assert out.stdout.split() == [w for name in names for w in (name, "ok")]


@pytest.mark.parametrize("name", list(MIXERS))
def test_first_compile_of_a_mixer_matches_eager(name):
    _in_fresh_process("default", [name])


def test_first_compile_of_every_op_matches_eager():
    _in_fresh_process("default", OPS + SPLIT)


def test_reduce_overhead_first_compile_matches_eager():
    """mode="reduce-overhead" (CUDA graphs): every mixer and op, forward and backward, recorded and replayed."""
    _in_fresh_process("reduce-overhead", list(MIXERS) + OPS + SPLIT)


@pytest.mark.parametrize("name", OPS + SPLIT)
def test_opcheck(name):
    from mingru.dispatch import triton_impl
    op, _, T = name.partition("@T")
    triton_impl(op)  # imports the module that registers the op
    if T:
        from mingru.kernels import layout
        assert all(layout.diagonal(2, int(T), 24, torch.device("cuda"), way, "scan").lookback
                   for way in ("forward", "backward")), "the split cases should run the single pass"
    args = [a.detach().requires_grad_() for a in _op_args(int(T or 37))[op]]
    torch.library.opcheck(getattr(torch.ops.mingru, op).default, args)


def test_opcheck_delta_rule():
    """The fused delta rule's ops: int inputs (the chunk size, the head sizes), optional tensors,
    auxiliary outputs."""
    from mingru.dispatch import triton_impl
    triton_impl("delta_rule")
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    k = torch.nn.functional.normalize(r(2, 37, 2, 3, 16), dim=-1)
    beta, log_gamma = 2 * torch.rand(2, 37, 2, 3, device="cuda"), -torch.rand(2, 37, 3, device="cuda")
    args = [x.detach().requires_grad_() for x in (r(2, 37, 3, 16), k, r(2, 37, 2, 3, 16), beta, log_gamma,
                                                    r(2, 3, 16, 16))]
    torch.library.opcheck(torch.ops.mingru.delta_rule.default, args + [16])
    # the layer's op: the projection output (B, T, H d_k + nh H (d_k + d_v + 1)), H = 3, nh = 2
    proj = r(2, 37, 3 * 16 + 2 * 3 * (16 + 16 + 1)).requires_grad_()
    torch.library.opcheck(torch.ops.mingru.delta_layer.default, [proj, *args[4:], 16, 3, 2, 16, 16])


@pytest.mark.parametrize("name", list(MIXERS) + OPS + SPLIT)
def test_direct_launches_match_kernel_run(name, monkeypatch):
    """Eager launches skip Triton's binder once a signature is known (common._direct_launch): the
    same outputs and gradients as every launch through kernel.run, on a second call (the first
    compiles and fills the cache) and on inputs 4 bytes off a 16-byte boundary, which Triton
    compiles separately."""
    from mingru.kernels import common
    monkeypatch.setenv("MINGRU_SCAN", "triton")
    fn, inputs, leaves = _case(name)
    runs = [_outputs_and_grads(fn, inputs, leaves) for _ in range(2)]
    shifted = [torch.cat([x.detach().new_zeros(1), x.detach().flatten()])[1:].view(x.shape).requires_grad_()
               for x in inputs]
    assert all(x.data_ptr() % 16 for x in shifted)
    moved = {id(x): s for x, s in zip(inputs, shifted)}
    runs.append(_outputs_and_grads(fn, shifted, [moved.get(id(x), x) for x in leaves]))
    monkeypatch.setattr(common, "_runtime", None)  # every launch through kernel.run
    want = _outputs_and_grads(fn, inputs, leaves)
    # not bitwise: the single pass's look-back may fold a different number of aggregates per run
    for got in runs:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


if __name__ == "__main__":
    compile_first(sys.argv[1], sys.argv[2].split(","))
