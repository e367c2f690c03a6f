"""The seed (mingru-scans 0.2.0) measured beside ours: its four scans at its shapes and its mixers.

Ours runs in this process, the seed in a separate one (`seed_runner.py`, the seed's folder first on
sys.path), both through the same functions on the same tensors: inputs, cotangents and float64
references (rounded to float32) are made here and handed over in a file. The two sides take turns
job by job (`seed_results`), so each pair of rows is timed under the same host conditions, and within
a job the wall clock in WALL_ROUNDS rounds (`alternate_wall`). Columns: wall clock
(per call in a loop of calls, median), GPU clock (kernel durations from a profiler trace), peak memory for the mixers;
ratios are seed / ours. Goal: at least 2x the seed by GPU clock and never slower by wall clock
(mixers: and peak memory no higher). Without .peers/mingru-scans the seed's columns say "not measured".
"""
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import mingru
from mingru.bench import cases, places, progress, report, seed_runner, timing, warm
from mingru.bench.progress import Sweep

NAME, SUBJECT = "seed", "op"
SHAPES = {"lab": (128, 64), "long-T": (16, 1024)}
QUICK_SHAPES = {"lab": (2, 8)}
WIDTH, QUICK_WIDTH = 64, 8
AFFINE_KV = ((4, 4), (8, 8), (16, 16), (8, 1))  # (8, 1) is GivensMinGRU's generic path
MIXERS = ("MinGRU", "SignedMinGRU", "RotationMinGRU", "GivensMinGRU", "DeltaMinGRU")
DELTA_LAYER_SHAPES = ((16, 1024, 256), (4, 4096, 256))
# our forms measured beside a mixer's default, at each of its shapes, against the same class of the seed
FORMS = {"DeltaMinGRU": ("DeltaMinGRU[fused]", "DeltaMinGRU[chunked]")}
DTYPES = ("float32", "bfloat16")
TOLERANCE = {  # against float64 on the same (rounded) inputs, normwise: rtol times the tensor's largest entry
    "float32": timing.gate((1e-4, 1e-4), (1e-3, 1e-3), True, True,
                           "float32 against float64, normwise (T steps of rounding in either kernel)"),
    "bfloat16": timing.gate((2e-2, 2e-2), (5e-2, 5e-2), True, True,
                            "bfloat16 outputs carry 8 significant bits; normwise"),
}
GOAL = "seed / ours >= 2 by GPU clock and >= 1 by wall clock (mixers: peak memory <= the seed's)"
# The wall clock of a job is timed in this many rounds, the two sides taking turns (the seed, ours,
# the seed, ...), each round a part of the usual span; *_us is each side's median round. At the
# seed's shapes the wall clock is host-bound, and a host's speed drifts within seconds.
WALL_ROUNDS = 3
RUNNER_TIMEOUT_S = 600


