"""unit_lower_solve: X = (I + L)^{-1} R for strictly lower triangular L (..., M, M), M <= MAX_M.

This is the UT transform of the chunked delta rule, one small system per chunk and head. One
program per matrix builds the inverse in BLOCK x BLOCK blocks: each diagonal block D_j by forward
substitution, a row at a time,
    inv[i, :] = e_i - sum_{l < i} L[i, l] inv[l, :],
then the blocks below the diagonal, block row by block row,
    X_ij = -D_i sum_{j <= l < i} L_il X_lj   (X_jj = D_j),
so the sequential part is BLOCK - 1 steps on small blocks and the rest is products of blocks.
Only the strictly lower part of L is read (the unit diagonal is implied), as in
torch.linalg.solve_triangular(L, R, upper=False, unitriangular=True), the eager reference. The
products of blocks are IEEE dots in the accumulation dtype (never TF32). The solve is then one
batched matmul.

The backward recomputes the inverse instead of saving it: with cotangent G,
    dR = inv^T G,   dL = -tril(dR X^T, -1).
"""
import torch
import triton
import triton.language as tl

from mingru.dispatch import ScanFallback
from mingru.kernels.common import cdiv, check_envelope, launch, next_pow2, planned, scan_op

BLOCK = 16      # the side of the blocks one program inverts and multiplies
MAX_M = 4 * BLOCK  # the program holds a 4 x 4 grid of blocks (larger systems run eager)
INVERSE_WARPS = 1  # per program: fastest of 1, 2, 4, 8 on an H100 for 64 x 64 systems


@triton.jit
def _load_block(L, base, M, i, j, BS: tl.constexpr, F64: tl.constexpr):
    """Block (i, j) of L's strictly lower part, zero outside M x M."""
    r = tl.arange(0, BS)
    rows, cols = i * BS + r[:, None], j * BS + r[None, :]
    block = tl.load(L + base + rows * M + cols, mask=(rows < M) & (cols < rows), other=0.0)
    return block.to(tl.float64 if F64 else tl.float32)


@triton.jit
def _store_block(INV, base, M, i, j, x, BS: tl.constexpr):
    r = tl.arange(0, BS)
    rows, cols = i * BS + r[:, None], j * BS + r[None, :]
    tl.store(INV + base + rows * M + cols, x.to(INV.dtype.element_ty), mask=(rows < M) & (cols < M))


@triton.jit
def _unit_lower_inverse(lower, BS: tl.constexpr):
    """(I + lower)^{-1} of one strictly lower block by forward substitution. The transpose is built
    (each row's sum then runs along axis 1) and row i of `lower` is picked by a masked sum."""
    r = tl.arange(0, BS)
    inv_t = tl.where(r[:, None] == r[None, :], 1.0, 0.0).to(lower.dtype)
    for i in range(1, BS):
        row = tl.sum(tl.where(r[:, None] == i, lower, 0.0), 0)               # L[i, l], zero for l >= i
        new = tl.where(r == i, 1.0, 0.0) - tl.sum(inv_t * row[None, :], 1)  # columns l >= i hold no part
        inv_t = tl.where(r[None, :] == i, new[:, None], inv_t)
    return tl.trans(inv_t)


