"""What every kernel module shares on the Python side: envelope checks, dtypes, TF32 switch, op registration."""
import contextlib

import torch
from torch.library import triton_op

try:  # the switch triton_op's own eager implementation uses; private, so tolerate its absence
    from torch._library.triton import set_wrap_triton_enabled as _wrap_triton_enabled
except ImportError:  # pragma: no cover - older torch: launches go through the (slower) wrapper
    _wrap_triton_enabled = lambda enabled: contextlib.nullcontext()  # noqa: E731

from mingru.dispatch import ScanFallback

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BLOCK_SIZES = (1, 2, 4, 8, 16)  # the k and v the matrix kernels are compiled for

_dot_precision = "ieee"


def dot_precision():
    """`input_precision` for every tl.dot that feeds a state: 'ieee' unless a caller opts out."""
    return _dot_precision


@contextlib.contextmanager
def allow_tf32_dots(enabled=True):
    """Let tl.dot use TF32 tensor cores inside this block (for the precision notebook only)."""
    global _dot_precision
    old, _dot_precision = _dot_precision, ("tf32" if enabled else "ieee")
    try:
        yield
    finally:
        _dot_precision = old


def require(condition, reason):
    if not condition:
        raise ScanFallback(reason)


def require_dtype(x):
    require(x.dtype in KERNEL_DTYPES, f"dtype {x.dtype} is outside the kernel envelope")


# Plain Python on purpose: triton.cdiv and triton.next_power_of_2 are JIT-aware functions, slow
# enough per call to show in the host time of a launch.
def cdiv(a, b):
    return -(-a // b)


def next_pow2(n):
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cotangent(g, like):
    """The cotangent of output `like` as the backward launchers take it: autograd passes None for
    an unused output, which is zeros. (The launchers make every cotangent contiguous themselves.)"""
    return torch.zeros_like(like) if g is None else g


def states_setup(ctx, inputs, output):
    """setup_context of a states-only op (A, X, h0) -> h: saves A, h0 and h, and whether h0 was given."""
    A, _, h0 = inputs
    ctx.has_h0 = h0 is not None
    ctx.save_for_backward(A, h0, output)


def states_grad(ctx, backward, g):
    """The grad of a states-only op: backward(A, h0, h, g) -> (dA, dX, dh0); dh0 only for a given h0."""
    A, h0, h = ctx.saved_tensors
    dA, dX, dh0 = backward(A, h0, h, cotangent(g, h))
    return dA, dX, (dh0 if ctx.has_h0 else None)


def scan_op(name, forward, backward, setup_context, grad):
    """Register a kernel pair as the custom ops mingru::<name> and mingru::<name>_backward, and
    return the callable the entry points use.

    forward(*inputs) and backward(*saved) are plain launchers with type hints; setup_context and
    grad(ctx, backward, *cotangents) follow torch.library.register_autograd. Under torch.compile
    the callable is the registered triton_op, which the compiler traces without a graph break. In
    eager it is an autograd.Function over the same launchers: the custom-op dispatcher costs tens
    of microseconds of host time per call, and wrap_triton's launch path (which the launchers use
    so that tracers see the kernels) hundreds more on the H200 host; both are longer than the
    kernel itself at the seed's small shapes (see notebooks/04_speedups). Inference calls (no input
    requires grad, or grad mode off) skip the autograd.Function as well.
    """
    ops = torch.ops.mingru
    triton_op(f"mingru::{name}", mutates_args=())(forward)
    triton_op(f"mingru::{name}_backward", mutates_args=())(backward)
    registered, registered_backward = getattr(ops, name), getattr(ops, f"{name}_backward")
    torch.library.register_autograd(f"mingru::{name}", lambda ctx, *g: grad(ctx, registered_backward, *g),
                                    setup_context=setup_context)
    def direct_forward(ctx, *inputs):  # the ctx-first form: apply() then skips binding by signature
        with _wrap_triton_enabled(False):
            output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    def direct_backward(ctx, *g):
        with _wrap_triton_enabled(False):
            return grad(ctx, backward, *g)

    direct = type(name, (torch.autograd.Function,), {
        "forward": staticmethod(direct_forward), "backward": staticmethod(direct_backward)})

    def call(*inputs):
        # Any tracer (dynamo, make_fx, export, fake tensors) sees the registered op; plain eager
        # launches the kernels directly, without wrap_triton's per-launch tracing machinery.
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
            return registered(*inputs)
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
            return direct.apply(*inputs)
        with _wrap_triton_enabled(False):  # inference: no graph to record, so no autograd.Function
            return forward(*inputs)
    return call
