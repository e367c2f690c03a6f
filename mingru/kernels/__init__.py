"""Triton kernels for the scans and the angle-fused rotation recurrence.

Importing this package imports Triton; `mingru.dispatch` does so only when a kernel is needed.

Vocabulary, one meaning each in every module here:
  lane       one independent recurrence: a channel of a batch row (diagonal), a (b, n) state (matrix,
             rotation).
  block      the lanes one program owns (BLOCK).
  segment    the time range one program walks. With more than one, a first pass writes each
             segment's aggregate and the second folds the earlier aggregates into its carry; or,
             in the diagonal forward's single pass (one tile per segment), each segment publishes
             its aggregate and then its inclusive prefix, and takes its carry from the segments
             before it by looking back over theirs.
  tile       the time steps a program loads and combines together inside its segment (TILE).
  injection  x_t, the additive term of h_t = a_t h_{t-1} + x_t (b, X, Bm, u, e^{log_values}).
  prefix     the scans' pair (Abar_t, Bbar_t): Abar_t = a_t ... a_1, Bbar_t = the state from zero,
             so that h_t = Abar_t h_0 + Bbar_t.
  plan       a `layout.Plan`: block, tile, segments, seg_len, warps, stages, prefetch, lookback;
             made by `layout` only.

Modules: `common` (envelope check, TF32 switch, launches, op registration with its autograd glue),
`layout` (the planner and `forced_layout`, the one override for tests and harnesses),
`core` (the affine monoid the diagonal kernels scan with), `diagonal` (linear_scan,
linear_recurrence, parallel_scan_log), `matrix` (matrix_scan, matrix_affine_scan,
matrix_recurrence), `wide` (matrix_recurrence for states of 32 or 64 rows and columns, one lane
per program), `rotation` (angle-fused Givens recurrence), `triangular` (the unit lower
triangular solves of the chunked delta rule), `delta_rule` (the whole chunked delta rule in two
kernels: DeltaMinGRU's fused form).
"""
import torch

if not hasattr(torch.library, "triton_op"):
    raise ImportError(f"mingru kernels need torch >= 2.6 (torch.library.triton_op); found {torch.__version__}")

import triton  # noqa: E402,F401  (ImportError here makes dispatch fall back)
