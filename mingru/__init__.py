"""mingru: the four scans of the minGRU family, as eager references and Triton kernels, and the
mixers, blocks and stacks built on them (the API of mingru-scans 0.2.0)."""
from mingru.blocks import MinGRUBlock, MinGRUStack
from mingru.dispatch import ScanFallback, scan_mode
from mingru.mixers import GivensMinGRU, MinGRU, RotationMinGRU, SignedMinGRU
from mingru.ops import (gated_recurrence, gated_recurrence_stacked, linear_recurrence, linear_scan, matrix_affine_scan,
                        matrix_recurrence, matrix_scan, parallel_scan_log, rotation_recurrence,
                        signed_recurrence_stacked)

__all__ = ["ScanFallback", "scan_mode", "MinGRU", "SignedMinGRU", "RotationMinGRU", "GivensMinGRU",
           "DeltaMinGRU", "MinGRUBlock", "MinGRUStack",
           "linear_scan", "linear_recurrence", "parallel_scan_log", "gated_recurrence",
           "gated_recurrence_stacked", "signed_recurrence_stacked", "matrix_scan",
           "matrix_affine_scan", "matrix_recurrence", "rotation_recurrence"]
__version__ = "0.1.0"


def __getattr__(name):
    # DeltaMinGRU lives in its own module, loaded on first use (`from mingru import *` included).
    if name == "DeltaMinGRU":
        from mingru.blocks import mixer_class
        return mixer_class("delta")
    raise AttributeError(f"module 'mingru' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"DeltaMinGRU"})
