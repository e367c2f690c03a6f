"""How the harnesses pick the implementation, check a call against its reference, time it, and
measure its memory: one protocol for ours and every competitor.

It imports torch and the standard library alone, so the seed's runner (a separate process whose
`mingru` is the seed) loads this file by path and measures the seed exactly as we measure ours.
"""
import contextlib
import gc
import math
import os
import time

import torch


@contextlib.contextmanager
def scan_impl(mode):
    """Run the enclosed calls with MINGRU_SCAN=mode; the dispatch seam reads it at call time.

    The package's own switch is `mingru.dispatch.using`; this file keeps its own because the seed's
    process loads it by path, where `mingru` is the seed."""
    old = os.environ.get("MINGRU_SCAN")
    os.environ["MINGRU_SCAN"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINGRU_SCAN", None)
        else:
            os.environ["MINGRU_SCAN"] = old


WALL_WARMUP_S, WALL_S, BATCH_S = 0.025, 0.05, 0.005  # median_us on a GPU: warm-up, timed span, one batch


def median_us(fn, device, grad_to_none=(), reps=3, warmup=WALL_WARMUP_S, span=WALL_S):
    """Wall-clock time of one `fn()` in microseconds, host included: what a loop of calls pays.

    GPU: the calls run back to back, as a training loop runs them (the host prepares the next call
    while the GPU works on this one), in batches timed by the host clock from one synchronize to
    the next, so a call costs the longer of its host work and its GPU work. After WALL_WARMUP_S of
    calls, batches of about BATCH_S (at least one call) run for about WALL_S (at least three); the
    median batch's time per call is returned. Inputs stay warm in L2, as in kernel_us. (flushed_us
    times each call alone behind an L2 flush; the host prepares a call while the flush runs, so it
    hides up to the flush's GPU time of host work: it is no wall clock for calls that the host
    bounds.) grad_to_none: tensors whose .grad is cleared before each call. warmup, span: the
    warm-up and the timed span in seconds (one round of an alternating comparison takes a part).
    CPU: the median wall clock of `reps` calls (the caller has already run it once).
    """
    if torch.device(device).type == "cuda":
        return _loop_us(fn, grad_to_none, torch.cuda.synchronize, warmup, span)
    times = []
    for _ in range(reps):
        for x in grad_to_none:
            x.grad = None
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def _loop_us(fn, grad_to_none, synchronize, warmup=WALL_WARMUP_S, span=WALL_S):
    """median_us's GPU protocol, with `synchronize` waiting for the device."""
    def batch(n):
        synchronize()
        start = time.perf_counter()
        for _ in range(n):
            for x in grad_to_none:
                x.grad = None
            fn()
        synchronize()
        return (time.perf_counter() - start) / n

    one = max(batch(1), 1e-7)
    batch(max(1, int(warmup / one)))
    n = max(1, int(BATCH_S / one))
    times = sorted(batch(n) for _ in range(max(3, int(span / (n * one)))))
    return times[len(times) // 2] * 1e6


def flushed_us(fn, device, grad_to_none=(), reps=3):
    """Time of one `fn()` alone, its inputs read from DRAM, in microseconds: triton's do_bench (25
    ms of warm-up, 50 ms of calls, each behind an L2 flush and timed with CUDA events; the median).
    The host's work hides behind the flush up to the flush's own GPU time, so a call that the host
    does not bound is timed with its launch gaps and cold caches: the clock for bandwidth. CPU: as
    median_us."""
    if torch.device(device).type != "cuda":
        return median_us(fn, device, grad_to_none, reps)
    from triton.testing import do_bench
    median, _, _ = do_bench(fn, warmup=25, rep=50, grad_to_none=list(grad_to_none) or None,
                            quantiles=[0.5, 0.2, 0.8])
    return median * 1e3


TRACE_BUDGET_S = 0.05  # wall time of the calls one profiler trace records, at most (beyond one call)


def kernel_us(fn, device, grad_to_none=(), reps=20):
    """GPU time of one `fn()` in microseconds without the host: the durations of the kernels (and
    memsets, copies) it launches, summed per call from torch.profiler's CUDA trace and averaged
    over `reps` calls after a warm-up call (fewer when the calls are long: a trace records at most
    about TRACE_BUDGET_S of them, since the profiler's cost grows with the events a call launches,
    e.g. a cuDNN RNN's kernels per step). Inputs stay warm in L2 between calls.

    Nothing is captured into a CUDA graph (a failed capture can leave the CUDA RNG unusable), so it
    works for any call. None on the CPU or when the trace holds no GPU activity.
    """
    if torch.device(device).type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = max(1, min(reps, int(TRACE_BUDGET_S / max(time.perf_counter() - start, 1e-9))))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for x in grad_to_none:
                x.grad = None
            fn()
        torch.cuda.synchronize()
    total = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total / reps if total > 0 else None


def peak_mb(fn, device):
    """Peak CUDA memory of one `fn()` above what was allocated before it, in MiB, after a warm-up
    call (kernels compiled, caches filled); None on a CPU."""
    if torch.device(device).type != "cuda":
        return None
    fn()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def gate(out, grad, out_normwise=False, grad_normwise=False, why=""):
    """A tolerance: `out` and `grad` are (atol, rtol); normwise scales rtol by a tensor's largest entry."""
    return {"out": out, "grad": grad, "out_normwise": out_normwise, "grad_normwise": grad_normwise, "why": why}


def max_err(got, want):
    """Largest |got - want| over paired tensors (pairs with a None skipped), in float64."""
    errs = [(g.double() - w.double()).abs().max().item() for g, w in zip(got, want)
            if g is not None and w is not None and g.numel()]
    return math.nan if any(math.isnan(e) for e in errs) else max(errs, default=0.0)


def tolerance_ratio(got, want, atol, rtol, normwise=False):
    """Largest |got - want| / (atol + rtol |want|) over paired tensors (normwise: rtol times the
    largest |want| of each tensor), so `within` holds exactly when the ratio is <= 1. Equal entries
    count 0; NaN, or a None paired with a non-zero tensor, counts inf."""
    worst = 0.0
    for g, w in zip(got, want):
        if g is None or w is None:
            if not all(x is None or not bool(x.any()) for x in (g, w)):
                return math.inf
            continue
        if not g.numel():
            continue
        g, w = g.double(), w.double()
        diff = (g - w).abs()
        allowed = atol + rtol * (w.abs().max() if normwise else w.abs())
        ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / allowed)
        worst = max(worst, torch.nan_to_num(ratio, nan=math.inf).max().item())
    return worst


def within(got, want, atol, rtol, normwise=False):
    """|got - want| <= atol + rtol |want| everywhere (normwise: rtol times the largest |want| of the
    tensor), NaN counting as a failure. A None gradient (autograd's "unused") equals a zero tensor."""
    for g, w in zip(got, want):
        if g is None or w is None:
            if not all(x is None or not bool(x.any()) for x in (g, w)):
                return False
            continue
        g, w = g.double(), w.double()
        scale = w.abs().max() if normwise and w.numel() else w.abs()
        if not bool(((g - w).abs() <= atol + rtol * scale).all()):
            return False
    return True


def agrees(got, want, tol):
    """(ok, max abs error) of (outputs, grads) against the reference (outputs, grads) under a gate."""
    err = max(max_err(got[0], want[0]), max_err(got[1], want[1]))
    ok = (within(got[0], want[0], *tol["out"], normwise=tol.get("out_normwise", False))
          and within(got[1], want[1], *tol["grad"], normwise=tol.get("grad_normwise", False)))
    return ok, err


def wrong(err, against):
    """The one status of a competitor that disagrees with its reference."""
    return f"wrong: max abs error {err:.2e} vs {against}"


def failure(err):
    """A short status for an exception: fallback when the kernel declined, else failed."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if "MINGRU_SCAN=triton" in text:
        return "fallback: " + text.split("cannot run its kernel: ")[-1][:160]
    return f"failed: {type(err).__name__}: {text[:160]}"


_last = []  # (step, device, leaves, reps, rounds) of the call check_then_time timed last, for `again`


def check_then_time(compute, want, tol, step, device, leaves=(), reps=3, gpu_time=True, against="float64",
                    rounds=1):
    """Run `compute()` -> (outputs, grads), compare with `want` under `tol`, then time `step()`.

    Returns {'us': wall µs (median), 'gpu_us': GPU µs (profiler trace; None on a CPU or when not
    asked), 'err': max abs error, 'status'}. A wrong answer or an exception is a status, never a time.
    reps=0 checks without timing (what a compile pool runs ahead: every kernel launched once).
    rounds: the wall clock is the first of that many rounds, each 1/rounds of the timed span;
    `again` measures each later one.
    """
    _last.clear()  # the previous call's tensors go now
    try:
        ok, err = agrees(compute(), want, tol)
        if not ok:
            return {"us": None, "gpu_us": None, "err": err, "status": wrong(err, against)}
        if reps == 0:
            return {"us": None, "gpu_us": None, "err": err, "status": "ok"}
        gpu = kernel_us(step, device, leaves) if gpu_time else None
        _last.extend((step, device, leaves, reps, rounds))
        return {"us": median_us(step, device, leaves, reps, span=WALL_S / rounds), "gpu_us": gpu, "err": err,
                "status": "ok"}
    except Exception as exc:  # noqa: BLE001  (compile errors, declined kernels, OOM: each becomes a row)
        _last.clear()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        return {"us": None, "gpu_us": None, "err": None, "status": failure(exc)}


def again():
    """One more round of the wall clock of the step check_then_time timed last (µs; None when it
    timed none): its part of the timed span after a part of the warm-up (the step ran before)."""
    if not _last:
        return None
    step, device, leaves, reps, rounds = _last
    return median_us(step, device, leaves, reps, warmup=WALL_WARMUP_S / rounds, span=WALL_S / rounds)
