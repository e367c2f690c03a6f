"""Peers: the gated diagonal recurrence h_t = exp(g_t) h_{t-1} + x_t in other libraries and ours,
and the delta rule of DeltaMinGRU (one micro-step per token) against flash-linear-attention's.

flash-linear-attention's HGRN kernels take (x, g) laid out (B, T, D) with a start state;
accelerated-scan's Triton scan takes (gates, tokens) laid out (B, D, T) and starts from zero.
fla's chunk_delta_rule takes (q, k, v, beta) laid out (B, T, heads, width) as our
`delta_rule_chunked` does; it is called with scale 1 (our readout has no scale), k L2-normalized
as DeltaMinGRU normalizes it.
Each competitor gets its own natural inputs, prepared outside the timed region, and is checked
against a float64 reference before it is timed: the eager scan run in float64 (tests hold it to the
float64 sequential loop, which at long T is too slow to run per competitor and shape).
A missing library is a row, not a gap. Wall clock and GPU clock (kernel durations from a profiler
trace) are both recorded; the goal is ours faster by GPU clock.
"""
import importlib

import torch
import torch.nn.functional as F

import mingru
from mingru import scans
from mingru.bench import cases, places
from mingru.bench.parity import SKIPPED
from mingru.bench.progress import Sweep
from mingru.bench.timing import check_then_time, failure, gate, scan_impl
from mingru.bench.warm import context_fault
from mingru.delta import delta_rule_chunked

NAME, SUBJECT = "peers", "competitor"
SHAPES = ((128, 64, 64), (16, 1024, 64), (16, 1024, 1024), (8, 4096, 2048), (2, 16384, 1024))
QUICK_SHAPES = ((1, 8, 4),)
GATE = (1e-4, 1e-4)  # float32 against the float64 loop, outputs and gradients
DELTA_GATE = gate((2e-2, 2e-2), (5e-2, 5e-2), True, True,
                  "delta rule in bfloat16 (fla's chunk_delta_rule refuses float32), against float64 on the same "
                  "rounded inputs, normwise: bfloat16 outputs carry 8 significant bits")
GOAL = "ours faster by GPU clock"
OURS = ("mingru.linear_recurrence", "mingru.parallel_scan_log", "mingru.delta_rule_chunked",
        "mingru.delta_rule_chunked[fused]")
# (B, T, heads, head width): DeltaMinGRU(256, 256) with its default 4 heads, at two layer shapes
DELTA_SHAPES = ((16, 1024, 4, 64), (4, 4096, 4, 64))
QUICK_DELTA_SHAPES = ((1, 8, 2, 4),)


def _find(*candidates):
    """The first importable (module, attribute), or (None, why) — 'not installed' when absent."""
    why = "not installed"
    for module, attr in candidates:
        try:
            return getattr(importlib.import_module(module), attr), None
        except ModuleNotFoundError as err:
            if err.name and err.name.split(".")[0] != module.split(".")[0]:
                why = f"import failed: {err}"
        except Exception as err:  # noqa: BLE001  (a broken peer install is reported, not raised)
            why = f"import failed: {type(err).__name__}: {err}"
    return None, why


ACCELERATED_BLOCK = 2048  # accelerated-scan's scalar kernels' default BLOCK (time steps a program takes at once)


def _accelerated(module):
    """accelerated-scan's scan as published (its forward_scan and backward_scan kernels, the same
    launches), through an autograd Function of ours whose states buffer has ACCELERATED_BLOCK
    elements of room past its end. Their backward_scan loads states[t - 1] for a whole block of t,
    masked by t > 0 alone, so when T is not a multiple of the block the last sequence reads up to
    ACCELERATED_BLOCK - 1 elements past the buffer: unused values, but an illegal address whenever
    the buffer ends where the allocator's memory does. The room changes no value and no launch."""
    if module is None:
        return None
    forward_scan, backward_scan = module.forward_scan, module.backward_scan

    class Scan(torch.autograd.Function):
        @staticmethod
        def forward(ctx, forget, inputs):
            if not (forget.is_contiguous() and inputs.is_contiguous() and forget.shape == inputs.shape):
                raise ValueError("accelerated-scan takes contiguous gates and tokens of one shape (B, D, T)")
            B, C, T = forget.shape
            states = inputs.new_empty(inputs.numel() + ACCELERATED_BLOCK)[:inputs.numel()].view(B, C, T)
            forward_scan[(B, C)](forget, inputs, states, seqlen=T, enable_fp_fusion=False)
            ctx.save_for_backward(forget, states)
            return states

        @staticmethod
        def backward(ctx, d_output):
            forget, states = ctx.saved_tensors
            B, C, T = forget.shape
            d_forget, d_inputs = torch.empty_like(forget), torch.empty_like(forget)
            backward_scan[(B, C)](forget, states, d_output.contiguous(), d_inputs, d_forget, seqlen=T,
                                  enable_fp_fusion=False)
            return d_forget, d_inputs

    return Scan.apply


