"""Benchmark harnesses: `python -m mingru.bench {all|NAME[,NAME...]} [--quick] [--out DIR]`.

Each harness writes <out>/<name>.json (rows + environment: the source of truth), <name>.md and its
figures under <out>/figures; every run also writes <out>/env.json. Without --quick a harness needs
a CUDA GPU (layer_cpu, the CPU column, runs on any CPU) and writes into results/; --quick is a
smoke run on tiny shapes (Triton through the interpreter when TRITON_INTERPRET=1) that claims no
GPU numbers and writes into scratch_out/results/. Without a GPU nothing writes into results/.

Development only: --only keeps the subjects whose names contain one of its words and merges
their rows into an existing file from the same GPU. `make reproduce` never uses it.
"""
import argparse
import importlib
import sys
import time
from pathlib import Path

HARNESSES = ("speed", "roofline", "memory", "parity", "peers", "layout", "precision", "seed", "layer",
             "layer_cpu", "scaling")
CPU_HARNESSES = ("layer_cpu",)  # they measure the CPU: a full run is valid on any machine


def _module(name):
    return importlib.import_module(f"mingru.bench.{name}")


def default_out(quick, has_gpu=True):
    """results/ for a full run on a GPU machine; scratch_out/results/ otherwise."""
    from mingru.bench import places
    return places.RESULTS if has_gpu and not quick else places.SCRATCH


def refusal(names, quick, out, has_gpu):
    """Why this run may not write where it would (None when it may): results/ holds the files of one
    full run on a GPU machine, so a smoke run or a machine without a GPU never writes there."""
    from mingru.bench import places
    if quick and places.is_committed_results(out):
        return "--quick is a smoke run: it never writes into results/ (use --out elsewhere)"
    gpu_only = [n for n in names if n not in CPU_HARNESSES]
    if not quick and not has_gpu and gpu_only:
        return f"{', '.join(gpu_only)} need a CUDA GPU; use --quick for a CPU smoke run"
    if not has_gpu and places.is_committed_results(out):
        return "without a GPU nothing writes into results/ (use --out elsewhere)"
    return None


