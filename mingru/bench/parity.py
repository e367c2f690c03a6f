"""Parity: every kernel and fused mixer path against the eager reference, outputs and gradients.

Each row runs one subject in float32 or bfloat16 under MINGRU_SCAN=triton and =eager on the same
inputs and cotangents and gates the difference per op family; the float64 sequential loop
(mingru.naive) shows how far each path is from the exact answer.
"""
import itertools
import math
import time

import torch

from mingru.bench import cases, warm
from mingru.bench.progress import Sweep
from mingru.bench.timing import failure, max_err, scan_impl, tolerance_ratio, within

NAME, SUBJECT = "scan_parity", "op"
SKIPPED = "skipped: the kernels need a GPU or TRITON_INTERPRET=1"
from mingru.validate import BLOCK_SIZES as BLOCKS  # noqa: E402

# (outputs (atol, rtol), gradients (atol, rtol), why) per family, for float32 inputs.
FLOAT32_GATES = {
    "affine": ((1e-5, 0.0), (1e-3, 0.0),
               "the gate of mingru-scans 0.2.0: both paths accumulate in float32 and differ only in summation order"),
    "log": ((1e-4, 1e-4), (1e-3, 1e-3),
            "the gate of mingru-scans 0.2.0: the exp/log round trip of the log-space scan costs about a decimal digit"),
    "rotation": ((1e-5, 0.0), (1e-3, 1e-3),
                 "the gate of mingru-scans 0.2.0 for the angle-fused path: cos/sin and 2*rounds Givens layers are formed "
                 "in float32 inside the kernel"),
}
_BF16 = torch.finfo(torch.bfloat16)  # eps: the spacing at 1 (machine epsilon); eps / 2: the unit roundoff
BFLOAT16_GATE = ((1e-2, 1e-2), (5e-2, 5e-2),
                 f"bfloat16 keeps {1 - round(math.log2(_BF16.eps))} significant bits (machine epsilon "
                 f"2^{round(math.log2(_BF16.eps))} = {_BF16.eps:.1e}, unit roundoff "
                 f"2^{round(math.log2(_BF16.eps / 2))} = {_BF16.eps / 2:.1e}); both paths "
                 "accumulate in float32 and round once, so they may differ by about a unit in the last place; "
                 "gradients are normwise (rtol times the tensor's largest entry): they read bf16-rounded saved "
                 "outputs and sum up to T*v rounded products, so their error follows the size of the terms")
MIXER_GRAD = ((1e-3, 1e-3), "weight gradients sum B*T terms, so they are gated normwise (rtol times the "
              "tensor's largest entry)")
MIXER_OUT = ("outputs are normwise too, with rtol at least atol: each state sums many projected terms, so its "
             "rounding follows the outputs' scale (eager_vs_f64 shows the reference's own share)")
ROTATION_STATE = "without decay a rotation state does not damp any step's rounding, so the error grows with T"
ROTATION_MIXERS = ("RotationMinGRU", "GivensMinGRU[fused]", "GivensMinGRU[generic]")
WARM = {"seconds": 0.0}  # time the compile pool spent before the sweep (0: no pool)
# DeltaMinGRU has parity rows only: its kernels (the chunks' triangular solves and inverses, the wide
# matrix_recurrence that chains them; the fused form's kernels) are not scans of their own in the
# speed tables
MIXERS = cases.MIXERS + ("DeltaMinGRU[chunked]", "DeltaMinGRU[fused]")
FAMILY = {"parallel_scan_log": "log", "gated_recurrence": "log", "rotation_recurrence": "rotation", "MinGRU": "log",
          "GivensMinGRU[fused]": "rotation", "RotationMinGRU": "rotation"}


def gate(name, dtype):
    """{'out': (atol, rtol), 'grad': (atol, rtol), 'why': str} for a subject at a dtype."""
    if dtype == torch.bfloat16:
        out, grad, why = BFLOAT16_GATE
    else:
        out, grad, why = FLOAT32_GATES[FAMILY.get(name, "affine")]
        if name in MIXERS:
            out = (out[0], max(out[1], out[0]))
            grad, why = MIXER_GRAD[0], f"{why}; {MIXER_GRAD[1]}; {MIXER_OUT}"
            if name in ROTATION_MIXERS:
                why = f"{why}; {ROTATION_STATE}"
    return {"out": out, "grad": grad, "out_normwise": name in MIXERS and dtype != torch.bfloat16,
            "grad_normwise": dtype == torch.bfloat16 or name in MIXERS, "why": why}


