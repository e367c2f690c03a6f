"""Speed: each op and mixer x {eager, torch.compile(eager), triton} x {fwd, fwd+bwd} x the seed's shapes.

All competitors of a row run in this process on the same fresh inputs; each is checked against
eager (the parity gates) before it is timed, and a competitor that fails, declines or disagrees
is a status, never a number. One that disagrees with eager is judged again against the same job
in float64 (eager): over long sequences eager float32's own rounding can exceed the gate, and then
the competitor closer to the exact answer is not the wrong one. Its row names the reference it
passed (`checked_against`).
"""
import torch

from mingru.bench import cases, warm
from mingru.bench.parity import SKIPPED, gate
from mingru.bench.progress import Sweep
from mingru.bench.timing import check_then_time, median_us, scan_impl

NAME, SUBJECT = "scan_bench", "op"
WARM = {"seconds": 0.0}  # time the compile pool spent before the sweep (0: no pool)
SHAPES = {"lab": (128, 64), "long-T": (16, 1024)}
QUICK_SHAPES = {"lab": (2, 8)}
WIDTH, QUICK_WIDTH = 64, 8
# --quick runs one subject per code path (diagonal op, matrix op, fused and generic mixer):
# every subject goes through the same functions, and the interpreter is slow.
QUICK_SUBJECTS = ("linear_scan", "matrix_affine_scan", "GivensMinGRU[fused]", "GivensMinGRU[generic]")
DIRECTIONS = ("fwd", "fwd+bwd")
# torch.compile is measured on the seed's four ops at the lab shape: inductor spends seconds per
# subject and direction, which the run's time budget cannot spend on every mixer and shape.
COMPILED = ("linear_scan", "parallel_scan_log", "matrix_scan", "matrix_affine_scan")
COMPILED_SHAPE = "lab"
NOT_COMPILED = "not measured (the compile baseline covers the seed's four ops at the lab shape)"


