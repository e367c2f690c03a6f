"""The eager launch path that skips Triton's binder (common._direct_launch), on a stand-in kernel.

The real launcher needs a GPU (tests/test_gpu.py runs it against kernel.run); here a stand-in with
Triton's kernel and compiled-kernel interface records what reaches it: a compiled kernel is reused
exactly when everything Triton specializes on is unchanged, and gets the call's own tensors in the
kernel's parameter order.
"""
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
from mingru.kernels import common  # noqa: E402

STREAM = 1234


class _Compiled:
    function, packed_metadata = "function", "packed"

    def __init__(self):
        self.launches, self.metadata = [], []

    def run(self, *xs):  # the C launcher's signature: grid, stream, function, metadata, hooks, arguments
        self.launches.append(xs)

    def launch_metadata(self, grid, stream, *values):
        self.metadata.append((grid, stream, values))
        return "launch-metadata"


class _Kernel:
    """Parameters x, n, y, FLAG, extra=5 (a default), like a JITFunction's params and signature."""

    def __init__(self, hooks=()):
        names = ("x", "n", "y", "FLAG", "extra")
        self.params = [SimpleNamespace(name=n) for n in names]
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        self.signature = inspect.Signature([inspect.Parameter(n, kind, default=5 if n == "extra" else
                                                              inspect.Parameter.empty) for n in names])
        self.pre_run_hooks = list(hooks)
        self.compiles = []

    def run(self, grid, warmup, **kwargs):  # kernel.run: "compiles", launches once, returns the kernel
        assert not warmup
        compiled = _Compiled()
        self.compiles.append((grid, kwargs, compiled))
        return compiled


@pytest.fixture
def runtime(monkeypatch):
    knobs = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    driver = SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0,
                                                    get_current_stream=lambda device: STREAM))
    monkeypatch.setattr(common, "_runtime", (knobs, driver, _Kernel))
    monkeypatch.setattr(common, "_compiled", {})
    return knobs


PLAN = dict(n=7, FLAG=True, num_warps=4)  # a plan's arguments: one dict per signature, never modified


def _go(kernel, x, y, grid=(3, 2), args=PLAN, flag=None):
    more = dict(x=x, y=y) if flag is None else dict(x=x, y=y, FLAG=flag)
    return common._direct_launch(kernel, grid, args, more)


def test_a_repeated_signature_launches_the_compiled_kernel_with_the_new_tensors(runtime):
    kernel = _Kernel()
    compiled = _go(kernel, torch.randn(8), torch.randn(8))
    assert len(kernel.compiles) == 1 and compiled.launches == []
    x, y = torch.randn(8), torch.randn(8)
    assert _go(kernel, x, y) is compiled
    assert len(kernel.compiles) == 1
    (launch,) = compiled.launches
    assert launch[:9] == (3, 2, 1, STREAM, "function", "packed", None, None, None)
    assert launch[9] is x and launch[11] is y and launch[10] == 7 and launch[12] is True and launch[13] == 5
    assert compiled.metadata == []  # no profiler hook: no launch metadata


@pytest.mark.parametrize("change", ["misaligned", "dtype", "grid", "plan", "constexpr"])
def test_anything_triton_specializes_on_compiles_again(runtime, change):
    kernel = _Kernel()
    x, y = torch.randn(8), torch.randn(8)
    _go(kernel, x, y)
    if change == "misaligned":  # 4 bytes past a 16-byte boundary
        _go(kernel, torch.randn(9)[1:], y)
    elif change == "dtype":
        _go(kernel, x.double(), y)
    elif change == "grid":
        _go(kernel, x, y, grid=(4, 2))
    elif change == "plan":
        _go(kernel, x, y, args=dict(PLAN, n=16))
    else:  # a constexpr passed per call: True, then False
        per_call = dict(n=7, num_warps=4)
        _go(kernel, x, y, args=per_call, flag=True)
        assert len(kernel.compiles) == 2
        _go(kernel, x, y, args=per_call, flag=True)
        kernel.compiles.pop()
        _go(kernel, x, y, args=per_call, flag=False)
    assert len(kernel.compiles) == 2
    _go(kernel, x, y)
    assert len(kernel.compiles) == 2  # the first signature is still remembered


def test_a_profiler_hook_gets_the_launch_metadata(runtime):
    kernel = _Kernel()
    compiled = _go(kernel, torch.randn(8), torch.randn(8))
    runtime.launch_enter_hook = enter = lambda metadata: None  # noqa: E731
    _go(kernel, torch.randn(8), torch.randn(8))
    assert len(compiled.metadata) == 1 and compiled.launches[0][6:8] == ("launch-metadata", enter)


def test_empty_hook_chains_are_no_hooks_and_a_registered_one_is_passed(runtime):
    """Triton's hooks are chains (HookChain: a list of callables in `calls`), empty unless a profiler
    adds one: an empty chain launches like no hook at all; a chain holding one gets the metadata."""
    chain = lambda: SimpleNamespace(calls=[])  # noqa: E731
    runtime.launch_enter_hook, runtime.launch_exit_hook = chain(), chain()
    kernel = _Kernel()
    compiled = _go(kernel, torch.randn(8), torch.randn(8))
    _go(kernel, torch.randn(8), torch.randn(8))
    assert compiled.metadata == [] and compiled.launches[-1][6:9] == (None, None, None)
    runtime.launch_enter_hook.calls.append(print)
    _go(kernel, torch.randn(8), torch.randn(8))
    assert len(compiled.metadata) == 1
    assert compiled.launches[-1][6:9] == ("launch-metadata", runtime.launch_enter_hook, None)


def test_kernels_with_pre_run_hooks_or_tensor_plans_always_take_kernel_run(runtime):
    hooked = _Kernel(hooks=[lambda *a, **k: None])
    for _ in range(2):
        _go(hooked, torch.randn(8), torch.randn(8))
    assert len(hooked.compiles) == 2
    plain, plan = _Kernel(), dict(n=7, FLAG=True, y=torch.randn(8))
    for _ in range(2):
        common._direct_launch(plain, (1,), plan, dict(x=torch.randn(8)))
    assert len(plain.compiles) == 2 and id(plan) not in common._compiled  # its tensor is not held
    fresh = _Kernel()  # a new args dict per call (not a memoized plan): correct, never remembered
    for _ in range(2):
        _go(fresh, torch.randn(8), torch.randn(8), args=dict(PLAN))
    assert len(fresh.compiles) == 2
