"""The layer a user trains: one fwd+bwd training step of a recurrent layer, against what a user
would pick instead: torch.nn.GRU (cuDNN), lucidrains' minGRU (minGRU-pytorch, eager and
torch.compile), the seed's MinGRU (its own process) and ours (auto, eager, torch.compile).

Every competitor is checked against its own float64 copy (eager) on the same input before it is
timed; a step is forward + backward of a random cotangent into .grad. Goal for ours (auto): GPU
clock at most lucidrains' compiled layer's and at most half of its eager layer's.
"""
import time

import torch

from mingru.bench import cases, places, seed, seed_runner, timing, warm
from mingru.bench.progress import Sweep

NAME, SUBJECT = "layer", "competitor"
SHAPES = ((128, 64, 64), (16, 1024, 256), (64, 256, 512), (4, 4096, 256))
QUICK_SHAPES = ((2, 8, 8),)
TOLERANCE = timing.gate((1e-3, 1e-3), (1e-2, 1e-2), True, True,
                        "float32 layer against its float64 copy, normwise (weight gradients sum B*T terms)")
OURS = "ours MinGRU (auto)"
WARM = {"seconds": 0.0}  # time the compile pool spent on the compiled competitors before the sweep
GOAL = "ours (auto) GPU clock <= lucidrains compiled and <= half of lucidrains eager"


def _lucidrains():
    """lucidrains' minGRU class, or (None, why) when .peers/minGRU-pytorch is absent."""
    if not places.peer_on_path("minGRU-pytorch"):
        return None, places.NOT_MEASURED.format(".peers/minGRU-pytorch")
    try:
        from minGRU_pytorch.minGRU import minGRU
    except Exception as exc:  # noqa: BLE001  (a broken unpack is a status)
        return None, timing.failure(exc)
    return minGRU, None


class _GRU(torch.nn.Module):
    """torch.nn.GRU returning its outputs only, batch first."""

    def __init__(self, d):
        super().__init__()
        self.gru = torch.nn.GRU(d, d, batch_first=True)

    def forward(self, x):
        return self.gru(x)[0]


def competitors(quick):
    """name -> (build(d) -> module, MINGRU_SCAN mode, compile?) or a 'not measured' string."""
    minGRU, why = _lucidrains()
    entries = {"torch.nn.GRU (cuDNN)": (_GRU, "auto", False)}
    for label, compiled in (("lucidrains minGRU (eager)", False), ("lucidrains minGRU (compiled)", True)):
        entries[label] = why or (minGRU, "auto", compiled)
    ours = lambda d: cases.mixer("MinGRU", {"d": d})  # noqa: E731
    entries.update({OURS: (ours, "auto", False), "ours MinGRU (eager)": (ours, "eager", False),
                    "ours MinGRU (compiled)": (ours, "auto", True)})
    return entries


def _backend(device):
    return "inductor" if device.type == "cuda" else "eager"  # inductor's C++ build is slow on a CPU


def step_row(name, B, T, d, device, reps, quick=False):
    """Check competitor `name` against its float64 copy, then time and weigh its training step.

    It takes the competitor's name, not its builder, so that the compile pool's spawned workers
    can receive the call (a lambda does not pickle)."""
    build, mode, compiled = competitors(quick)[name]
    job = {**seed.module_job("layer", B, T, d, mode=mode, reps=reps), "tol": TOLERANCE}
    wrap = None
    if compiled:
        torch._dynamo.reset()
        wrap = lambda module: torch.compile(module, backend=_backend(device))  # noqa: E731
    return seed_runner.run_module(None, timing, job, device, lambda j: build(d), wrap)


def compile_plan(device, quick, env, keep=lambda name: True):
    """[(target, cases)] that the compile pool runs once before the sweep: the compiled competitors."""
    entries = {k: v for k, v in competitors(quick).items() if keep(k)}
    todo = [(name, shape) for shape in (QUICK_SHAPES if quick else SHAPES) for name in entries]
    return [("mingru.bench.layer:step_row", warm_cases(entries, todo, device, 1 if quick else 3, quick))]


