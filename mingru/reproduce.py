"""`make reproduce [NB=04]`: regenerate results/ and re-execute the notebooks from them.

On a GPU each chapter first runs the measurements it shows (writing results/), then its notebook
is executed in place with papermill, so the committed notebooks and results/ come from one run.
Without a GPU (or with --smoke) the same steps run in their --quick CPU form into a scratch
folder, and the notebooks are executed there with SMOKE=True, rendering the committed results.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
RESULTS = ROOT / "results"

# chapter -> (notebook name, measuring steps as `python -m` argument lists, what only a GPU gives)
CHAPTERS = {
    "01": ("01_monoid", [], None),
    "02": ("02_kernel_layout", [["mingru.bench", "layout"]], "the compiled kernels' per-step latency and layout sweep"),
    "03": ("03_tf32_ieee_guard", [["mingru.precision"]], "TF32 vs IEEE errors (the interpreter ignores "
           "input_precision)"),
    "04": ("04_speedups", [["mingru.bench", "speed"], ["mingru.bench", "roofline"], ["mingru.bench", "peers"]],
           "speed, roofline and peer timings"),
    "05": ("05_memory", [["mingru.bench", "memory"]], "peak CUDA memory"),
    "06": ("06_conformance", [["mingru.bench", "parity"]], "the parity harness over the whole envelope"),
}
ALL_STEPS = [["mingru.bench", "all"], ["mingru.precision"]]


def chapter_key(text):
    """'4', '04' and '04_speedups' all name chapter '04'."""
    head = text.strip().split("_")[0]
    key = head.zfill(2) if head.isdigit() else head
    if key not in CHAPTERS or (text.strip() != head and text.strip() != CHAPTERS[key][0]):
        names = ", ".join(f"{k} ({entry[0]})" for k, entry in CHAPTERS.items())
        raise argparse.ArgumentTypeError(f"unknown chapter {text!r}; expected one of: {names}")
    return key


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m mingru.reproduce", description=__doc__.split("\n")[0])
    parser.add_argument("chapter", nargs="?", type=chapter_key,
                        help="one chapter, e.g. 04 (default: every chapter, after `bench all`)")
    parser.add_argument("--smoke", action="store_true",
                        help="take the CPU smoke path even on a GPU machine")
    parser.add_argument("--out", type=Path, default=ROOT / "scratch_out",
                        help="scratch folder of the smoke path (default: scratch_out/)")
    parser.add_argument("--no-measure", action="store_true",
                        help="skip every measurement: execute the notebooks from the results/ already there "
                             "(to split a GPU run across several device calls)")
    parser.add_argument("--kernel", default="python3", help="Jupyter kernel name (default: python3)")
    return parser.parse_args(argv)


def has_gpu():
    import torch
    return torch.cuda.is_available()


def run_step(step, smoke, out):
    cmd = [sys.executable, "-m", *step]
    if smoke:
        cmd += ["--quick", "--out", str(out / "results")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if smoke:
        env.setdefault("TRITON_INTERPRET", "1")  # kernels run through the interpreter on CPU tensors
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"`python -m {' '.join(step)}` exited with {done.returncode}:\n{tail}")


def run_notebook(key, smoke, out, kernel, measure=True):
    import papermill
    name, steps, _ = CHAPTERS[key]
    source = NOTEBOOKS / f"{name}.ipynb"
    # A chapter whose harness ran just before need not measure again inside the notebook.
    params = {"SMOKE": smoke, "MEASURE": measure and not steps}
    if smoke:
        target = out / "notebooks" / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        params["RESULTS_DIR"] = str(RESULTS)
    else:
        target = source
    with quiet_stderr() as log:
        try:
            papermill.execute_notebook(str(source), str(target), parameters=params, kernel_name=kernel,
                                       cwd=str(NOTEBOOKS), progress_bar=False, log_output=False)
        except Exception as err:
            raise RuntimeError(f"{err}\nkernel stderr (last lines):\n{log.tail()}\n"
                               f"the executed notebook, with the error: {target}") from err
    return target


class quiet_stderr:
    """Send file descriptor 2 to a temporary file: the kernel's start-up chatter is no progress line."""

    def __enter__(self):
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile(mode="w+")
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        return False

    def tail(self, lines=10):
        self.file.seek(0)
        return "\n".join(self.file.read().strip().splitlines()[-lines:])


def recorded(name, results_dir, chapter):
    """Load <results_dir>/<name>.json for a notebook, printing where its numbers come from (None if absent)."""
    from mingru.bench import report
    path = Path(results_dir) / f"{name}.json"
    if not path.exists():
        print(f"{name}.json is not in {results_dir} yet: `make reproduce NB={chapter}` on a GPU writes it.")
        return None
    data = report.load(path)
    env = data["env"]
    if env.get("smoke") or not env.get("gpu"):
        print(f"{name}.json holds a CPU smoke run, not GPU measurements: {report.env_line(env)}")
    else:
        where = f"{env['gpu']} at commit {(env.get('git_commit') or 'unknown')[:10]} ({env.get('date')})"
        print(("showing the results measured on " if has_gpu() else "no GPU here: showing the results recorded on ")
              + where)
    return data


def timed(label, fn):
    start = time.monotonic()
    print(f"  {label} ...", flush=True)
    try:
        fn()
    except Exception as err:  # report and go on with the next step; the exit code says it failed
        print(f"  {label}: FAILED after {time.monotonic() - start:.0f} s\n    "
              + str(err).strip().replace("\n", "\n    "), flush=True)
        return False
    print(f"  {label}: ok ({time.monotonic() - start:.0f} s)", flush=True)
    return True


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    smoke = args.smoke or not has_gpu()
    keys = [args.chapter] if args.chapter else list(CHAPTERS)
    steps = [] if args.no_measure else CHAPTERS[args.chapter][1] if args.chapter else ALL_STEPS
    out = args.out.resolve()
    if smoke:
        print(f"CPU smoke run (no GPU{' used' if args.smoke else ' here'}): measurements run with --quick "
              f"into {out / 'results'}, notebooks execute into {out / 'notebooks'} with SMOKE=True and "
              f"render the committed {RESULTS}.")
    failed = []
    if steps:
        print("measure:", flush=True)
        for step in steps:
            if not timed(" ".join(step[1:]) or step[0], lambda: run_step(step, smoke, out)):
                failed.append(" ".join(step))
    for key in keys:
        name = CHAPTERS[key][0]
        print(f"[{key}] {name}", flush=True)
        if not timed(f"execute {name}.ipynb", lambda: run_notebook(key, smoke, out, args.kernel, not args.no_measure)):
            failed.append(name)
    if smoke:
        needs_gpu = [f"  [{key}] {CHAPTERS[key][2]}" for key in keys if CHAPTERS[key][2]]
        print("needs a GPU (run `make reproduce` there; the smoke run only exercised the code paths):\n"
              + "\n".join(needs_gpu) if needs_gpu else "nothing in this chapter needs a GPU")
    if failed:
        print(f"reproduce: {len(failed)} step(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("reproduce: all steps passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
