"""`make reproduce [NB=04]`: regenerate results/ and re-execute the notebooks from them, in one run.

On a GPU the kernels of every harness are compiled first, in one pool of worker processes, with
nothing measured meanwhile; then every harness runs once (each with a time budget, a progress bar
and its wall time), writing results/; then every notebook is executed in place with papermill while
results/figures/ is drawn, so results/, env.json, results/reproduce.json (this run's step times) and
the notebooks all name one commit and one GPU.
Without a GPU (or with --smoke) the harnesses run in their --quick CPU form into a scratch folder
and the notebooks execute there with SMOKE=True, rendering the committed results.
"""
import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
RESULTS = ROOT / "results"

# harness -> (chapter that shows it, time budget in seconds on an H200 from a cold cache)
# (in the order they run: the comparisons the chapters' headlines rest on first, the parity sweep
# last: it is the longest, and the one whose budget a --deadline can shorten without skipping a table)
# A budget caps a harness's sweep: past it the sweep stops, and its result file and this run's
# summary say how many cases it left out. Each is set above what the sweep takes on an H200 once
# the pool has compiled its kernels (results/reproduce.json records what each step took), with room
# for a slower host: on an H100 whose host ran most other steps 15-75 % slower than another H100's, the
# seed sweep (its mixer rows first) spent 60 s and left 46 of its 76 cases out, where the other had
# run all 76 in 52 s. On another slow H100 host the CPU layer sweep (run on the host's CPU) needed
# about 1.8x its time on a fast one and the parity sweep 1.4x; the steps that had finished with half
# their budget or more to spare gave them the room, so the sum is unchanged. The precision sweep's
# delta rule rows took it from 9 s to 12 (8 s on an H100 with the rows), the speed sweep (12 s) gave 3.
HARNESSES = {
    "seed": ("04", 100), "speed": ("04", 22), "layer": ("04", 53), "memory": ("05", 25),
    "peers": ("04", 25), "roofline": ("04", 28), "precision": ("03", 12), "layout": ("02", 6),
    "scaling": ("08", 9), "layer_cpu": ("04", 32), "parity": ("06", 42),
}
ISOLATED = ("peers",)  # harnesses that run other projects' kernels, each in a child process (run_harness)
COMPILE_BUDGET_S = 150  # the run-wide compile pool from a cold cache (GPU runs only; not enforced: no step is cut)
NOTEBOOK_RESERVE_S = 75  # with --deadline: the time kept for the notebooks (side by side: the slowest chapter sets it)
NOTEBOOK_BUDGET_S = 10  # papermill: kernel start, imports, rendering from results/
NOTEBOOK_WORKERS = 8  # chapters executed at once
# A Jupyter kernel can die while it starts, before any cell runs (seen with 8 chapters starting at
# once on a loaded host): such a chapter is started again, up to this many times in all.
KERNEL_START_TRIES = 3
KERNEL_START_FAILURE = "Kernel died before replying to kernel_info"
FIGURES_BUDGET_S = 15  # results/figures/ of every harness that ran, drawn beside the notebooks
NEEDS_GPU = {"02": "the compiled kernels' per-step latency and layout sweep",
             "03": "TF32 vs IEEE errors (the interpreter ignores input_precision)",
             "04": "speed, roofline, peer, seed and layer timings", "05": "peak CUDA memory",
             "06": "the parity harness over the whole envelope",
             "07": "training at GPU sizes through the compiled kernels, and torch.compile with inductor",
             "08": "the sequence-parallel cost model on a GPU (NCCL rows need >= 2 GPUs)"}


def chapters():
    """'01' -> '01_monoid' for every numbered notebook."""
    return {p.stem[:2]: p.stem for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))}


def chapter_key(text):
    """'4', '04' and '04_speedups' all name chapter '04'."""
    known = chapters()
    head = text.strip().split("_")[0]
    key = head.zfill(2) if head.isdigit() else head
    if key not in known or (text.strip() != head and text.strip() != known[key]):
        names = ", ".join(f"{k} ({name})" for k, name in known.items())
        raise argparse.ArgumentTypeError(f"unknown chapter {text!r}; expected one of: {names}")
    return key


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m mingru.reproduce", description=__doc__.split("\n")[0])
    parser.add_argument("chapter", nargs="?", type=chapter_key,
                        help="one chapter, e.g. 04 (default: every harness, then every notebook)")
    parser.add_argument("--smoke", action="store_true", help="take the CPU smoke path even on a GPU machine")
    parser.add_argument("--out", type=Path, default=ROOT / "scratch_out",
                        help="scratch folder of the smoke path (default: scratch_out/)")
    parser.add_argument("--no-measure", action="store_true",
                        help="development only: execute the notebooks from the results/ already there")
    parser.add_argument("--kernel", default="python3", help="Jupyter kernel name (default: python3)")
    parser.add_argument("--deadline", type=float, default=0,
                        help="a hard limit in seconds for the whole run (default: none): no harness starts "
                             f"later than {NOTEBOOK_RESERVE_S} s before it (skipped harnesses are recorded and "
                             "their result files keep their old commit), and each notebook is stopped at it")
    parser.add_argument("--budget-scale", type=_positive, default=1.0, metavar="X",
                        help="multiply every harness's time budget by X (default 1: budgets an H200 fits in; "
                             "a slower GPU, an L4 say, needs a larger X for complete tables, and takes longer)")
    return parser.parse_args(argv)


