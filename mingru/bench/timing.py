"""How the harnesses time things and pick the implementation: one place for both."""
import contextlib
import os
import sys
import time

import torch


@contextlib.contextmanager
def scan_impl(mode):
    """Run the enclosed calls with MINGRU_SCAN=mode; the dispatch seam reads it at call time."""
    old = os.environ.get("MINGRU_SCAN")
    os.environ["MINGRU_SCAN"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINGRU_SCAN", None)
        else:
            os.environ["MINGRU_SCAN"] = old


def median_us(fn, device, grad_to_none=(), reps=3):
    """Median time of one `fn()` in microseconds.

    GPU: triton's do_bench (warm-up, CUDA events, L2 flushed before every rep, so inputs never
    sit in cache). CPU smoke runs: wall clock over `reps` calls after one warm-up call.
    """
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench
        median, _, _ = do_bench(fn, grad_to_none=list(grad_to_none) or None, quantiles=[0.5, 0.2, 0.8])
        return median * 1e3
    times = []
    for _ in range(reps + 1):
        for x in grad_to_none:
            x.grad = None
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return times[len(times) // 2] * 1e6


def kernel_us(fn, device, grad_to_none=(), reps=20):
    """GPU time of one `fn()` in microseconds without the host: the durations of the kernels (and
    memsets, copies) it launches, summed per call from torch.profiler's CUDA trace and averaged
    over `reps` calls after a warm-up call. Inputs stay warm in L2 between calls.

    Nothing is captured (a failed CUDA-graph capture of an autograd backward once left the CUDA RNG
    broken for the rest of the process), so it works for any call. None on the CPU or when the trace
    holds no GPU activity.
    """
    if torch.device(device).type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for x in grad_to_none:
                x.grad = None
            fn()
        torch.cuda.synchronize()
    total = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return total / reps if total > 0 else None


class Progress:
    """Stderr lines '[speed 3/40 0:12] linear_scan B128-T64-D64' for long sweeps, at most ~50 a sweep."""

    def __init__(self, name, total):
        self.name, self.total, self.done, self.start = name, total, 0, time.monotonic()
        self.every = max(1, total // 50)

    def __call__(self, what):
        self.done += 1
        if self.done % self.every and self.done != self.total:
            return
        elapsed = int(time.monotonic() - self.start)
        print(f"[{self.name} {self.done}/{self.total} {elapsed // 60}:{elapsed % 60:02d}] {what}",
              file=sys.stderr, flush=True)
