"""The chunked delta rule in two kernels: one program per (batch row, head) walks the chunks in
order with the state S (d_k x d_v) in registers, and does each chunk's WY algebra in BS x BS
blocks of micro-steps, so that no chunk term (the M x M systems, the readout matrix, the chunk
layout) is ever written to memory.

Per chunk of C tokens and M = C nh micro-steps (see `mingru.delta` for the recurrence), with c the
chunk-relative cumulative log decay (c_m that of micro-step m's token, c_end the chunk's total):

    T = I + L,  L[i, l] = beta_l (k_i . k_l) e^{c_i - c_l}   (l < i)
    u = T^{-1} (V - diag(e^c) K S)                            (the pseudo-values, M x d_v)
    y_t = e^{c_t} S^T q_t + sum_l read[t, l] u_l,  read[t, l] = beta_l (q_t . k_l) e^{c_t - c_l}
          over the micro-steps l of tokens <= t
    S' = e^{c_end} S + Kc^T u,  Kc's rows beta_l e^{c_end - c_l} k_l

The solve runs by blocks: u_i = D_i (r_i - sum_{j<i} L_ij u_j) with D_i = (I + L_ii)^{-1} from
`triangular._unit_lower_inverse`; each u_i is written to the output u, from which the later blocks
read it back. The readout's rows sit at micro-steps too: token t's query at its last micro-step,
zero rows at the others (`_queries`), so that L and read share their blocks' operands, each pair of
blocks (i, j <= i) loaded once for both. The forward writes y, the final state, u and the state at
each chunk start: what the backward keeps (the inputs, u and N states: nothing of size M x M).

The backward walks the chunks from the last one with the state's cotangent dS in registers:
    du = read^T dy + Kc dS',  dr = T^{-T} du (by blocks from the last),  dv = dr,
    dS = e^{c_end} dS' + (diag(e^c) Q)^T dy - (diag(e^c) K)^T dr,
then the gradients of k, q, beta and log gamma from dL = -tril(dr u^T, -1) and dread = dy u^T
(masked to token(l) <= t), a block's row pairs and column pairs recomputed where it needs them. Every product is a
tl.dot at the IEEE precision (`common.dot_precision`); the tiles need d_k, d_v <= MAX_D.

Two ops share the kernels: `delta_rule` takes q, k, v, beta as given (`delta_rule_chunked`'s fused
form); `delta_layer` takes DeltaMinGRU's projection output (`delta.split_projection`), normalizes
the keys and gates the write strengths (beta = 2 sigmoid) as it loads them (RAW), differentiates
both in the backward, and writes the four gradients into one buffer laid out as that output.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from mingru.delta import split_projection
from mingru.dispatch import ScanFallback
from mingru.kernels.common import cdiv, check_envelope, dot_precision, launch, next_pow2, planned, scan_op
from mingru.kernels.triangular import _unit_lower_inverse

BS = 16     # micro-steps per block of the chunk's triangular system
MAX_D = 64  # d_k and d_v: the state and its cotangent live in registers
WARPS = 4       # d_k, d_v <= 16
WIDE_WARPS = 8  # above: at 4 warps ptxas spills registers to local memory (sm_90), at 8 little or none
NORM_EPS = tl.constexpr(1e-12)  # F.normalize's eps, for the layer's keys


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _micro(n, blk, C, NH, T, BS: tl.constexpr):
    """Micro-steps of block `blk` of chunk n: (index in the chunk, token in the chunk, token in the
    sequence, live: inside the chunk and the sequence)."""
    m = blk * BS + tl.arange(0, BS)
    tok = m // NH
    t = n * C + tok
    return m, tok, t, (m < C * NH) & (t < T)


@triton.jit
def _queries(Q, off, st, t, m, live, NH, DK, BDK: tl.constexpr, F64: tl.constexpr):
    """The readout's rows at micro-steps m: q of token t at the last micro-step of each token (live_q),
    zero rows elsewhere; (the rows, live_q)."""
    live_q = live & (m % NH == NH - 1)
    return _rows(Q, off, st, 0, t, m * 0, live_q, DK, BDK, F64), live_q


@triton.jit
def _chunk_decay(G, g_off, sgt, n, C, T, CP: tl.constexpr, F64: tl.constexpr, DECAY: tl.constexpr):
    """log gamma of chunk n's tokens (CP entries, 0 past the chunk or the sequence; 0 without decay)."""
    s = tl.arange(0, CP)
    if DECAY:
        g = tl.load(G + g_off + (n * C + s).to(tl.int64) * sgt, mask=(s < C) & (n * C + s < T), other=0.0)
        return g.to(tl.float64 if F64 else tl.float32)
    return tl.zeros([CP], tl.float64 if F64 else tl.float32)


