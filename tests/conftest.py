"""Test setup: without a GPU the Triton kernels run through the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any module holding @triton.jit functions is imported,
so it is set here, at collection time, before the tests import mingru.kernels.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def triton_mode(monkeypatch):
    """Route the public ops to the Triton kernels (interpreter on CPU)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MINGRU_SCAN", "triton")


@pytest.fixture
def eager_mode(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "eager")


SEED_DIR = Path(__file__).resolve().parents[1] / ".peers" / "mingru-scans"


@pytest.fixture(scope="session")
def seed_results(tmp_path_factory):
    """Every case of seedrun.py run once on the published mingru-scans 0.2.0, in its own process
    (it also imports as `mingru`); skipped when `make peers` has not unpacked it."""
    if not (SEED_DIR / "mingru" / "min_gru.py").exists():
        pytest.skip(f"mingru-scans 0.2.0 is not unpacked in {SEED_DIR} (run `make peers`)")
    out = tmp_path_factory.mktemp("seed") / "seed.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("seedrun.py")), str(SEED_DIR), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)
