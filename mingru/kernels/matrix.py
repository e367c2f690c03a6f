"""Triton kernels for the k x k recurrence: matrix_affine_scan, matrix_scan, matrix_recurrence.

All three walk S_t = A_t S_{t-1} + X_t along time, one lane per (b, n), the state in registers
as two blocks that share every transition A_t:
  P (k x k)  prefix product Abar_t = A_t ... A_1, from I, no injection (the scans only);
  H (k x v)  Bbar_t, or the states h_t of matrix_recurrence, from 0 or h0, injection X_t.
matrix_scan is the k=2, v=1 instance. The backward is the same walk in reverse time on the adjoint
  lam_t = g_t + A_{t+1}^T lam_{t+1},  dX_t = lam^H_t,  dA_t = lam_t S_{t-1}^T,  dh0 = A_1^T lam_1,
and reads only the forward's inputs and outputs (no saved intermediates, no division).

Layout (`layout.matrix`): a program owns BLOCK lanes and walks one time segment, TILE steps per
iteration (one step with PREFETCH: the next step's inputs load while this one multiplies). With
one segment that is the whole sequence. With several, a first pass writes each segment's
aggregate (its own product and offset); in the second pass each program first walks
the aggregates of the segments before its own (a short sequence with the same recurrence, so the
same code) to get its carry, then re-walks its segment from there. The backward is split the same
way, the later segments first.
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from mingru.kernels import layout, wide
from mingru.kernels.common import cdiv, check_envelope, dot_precision, launch, planned, scan_op
from mingru.validate import BLOCK_SIZES

# PMODE, how the k x k block of the forward walk behaves:
NO_P: tl.constexpr = tl.constexpr(0)    # absent (matrix_recurrence)
PROD: tl.constexpr = tl.constexpr(1)    # prefix product: starts at I, no injection
ADJ: tl.constexpr = tl.constexpr(2)     # adjoint carry of the backward: starts at 0, injected


# ---- jitted building blocks ---------------------------------------------------------------

@triton.jit
def _zeros(BLOCK: tl.constexpr, R: tl.constexpr, C: tl.constexpr, F64: tl.constexpr):
    if F64:
        z = tl.zeros([BLOCK, R, C], tl.float64)
    else:
        z = tl.zeros([BLOCK, R, C], tl.float32)
    return z


@triton.jit
def _eye(BLOCK: tl.constexpr, K: tl.constexpr, F64: tl.constexpr):
    r = tl.arange(0, K)
    return _zeros(BLOCK, K, K, F64) + tl.where(r[:, None] == r[None, :], 1.0, 0.0)[None, :, :]


@triton.jit
def _lane_ptrs(ptr, sb, sn, b, i, R: tl.constexpr, C: tl.constexpr):
    """Pointers [BLOCK, R*C] to every lane's R x C block at t = 0.

    The block is flat and its offset a known multiple of R*C (the launcher guarantees it), so
    a lane's block is one vector load held by one thread instead of being spread over several.
    """
    base = tl.multiple_of(b * sb + i * sn, R * C)
    return ptr + base[:, None] + tl.arange(0, R * C)[None, :]


@triton.jit
def _blk(x):
    """A scalar as a [1,1] block: the interpreter rejects masks that mix blocks and scalars."""
    return x + tl.zeros([1, 1], tl.int32)


@triton.jit
def _load(tile, t, st, mask, R: tl.constexpr, C: tl.constexpr, F64: tl.constexpr):
    """Every lane's R x C block at time t, as [BLOCK, R, C] in the accumulation dtype."""
    x = tl.load(tile + t * st, mask=mask, other=0.0)
    if F64:
        y = x.to(tl.float64)
    else:
        y = x.to(tl.float32)
    return tl.reshape(y, [y.shape[0], R, C])


@triton.jit
def _store(tile, t, st, x, mask):
    flat = tl.reshape(x, [x.shape[0], x.shape[1] * x.shape[2]])
    tl.store(tile + t * st, flat.to(tile.dtype.element_ty), mask=mask)


