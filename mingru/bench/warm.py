"""Compile in parallel: worker processes run each case once so that the Triton cache on disk holds
every kernel variant before the main process measures.

Triton compiles a kernel in the process that first launches it, one variant after another; a
sweep over block sizes and dtypes spends most of a cold run compiling. Workers (fresh processes,
one CUDA context each) take the cases one at a time and compile them side by side; the main
process then loads the compiled kernels from the cache. Results of the workers are discarded: only
the main process's measurements are recorded.

A CUDA error leaves the CUDA context of the worker where it happened unusable (an illegal address
in any kernel is reported at some later call), so that worker runs no more calls: it hands them
back, and they run again in a fresh pool once the current one ends (at most POOL_ROUNDS pools).
The call that raised the error counts as failed, as any other call that raises.

A harness warms its own cases when it starts (`warm`); a full run instead compiles every harness's
cases in one pool before anything is measured (`warm_all`), so that the pool waits for its slowest
case once instead of once per harness, and the harnesses then skip their own pools.
"""
import concurrent.futures
import importlib
import multiprocessing
import os
import sys
import time

WORKERS_ENV = "MINGRU_BENCH_WORKERS"
DONE = set()  # targets whose cases a run-wide pool (warm_all) already compiled in this process
SPENT = {}  # target -> worker seconds its calls took in the last pool that ran it (where a cold run's time goes)
LONGEST = {}  # target -> its longest single call in that pool (what bounds the pool from below)
FAILED = {}  # target -> (calls that raised in that pool, the first one's error): those cases compile in the sweep
POOL_ROUNDS = 3  # pools a run of calls may take when CUDA errors leave workers unusable
# GPU memory a worker may need: its CUDA context and one case's tensors (its cache is emptied after
# each call). Sixteen workers ran out of memory on an 80 GB GPU where they had not on a 141 GB one.
WORKER_GPU_BYTES = 6 * 2**30
_DEAD = []  # in a worker: the CUDA error that left its context unusable (the worker then hands calls back)


def pin_triton_cache():
    """Set TRITON_CACHE_DIR to Triton's default folder unless it is set, and return the folder.

    The pool's workers and the main process must share one cache. torch.compile (inductor) sets
    TRITON_CACHE_DIR to a folder of its own the first time it compiles in a process where it is
    unset; from then on the main process looks for kernels where the pool did not put them and
    compiles every variant again in its sweep. A run pins the folder before anything compiles."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    folder = os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache")
    os.environ["TRITON_CACHE_DIR"] = folder
    return folder


def default_workers(device):
    """One per CPU core (at most 16) on a GPU machine: compiling is single-threaded CPU work; but at
    most one per WORKER_GPU_BYTES of the GPU's memory, which the workers share (each runs its case
    on the GPU). 0 (no pool) on a CPU; MINGRU_BENCH_WORKERS overrides."""
    if os.environ.get(WORKERS_ENV) is not None:
        return int(os.environ[WORKERS_ENV])
    if str(device).split(":")[0] != "cuda":
        return 0
    workers = max(0, min(16, os.cpu_count() or 2))
    import torch
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        workers = min(workers, max(1, total // WORKER_GPU_BYTES))
    return workers


def context_fault(exc):
    """Whether `exc` is a CUDA error, which leaves the process's CUDA context unusable."""
    return "CUDA error" in str(exc) or type(exc).__name__ == "AcceleratorError"


def _run_call(target, case):
    """Run one call in this worker; return the seconds it took, the error it raised (or None), and
    whether it was handed back unrun (this worker's CUDA context is unusable)."""
    if _DEAD:
        return 0.0, None, True
    module, _, name = target.partition(":")
    start = time.monotonic()
    error = None
    try:
        getattr(importlib.import_module(module), name)(*case)
    except Exception as exc:  # noqa: BLE001  (the main process measures the case again and reports it)
        error = f"{type(exc).__name__}: {exc}"[:300]
        if context_fault(exc):
            _DEAD.append(error)
    torch = sys.modules.get("torch")
    if not _DEAD and torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # what the call left cached goes back to the workers beside this one
    return time.monotonic() - start, error, False


def _pool(calls, workers):
    """Run (target, case) calls across `workers` spawned processes; return the seconds spent (and
    add each target's worker seconds to SPENT, its longest call to LONGEST, the calls that raised to
    FAILED, each target's failures also printed: the sweep then compiles those cases one by one).

    Calls are handed out one at a time, in the given order, to whichever worker is free, so the
    pool ends soon after its longest call when that call is listed first (a static split would
    leave some workers idle while one works through its share). Calls that a worker with an
    unusable CUDA context handed back run in a fresh pool after this one (POOL_ROUNDS in all);
    any still unrun after the last count as failed."""
    start = time.monotonic()
    # torch.compile inside a worker compiles in that worker alone, not in a pool of its own per worker
    old = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    try:
        pending = list(calls)
        for round_ in range(1, POOL_ROUNDS + 1):
            pending = _one_pool(pending, workers)
            if not pending:
                break
            if round_ < POOL_ROUNDS:
                print(f"compile pool: a CUDA error left a worker unusable; the {len(pending)} call(s) it handed "
                      "back run in fresh workers", file=sys.stderr, flush=True)
        for target, _ in pending:
            _record(target, 0.0, f"not run: CUDA errors left the workers of {POOL_ROUNDS} pools unusable")
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS")
        else:
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = old
    for target in dict.fromkeys(target for target, _ in calls):
        if target in FAILED:
            count, first = FAILED[target]
            print(f"compile pool: {count} call(s) of {target} raised (first: {first}); the sweep compiles "
                  "those cases itself", file=sys.stderr, flush=True)
    return time.monotonic() - start


def _one_pool(calls, workers):
    """One pool over `calls`, recorded as they finish; returns the calls handed back unrun."""
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    back = []
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(calls)), mp_context=context) as pool:
        futures = [(call, pool.submit(_run_call, *call)) for call in calls]
        for call, future in futures:
            seconds, error, handed_back = future.result()
            if handed_back:
                back.append(call)
            else:
                _record(call[0], seconds, error)
    return back


def _record(target, seconds, error):
    SPENT[target] = SPENT.get(target, 0.0) + seconds
    LONGEST[target] = max(LONGEST.get(target, 0.0), seconds)
    if error:
        count, first = FAILED.get(target, (0, error))
        FAILED[target] = (count + 1, first)


def _forget(target):
    for record in (SPENT, LONGEST, FAILED):
        record.pop(target, None)


def warm(target, cases, workers):
    """Run `target` ('module:function') on every case across `workers` processes; return the seconds
    spent (0 when a run-wide pool compiled this target already, or with workers < 2: nothing runs)."""
    cases = list(cases)
    if target in DONE or workers < 2 or len(cases) < 2:
        return 0.0
    _forget(target)
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
        _forget(target)
    seconds = _pool(calls, workers)
    DONE.update(target for target, _ in plans)
    return seconds
