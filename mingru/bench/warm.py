"""Compile in parallel: worker processes run each case once so that the Triton cache on disk holds
every kernel variant before the main process measures.

Triton compiles a kernel in the process that first launches it, one variant after another; a
sweep over block sizes and dtypes spends most of a cold run compiling. Workers (fresh processes,
one CUDA context each) take the cases one at a time and compile them side by side; the main
process then loads the compiled kernels from the cache. Results of the workers are discarded: only
the main process's measurements are recorded.

A harness warms its own cases when it starts (`warm`); a full run instead compiles every harness's
cases in one pool before anything is measured (`warm_all`), so that the pool waits for its slowest
case once instead of once per harness, and the harnesses then skip their own pools.
"""
import concurrent.futures
import importlib
import multiprocessing
import os
import time

WORKERS_ENV = "MINGRU_BENCH_WORKERS"
DONE = set()  # targets whose cases a run-wide pool (warm_all) already compiled in this process
SPENT = {}  # target -> worker seconds its calls took in the last pool that ran it (where a cold run's time goes)
LONGEST = {}  # target -> its longest single call in that pool (what bounds the pool from below)


def default_workers(device):
    """One per CPU core (at most 16) on a GPU machine: compiling is single-threaded CPU work;
    0 (no pool) on a CPU or when MINGRU_BENCH_WORKERS says so."""
    if os.environ.get(WORKERS_ENV) is not None:
        return int(os.environ[WORKERS_ENV])
    if str(device).split(":")[0] != "cuda":
        return 0
    return max(0, min(16, os.cpu_count() or 2))


def _run_call(target, case):
    """Run one call in this worker; return the seconds it took."""
    module, _, name = target.partition(":")
    start = time.monotonic()
    try:
        getattr(importlib.import_module(module), name)(*case)
    except Exception:  # noqa: BLE001  (the main process measures the case again and reports it)
        pass
    return time.monotonic() - start


def _pool(calls, workers):
    """Run (target, case) calls across `workers` spawned processes; return the seconds spent (and
    add each target's worker seconds to SPENT, its longest call to LONGEST).

    Calls are handed out one at a time, in the given order, to whichever worker is free, so the
    pool ends soon after its longest call when that call is listed first (a static split would
    leave some workers idle while one works through its share)."""
    start = time.monotonic()
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    # torch.compile inside a worker compiles in that worker alone, not in a pool of its own per worker
    old = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    try:
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(calls)), mp_context=context) as pool:
            futures = [(target, pool.submit(_run_call, target, case)) for target, case in calls]
            for target, future in futures:
                seconds = future.result()
                SPENT[target] = SPENT.get(target, 0.0) + seconds
                LONGEST[target] = max(LONGEST.get(target, 0.0), seconds)
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS")
        else:
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = old
    return time.monotonic() - start


def warm(target, cases, workers):
    """Run `target` ('module:function') on every case across `workers` processes; return the seconds
    spent (0 when a run-wide pool compiled this target already, or with workers < 2: nothing runs)."""
    cases = list(cases)
    if target in DONE or workers < 2 or len(cases) < 2:
        return 0.0
    SPENT.pop(target, None)
    LONGEST.pop(target, None)
    return _pool([(target, case) for case in cases], workers)


def warm_plans(plans, workers):
    """`warm` for each (target, cases) of a harness's compile plan; the seconds spent in all."""
    return sum(warm(target, cases, workers) for target, cases in plans)


def warm_all(plans, workers):
    """One pool for several harnesses: `plans` is a list of (target, cases); every call of every
    target runs once across `workers` processes, and each target is marked done so that the
    harnesses' own `warm` calls return at once. Returns the seconds spent."""
    calls = [(target, case) for target, cases in plans for case in cases]
    if workers < 2 or not calls:
        return 0.0
    for target, _ in plans:
        SPENT.pop(target, None)
        LONGEST.pop(target, None)
    seconds = _pool(calls, workers)
    DONE.update(target for target, _ in plans)
    return seconds
