"""unit_lower_solve: X = (I + L)^{-1} R for strictly lower triangular L (..., M, M), M <= MAX_M.

This is the UT transform of the chunked delta rule, one small system per chunk and head. One
program per matrix builds the inverse by forward substitution, a row at a time,
    inv[i, :] = e_i - sum_{l < i} L[i, l] inv[l, :],
with the whole M x M inverse in registers; the solve is then one batched matmul. Only the
strictly lower part of L is read (the unit diagonal is implied), as in
torch.linalg.solve_triangular(L, R, upper=False, unitriangular=True), the eager reference.

The backward recomputes the inverse instead of saving it: with cotangent G,
    dR = inv^T G,   dL = -tril(dR X^T, -1).
"""
import torch
import triton
import triton.language as tl

from mingru.dispatch import ScanFallback
from mingru.kernels.common import check_envelope, launch, next_pow2, planned, scan_op

MAX_M = 64  # the largest system one program inverts in registers (larger ones run eager)


@triton.jit
def _inverse_kernel(L, INV, M, MP: tl.constexpr, F64: tl.constexpr):
    """INV[m] = (I + strict_lower(L[m]))^{-1} for contiguous (batch, M, M) L and INV; MP >= M.

    L's strictly lower part is loaded once; the program holds the transpose, inv^T, so that each
    row's sum runs along axis 1, and picks row i of L out of its registers by a masked sum."""
    base = tl.program_id(0).to(tl.int64) * M * M
    r = tl.arange(0, MP)
    acc = tl.float64 if F64 else tl.float32
    lower = tl.load(L + base + r[:, None] * M + r[None, :], mask=(r[None, :] < r[:, None]) & (r[:, None] < M),
                    other=0.0).to(acc)
    inv_t = tl.where(r[:, None] == r[None, :], 1.0, 0.0).to(acc)
    for i in range(1, M):
        row = tl.sum(tl.where(r[:, None] == i, lower, 0.0), 0)               # L[i, l], zero for l >= i
        new = tl.where(r == i, 1.0, 0.0) - tl.sum(inv_t * row[None, :], 1)  # columns l >= i hold no part
        inv_t = tl.where(r[None, :] == i, new[:, None], inv_t)
    tl.store(INV + base + r[None, :] * M + r[:, None], inv_t.to(INV.dtype.element_ty),
             mask=(r[:, None] < M) & (r[None, :] < M))


@planned
def _plan(M, f64):
    """The inverse kernel's arguments besides the tensors, for M x M systems."""
    mp = max(16, next_pow2(M))
    # of 1, 2, 4 and 8 warps, 2 ran fastest for 64 x 64 on an H200: smaller systems keep at least
    # its elements per thread
    return dict(M=M, MP=mp, F64=f64, num_warps=max(1, mp * mp // 2048))


def _inverse(L):
    M = L.shape[-1]
    L = L.contiguous()
    inv = torch.empty_like(L)
    launch(_inverse_kernel, (L.numel() // (M * M),), _plan(M, L.dtype == torch.float64), L=L, INV=inv)
    return inv


def _forward(L: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    return _inverse(L) @ R


def _backward(L: torch.Tensor, X: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dR = _inverse(L).mT @ G
    return -(dR @ X.mT).tril(-1), dR


_solve = scan_op("unit_lower_solve", _forward, _backward, saved=(0,))


def unit_lower_solve(L, R):
    """The Triton path of `scans.unit_lower_solve`; ScanFallback outside float32/float64 and M <= MAX_M."""
    check_envelope(L)
    if L.shape[-1] > MAX_M:
        raise ScanFallback(f"M = {L.shape[-1]}: one program inverts systems of M <= {MAX_M}")
    if L.dtype not in (torch.float32, torch.float64) or R.dtype != L.dtype:
        raise ScanFallback(f"unit_lower_solve takes float32 or float64 L and R of one dtype, got {L.dtype} "
                           f"and {R.dtype}")
    if L.numel() == 0:
        return R.clone()
    return _solve(L, R)
