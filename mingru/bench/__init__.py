"""Benchmark harnesses: `python -m mingru.bench {all|speed,roofline,memory,parity,peers,layout} [--quick]`.

Each writes <out>/<name>.json (rows + environment: the source of truth), <name>.md and its figures
under <out>/figures; every run also writes <out>/env.json. Without --quick it needs a CUDA GPU;
--quick is a CPU smoke run on tiny shapes (Triton through the interpreter only when
TRITON_INTERPRET=1 is set) that exercises the same code and claims no GPU numbers. --only keeps
the subjects whose names contain one of its words and merges their rows into an existing file
from the same GPU, so a long sweep can be split across several calls.
"""
import argparse
import importlib
import itertools
from pathlib import Path

HARNESSES = ("speed", "roofline", "memory", "parity", "peers", "layout")


def run(which, quick=False, out="results", only=None, shard=None):
    """Run harnesses ('all', a name, or names joined by commas); return the paths written.

    shard=(i, n) keeps every n-th case the harness asks about, starting at the i-th, so n processes
    can share a long sweep (each compiles only its own kernels); tools/merge_results.py joins them.
    """
    import torch

    from mingru import plots
    from mingru.bench import env as environment
    from mingru.bench import report

    names = HARNESSES if which == "all" else tuple(which.split(","))
    device = torch.device("cpu" if quick else "cuda")
    env = environment.environment(device, smoke=quick)
    paths = [report.write_env(out, env)]
    wanted = [w.strip() for w in only.split(",")] if only else None
    keep = (lambda name: any(w in name for w in wanted)) if wanted else (lambda name: True)
    if shard:
        keep = _sharded(keep, *shard)
    for name in names:
        module = importlib.import_module(f"mingru.bench.{name}")
        rows = module.measure(device, quick, env, keep)
        merged = []
        if only:
            rows, merged = _merge(Path(out) / f"{module.NAME}.json", module.SUBJECT, rows, keep, env)
        meta = {"smoke": quick, "only": only, "merged_from": merged, **module.summarize(rows, env)}
        if merged:
            meta["notes"].append(f"--only {only}: merged with the other rows of earlier runs ({', '.join(merged)})")
        paths += report.write(out, module.NAME, env, rows, meta)
        paths += plots.draw(module.NAME, out)
    return paths


def _sharded(keep, index, count):
    seen = itertools.count()
    return lambda name: keep(name) and next(seen) % count == index


def _shard(text):
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"--shard takes I/N with 0 <= I < N, got {text!r}")
    return int(index), int(count)


def _merge(path, subject, rows, keep, env):
    """--only replaces the named subjects' rows of an existing result file from the same GPU."""
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mingru.bench", description=__doc__.splitlines()[0])
    parser.add_argument("what", help=f"all, or one or more of {','.join(HARNESSES)} joined by commas")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run on tiny shapes; its numbers are not GPU numbers")
    parser.add_argument("--out", default="results", help="output folder (default: results)")
    parser.add_argument("--only", default=None,
                        help="comma-separated parts of op/mixer/peer names to keep, e.g. matrix,Givens")
    parser.add_argument("--shard", type=_shard, default=None,
                        help="I/N: run every N-th case from the I-th (parallel processes; see tools/merge_results.py)")
    args = parser.parse_args(argv)
    unknown = set(args.what.split(",")) - set(HARNESSES) if args.what != "all" else set()
    if unknown:
        parser.error(f"unknown harness {', '.join(sorted(unknown))}; choose all or {', '.join(HARNESSES)}")
    import torch
    if not args.quick and not torch.cuda.is_available():
        parser.error("the benchmarks need a CUDA GPU; use --quick for a CPU smoke run")
    for path in run(args.what, args.quick, args.out, args.only, args.shard):
        print(path)