def run(which, quick=False, out=None, only=None, budgets=None, env=None, draw=True):
    """Run harnesses ('all', a name, or names joined by commas); return the paths written.

    budgets: {harness: seconds}; past its budget a harness stops and its result says what it left out.
    env: the environment record to store (default: measured now), so one run's files share one.
    draw: False leaves the figures to the caller (`make reproduce` draws them all at the end, beside
    the notebooks, so no harness waits for matplotlib).
    """
    import torch

    from mingru.bench import env as environment
    from mingru.bench import plots, progress, report

    names = HARNESSES if which == "all" else tuple(which.split(","))
    has_gpu = torch.cuda.is_available()
    out = Path(default_out(quick, has_gpu) if out is None else out)
    why = refusal(names, quick, out, has_gpu)
    if why:
        raise ValueError(why)
    progress.BUDGETS.update(budgets or {})
    gpu = torch.device("cpu" if quick else "cuda")
    if env is None:
        cpu_only = all(n in CPU_HARNESSES for n in names)
        env = environment.environment(torch.device("cpu") if cpu_only else gpu, smoke=quick)
    paths = [report.write_env(out, env)]
    wanted = [w.strip() for w in only.split(",")] if only else None
    keep = (lambda name: any(w in name for w in wanted)) if wanted else (lambda name: True)
    for name in names:
        start = time.monotonic()
        module = _module(name)
        device = torch.device("cpu") if name in CPU_HARNESSES else gpu
        rows = module.measure(device, quick, env, keep)
        merged = []
        if only:
            rows, merged = _merge(out / f"{module.NAME}.json", module.SUBJECT, rows, keep, env)
        meta = {"smoke": quick, "only": only, "merged_from": merged, **module.summarize(rows, env)}
        meta.setdefault("notes", [])
        if progress.budget_note(name):
            meta["notes"].append(progress.budget_note(name))
        if merged:
            meta["notes"].append(f"--only {only}: merged with the other rows of earlier runs ({', '.join(merged)})")
        paths += report.write(out, module.NAME, env, rows, meta)
        paths += plots.draw(module.NAME, out) if draw else []
        print(f"{name}: {len(rows)} rows in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return paths


# Plans by the time of their calls, longest first (a cold run's results/reproduce.json lists each
# target's longest call): the pool hands calls out in this order, so it ends soon after its longest.
# Our side of the seed's cases goes last: by then the other harnesses have compiled most of its
# kernels, and its calls load them from the cache.
POOL_ORDER = ("peers:warm_race", "train:warm_run", "layer:step_row", "speed:measure_subject", "seed:warm_seed",
              "precision:errors", "precision:delta_errors", "memory:compile_case", "parity:compile_case",
              "seed:warm_ours")


def compile_ahead(names, quick=False, env=None, workers=None, extra=()):
    """Compile every kernel the harnesses `names` will launch, in one pool, before any of them
    measures; return the seconds spent. Nothing is measured meanwhile, so the pool's load on the
    CPU and GPU touches no recorded number.

    Harnesses that define compile_plan() contribute [(target, cases)]; each later skips its own
    pool. `extra`: more (target, cases), e.g. a notebook's training runs. The seed's process is
    warmed from its own plan; the other peers run in this process.
    """
    import torch

    from mingru.bench import env as environment
    from mingru.bench import warm

    device = torch.device("cpu" if quick else "cuda")
    env = env or environment.environment(device, smoke=quick)
    workers = warm.default_workers(device) if workers is None else workers
    if workers < 2:
        return 0.0
    modules = [_module(name) for name in names if name not in CPU_HARNESSES]
    plans = [plan for m in modules if hasattr(m, "compile_plan") for plan in m.compile_plan(device, quick, env)]
    rank = lambda plan: next((i for i, t in enumerate(POOL_ORDER) if plan[0].endswith(t)), len(POOL_ORDER))  # noqa: E731
    return warm.warm_all(sorted([*plans, *extra], key=rank), workers)


def _merge(path, subject, rows, keep, env):
    """--only (development) replaces the named subjects' rows of an existing result file from the same GPU."""
    from mingru.bench import report

    if not path.exists():
        return rows, []
    old = report.load(path)
    if old["env"].get("gpu") != env["gpu"] or bool(old["env"].get("smoke")) != bool(env["smoke"]):
        return rows, []
    kept = [r for r in old["rows"] if not keep(str(r.get(subject, "")))]
    if not kept:
        return rows, []
    return kept + rows, [old["env"].get("date")] + old["meta"].get("merged_from", [])


def _budget(text):
    name, _, seconds = text.partition("=")
    try:
        return name, float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget takes NAME=SECONDS, got {text!r}") from None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mingru.bench", description=__doc__.splitlines()[0])
    parser.add_argument("what", help=f"all, or one or more of {','.join(HARNESSES)} joined by commas")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run on tiny shapes; its numbers are not GPU numbers")
    parser.add_argument("--out", default=None,
                        help="output folder (default: results/ on a GPU, else or with --quick scratch_out/results/)")
    parser.add_argument("--budget", type=_budget, action="append", default=[],
                        help="NAME=SECONDS: stop that harness's sweep after so long (repeatable)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes that compile kernel variants ahead of the parity sweep "
                             "(default: half the cores, at most 8, on a GPU; 0 turns the pool off)")
    parser.add_argument("--only", default=None,
                        help="development only: comma-separated parts of op/mixer/peer names to keep, "
                             "merged into the existing result file")
    args = parser.parse_args(argv)
    unknown = set(args.what.split(",")) - set(HARNESSES) if args.what != "all" else set()
    if unknown:
        parser.error(f"unknown harness {', '.join(sorted(unknown))}; choose all or {', '.join(HARNESSES)}")
    import torch
    names = HARNESSES if args.what == "all" else tuple(args.what.split(","))
    has_gpu = torch.cuda.is_available()
    why = refusal(names, args.quick, default_out(args.quick, has_gpu) if args.out is None else args.out, has_gpu)
    if why:
        parser.error(why)
    from mingru.bench import warm
    warm.pin_triton_cache()  # before any harness compiles: the pool and this process share it
    if args.workers is not None:
        import os
        os.environ[warm.WORKERS_ENV] = str(args.workers)
    for path in run(args.what, args.quick, args.out, args.only, dict(args.budget)):
        print(path)
