"""What every kernel module shares on the Python side: envelope checks, dtypes, TF32 switch."""
import contextlib

import torch
import triton

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


def next_pow2(n):
    return triton.next_power_of_2(max(int(n), 1))
