"""DeltaMinGRU: the chunked WY form equals the token-by-token recurrence, chains, compiles,
rejects bad input by name, and matches mingru-scans 0.2.0 from the same state_dict."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gradutil import outputs_and_grads
import seedrun
from mingru import delta, dispatch
from mingru.delta import DeltaMinGRU, delta_rule_chunked, delta_rule_recurrent

f64 = torch.float64


def _inputs(B, T, H, d_k, d_v, nh, gated, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, d_k, generator=g, dtype=f64)
    k = F.normalize(torch.randn(B, T, nh, H, d_k, generator=g, dtype=f64), dim=-1)
    v = torch.randn(B, T, nh, H, d_v, generator=g, dtype=f64)
    beta = 2 * torch.rand(B, T, nh, H, generator=g, dtype=f64)
    h_0 = torch.randn(B, H, d_k, d_v, generator=g, dtype=f64)
    log_gamma = -torch.rand(B, T, H, generator=g, dtype=f64) if gated else None
    return [q, k, v, beta, h_0] + ([log_gamma] if gated else [])


def _call(fn, **options):
    """fn over the flat input list _inputs builds (log_gamma last, when there is one)."""
    def run(q, k, v, beta, h_0, log_gamma=None):
        return fn(q, k, v, beta, log_gamma=log_gamma, h_0=h_0, **options)
    return run


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("nh", [1, 2], ids=["nh1", "nh2"])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 64], ids=lambda c: f"C{c}")
def test_chunked_equals_recurrent_with_gradients(chunk_size, nh, gated):
    inputs = _inputs(2, 13, 3, 5, 4, nh, gated)          # T = 13 is no multiple of 4 or 5
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(2, 13, 3, 4, generator=g, dtype=f64), torch.randn(2, 3, 5, 4, generator=g, dtype=f64)]
    want, want_grads = outputs_and_grads(_call(delta_rule_recurrent), inputs, cot)
    for across in ("carry", "loop", "scan"):
        got, got_grads = outputs_and_grads(_call(delta_rule_chunked, chunk_size=chunk_size, across=across),
                                           inputs, cot)
        for a, b in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=across)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("nh", [1, 2], ids=["nh1", "nh2"])
@pytest.mark.parametrize("T", [3, 13], ids=["one-chunk", "four-chunks"])
def test_no_start_state_is_a_zero_one(T, nh, gated):
    """h_0=None (the carried form skips the first chunk's state terms) gives what zeros give."""
    q, k, v, beta, h_0, *lg = _inputs(2, T, 3, 5, 4, nh, gated)
    g = torch.Generator().manual_seed(3)
    cot = [torch.randn(2, T, 3, 4, generator=g, dtype=f64), torch.randn(2, 3, 5, 4, generator=g, dtype=f64)]
    zeros = torch.zeros_like(h_0)
    want, want_grads = outputs_and_grads(
        lambda q, k, v, beta, *lg: delta_rule_recurrent(q, k, v, beta, *lg, h_0=zeros), [q, k, v, beta, *lg], cot)
    for across in ("carry", "loop"):
        got, got_grads = outputs_and_grads(
            lambda q, k, v, beta, *lg: delta_rule_chunked(q, k, v, beta, *lg, chunk_size=4, across=across),
            [q, k, v, beta, *lg], cot)
        for a, b in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=across)


def test_nh_axis_may_be_left_out_at_nh_1():
    q, k, v, beta, h_0 = _inputs(2, 7, 2, 4, 3, 1, False)
    full = delta_rule_chunked(q, k, v, beta, h_0=h_0, chunk_size=3)
    short = delta_rule_chunked(q, k[:, :, 0], v[:, :, 0], beta[:, :, 0], h_0=h_0, chunk_size=3)
    for a, b in zip(full, short):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [dict(nh=1), dict(nh=2, decay="learnable", chunk_size=3),
                                    dict(nh=3, decay="fixed", decay_rate=0.3, d_k=3, d_v=2)],
                         ids=["deltanet", "deltaproduct-learnable", "nh3-fixed-dk3-dv2"])