def measure(device, quick, env, keep=lambda name: True):
    reps = 1 if quick else 3
    shapes = QUICK_SHAPES if quick else SHAPES
    entries = {k: v for k, v in competitors(quick).items() if keep(k)}
    rows = []
    if keep("seed MinGRU (auto)"):
        theirs, version = seed.run_seed([seed.module_job("MinGRU", B, T, d, reps=reps) for B, T, d in shapes],
                                        device)
        for (B, T, d), got in zip(shapes, theirs or [{"status": version}] * len(shapes)):
            rows.append({"competitor": "seed MinGRU (auto)", "B": B, "T": T, "d": d, **_cols(got)})
    todo = [(name, shape) for shape in shapes for name in entries]
    WARM["seconds"] = warm.warm_plans(compile_plan(device, quick, env, keep), warm.default_workers(device))
    for name, (B, T, d) in Sweep("layer", todo, lambda c: f"{c[0]} B{c[1][0]}-T{c[1][1]}-d{c[1][2]}"):
        entry = entries[name]
        start = time.monotonic()
        got = {"status": entry} if isinstance(entry, str) else step_row(name, B, T, d, device, reps, quick)
        got["job_s"] = time.monotonic() - start  # compile, check, timing and memory of this row
        rows.append({"competitor": name, "B": B, "T": T, "d": d, **_cols(got)})
    return rows


def warm_cases(entries, todo, device, reps, quick):
    """step_row's arguments for every compiled competitor: plain values, so they pickle."""
    return [(name, *shape, device, reps, quick) for name, shape in todo
            if not isinstance(entries[name], str) and entries[name][2]]


def _cols(got):
    return {"us": got.get("us"), "gpu_us": got.get("gpu_us"), "peak_mb": got.get("peak_mb"),
            "err": got.get("err"), "status": got["status"], "job_s": got.get("job_s")}


def judge(rows):
    """On our (auto) rows: lucidrains' times / ours by GPU clock, and meets_goal."""
    by = {(r["competitor"], r["B"], r["T"], r["d"]): r for r in rows}
    short = []
    for r in rows:
        if r["competitor"] != OURS:
            continue
        shape = (r["B"], r["T"], r["d"])
        for key, other in (("vs_lucidrains_compiled_x", "lucidrains minGRU (compiled)"),
                           ("vs_lucidrains_eager_x", "lucidrains minGRU (eager)"),
                           ("vs_gru_x", "torch.nn.GRU (cuDNN)"), ("vs_seed_x", "seed MinGRU (auto)")):
            theirs = by.get((other, *shape), {}).get("gpu_us")
            r[key] = theirs / r["gpu_us"] if theirs and r.get("gpu_us") else None
        c, e = r["vs_lucidrains_compiled_x"], r["vs_lucidrains_eager_x"]
        r["meets_goal"] = None if c is None or e is None else (c >= 1 and e >= 2)
        if r["meets_goal"] is False:
            short.append("B{}-T{}-d{}".format(*shape))
    return short


def summarize(rows, env):
    short = judge(rows)
    return {
        "goal": GOAL,
        "tolerance": TOLERANCE,
        "compile_pool_s": WARM["seconds"],
        "columns": ["competitor", "B", "T", "d", "us", "gpu_us", "peak_mb", "vs_lucidrains_compiled_x",
                    "vs_lucidrains_eager_x", "vs_gru_x", "vs_seed_x", "meets_goal", "status"],
        "notes": ["one training step: forward + backward of a random cotangent into .grad, float32; us = wall "
                  "clock per step in a loop of steps (median), gpu_us = kernel durations from a torch.profiler "
                  "trace, peak_mb = CUDA peak above what was allocated before the step",
                  "vs_*_x = their GPU time / ours (above 1: ours faster); the seed runs in its own process",
                  f"meets_goal: {GOAL}",
                  "shapes short of the goal: " + (", ".join(short) or "none")],
    }