def _hgrn(kernel):
    return None if kernel is None else (lambda x, g, h0: kernel(x, g, initial_state=h0)[0])


def competitors():
    """name -> (fn, prepare(g, x, h0) -> inputs, their names, float64 reference, why missing)."""
    for folder in ("fla-core", "accelerated-scan"):
        places.peer_on_path(folder)
    fused, why_fla = _find(("fla.ops.hgrn", "fused_recurrent_hgrn"))
    chunk, _ = _find(("fla.ops.hgrn", "chunk_hgrn"))
    kernel, why_acc = _find(("accelerated_scan.scalar", "backward_scan"))
    scan = _accelerated(kernel and importlib.import_module("accelerated_scan.scalar"))
    bdt = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    fla_ref = lambda x, g, h0: scans.linear_recurrence(g.exp(), x, h0)  # noqa: E731
    return {
        "mingru.linear_recurrence": (mingru.linear_recurrence, lambda g, x, h0: (g.exp(), x, h0),
                                     ("a", "b", "h0"), scans.linear_recurrence, None),
        "mingru.parallel_scan_log": (mingru.parallel_scan_log,
                                     lambda g, x, h0: (g, torch.cat([h0.log()[:, None], x.log()], 1)),
                                     ("log_coeffs", "log_values"), scans.parallel_scan_log, None),
        "fla.fused_recurrent_hgrn": (_hgrn(fused), lambda g, x, h0: (x, g, h0), ("x", "g", "h0"),
                                     fla_ref, why_fla),
        "fla.chunk_hgrn": (_hgrn(chunk), lambda g, x, h0: (x, g, h0), ("x", "g", "h0"), fla_ref, why_fla),
        "accelerated_scan": (scan, lambda g, x, h0: (bdt(g.exp()), bdt(x)), ("gates", "tokens"),
                             lambda f, i: bdt(scans.linear_recurrence(bdt(f), bdt(i))), why_acc),
        # what a caller holding (B, T, D) tensors, like our mixers, pays: the transposes in and out
        "accelerated_scan (B,T,D)": (scan and (lambda f, i: bdt(scan(bdt(f), bdt(i)))),
                                     lambda g, x, h0: (g.exp(), x), ("gates", "tokens"),
                                     scans.linear_recurrence, why_acc),
    }


def delta_competitors():
    """name -> (fn(q, k, v, beta) -> outputs, why missing): the delta rule at nh = 1, no decay, no h_0."""
    places.peer_on_path("fla-core")
    chunk, why = _find(("fla.ops.delta_rule", "chunk_delta_rule"))
    return {"mingru.delta_rule_chunked": (lambda q, k, v, beta: delta_rule_chunked(q, k, v, beta)[0], None),
            "mingru.delta_rule_chunked[fused]": (
                lambda q, k, v, beta: delta_rule_chunked(q, k, v, beta, across="fused")[0], None),
            "fla.chunk_delta_rule": (chunk and (lambda q, k, v, beta: chunk(q, k, v, beta, scale=1.0)[0]), why)}


def race_delta(name, entry, B, T, H, d, device, quick, runnable):
    """Rows (fwd, fwd+bwd) of one delta-rule competitor; D = H * d. Reference: our chunked delta
    rule in float64 (the tests hold it to the token-by-token oracle)."""
    fn, why = entry
    rows = _rows(name, (B, T, H, d), True)
    if fn is None or not runnable:
        return [{**r, "us": None, "status": why or SKIPPED} for r in rows]
    q, v = torch.randn(B, T, H, d, device=device), torch.randn(B, T, H, d, device=device)
    k = F.normalize(torch.randn(B, T, H, d, device=device), dim=-1)
    beta = torch.sigmoid(torch.randn(B, T, H, device=device))
    job = cases.Job(name, fn, tuple(t.bfloat16() for t in (q, k, v, beta))).requiring_grad()
    reference = lambda *xs: delta_rule_chunked(*xs)[0]  # noqa: E731
    exact = cases.Job(name, reference, tuple(t.detach().double() for t in job.inputs)).requiring_grad()
    return _timed(rows, job, exact, ("q", "k", "v", "beta"), device, quick, DELTA_GATE)