def subjects(width, k=8, layers=3):
    """The seed's ops at hidden width `width` (n = width / k blocks), the states-only ops, the mixers.

    k and layers are GivensMinGRU's (k=8, rounds=3); --quick shrinks them to keep the interpreter fast.
    """
    yield "linear_scan", dict(D=width)
    yield "linear_recurrence", dict(D=width)
    yield "parallel_scan_log", dict(D=width)
    yield "gated_recurrence", dict(D=width)                          # MinGRU's path
    yield "matrix_scan", dict(n=width // 2)
    yield "matrix_affine_scan", dict(n=width // k, k=k, v=1)
    yield "matrix_recurrence", dict(n=width // k, k=k, v=1)        # GivensMinGRU's generic path
    yield "rotation_recurrence", dict(n=width // k, k=k, L=layers)  # GivensMinGRU's fused path
    for mixer in cases.MIXERS:
        yield mixer, dict(d=width, k=k, L=layers) if mixer.startswith("Givens") else dict(d=width)


def _compiled(fn, backend):
    # A fresh dynamo cache per subject: every compiled op shares few code objects, and hitting
    # the recompile limit would silently run eager.
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend)


def competitor(job, fn, cot, want, g, mode, device, reps, gpu_time=False):
    """fn checked against eager's (outputs, grads), then timed under MINGRU_SCAN=mode; if it
    disagrees, checked against float64 instead (`exact`). 'checked_against' names the reference."""
    def judge(want, against):
        with scan_impl(mode):
            compute = (lambda: cases.forward(job, fn)) if cot is None else (lambda: cases.forward_backward(job, cot, fn))
            got = check_then_time(compute, want, g, lambda: cases.step(job, cot, fn), device,
                                  job.leaves if cot is not None else (), reps, gpu_time, against=against)
        return {**got, "checked_against": against}
    got = judge(want, "eager")
    return judge(exact(job, cot), "float64") if got["status"].startswith("wrong") else got


def exact(job, cot):
    """(outputs, grads) of the job in float64, eager: the reference when float32 paths disagree."""
    ref = job.in_float64()
    with scan_impl("eager"):
        if cot is None:
            return cases.forward(ref)
        return cases.forward_backward(ref, tuple(c.double() for c in cot))


def measure_subject(name, dims, shape, device, quick, env, backend):
    job = cases.make(name, dims, torch.float32, device)
    g = gate(name, torch.float32)
    compiled = _compiled(job.fn, backend) if (name in COMPILED and shape == COMPILED_SHAPE) or quick else None
    reps = 1 if quick else 3
    triton_ok = cases.kernels_run(device, env)
    rows = []
    for direction in DIRECTIONS:
        run = job if direction == "fwd" else job.requiring_grad()
        with scan_impl("eager"):
            if direction == "fwd":
                want, cot = cases.forward(run), None
            else:
                outs = cases.outputs(run.fn, run.inputs)
                cot = cases.cotangents_for(outs)
                want = cases.forward_backward(run, cot)
            eager_us = median_us(lambda: cases.step(run, cot), device, run.leaves if cot else (), reps)
        row = {"op": name, "shape": shape, "dims": cases.label(dims), "B": dims["B"], "T": dims["T"],
               "direction": direction, "dtype": "float32", "eager_us": eager_us}
        if compiled is None:
            row["compile_us"], compile_status = None, NOT_COMPILED
        else:
            got = competitor(run, compiled, cot, want, g, "eager", device, reps)
            row["compile_us"], compile_status = got["us"], got["status"]
            row["compile_checked_against"] = got["checked_against"]
        if triton_ok:
            got = competitor(run, run.fn, cot, want, g, "triton", device, reps, gpu_time=True)
            row["triton_us"], row["triton_gpu_us"], row["triton_err"], triton_status = (
                got["us"], got["gpu_us"], got["err"], got["status"])
            row["triton_checked_against"] = got["checked_against"]
        else:
            row["triton_us"], row["triton_gpu_us"], triton_status = None, None, SKIPPED
        row["compile_x"] = _ratio(eager_us, row["compile_us"])
        row["triton_x"] = _ratio(eager_us, row["triton_us"])
        row["triton_vs_compile"] = _ratio(row["compile_us"], row["triton_us"])
        bad = [f"{who} {s}" for who, s in (("compile", compile_status), ("triton", triton_status))
               if s not in ("ok", NOT_COMPILED)]
        row["status"] = "; ".join(bad) or "ok"
        rows.append(row)
    return rows


def _ratio(a, b):
    return a / b if a and b else None


def compile_backend(device):
    # Inductor on the GPU; on the CPU smoke run only dynamo's tracing (inductor's C++ build is slow).
    return "inductor" if torch.device(device).type == "cuda" else "eager"


def _todo(quick, keep):
    shapes, width, k, layers = (QUICK_SHAPES, QUICK_WIDTH, 4, 2) if quick else (SHAPES, WIDTH, 8, 3)
    return [(name, {"B": B, "T": T, **dims}, shape) for shape, (B, T) in shapes.items()
            for name, dims in subjects(width, k, layers)
            if keep(name) and (not quick or name in QUICK_SUBJECTS)]


def compile_plan(device, quick, env, keep=lambda name: True):
    """[(target, cases)] that the compile pool runs once before the sweep: every subject."""
    backend = compile_backend(device)
    return [("mingru.bench.speed:measure_subject",
             [(n, d, s, device, quick, env, backend) for n, d, s in _todo(quick, keep)])]


def measure(device, quick, env, keep=lambda name: True):
    WARM["seconds"] = warm.warm_plans(compile_plan(device, quick, env, keep), warm.default_workers(device))
    backend = compile_backend(device)
    rows = []
    for name, dims, shape in Sweep("speed", _todo(quick, keep), lambda c: f"{c[0]} {cases.label(c[1])}"):
        rows += measure_subject(name, dims, shape, device, quick, env, backend)
    return rows


def summarize(rows, env):
    backend = compile_backend(env["device"])
    slower = [f"{r['op']} {r['dims']} {r['direction']}: triton {r['triton_x']:.2f}x eager"
              for r in rows if r.get("triton_x") is not None and r["triton_x"] < 1]
    arbitrated = [f"{r['op']} {r['dims']} {r['direction']} ({who})" for r in rows for who in ("compile", "triton")
                  if r.get(f"{who}_checked_against") == "float64"]
    return {
        "compile_backend": backend,
        "compile_pool_s": WARM["seconds"],
        "method": ("wall clock per call in a loop of calls after a warm-up, median of batches "
                   "(host and GPU overlap as in a training loop; timing.median_us) on fresh random non-zero "
                   "float32 inputs; fwd = inference under no_grad, "
                   "fwd+bwd = forward + backward of random cotangents on every output into .grad "
                   "(grads reset each call); every competitor checked against eager with the parity "
                   "gates before timing (against float64 where it disagrees with eager)" if backend == "inductor" else
                   "CPU smoke run: wall-clock medians of a few calls, not GPU numbers"),
        "columns": ["op", "shape", "dims", "direction", "eager_us", "compile_us", "triton_us",
                    "compile_x", "triton_x", "triton_vs_compile", "triton_gpu_us", "status"],
        "notes": ["*_us: wall time per call in a loop of calls (includes the host's Python and launch cost); "
                  "triton_gpu_us: GPU time of the Triton call alone, host cost removed: its kernels' durations "
                  "summed per call from a torch.profiler CUDA trace (mean of 20 calls, inputs warm in L2)",
                  "*_x = eager time / that competitor's time (higher is faster); "
                  "triton_vs_compile = compile time / triton time",
                  f"torch.compile backend: {backend} (of the eager path, MINGRU_SCAN=eager)",
                  "rows where triton is slower than eager: " + ("; ".join(slower) or "none"),
                  "competitors that disagreed with eager float32 and were judged against float64 instead "
                  "(their status says whether they passed): " + ("; ".join(arbitrated) or "none")],
    }