def grid(quick):
    """(subject, dims, dtype) for every row: the envelope in k, v, T (1 and non-powers of two), B, D."""
    f32, bf16 = torch.float32, torch.bfloat16
    if quick:  # one row per code path: the interpreter is slow
        yield "linear_scan", dict(B=1, T=5, D=3), f32
        yield "linear_scan", dict(B=1, T=5, D=3), bf16
        yield "parallel_scan_log", dict(B=1, T=5, D=3), f32
        yield "matrix_affine_scan", dict(B=1, T=3, n=1, k=2, v=2), f32
        yield "rotation_recurrence", dict(B=1, T=3, n=1, k=4, L=2, h0=True), f32
        yield "GivensMinGRU[fused]", dict(B=1, T=3, d=4, k=2, L=1), f32
        return
    # T = 1 and T = 2 once per diagonal op, start state and dtype, T = 1 once per dtype for matrix_scan
    # and matrix_affine_scan (the trivial and the shortest scans); otherwise lengths
    # that cross the tile, segment and power-of-two boundaries, at a single lane, a ragged width and
    # a wide one. Every (k, v) block pair of the matrix kernels appears; each row compiles at most
    # one new variant.
    for dtype in (f32, bf16):
        for op in cases.DIAGONAL:
            h0s = (False, True) if op == "linear_recurrence" else (False,)
            for h0 in h0s:
                for T in (1, 2):
                    yield op, dict(B=2, T=T, D=33, h0=h0), dtype
                for T in (7, 100, 1024, 4099):
                    for B, D in ((1, 1), (2, 33), (3, 257)):
                        yield op, dict(B=B, T=T, D=D, h0=h0), dtype
        yield "matrix_scan", dict(B=2, T=1, n=32), dtype
        for T in (2, 7, 100, 1024):
            for B, n in ((1, 1), (4, 5)):
                yield "matrix_scan", dict(B=B, T=T, n=n), dtype
        yield "matrix_affine_scan", dict(B=2, T=1, n=3, k=2, v=2), dtype
        # float32 covers every (k, v) pair the kernels compile; bfloat16 the pairs v = 1 and v = k,
        # where its rounding differs (the dot and broadcast paths): a variant compiled is a row's cost
        for k in BLOCKS:
            for v in BLOCKS if dtype == f32 else sorted({1, k}):
                for T in (33, 300):
                    yield "matrix_affine_scan", dict(B=3, T=T, n=5, k=k, v=v), dtype
            for v in (1, 4, 16) if dtype == f32 else sorted({1, k} & {1, 4, 16}):
                for T, h0 in ((33, False), (300, True)):
                    yield "matrix_recurrence", dict(B=2, T=T, n=3, k=k, v=v, h0=h0), dtype
        # the wide kernel (k, v in 32, 64: one lane per program, a tl.dot a step)
        for k, v, T, h0 in ((32, 32, 5, True), (64, 64, 33, False), (64, 32, 17, True), (32, 64, 9, False)):
            if dtype == f32 or k == v == 64:
                yield "matrix_recurrence", dict(B=2, T=T, n=3, k=k, v=v, h0=h0), dtype
        for k in (2, 4, 8, 16):
            for L in (1, 3):
                for T, h0 in ((33, False), (300, True)):
                    yield "rotation_recurrence", dict(B=2, T=T, n=3, k=k, L=L, h0=h0), dtype
        # with a scale of the odd components: RotationMinGRU's k = 2, one layer, and a wider block
        for k, L, T, h0 in ((2, 1, 33, True), (2, 1, 300, False), (8, 3, 33, True)):
            yield "rotation_recurrence", dict(B=2, T=T, n=3, k=k, L=L, h0=h0, scale=True), dtype
        for mixer in cases.MIXERS:
            for B, T in ((2, 33), (2, 300)):
                yield mixer, dict(B=B, T=T, d=32, k=8), dtype
        # 4 heads: d_k = 8 chains on the narrow matrix kernel, d_k = 32 on the wide one; T = 33 is
        # one chunk (carried: the triangular inverse kernel against eager solves), T = 300 five
        for T, d in ((33, 128), (300, 32), (300, 128)):
            yield "DeltaMinGRU[chunked]", dict(B=2, T=T, d=d), dtype
        # the fused form (its kernels run the whole rule): one chunk, and five with d_k = 8 and 32
        for T, d in ((33, 128), (300, 32), (300, 128)):
            yield "DeltaMinGRU[fused]", dict(B=2, T=T, d=d), dtype


