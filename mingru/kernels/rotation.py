"""Angle-fused Givens recurrence: h_t = decay_t G_{t,L} ... G_{t,1} S_t h_{t-1} + u_t, in registers.

S_t = diag(1, s_t, 1, s_t, ...) scales the odd components by scale_t (identity when no scale is
given): with k = 2 and one layer, decay_t R(theta_t) diag(1, s_t) is RotationMinGRU's transition.

Each program owns BLOCK_N lanes (b, n) and walks T. A lane's state is kept as its even and odd
halves E, O (k/2 each): even layers rotate the pairs (E_j, O_j), odd layers (O_j, E_{j+1 mod k/2}),
so a transition costs O(L k) flops and no k x k matrix ever exists, in registers or in memory.
The scale multiplies O before the first layer.

The backward walks T in reverse with the adjoint lam_t = g_t + decay_{t+1} G_{t+1}^T lam_{t+1}. The
per-layer intermediates of step t are recomputed from h_{t-1}, read back from the forward output,
and the layers are undone with G_l^T: rotations are orthogonal, so nothing is ever divided by a
decay (undoing a step by its inverse amplifies rounding by decay^-T).

A step's loads do not depend on the state, so Triton's software pipeliner prefetches them
STAGES - 1 steps ahead (cp.async into shared memory, for 32- and 64-bit inputs) while the serial
chain of rotations runs; that chain, not bandwidth, bounds the walk.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from mingru.kernels import layout
from mingru.kernels.common import cdiv, check_envelope, launch, planned, scan_op

BLOCK_KS = (2, 4, 8, 16)
MAX_LAYERS = 16


@triton.jit
def _sincos(x):
    """sin and cos without branches (data-dependent branches would split the loop body): reduce by
    k pi/2 in two FMA steps, then Taylor polynomials on the remainder r; within ~1e-7 of sin(x) for
    |x| up to ~1e6 rad. Beyond that the float32 product x 2/pi can miss the quadrant and no float32
    angle is meaningful much further out (its spacing nears 2 pi), so r is clipped to [-1, 1] (wider
    than pi/4, to spare rounding near a quadrant's edge): sin and cos stay those of some angle, and
    a rotation stays a rotation. NaN and inf give NaN. (A second reduction would keep larger angles
    accurate, but it lengthens every step's chain: the walks measured much slower with it.)"""
    if x.dtype == tl.float64:
        s, c = tl.sin(x), tl.cos(x)
    else:
        k = tl.floor(x * 0.6366197723675814 + 0.5)
        r = tl.fma(k, 4.371139000186243e-08, tl.fma(k, -1.5707963705062866, x))  # float32(pi/2), its error
        r = tl.where(r > 1.0, 1.0, tl.where(r < -1.0, -1.0, r))  # NaN stays NaN
        r2 = r * r
        sr = r + r * r2 * (-1 / 6 + r2 * (1 / 120 + r2 * (-1 / 5040 + r2 * (1 / 362880))))
        cr = 1 + r2 * (-1 / 2 + r2 * (1 / 24 + r2 * (-1 / 720 + r2 * (1 / 40320 + r2 * (-1 / 3628800)))))
        q = k.to(tl.int32)  # quadrant: sin x = (sin r, cos r, -sin r, -cos r)[q mod 4]
        swap = (q & 1) != 0
        s = tl.where(swap, cr, sr)
        c = tl.where(swap, sr, cr)
        s = tl.where((q & 2) != 0, -s, s)
        c = tl.where(((q + 1) & 2) != 0, -c, c)
    return s, c


# A program's state tiles are [H, BLOCK_N] with the lanes on the fast axis. Rolling E by a row is
# a select with a constant mask and a sum: where one thread holds whole lanes it folds away when
# compiled (x + -0.0 is x exactly); where a lane's rows sit on several threads (the planner's 8
# lanes a warp) it is a shuffle within the warp, and those threads share out the lane's sines and
# cosines, most of a step's instructions. Memory is read and written through flat [H * BLOCK_N]
# vectors reshaped to tiles: a 2-D access with no contiguous axis lets Triton pick a thread order
# that differs between versions, and re-laying the tiles out through shared memory on every step.
# Helpers take whole steps, since under the interpreter every nested jit call costs milliseconds.

@triton.jit
def _roll_masks(H: tl.constexpr):
    i = tl.arange(0, H)
    nxt = (i[None, :] == (i[:, None] + 1) % H)[:, :, None]  # row j picks row j + 1
    prv = (i[None, :] == (i[:, None] + H - 1) % H)[:, :, None]  # row j picks row j - 1
    return nxt, prv


@triton.jit
def _load_rows(ptr, mask, like):
    """The flat vector at ptr as a tile shaped and typed like `like`."""
    return tl.reshape(tl.load(ptr, mask=mask, other=0.0), like.shape).to(like.dtype)


@triton.jit
def _step_sincos(ang_t, sal, mask, like, L: tl.constexpr):
    """The sines and cosines of one step's L layers of angles (at ang_t + l * sal), as two L-tuples
    of tiles shaped like `like`: computed once per step, read by every pass over its layers."""
    S = ()
    C = ()
    for l in tl.static_range(L):
        s, c = _sincos(_load_rows(ang_t + l * sal, mask, like))
        S = S + (s,)
        C = C + (c,)
    return S, C


@triton.jit
def _rotate(E, O, S, C, L: tl.constexpr):
    """Apply one step's L brick-wall layers (sines S, cosines C): even layers turn (E_j, O_j),
    odd layers (O_j, E_{j+1})."""
    nxt, prv = _roll_masks(E.shape[0])
    for l in tl.static_range(L):
        s, c = S[l], C[l]
        if l % 2 == 0:
            E, O = c * E - s * O, s * E + c * O
        else:
            En = tl.sum(tl.where(nxt, E[None, :, :], -0.0), axis=1)
            O, En = c * O - s * En, s * O + c * En
            E = tl.sum(tl.where(prv, En[None, :, :], -0.0), axis=1)
    return E, O


@triton.jit
def _rotate_back(E, O, NE, NO, S, C, dang_t, mask, L: tl.constexpr):
    """Walk one step's layers backwards from its rotated state (E, O) and adjoint (NE, NO), storing
    the angle gradients at dang_t + l * H; returns the adjoint of the unrotated state.

    A turned pair (p, q) has d p / d theta = -q and d q / d theta = p; the pair and its adjoint go
    back through G^T, exact because rotations are orthogonal.
    """
    H: tl.constexpr = E.shape[0]
    nxt, prv = _roll_masks(H)
    for r in tl.static_range(L):
        l = L - 1 - r
        s, c = S[L - 1 - r], C[L - 1 - r]  # (a tuple takes constexpr indices only)
        if l % 2 == 0:
            p, q, a, b = E, O, NE, NO
        else:
            p = O
            q = tl.sum(tl.where(nxt, E[None, :, :], -0.0), axis=1)
            a = NO
            b = tl.sum(tl.where(nxt, NE[None, :, :], -0.0), axis=1)
        dtheta = tl.reshape(b * p - a * q, [H * E.shape[1]])
        tl.store(dang_t + l * H, dtheta.to(dang_t.dtype.element_ty), mask=mask)
        p, q = c * p + s * q, c * q - s * p
        a, b = c * a + s * b, c * b - s * a
        if l % 2 == 0:
            E, O, NE, NO = p, q, a, b
        else:
            E = tl.sum(tl.where(prv, q[None, :, :], -0.0), axis=1)
            O = p
            NE = tl.sum(tl.where(prv, b[None, :, :], -0.0), axis=1)
            NO = a
    return NE, NO


@triton.jit
def _store_pair(ptr, E, O, mask):
    """Store the halves of k-vectors: E at ptr (flat, even slots), O one element later."""
    flat: tl.constexpr = E.shape[0] * E.shape[1]
    tl.store(ptr, tl.reshape(E, [flat]).to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + 1, tl.reshape(O, [flat]).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lanes(LANES, N, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Flat tile index f of this program: row j = f // BLOCK_N, lane f % BLOCK_N, its live mask and
    (b, n). (No pointer enters here: torch.compile's mutation analysis would count every pointer a
    call takes as reaching the indices it returns, and with them every store.)"""
    f = tl.arange(0, H * BLOCK_N)
    lane = tl.program_id(0) * BLOCK_N + f % BLOCK_N
    return f // BLOCK_N, lane, lane < LANES, (lane // N).to(tl.int64), (lane % N).to(tl.int64)


# Sizes and strides are not specialized: ==1 or %16 facts would only invite vectorized re-layouts.
_FWD_INTS = "LANES N T sab sat san sal saj sdb sdt sdn sub sut sun suk s0b s0n s0k ssb sst ssn".split()
_BWD_INTS = "LANES N T sgb sgt sgn sgk sab sat san sal saj sdb sdt sdn s0b s0n s0k ssb sst ssn sdaj".split()


@triton.jit(do_not_specialize=_FWD_INTS)
def _rotation_fwd_kernel(ang, dec, u, h0, sc, h, LANES, N, T,
                         sab, sat, san, sal, saj, sdb, sdt, sdn, sub, sut, sun, suk, s0b, s0n, s0k,
                         ssb, sst, ssn, HAS_H0: tl.constexpr, HAS_SCALE: tl.constexpr, L: tl.constexpr,
                         H: tl.constexpr,
                         BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    ACC = tl.float64 if h.dtype.element_ty == tl.float64 else tl.float32
    j, lane, live, b, n = _lanes(LANES, N, H, BLOCK_N)
    ang_f, dec_f = ang + b * sab + n * san + j * saj, dec + b * sdb + n * sdn  # angles and decay at t = 0
    u_f = u + b * sub + n * sun + 2 * j * suk
    h_f = h + (b * T * N + n) * (2 * H) + 2 * j  # h is contiguous (B, T, n, k)
    sc_f = sc + b * ssb + n * ssn
    E = tl.zeros([H, BLOCK_N], dtype=ACC)
    O = E
    if HAS_H0:
        h0_f = h0 + b * s0b + n * s0n + 2 * j * s0k
        E = _load_rows(h0_f, live, E)
        O = _load_rows(h0_f + s0k, live, O)
    # the loads do not depend on the state, so Triton's pipeliner can prefetch STAGES - 1 steps ahead
    for t in tl.range(0, T, num_stages=STAGES):
        d = _load_rows(dec_f + t * sdt, live, E)
        uE = _load_rows(u_f + t * sut, live, E)
        uO = _load_rows(u_f + t * sut + suk, live, E)
        if HAS_SCALE:
            O = _load_rows(sc_f + t * sst, live, O) * O
        S, C = _step_sincos(ang_f + t * sat, sal, live, E, L)
        E, O = _rotate(E, O, S, C, L)
        E = d * E + uE
        O = d * O + uO
        _store_pair(h_f + t * N * 2 * H, E, O, live)


@triton.jit(do_not_specialize=_BWD_INTS)
def _rotation_bwd_kernel(g, ang, dec, h0, sc, h, dang, ddec, du, dh0, dsc, LANES, N, T,
                         sgb, sgt, sgn, sgk, sab, sat, san, sal, saj, sdb, sdt, sdn, s0b, s0n, s0k,
                         ssb, sst, ssn, sdaj, HAS_H0: tl.constexpr, HAS_SCALE: tl.constexpr,
                         L: tl.constexpr, H: tl.constexpr,
                         BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    ACC = tl.float64 if h.dtype.element_ty == tl.float64 else tl.float32
    j, lane, live, b, n = _lanes(LANES, N, H, BLOCK_N)
    ang_f, dec_f = ang + b * sab + n * san + j * saj, dec + b * sdb + n * sdn  # angles and decay at t = 0
    g_f = g + b * sgb + n * sgn + 2 * j * sgk
    # h, du, dh0, ddecay, dscale and dangles are contiguous: (B,T,n,k), (B,T,n,k), (B,n,k), (B,T,n) twice,
    # (B,T,n,L,k/2)
    h_f = h + (b * T * N + n) * (2 * H) + 2 * j
    du_f = du + (b * T * N + n) * (2 * H) + 2 * j
    dang_f = dang + (b * T * N + n) * (L * H) + j * sdaj
    lane1 = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # one entry per lane, for ddecay
    ddec_1 = ddec + (lane1 // N).to(tl.int64) * T * N + lane1 % N
    dsc_1 = dsc + (lane1 // N).to(tl.int64) * T * N + lane1 % N
    sc_f = sc + b * ssb + n * ssn
    h0_f = h0 + b * s0b + n * s0n + 2 * j * s0k
    # M = decay_{t+1} G_{t+1}^T lam_{t+1}, zero after the last step
    ME = tl.zeros([H, BLOCK_N], dtype=ACC)
    MO = ME
    for s in tl.range(0, T, num_stages=STAGES):
        t = T - 1 - s
        LE = _load_rows(g_f + t * sgt, live, ME) + ME
        LO = _load_rows(g_f + t * sgt + sgk, live, MO) + MO
        # this step's rotated state, recomputed from h_{t-1} (h0, or zeros, at t = 0)
        prev_f = tl.where(t > 0, h_f + (t - 1) * N * 2 * H, h0_f)
        has_prev = lane < tl.where((t > 0) | HAS_H0, LANES, 0)  # bool & scalar bool gives ints in the interpreter
        yE = _load_rows(prev_f, has_prev, ME)
        yO = _load_rows(prev_f + tl.where(t > 0, 1, s0k), has_prev, ME)
        d = _load_rows(dec_f + t * sdt, live, ME)
        prev_O = yO
        if HAS_SCALE:
            s_t = _load_rows(sc_f + t * sst, live, ME)
            yO = s_t * yO
        S, C = _step_sincos(ang_f + t * sat, sal, live, ME, L)  # once for both passes over the layers
        yE, yO = _rotate(yE, yO, S, C, L)
        ME, MO = _rotate_back(yE, yO, d * LE, d * LO, S, C, dang_f + t * N * L * H, live, L)
        if HAS_SCALE:  # back through S_t: d scale = <adjoint of S_t h, odd part of h_{t-1}>
            tl.store(dsc_1 + t * N, tl.sum(MO * prev_O, axis=0).to(dsc.dtype.element_ty), mask=lane1 < LANES)
            MO = s_t * MO
        _store_pair(du_f + t * N * 2 * H, LE, LO, live)
        tl.store(ddec_1 + t * N, tl.sum(LE * yE + LO * yO, axis=0).to(ddec.dtype.element_ty), mask=lane1 < LANES)
    _store_pair(dh0 + (b * N + n) * (2 * H) + 2 * j, ME, MO, live)


@planned
def _plan(backward, shape, strides, has_h0, has_scale, itemsize, forced):
    """(grid, arguments besides the tensors) of the forward or the backward for angles of `shape`;
    strides: the kernel's stride arguments in _FWD_INTS / _BWD_INTS order after LANES, N, T (zeros
    for an absent h0 or scale). forced is layout's forced layout, which layout.rotation reads: it
    keys the memo."""
    B, T, N, L, H = shape
    lay = layout.rotation(T, L, H, itemsize, backward=backward)
    ints = dict(zip(_BWD_INTS if backward else _FWD_INTS, (B * N, N, T, *strides)))
    return (cdiv(B * N, lay.block),), dict(ints, HAS_H0=has_h0, HAS_SCALE=has_scale, L=L, H=H, BLOCK_N=lay.block,
                                           STAGES=lay.stages, num_warps=lay.warps)


def _optional(x):
    """The strides of an optional (B, N, width) tensor: zeros when it is absent."""
    return (0, 0, 0) if x is None else x.stride()


def _launch_fwd(angles, decay, u, h0, scale):
    B, T, N, L, H = angles.shape
    h = torch.empty(B, T, N, 2 * H, dtype=u.dtype, device=u.device)
    strides = (*angles.stride(), *decay.stride(), *u.stride(), *_optional(h0), *_optional(scale))
    grid, args = _plan(False, angles.shape, strides, h0 is not None, scale is not None, u.element_size(),
                       layout._forced)
    launch(_rotation_fwd_kernel, grid, args, ang=angles, dec=decay, u=u, h0=h0 if h0 is not None else h,
           sc=scale if scale is not None else decay, h=h)
    return h


def _launch_bwd(angles, decay, h0, scale, h, g):
    B, T, N, L, H = angles.shape
    dangles = torch.empty(angles.shape, dtype=angles.dtype, device=angles.device)
    ddecay = torch.empty(decay.shape, dtype=decay.dtype, device=decay.device)
    du, dh0 = torch.empty_like(h), torch.empty(B, N, 2 * H, dtype=h.dtype, device=h.device)
    dscale = torch.empty(decay.shape if scale is not None else 0, dtype=decay.dtype, device=decay.device)
    strides = (*g.stride(), *angles.stride(), *decay.stride(), *_optional(h0), *_optional(scale), dangles.stride(-1))
    grid, args = _plan(True, angles.shape, strides, h0 is not None, scale is not None, h.element_size(),
                       layout._forced)
    launch(_rotation_bwd_kernel, grid, args, g=g, ang=angles, dec=decay, h0=h0 if h0 is not None else h,
           sc=scale if scale is not None else decay, h=h, dang=dangles, ddec=ddecay, du=du, dh0=dh0,
           dsc=dscale if scale is not None else ddecay)
    return dangles, ddecay, du, dh0, dscale


def _rotation_fwd(angles: torch.Tensor, decay: torch.Tensor, u: torch.Tensor,
                  h0: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _launch_fwd(angles, decay, u, h0, scale)


def _rotation_bwd(angles: torch.Tensor, decay: torch.Tensor, h0: Optional[torch.Tensor],
                  scale: Optional[torch.Tensor], h: torch.Tensor,
                  g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_bwd(angles, decay, h0, scale, h, g)


# u is not saved: du = lam
_rotation_recurrence = scan_op("rotation_recurrence", _rotation_fwd, _rotation_bwd, saved=(0, 1, 3, 4),
                               optional=(3, 4))


def rotation_recurrence(angles, decay, u, h0=None, scale=None):
    """Entry point for the dispatch seam: the angle-fused kernel, or ScanFallback outside its envelope."""
    T, N, k, L = u.shape[1], u.shape[2], u.shape[-1], angles.shape[-2]
    given = [x for x in (angles, decay, u, scale) if x is not None]
    span = T * max(N * L * k, *(abs(x.stride(1)) for x in given))
    check_envelope(u, span=span, sizes=(("k", k, BLOCK_KS), ("layers", L, range(1, MAX_LAYERS + 1))))
    return _rotation_recurrence(angles, decay, u, h0, scale)