def _positive(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def has_gpu():
    import torch
    return torch.cuda.is_available()


def triton_cache_state():
    """'cold' when Triton's on-disk kernel cache is absent or empty at the start, else 'warm'. The
    folder is pinned for the whole run (see warm.pin_triton_cache)."""
    from mingru.bench import warm
    folder = Path(warm.pin_triton_cache())
    return "warm" if folder.is_dir() and any(folder.iterdir()) else "cold"


def plan(harnesses, notebooks, compile_first=False, budget_scale=1.0):
    """The steps of this run with their budgets (the harnesses' times budget_scale), printed before
    anything starts."""
    steps = [("compile ahead", COMPILE_BUDGET_S)] if compile_first and harnesses else []
    steps += [(f"bench {name}", harness_budget(name, budget_scale)) for name in harnesses]
    steps += [("figures", FIGURES_BUDGET_S)] if harnesses else []
    steps += [(f"notebook {name}", NOTEBOOK_BUDGET_S) for name in notebooks]
    return steps


def harness_budget(name, scale=1.0):
    """Harness `name`'s time budget in whole seconds (at least 1), scaled (see --budget-scale)."""
    return max(1, round(HARNESSES[name][1] * scale))


CHILDREN = {}  # ISOLATED harness -> its child process, started ahead (start_children)


def start_children(harnesses):
    """Spawn the child process of each ISOLATED harness in `harnesses` now and let it import torch
    and the harnesses (nothing is measured meanwhile), so that its step starts measuring at once."""
    context = multiprocessing.get_context("spawn")
    for name in harnesses:
        if name in ISOLATED and name not in CHILDREN:
            CHILDREN[name] = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
            CHILDREN[name].submit(_prepare, name)


def _prepare(name):
    import torch

    from mingru import bench
    bench._module(name)
    if torch.cuda.is_available():
        torch.cuda.init()


def run_harness(name, smoke, results_dir, env, budget):
    """One harness into results_dir within `budget` seconds (a GPU run's; a smoke run on a CPU is
    slower and has none).

    A harness in ISOLATED runs in a spawned child process: a kernel fault (an illegal address)
    leaves a process's CUDA context unusable, so a fault in another project's kernel fails that
    harness alone instead of every step after it."""
    from mingru.bench import progress
    if name not in ISOLATED:
        progress.SKIPPED[name] = _harness(name, smoke, results_dir, env, budget)
        return
    start_children([name])
    with CHILDREN.pop(name) as child:
        progress.SKIPPED[name] = child.submit(_harness, name, smoke, results_dir, env, budget).result()


def _harness(name, smoke, results_dir, env, budget):
    """Run harness `name`; return how many cases its budget left out."""
    from mingru import bench
    from mingru.bench import progress
    bench.run(name, quick=smoke, out=results_dir, budgets={} if smoke else {name: budget}, env=env, draw=False)
    return progress.SKIPPED.get(name, 0)


def draw_figures(harnesses, results_dir):
    """The figures of `harnesses` from their result files, in spawned processes side by side."""
    from mingru import bench
    from mingru.bench import plots
    names = [bench._module(name).NAME for name in harnesses]
    names = [name for name in names if (Path(results_dir) / f"{name}.json").exists()]  # a failed harness has none
    if not names:
        return []
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(4, len(names)), mp_context=context) as pool:
        return [path for paths in pool.map(plots.draw, names, [results_dir] * len(names)) for path in paths]


def kernel_env():
    """The environment of a chapter's kernel: the chapters run side by side (NOTEBOOK_WORKERS, beside the
    figures), so each gets an equal share of the CPU cores for its torch threads (OMP_NUM_THREADS), unless
    the caller set OMP_NUM_THREADS: a chapter that times CPU code then times its share, not a core
    oversubscribed by the other kernels' threads."""
    share = max(1, (os.cpu_count() or 1) // (NOTEBOOK_WORKERS + 1))
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(share))}