def race(name, entry, B, T, D, device, quick, runnable):
    """Rows (fwd, fwd+bwd) of one competitor at one shape."""
    fn, prepare, names, reference, why = entry
    rows = _rows(name, (B, T, D), False)
    if fn is None:
        return [{**r, "us": None, "status": why} for r in rows]
    if not runnable:
        return [{**r, "us": None, "status": SKIPPED} for r in rows]
    g = -F.softplus(torch.randn(B, T, D, device=device))
    x, h0 = F.softplus(torch.randn(B, T, D, device=device)), F.softplus(torch.randn(B, D, device=device))
    job = cases.Job(name, fn, prepare(g, x, h0)).requiring_grad()
    exact = cases.Job(name, reference, tuple(t.detach().double() for t in job.inputs)).requiring_grad()
    return _timed(rows, job, exact, names, device, quick, gate(GATE, GATE))


def _timed(rows, job, exact, names, device, quick, tol):
    """Check `job` against the float64 `exact` (outputs, and gradients of random cotangents), then time
    it: one row per direction."""
    want_out = cases.outputs(exact.fn, exact.inputs)
    dtype = job.inputs[0].dtype
    # the cotangents are rounded to the job's dtype before the reference uses them: both sides get the same
    cot = tuple(c.to(dtype).to(c.dtype) for c in cases.cotangents_for(want_out))
    want_grads = torch.autograd.grad(want_out, exact.leaves, cot)
    cot = tuple(c.to(dtype) for c in cot)
    out = []
    for row, direction in zip(rows, ("fwd", "fwd+bwd")):
        c = None if direction == "fwd" else cot
        with scan_impl("triton"):
            if c is None:
                compute, want, skip = (lambda: (cases.forward(job)[0], ())), (want_out, ()), []
            else:
                try:
                    first = cases.forward_backward(job, c)
                except Exception as exc:  # noqa: BLE001  (a peer that rejects a shape is a row)
                    out.append({**row, "us": None, "gpu_us": None, "err": None, "status": failure(exc)})
                    continue
                # A peer may not differentiate some input (chunk_hgrn: h0): say so, compare the rest.
                skip = [i for i, gr in enumerate(first[1]) if gr is None]
                kept = lambda grads: tuple(gr for i, gr in enumerate(grads) if i not in skip)  # noqa: E731
                compute, want = (lambda: (first[0], kept(first[1]))), (want_out, kept(want_grads))
            got = check_then_time(compute, want, tol, lambda: cases.step(job, c), device,
                                  job.leaves if c else (), 1 if quick else 3, against="float64")
        if got["status"] == "ok" and skip:
            got["status"] = f"ok (no gradient for {', '.join(names[i] for i in skip)})"
        out.append({**row, **got})
    return out


def warm_race(name, shape, device, quick):
    """One competitor's rows by name (what the compile pool's workers receive: names pickle)."""
    delta = delta_competitors()
    if name in delta:
        race_delta(name, delta[name], *shape, device, quick, True)
    else:
        race(name, competitors()[name], *shape, device, quick, True)


def _todo(quick, keep):
    """(name, shape, delta?) of every row pair: the diagonal peers at SHAPES, the delta rule at DELTA_SHAPES."""
    diagonal = [(n, s, False) for s in (QUICK_SHAPES if quick else SHAPES) for n in competitors() if keep(n)]
    return diagonal + [(n, s, True) for s in (QUICK_DELTA_SHAPES if quick else DELTA_SHAPES)
                       for n in delta_competitors() if keep(n)]


def compile_plan(device, quick, env, keep=lambda name: True):
    """[(target, cases)] that the compile pool runs once before the sweep: every peer's kernels
    (fla autotunes its block sizes on first use)."""
    if not cases.kernels_run(device, env):
        return [("mingru.bench.peers:warm_race", [])]
    present = {k for k, v in {**competitors(), **delta_competitors()}.items() if v[0] is not None}
    return [("mingru.bench.peers:warm_race", [(n, s, device, quick) for n, s, _ in _todo(quick, keep) if n in present])]


