"""Test setup: without a GPU the Triton kernels run through the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any module holding @triton.jit functions is imported,
so it is set here, at collection time, before the tests import mingru.kernels.
"""
import os

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