def test_mixer_forward_equals_steps(kwargs):
    torch.manual_seed(0)
    m = DeltaMinGRU(5, 8, n_heads=2, **kwargs).double()
    x = torch.randn(2, 9, 5, dtype=f64)
    dt = torch.rand(2, 9, dtype=f64) * 3 if m.decay else None
    h_0 = torch.randn(2, 1, m.state_size, dtype=f64)
    y, h_T = m(x, h_0=h_0, delta_t=dt, return_state=True)
    h, ys = h_0[:, 0], []
    for t in range(x.shape[1]):
        y_t, h = m.step(x[:, t], h, None if dt is None else dt[:, t])
        ys.append(y_t)
    torch.testing.assert_close(y, torch.stack(ys, 1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h_T[:, 0], h, rtol=1e-10, atol=1e-10)


def test_returned_state_chains_two_calls_outputs_and_gradients():
    torch.manual_seed(0)
    m = DeltaMinGRU(4, 6, n_heads=2, nh=2, chunk_size=4, decay="learnable").double()
    x, dt = torch.randn(2, 11, 4, dtype=f64), torch.rand(2, 11, dtype=f64)

    def run(split):
        m.zero_grad()
        if split is None:
            y, h = m(x, delta_t=dt, return_state=True)
        else:
            y1, s = m(x[:, :split], delta_t=dt[:, :split], return_state=True)
            y2, h = m(x[:, split:], h_0=s, delta_t=dt[:, split:], return_state=True)
            y = torch.cat([y1, y2], 1)
        (y.sin().sum() + h.square().sum()).backward()
        return [y, h] + [p.grad.clone() for p in m.parameters()]

    for a, b in zip(run(5), run(None)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_compiles_without_graph_breaks():
    torch.manual_seed(0)
    m = DeltaMinGRU(4, 8, n_heads=2, nh=2, chunk_size=4)
    x = torch.randn(2, 10, 4)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y, h = compiled(x, return_state=True)
    (y.sum() + h.sum()).backward()
    want_y, want_h = m(x, return_state=True)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(h, want_h)
    # the gated core and the scan chaining (decay's CPU-only delta_t inspection is host-side)
    inputs = _inputs(2, 9, 2, 4, 4, 2, True)
    run = _call(delta_rule_chunked, chunk_size=4, across="scan")
    y, h = torch.compile(run, fullgraph=True, backend="aot_eager")(*inputs)
    for a, b in zip((y, h), run(*inputs)):
        torch.testing.assert_close(a, b)


# --- the fused kernels (mingru.kernels.delta_rule) through the interpreter ------------------------

# the interpreter computes float64 exactly on CPU tensors; on a GPU the compiled kernels are tested in
# float32 (test_fused_kernels_on_gpu_against_float64) and under torch.compile (tests/test_gpu.py)
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests on CPU tensors")


@pytest.mark.parametrize("B, T, H, d_k, d_v, nh, chunk_size, gated, start", [
    (2, 13, 3, 5, 4, 1, 5, False, True),     # three chunks, the last one short; d_k, d_v below the tile
    (2, 13, 3, 5, 4, 2, 4, True, False),     # DeltaProduct, decay, a zero start
    (1, 40, 2, 16, 16, 1, 16, True, True),   # one block of micro-steps a chunk
    (1, 41, 1, 16, 8, 3, 20, True, True),    # M = 60 micro-steps: four blocks, token blocks astride them
    (1, 20, 2, 8, 8, 1, 64, False, False),   # one chunk (the seed's lab case at small size)
    (1, 30, 1, 8, 40, 2, 20, True, True),    # the walks: two column programs (the last partial), two row steps
], ids=["3-chunks", "nh2-gated-zero-start", "one-block", "nh3-four-blocks", "one-chunk", "walks-split"])
@interpreted
def test_fused_kernels_equal_recurrent(B, T, H, d_k, d_v, nh, chunk_size, gated, start, triton_mode):
    q, k, v, beta, h_0, *lg = _inputs(B, T, H, d_k, d_v, nh, gated)
    if not start:
        h_0 = None
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(B, T, H, d_v, generator=g, dtype=f64), torch.randn(B, H, d_k, d_v, generator=g, dtype=f64)]
    leaves = [q, k, v, beta, *lg] + ([h_0] if start else [])

    def run(fn, **options):
        def call(q, k, v, beta, *rest):
            return fn(q, k, v, beta, log_gamma=rest[0] if gated else None, h_0=rest[-1] if start else None,
                      **options)
        return outputs_and_grads(call, leaves, cot)

    want, want_grads = run(delta_rule_recurrent)
    got, got_grads = run(delta_rule_chunked, chunk_size=chunk_size, across="fused")
    for a, b in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


@interpreted
def test_fused_backward_keeps_no_output_it_never_reads(triton_mode):
    """The fused rule's backward never reads y or h_T, so neither is kept for it (y's memory can go once
    the layer after it is done with it); a gradient through h_T alone (y's cotangent then zeros) stays
    exact."""
    inputs = _inputs(1, 11, 2, 5, 4, 2, True)
    leaves = [x.clone().requires_grad_() for x in inputs]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y, h = _call(delta_rule_chunked, chunk_size=4, across="fused")(*leaves)
    assert kept and not any(t.data_ptr() in (y.data_ptr(), h.data_ptr()) for t in kept)
    cot = torch.randn(h.shape, generator=torch.Generator().manual_seed(2), dtype=f64)
    got = torch.autograd.grad(h, leaves, cot)
    want = torch.autograd.grad(_call(delta_rule_recurrent)(*leaves)[1], leaves, cot, allow_unused=True)
    for a, b, x in zip(got, want, leaves):  # q does not reach h_T: the recurrence leaves it out of its graph
        torch.testing.assert_close(a, torch.zeros_like(x) if b is None else b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("kwargs", [dict(nh=1, chunk_size=16), dict(nh=2, chunk_size=5, decay="learnable")],
                         ids=["deltanet", "deltaproduct-decay"])
@interpreted
def test_fused_layer_equals_eager_in_float64(kwargs, triton_mode):
    """The layer's kernels (keys normalized, strengths gated and both differentiated inside) against
    the eager mixer in float64: outputs, state, the input's and every weight's gradient."""
    torch.manual_seed(0)
    ref = DeltaMinGRU(6, 16, n_heads=2, **kwargs).double()
    m = DeltaMinGRU(6, 16, n_heads=2, fused=True, **kwargs).double()
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 23, 6, dtype=f64)
    dt = torch.rand(2, 23, dtype=f64) if ref.decay else None
    h_0 = torch.randn(2, 1, ref.state_size, dtype=f64)

    def run(model):
        leaf = x.clone().requires_grad_()
        y, h = model(leaf, h_0=h_0, delta_t=dt, return_state=True)
        (y.sin().sum() + h.square().sum()).backward()
        return [y, h, leaf.grad] + [p.grad for p in model.parameters()]

    with dispatch.using("eager"):
        want = run(ref)
    for a, b in zip(run(m), want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@interpreted
def test_fused_mixer_float32_and_chained_state(triton_mode):
    """DeltaMinGRU(fused=True) in float32 against the float64 eager mixer, with decay, a returned
    state and its chaining: outputs, the state and every weight's gradient."""
    torch.manual_seed(0)
    ref = DeltaMinGRU(6, 16, n_heads=2, nh=2, chunk_size=8, decay="learnable").double()
    m = DeltaMinGRU(6, 16, n_heads=2, nh=2, chunk_size=8, decay="learnable", fused=True)
    m.load_state_dict(ref.state_dict())
    x, dt = torch.randn(2, 19, 6, dtype=f64), torch.rand(2, 19, dtype=f64)

    def run(model, dtype):
        model.zero_grad()
        xs, dts = x.to(dtype), dt.to(dtype)
        y1, s = model(xs[:, :11], delta_t=dts[:, :11], return_state=True)
        y2, h = model(xs[:, 11:], h_0=s, delta_t=dts[:, 11:], return_state=True)
        y = torch.cat([y1, y2], 1)
        (y.sin().sum() + h.square().sum()).backward()
        return [y, h] + [p.grad for p in model.parameters()]

    with dispatch.using("eager"):
        want = run(ref, f64)
    for a, b in zip(run(m, torch.float32), want):
        torch.testing.assert_close(a.double(), b, rtol=2e-4, atol=2e-4 * b.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d_k, d_v", [(16, 16), (64, 32)])
def test_fused_kernels_on_gpu_against_float64(d_k, d_v, monkeypatch):
    """The compiled kernels (tl.dot on tensor cores, where the interpreter computes exactly) in float32:
    decay, DeltaProduct, a start state and a short last chunk, against the float64 recurrence."""
    monkeypatch.setenv("MINGRU_SCAN", "triton")
    inputs = _inputs(2, 150, 3, d_k, d_v, 2, True)
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(2, 150, 3, d_v, generator=g, dtype=f64), torch.randn(2, 3, d_k, d_v, generator=g, dtype=f64)]
    want, want_grads = outputs_and_grads(_call(delta_rule_recurrent), inputs, cot)
    got, got_grads = outputs_and_grads(_call(delta_rule_chunked, chunk_size=64, across="fused"),
                                       [x.float().cuda() for x in inputs], [c.float().cuda() for c in cot])
    for a, b in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=1e-4 * b.abs().max().item())


@interpreted
def test_fused_ops_registered_for_tracers_match_the_fast_path(triton_mode):
    """Eager calls run an autograd.Function over the launchers; torch.compile traces the registered
    ops mingru::delta_rule and mingru::delta_layer (sizes as int inputs, u and the chunk-start states
    as outputs without gradients). Both must give the same values and gradients."""
    from mingru.kernels import delta_rule as fused
    q, k, v, beta, h_0, lg = _inputs(1, 9, 2, 5, 4, 2, True)
    proj = torch.randn(1, 9, 2 * 5 + 2 * 2 * (5 + 4 + 1), dtype=f64)
    cases = [((fused._delta_rule, torch.ops.mingru.delta_rule), [q, k, v, beta, lg, h_0], [4]),
             ((fused._delta_layer, torch.ops.mingru.delta_layer), [proj, lg, h_0], [4, 2, 2, 5, 4])]
    for fns, tensors, sizes in cases:
        results = []
        for fn in fns:
            leaves = [x.detach().clone().requires_grad_() for x in tensors]
            y, h = fn(*leaves, *sizes)[:2]
            grads = torch.autograd.grad((y, h), leaves, (torch.cos(y), torch.sin(h)))
            results.append([y, h, *grads])
        for fast, registered in zip(*results):
            torch.testing.assert_close(fast, registered, rtol=0, atol=0)


AOT_COMPILE = """
import inspect, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mingru.kernels import delta_rule as fused
key = ((2, 100, 2, 3, 32), 32, 64, (1,) * 3, (1,) * 4, (1,) * 4, (1,) * 4, (1,) * 3, False, True, True, True,
       ("ieee", "tf32x3"))  # the precisions `_precisions` picks on a GPU with TF32 tensor cores
forward, backward = fused._plan(*key), fused._backward_plan(key, (1,) * 3, (1,) * 4, (1,) * 4, (1,) * 4, (1,) * 4)
for kernel, args in ((fused._solve_kernel, forward["solve"]), (fused._walk_kernel, forward["walk"]),
                     (fused._readout_kernel, forward["readout"]), (fused._readout_back_kernel, backward["readout"]),
                     (fused._walk_back_kernel, backward["walk"]), (fused._dr_kernel, backward["dr"]),
                     (fused._gradient_kernel, backward["gradient"]), (fused._decay_gradient_kernel, backward["decay"])):
    params = list(inspect.signature(kernel.fn).parameters)
    constexprs = {name: args[name] for name in params if name in args and kernel.params[params.index(name)].is_constexpr}
    signature = {name: "constexpr" if name in constexprs else "i32" if name in args else "*fp32" for name in params}
    triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=args["num_warps"]))
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles and runs them (test_gpu.py)")
def test_fused_kernels_compile_for_a_gpu_without_one():
    """The interpreter runs the kernels' Python, not Triton's compiler: compile all eight for sm_90 in a
    process without TRITON_INTERPRET (frontend, lowering and ptxas; no device needed), with every
    switch on, at d_k = d_v = 32."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", AOT_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode and ("ptxas" in out.stderr or "GPUTarget" in out.stderr or "ASTSource" in out.stderr):
        pytest.skip(f"this Triton cannot compile ahead of time here: {out.stderr.strip().splitlines()[-1]}")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-4000:]


