"""Compile in parallel: worker processes run each case once so that the Triton cache on disk holds
every kernel variant before the main process measures.

Triton compiles a kernel in the process that first launches it, one variant after another; a
sweep over block sizes and dtypes spends most of a cold run compiling. Workers (fresh processes,
one CUDA context each) compile disjoint slices of the cases at once; the main process then loads
the compiled kernels from the cache. Results of the workers are discarded: only the main process's
measurements are recorded.
"""
import concurrent.futures
import importlib
import multiprocessing
import os
import time

WORKERS_ENV = "MINGRU_BENCH_WORKERS"


def default_workers(device):
    """One per CPU core (at most 16) on a GPU machine: compiling is single-threaded CPU work;
    0 (no pool) on a CPU or when MINGRU_BENCH_WORKERS says so."""
    if os.environ.get(WORKERS_ENV) is not None:
        return int(os.environ[WORKERS_ENV])
    if str(device).split(":")[0] != "cuda":
        return 0
    return max(0, min(16, os.cpu_count() or 2))


def _run_slice(target, cases):
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    for case in cases:
        try:
            fn(*case)
        except Exception:  # noqa: BLE001  (the main process measures the case again and reports it)
            pass
    return len(cases)


def warm(target, cases, workers):
    """Run `target` ('module:function') on every case across `workers` processes; return the seconds spent.

    Cases are dealt round-robin so that each worker gets a mix of variants. With workers < 2 nothing runs.
    """
    cases = list(cases)
    if workers < 2 or len(cases) < 2:
        return 0.0
    start = time.monotonic()
    slices = [cases[i::workers] for i in range(workers)]
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with concurrent.futures.ProcessPoolExecutor(len(slices), mp_context=context) as pool:
        list(pool.map(_run_slice, [target] * len(slices), slices))
    return time.monotonic() - start