@triton.jit
def _mm(a, b):
    """a @ b for two blocks in their dtype: IEEE products, never TF32 (a broadcast product summed
    over the middle axis compiles to a dot of the default precision, TF32)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _inverse_kernel(L, INV, M, BS: tl.constexpr, NB: tl.constexpr, F64: tl.constexpr):
    """INV[m] = (I + strict_lower(L[m]))^{-1} for contiguous (batch, M, M) L and INV, as an NB x NB
    grid of BS x BS blocks, NB = cdiv(M, BS) <= 4 (a block past M is the identity's: not stored)."""
    base = tl.program_id(0).to(tl.int64) * M * M
    zero = tl.zeros((BS, BS), tl.float64 if F64 else tl.float32)
    D0 = _unit_lower_inverse(_load_block(L, base, M, 0, 0, BS, F64), BS)
    _store_block(INV, base, M, 0, 0, D0, BS)
    if NB >= 2:
        L10 = _load_block(L, base, M, 1, 0, BS, F64)
        D1 = _unit_lower_inverse(_load_block(L, base, M, 1, 1, BS, F64), BS)
        X10 = -_mm(D1, _mm(L10, D0))
        _store_block(INV, base, M, 0, 1, zero, BS)
        _store_block(INV, base, M, 1, 0, X10, BS)
        _store_block(INV, base, M, 1, 1, D1, BS)
    if NB >= 3:
        L20, L21 = _load_block(L, base, M, 2, 0, BS, F64), _load_block(L, base, M, 2, 1, BS, F64)
        D2 = _unit_lower_inverse(_load_block(L, base, M, 2, 2, BS, F64), BS)
        X21 = -_mm(D2, _mm(L21, D1))
        X20 = -_mm(D2, _mm(L20, D0) + _mm(L21, X10))
        for j in range(2):
            _store_block(INV, base, M, j, 2, zero, BS)
        _store_block(INV, base, M, 2, 0, X20, BS)
        _store_block(INV, base, M, 2, 1, X21, BS)
        _store_block(INV, base, M, 2, 2, D2, BS)
    if NB >= 4:
        L30, L31 = _load_block(L, base, M, 3, 0, BS, F64), _load_block(L, base, M, 3, 1, BS, F64)
        L32 = _load_block(L, base, M, 3, 2, BS, F64)
        D3 = _unit_lower_inverse(_load_block(L, base, M, 3, 3, BS, F64), BS)
        X32 = -_mm(D3, _mm(L32, D2))
        X31 = -_mm(D3, _mm(L31, D1) + _mm(L32, X21))
        X30 = -_mm(D3, _mm(L30, D0) + _mm(L31, X10) + _mm(L32, X20))
        for j in range(3):
            _store_block(INV, base, M, j, 3, zero, BS)
        _store_block(INV, base, M, 3, 0, X30, BS)
        _store_block(INV, base, M, 3, 1, X31, BS)
        _store_block(INV, base, M, 3, 2, X32, BS)
        _store_block(INV, base, M, 3, 3, D3, BS)


@planned
def _plan(M, f64):
    """The inverse kernel's arguments besides the tensors, for M x M systems."""
    bs = BLOCK if M > BLOCK else max(2, next_pow2(M))  # one block: as small as M allows
    return dict(M=M, BS=bs, NB=cdiv(M, bs), F64=f64, num_warps=INVERSE_WARPS)


def _inverse(L: torch.Tensor) -> torch.Tensor:
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


def _inverse_backward(inv: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    return -(inv.mT @ G @ inv.mT).tril(-1)  # d(inv) = -inv dL inv, on the strictly lower part read


_solve = scan_op("unit_lower_solve", _forward, _backward, saved=(0,))
_inverted = scan_op("unit_lower_inverse", _inverse, _inverse_backward, saved=())


def _check(L, R, name):
    check_envelope(L)
    if L.shape[-1] > MAX_M:
        raise ScanFallback(f"M = {L.shape[-1]}: one program inverts systems of M <= {MAX_M}")
    if L.dtype not in (torch.float32, torch.float64) or R.dtype != L.dtype:
        raise ScanFallback(f"{name} takes float32 or float64 L and R of one dtype, got {L.dtype} and {R.dtype}")


def unit_lower_solve(L, R):
    """The Triton path of `scans.unit_lower_solve`; ScanFallback outside float32/float64 and M <= MAX_M."""
    _check(L, R, "unit_lower_solve")
    if L.numel() == 0:
        return R.clone()
    return _solve(L, R)


def unit_lower_inverse(L):
    """The Triton path of `scans.unit_lower_inverse`, in the envelope of `unit_lower_solve`."""
    _check(L, L, "unit_lower_inverse")
    if L.numel() == 0:
        return L.clone()
    return _inverted(L)
