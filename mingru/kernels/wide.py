"""matrix_recurrence for wide states, k and v in WIDE_SIZES: one lane per program, one tl.dot a step.

A lane's k x v state lives in the registers of its programs, and each step applies its
transition as one matrix product, H <- A_t H + X_t. The walk is sequential in
time with a full product per step, so it pays off for few, large steps: the delta rule chains one
such map per chunk (T = sequence length / chunk size). The narrow kernels of `matrix` hold
several lanes' small states per program instead and take k, v <= 16.

A program owns BV of the v columns (the columns never mix). The backward walks the same lane in
reverse on the adjoint and reads only the forward's inputs and outputs:
  lam_t = g_t + A_{t+1}^T lam_{t+1},  dX_t = lam_t,  dh0 = A_1^T lam_1;
then dA_t = lam_t h_{t-1}^T (h_0 the initial state, zeros when none is given) is one batched
matmul over every step. Every product in the kernels is a tl.dot at the precision
`common.dot_precision` names (IEEE float32 unless lifted); states are carried in float32
(float64 for float64).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from mingru.kernels.common import dot_precision, launch, planned, scan_op

WIDE_SIZES = (32, 64)  # k and v this kernel takes (the matrix kernels take <= 16; others run eager)


@triton.jit
def _mm(a, b, F64: tl.constexpr, PREC: tl.constexpr):
    """a @ b; float64 as a broadcast sum (tl.dot has no float64 on every GPU)."""
    if F64:
        return tl.sum(a[:, :, None] * b[None, :, :], 1)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _at(lane, N, sb, sn):
    """Element offset (64-bit) of lane (b, n) = (lane // N, lane % N) given its b and n strides."""
    return (lane // N).to(tl.int64) * sb + (lane % N).to(tl.int64) * sn


@triton.jit
def _forward_kernel(A, X, H0, OUT, T, N, a_sb, a_st, a_sn, x_sb, x_st, x_sn, h_sb, h_sn, o_sb, o_st, o_sn,
                    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr,
                    F64: tl.constexpr, PREC: tl.constexpr):
    """OUT[t] = A[t] OUT[t-1] + X[t] for columns [BV * program_id(1), + BV) of one lane's state."""
    lane = tl.program_id(0)
    A, X, OUT = A + _at(lane, N, a_sb, a_sn), X + _at(lane, N, x_sb, x_sn), OUT + _at(lane, N, o_sb, o_sn)
    rk, rv = tl.arange(0, K), tl.program_id(1) * BV + tl.arange(0, BV)
    sq, kv = rk[:, None] * K + rk[None, :], rk[:, None] * V + rv[None, :]
    acc = tl.float64 if F64 else tl.float32
    if HAS_H0:
        h = tl.load(H0 + _at(lane, N, h_sb, h_sn) + kv).to(acc)
    else:
        h = tl.zeros([K, BV], acc)
    for t in range(T):
        h = _mm(tl.load(A + t * a_st + sq).to(acc), h, F64, PREC) + tl.load(X + t * x_st + kv).to(acc)
        tl.store(OUT + t * o_st + kv, h.to(OUT.dtype.element_ty))


@triton.jit
def _backward_kernel(A, G, DX, DH0, T, N, a_sb, a_st, a_sn, g_sb, g_st, g_sn, K: tl.constexpr, V: tl.constexpr,
                     BV: tl.constexpr, HAS_H0: tl.constexpr, F64: tl.constexpr, PREC: tl.constexpr):
    """The adjoint walk: DX[t] = lam_t (contiguous like OUT) and DH0 = A_1^T lam_1 (contiguous)."""
    lane = tl.program_id(0)
    A, G = A + _at(lane, N, a_sb, a_sn), G + _at(lane, N, g_sb, g_sn)
    DX = DX + _at(lane, N, T * N * K * V, K * V)
    rk, rv = tl.arange(0, K), tl.program_id(1) * BV + tl.arange(0, BV)
    sq, kv = rk[:, None] * K + rk[None, :], rk[:, None] * V + rv[None, :]
    acc = tl.float64 if F64 else tl.float32
    lam = tl.zeros([K, BV], acc)
    a_next = tl.zeros([K, K], acc)  # A_{t+1}; none after the last step
    for i in range(T):
        t = T - 1 - i
        lam = tl.load(G + t * g_st + kv).to(acc) + _mm(tl.trans(a_next), lam, F64, PREC)
        tl.store(DX + t * N * K * V + kv, lam.to(DX.dtype.element_ty))
        a_next = tl.load(A + t * a_st + sq).to(acc)
    if HAS_H0:
        tl.store(DH0 + _at(lane, N, N * K * V, K * V) + kv, _mm(tl.trans(a_next), lam, F64, PREC).to(DH0.dtype.element_ty))


def _inner(x):
    """x with dense trailing (R, C) blocks (outer strides are passed to the kernels as they are)."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def _strides(name, x):
    return {f"{name}_sb": x.stride(0), f"{name}_st": x.stride(1), f"{name}_sn": x.stride(2)}


BV = 16  # columns per program: wider blocks spilled registers on an H200 (several times slower)


def _shared(A, X):
    """The grid and the arguments besides the tensors and strides, for A (B, T, n, k, k) and X (.., v)."""
    return _plan(A.shape, X.shape[-1], A.dtype == torch.float64, dot_precision())


@planned
def _plan(shape, v, f64, prec):
    B, T, n, k, _ = shape
    return (B * n, v // BV), dict(T=T, N=n, K=k, V=v, BV=BV, F64=f64, PREC=prec, num_warps=4)


def _forward(A: torch.Tensor, X: torch.Tensor, h0: Optional[torch.Tensor]) -> torch.Tensor:
    A, X, h0 = _inner(A), _inner(X), None if h0 is None else _inner(h0)
    h = A.new_empty(X.shape)
    grid, shared = _shared(A, X)
    h_sb, h_sn = (0, 0) if h0 is None else h0.stride()[:2]
    launch(_forward_kernel, grid, shared, A=A, X=X, H0=A if h0 is None else h0, OUT=h, **_strides("a", A),
           **_strides("x", X), h_sb=h_sb, h_sn=h_sn, **_strides("o", h), HAS_H0=h0 is not None)
    return h


def _backward(A: torch.Tensor, h0: Optional[torch.Tensor], h: torch.Tensor,
              g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    A, g = _inner(A), _inner(g)
    dX = A.new_empty(h.shape)
    dh0 = A.new_empty(h0.shape) if h0 is not None else A.new_empty(0)
    grid, shared = _shared(A, h)
    launch(_backward_kernel, grid, shared, A=A, G=g, DX=dX, DH0=dh0, **_strides("a", A), **_strides("g", g),
           HAS_H0=h0 is not None)
    # dA_t = lam_t h_{t-1}^T for every step at once, h_0 the initial state (zeros if none)
    first = torch.zeros_like(h[:, :1]) if h0 is None else h0.unsqueeze(1).to(h.dtype)
    dA = dX @ torch.cat([first, h[:, :-1]], 1).mT
    return dA, dX, dh0


_matrix_recurrence = scan_op("matrix_recurrence_wide", _forward, _backward, saved=(0, 2), optional=(2,))


def matrix_recurrence(A, X, h0=None):
    """The wide kernel; `matrix.matrix_recurrence` checks the envelope (k, v in WIDE_SIZES) first."""
    return _matrix_recurrence(A, X, h0)