@triton.jit
def _cum(g, tok, CP: tl.constexpr):
    """The chunk-relative cumulative log decay at chunk tokens `tok`: sum of g over tokens <= tok."""
    s = tl.arange(0, CP)
    return tl.sum(tl.where(s[None, :] <= tok[:, None], g[None, :], 0.0), 1)


@triton.jit
def _rows(P, off, st, sj, t, j, live, D, BD: tl.constexpr, F64: tl.constexpr):
    """Rows (token t, micro-step j) of a (.., T, [nh,] .., D) tensor at `off` as a (len(t), BD) tile."""
    cols = tl.arange(0, BD)
    ptr = P + off + t[:, None].to(tl.int64) * st + j[:, None] * sj + cols[None, :]
    x = tl.load(ptr, mask=live[:, None] & (cols[None, :] < D), other=0.0)
    return x.to(tl.float64 if F64 else tl.float32)


@triton.jit
def _put_rows(P, off, st, sj, t, j, live, D, x, BD: tl.constexpr):
    cols = tl.arange(0, BD)
    ptr = P + off + t[:, None].to(tl.int64) * st + j[:, None] * sj + cols[None, :]
    tl.store(ptr, x.to(P.dtype.element_ty), mask=live[:, None] & (cols[None, :] < D))


@triton.jit
def _scalars(P, off, st, sj, t, j, live, F64: tl.constexpr):
    x = tl.load(P + off + t.to(tl.int64) * st + j * sj, mask=live, other=0.0)
    return x.to(tl.float64 if F64 else tl.float32)


@triton.jit
def _keys(K, off, st, sj, t, j, live, DK, BDK: tl.constexpr, F64: tl.constexpr, RAW: tl.constexpr):
    """Key rows; RAW: rows of the projection, L2-normalized here as F.normalize does (x / max(|x|, eps))."""
    k = _rows(K, off, st, sj, t, j, live, DK, BDK, F64)
    if RAW:
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, 1)), NORM_EPS)[:, None]
    return k


@triton.jit
def _betas(BETA, off, st, sj, t, j, live, F64: tl.constexpr, RAW: tl.constexpr):
    """Write strengths; RAW: pre-activations z, turned into beta = 2 sigmoid(z) in (0, 2) here."""
    b = _scalars(BETA, off, st, sj, t, j, live, F64)
    if RAW:
        b = tl.where(live, 2.0 / (1.0 + tl.exp(-b)), 0.0)
    return b


@triton.jit
def _state_ptrs(P, off, DK, DV, BDK: tl.constexpr, BDV: tl.constexpr):
    rk, rv = tl.arange(0, BDK), tl.arange(0, BDV)
    return P + off + rk[:, None] * DV + rv[None, :], (rk[:, None] < DK) & (rv[None, :] < DV)


@triton.jit
def _decayed(x, keep, c_row, c_col):
    """x[r, l] e^{c_row[r] - c_col[l]} where `keep`, else 0: a product block of a chunk under its decay
    (kept entries pair a later row with an earlier column, so their factor is at most 1)."""
    return tl.where(keep, x * tl.exp(tl.where(keep, c_row[:, None] - c_col[None, :], 0.0)), 0.0)


@triton.jit
def _diagonal_inverse(Kb, bb, cb, m, BS: tl.constexpr, PREC: tl.constexpr):
    """D = (I + L_bb)^{-1} of a diagonal block: L_bb[i, l] = beta_l (k_i . k_l) e^{c_i - c_l}, l < i."""
    L = _decayed(_dot(Kb, tl.trans(Kb * bb[:, None]), PREC), m[:, None] > m[None, :], cb, cb)
    return _unit_lower_inverse(L, BS)