def _rows(name, shape, is_delta):
    """The (fwd, fwd+bwd) rows of one competitor at one shape, before anything is measured."""
    B, T = shape[:2]
    D, dtype = (shape[2] * shape[3], "bfloat16") if is_delta else (shape[2], "float32")
    return [{"competitor": name, "B": B, "T": T, "D": D, "dtype": dtype, "direction": d} for d in ("fwd", "fwd+bwd")]


def measure(device, quick, env, keep=lambda name: True):
    """Every row pair of _todo. A CUDA error ends the measuring: the case where it surfaced and every
    later one become rows saying so, and the rows measured before it are kept."""
    entries, delta = competitors(), delta_competitors()
    runnable = cases.kernels_run(device, env)
    rows, fault = [], None
    for name, shape, is_delta in Sweep("peers", _todo(quick, keep),
                                       lambda c: f"{c[0]} " + "-".join(map(str, c[1]))):
        if fault:
            rows += [{**r, "us": None, "status": fault} for r in _rows(name, shape, is_delta)]
            continue
        try:
            if is_delta:
                rows += race_delta(name, delta[name], *shape, device, quick, runnable)
            else:
                rows += race(name, entries[name], *shape, device, quick, runnable)
        except Exception as exc:  # noqa: BLE001  (only a CUDA error is turned into rows)
            if not context_fault(exc):
                raise
            rows += [{**r, "us": None, "status": failure(exc)} for r in _rows(name, shape, is_delta)]
            case = f"{name} " + "-".join(map(str, shape))
            fault = f"not run: a CUDA error surfaced at {case} (possibly from the case before it)"
    return rows


def summarize(rows, env):
    losses = _compare(rows)
    not_run = sum(1 for r in rows if str(r.get("status", "")).startswith("not run"))
    return {
        "gate": {"out_and_grad": GATE, "why": "float32 against the eager scan in float64"},
        "goal": GOAL,
        "columns": ["competitor", "B", "T", "D", "dtype", "direction", "us", "gpu_us", "ours_x", "ours_gpu_x",
                    "meets_goal", "err", "status"],
        "losses": losses,
        "notes": ["us: wall clock per call in a loop of calls (median, host included); gpu_us: the kernels' own time "
                  "from a torch.profiler trace",
                  "ours_x / ours_gpu_x = this competitor's time / our fastest op's time at the same shape and "
                  "direction, by wall and by GPU clock (above 1: we are faster)",
                  f"meets_goal ({GOAL}): ours_gpu_x > 1 on a peer's row; — where either side was not measured",
                  "accelerated_scan takes (B, D, T) inputs; 'accelerated_scan (B,T,D)' adds the transposes "
                  "a caller holding (B, T, D) tensors pays",
                  "accelerated_scan runs its own two Triton kernels with their launches, through an autograd "
                  f"Function that allocates its states buffer with {ACCELERATED_BLOCK} elements of room: its "
                  "backward reads past that buffer (unused values) when T is not a multiple of its block",
                  "delta-rule rows (mingru.delta_rule_chunked in its default and its fused form, fla.chunk_delta_rule): "
                  "D = heads x head width, "
                  f"heads {DELTA_SHAPES[0][2]}, one micro-step per token (nh = 1), no decay; gate: {DELTA_GATE['why']}",
                  "rows where a peer beats us by GPU clock: " + ("; ".join(losses) or "none"),
                  f"rows not run after a CUDA error in this process: {not_run}"],
    }


def _compare(rows):
    best = {}
    for r in rows:
        if r["competitor"] in OURS:
            key = (r["B"], r["T"], r["D"], r["direction"])
            for clock in ("us", "gpu_us"):
                if r.get(clock):
                    best[key, clock] = min(best.get((key, clock), r[clock]), r[clock])
    losses = []
    for r in rows:
        key = (r["B"], r["T"], r["D"], r["direction"])
        for clock, ratio in (("us", "ours_x"), ("gpu_us", "ours_gpu_x")):
            ours = best.get((key, clock))
            r[ratio] = r[clock] / ours if ours and r.get(clock) else None
        peer = r["competitor"] not in OURS
        r["meets_goal"] = None if not peer or r["ours_gpu_x"] is None else r["ours_gpu_x"] > 1
        if r["meets_goal"] is False:
            losses.append(f"{r['competitor']} B{r['B']}-T{r['T']}-D{r['D']} {r['direction']}: "
                          f"{1 / r['ours_gpu_x']:.2f}x faster than ours by GPU clock")
    return losses