def test_chunk_local_kernels_split_their_dots_only_where_tensor_cores_keep_float32_accuracy(monkeypatch):
    """tf32x3 for the solve and the readouts under the IEEE guard on float32 with TF32 tensor cores
    and keys of at least SPLIT_MIN_DK; IEEE everywhere else (narrower keys, CPU, float64, no tensor
    cores); TF32 everywhere when the guard is lifted."""
    from mingru.kernels import delta_rule as fused
    from mingru.kernels.common import allow_tf32_dots
    wide = fused.SPLIT_MIN_DK
    on = lambda dtype, cuda=True, d_k=wide: SimpleNamespace(  # noqa: E731
        dtype=dtype, is_cuda=cuda, device=torch.device("cuda", 0), shape=(2, 8, 4, d_k))
    monkeypatch.setattr(fused, "_tensor_cores", lambda index: True)
    assert fused._precisions(on(torch.float32)) == ("ieee", "tf32x3")
    assert fused._precisions(on(torch.float32, d_k=wide // 2)) == ("ieee", "ieee")
    assert fused._precisions(on(torch.float64)) == ("ieee", "ieee")
    assert fused._precisions(on(torch.float32, cuda=False)) == ("ieee", "ieee")
    assert fused._precisions(torch.zeros(1, 1, 1, wide)) == ("ieee", "ieee")
    with allow_tf32_dots():
        assert fused._precisions(on(torch.float32)) == ("tf32", "tf32")
    monkeypatch.setattr(fused, "_tensor_cores", lambda index: False)
    assert fused._precisions(on(torch.float32)) == ("ieee", "ieee")


@interpreted
def test_fused_form_declines_states_above_its_tile(triton_mode):
    q, k, v, beta, h_0 = _inputs(1, 3, 1, 72, 4, 1, False)
    with pytest.raises(RuntimeError, match="d_k = 72"):
        delta_rule_chunked(q, k, v, beta, h_0=h_0, across="fused")
    with dispatch.using("auto"):  # auto runs eager on a CPU: the default form
        y, h = delta_rule_chunked(q, k, v, beta, h_0=h_0, across="fused")
    want = delta_rule_recurrent(q, k, v, beta, h_0=h_0)
    for a, b in zip((y, h), want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_fused_by_shape(monkeypatch):
    """fused=None: the fused form for narrow heads and short walks, the default form elsewhere; the
    keyword forces either; forward runs the chosen one."""
    width, steps = delta.AUTO_FUSED_WIDTH, delta.AUTO_FUSED_STEPS
    narrow, wide = DeltaMinGRU(8, 2 * width, n_heads=2), DeltaMinGRU(8, 4 * width, n_heads=2)
    assert narrow.fuses(steps) and not narrow.fuses(steps + 1) and not wide.fuses(1)
    assert not DeltaMinGRU(8, 2 * width, n_heads=2, nh=2).fuses(steps // 2 + 1)
    assert DeltaMinGRU(8, 2 * width, n_heads=2, nh=2).fuses(steps // 2)
    assert DeltaMinGRU(8, 4 * width, n_heads=2, fused=True).fuses(10 * steps)
    assert not DeltaMinGRU(8, 2 * width, n_heads=2, fused=False).fuses(1)
    ran, default = [], delta._layer_default
    monkeypatch.setattr(delta, "delta_layer", lambda *a: ran.append("fused") or default(*a))
    monkeypatch.setattr(delta, "_layer_default", lambda *a: ran.append("default") or default(*a))
    narrow(torch.randn(1, 3, 8))
    narrow(torch.randn(1, steps + 1, 8))
    wide(torch.randn(1, 3, 8))
    assert ran == ["fused", "default", "default"]


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="n_heads"):
        DeltaMinGRU(4, 10, n_heads=4)
    for name in ("n_heads", "nh", "chunk_size"):
        with pytest.raises(ValueError, match=name):
            DeltaMinGRU(4, 8, **{name: 0})
    with pytest.raises(ValueError, match="decay"):
        DeltaMinGRU(4, 8, decay="linear")
    with pytest.raises(TypeError, match="fused must be None"):
        DeltaMinGRU(4, 8, fused="yes")
    m = DeltaMinGRU(4, 8, n_heads=2)
    with pytest.raises(ValueError, match="x must have shape"):
        m(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="h_0 must have shape"):
        m(torch.randn(2, 5, 4), h_0=torch.zeros(2, m.state_size))
    with pytest.raises(ValueError, match="h_prev must have shape"):
        m.step(torch.randn(2, 4), torch.zeros(2, 1, m.state_size))
    with pytest.raises(ValueError, match="delta_t"):
        m(torch.randn(2, 5, 4), delta_t=torch.ones(2, 5))
    with pytest.raises(ValueError, match="delta_t"):
        DeltaMinGRU(4, 8, n_heads=2, decay="fixed")(torch.randn(2, 5, 4))
    q, k, v, beta, h_0 = _inputs(2, 5, 2, 3, 3, 1, False)
    with pytest.raises(ValueError, match="beta must have shape"):
        delta_rule_chunked(q, k, v, beta[..., :1])
    with pytest.raises(ValueError, match="log_gamma must have shape"):
        delta_rule_chunked(q, k, v, beta, log_gamma=torch.zeros(2, 5, 1, dtype=f64))
    with pytest.raises(ValueError, match="chunk_size"):
        delta_rule_chunked(q, k, v, beta, chunk_size=0)
    with pytest.raises(ValueError, match="across"):
        delta_rule_chunked(q, k, v, beta, across="tree")
    with pytest.raises(TypeError, match="q must be a floating-point"):
        delta_rule_chunked(q.long(), k, v, beta)


# --- differential test against mingru-scans 0.2.0 (seedrun.py runs it in its own interpreter) -----

@pytest.mark.parametrize("name", list(seedrun.DELTA_CASES))
def test_matches_seed_from_its_state_dict(seed_results, name):
    seed = seed_results["delta:" + name]
    torch.manual_seed(0)                                   # as the seed's run did
    m = DeltaMinGRU(**seedrun.DELTA_CASES[name])
    for key, value in m.state_dict().items():
        torch.testing.assert_close(value, seed["state_dict"][key], rtol=0, atol=0, msg=key)
    m.load_state_dict(seed["state_dict"], strict=True)
    case = seedrun.delta_inputs(name)
    with pytest.warns(UserWarning, match="delta_t") if case["delta_t"] is not None else contextlib.nullcontext():
        ours = seedrun.run_delta(m, case)
    assert ours.keys() == seed.keys() - {"state_dict"}
    for key, value in ours.items():
        torch.testing.assert_close(value, seed[key], rtol=1e-4, atol=1e-5, msg=key)

