"""The chunked delta rule in kernels that read the inputs in place, three forward and four or five
backward: only the walk over the chunks is sequential (one program per batch row, head and WALK_BV
columns of the state, which walk independently); every chunk's WY algebra runs in its own program
(the gradients: in one program per block of micro-steps of every chunk), in BS x BS
blocks of micro-steps (READOUT_BS in the readouts), so that no chunk term (the M x M systems, the
readout matrix, the chunk layout) is ever written to memory.

Per chunk of C tokens and M = C nh micro-steps (see `mingru.delta` for the recurrence), with c the
chunk-relative cumulative log decay (c_m that of micro-step m's token, c_end the chunk's total):

    T = I + L,  L[i, l] = beta_l (k_i . k_l) e^{c_i - c_l}   (l < i)
    u = u0 - w S,  u0 = T^{-1} V,  w = T^{-1} diag(e^c) K    (the pseudo-values, M x d_v)
    y_t = e^{c_t} S^T q_t + sum_l read[t, l] u_l,  read[t, l] = beta_l (q_t . k_l) e^{c_t - c_l}
          over the micro-steps l of tokens <= t
    S' = e^{c_end} S + Kc^T u,  Kc's rows beta_l e^{c_end - c_l} k_l

Forward: `_solve_kernel` (every chunk) forms u0 and w by blocks, u0_i = D_i (v_i - sum_{j<i} L_ij
u0_j) with D_i = (I + L_ii)^{-1} from `triangular._unit_lower_inverse`, each block written out and
read back by the later ones; `_walk_kernel` walks S through the chunks, turning u0 into u and
storing S at each chunk start; `_readout_kernel` (every chunk) forms y. The readout's rows sit at
micro-steps too: token t's query at its last micro-step, zero rows at the others (`_queries`). The
backward keeps the inputs, u, w and the N chunk-start states: nothing of size M x M.

Backward: `_readout_back_kernel` (every chunk) forms read^T dy and (diag(e^c) Q)^T dy;
`_walk_back_kernel` walks the state's cotangent from the last chunk,
    du = read^T dy + Kc dS',  dS = e^{c_end} dS' + (diag(e^c) Q)^T dy - w^T du
(w^T = (diag(e^c) K)^T T^{-T}, so the walk needs no solve), keeping each chunk's du and dS';
`_dr_kernel` (every chunk) solves dr = T^{-T} du by blocks from the last (dv = dr);
`_gradient_kernel` (every block of micro-steps of every chunk: the chunk's work spread over NB
programs) forms the block's gradients of k, q and beta from
dL = -tril(dr u^T, -1) and dread = dy u^T (masked to token(l) <= t), its row pairs and column pairs
recomputed where it needs them, and with decay its share of dlog gamma, which
`_decay_gradient_kernel` sums over the chunk's blocks. Every product
is a tl.dot at float32 accuracy (`_precisions`); the tiles need d_k, d_v <= MAX_D.

Two ops share the kernels: `delta_rule` takes q, k, v, beta as given (`delta_rule_chunked`'s fused
form); `delta_layer` takes DeltaMinGRU's projection output (`delta.split_projection`), normalizes
the keys and gates the write strengths (beta = 2 sigmoid) as it loads them (RAW), differentiates
both in the backward, and writes the four gradients into one buffer laid out as that output.
"""
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from mingru.delta import split_projection
from mingru.dispatch import ScanFallback
from mingru.kernels.common import (cdiv, check_envelope, dot_precision, is_wrap_triton_enabled, launch, next_pow2,
                                   planned, scan_op)
from mingru.kernels.triangular import _unit_lower_inverse

BS = 16     # micro-steps per block of the chunk's triangular system
# micro-steps per block of the two readout kernels: in an H100 sweep (the rule with decay, GPU clock
# per kernel, 4 heads at B16 T1024 d_k 64 and 16, B128 T64 d_k 16) 32 ran both readouts faster than BS
# at every shape, while 32 and 64 ran the solve and the gradient kernel slower (so did 8 warps and
# tf32x3 in the gradient kernel).
READOUT_BS = 32
MAX_D = 64  # d_k and d_v: the state and its cotangent live in registers
WARPS = 4       # every kernel (8 measured slower for the chunk kernels on an H100)
WALK_BV = 32    # state columns per program of the walks (the columns of S walk independently)
WALK_ROWS = 32  # micro-steps per step of the walks
NORM_EPS = tl.constexpr(1e-12)  # F.normalize's eps, for the layer's keys
SPLIT_LOCAL = True  # tf32x3 in the chunk-local kernels where `_precisions` allows (False: IEEE everywhere)
SPLIT_MIN_DK = 64  # ... and keys at least this wide: on an H100 the split was faster at d_k = 64, slower at 16


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
def _state_tile(DK, DV, v0, BDK: tl.constexpr, BV: tl.constexpr):
    """Element offsets and mask of columns v0 .. v0 + BV of a DK x DV state, as a (BDK, BV) tile."""
    rk, rv = tl.arange(0, BDK), v0 + tl.arange(0, BV)
    return rk[:, None] * DV + rv[None, :], (rk[:, None] < DK) & (rv[None, :] < DV)