def op_cases(quick):
    """(op, dims, shape, dtype, direction) at the seed's shapes; --quick: one tiny op per family."""
    shapes, width = (QUICK_SHAPES, QUICK_WIDTH) if quick else (SHAPES, WIDTH)
    dtypes, kvs = (("float32",), ((4, 2),)) if quick else (DTYPES, AFFINE_KV)
    for shape, (B, T) in shapes.items():
        subjects = [("linear_scan", dict(D=width)), ("matrix_affine_scan", dict(n=width // kvs[0][0], k=kvs[0][0], v=kvs[0][1]))]
        if not quick:
            subjects = [("parallel_scan_log", dict(D=width)), ("linear_scan", dict(D=width)),
                        ("matrix_scan", dict(n=width // 2))]
            subjects += [("matrix_affine_scan", dict(n=width // k, k=k, v=v)) for k, v in kvs]
        for op, dims in subjects:
            for dtype in dtypes:
                for direction in ("fwd", "fwd+bwd"):
                    yield op, {"B": B, "T": T, **dims}, shape, dtype, direction


def mixer_cases(quick):
    """(mixer, B, T, d) for every mixer both packages have, at the seed's shapes; DeltaMinGRU also
    at the widths of a language-model layer (n_heads 4 by default in both packages)."""
    shapes, width = (QUICK_SHAPES, QUICK_WIDTH) if quick else (SHAPES, WIDTH)
    names = [m for m in MIXERS if hasattr(mingru, m)]
    found = [(m, B, T, width) for m in (names[:1] if quick else names) for B, T in shapes.values()]
    if quick:
        return found
    found += [("DeltaMinGRU", B, T, d) for B, T, d in DELTA_LAYER_SHAPES]
    return found + [(form, B, T, d) for m, B, T, d in found for form in FORMS.get(m, ())]


def op_reference(op, dims, dtype, device):
    """Inputs, cotangents and float64 outputs and gradients (the eager scan in float64) of one op at
    one shape and dtype, on the CPU. The references are rounded to float32 for the hand-over: that
    adds at most 6e-8 relative error against gates of 1e-4 and up, and halves the file the seed reads."""
    inputs = cases.op_inputs(op, dims, getattr(torch, dtype), device)
    exact = tuple(None if x is None else x.detach().double().requires_grad_() for x in inputs)
    with timing.scan_impl("eager"):
        outs = cases.outputs(getattr(mingru.scans, op), exact)
        cot = cases.cotangents_for(outs)
        grads = torch.autograd.grad(outs, [x for x in exact if x is not None], cot)
    cpu = lambda xs, to=None: tuple(None if x is None else x.detach().to("cpu", to) for x in xs)  # noqa: E731
    return {"inputs": cpu(inputs), "cot": cpu(cot, getattr(torch, dtype)), "want_out": cpu(outs, torch.float32),
            "want_grads": cpu(grads, torch.float32)}


def op_job(op, dims, dtype, direction, device, reps, reference=None):
    """One op case: its `op_reference` (made here unless given: the fwd and fwd+bwd jobs of one
    shape share theirs, and the file that carries them to the seed stores shared tensors once)."""
    ref = reference or op_reference(op, dims, dtype, device)
    return {"kind": "op", "name": op, "direction": direction, **ref,
            "want_grads": ref["want_grads"] if direction != "fwd" else (),
            "tol": TOLERANCE[dtype], "reps": reps, "gpu_time": True}


def module_job(name, B, T, d, dtype="float32", mode="auto", reps=3, memory=True, seed=0):
    """A mixer's fwd+bwd on a fresh input x ~ N(0, 1) of shape (B, T, d); default constructor (d, d).
    name: our subject (`cases.mixer`'s names: 'DeltaMinGRU[fused]' is a form of ours); the seed runs
    its class of that name without the bracket."""
    gen = torch.Generator().manual_seed(seed)
    return {"kind": "module", "name": name.partition("[")[0], "subject": name, "args": (d, d), "kwargs": {},
            "dtype": dtype, "mode": mode,
            "x": torch.randn(B, T, d, generator=gen).to(getattr(torch, dtype)), "seed": seed,
            "tol": TOLERANCE[dtype], "reps": reps, "gpu_time": True, "memory": memory}


def ours(job, device):
    """The same job run on our package, in this process, through the runner's functions."""
    start = time.monotonic()
    if job["kind"] == "op":
        with timing.scan_impl("auto"):
            got = seed_runner.run_op(mingru, timing, job, device)
    else:
        build = lambda j: cases.mixer(j.get("subject", j["name"]), {"d": j["args"][1]})  # noqa: E731
        got = seed_runner.run_module(mingru, timing, job, device, build)
    return {**got, "job_s": time.monotonic() - start}


def seed_results(jobs, device, timeout=RUNNER_TIMEOUT_S):
    """The seed's result of each job in turn, from one subprocess in lockstep: the seed starts job i+1
    only when the next result is asked for, so a caller that measures its own side of job i in between
    times both sides in alternation, under the same host conditions (wall clock at the seed's shapes
    is host-bound, and a host's speed drifts over a sweep). Sets VERSION["seed"]; where the seed
    cannot run, every job's result is {"status": why}."""
    VERSION["seed"] = None
    if not (places.SEED / "mingru").is_dir():
        yield from [{"status": places.NOT_MEASURED.format(".peers/mingru-scans")}] * len(jobs)
        return
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "jobs.pt"
        torch.save({"device": str(device), "jobs": jobs}, spec)
        with open(Path(tmp) / "stderr", "w+") as err:
            proc = subprocess.Popen([sys.executable, str(Path(seed_runner.__file__)), str(places.SEED), str(spec)],
                                    cwd=tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
            timer = threading.Timer(timeout, proc.kill)
            timer.start()
            try:
                VERSION["seed"] = _reply(proc, "VERSION ")
                for i in range(len(jobs)):
                    got = None if VERSION["seed"] is None else _reply(proc, "RESULT ", ask=True)
                    if got is None:
                        why = (f"not measured: the seed's runner ran past {timeout} s" if not timer.is_alive()
                               else "not measured: the seed's runner failed ({})".format(_last_line(err)))
                        yield from [{"status": why}] * (len(jobs) - i)
                        return
                    ask = yield json.loads(got)
                    while ask == "wall":  # send("wall"): one more wall-clock round of this job (µs or None)
                        us = _reply(proc, "WALL ", ask=True, line="wall")
                        ask = yield None if us is None else json.loads(us)
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.stdin.close()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()


def _reply(proc, tag, ask=False, line="next"):
    """The runner's next line starting with `tag`, without the tag (other lines are the seed's own
    prints), after sending it `line` if `ask`; None once the runner has exited or been killed."""
    try:
        if ask:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
    except (BrokenPipeError, OSError):
        pass
    return None


def _last_line(err):
    err.flush()
    err.seek(0)
    return ((err.read().strip().splitlines() or ["no output"])[-1])[:160]


def run_seed(jobs, device, timeout=RUNNER_TIMEOUT_S):
    """The seed's results for `jobs` (one subprocess for all, run straight through), or (None, why)
    when it could not run."""
    got = list(seed_results(jobs, device, timeout))
    failed = next((g["status"] for g in got if g["status"].startswith("not measured")), None)
    if failed or VERSION["seed"] is None:
        return None, failed or places.NOT_MEASURED.format(".peers/mingru-scans")
    return got, VERSION["seed"]


def compare(row, mine, theirs, memory=False):
    """Fill ours_*/seed_* columns, seed/ours ratios and meets_goal of one row."""
    for side, got in (("ours", mine), ("seed", theirs)):
        row[f"{side}_us"], row[f"{side}_gpu_us"] = got.get("us"), got.get("gpu_us")
        row[f"{side}_err"], row[f"{side}_status"] = got.get("err"), got["status"]
        row[f"{side}_job_s"] = got.get("job_s")  # seconds the job took in all (where a run's time goes)
        row[f"{side}_wall_rounds"] = got.get("wall_rounds")  # each round's wall clock, when taken in rounds
        if memory:
            row[f"{side}_peak_mb"] = got.get("peak_mb")
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    row["x_wall"] = ratio(row["seed_us"], row["ours_us"])
    row["x_gpu"] = ratio(row["seed_gpu_us"], row["ours_gpu_us"])
    need = [row["x_gpu"], row["x_wall"]] + ([row["ours_peak_mb"], row["seed_peak_mb"]] if memory else [])
    if any(v is None for v in need):
        row["meets_goal"] = None
    else:
        row["meets_goal"] = (row["x_gpu"] >= 2 and row["x_wall"] >= 1
                             and (not memory or row["ours_peak_mb"] <= row["seed_peak_mb"]))
    return row


def _todo(quick, keep):
    return [c for c in op_cases(quick) if keep(c[0])], [c for c in mixer_cases(quick) if keep(c[0])]


def _jobs(todo, mixers, device, reps, rounds=1):
    # mixers first: a sweep cut short by its time budget leaves out op rows, which repeat across dtypes
    jobs = [{**module_job(m, B, T, d, reps=reps, memory=True), "wall_rounds": rounds} for m, B, T, d in mixers]
    refs = {}
    for op, dims, _, dtype, direction in todo:
        key = (op, cases.label(dims), dtype)
        if key not in refs:
            refs[key] = op_reference(op, dims, dtype, device)
        jobs.append({**op_job(op, dims, dtype, direction, device, reps, refs[key]), "wall_rounds": rounds})
    return jobs


def warm_ours(kind, case, device):
    """Our side of one case, once (what the compile pool's workers run; plain arguments pickle)."""
    job = (op_job(*case, device, 0) if kind == "op" else module_job(*case, reps=0, memory=False))
    ours(job, device)


SEED_WARM_PARTS = 6  # seed processes the compile pool starts, each checking every 6th case once


def warm_seed(mixers, todo, device):
    """The seed's side of some cases, checked once (not timed) in the seed's own process: its Triton
    kernels land in the on-disk cache that the measured run of the seed then reads, as ours do."""
    jobs = _jobs(todo, mixers, device, 0)
    for job in jobs:
        job["memory"] = False
    run_seed(jobs, device)


def compile_plan(device, quick, env, keep=lambda name: True):
    """[(target, cases)] that the compile pool runs once before the sweep: our side of every case,
    and the seed's side in SEED_WARM_PARTS processes of its own."""
    todo, mixers = _todo(quick, keep)
    parts = 1 if quick else SEED_WARM_PARTS
    theirs = [(mixers[i::parts], todo[i::parts], device) for i in range(parts)]
    return [("mingru.bench.seed:warm_seed", theirs if (places.SEED / "mingru").is_dir() else []),
            ("mingru.bench.seed:warm_ours", [("module", m, device) for m in mixers]
             + [("op", (op, dims, dtype, direction), device) for op, dims, _, dtype, direction in todo])]


def measure(device, quick, env, keep=lambda name: True):
    reps = 1 if quick else 3
    todo, mixers = _todo(quick, keep)
    warm.warm_plans(compile_plan(device, quick, env, keep), warm.default_workers(device))
    rounds = 1 if quick else WALL_ROUNDS
    jobs = _jobs(todo, mixers, device, reps, rounds)
    budget = progress.BUDGETS.get(NAME)
    rows = []
    labelled = [(m, f"B{B}-T{T}-d{d}", "mixer", "float32", "fwd+bwd") for m, B, T, d in mixers]
    labelled += [(op, cases.label(dims), shape, dtype, direction) for op, dims, shape, dtype, direction in todo]
    with contextlib.closing(seed_results(jobs, device, 3 * budget if budget else RUNNER_TIMEOUT_S)) as theirs:
        for (op, dims, shape, dtype, direction), job in Sweep("seed", list(zip(labelled, jobs)),
                                                              lambda w: " ".join(w[0][:2])):
            row = {"op": op, "shape": shape, "dims": dims, "dtype": dtype, "direction": direction}
            seed_got = next(theirs)  # the seed measures this job, then waits while ours is measured
            mine = ours(job, device)
            alternate_wall(theirs, seed_got, mine, rounds)
            rows.append(compare(row, mine, seed_got, memory=job["kind"] == "module"))
            if job["kind"] == "op":
                bound(row, job, env["copy_gbps"])
    return rows


def bound(row, job, copy_gbps):
    """An op row's bound_gpu_us, the GPU time of a kernel that moves the least bytes
    (`cases.least_bytes`) at this run's copy bandwidth, and x_bound = seed / that time: the x_gpu of a
    kernel streaming at copy bandwidth, so x_gpu >= 2 needs 200 / x_bound % of it. The copy rate is
    DRAM's: inputs small enough to stay in L2 between calls can go faster."""
    size = getattr(torch, row["dtype"]).itemsize
    out = sum(x.numel() for x in job["want_out"] if x is not None) * size
    row["bound_gpu_us"] = cases.least_bytes(cases.nbytes(job["inputs"]), out, row["direction"]) / (copy_gbps * 1e3)
    row["x_bound"] = row["seed_gpu_us"] / row["bound_gpu_us"] if row.get("seed_gpu_us") else None
    return row


def alternate_wall(theirs, seed_got, mine, rounds):
    """The later wall-clock rounds of one job, the seed's then ours each time; each side's `us`
    becomes its median round and `wall_rounds` lists them. A side without a first time takes none."""
    theirs_walls, my_walls = [seed_got.get("us")], [mine.get("us")]
    for _ in range(rounds - 1):
        if theirs_walls[0] is not None:
            theirs_walls.append(theirs.send("wall"))
        if my_walls[0] is not None:
            my_walls.append(timing.again())
    for got, walls in ((seed_got, theirs_walls), (mine, my_walls)):
        if walls[0] is not None:
            times = sorted(t for t in walls if t is not None)
            got["wall_rounds"], got["us"] = walls, times[len(times) // 2]


VERSION = {"seed": None}


def summarize(rows, env):
    short = [f"{r['op']} {r['dims']} {r['dtype']} {r['direction']} [{report.seed_short_of(r)}]" for r in rows
             if r.get("meets_goal") is False]
    return {
        "seed_version": VERSION["seed"],
        "goal": GOAL,
        "tolerances": TOLERANCE,
        "columns": ["op", "shape", "dims", "dtype", "direction", "ours_us", "seed_us", "x_wall", "ours_gpu_us",
                    "seed_gpu_us", "x_gpu", "x_bound", "ours_peak_mb", "seed_peak_mb", "meets_goal", "ours_status",
                    "seed_status"],
        "notes": ["ours: MINGRU_SCAN=auto in this process; seed: mingru-scans "
                  f"{VERSION['seed'] or '(not measured)'} in a separate process, same tensors, same code path; the two "
                  "processes take turns job by job (the seed's job, then ours), so a pair is timed under the same "
                  f"host conditions, and within a job the wall clock in {WALL_ROUNDS} rounds (the seed's, ours, the "
                  "seed's, ...)",
                  "*_us: wall clock per call in a loop of calls (median of the rounds, each the median of its "
                  "batches, host included); *_gpu_us: kernel "
                  "durations from a torch.profiler trace; x_* = seed / ours (above 1: ours faster)",
                  "every side checked against float64 before timing (ops: the eager scan in float64 on the "
                  "same inputs; mixers: the same module in float64, eager); a mismatch is a status, not a time",
                  "x_bound (ops): the seed's GPU time over that of a kernel moving the least bytes (each input "
                  "and output once; fwd+bwd: 3 in + 2 out) at this run's copy bandwidth: the x_gpu of a kernel "
                  "streaming at the DRAM copy rate (inputs that stay in L2 between calls can go faster)",
                  f"meets_goal: {GOAL}",
                  "rows short of the goal: " + ("; ".join(short) or "none")],
    }
