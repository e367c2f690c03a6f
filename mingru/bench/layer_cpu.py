"""The CPU column: each of our mixers' default path on a CPU (auto, which is eager there) against
the seed's eager path, one fwd+bwd step, median wall clock in ms.

Both sides go through the same functions on the same input (the seed in its own process; the two
take turns row by row, and within a row in rounds, as the seed table does: a host's speed drifts
within seconds, by more than the margins these rows are judged on). Goal: ours no slower than the
seed on the same CPU. --quick runs tiny shapes for CI, in two rounds.
"""
import contextlib

import torch

import mingru
from mingru.bench import seed
from mingru.bench.progress import Sweep

NAME, SUBJECT = "layer_cpu", "mixer"
SHAPES = ((16, 256, 64), (4, 1024, 128), (64, 64, 64))
QUICK_SHAPES = ((2, 8, 8),)
MIXERS = ("MinGRU", "SignedMinGRU", "RotationMinGRU", "GivensMinGRU", "DeltaMinGRU")
GOAL = "ours no slower than the seed's eager (seed_x >= 1)"


def measure(device, quick, env, keep=lambda name: True):
    device = torch.device("cpu")
    reps, rounds = (1, 2) if quick else (5, seed.WALL_ROUNDS)
    todo = [(m, shape) for shape in (QUICK_SHAPES if quick else SHAPES) for m in MIXERS
            if keep(m) and hasattr(mingru, m)]
    jobs = [seed.module_job(m, B, T, d, reps=reps, memory=False) for m, (B, T, d) in todo]
    for job in jobs:
        job["gpu_time"], job["wall_rounds"] = False, rounds
    rows = []
    with contextlib.closing(seed.seed_results(jobs, device)) as theirs:  # the seed's job, then ours, then the next
        for (m, (B, T, d)), job in Sweep("layer_cpu", list(zip(todo, jobs)),
                                         lambda w: f"{w[0][0]} B{w[0][1][0]}-T{w[0][1][1]}"):
            got = next(theirs)
            mine = seed.ours(job, device)
            seed.alternate_wall(theirs, got, mine, rounds)  # the later rounds: the seed's, then ours, ...
            ms = lambda r: r.get("us") and r["us"] / 1e3  # noqa: E731
            row = {"mixer": m, "B": B, "T": T, "d": d, "ours_ms": ms(mine), "seed_ms": ms(got),
                   "ours_status": mine["status"], "seed_status": got["status"],
                   "ours_wall_rounds": mine.get("wall_rounds"), "seed_wall_rounds": got.get("wall_rounds")}
            row["seed_x"] = row["seed_ms"] / row["ours_ms"] if row["seed_ms"] and row["ours_ms"] else None
            row["meets_goal"] = None if row["seed_x"] is None else row["seed_x"] >= 1
            rows.append(row)
    return rows


def summarize(rows, env):
    rounds = max((len(r.get("ours_wall_rounds") or ()) for r in rows), default=1)
    short = [f"{r['mixer']} B{r['B']}-T{r['T']}-d{r['d']}" for r in rows if r.get("meets_goal") is False]
    return {
        "goal": GOAL,
        "threads": torch.get_num_threads(),
        "device": "cpu",  # a CPU harness on whatever machine runs it: the provenance names its CPU
        "columns": ["mixer", "B", "T", "d", "ours_ms", "seed_ms", "seed_x", "meets_goal", "ours_status",
                    "seed_status"],
        "notes": [f"CPU fwd+bwd of one layer, float32, default constructors, median of a few steps, "
                  f"{torch.get_num_threads()} torch threads; ours = MINGRU_SCAN=auto (eager on a CPU), the seed's "
                  "eager path in its own process; both checked against their float64 copies first",
                  f"*_ms: each side's median round of {rounds}, the two taking turns (the seed's, ours, the seed's, "
                  "...); *_wall_rounds in the JSON lists the rounds (µs)",
                  "seed_x = seed ms / ours ms (above 1: ours faster)",
                  "rows where the seed is faster: " + (", ".join(short) or "none")],
    }