@triton.jit
def _mm(a, s, TRANS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """a @ s for every lane (a^T @ s if TRANS); a [BLOCK,K,K], s [BLOCK,K,W].

    Below k=16 a broadcast product summed in registers is exact fp32; tl.dot needs every dim
    >= 16 and, on float32, would round through TF32 unless PREC says "ieee".
    """
    if DOT:
        if TRANS:
            a = tl.permute(a, (0, 2, 1))
        y = tl.dot(a, s, input_precision=PREC)
    else:  # reshape, not [:, None]: it keeps each lane's block in the layout the loads gave it
        a4 = tl.reshape(a, [a.shape[0], a.shape[1], a.shape[2], 1])
        if TRANS:
            y = tl.sum(a4 * tl.reshape(s, [s.shape[0], s.shape[1], 1, s.shape[2]]), axis=1)
        else:
            y = tl.sum(a4 * tl.reshape(s, [s.shape[0], 1, s.shape[1], s.shape[2]]), axis=2)
    return y


@triton.jit
def _mm_nt(x, y, DOT: tl.constexpr, PREC: tl.constexpr):
    """x @ y^T for every lane; x, y [BLOCK,K,W] -> [BLOCK,K,K]."""
    if DOT:
        z = tl.dot(x, tl.permute(y, (0, 2, 1)), input_precision=PREC)
    else:
        x4 = tl.reshape(x, [x.shape[0], x.shape[1], 1, x.shape[2]])
        z = tl.sum(x4 * tl.reshape(y, [y.shape[0], 1, y.shape[1], y.shape[2]]), axis=3)
    return z


@triton.jit
def _program(BLOCK: tl.constexpr, LANES, N, seg_len, T, K: tl.constexpr, F64: tl.constexpr):
    """This program's lanes (live mask [BLOCK, 1], batch and n index), its segment c = [start, end)
    and the identity. (No pointer enters here: torch.compile's mutation analysis would count every
    pointer a call takes as reaching the lane indices it returns, and with them every store.)"""
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1)
    start = c * seg_len
    live, b, i = (lane < LANES)[:, None], (lane // N).to(tl.int64), (lane % N).to(tl.int64)
    end = tl.minimum(start + seg_len, T)
    return live, b, i, c, start, end, _eye(BLOCK, K, F64)


# ---- forward: S_t = A_t S_{t-1} + X_t ------------------------------------------------------

@triton.jit
def _fwd_load(a_tile, a_st, xp_tile, xp_st, xh_tile, xh_st, t, end, live, eye,
              K: tl.constexpr, V: tl.constexpr, PMODE: tl.constexpr, F64: tl.constexpr):
    ok = _blk(t) < end  # steps past the segment are the identity (I, 0)
    a = tl.where(ok, _load(a_tile, t, a_st, live & ok, K, K, F64), eye)
    xh = _load(xh_tile, t, xh_st, live & ok, K, V, F64)
    xp = 0.0
    if PMODE == ADJ:
        xp = _load(xp_tile, t, xp_st, live & ok, K, K, F64)
    return a, xp, xh


@triton.jit
def _fwd_step(P, H, a, xp, xh, t, end, op_tile, op_st, oh_tile, oh_st, live,
              PMODE: tl.constexpr, STORE: tl.constexpr, DOT_P: tl.constexpr, DOT_H: tl.constexpr,
              PREC: tl.constexpr):
    if PMODE != NO_P:
        P = _mm(a, P, False, DOT_P, PREC) + xp
    H = _mm(a, H, False, DOT_H, PREC) + xh
    if STORE:
        ok = live & (_blk(t) < end)
        if PMODE != NO_P:
            _store(op_tile, t, op_st, P, ok)
        _store(oh_tile, t, oh_st, H, ok)
    return P, H


@triton.jit
def _fwd_walk(P, H, a_tile, a_st, xp_tile, xp_st, xh_tile, xh_st, op_tile, op_st, oh_tile, oh_st,
              start, end, live, eye, K: tl.constexpr, V: tl.constexpr, PMODE: tl.constexpr,
              STORE: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr, F64: tl.constexpr,
              DOT_P: tl.constexpr, DOT_H: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr):
    """Steps start..end-1 of S_t = A_t S_{t-1} + X_t from the state (P, H); STORE writes every S_t.

    TILE steps per iteration: their loads do not depend on the state, so all are issued before
    the first matmul waits; STAGES > 1 lets Triton's pipeliner prefetch iterations ahead.
    PREFETCH (TILE = 1): registers hold the next step's inputs, loaded before this step's products.
    """
    if PREFETCH:
        a, xp, xh = _fwd_load(a_tile, a_st, xp_tile, xp_st, xh_tile, xh_st, start, end, live, eye, K, V, PMODE, F64)
        for t in tl.range(start, end, 1, num_stages=STAGES):
            a1, xp1, xh1 = _fwd_load(a_tile, a_st, xp_tile, xp_st, xh_tile, xh_st, t + 1, end, live, eye,
                                     K, V, PMODE, F64)
            P, H = _fwd_step(P, H, a, xp, xh, t, end, op_tile, op_st, oh_tile, oh_st, live,
                             PMODE, STORE, DOT_P, DOT_H, PREC)
            a, xh = a1, xh1
            if PMODE == ADJ:  # otherwise xp is the constant 0
                xp = xp1
    else:
        for t0 in tl.range(start, end, TILE, num_stages=STAGES):
            a0, xp0, xh0 = _fwd_load(a_tile, a_st, xp_tile, xp_st, xh_tile, xh_st, t0, end, live, eye, K, V, PMODE, F64)
            if TILE >= 2:
                a1, xp1, xh1 = _fwd_load(a_tile, a_st, xp_tile, xp_st, xh_tile, xh_st, t0 + 1, end, live, eye,
                                         K, V, PMODE, F64)
            if TILE >= 4:
                a2, xp2, xh2 = _fwd_load(a_tile, a_st, xp_tile, xp_st, xh_tile, xh_st, t0 + 2, end, live, eye,
                                         K, V, PMODE, F64)
                a3, xp3, xh3 = _fwd_load(a_tile, a_st, xp_tile, xp_st, xh_tile, xh_st, t0 + 3, end, live, eye,
                                         K, V, PMODE, F64)
            P, H = _fwd_step(P, H, a0, xp0, xh0, t0, end, op_tile, op_st, oh_tile, oh_st, live,
                             PMODE, STORE, DOT_P, DOT_H, PREC)
            if TILE >= 2:
                P, H = _fwd_step(P, H, a1, xp1, xh1, t0 + 1, end, op_tile, op_st, oh_tile, oh_st, live,
                                 PMODE, STORE, DOT_P, DOT_H, PREC)
            if TILE >= 4:
                P, H = _fwd_step(P, H, a2, xp2, xh2, t0 + 2, end, op_tile, op_st, oh_tile, oh_st, live,
                                 PMODE, STORE, DOT_P, DOT_H, PREC)
                P, H = _fwd_step(P, H, a3, xp3, xh3, t0 + 3, end, op_tile, op_st, oh_tile, oh_st, live,
                                 PMODE, STORE, DOT_P, DOT_H, PREC)
    return P, H


@triton.jit
def _forward_kernel(A, a_sb, a_st, a_sn, XH, xh_sb, xh_st, xh_sn, H0, h0_sb, h0_sn,
                    GP, gp_sb, gp_st, gp_sn, GH, gh_sb, gh_st, gh_sn,
                    OP, op_sb, op_st, op_sn, OH, oh_sb, oh_st, oh_sn, N, LANES, T, seg_len,
                    K: tl.constexpr, V: tl.constexpr, BLOCK: tl.constexpr, PMODE: tl.constexpr,
                    HAS_H0: tl.constexpr, AGG_PASS: tl.constexpr, SPLIT: tl.constexpr,
                    TILE: tl.constexpr, STAGES: tl.constexpr, F64: tl.constexpr,
                    DOT_P: tl.constexpr, DOT_H: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr):
    """Walk segment c = program_id(1) of BLOCK lanes.

    AGG_PASS: from (I, 0), write only the segment's aggregate (product, offset) to row c of OP, OH.
    Otherwise write every state to OP (if PMODE) and OH, starting (when SPLIT) from the initial
    state carried through the aggregates GP, GH of segments 0..c-1.
    """
    live, b, i, c, start, end, eye = _program(BLOCK, LANES, N, seg_len, T, K, F64)
    a_tile = _lane_ptrs(A, a_sb, a_sn, b, i, K, K)
    xh_tile = _lane_ptrs(XH, xh_sb, xh_sn, b, i, K, V)
    op_tile = _lane_ptrs(OP, op_sb, op_sn, b, i, K, K)
    oh_tile = _lane_ptrs(OH, oh_sb, oh_sn, b, i, K, V)

    H = _zeros(BLOCK, K, V, F64)
    if HAS_H0:
        H = _load(_lane_ptrs(H0, h0_sb, h0_sn, b, i, K, V), 0, 0, live, K, V, F64)
    P = _zeros(BLOCK, 1, 1, F64)  # placeholder: loop-carried values must be tensors
    if PMODE == PROD:
        P = eye
    if SPLIT:  # the aggregates are a short sequence with the same recurrence
        P, H = _fwd_walk(P, H, _lane_ptrs(GP, gp_sb, gp_sn, b, i, K, K), gp_st, a_tile, 0,
                         _lane_ptrs(GH, gh_sb, gh_sn, b, i, K, V), gh_st, op_tile, 0, oh_tile, 0, 0, c, live, eye,
                         K, V, PMODE, False, TILE, STAGES, F64, DOT_P, DOT_H, PREC, PREFETCH)
    P, H = _fwd_walk(P, H, a_tile, a_st, a_tile, 0, xh_tile, xh_st, op_tile, op_st, oh_tile, oh_st, start, end,
                     live, eye, K, V, PMODE, not AGG_PASS, TILE, STAGES, F64, DOT_P, DOT_H, PREC, PREFETCH)
    if AGG_PASS:
        _store(op_tile, c, op_st, P, live)
        _store(oh_tile, c, oh_st, H, live)


# ---- backward: lam_t = g_t + A_{t+1}^T lam_{t+1}, walked from the end -----------------------

@triton.jit
def _bwd_load(a_tile, a_st, gp_tile, gp_st, gh_tile, gh_st, sp_tile, sp_st, sh_tile, sh_st, h_init,
              t, start, T, live, eye, K: tl.constexpr, V: tl.constexpr, HAS_P: tl.constexpr,
              GRADS: tl.constexpr, F64: tl.constexpr):
    tt = _blk(t)
    ok = tt >= start  # steps before the segment are the identity
    a = tl.where(ok, _load(a_tile, t + 1, a_st, live & ok & (tt + 1 < T), K, K, F64), eye)  # A_T = 0
    gh = _load(gh_tile, t, gh_st, live & ok, K, V, F64)
    gp = 0.0
    sp = 0.0
    sh = 0.0
    if HAS_P:
        gp = _load(gp_tile, t, gp_st, live & ok, K, K, F64)
    if GRADS:  # the state before step t: S_{t-1}, or the initial [I | h0] at t = 0
        has_prev = ok & (tt >= 1)
        sh = tl.where(tt >= 1, _load(sh_tile, t - 1, sh_st, live & has_prev, K, V, F64), h_init)
        if HAS_P:
            sp = tl.where(tt >= 1, _load(sp_tile, t - 1, sp_st, live & has_prev, K, K, F64), eye)
    return a, gp, gh, sp, sh


@triton.jit
def _bwd_step(M, LP, LH, a, gp, gh, sp, sh, t, start, da_tile, da_st, dx_tile, dx_st, live,
              HAS_P: tl.constexpr, GRADS: tl.constexpr, DOT_P: tl.constexpr, DOT_H: tl.constexpr,
              PREC: tl.constexpr):
    LH = _mm(a, LH, True, DOT_H, PREC) + gh
    if HAS_P:
        LP = _mm(a, LP, True, DOT_P, PREC) + gp
    if GRADS:
        ok = live & (_blk(t) >= start)
        _store(dx_tile, t, dx_st, LH, ok)
        dA = _mm_nt(LH, sh, DOT_H, PREC)
        if HAS_P:
            dA += _mm_nt(LP, sp, DOT_P, PREC)
        _store(da_tile, t, da_st, dA, ok)
    else:  # the segment's aggregate also needs the product of its transposed transitions
        M = _mm(a, M, True, DOT_P, PREC)
    return M, LP, LH


@triton.jit
def _backward_kernel(A, a_sb, a_st, a_sn, GP, gp_sb, gp_st, gp_sn, GH, gh_sb, gh_st, gh_sn,
                     SP, sp_sb, sp_st, sp_sn, SH, sh_sb, sh_st, sh_sn, H0, h0_sb, h0_sn,
                     DA, da_sb, da_st, da_sn, DX, dx_sb, dx_st, dx_sn, DH0, dh0_sb, dh0_sn,
                     OM, om_sb, om_st, om_sn, OP, op_sb, op_st, op_sn, OH, oh_sb, oh_st, oh_sn,
                     N, LANES, T, seg_len, segments,
                     K: tl.constexpr, V: tl.constexpr, BLOCK: tl.constexpr, HAS_P: tl.constexpr,
                     HAS_H0: tl.constexpr, SPLIT: tl.constexpr, GRADS: tl.constexpr,
                     TILE: tl.constexpr, STAGES: tl.constexpr, F64: tl.constexpr,
                     DOT_P: tl.constexpr, DOT_H: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr):
    """Walk segment c backwards (PREFETCH as in `_fwd_walk`).

    GRADS writes dA, dX (and dh0), starting (when SPLIT) from lam at the start of segment c+1,
    carried through the aggregates of the later segments. Otherwise the segment's aggregate
    lam_start = M lam_end + y goes to row segments-1-c of OM, OP, OH: reversed, so the later
    segments come first and the carry is the forward walk over rows 0..segments-2-c.
    """
    live, b, i, c, start, end, eye = _program(BLOCK, LANES, N, seg_len, T, K, F64)
    a_tile = _lane_ptrs(A, a_sb, a_sn, b, i, K, K)
    gp_tile = _lane_ptrs(GP, gp_sb, gp_sn, b, i, K, K)
    gh_tile = _lane_ptrs(GH, gh_sb, gh_sn, b, i, K, V)
    sp_tile = _lane_ptrs(SP, sp_sb, sp_sn, b, i, K, K)
    sh_tile = _lane_ptrs(SH, sh_sb, sh_sn, b, i, K, V)
    da_tile = _lane_ptrs(DA, da_sb, da_sn, b, i, K, K)
    dx_tile = _lane_ptrs(DX, dx_sb, dx_sn, b, i, K, V)

    LH = _zeros(BLOCK, K, V, F64)
    LP = _zeros(BLOCK, 1, 1, F64)  # placeholders: loop-carried values must be tensors
    if HAS_P:
        LP = _zeros(BLOCK, K, K, F64)
    M = _zeros(BLOCK, 1, 1, F64)
    if not GRADS:
        M = eye
    if SPLIT:
        om_tile = _lane_ptrs(OM, om_sb, om_sn, b, i, K, K)
        oh_tile = _lane_ptrs(OH, oh_sb, oh_sn, b, i, K, V)
        if HAS_P:
            LP, LH = _fwd_walk(LP, LH, om_tile, om_st, _lane_ptrs(OP, op_sb, op_sn, b, i, K, K), op_st, oh_tile, oh_st,
                               om_tile, 0, oh_tile, 0, 0, segments - 1 - c, live, eye, K, V, ADJ, False, TILE,
                               STAGES, F64, DOT_P, DOT_H, PREC, PREFETCH)
        else:
            LP, LH = _fwd_walk(LP, LH, om_tile, om_st, om_tile, 0, oh_tile, oh_st, om_tile, 0, oh_tile, 0,
                               0, segments - 1 - c, live, eye, K, V, NO_P, False, TILE, STAGES, F64,
                               DOT_P, DOT_H, PREC, PREFETCH)
    h_init = _zeros(BLOCK, K, V, F64)
    if HAS_H0:
        h_init = _load(_lane_ptrs(H0, h0_sb, h0_sn, b, i, K, V), 0, 0, live, K, V, F64)

    if PREFETCH:
        a, gp, gh, sp, sh = _bwd_load(a_tile, a_st, gp_tile, gp_st, gh_tile, gh_st, sp_tile, sp_st, sh_tile, sh_st,
                                      h_init, end - 1, start, T, live, eye, K, V, HAS_P, GRADS, F64)
        for j in tl.range(0, end - start, 1, num_stages=STAGES):
            t = end - 1 - j
            a1, gp1, gh1, sp1, sh1 = _bwd_load(a_tile, a_st, gp_tile, gp_st, gh_tile, gh_st, sp_tile, sp_st,
                                               sh_tile, sh_st, h_init, t - 1, start, T, live, eye,
                                               K, V, HAS_P, GRADS, F64)
            M, LP, LH = _bwd_step(M, LP, LH, a, gp, gh, sp, sh, t, start, da_tile, da_st, dx_tile, dx_st,
                                  live, HAS_P, GRADS, DOT_P, DOT_H, PREC)
            a, gh = a1, gh1
            if HAS_P:  # otherwise gp and sp are the constant 0
                gp = gp1
                if GRADS:
                    sp = sp1
            if GRADS:  # otherwise sh is the constant 0
                sh = sh1
    else:
        for j0 in tl.range(0, end - start, TILE, num_stages=STAGES):
            t0 = end - 1 - j0
            a0, gp0, gh0, sp0, sh0 = _bwd_load(a_tile, a_st, gp_tile, gp_st, gh_tile, gh_st, sp_tile, sp_st,
                                               sh_tile, sh_st, h_init, t0, start, T, live, eye, K, V, HAS_P, GRADS, F64)
            if TILE >= 2:
                a1, gp1, gh1, sp1, sh1 = _bwd_load(a_tile, a_st, gp_tile, gp_st, gh_tile, gh_st, sp_tile, sp_st,
                                                   sh_tile, sh_st, h_init, t0 - 1, start, T, live, eye,
                                                   K, V, HAS_P, GRADS, F64)
            if TILE >= 4:
                a2, gp2, gh2, sp2, sh2 = _bwd_load(a_tile, a_st, gp_tile, gp_st, gh_tile, gh_st, sp_tile, sp_st,
                                                   sh_tile, sh_st, h_init, t0 - 2, start, T, live, eye,
                                                   K, V, HAS_P, GRADS, F64)
                a3, gp3, gh3, sp3, sh3 = _bwd_load(a_tile, a_st, gp_tile, gp_st, gh_tile, gh_st, sp_tile, sp_st,
                                                   sh_tile, sh_st, h_init, t0 - 3, start, T, live, eye,
                                                   K, V, HAS_P, GRADS, F64)
            M, LP, LH = _bwd_step(M, LP, LH, a0, gp0, gh0, sp0, sh0, t0, start, da_tile, da_st, dx_tile, dx_st,
                                  live, HAS_P, GRADS, DOT_P, DOT_H, PREC)
            if TILE >= 2:
                M, LP, LH = _bwd_step(M, LP, LH, a1, gp1, gh1, sp1, sh1, t0 - 1, start, da_tile, da_st, dx_tile,
                                      dx_st, live, HAS_P, GRADS, DOT_P, DOT_H, PREC)
            if TILE >= 4:
                M, LP, LH = _bwd_step(M, LP, LH, a2, gp2, gh2, sp2, sh2, t0 - 2, start, da_tile, da_st, dx_tile,
                                      dx_st, live, HAS_P, GRADS, DOT_P, DOT_H, PREC)
                M, LP, LH = _bwd_step(M, LP, LH, a3, gp3, gh3, sp3, sh3, t0 - 3, start, da_tile, da_st, dx_tile,
                                      dx_st, live, HAS_P, GRADS, DOT_P, DOT_H, PREC)

    if GRADS:
        if HAS_H0:  # dh0 = A_1^T lam_1, from the program that walked t = 0
            first = live & (_blk(c) == 0)
            a = _load(a_tile, 0, a_st, first, K, K, F64)
            _store(_lane_ptrs(DH0, dh0_sb, dh0_sn, b, i, K, V), 0, 0, _mm(a, LH, True, DOT_H, PREC), first)
    else:
        row = segments - 1 - c
        _store(_lane_ptrs(OM, om_sb, om_sn, b, i, K, K), row, om_st, M, live)
        if HAS_P:
            _store(_lane_ptrs(OP, op_sb, op_sn, b, i, K, K), row, op_st, LP, live)
        _store(_lane_ptrs(OH, oh_sb, oh_sn, b, i, K, V), row, oh_st, LH, live)


# k from which the products go through tl.dot (its dims must be >= 16); below it, broadcast
# products summed in registers. At k = 16 the broadcast form (one lane, 1 to 8 warps) ran slower
# than tl.dot on the H200.
DOT_K = 16


# ---- launches ----------------------------------------------------------------------------
#
# A launch passes its tensors plus a plan's arguments (grid, strides, sizes, switches). The plan
# depends only on the tensors' sizes and strides, the dtype, the device and the global switches,
# so `planned` makes it once per call signature and a call only allocates and launches.

def _dense(x, outer=3):
    """x itself if its dims after the first `outer` form a dense row-major block and every outer
    stride is a multiple of the block's size or belongs to a dim of size 1 (what the kernels'
    block loads assume; broadcasts with stride 0 qualify), else a contiguous copy. The block is
    (R, C), or (R,) for a (B, T, n, R) tensor read as (B, T, n, R, 1)."""
    if x.is_contiguous():  # contiguous tensors obey the rule: one cheap test for the common case
        return x
    shape, strides = x.shape, x.stride()
    size = 1
    for d in range(x.dim() - 1, outer - 1, -1):
        if shape[d] != 1 and strides[d] != size:
            return x.contiguous()
        size *= shape[d]
    if all(s % size == 0 or d == 1 for s, d in zip(strides[:outer], shape[:outer])):
        return x
    return x.contiguous()


def _seq(p, strides):
    """The b, t, n stride arguments of the (B, T, n, R, C) tensor passed as `p`; zeros when it is
    absent (None: the kernel does not read it)."""
    sb, st, sn = strides[:3] if strides is not None else (0, 0, 0)
    return {f"{p}_sb": sb, f"{p}_st": st, f"{p}_sn": sn}


def _per_lane(p, strides):
    """The b, n stride arguments of a (B, n, R, C) tensor (h0, dh0), as `_seq`."""
    sb, sn = strides[:2] if strides is not None else (0, 0)
    return {f"{p}_sb": sb, f"{p}_sn": sn}


def _rows(segments, B, n, R, C):
    """(size, strides) of a buffer of segment aggregates or carries: (B, segments, n, R, C), each
    segment's row contiguous."""
    return (B, segments, n, R, C), (n * R * C, B * n * R * C, R * C, C, 1)


class _Plan(NamedTuple):
    grid: tuple
    acc: torch.dtype  # of the aggregate buffers
    rows: tuple       # (size, strides) or None (absent) of each aggregate buffer; () without a time split
    first: dict       # the aggregate pass's arguments besides the tensors; None without a time split
    last: dict        # the main pass's


def _walk(shape, v, width, dtype, device, prec, direction):
    """The grid, the segment count and the arguments every pass of a walk in `direction` over
    A (B, T, n, k, k) with a k x `width` state shares."""
    B, T, n, k, _ = shape
    lay = layout.matrix(B * n, T, k, width, device, direction)
    f64 = dtype == torch.float64
    dot = k >= DOT_K and not f64
    shared = dict(N=n, LANES=B * n, T=T, seg_len=lay.seg_len, K=k, V=v, BLOCK=lay.block, TILE=lay.tile,
                  STAGES=lay.stages, PREFETCH=lay.prefetch, F64=f64, DOT_P=dot, DOT_H=dot and v >= 16,
                  PREC=prec if dot else "ieee", num_warps=lay.warps)
    return (cdiv(B * n, lay.block), lay.segments), lay.segments, shared


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@planned
def _forward_plan(shape, v, a, x, h0, h, p, dtype, device, forced, prec):
    """The plan of `_forward` for A of `shape`; a, x, h0, h, p: the strides of A, X, h0, H, P (None:
    absent). forced is layout's forced layout, which layout.matrix reads: it keys the memo."""
    B, T, n, k, _ = shape
    # width + k: the time split's first pass carries the product
    grid, segments, shared = _walk(shape, v, v + k, dtype, device, prec, "forward")
    base = dict(shared, **_seq("a", a), **_seq("xh", x))
    rows, first, agg = (), None, (None, None)
    if segments > 1:  # first pass: every segment's product and offset
        rows = (_rows(segments, B, n, k, k), _rows(segments, B, n, k, v))
        agg = tuple(stride for _, stride in rows)
        first = dict(base, **_per_lane("h0", None), **_seq("gp", None), **_seq("gh", None), **_seq("op", agg[0]),
                     **_seq("oh", agg[1]), PMODE=PROD.value, HAS_H0=False, AGG_PASS=True, SPLIT=False)
    last = dict(base, **_per_lane("h0", h0), **_seq("gp", agg[0]), **_seq("gh", agg[1]), **_seq("op", p),
                **_seq("oh", h), PMODE=(PROD if p is not None else NO_P).value, HAS_H0=h0 is not None,
                AGG_PASS=False, SPLIT=segments > 1)
    return _Plan(grid, _acc(dtype), rows, first, last)


@planned
def _backward_plan(shape, v, a, gp, gh, sp, sh, h0, da, dx, dh0, dtype, device, forced, prec):
    """The plan of `_backward`, as `_forward_plan`: the strides of each of its tensors (None: absent)."""
    B, T, n, k, _ = shape
    has_p = sp is not None
    grid, segments, shared = _walk(shape, v, v + k + (k if has_p else 0), dtype, device, prec, "backward")
    base = dict(shared, **_seq("a", a), **_seq("gp", gp), **_seq("gh", gh), HAS_P=has_p, segments=segments)
    rows, first, agg = (), None, (None, None, None)
    if segments > 1:  # first pass: every segment's map lam_end -> lam_start, later segments first
        rows = (_rows(segments, B, n, k, k), _rows(segments, B, n, k, k) if has_p else None,
                _rows(segments, B, n, k, v))
        agg = tuple(None if r is None else r[1] for r in rows)
        first = dict(base, **_seq("sp", None), **_seq("sh", None), **_per_lane("h0", None), **_seq("da", None),
                     **_seq("dx", None), **_per_lane("dh0", None), **_seq("om", agg[0]), **_seq("op", agg[1]),
                     **_seq("oh", agg[2]), HAS_H0=False, SPLIT=False, GRADS=False)
    last = dict(base, **_seq("sp", sp), **_seq("sh", sh), **_per_lane("h0", h0), **_seq("da", da),
                **_seq("dx", dx), **_per_lane("dh0", dh0), **_seq("om", agg[0]), **_seq("op", agg[1]),
                **_seq("oh", agg[2]), HAS_H0=h0 is not None, SPLIT=segments > 1, GRADS=True)
    return _Plan(grid, _acc(dtype), rows, first, last)


def _strides(x):
    return None if x is None else x.stride()


def _buffers(plan, like, count):
    """The plan's `count` aggregate buffers; `like` stands in for an absent one (for all without a
    time split)."""
    if not plan.rows:
        return (like,) * count
    return tuple(like if r is None else torch.empty_strided(*r, dtype=plan.acc, device=like.device)
                 for r in plan.rows)


def _forward(A, X, h0, H, P, v):
    """Fill H (and P, the prefix products, if given) with the walk from h0 (zeros if None). X and H
    are (B, T, n, k, v), or (B, T, n, k) when v = 1; absent tensors are passed as A, unread."""
    plan = _forward_plan(A.shape, v, A.stride(), X.stride(), _strides(h0), H.stride(), _strides(P), A.dtype,
                         A.device, layout._forced, dot_precision())
    gp, gh = _buffers(plan, A, 2)
    if plan.first is not None:
        launch(_forward_kernel, plan.grid, plan.first, A=A, XH=X, H0=A, GP=A, GH=A, OP=gp, OH=gh)
    launch(_forward_kernel, plan.grid, plan.last, A=A, XH=X, H0=A if h0 is None else h0, GP=gp, GH=gh,
           OP=A if P is None else P, OH=H)


def _backward(A, P, H, h0, gP, gH, dA, dX, dh0, v):
    """Fill dA, dX (and dh0) from the cotangents gH (and gP of the prefix products, if P is given);
    shapes as in `_forward`."""
    plan = _backward_plan(A.shape, v, A.stride(), _strides(gP), gH.stride(), _strides(P), H.stride(), _strides(h0),
                          dA.stride(), dX.stride(), _strides(dh0), A.dtype, A.device, layout._forced, dot_precision())
    om, op, oh = _buffers(plan, A, 3)
    gP = A if gP is None else gP
    if plan.first is not None:
        launch(_backward_kernel, plan.grid, plan.first, A=A, GP=gP, GH=gH, SP=A, SH=A, H0=A, DA=A, DX=A, DH0=A,
               OM=om, OP=op, OH=oh)
    launch(_backward_kernel, plan.grid, plan.last, A=A, GP=gP, GH=gH, SP=A if P is None else P, SH=H,
           H0=A if h0 is None else h0, DA=dA, DX=dX, DH0=A if dh0 is None else dh0, OM=om, OP=op, OH=oh)


# ---- matrix_affine_scan, and matrix_scan: its k=2, v=1 instance with b (B,T,n,2) read as (B,T,n,2,1) ----

def _scan_forward(A, X, Bbar, v):
    A = _dense(A)
    Abar = A.new_empty(A.shape)
    _forward(A, _dense(X), None, Bbar, Abar, v)
    return Abar


def _scan_backward(A, Abar, Bbar, gA, gB, dB, v):
    A = _dense(A)
    dA = A.new_empty(A.shape)
    _backward(A, _dense(Abar), _dense(Bbar), None, _dense(gA), _dense(gB), dA, dB, None, v)
    return dA


def _matrix_affine_scan_fwd(A: torch.Tensor, Bm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    Bbar = A.new_empty(Bm.shape)
    return _scan_forward(A, Bm, Bbar, Bm.shape[-1]), Bbar


def _matrix_affine_scan_bwd(A: torch.Tensor, Abar: torch.Tensor, Bbar: torch.Tensor, gA: torch.Tensor,
                            gB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dB = A.new_empty(Bbar.shape)
    return _scan_backward(A, Abar, Bbar, gA, gB, dB, Bbar.shape[-1]), dB


def _matrix_scan_fwd(M: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    Bc = M.new_empty(b.shape)
    return _scan_forward(M, b, Bc, 1), Bc


def _matrix_scan_bwd(M: torch.Tensor, Abar: torch.Tensor, Bc: torch.Tensor, gA: torch.Tensor,
                     gB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    db = M.new_empty(Bc.shape)
    return _scan_backward(M, Abar, Bc, gA, gB, db, 1), db


_matrix_affine_scan = scan_op("matrix_affine_scan", _matrix_affine_scan_fwd, _matrix_affine_scan_bwd, saved=(0,))
_matrix_scan = scan_op("matrix_scan", _matrix_scan_fwd, _matrix_scan_bwd, saved=(0,))


# ---- matrix_recurrence: states only, no prefix products -------------------------------------

def _matrix_recurrence_fwd(A: torch.Tensor, X: torch.Tensor, h0: Optional[torch.Tensor]) -> torch.Tensor:
    A, X = _dense(A), _dense(X)
    h = A.new_empty(X.shape)
    _forward(A, X, None if h0 is None else _dense(h0, outer=2), h, None, X.shape[-1])
    return h


def _matrix_recurrence_bwd(A: torch.Tensor, h0: Optional[torch.Tensor], h: torch.Tensor,
                           g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    A = _dense(A)
    dA, dX = A.new_empty(A.shape), A.new_empty(h.shape)
    dh0 = A.new_empty(h.shape[0], *h.shape[2:]) if h0 is not None else A.new_empty(0)
    _backward(A, None, _dense(h), None if h0 is None else _dense(h0, outer=2), None, _dense(g), dA, dX,
              dh0 if h0 is not None else None, h.shape[-1])
    return dA, dX, dh0


_matrix_recurrence = scan_op("matrix_recurrence", _matrix_recurrence_fwd, _matrix_recurrence_bwd, saved=(0, 2),
                             optional=(2,))


# ---- entry points (inputs already validated by mingru.ops) -------------------------------

def _check(A, X, v, sizes=BLOCK_SIZES):
    """ScanFallback unless a kernel compiled for k, v in `sizes` takes A (B,T,n,k,k) and X (B,T,n,k,v),
    or (B,T,n,k) at v = 1."""
    T, n, k = A.shape[1], A.shape[2], A.shape[-1]
    # time offsets are 32-bit within a lane (lanes use 64-bit offsets)
    check_envelope(A, span=T * max(A.stride(1), X.stride(1), n * k * max(k, v)),
                   sizes=(("k", k, sizes), ("v", v, sizes)))


def matrix_affine_scan(A, Bm):
    _check(A, Bm, Bm.shape[-1])
    return _matrix_affine_scan(A, Bm)


def matrix_scan(M, b):
    _check(M, b, 1)
    return _matrix_scan(M, b)


def recurrence_sizes(k):
    """The k and v that matrix_recurrence has a kernel for at block size k: wide.WIDE_SIZES (the wide
    kernel) when k is one of them, else BLOCK_SIZES (these narrow kernels)."""
    return wide.WIDE_SIZES if k in wide.WIDE_SIZES else BLOCK_SIZES


def matrix_recurrence(A, X, h0=None):
    sizes = recurrence_sizes(A.shape[-1])
    _check(A, X, X.shape[-1], sizes)
    return (wide.matrix_recurrence if sizes is wide.WIDE_SIZES else _matrix_recurrence)(A, X, h0)
