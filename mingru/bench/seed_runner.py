"""Measure the seed (mingru-scans, which imports as `mingru`) in its own process.

    python seed_runner.py SEED_DIR JOBS.pt

Run as a script, never imported: SEED_DIR goes first on sys.path so `import mingru` is the
seed, and the measuring protocol is this package's `timing.py` loaded by file path (it imports
torch only). JOBS.pt holds the inputs, cotangents and references (float64 results rounded to
float32) that the main process made, so both sides are measured on the same tensors; each job is
checked before it is timed.

Lockstep protocol, so that the two sides are timed in alternation under the same host conditions:
the runner prints `VERSION <version>`, then for each job waits for a line on stdin (end of input
stops it), runs the job and prints `RESULT <json>`; a line `wall` instead times the last job's
step once more (`timing.again`, one more wall-clock round) and prints `WALL <µs or null>`. The
main process measures its own side of a job, and of each round, while the runner waits.
"""
import copy
import importlib.util
import json
import math
import os
import sys
from pathlib import Path


def _load_timing():
    spec = importlib.util.spec_from_file_location("bench_timing", Path(__file__).with_name("timing.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _to(xs, device):
    return tuple(None if x is None else x.to(device) for x in xs)


def run_op(seed, timing, job, device):
    """One of the seed's scan functions on the job's inputs: outputs and gradients vs float64."""
    fn = getattr(seed, job["name"])
    inputs = _to(job["inputs"], device)
    want_out = _to(job["want_out"], device)
    if job["direction"] == "fwd":
        def compute():
            with timing.torch.no_grad():
                return _outputs(fn(*inputs)), ()

        def step():
            with timing.torch.no_grad():
                fn(*inputs)
        return timing.check_then_time(compute, (want_out, ()), job["tol"], step, device, (),
                                      job["reps"], job["gpu_time"], rounds=job.get("wall_rounds", 1))
    leaves = tuple(x.detach().requires_grad_() for x in inputs)
    cot = _to(job["cot"], device)

    def compute():
        outs = _outputs(fn(*leaves))
        return tuple(o.detach() for o in outs), timing.torch.autograd.grad(outs, leaves, cot)
    step = lambda: timing.torch.autograd.backward(_outputs(fn(*leaves)), cot)  # noqa: E731
    return timing.check_then_time(compute, (want_out, _to(job["want_grads"], device)), job["tol"],
                                  step, device, leaves, job["reps"], job["gpu_time"], rounds=job.get("wall_rounds", 1))


def run_module(seed, timing, job, device, build=None, wrap=None):
    """A layer's fwd+bwd on the job's input, checked against its own float64 copy (eager).

    build(job) makes the module (default: the namespace's class `job['name']` called with job['args']);
    wrap(module) is what gets called (e.g. torch.compile of it); its parameters are the module's.
    """
    torch = timing.torch
    torch.manual_seed(job["seed"])
    dtype = getattr(torch, job["dtype"])
    module = build(job) if build else getattr(seed, job["name"])(*job["args"], **job["kwargs"])
    reference = copy.deepcopy(module).double().to(device)
    module = module.to(device, dtype)
    params = tuple(module.parameters())
    module = wrap(module) if wrap else module
    x = job["x"].to(device)
    with timing.scan_impl("eager"):
        x64 = x.double().requires_grad_()
        ref_out = _outputs(reference(x64))
        cot = tuple(torch.randn_like(o) for o in ref_out)
        want = (tuple(o.detach() for o in ref_out),
                torch.autograd.grad(ref_out, (x64, *reference.parameters()), cot))
    cot = tuple(c.to(dtype) for c in cot)
    leaf = x.detach().requires_grad_()

    def compute():
        outs = _outputs(module(leaf))
        return tuple(o.detach() for o in outs), torch.autograd.grad(outs, (leaf, *params), cot)
    step = lambda: torch.autograd.backward(_outputs(module(leaf)), cot)  # noqa: E731
    with timing.scan_impl(job.get("mode", "auto")):
        got = timing.check_then_time(compute, want, job["tol"], step, device, (leaf, *params),
                                     job["reps"], job["gpu_time"], rounds=job.get("wall_rounds", 1))
        if got["status"] == "ok" and job.get("memory"):
            got["peak_mb"] = timing.peak_mb(step, device)
    return got


def main(seed_dir, jobs_path):
    seed_dir = str(Path(seed_dir).resolve())
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [seed_dir] + [p for p in sys.path if p not in ("", here)]
    timing = _load_timing()
    import mingru as seed
    if not str(Path(seed.__file__).resolve()).startswith(seed_dir):
        raise SystemExit(f"seed_runner: `import mingru` found {seed.__file__}, not the seed in {seed_dir}")
    spec = timing.torch.load(jobs_path, weights_only=False)
    device = spec["device"]
    print("VERSION", _version(seed_dir), flush=True)
    jobs = iter(spec["jobs"])
    for line in iter(sys.stdin.readline, ""):
        if line.strip() == "wall":  # one more wall-clock round of the last job
            try:
                us = timing.again()
            except Exception:  # noqa: BLE001  (a round that fails has no time)
                us = None
            print("WALL", json.dumps(us if us is not None and math.isfinite(us) else None), flush=True)
            continue
        job = next(jobs, None)
        if job is None:
            return
        start = timing.time.monotonic()
        try:
            run = run_op if job["kind"] == "op" else run_module
            got = run(seed, timing, job, device)
        except Exception as exc:  # noqa: BLE001  (a job the seed cannot run becomes a status)
            got = {"us": None, "gpu_us": None, "err": None, "status": timing.failure(exc)}
        got["job_s"] = timing.time.monotonic() - start  # check, timing and memory of this job
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in got.items()}
        print("RESULT", json.dumps(clean), flush=True)


def _version(seed_dir):
    found = sorted(Path(seed_dir).glob("mingru_scans-*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-", 1)[1] if found else "unknown"


if __name__ == "__main__":
    os.environ.setdefault("MINGRU_SCAN", "auto")
    main(*sys.argv[1:3])
