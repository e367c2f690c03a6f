"""Differential test against the published mingru-scans 0.2.0 (unpacked by `make peers`).

The published package runs once, in a subprocess (it is also called `mingru`), over every case
of seedrun.py; each case is then rebuilt here from its saved state_dict (strict) and must give
the same forward outputs, gradients, chained forward and step loop.
"""
import warnings

import pytest
import torch

import mingru
import seedrun

CASES = [*seedrun.MIXER_CASES, *seedrun.STACK_CASES]


def _need_delta(name):
    if "delta" in name:
        pytest.importorskip("mingru.delta")


def _tol(x, loose=False):
    return {"atol": 1e-5, "rtol": 1e-4} if x.dtype == torch.float32 or loose else {"atol": 1e-10, "rtol": 1e-9}


def _log_space_after_capped_gap(name):
    """The published MinGRU forward (cumsum, then logcumsumexp) keeps only ~1e-6 of accuracy after
    a +inf gap capped to 1e10; its own step loop, like our forward, stays exact to float64."""
    cls, _, kind, _ = seedrun.MIXER_CASES.get(name, (None, None, None, None))
    return cls == "MinGRU" and kind == "bad"


@pytest.mark.parametrize("name", CASES)
def test_matches_published(name, seed_results, eager_mode):
    _need_delta(name)
    ref = seed_results[name]
    module, _ = seedrun.build(mingru, name)
    module.load_state_dict(ref["state_dict"], strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bad-delta_t cases warn, on both sides
        got = seedrun.run_case(module, ref["x"], ref["w"], ref["dt"], name in seedrun.STACK_CASES)
    want = {k: v for k, v in ref.items() if k not in ("state_dict", "x", "w", "dt")}
    assert sorted(got) == sorted(want)
    loose = _log_space_after_capped_gap(name)
    if loose:
        torch.testing.assert_close(got["y"], want["steps"], **_tol(want["y"]))
    for key in want:
        torch.testing.assert_close(got[key], want[key], **_tol(want[key], loose), msg=f"{name}: {key}")


@pytest.mark.parametrize("name", CASES)
def test_same_seed_same_initial_weights(name, seed_results):
    """Modules are built in the published order, so one seed gives the same initial weights."""
    _need_delta(name)
    module, _ = seedrun.build(mingru, name)
    ours, theirs = module.state_dict(), seed_results[name]["state_dict"]
    assert list(ours) == list(theirs)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], atol=0, rtol=0, msg=f"{name}: {key}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", CASES)
def test_matches_published_on_gpu(name, seed_results, monkeypatch):
    """The published checkpoints, loaded here and run in float32 through the CUDA kernels."""
    _need_delta(name)
    monkeypatch.setenv("MINGRU_SCAN", "triton")
    ref = seed_results[name]
    module, _ = seedrun.build(mingru, name)
    module.load_state_dict(ref["state_dict"], strict=True)
    module = module.to("cuda", torch.float32)
    x, w, dt = (None if t is None else t.to("cuda", torch.float32) for t in (ref["x"], ref["w"], ref["dt"]))
    got = seedrun.run_case(module, x, w, dt, name in seedrun.STACK_CASES)
    for key, want in ref.items():
        if key not in ("state_dict", "x", "w", "dt"):
            torch.testing.assert_close(got[key].cpu().double(), want.double(), atol=2e-4, rtol=2e-3,
                                       msg=f"{name}: {key}")


def test_every_published_name_is_ours(tmp_path):
    """`from mingru import *` and attribute access give every name mingru-scans 0.2.0 exports."""
    import os
    import subprocess
    import sys

    from conftest import SEED_DIR
    if not (SEED_DIR / "mingru" / "__init__.py").exists():
        pytest.skip(f"mingru-scans 0.2.0 is not unpacked in {SEED_DIR} (run `make peers`)")
    env = {**os.environ, "PYTHONPATH": str(SEED_DIR)}
    probe = "import mingru; print(mingru.__file__); print(*mingru.__all__)"
    where, published = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                                      text=True, check=True).stdout.splitlines()
    assert where.startswith(str(SEED_DIR)), where  # the published package, not ours
    names = [n for n in published.split() if n != "__version__"]
    assert names and set(names) <= set(mingru.__all__), sorted(set(names) - set(mingru.__all__))
    star = {}
    exec("from mingru import *", star)
    assert all(n in star for n in names), [n for n in names if n not in star]