@triton.jit
def _forward_kernel(Q, K, V, BETA, G, H0, Y, U, S0, HT,
                    sqb, sqt, sqh, skb, skt, skj, skh, svb, svt, svj, svh, sbb, sbt, sbj, sbh, sgb, sgt, sgh,
                    H, T, C, NH, N, DK, DV,
                    BDK: tl.constexpr, BDV: tl.constexpr, CP: tl.constexpr, BS: tl.constexpr,
                    DECAY: tl.constexpr, HAS_H0: tl.constexpr, RAW: tl.constexpr, F64: tl.constexpr,
                    PREC: tl.constexpr):
    """y, the final state, u (laid out as v, contiguous) and the chunk-start states (B, H, N, DK, DV)
    of one (batch row, head) per program; y (B, T, H, DV) and the states contiguous. RAW: K and BETA
    hold the layer's projections, normalized and gated here (see `_keys`, `_betas`)."""
    pid = tl.program_id(0)
    b, h = (pid // H).to(tl.int64), pid % H
    q_off, k_off, v_off = b * sqb + h * sqh, b * skb + h * skh, b * svb + h * svh
    beta_off, g_off = b * sbb + h * sbh, b * sgb + h * sgh
    su_t, su_j = NH * H * DV, H * DV                       # u: (B, T, nh, H, DV) contiguous
    u_off, y_off = b * T * su_t + h * DV, b * T * H * DV + h * DV
    s_off = pid.to(tl.int64) * N * DK * DV
    ptrs, smask = _state_ptrs(S0, s_off, DK, DV, BDK, BDV)
    if HAS_H0:
        p0, _ = _state_ptrs(H0, pid.to(tl.int64) * DK * DV, DK, DV, BDK, BDV)
        S = tl.load(p0, mask=smask, other=0.0).to(tl.float64 if F64 else tl.float32)
    else:
        S = tl.zeros([BDK, BDV], tl.float64 if F64 else tl.float32)
    NB = tl.cdiv(C * NH, BS)
    for n in range(N):
        tl.store(ptrs + n * DK * DV, S.to(S0.dtype.element_ty), mask=smask)
        g = _chunk_decay(G, g_off, sgt, n, C, T, CP, F64, DECAY)
        c_end = tl.sum(g, 0)
        S_end = S * tl.exp(c_end)
        # block i of the solve, u_i = D_i (v_i - e^{c_i} k_i S - sum_{j<i} L_ij u_j), and of the readout
        # (its queries): each earlier block's keys and u are loaded once for both
        for i in range(NB):
            m_i, tok_i, t_i, live_i = _micro(n, i, C, NH, T, BS)
            K_i = _keys(K, k_off, skt, skj, t_i, m_i % NH, live_i, DK, BDK, F64, RAW)
            b_i = _betas(BETA, beta_off, sbt, sbj, t_i, m_i % NH, live_i, F64, RAW)
            c_i = _cum(g, tok_i, CP)
            Q_i, live_q = _queries(Q, q_off, sqt, t_i, m_i, live_i, NH, DK, BDK, F64)
            e_i = tl.exp(c_i)[:, None]
            r = _rows(V, v_off, svt, svj, t_i, m_i % NH, live_i, DV, BDV, F64) - _dot(K_i * e_i, S, PREC)
            y = _dot(Q_i * e_i, S, PREC)
            for j in range(i):
                m_j, tok_j, t_j, live_j = _micro(n, j, C, NH, T, BS)
                Kb_j = _keys(K, k_off, skt, skj, t_j, m_j % NH, live_j, DK, BDK, F64, RAW) * \
                    _betas(BETA, beta_off, sbt, sbj, t_j, m_j % NH, live_j, F64, RAW)[:, None]
                U_j = _rows(U, u_off, su_t, su_j, t_j, m_j % NH, live_j, DV, BDV, F64)
                E = tl.exp(c_i[:, None] - _cum(g, tok_j, CP)[None, :])  # every pair of an earlier block: <= 1
                r -= _dot(_dot(K_i, tl.trans(Kb_j), PREC) * E, U_j, PREC)
                y += _dot(_dot(Q_i, tl.trans(Kb_j), PREC) * E, U_j, PREC)
            Kb_i = K_i * b_i[:, None]
            u_i = _dot(_diagonal_inverse(K_i, b_i, c_i, m_i, BS, PREC), r, PREC)
            _put_rows(U, u_off, su_t, su_j, t_i, m_i % NH, live_i, DV, u_i, BDV)
            y += _dot(_decayed(_dot(Q_i, tl.trans(Kb_i), PREC), tok_i[None, :] <= tok_i[:, None], c_i, c_i), u_i,
                      PREC)
            _put_rows(Y, y_off, H * DV, 0, t_i, m_i * 0, live_q, DV, y, BDV)
            S_end += _dot(tl.trans(Kb_i * tl.exp(c_end - c_i)[:, None]), u_i, PREC)
            tl.debug_barrier()  # the later blocks read u_i back
        S = S_end
    pT, _ = _state_ptrs(HT, pid.to(tl.int64) * DK * DV, DK, DV, BDK, BDV)
    tl.store(pT, S.to(HT.dtype.element_ty), mask=smask)


@triton.jit
def _backward_kernel(Q, K, BETA, G, U, S0, DY, DHT, DQ, DKK, DVO, DB, DG, DH0,
                     sqb, sqt, sqh, skb, skt, skj, skh, sbb, sbt, sbj, sbh, sgb, sgt, sgh,
                     sdqb, sdqt, sdqh, sdkb, sdkt, sdkj, sdkh, sdvb, sdvt, sdvj, sdvh, sdbb, sdbt, sdbj, sdbh,
                     H, T, C, NH, N, DK, DV,
                     BDK: tl.constexpr, BDV: tl.constexpr, CP: tl.constexpr, BS: tl.constexpr,
                     DECAY: tl.constexpr, HAS_H0: tl.constexpr, RAW: tl.constexpr, F64: tl.constexpr,
                     PREC: tl.constexpr):
    """The gradients of `_forward_kernel`'s inputs from the cotangents of y (DY, as y) and of the final
    state (DHT): DQ, DKK, DVO, DB with their own strides (sd*), DG contiguous (B, T, H). DVO also
    holds dr = T^{-T} du while the chunk's blocks are solved (dv = dr)."""
    pid = tl.program_id(0)
    b, h = (pid // H).to(tl.int64), pid % H
    q_off, k_off, beta_off, g_off = b * sqb + h * sqh, b * skb + h * skh, b * sbb + h * sbh, b * sgb + h * sgh
    su_t, su_j = NH * H * DV, H * DV                     # u: (B, T, nh, H, DV) contiguous
    u_off, y_off = b * T * su_t + h * DV, b * T * H * DV + h * DV
    dq_off, dk_off, dv_off = b * sdqb + h * sdqh, b * sdkb + h * sdkh, b * sdvb + h * sdvh
    db_off, dg_off = b * sdbb + h * sdbh, b * T * H + h   # dlog gamma: (B, T, H) contiguous
    s_off = pid.to(tl.int64) * N * DK * DV
    ptrs, smask = _state_ptrs(S0, s_off, DK, DV, BDK, BDV)
    pT, _ = _state_ptrs(DHT, pid.to(tl.int64) * DK * DV, DK, DV, BDK, BDV)
    dS = tl.load(pT, mask=smask, other=0.0).to(tl.float64 if F64 else tl.float32)
    NB = tl.cdiv(C * NH, BS)
    s = tl.arange(0, CP)
    for back in range(N):
        n = N - 1 - back
        S = tl.load(ptrs + n * DK * DV, mask=smask, other=0.0).to(tl.float64 if F64 else tl.float32)
        g = _chunk_decay(G, g_off, sgt, n, C, T, CP, F64, DECAY)
        c_end = tl.sum(g, 0)
        # dr = T^{-T} du by blocks from the last: dr_j = D_j^T (du_j - sum_{i>j} L_ij^T dr_i), du_j
        # gathering the readout's columns j from the queries of blocks i >= j
        for rb in range(NB):
            j = NB - 1 - rb
            m_j, tok_j, t_j, live_j = _micro(n, j, C, NH, T, BS)
            K_j = _keys(K, k_off, skt, skj, t_j, m_j % NH, live_j, DK, BDK, F64, RAW)
            b_j = _betas(BETA, beta_off, sbt, sbj, t_j, m_j % NH, live_j, F64, RAW)
            c_j = _cum(g, tok_j, CP)
            Kb_j = K_j * b_j[:, None]
            Q_j, live_q = _queries(Q, q_off, sqt, t_j, m_j, live_j, NH, DK, BDK, F64)
            R = _decayed(_dot(Q_j, tl.trans(Kb_j), PREC), tok_j[None, :] <= tok_j[:, None], c_j, c_j)
            du = _dot(Kb_j * tl.exp(c_end - c_j)[:, None], dS, PREC) + \
                _dot(tl.trans(R), _rows(DY, y_off, H * DV, 0, t_j, m_j * 0, live_q, DV, BDV, F64), PREC)
            for i in range(j + 1, NB):
                m_i, tok_i, t_i, live_i = _micro(n, i, C, NH, T, BS)
                K_i = _keys(K, k_off, skt, skj, t_i, m_i % NH, live_i, DK, BDK, F64, RAW)
                Q_i, live_qi = _queries(Q, q_off, sqt, t_i, m_i, live_i, NH, DK, BDK, F64)
                E = tl.exp(_cum(g, tok_i, CP)[:, None] - c_j[None, :])
                du += _dot(tl.trans(_dot(Q_i, tl.trans(Kb_j), PREC) * E),
                           _rows(DY, y_off, H * DV, 0, t_i, m_i * 0, live_qi, DV, BDV, F64), PREC)
                du -= _dot(tl.trans(_dot(K_i, tl.trans(Kb_j), PREC) * E),
                           _rows(DVO, dv_off, sdvt, sdvj, t_i, m_i % NH, live_i, DV, BDV, F64), PREC)
            dr = _dot(tl.trans(_diagonal_inverse(K_j, b_j, c_j, m_j, BS, PREC)), du, PREC)
            _put_rows(DVO, dv_off, sdvt, sdvj, t_j, m_j % NH, live_j, DV, dr, BDV)
            tl.debug_barrier()  # the earlier blocks read dr back
        dct = tl.zeros([CP], tl.float64 if F64 else tl.float32)  # d c per token of the chunk
        dce = tl.sum(tl.sum(S * dS, 1), 0) * tl.exp(c_end)     # d c_end
        dS_prev = dS * tl.exp(c_end)
        # k, beta and q, a block of micro-steps j at a time: its rows and columns of dL = -(dr u^T)
        # e^{c_i - c_l} (l < i) and of dread = dy u^T e^{c_t - c_l} (token(l) <= t, queries at micro-steps)
        for j in range(NB):
            m_j, tok_j, t_j, live_j = _micro(n, j, C, NH, T, BS)
            K_j = _keys(K, k_off, skt, skj, t_j, m_j % NH, live_j, DK, BDK, F64, RAW)
            b_j = _betas(BETA, beta_off, sbt, sbj, t_j, m_j % NH, live_j, F64, RAW)
            c_j = _cum(g, tok_j, CP)
            Q_j, live_q = _queries(Q, q_off, sqt, t_j, m_j, live_j, NH, DK, BDK, F64)
            dy_j = _rows(DY, y_off, H * DV, 0, t_j, m_j * 0, live_q, DV, BDV, F64)
            U_j = _rows(U, u_off, su_t, su_j, t_j, m_j % NH, live_j, DV, BDV, F64)
            dr_j = _rows(DVO, dv_off, sdvt, sdvj, t_j, m_j % NH, live_j, DV, BDV, F64)
            dk = tl.zeros([BS, BDK], tl.float64 if F64 else tl.float32)
            dq = tl.zeros([BS, BDK], tl.float64 if F64 else tl.float32)
            db = tl.zeros([BS], tl.float64 if F64 else tl.float32)
            dc = tl.zeros([BS], tl.float64 if F64 else tl.float32)
            for l in range(j + 1):  # rows j: the pairs with the blocks l <= j
                m_l, tok_l, t_l, live_l = _micro(n, l, C, NH, T, BS)
                Kb_l = _keys(K, k_off, skt, skj, t_l, m_l % NH, live_l, DK, BDK, F64, RAW) * \
                    _betas(BETA, beta_off, sbt, sbj, t_l, m_l % NH, live_l, F64, RAW)[:, None]
                U_l = tl.trans(_rows(U, u_off, su_t, su_j, t_l, m_l % NH, live_l, DV, BDV, F64))
                c_l = _cum(g, tok_l, CP)
                A = _decayed(-_dot(dr_j, U_l, PREC), m_j[:, None] > m_l[None, :], c_j, c_l)
                R = _decayed(_dot(dy_j, U_l, PREC), tok_l[None, :] <= tok_j[:, None], c_j, c_l)
                dk += _dot(A, Kb_l, PREC)
                dq += _dot(R, Kb_l, PREC)
                if DECAY:
                    dc += tl.sum(A * _dot(K_j, tl.trans(Kb_l), PREC), 1) + tl.sum(R * _dot(Q_j, tl.trans(Kb_l), PREC), 1)
            for i in range(j, NB):  # columns j: the pairs with the blocks i >= j
                m_i, tok_i, t_i, live_i = _micro(n, i, C, NH, T, BS)
                K_i = _keys(K, k_off, skt, skj, t_i, m_i % NH, live_i, DK, BDK, F64, RAW)
                Q_i, live_qi = _queries(Q, q_off, sqt, t_i, m_i, live_i, NH, DK, BDK, F64)
                c_i = _cum(g, tok_i, CP)
                A = _decayed(-_dot(_rows(DVO, dv_off, sdvt, sdvj, t_i, m_i % NH, live_i, DV, BDV, F64), tl.trans(U_j),
                                   PREC), m_i[:, None] > m_j[None, :], c_i, c_j)
                R = _decayed(_dot(_rows(DY, y_off, H * DV, 0, t_i, m_i * 0, live_qi, DV, BDV, F64), tl.trans(U_j),
                                  PREC), tok_j[None, :] <= tok_i[:, None], c_i, c_j)
                dk += b_j[:, None] * (_dot(tl.trans(A), K_i, PREC) + _dot(tl.trans(R), Q_i, PREC))
                col = tl.sum(A * _dot(K_i, tl.trans(K_j), PREC), 0) + tl.sum(R * _dot(Q_i, tl.trans(K_j), PREC), 0)
                db += col
                dc -= b_j * col
            e = tl.exp(c_j)
            dKh = -_dot(dr_j, tl.trans(S), PREC)              # through e^{c} k in the solve's right side
            dk += e[:, None] * dKh
            dQh = _dot(dy_j, tl.trans(S), PREC)               # through e^{c} q in the readout
            dq += e[:, None] * dQh
            dc += e * (tl.sum(dKh * K_j, 1) + tl.sum(dQh * Q_j, 1))
            dS_prev += _dot(tl.trans(Q_j * e[:, None]), dy_j, PREC) - _dot(tl.trans(K_j * e[:, None]), dr_j, PREC)
            w = tl.exp(c_end - c_j)
            dKc = _dot(U_j, tl.trans(dS), PREC)               # through beta e^{c_end - c} k in S'
            x = tl.sum(dKc * K_j, 1)
            dk += (b_j * w)[:, None] * dKc
            db += w * x
            dc -= b_j * w * x
            dce += tl.sum(b_j * w * x, 0)
            if RAW:  # back through k = normalize(k_raw) and beta = 2 sigmoid(beta_raw)
                raw = _rows(K, k_off, skt, skj, t_j, m_j % NH, live_j, DK, BDK, F64)
                norm = tl.sqrt(tl.sum(raw * raw, 1))
                radial = tl.where(norm > NORM_EPS, tl.sum(K_j * dk, 1), 0.0)
                dk = (dk - K_j * radial[:, None]) / tl.maximum(norm, NORM_EPS)[:, None]
                db = db * b_j * (1.0 - 0.5 * b_j)
            _put_rows(DKK, dk_off, sdkt, sdkj, t_j, m_j % NH, live_j, DK, dk, BDK)
            _put_rows(DQ, dq_off, sdqt, 0, t_j, m_j * 0, live_q, DK, dq, BDK)
            tl.store(DB + db_off + t_j.to(tl.int64) * sdbt + (m_j % NH) * sdbj, db.to(DB.dtype.element_ty),
                     mask=live_j)
            if DECAY:
                dct += tl.sum(tl.where(tok_j[:, None] == s[None, :], dc[:, None], 0.0), 0)
        if DECAY:  # c_t sums log gamma over the chunk's tokens <= t; c_end over all of them
            dg = tl.sum(tl.where(s[:, None] <= s[None, :], dct[None, :], 0.0), 1) + dce
            tl.store(DG + dg_off + (n * C + s).to(tl.int64) * H, dg.to(DG.dtype.element_ty),
                     mask=(s < C) & (n * C + s < T))
        dS = dS_prev
    if HAS_H0:
        p0, _ = _state_ptrs(DH0, pid.to(tl.int64) * DK * DV, DK, DV, BDK, BDV)
        tl.store(p0, dS.to(DH0.dtype.element_ty), mask=smask)


# ---- launches ------------------------------------------------------------------------------

@planned
def _plan(shape, dv, C, q, k, v, beta, g, f64, decay, has_h0, raw, prec):
    """The forward's arguments besides the tensors: k of `shape` (B, T, nh, H, d_k), chunks of C
    tokens; q, k, v, beta, g: the strides of the inputs (g None without decay)."""
    B, T, nh, H, dk = shape
    return dict(sqb=q[0], sqt=q[1], sqh=q[2], skb=k[0], skt=k[1], skj=k[2], skh=k[3],
                svb=v[0], svt=v[1], svj=v[2], svh=v[3], sbb=beta[0], sbt=beta[1], sbj=beta[2], sbh=beta[3],
                **dict(zip(("sgb", "sgt", "sgh"), g or (0, 0, 0))),
                H=H, T=T, C=C, NH=nh, N=cdiv(T, C), DK=dk, DV=dv, BDK=max(16, next_pow2(dk)),
                BDV=max(16, next_pow2(dv)), CP=max(16, next_pow2(C)), BS=BS, DECAY=decay,
                HAS_H0=has_h0, RAW=raw, F64=f64, PREC=prec, num_warps=WARPS if max(dk, dv) <= 16 else WIDE_WARPS)


@planned
def _backward_plan(key, dq, dk, dv, dbeta):
    """The backward's arguments: the forward's of `key` (what `_plan` takes) without v's strides (it
    reads u), and the strides of the gradients it writes."""
    args = {name: value for name, value in _plan(*key).items() if not name.startswith("sv")}
    args.update(zip(("sdqb", "sdqt", "sdqh"), dq[:3]))
    for p, strides in (("sdk", dk), ("sdv", dv), ("sdb", dbeta)):
        args.update(zip((p + "b", p + "t", p + "j", p + "h"), strides[:4]))
    return args


def _rows_last(x):
    """x with a unit stride along its last dim (what the kernels' row loads assume)."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _key(q, k, v, beta, log_gamma, h0, chunk_size, raw):
    return (tuple(k.shape), v.shape[-1], min(chunk_size, q.shape[1]), q.stride(), k.stride(), v.stride(),
            beta.stride(), None if log_gamma is None else log_gamma.stride(), q.dtype == torch.float64,
            log_gamma is not None, h0 is not None, raw, dot_precision())


def _run_forward(q, k, v, beta, log_gamma, h0, chunk_size, raw):
    """(y, h_T, u, the chunk-start states); q, k, v and log_gamma with unit last strides, h0 contiguous."""
    B, T, nh, H, dk = k.shape
    dv = v.shape[-1]
    plan = _plan(*_key(q, k, v, beta, log_gamma, h0, chunk_size, raw))
    y, hT = q.new_empty(B, T, H, dv), q.new_empty(B, H, dk, dv)
    u, starts = q.new_empty(B, T, nh, H, dv), q.new_empty(B, H, plan["N"], dk, dv)
    launch(_forward_kernel, (B * H,), plan, Q=q, K=k, V=v, BETA=beta, G=q if log_gamma is None else log_gamma,
           H0=q if h0 is None else h0, Y=y, U=u, S0=starts, HT=hT)
    return y, hT, u, starts


def _run_backward(q, k, v, beta, log_gamma, h0, chunk_size, raw, u, starts, dy, dhT, dq, dk, dv, dbeta):
    """Fill dq, dk, dv, dbeta (any strides with a unit last one); return (dlog_gamma, dh0), empty
    where the input is absent."""
    B, T, nh, H, _ = k.shape
    plan = _backward_plan(_key(q, k, v, beta, log_gamma, h0, chunk_size, raw), dq.stride(), dk.stride(),
                          dv.stride(), dbeta.stride())
    dg = torch.empty(log_gamma.shape, dtype=q.dtype, device=q.device) if log_gamma is not None else q.new_empty(0)
    dh0 = torch.empty(h0.shape, dtype=q.dtype, device=q.device) if h0 is not None else q.new_empty(0)
    launch(_backward_kernel, (B * H,), plan, Q=q, K=k, BETA=beta, G=q if log_gamma is None else log_gamma, U=u,
           S0=starts, DY=dy.contiguous(), DHT=dhT.contiguous(), DQ=dq, DKK=dk, DVO=dv, DB=dbeta, DG=dg,
           DH0=dh0 if h0 is not None else q)
    return dg, dh0


def _contiguous(x):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# -- the rule on q, k, v, beta as given (delta_rule_chunked's fused form) --

def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
             log_gamma: Optional[torch.Tensor], h0: Optional[torch.Tensor],
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, log_gamma = (_rows_last(x) for x in (q, k, v, log_gamma))
    return _run_forward(q, k, v, beta, log_gamma, None if h0 is None else h0.contiguous(), chunk_size, False)


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
              log_gamma: Optional[torch.Tensor], h0: Optional[torch.Tensor], chunk_size: int,
              y: torch.Tensor, hT: torch.Tensor, u: torch.Tensor, starts: torch.Tensor, dy: torch.Tensor,
              dhT: torch.Tensor, du: torch.Tensor, dstarts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor, torch.Tensor]:
    q, k, v, log_gamma = (_rows_last(x) for x in (q, k, v, log_gamma))
    dq, dk, dv, dbeta = _contiguous(q), _contiguous(k), _contiguous(v), _contiguous(beta)
    dg, dh0 = _run_backward(q, k, v, beta, log_gamma, h0, chunk_size, False, u, starts, dy, dhT, dq, dk, dv, dbeta)
    return dq, dk, dv, dbeta, dg, dh0


# y and the final state carry gradients; u and the chunk-start states only carry the forward's
# work to the backward
_delta_rule = scan_op("delta_rule", _forward, _backward, saved=(0, 1, 2, 3, 4, 5, 6), optional=(4, 5), aux=2)


# -- the rule on the layer's projection output (DeltaMinGRU's fused form) --

def _layer_forward(proj: torch.Tensor, log_gamma: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                   chunk_size: int, n_heads: int, nh: int, d_k: int,
                   d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    proj, log_gamma = proj.contiguous(), _rows_last(log_gamma)
    return _run_forward(*split_projection(proj, n_heads, nh, d_k, d_v), log_gamma,
                        None if h0 is None else h0.contiguous(), chunk_size, True)


def _layer_backward(proj: torch.Tensor, log_gamma: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                    chunk_size: int, n_heads: int, nh: int, d_k: int, d_v: int, y: torch.Tensor, hT: torch.Tensor,
                    u: torch.Tensor, starts: torch.Tensor, dy: torch.Tensor, dhT: torch.Tensor, du: torch.Tensor,
                    dstarts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    proj, log_gamma = proj.contiguous(), _rows_last(log_gamma)
    dproj = _contiguous(proj)  # the four gradients land in one buffer, laid out as proj
    dg, dh0 = _run_backward(*split_projection(proj, n_heads, nh, d_k, d_v), log_gamma, h0, chunk_size, True, u,
                            starts, dy, dhT, *split_projection(dproj, n_heads, nh, d_k, d_v))
    return dproj, dg, dh0


_delta_layer = scan_op("delta_layer", _layer_forward, _layer_backward, saved=tuple(range(8)), optional=(1, 2),
                       aux=2)


def _check(x, others, dk, dv):
    check_envelope(x)
    if dk > MAX_D or dv > MAX_D:
        raise ScanFallback(f"d_k = {dk}, d_v = {dv}: the fused kernels hold states of d_k, d_v <= {MAX_D}")
    if x.dtype not in (torch.float32, torch.float64) or any(t is not None and t.dtype != x.dtype for t in others):
        raise ScanFallback(f"the fused delta rule takes float32 or float64 inputs of one dtype, got {x.dtype}")


def delta_rule(q, k, v, beta, log_gamma, h0, chunk_size):
    """The Triton path of `delta.delta_rule_chunked(..., across="fused")` on checked inputs (k, v,
    beta with their nh axis, T >= 1): (y (B, T, H, d_v), h_T (B, H, d_k, d_v)). ScanFallback outside
    float32/float64 inputs of one dtype and d_k, d_v <= MAX_D."""
    _check(q, (k, v, beta, log_gamma, h0), k.shape[-1], v.shape[-1])
    y, hT, _, _ = _delta_rule(q, k, v, beta, log_gamma, h0, chunk_size)
    return y, hT


def delta_layer(proj, log_gamma, h0, chunk_size, n_heads, nh, d_k, d_v):
    """The Triton path of `delta.delta_layer`: the rule on DeltaMinGRU's projection output, its keys
    normalized and its write strengths gated inside the kernels, and its gradient in one buffer."""
    _check(proj, (log_gamma, h0), d_k, d_v)
    y, hT, _, _ = _delta_layer(proj, log_gamma, h0, chunk_size, n_heads, nh, d_k, d_v)
    return y, hT
