"""Triton kernels for the four scans and the angle-fused rotation recurrence.

Importing this package imports Triton; `mingru.dispatch` does so only when a kernel is needed.
Modules: `common` (envelope, dtypes, TF32 switch), `core` (the shared monoid combine, jitted),
`diagonal` (linear_scan, linear_recurrence, parallel_scan_log), `matrix` (matrix_scan,
matrix_affine_scan, matrix_recurrence), `rotation` (angle-fused Givens recurrence).
"""
import torch

if not hasattr(torch.library, "triton_op"):
    raise ImportError(f"mingru kernels need torch >= 2.6 (torch.library.triton_op); found {torch.__version__}")

import triton  # noqa: E402,F401  (ImportError here makes dispatch fall back)
