"""mingru: the four scans of the minGRU family, as eager references and Triton kernels."""
from mingru.dispatch import ScanFallback, scan_mode
from mingru.mixers import GivensMinGRU, MinGRU, RotationMinGRU, SignedMinGRU
from mingru.ops import (linear_recurrence, linear_scan, matrix_affine_scan, matrix_recurrence,
                        matrix_scan, parallel_scan_log, rotation_recurrence)

__all__ = ["ScanFallback", "scan_mode", "MinGRU", "SignedMinGRU", "RotationMinGRU", "GivensMinGRU",
           "linear_scan", "linear_recurrence", "parallel_scan_log", "matrix_scan",
           "matrix_affine_scan", "matrix_recurrence", "rotation_recurrence"]
__version__ = "0.1.0"