def run_notebook(key, smoke, out, kernel, results_dir, timeout=None):
    """Execute one chapter with papermill in its own process (so chapters can run side by side).

    papermill clears a notebook's outputs when it starts, so an in-place run executes into a
    partial file beside the chapter and replaces the chapter only when every cell ran: a failed
    or stopped run leaves the committed notebook as it was. A kernel that dies while it starts
    (before any cell) is started again, up to KERNEL_START_TRIES times in all.
    """
    name = chapters()[key]
    source = NOTEBOOKS / f"{name}.ipynb"
    params = {"SMOKE": smoke, "MEASURE": False}
    if smoke:
        target = out / "notebooks" / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        params["RESULTS_DIR"] = str(RESULTS)
    else:
        target = source
    partial = target.with_name(f".{name}.partial.ipynb")
    # paths relative to the repository: papermill records them in the notebook's metadata
    cmd = [sys.executable, "-m", "papermill", os.path.relpath(source, ROOT), os.path.relpath(partial, ROOT),
           "-k", kernel, "--cwd", "notebooks", "--no-progress-bar", "--no-log-output"]
    for key_, value in params.items():
        cmd += ["-p", key_, str(value)]
    deadline = None if timeout is None else time.monotonic() + timeout
    for attempt in range(1, KERNEL_START_TRIES + 1):
        left = None if deadline is None else max(deadline - time.monotonic(), 1.0)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=left, cwd=ROOT, env=kernel_env())
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"stopped at the run's deadline after {timeout:.0f} s; {target} keeps its earlier "
                               "outputs") from None
        if done.returncode == 0 or KERNEL_START_FAILURE not in done.stdout + done.stderr:
            break
        if attempt < KERNEL_START_TRIES:
            print(f"   {name}: the Jupyter kernel died before it answered; starting it again "
                  f"({attempt + 1} of {KERNEL_START_TRIES})", flush=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise RuntimeError(f"papermill exited with {done.returncode}:\n{tail}\n"
                           f"the executed notebook, with the error: {partial} ({target} keeps its earlier outputs)")
    import nbformat  # papermill's own reader and writer: the file reads as papermill wrote it
    executed = nbformat.read(partial, as_version=nbformat.NO_CONVERT)
    executed.metadata.papermill.output_path = os.path.relpath(target, ROOT)
    nbformat.write(executed, target)
    partial.unlink()
    return target


def timed(label, budget, fn, record):
    """Run one step, print its wall time against its budget, and append it to `record`."""
    start = time.monotonic()
    print(f"== {label} (budget {budget} s)", flush=True)
    try:
        fn()
        ok, why = True, None
    except Exception as err:  # report and go on with the next step; the exit code says it failed
        ok, why = False, str(err).strip()
    seconds = time.monotonic() - start
    print(f"== {label}: {'ok' if ok else 'FAILED'} in {seconds:.0f} s" + ("" if ok else "\n    " + why.replace(
        "\n", "\n    ")), flush=True)
    record.append({"step": label, "seconds": round(seconds, 1), "budget_s": budget, "ok": ok})
    return ok


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    smoke = args.smoke or not has_gpu()
    keys = [args.chapter] if args.chapter else list(chapters())
    harnesses = [] if args.no_measure else [h for h, (ch, _) in HARNESSES.items() if ch in keys]
    out = args.out.resolve()
    results_dir = out / "results" if smoke else RESULTS
    steps = plan(harnesses, [chapters()[k] for k in keys], compile_first=not smoke, budget_scale=args.budget_scale)
    cache = triton_cache_state()
    scaled = "" if args.budget_scale == 1 else f", harnesses' budgets x {args.budget_scale:g}"
    print(f"reproduce: {len(steps)} steps, budget {sum(b for _, b in steps)} s in all (H200, cold cache{scaled}); "
          f"Triton cache {cache}")
    for label, budget in steps:
        print(f"  {label:<32} {budget:>4} s")
    if smoke:
        print(f"CPU smoke run (no GPU{' used' if args.smoke else ' here'}): harnesses run with --quick into "
              f"{results_dir}, notebooks execute into {out / 'notebooks'} with SMOKE=True and render the "
              f"committed {RESULTS}.", flush=True)
    record, start = [], time.monotonic()
    env = None

    def progress():
        """After every harness the record so far is written (complete: false), so a run stopped
        from outside still says how long each finished step took."""
        write_record(results_dir, record, time.monotonic() - start, cache, env, keys, smoke, complete=False)

    if harnesses:
        import torch

        from mingru.bench import env as environment
        if smoke:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels through the interpreter on CPU tensors
        env = environment.environment(torch.device("cpu" if smoke else "cuda"), smoke=smoke)
        if not smoke:
            start_children(harnesses)
            timed("compile ahead", COMPILE_BUDGET_S, lambda: compile_ahead(harnesses, keys, env), record)
            progress()
    for name in harnesses:
        budget = harness_budget(name, args.budget_scale)
        if args.deadline and time.monotonic() - start > args.deadline - NOTEBOOK_RESERVE_S:
            print(f"== bench {name}: skipped (the run's deadline of {args.deadline:.0f} s is near); "
                  f"results/ keeps its earlier file", flush=True)
            record.append({"step": f"bench {name}", "seconds": 0.0, "budget_s": budget, "ok": False,
                           "skipped": "deadline"})
            continue
        timed(f"bench {name}", budget, lambda: run_harness(name, smoke, results_dir, env, budget), record)
        cut = left_out(name)
        if cut:
            record[-1]["left_out"] = cut
            print(f"   {name}: its time budget left {cut} cases out (its result file says so)", flush=True)
        progress()
    left = (lambda: max(30.0, args.deadline - (time.monotonic() - start))) if args.deadline else (lambda: None)
    # The notebooks only render results (MEASURE=False), so they run side by side, each in its own
    # kernel process, beside the drawing of the figures; the harnesses before them ran alone, so
    # nothing disturbed their timings.
    jobs = [lambda: timed("figures", FIGURES_BUDGET_S, lambda: draw_figures(harnesses, results_dir), record)
            ] if harnesses else []
    jobs += [lambda key=key: timed(f"notebook {chapters()[key]}", NOTEBOOK_BUDGET_S,
                                   lambda: run_notebook(key, smoke, out, args.kernel, results_dir, left()), record)
             for key in keys]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(keys), NOTEBOOK_WORKERS) + bool(harnesses))) as pool:
        list(pool.map(lambda job: job(), jobs))
    total = time.monotonic() - start
    failed = [r["step"] for r in record if not r["ok"]]
    cut = {r["step"]: r["left_out"] for r in record if r.get("left_out")}
    write_record(results_dir, record, total, cache, env, keys, smoke, complete=not failed and not cut)
    if smoke:
        needs = [f"  [{k}] {NEEDS_GPU[k]}" for k in keys if k in NEEDS_GPU]
        print("needs a GPU (run `make reproduce` there; the smoke run only exercised the code paths):\n"
              + "\n".join(needs) if needs else "nothing in this chapter needs a GPU")
    print(f"reproduce: {total:.0f} s in all")
    if cut:
        print("reproduce: time budgets left cases out (a slower GPU than the budgets': raise them with "
              f"--budget-scale, now {args.budget_scale:g}; make reproduce ARGS=\"--budget-scale 4\"): "
              + ", ".join(f"{step} {n}" for step, n in cut.items()))
    if failed:
        print(f"reproduce: {len(failed)} step(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("reproduce: all steps passed")
    return 0


def left_out(name):
    """Cases the harness `name`'s last sweep left out when its budget was spent."""
    from mingru.bench import progress
    return progress.SKIPPED.get(name, 0)


def compile_ahead(harnesses, keys, env):
    """The run-wide compile pool, and where its worker time went, per harness function. With the
    chapter that trains the mixers (07) it also compiles that chapter's GPU training runs."""
    from mingru import bench, train
    from mingru.bench import warm
    extra = [("mingru.train:warm_run", train.demo_runs("cuda"))] if "07" in keys else []
    seconds = bench.compile_ahead(harnesses, env=env, extra=extra)
    spent = ", ".join(f"{target.rsplit('.', 1)[-1]} {s:.0f} (longest call {warm.LONGEST[target]:.0f})"
                      for target, s in sorted(warm.SPENT.items(), key=lambda kv: -kv[1]))
    print(f"   {seconds:.0f} s in the pool; worker seconds by harness function: {spent or 'none'}", flush=True)


def write_record(results_dir, record, total, cache, env, keys, smoke, complete=True):
    """results/reproduce.json: this run's steps, their wall times and budgets, commit, GPU, cache state,
    complete (the run reached its end with every step ok and no case left out by a time budget: the
    files in results/ are then this run's, all of them), and the worker seconds of the compile
    pools per harness function (each one's longest call, and its calls that raised in the pool:
    their cases compiled in the sweep instead)."""
    from mingru.bench import env as environment
    from mingru.bench import warm
    # the state at the run's start: by its end the run has rewritten results/, which git tracks
    commit, dirty = (env["git_commit"], env["git_dirty"]) if env else environment.git_state()
    data = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": commit, "git_dirty": dirty, "gpu": (env or {}).get("gpu") or environment.gpu_record()["gpu"],
            "smoke": smoke, "triton_cache": cache, "chapters": keys, "complete": complete,
            "total_s": round(total, 1), "budget_s": sum(r["budget_s"] for r in record), "steps": record,
            "compile_worker_s": {target: round(s, 1) for target, s in sorted(warm.SPENT.items())},
            "compile_longest_call_s": {target: round(s, 1) for target, s in sorted(warm.LONGEST.items())},
            "compile_failures": {target: {"calls": n, "first": first} for target, (n, first) in sorted(warm.FAILED.items())}}
    path = Path(results_dir) / "reproduce.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