def check(name, dims, dtype, device):
    """One parity row: errors of triton against eager (gated) and of both against float64."""
    job = cases.make(name, dims, dtype, device).requiring_grad()
    g = gate(name, dtype)
    row = {"op": name, "dims": cases.label(dims), "T": dims["T"], "dtype": str(dtype).replace("torch.", ""),
           "out_gate": "{:g}/{:g}".format(*g["out"]) + (" normwise" if g["out_normwise"] else ""),
           "grad_gate": "{:g}/{:g}".format(*g["grad"]) + (" normwise" if g["grad_normwise"] else "")}
    with scan_impl("eager"):
        want = cases.outputs(job.fn, job.inputs)
        cot = cases.cotangents_for(want)
        want_grads = torch.autograd.grad(want, job.leaves, cot, allow_unused=True)
    try:
        with scan_impl("triton"):
            got, got_grads = cases.forward_backward(job, cot)
    except Exception as err:  # noqa: BLE001  (a kernel that declines or crashes becomes a row)
        return {**row, "pass": None, "status": failure(err)}
    row.update(out_err=max_err(got, want), grad_err=max_err(got_grads, want_grads),
               out_ratio=tolerance_ratio(got, want, *g["out"], normwise=g["out_normwise"]),
               grad_ratio=tolerance_ratio(got_grads, want_grads, *g["grad"], normwise=g["grad_normwise"]))
    reference = cases.naive_fn(name)
    if reference is not None or name in MIXERS:  # a mixer: the same module in float64, eager
        f64 = job.in_float64()
        with torch.no_grad(), scan_impl("eager"):
            exact = cases.outputs(f64.fn if reference is None else reference, f64.inputs)
        row.update(triton_vs_f64=max_err(got, exact), eager_vs_f64=max_err(want, exact))
    row["pass"] = (within(got, want, *g["out"], normwise=g["out_normwise"])
                   and within(got_grads, want_grads, *g["grad"], normwise=g["grad_normwise"]))
    row["status"] = "ok"
    return row


def compile_case(name, dims, dtype, device):
    """Run one row's kernels forward and backward once (no reference): what the compile pool needs."""
    job = cases.make(name, dims, dtype, device).requiring_grad()
    with scan_impl("triton"):
        outs = cases.outputs(job.fn, job.inputs)
        torch.autograd.grad(outs, job.leaves, cases.cotangents_for(outs), allow_unused=True)


def _todo(device, quick, env, keep):
    return [c for c in grid(quick) if keep(c[0])] if cases.kernels_run(device, env) else []


def compile_plan(device, quick, env, keep=lambda name: True):
    """[(target, cases)] that the compile pool runs once before the sweep: every row's kernels,
    dealt round-robin over (subject, dtype). Rows of one subject often share a compiled variant;
    dealt one after another they would start side by side in several workers, each compiling it,
    where spread out the later ones load it from the cache."""
    groups = {}
    for c in _todo(device, quick, env, keep):
        groups.setdefault((c[0], c[2]), []).append((*c, device))
    return [("mingru.bench.parity:compile_case",
             [c for turn in itertools.zip_longest(*groups.values()) for c in turn if c is not None])]


def measure(device, quick, env, keep=lambda name: True):
    cases_ = _todo(device, quick, env, keep)
    WARM["seconds"] = warm.warm_plans(compile_plan(device, quick, env, keep), warm.default_workers(device))
    rows = []
    for name, dims, dtype in Sweep("parity", cases_, lambda c: f"{c[0]} {cases.label(c[1])} {c[2]}"):
        start = time.monotonic()
        rows.append(check(name, dims, dtype, device))
        rows[-1]["seconds"] = round(time.monotonic() - start, 3)  # where a sweep's time goes (compiles included)
    if not cases_:
        rows.append({"op": "all", "pass": None, "status": SKIPPED})
    return rows


def summarize(rows, env):
    passed = sum(r.get("pass") is True for r in rows)
    failed = sum(r.get("pass") is False for r in rows)
    gates = {f"{family} float32": {"out": out, "grad": grad, "why": why}
             for family, (out, grad, why) in FLOAT32_GATES.items()}
    gates["all bfloat16"] = dict(zip(("out", "grad", "why"), BFLOAT16_GATE))
    gates["mixer gradients float32"] = {"grad": MIXER_GRAD[0], "why": MIXER_GRAD[1]}
    gates["mixer outputs float32"] = {"out": "family gate, normwise, rtol >= atol", "why": MIXER_OUT}
    gates["rotation mixers float32"] = {"why": ROTATION_STATE}
    return {
        "summary": {"rows": len(rows), "passed": passed, "failed": failed,
                    "not_run": len(rows) - passed - failed},
        "tolerances": gates,
        "method": ("triton vs eager on the same inputs and random cotangents; pass when "
                   "|triton - eager| <= atol + rtol |eager| for every output and every gradient "
                   "(inputs and module parameters); *_vs_f64: outputs against the float64 "
                   "sequential loop of mingru.naive"),
        "columns": ["op", "dims", "dtype", "out_err", "grad_err", "out_ratio", "grad_ratio", "triton_vs_f64", "eager_vs_f64",
                    "out_gate", "grad_gate", "pass", "status"],
        "compile_pool_s": WARM["seconds"],
        "notes": [f"{passed} of {len(rows)} rows pass, {failed} fail, "
                  f"{len(rows) - passed - failed} did not run (see status)",
                  "gates are atol/rtol; " + "; ".join(f"{k}: {v['why']}" for k, v in gates.items())],
    }
