"""Roofline: achieved GB/s of the diagonal Triton kernels against this run's copy bandwidth.

Bytes are the minimum any implementation must move (`cases.least_bytes`).
"""
import torch

from mingru.bench import cases
from mingru.bench.parity import SKIPPED, gate
from mingru.bench.progress import Sweep
from mingru.bench.timing import agrees, failure, flushed_us, kernel_us, scan_impl, wrong

NAME, SUBJECT = "roofline", "op"
# The peers' long shapes and the two long-T targets (B*D = 2048 at T = 16384, B*D = 256 at T = 65536);
# the seed's shapes (B128 T64, B16 T1024 at D = 64) are timed once, by the speed harness.
NAMED = ((16, 1024, 1024), (8, 4096, 2048), (2, 16384, 1024), (1, 65536, 256))
QUICK, QUICK_OPS = ((1, 8, 4), (1, 32, 4)), ("linear_recurrence",)  # the interpreter is slow


def grid(quick):
    """(B, T, D): T from 256 to 16384 at B*D from 1K to 64K (at most 2^26 elements), plus NAMED."""
    if quick:
        return list(QUICK)
    shapes = set(NAMED)
    for T in (256, 1024, 4096, 16384):
        for BD in (2**10, 2**12, 2**14, 2**16):
            if BD * T <= 2**26:
                D = min(BD, 1024)
                shapes.add((BD // D, T, D))
    return sorted(shapes, key=lambda s: (s[0] * s[2], s[1]))


def point(op, B, T, D, direction, device, copy_gbps, quick):
    job = cases.make(op, {"B": B, "T": T, "D": D}, torch.float32, device)
    run = job if direction == "fwd" else job.requiring_grad()
    g = gate(op, torch.float32)
    row = {"op": op, "B": B, "T": T, "D": D, "BD": B * D, "direction": direction}
    inputs = [x for x in job.inputs if x is not None]
    with torch.no_grad(), scan_impl("eager"):
        outs = cases.outputs(job.fn, job.inputs)
    cot = None if direction == "fwd" else cases.cotangents_for(outs)
    row["bytes"] = cases.least_bytes(cases.nbytes(inputs), cases.nbytes(outs), direction)
    status = "ok"
    try:
        with scan_impl("triton"):
            got = cases.forward(run) if cot is None else cases.forward_backward(run, cot)
        try:
            with scan_impl("eager"):
                want = cases.forward(run) if cot is None else cases.forward_backward(run, cot)
            ok, err = agrees(got, want, g)
            if not ok:
                return {**row, "us": None, "status": wrong(err, "eager")}
        except torch.cuda.OutOfMemoryError:
            # The eager reference keeps every step of its chunked scan (and dense transitions) for its backward.
            torch.cuda.empty_cache()
            status = "ok (unchecked: the eager reference ran out of memory)"
        got = want = None  # free both before timing
        with scan_impl("triton"):
            us = flushed_us(lambda: cases.step(run, cot), device, run.leaves if cot else (), 1 if quick else 3)
            gus = kernel_us(lambda: cases.step(run, cot), device, run.leaves if cot else ())
    except Exception as exc:  # noqa: BLE001  (a declined or crashed kernel becomes a row)
        return {**row, "us": None, "status": failure(exc)}
    gbps = row["bytes"] / us / 1e3
    gpu_gbps = row["bytes"] / gus / 1e3 if gus else None
    return {**row, "us": us, "gbps": gbps, "pct_copy": 100 * gbps / copy_gbps, "gpu_us": gus,
            "gpu_gbps": gpu_gbps, "gpu_pct_copy": gpu_gbps and 100 * gpu_gbps / copy_gbps,
            "status": status}


def measure(device, quick, env, keep=lambda name: True):
    ops = [op for op in (QUICK_OPS if quick else cases.DIAGONAL) if keep(op)]
    runnable = cases.kernels_run(device, env)
    todo = [(op, *shape, direction) for shape in grid(quick) for op in ops for direction in ("fwd", "fwd+bwd")]
    rows = []
    for op, B, T, D, direction in Sweep("roofline", todo if runnable else (), lambda c: f"{c[0]} B{c[1]}-T{c[2]}-D{c[3]} {c[4]}"):
        rows.append(point(op, B, T, D, direction, device, env["copy_gbps"], quick))
    if not runnable:
        rows.append({"op": "all", "status": SKIPPED})
    return rows


def summarize(rows, env):
    return {
        "copy_gbps": env["copy_gbps"],
        "bytes_method": "fwd: inputs read once + outputs written once; fwd+bwd adds cotangents "
                        "read + inputs read + input gradients written once (3 in + 2 out), float32",
        "columns": ["op", "B", "T", "D", "direction", "us", "gbps", "pct_copy", "gpu_us", "gpu_gbps",
                    "gpu_pct_copy", "status"],
        "notes": [f"copy bandwidth measured in this run: {env['copy_gbps']:.0f} GB/s "
                  f"({env['copy_method']})",
                  "bytes: fwd = inputs + outputs; fwd+bwd = 3 x inputs + 2 x outputs (the minimum "
                  "any implementation must move)",
                  "us: one call behind an L2 flush (timing.flushed_us), inputs read from HBM; gpu_us: the "
                  "kernels' own time from a torch.profiler trace (inputs warm in L2)"],
    }