@triton.jit
def _state_ptrs(P, off, DK, DV, BDK: tl.constexpr, BDV: tl.constexpr):
    cells, mask = _state_tile(DK, DV, 0, BDK, BDV)
    return P + off + cells, mask


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
def _solve_kernel(K, V, BETA, G, U, W,
                  skb, skt, skj, skh, svb, svt, svj, svh, sbb, sbt, sbj, sbh, sgb, sgt, sgh,
                  H, T, C, NH, DK, DV,
                  BDK: tl.constexpr, BDV: tl.constexpr, CP: tl.constexpr, BS: tl.constexpr,
                  DECAY: tl.constexpr, RAW: tl.constexpr, F64: tl.constexpr, PREC: tl.constexpr):
    """The UT transform of chunk program_id(0) of one (batch row, head) program_id(1): u0 = T^{-1} v
    into U and w = T^{-1} diag(e^c) k into W (both (B, T, nh, H, d) contiguous), by blocks: block i
    solves against the blocks j < i, read back from U and W."""
    n, pid = tl.program_id(0), tl.program_id(1)
    b, h = (pid // H).to(tl.int64), pid % H
    k_off, v_off, beta_off, g_off = b * skb + h * skh, b * svb + h * svh, b * sbb + h * sbh, b * sgb + h * sgh
    su_t, su_j, sw_t, sw_j = NH * H * DV, H * DV, NH * H * DK, H * DK
    u_off, w_off = b * T * su_t + h * DV, b * T * sw_t + h * DK
    g = _chunk_decay(G, g_off, sgt, n, C, T, CP, F64, DECAY)
    for i in range(tl.cdiv(C * NH, BS)):
        m_i, tok_i, t_i, live_i = _micro(n, i, C, NH, T, BS)
        K_i = _keys(K, k_off, skt, skj, t_i, m_i % NH, live_i, DK, BDK, F64, RAW)
        b_i = _betas(BETA, beta_off, sbt, sbj, t_i, m_i % NH, live_i, F64, RAW)
        c_i = _cum(g, tok_i, CP)
        r = _rows(V, v_off, svt, svj, t_i, m_i % NH, live_i, DV, BDV, F64)
        w = K_i * tl.exp(c_i)[:, None]
        for j in range(i):
            m_j, tok_j, t_j, live_j = _micro(n, j, C, NH, T, BS)
            Kb_j = _keys(K, k_off, skt, skj, t_j, m_j % NH, live_j, DK, BDK, F64, RAW) * \
                _betas(BETA, beta_off, sbt, sbj, t_j, m_j % NH, live_j, F64, RAW)[:, None]
            L = _dot(K_i, tl.trans(Kb_j), PREC) * tl.exp(c_i[:, None] - _cum(g, tok_j, CP)[None, :])
            r -= _dot(L, _rows(U, u_off, su_t, su_j, t_j, m_j % NH, live_j, DV, BDV, F64), PREC)
            w -= _dot(L, _rows(W, w_off, sw_t, sw_j, t_j, m_j % NH, live_j, DK, BDK, F64), PREC)
        D = _diagonal_inverse(K_i, b_i, c_i, m_i, BS, PREC)
        _put_rows(U, u_off, su_t, su_j, t_i, m_i % NH, live_i, DV, _dot(D, r, PREC), BDV)
        _put_rows(W, w_off, sw_t, sw_j, t_i, m_i % NH, live_i, DK, _dot(D, w, PREC), BDK)
        tl.debug_barrier()  # the later blocks read u0_i and w_i back


@triton.jit
def _walk_kernel(K, BETA, G, H0, U0, W, U, S0, HT,
                 skb, skt, skj, skh, sbb, sbt, sbj, sbh, sgb, sgt, sgh,
                 H, T, C, NH, N, DK, DV,
                 BDK: tl.constexpr, BV: tl.constexpr, CP: tl.constexpr, WB: tl.constexpr,
                 DECAY: tl.constexpr, HAS_H0: tl.constexpr, RAW: tl.constexpr, F64: tl.constexpr,
                 PREC: tl.constexpr):
    """The only sequential part: one (batch row, head) program_id(0) and BV columns program_id(1) of
    the state walk the chunks in order, u = u0 - w S (u0 from U0, u into U; they may be one buffer),
    S' = e^{c_end} S + Kc^T u, and
    store S at each chunk start (S0, (B, H, N, DK, DV)) and at the end (HT)."""
    pid, v0 = tl.program_id(0), tl.program_id(1) * BV
    b, h = (pid // H).to(tl.int64), pid % H
    k_off, beta_off, g_off = b * skb + h * skh, b * sbb + h * sbh, b * sgb + h * sgh
    su_t, su_j, sw_t, sw_j = NH * H * DV, H * DV, NH * H * DK, H * DK
    u_off, w_off = b * T * su_t + h * DV + v0, b * T * sw_t + h * DK
    sp, smask = _state_tile(DK, DV, v0, BDK, BV)
    s_off = pid.to(tl.int64) * DK * DV
    if HAS_H0:
        S = tl.load(H0 + s_off + sp, mask=smask, other=0.0).to(tl.float64 if F64 else tl.float32)
    else:
        S = tl.zeros([BDK, BV], tl.float64 if F64 else tl.float32)
    for n in range(N):
        tl.store(S0 + s_off * N + n * DK * DV + sp, S.to(S0.dtype.element_ty), mask=smask)
        g = _chunk_decay(G, g_off, sgt, n, C, T, CP, F64, DECAY)
        c_end = tl.sum(g, 0)
        S_end = S * tl.exp(c_end)
        for i in range(tl.cdiv(C * NH, WB)):
            m_i, tok_i, t_i, live_i = _micro(n, i, C, NH, T, WB)
            u = _rows(U0, u_off, su_t, su_j, t_i, m_i % NH, live_i, DV - v0, BV, F64) - \
                _dot(_rows(W, w_off, sw_t, sw_j, t_i, m_i % NH, live_i, DK, BDK, F64), S, PREC)
            _put_rows(U, u_off, su_t, su_j, t_i, m_i % NH, live_i, DV - v0, u, BV)
            Kc = _keys(K, k_off, skt, skj, t_i, m_i % NH, live_i, DK, BDK, F64, RAW) * \
                (_betas(BETA, beta_off, sbt, sbj, t_i, m_i % NH, live_i, F64, RAW) *
                 tl.exp(c_end - _cum(g, tok_i, CP)))[:, None]
            S_end += _dot(tl.trans(Kc), u, PREC)
        S = S_end
    tl.store(HT + s_off + sp, S.to(HT.dtype.element_ty), mask=smask)


@triton.jit
def _readout_kernel(Q, K, BETA, G, U, S0, Y,
                    sqb, sqt, sqh, skb, skt, skj, skh, sbb, sbt, sbj, sbh, sgb, sgt, sgh,
                    H, T, C, NH, N, DK, DV,
                    BDK: tl.constexpr, BDV: tl.constexpr, CP: tl.constexpr, BS: tl.constexpr,
                    DECAY: tl.constexpr, RAW: tl.constexpr, F64: tl.constexpr, PREC: tl.constexpr):
    """y of chunk program_id(0), one (batch row, head) program_id(1): y_t = e^{c_t} S^T q_t + sum_l
    read[t, l] u_l, by blocks of queries (rows at micro-steps, see `_queries`); Y (B, T, H, DV)."""
    n, pid = tl.program_id(0), tl.program_id(1)
    b, h = (pid // H).to(tl.int64), pid % H
    q_off, k_off, beta_off, g_off = b * sqb + h * sqh, b * skb + h * skh, b * sbb + h * sbh, b * sgb + h * sgh
    su_t, su_j = NH * H * DV, H * DV
    u_off, y_off = b * T * su_t + h * DV, b * T * H * DV + h * DV
    ptrs, smask = _state_ptrs(S0, (pid.to(tl.int64) * N + n) * DK * DV, DK, DV, BDK, BDV)
    S = tl.load(ptrs, mask=smask, other=0.0).to(tl.float64 if F64 else tl.float32)
    g = _chunk_decay(G, g_off, sgt, n, C, T, CP, F64, DECAY)
    for i in range(tl.cdiv(C * NH, BS)):
        m_i, tok_i, t_i, live_i = _micro(n, i, C, NH, T, BS)
        c_i = _cum(g, tok_i, CP)
        Q_i, live_q = _queries(Q, q_off, sqt, t_i, m_i, live_i, NH, DK, BDK, F64)
        y = _dot(Q_i * tl.exp(c_i)[:, None], S, PREC)
        for j in range(i + 1):
            m_j, tok_j, t_j, live_j = _micro(n, j, C, NH, T, BS)
            Kb_j = _keys(K, k_off, skt, skj, t_j, m_j % NH, live_j, DK, BDK, F64, RAW) * \
                _betas(BETA, beta_off, sbt, sbj, t_j, m_j % NH, live_j, F64, RAW)[:, None]
            R = _decayed(_dot(Q_i, tl.trans(Kb_j), PREC), tok_j[None, :] <= tok_i[:, None], c_i, _cum(g, tok_j, CP))
            y += _dot(R, _rows(U, u_off, su_t, su_j, t_j, m_j % NH, live_j, DV, BDV, F64), PREC)
        _put_rows(Y, y_off, H * DV, 0, t_i, m_i * 0, live_q, DV, y, BDV)


@triton.jit
def _readout_back_kernel(Q, K, BETA, G, DY, DU0, E,
                         sqb, sqt, sqh, skb, skt, skj, skh, sbb, sbt, sbj, sbh, sgb, sgt, sgh,
                         sdub, sdut, sduj, sduh,
                         H, T, C, NH, N, DK, DV,
                         BDK: tl.constexpr, BDV: tl.constexpr, CP: tl.constexpr, BS: tl.constexpr,
                         DECAY: tl.constexpr, RAW: tl.constexpr, F64: tl.constexpr, PREC: tl.constexpr):
    """The readout's cotangents of chunk program_id(0), one (batch row, head) program_id(1), before
    the walk back: read^T dy into DU0 (strides sdu*) and (diag(e^c) Q)^T dy into E[n] ((B, H, N, DK, DV))."""
    n, pid = tl.program_id(0), tl.program_id(1)
    b, h = (pid // H).to(tl.int64), pid % H
    q_off, k_off, beta_off, g_off = b * sqb + h * sqh, b * skb + h * skh, b * sbb + h * sbh, b * sgb + h * sgh
    y_off, du_off = b * T * H * DV + h * DV, b * sdub + h * sduh
    g = _chunk_decay(G, g_off, sgt, n, C, T, CP, F64, DECAY)
    NB = tl.cdiv(C * NH, BS)
    e = tl.zeros([BDK, BDV], tl.float64 if F64 else tl.float32)
    for j in range(NB):
        m_j, tok_j, t_j, live_j = _micro(n, j, C, NH, T, BS)
        c_j = _cum(g, tok_j, CP)
        Kb_j = _keys(K, k_off, skt, skj, t_j, m_j % NH, live_j, DK, BDK, F64, RAW) * \
            _betas(BETA, beta_off, sbt, sbj, t_j, m_j % NH, live_j, F64, RAW)[:, None]
        du = tl.zeros([BS, BDV], tl.float64 if F64 else tl.float32)
        for i in range(j, NB):
            m_i, tok_i, t_i, live_i = _micro(n, i, C, NH, T, BS)
            Q_i, live_qi = _queries(Q, q_off, sqt, t_i, m_i, live_i, NH, DK, BDK, F64)
            R = _decayed(_dot(Q_i, tl.trans(Kb_j), PREC), tok_j[None, :] <= tok_i[:, None], _cum(g, tok_i, CP), c_j)
            du += _dot(tl.trans(R), _rows(DY, y_off, H * DV, 0, t_i, m_i * 0, live_qi, DV, BDV, F64), PREC)
        _put_rows(DU0, du_off, sdut, sduj, t_j, m_j % NH, live_j, DV, du, BDV)
        Q_j, live_q = _queries(Q, q_off, sqt, t_j, m_j, live_j, NH, DK, BDK, F64)
        e += _dot(tl.trans(Q_j * tl.exp(c_j)[:, None]), _rows(DY, y_off, H * DV, 0, t_j, m_j * 0, live_q, DV, BDV, F64),
                  PREC)
    ptrs, smask = _state_ptrs(E, (pid.to(tl.int64) * N + n) * DK * DV, DK, DV, BDK, BDV)
    tl.store(ptrs, e.to(E.dtype.element_ty), mask=smask)


@triton.jit
def _walk_back_kernel(K, BETA, G, W, DHT, DU0, E, DU, DS, DH0,
                      skb, skt, skj, skh, sbb, sbt, sbj, sbh, sgb, sgt, sgh, sdub, sdut, sduj, sduh,
                      H, T, C, NH, N, DK, DV,
                      BDK: tl.constexpr, BV: tl.constexpr, CP: tl.constexpr, WB: tl.constexpr,
                      DECAY: tl.constexpr, HAS_H0: tl.constexpr, RAW: tl.constexpr, F64: tl.constexpr,
                      PREC: tl.constexpr):
    """The walk back, one (batch row, head) program_id(0) and BV columns program_id(1) of the state's
    cotangent dS from the last chunk: du = read^T dy + Kc dS' (read^T dy from DU0, du into DU, both
    with strides sdu*; they may be one buffer), dS = e^{c_end} dS' + (diag(e^c) Q)^T dy - w^T du (since (diag(e^c) k)^T T^{-T} =
    w^T; the readout's term from E[n]); DS[n] gets dS' (the cotangent of chunk n's end state; DS may
    be E), DH0 the last dS."""
    pid, v0 = tl.program_id(0), tl.program_id(1) * BV
    b, h = (pid // H).to(tl.int64), pid % H
    k_off, beta_off, g_off = b * skb + h * skh, b * sbb + h * sbh, b * sgb + h * sgh
    sw_t, sw_j = NH * H * DK, H * DK
    w_off, du_off = b * T * sw_t + h * DK, b * sdub + h * sduh + v0
    sp, smask = _state_tile(DK, DV, v0, BDK, BV)
    s_off = pid.to(tl.int64) * DK * DV
    dS = tl.load(DHT + s_off + sp, mask=smask, other=0.0).to(tl.float64 if F64 else tl.float32)
    for back in range(N):
        n = N - 1 - back
        g = _chunk_decay(G, g_off, sgt, n, C, T, CP, F64, DECAY)
        c_end = tl.sum(g, 0)
        at = s_off * N + n * DK * DV + sp
        dS_prev = dS * tl.exp(c_end) + tl.load(E + at, mask=smask, other=0.0).to(tl.float64 if F64 else tl.float32)
        tl.store(DS + at, dS.to(DS.dtype.element_ty), mask=smask)
        for i in range(tl.cdiv(C * NH, WB)):
            m_i, tok_i, t_i, live_i = _micro(n, i, C, NH, T, WB)
            Kc = _keys(K, k_off, skt, skj, t_i, m_i % NH, live_i, DK, BDK, F64, RAW) * \
                (_betas(BETA, beta_off, sbt, sbj, t_i, m_i % NH, live_i, F64, RAW) *
                 tl.exp(c_end - _cum(g, tok_i, CP)))[:, None]
            du = _rows(DU0, du_off, sdut, sduj, t_i, m_i % NH, live_i, DV - v0, BV, F64) + _dot(Kc, dS, PREC)
            _put_rows(DU, du_off, sdut, sduj, t_i, m_i % NH, live_i, DV - v0, du, BV)
            dS_prev -= _dot(tl.trans(_rows(W, w_off, sw_t, sw_j, t_i, m_i % NH, live_i, DK, BDK, F64)), du, PREC)
        dS = dS_prev
    if HAS_H0:
        tl.store(DH0 + s_off + sp, dS.to(DH0.dtype.element_ty), mask=smask)


@triton.jit
def _dr_kernel(K, BETA, G, DU, DVO,
               skb, skt, skj, skh, sbb, sbt, sbj, sbh, sgb, sgt, sgh, sdvb, sdvt, sdvj, sdvh, sdub, sdut, sduj, sduh,
               H, T, C, NH, DK, DV,
               BDK: tl.constexpr, BDV: tl.constexpr, CP: tl.constexpr, BS: tl.constexpr,
               DECAY: tl.constexpr, RAW: tl.constexpr, F64: tl.constexpr, PREC: tl.constexpr):
    """dr = T^{-T} du of chunk program_id(0), one (batch row, head) program_id(1), by blocks from the
    last: dr_j = D_j^T (du_j - sum_{i>j} L_ij^T dr_i), from the walk back's du (DU, strides sdu*; it
    may be DVO) into DVO (dv = dr), which the earlier blocks read back."""
    n, pid = tl.program_id(0), tl.program_id(1)
    b, h = (pid // H).to(tl.int64), pid % H
    k_off, beta_off, g_off = b * skb + h * skh, b * sbb + h * sbh, b * sgb + h * sgh
    dv_off = b * sdvb + h * sdvh
    NB = tl.cdiv(C * NH, BS)
    g = _chunk_decay(G, g_off, sgt, n, C, T, CP, F64, DECAY)
    for rb in range(NB):
        j = NB - 1 - rb
        m_j, tok_j, t_j, live_j = _micro(n, j, C, NH, T, BS)
        K_j = _keys(K, k_off, skt, skj, t_j, m_j % NH, live_j, DK, BDK, F64, RAW)
        b_j = _betas(BETA, beta_off, sbt, sbj, t_j, m_j % NH, live_j, F64, RAW)
        c_j = _cum(g, tok_j, CP)
        Kb_j = K_j * b_j[:, None]
        du = _rows(DU, b * sdub + h * sduh, sdut, sduj, t_j, m_j % NH, live_j, DV, BDV, F64)
        for i in range(j + 1, NB):
            m_i, tok_i, t_i, live_i = _micro(n, i, C, NH, T, BS)
            K_i = _keys(K, k_off, skt, skj, t_i, m_i % NH, live_i, DK, BDK, F64, RAW)
            E = tl.exp(_cum(g, tok_i, CP)[:, None] - c_j[None, :])
            du -= _dot(tl.trans(_dot(K_i, tl.trans(Kb_j), PREC) * E),
                       _rows(DVO, dv_off, sdvt, sdvj, t_i, m_i % NH, live_i, DV, BDV, F64), PREC)
        dr = _dot(tl.trans(_diagonal_inverse(K_j, b_j, c_j, m_j, BS, PREC)), du, PREC)
        _put_rows(DVO, dv_off, sdvt, sdvj, t_j, m_j % NH, live_j, DV, dr, BDV)
        tl.debug_barrier()  # the earlier blocks read dr back


@triton.jit
def _gradient_kernel(Q, K, BETA, G, U, S0, DY, DS, DQ, DKK, DVO, DB, DGB,
                     sqb, sqt, sqh, skb, skt, skj, skh, sbb, sbt, sbj, sbh, sgb, sgt, sgh,
                     sdqb, sdqt, sdqh, sdkb, sdkt, sdkj, sdkh, sdvb, sdvt, sdvj, sdvh, sdbb, sdbt, sdbj, sdbh,
                     H, T, C, NH, N, DK, DV,
                     BDK: tl.constexpr, BDV: tl.constexpr, CP: tl.constexpr, BS: tl.constexpr,
                     DECAY: tl.constexpr, RAW: tl.constexpr, F64: tl.constexpr, PREC: tl.constexpr):
    """The gradients of block program_id(0) % NB of micro-steps of chunk program_id(0) // NB, one
    (batch row, head) program_id(1), from dr (DVO, `_dr_kernel`) and dS' (DS[n]): its rows of DQ, DKK,
    DB (own strides sd*) from its rows and columns of dL = -(dr u^T) e^{c_i - c_l} (l < i) and of
    dread = dy u^T e^{c_t - c_l} (token(l) <= t, queries at micro-steps). With DECAY, the block's share
    of dlog gamma over the chunk's CP tokens goes to DGB[(pid, n, block)] (`_decay_gradient_kernel`
    sums the shares); the block 0 adds the share of the chunk-start state."""
    nj, pid = tl.program_id(0), tl.program_id(1)
    NB = tl.cdiv(C * NH, BS)
    n, j = nj // NB, nj % NB
    b, h = (pid // H).to(tl.int64), pid % H
    q_off, k_off, beta_off, g_off = b * sqb + h * sqh, b * skb + h * skh, b * sbb + h * sbh, b * sgb + h * sgh
    su_t, su_j = NH * H * DV, H * DV                     # u: (B, T, nh, H, DV) contiguous
    u_off, y_off = b * T * su_t + h * DV, b * T * H * DV + h * DV
    dq_off, dk_off, dv_off = b * sdqb + h * sdqh, b * sdkb + h * sdkh, b * sdvb + h * sdvh
    db_off = b * sdbb + h * sdbh
    ptrs, smask = _state_ptrs(S0, (pid.to(tl.int64) * N + n) * DK * DV, DK, DV, BDK, BDV)
    S = tl.load(ptrs, mask=smask, other=0.0).to(tl.float64 if F64 else tl.float32)
    ptrs, _ = _state_ptrs(DS, (pid.to(tl.int64) * N + n) * DK * DV, DK, DV, BDK, BDV)
    dS = tl.load(ptrs, mask=smask, other=0.0).to(tl.float64 if F64 else tl.float32)
    s = tl.arange(0, CP)
    g = _chunk_decay(G, g_off, sgt, n, C, T, CP, F64, DECAY)
    c_end = tl.sum(g, 0)
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
    w = tl.exp(c_end - c_j)
    dKc = _dot(U_j, tl.trans(dS), PREC)               # through beta e^{c_end - c} k in S'
    x = tl.sum(dKc * K_j, 1)
    dk += (b_j * w)[:, None] * dKc
    db += w * x
    dc -= b_j * w * x
    if RAW:  # back through k = normalize(k_raw) and beta = 2 sigmoid(beta_raw)
        raw = _rows(K, k_off, skt, skj, t_j, m_j % NH, live_j, DK, BDK, F64)
        norm = tl.sqrt(tl.sum(raw * raw, 1))
        radial = tl.where(norm > NORM_EPS, tl.sum(K_j * dk, 1), 0.0)
        dk = (dk - K_j * radial[:, None]) / tl.maximum(norm, NORM_EPS)[:, None]
        db = db * b_j * (1.0 - 0.5 * b_j)
    _put_rows(DKK, dk_off, sdkt, sdkj, t_j, m_j % NH, live_j, DK, dk, BDK)
    _put_rows(DQ, dq_off, sdqt, 0, t_j, m_j * 0, live_q, DK, dq, BDK)
    tl.store(DB + db_off + t_j.to(tl.int64) * sdbt + (m_j % NH) * sdbj, db.to(DB.dtype.element_ty), mask=live_j)
    if DECAY:  # c_t sums log gamma over the chunk's tokens <= t; c_end over all of them
        dce = tl.sum(b_j * w * x, 0)
        if j == 0:
            dce += tl.sum(tl.sum(S * dS, 1), 0) * tl.exp(c_end)
        dct = tl.sum(tl.where(tok_j[:, None] == s[None, :], dc[:, None], 0.0), 0)  # d c per token
        dg = tl.sum(tl.where(s[:, None] <= s[None, :], dct[None, :], 0.0), 1) + dce
        tl.store(DGB + ((pid.to(tl.int64) * N + n) * NB + j) * CP + s, dg)


@triton.jit
def _decay_gradient_kernel(DGB, DG, H, T, C, NH, N, CP: tl.constexpr, BS: tl.constexpr):
    """dlog gamma (DG, (B, T, H) contiguous) of chunk program_id(0), one (batch row, head)
    program_id(1): the sum of its blocks' shares (`_gradient_kernel`)."""
    n, pid = tl.program_id(0), tl.program_id(1)
    b, h = (pid // H).to(tl.int64), pid % H
    NB = tl.cdiv(C * NH, BS)
    s = tl.arange(0, CP)
    dg = tl.zeros([CP], DGB.dtype.element_ty)
    for j in range(NB):
        dg += tl.load(DGB + ((pid.to(tl.int64) * N + n) * NB + j) * CP + s)
    tl.store(DG + b * T * H + h + (n * C + s).to(tl.int64) * H, dg.to(DG.dtype.element_ty),
             mask=(s < C) & (n * C + s < T))


# ---- launches ------------------------------------------------------------------------------

def _args(kernel, common, **options):
    """The entries of `common` that `kernel` takes, plus launch options."""
    names = set(kernel.arg_names)
    return {**{name: value for name, value in common.items() if name in names}, **options}


@planned
def _plan(shape, dv, C, q, k, v, beta, g, f64, decay, has_h0, raw, prec):
    """The forward kernels' arguments besides the tensors, kernel by kernel: k of `shape` (B, T, nh,
    H, d_k), chunks of C tokens; q, k, v, beta, g: the strides of the inputs (g None without decay)."""
    B, T, nh, H, dk = shape
    bdk, bdv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    state, local = prec  # the walks' and the gradient kernels', the chunk-local kernels' (`_precisions`)
    common = dict(sqb=q[0], sqt=q[1], sqh=q[2], skb=k[0], skt=k[1], skj=k[2], skh=k[3],
                  svb=v[0], svt=v[1], svj=v[2], svh=v[3], sbb=beta[0], sbt=beta[1], sbj=beta[2], sbh=beta[3],
                  **dict(zip(("sgb", "sgt", "sgh"), g or (0, 0, 0))),
                  H=H, T=T, C=C, NH=nh, N=cdiv(T, C), DK=dk, DV=dv, BDK=bdk, BDV=bdv, BV=min(bdv, WALK_BV),
                  CP=max(16, next_pow2(C)), BS=BS, WB=min(WALK_ROWS, max(16, next_pow2(C * nh))), DECAY=decay,
                  HAS_H0=has_h0, RAW=raw, F64=f64, PREC=state)
    return dict(common=common, solve=_args(_solve_kernel, common, PREC=local, num_warps=WARPS),
                walk=_args(_walk_kernel, common, num_warps=WARPS),
                readout=_args(_readout_kernel, common, BS=READOUT_BS, PREC=local, num_warps=WARPS))


@planned
def _backward_plan(key, dq, dk, dv, dbeta, du):
    """The backward kernels' arguments: the forward's of `key` (what `_plan` takes) and the strides of
    the gradients they write."""
    forward = _plan(*key)
    common = dict(forward["common"])  # the state's precision; the readout back takes the solve's
    common.update(zip(("sdqb", "sdqt", "sdqh"), dq[:3]))
    for p, strides in (("sdk", dk), ("sdv", dv), ("sdb", dbeta), ("sdu", du)):
        common.update(zip((p + "b", p + "t", p + "j", p + "h"), strides[:4]))
    return dict(common=common, readout=_args(_readout_back_kernel, common, BS=READOUT_BS,
                                             PREC=forward["solve"]["PREC"], num_warps=WARPS),
                walk=_args(_walk_back_kernel, common, num_warps=WARPS),
                dr=_args(_dr_kernel, common, num_warps=WARPS),
                gradient=_args(_gradient_kernel, common, num_warps=WARPS),
                decay=_args(_decay_gradient_kernel, common, num_warps=WARPS),
                blocks=cdiv(common["C"] * common["NH"], BS))


def _rows_last(x):
    """x with a unit stride along its last dim (what the kernels' row loads assume)."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _key(q, k, v, beta, log_gamma, h0, chunk_size, raw):
    return (tuple(k.shape), v.shape[-1], min(chunk_size, q.shape[1]), q.stride(), k.stride(), v.stride(),
            beta.stride(), None if log_gamma is None else log_gamma.stride(), q.dtype == torch.float64,
            log_gamma is not None, h0 is not None, raw, _precisions(q))


def _precisions(x):
    """(PREC of the walks and the gradient kernels, PREC of the chunk-local solve and readouts) for
    queries x of shape (B, T, H, d_k). Under the IEEE guard, float32 with d_k >= SPLIT_MIN_DK on an
    NVIDIA GPU with TF32 tensor cores (compute capability >= 8), the chunk-local kernels multiply in
    "tf32x3": each operand split into a TF32 head and a TF32 tail, three tensor-core products
    summed, float32 accuracy (`bench.precision` measures the error and time of each choice); the
    walks and the gradient kernels keep IEEE dots (three products there measured slower than the
    FMA dots)."""
    prec = dot_precision()
    if (SPLIT_LOCAL and prec == "ieee" and x.dtype == torch.float32 and x.shape[-1] >= SPLIT_MIN_DK and x.is_cuda
            and _tensor_cores(x.device.index)):
        return prec, "tf32x3"
    return prec, prec


@functools.lru_cache(maxsize=None)
def _tensor_cores(index):
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 8


def _own(buffer, fresh=None):
    """The buffer a launch writes where an earlier launch wrote `buffer`: `buffer` itself in eager
    (each kernel reads what it replaces before writing it, program by program), and a buffer of its
    own (`fresh`, or one like `buffer`) under a tracer: torch.compile gave wrong results when a
    launch rewrote a buffer an earlier launch had written, and with one writer per buffer it sees
    every dependency."""
    if not is_wrap_triton_enabled():
        return buffer
    return _contiguous(buffer) if fresh is None else fresh


def _run_forward(q, k, v, beta, log_gamma, h0, chunk_size, raw):
    """(y, h_T, u, w, the chunk-start states); q, k, v and log_gamma with unit last strides, h0
    contiguous. Three launches: the chunks' solves, the walk, the chunks' readouts."""
    B, T, nh, H, dk = k.shape
    dv = v.shape[-1]
    plan = _plan(*_key(q, k, v, beta, log_gamma, h0, chunk_size, raw))
    N, BV = plan["common"]["N"], plan["common"]["BV"]
    y, hT = q.new_empty(B, T, H, dv), q.new_empty(B, H, dk, dv)
    u, w = q.new_empty(B, T, nh, H, dv), q.new_empty(B, T, nh, H, dk)
    starts, G = q.new_empty(B, H, N, dk, dv), q if log_gamma is None else log_gamma
    u0 = _own(u)
    launch(_solve_kernel, (N, B * H), plan["solve"], K=k, V=v, BETA=beta, G=G, U=u0, W=w)
    launch(_walk_kernel, (B * H, cdiv(dv, BV)), plan["walk"], K=k, BETA=beta, G=G, H0=q if h0 is None else h0,
           U0=u0, W=w, U=u, S0=starts, HT=hT)
    launch(_readout_kernel, (N, B * H), plan["readout"], Q=q, K=k, BETA=beta, G=G, U=u, S0=starts, Y=y)
    return y, hT, u, w, starts


def _run_backward(q, k, v, beta, log_gamma, h0, chunk_size, raw, u, w, starts, dy, dhT, dq, dk, dv, dbeta):
    """Fill dq, dk, dv, dbeta (any strides with a unit last one); return (dlog_gamma, dh0), empty
    where the input is absent. Three launches: the readouts' cotangents, the walk back, the chunks'
    gradients."""
    B, T, nh, H, _ = k.shape
    du = _own(dv, _contiguous(u))  # read^T dy, then du, then (in the last kernel) dr = dv
    du0, e = _own(du), _contiguous(starts)
    plan = _backward_plan(_key(q, k, v, beta, log_gamma, h0, chunk_size, raw), dq.stride(), dk.stride(),
                          dv.stride(), dbeta.stride(), du.stride())
    N, BV = plan["common"]["N"], plan["common"]["BV"]
    dg = torch.empty(log_gamma.shape, dtype=q.dtype, device=q.device) if log_gamma is not None else q.new_empty(0)
    dh0 = torch.empty(h0.shape, dtype=q.dtype, device=q.device) if h0 is not None else q.new_empty(0)
    ds = _own(e)
    G, dy = q if log_gamma is None else log_gamma, dy.contiguous()
    launch(_readout_back_kernel, (N, B * H), plan["readout"], Q=q, K=k, BETA=beta, G=G, DY=dy, DU0=du0, E=e)
    launch(_walk_back_kernel, (B * H, cdiv(v.shape[-1], BV)), plan["walk"], K=k, BETA=beta, G=G, W=w,
           DHT=dhT.contiguous(), DU0=du0, E=e, DU=du, DS=ds, DH0=dh0 if h0 is not None else q)
    launch(_dr_kernel, (N, B * H), plan["dr"], K=k, BETA=beta, G=G, DU=du, DVO=dv)
    NB = plan["blocks"]
    dgb = q.new_empty(B * H * N * NB * plan["common"]["CP"]) if log_gamma is not None else q.new_empty(0)
    launch(_gradient_kernel, (N * NB, B * H), plan["gradient"], Q=q, K=k, BETA=beta, G=G, U=u, S0=starts, DY=dy,
           DS=ds, DQ=dq, DKK=dk, DVO=dv, DB=dbeta, DGB=dgb)
    if log_gamma is not None:
        launch(_decay_gradient_kernel, (N, B * H), plan["decay"], DGB=dgb, DG=dg)
    return dg, dh0


def _contiguous(x):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# -- the rule on q, k, v, beta as given (delta_rule_chunked's fused form) --

def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
             log_gamma: Optional[torch.Tensor], h0: Optional[torch.Tensor],
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, log_gamma = (_rows_last(x) for x in (q, k, v, log_gamma))
    return _run_forward(q, k, v, beta, log_gamma, None if h0 is None else h0.contiguous(), chunk_size, False)


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
              log_gamma: Optional[torch.Tensor], h0: Optional[torch.Tensor], chunk_size: int,
              y: torch.Tensor, hT: torch.Tensor, u: torch.Tensor, w: torch.Tensor, starts: torch.Tensor,
              dy: torch.Tensor, dhT: torch.Tensor, du: torch.Tensor, dw: torch.Tensor,
              dstarts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor, torch.Tensor]:
    q, k, v, log_gamma = (_rows_last(x) for x in (q, k, v, log_gamma))
    dq, dk, dv, dbeta = _contiguous(q), _contiguous(k), _contiguous(v), _contiguous(beta)
    dg, dh0 = _run_backward(q, k, v, beta, log_gamma, h0, chunk_size, False, u, w, starts, dy, dhT, dq, dk, dv,
                            dbeta)
    return dq, dk, dv, dbeta, dg, dh0


# y and the final state carry gradients but the backward never reads them (they are not kept: y's
# memory goes once the layer after it is done with it); u, w and the chunk-start states only carry
# the forward's work to the backward
_delta_rule = scan_op("delta_rule", _forward, _backward, saved=(0, 1, 2, 3, 4, 5, 6), optional=(4, 5), aux=3,
                      unread=(0, 1))


# -- the rule on the layer's projection output (DeltaMinGRU's fused form) --

def _layer_forward(proj: torch.Tensor, log_gamma: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                   chunk_size: int, n_heads: int, nh: int, d_k: int,
                   d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    proj, log_gamma = proj.contiguous(), _rows_last(log_gamma)
    return _run_forward(*split_projection(proj, n_heads, nh, d_k, d_v), log_gamma,
                        None if h0 is None else h0.contiguous(), chunk_size, True)


def _layer_backward(proj: torch.Tensor, log_gamma: Optional[torch.Tensor], h0: Optional[torch.Tensor],
                    chunk_size: int, n_heads: int, nh: int, d_k: int, d_v: int, y: torch.Tensor, hT: torch.Tensor,
                    u: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, dy: torch.Tensor, dhT: torch.Tensor,
                    du: torch.Tensor, dw: torch.Tensor, dstarts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor]:
    proj, log_gamma = proj.contiguous(), _rows_last(log_gamma)
    dproj = _contiguous(proj)  # the four gradients land in one buffer, laid out as proj
    dg, dh0 = _run_backward(*split_projection(proj, n_heads, nh, d_k, d_v), log_gamma, h0, chunk_size, True, u,
                            w, starts, dy, dhT, *split_projection(dproj, n_heads, nh, d_k, d_v))
    return dproj, dg, dh0


_delta_layer = scan_op("delta_layer", _layer_forward, _layer_backward, saved=tuple(range(8)), optional=(1, 2),
                       aux=3, unread=(0, 1))


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
    y, hT, *_ = _delta_rule(q, k, v, beta, log_gamma, h0, chunk_size)
    return y, hT


def delta_layer(proj, log_gamma, h0, chunk_size, n_heads, nh, d_k, d_v):
    """The Triton path of `delta.delta_layer`: the rule on DeltaMinGRU's projection output, its keys
    normalized and its write strengths gated inside the kernels, and its gradient in one buffer."""
    _check(proj, (log_gamma, h0), d_k, d_v)
    y, hT, *_ = _delta_layer(proj, log_gamma, h0, chunk_size, n_heads, nh, d_k, d_v)
    return y, hT
