"""Triton kernels for the elementwise-in-D scans: linear_scan, linear_recurrence, parallel_scan_log,
gated_recurrence, signed_recurrence_stacked.

All five are the affine monoid of `core` run along time, one lane per channel. One forward
kernel and one backward kernel serve them through the constexpr MODE:

  SCAN  linear_scan(a, b) -> (A, Bc)        the prefix: A_t = prod a,  Bc_t = a_t Bc_{t-1} + b_t
  REC   linear_recurrence(a, b, h0) -> h    the same, from h0, without the prefix products
  LOG   parallel_scan_log(lc, lv) -> h      h_t = e^{lc_t} h_{t-1} + e^{lv_t}, h_0 = e^{lv_0}
  GATE  gated_recurrence(k, c, h0) -> h     REC with a_t = 1 - z_t, b_t = z_t g(c_t), z = sigmoid(k),
                                            the gates computed from k and c as the tiles load
                                            (stacked: k | c in one tensor, optionally plus a bias)
  SIGN  signed_recurrence_stacked(kcs, h0)  REC with a_t = tanh(s_t), b_t = z_t c_t from k | c | s in
        -> h                                one tensor (plus a bias); SIGN_COUPLED: a_t = (1 - z_t) tanh(s_t)

The backward is the same monoid in reverse time: lam_t = g_t + a_{t+1} lam_{t+1}, read from the
forward's inputs and outputs only (no division, so a_t = 0 is fine). With a bias (the stacked
forms) every program also sums its own gradient rows of k, c (and s): one partial row per (batch row,
segment), which the launcher adds up, so no (B, T, 2D) or (B, T, 3D) gradient is read again to
reduce it. The gates are recomputed from the pre-activations wherever a kernel needs them: no gate
tensor is stored.

Layout (`layout.diagonal`): one program per (block of channels, batch row, time segment) walks its segment in
tiles of TILE steps, scanning each tile with tl.associative_scan and carrying the state across
tiles in registers. With more than one segment a first pass writes each segment's aggregate and
the second pass folds the aggregates of the earlier segments into its starting carry. Where the
plan says `lookback`, both directions replace those two passes by one (`_lookback_kernel`,
`_lookback_backward_kernel`): one tile per program, each tile's carry from the published aggregates
and prefixes of the tiles before it in the scan's direction, so the inputs are read once. The
published values are float32 packed beside their flags; float64 keeps the two passes.
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from mingru.kernels import layout
from mingru.kernels.common import cdiv, check_envelope, launch, planned, scan_op
from mingru.kernels.core import affine_combine, carry_scan, last_row, log_add_exp, state_scan

SCAN: tl.constexpr = tl.constexpr(0)
REC: tl.constexpr = tl.constexpr(1)
LOG: tl.constexpr = tl.constexpr(2)
GATE: tl.constexpr = tl.constexpr(3)
SIGN: tl.constexpr = tl.constexpr(4)
SIGN_COUPLED: tl.constexpr = tl.constexpr(5)
# the planner's name of each MODE: the signed forms take the gate form's tiles (the same walk, one
# more input stream)
FORMS = ("scan", "rec", "log", "gate", "gate", "gate")


@triton.jit
def _acc(x, F64: tl.constexpr):
    if F64:
        y = x.to(tl.float64)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _tile_offsets(t0, t_end, cols, cmask, D, SX, TILE: tl.constexpr):
    """Offsets (relative to a batch row) of the [TILE, BLOCK] tile starting at t0 in the outputs
    (rows of D) and in the inputs (rows of SX), and its mask."""
    rows = t0.to(tl.int64) + tl.arange(0, TILE)
    mask = (rows < t_end)[:, None] & cmask[None, :]
    return rows[:, None] * D + cols[None, :], rows[:, None] * SX + cols[None, :], mask


@triton.jit
def _candidate(c):
    """minGRU's g(c) = c + 1/2 for c >= 0, sigmoid(c) below, and its derivative."""
    s = tl.sigmoid(c)
    return tl.where(c >= 0, c + 0.5, s), tl.where(c >= 0, 1.0, s * (1.0 - s))


@triton.jit
def _tanh(x):
    """tanh from one exp of -2|x| (no overflow), odd by construction, exactly +-1 at +-inf."""
    t = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@triton.jit
def _signed_gates(k, c, s, MODE: tl.constexpr):
    """SignedMinGRU's coefficients from its (biased) pre-activations: (a, b, z, u) with z = sigmoid(k),
    u = tanh(s), a = u (SIGN_COUPLED: (1 - z) u, 1 - z taken as sigmoid(-k)), b = z c."""
    z = tl.sigmoid(k)
    u = _tanh(s)
    a = u
    if MODE == SIGN_COUPLED:
        a = tl.sigmoid(-k) * u
    return a, z * c, z, u


@triton.jit
def _load_inputs(x_ptr, y_ptr, offs, mask, bias_k, bias_c, bias_s, D, MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 F64: tl.constexpr):
    """A forward tile, padded with the identity: (a, b) = (1, 0), or (lc, lv) = (0, -inf); GATE
    returns (1 - z, z g(c)) from the pre-activations k + bias_k, c + bias_c (k = -inf pads: z = 0);
    SIGN its gates from k, c and s = the rows' third part, 2D past k (k = -inf, s = +inf pad)."""
    if MODE == LOG:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        y = tl.load(y_ptr + offs, mask=mask, other=float("-inf"))
    elif MODE == GATE or MODE >= SIGN:
        x = tl.load(x_ptr + offs, mask=mask, other=float("-inf"))
        y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=1.0)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    x, y = _acc(x, F64), _acc(y, F64)
    x, y = _biased(x, bias_k[None, :], HAS_BIAS), _biased(y, bias_c[None, :], HAS_BIAS)
    if MODE == GATE:
        z = tl.sigmoid(x)
        x, y = tl.sigmoid(-x), z * _candidate(y)[0]
    elif MODE >= SIGN:
        s = _biased(_acc(tl.load(x_ptr + 2 * D + offs, mask=mask, other=float("inf")), F64), bias_s[None, :],
                    HAS_BIAS)
        x, y, _, _ = _signed_gates(x, y, s, MODE)
    return x, y


@triton.jit
def _biased(v, bias, HAS_BIAS: tl.constexpr):
    """v + bias (bias broadcast by the caller); v itself without a bias, so no zeros are added."""
    if HAS_BIAS:
        v = v + bias
    return v


@triton.jit
def _bias(bias_ptr, cols, cmask, D, MODE: tl.constexpr, HAS_BIAS: tl.constexpr, F64: tl.constexpr):
    """The biases of k, c and s on these channels: bias_ptr holds (2D,) = k's | c's, or for SIGN
    (3D,) = k's | c's | s's (zeros without: placeholders that _biased never adds)."""
    if HAS_BIAS:
        bias_k = _acc(tl.load(bias_ptr + cols, mask=cmask, other=0.0), F64)
        bias_c = _acc(tl.load(bias_ptr + D + cols, mask=cmask, other=0.0), F64)
        bias_s = bias_c
        if MODE >= SIGN:
            bias_s = _acc(tl.load(bias_ptr + 2 * D + cols, mask=cmask, other=0.0), F64)
    else:
        bias_k = _acc(tl.zeros(cols.shape, tl.float32), F64)
        bias_c = bias_k
        bias_s = bias_k
    return bias_k, bias_c, bias_s


@triton.jit
def _program(T, D, seg_len, segments, BLOCK: tl.constexpr):
    """This program's batch row, segment, channels and the row offsets it needs."""
    b = tl.program_id(1).to(tl.int64)
    seg = tl.program_id(2)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t_begin = seg * seg_len
    agg_off = (b * segments) * D + cols  # aggregates: (k, B, segments, D), k = which quantity
    agg_stride = tl.num_programs(1) * segments * D
    # log_values has one more row than the (B, T, D) tensors: slot 0 is log h0
    return b, seg, cols, cols < D, t_begin, tl.minimum(t_begin + seg_len, T), b * T * D, b * (T + 1) * D, \
        agg_off, agg_stride


@triton.jit
def _forward_kernel(x_ptr, y_ptr, h0_ptr, bias_ptr, out_a_ptr, out_h_ptr, agg_ptr, T, D, SX, seg_len, segments,
                    MODE: tl.constexpr, AGG_PASS: tl.constexpr, HAS_H0: tl.constexpr, HAS_BIAS: tl.constexpr,
                    F64: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
                    PREFETCH: tl.constexpr):
    b, seg, cols, cmask, t_begin, t_end, base, lv_base, agg_off, agg_stride = _program(T, D, seg_len, segments, BLOCK)
    x_base = b * T * SX  # the inputs' rows hold SX elements (== D except for the stacked forms)
    bias_k, bias_c, bias_s = _bias(bias_ptr, cols, cmask, D, MODE, HAS_BIAS, F64)
    y_base = lv_base + D if MODE == LOG else x_base

    carry_a = _acc(tl.full([BLOCK], 1.0, tl.float32), F64)
    carry_b = _acc(tl.zeros([BLOCK], tl.float32), F64)
    if not AGG_PASS:
        _, entry = _entry(x_ptr, y_ptr, h0_ptr, b, cols, cmask, D, lv_base, MODE, HAS_H0, F64)
    start = t_begin
    if MODE == LOG:
        # The state is carried in linear space (it is an output, so finite when the answer is);
        # only the entry state of a segment, which may be far outside the float range (h0 =
        # e^100, say), stays in log form until it is applied as one exp(lc + log h).
        lc_sum = _acc(tl.zeros([TILE, BLOCK], tl.float32), F64)
        if not AGG_PASS:
            log_h = entry
            for s in range(0, seg):  # segment aggregates in log form: (sum of lc, log of B)
                agg_lc = tl.load(agg_ptr + agg_off + s * D, mask=cmask, other=0.0)
                log_h = log_add_exp(agg_lc + log_h, tl.load(agg_ptr + agg_stride + agg_off + s * D,
                                                             mask=cmask, other=0.0))
            row = t_begin.to(tl.int64) * D + cols
            lc0 = _acc(tl.load(x_ptr + x_base + row, mask=cmask, other=0.0), F64)
            lv0 = _acc(tl.load(y_ptr + y_base + row, mask=cmask, other=0.0), F64)
            carry_b = tl.exp(lv0) + tl.exp(lc0 + log_h)
            tl.store(out_h_ptr + base + row, carry_b.to(out_h_ptr.dtype.element_ty), mask=cmask)
            start = t_begin + 1
    else:
        if not AGG_PASS:
            carry_b = entry
            for s in range(0, seg):  # fold in the aggregates of the earlier segments
                agg_a = tl.load(agg_ptr + agg_off + s * D, mask=cmask, other=0.0)
                carry_b = agg_a * carry_b + tl.load(agg_ptr + agg_stride + agg_off + s * D, mask=cmask, other=0.0)
                carry_a = agg_a * carry_a

    if PREFETCH:  # registers hold the next tile while this one is scanned
        _, in_offs, mask = _tile_offsets(start, t_end, cols, cmask, D, SX, TILE)
        x_next, y_next = _load_inputs(x_ptr + x_base, y_ptr + y_base, in_offs, mask, bias_k, bias_c, bias_s, D,
                                      MODE, HAS_BIAS, F64)
    for i in range(0, tl.cdiv(t_end - start, TILE)):
        offs, in_offs, mask = _tile_offsets(start + i * TILE, t_end, cols, cmask, D, SX, TILE)
        if PREFETCH:
            x, y = x_next, y_next
            _, in_offs_n, mask_n = _tile_offsets(start + (i + 1) * TILE, t_end, cols, cmask, D, SX, TILE)
            x_next, y_next = _load_inputs(x_ptr + x_base, y_ptr + y_base, in_offs_n, mask_n, bias_k, bias_c,
                                          bias_s, D, MODE, HAS_BIAS, F64)
        else:
            x, y = _load_inputs(x_ptr + x_base, y_ptr + y_base, in_offs, mask, bias_k, bias_c, bias_s, D, MODE,
                                HAS_BIAS, F64)
        if MODE == LOG:
            if AGG_PASS:
                lc_sum += x
            x = tl.exp(x)
            y = tl.exp(y)
        if MODE == SCAN or (AGG_PASS and MODE != LOG):
            big_a, h, carry_a, carry_b = carry_scan(x, y, carry_a, carry_b)
            if MODE == SCAN and not AGG_PASS:
                tl.store(out_a_ptr + base + offs, big_a.to(out_a_ptr.dtype.element_ty), mask=mask)
        else:
            h, carry_b = state_scan(x, y, carry_b)
        if not AGG_PASS:
            tl.store(out_h_ptr + base + offs, h.to(out_h_ptr.dtype.element_ty), mask=mask)

    if AGG_PASS:
        if MODE == LOG:
            carry_a = tl.sum(lc_sum, axis=0)
            carry_b = tl.log(carry_b)
        tl.store(agg_ptr + agg_off + seg * D, carry_a, mask=cmask)
        tl.store(agg_ptr + agg_stride + agg_off + seg * D, carry_b, mask=cmask)


@triton.jit
def _entry(x_ptr, y_ptr, h0_ptr, b, cols, cmask, D, lv_base, MODE: tl.constexpr, HAS_H0: tl.constexpr,
           F64: tl.constexpr):
    """The state before step 0 as a prefix pair: (1, h0 or 0); LOG: in log form, (0, log h0)."""
    if MODE == LOG:
        carry_a = _acc(tl.zeros(cols.shape, tl.float32), F64)
        carry_b = _acc(tl.load(y_ptr + lv_base + cols, mask=cmask, other=0.0), F64)
    else:
        carry_a = _acc(tl.full(cols.shape, 1.0, tl.float32), F64)
        carry_b = _acc(tl.zeros(cols.shape, tl.float32), F64)
        if HAS_H0:
            carry_b = _acc(tl.load(h0_ptr + b * D + cols, mask=cmask, other=0.0), F64)
    return carry_a, carry_b


@triton.jit
def _then(a1, b1, m1, a2, b2, m2, LOG_FORM: tl.constexpr):
    """(a1, b1) then (a2, b2): `affine_combine`, or in log form its image under log; m, a second
    offset beside b under the same coefficients (SCAN's backward carries two adjoints), follows
    b's rule in linear space."""
    if LOG_FORM:
        a, b = a1 + a2, log_add_exp(a2 + b1, b2)
    else:
        a, b = affine_combine(a1, b1, a2, b2)
    return a, b, a2 * m1 + m2


@triton.jit
def _pack(v, FLAG: tl.constexpr):
    return v.to(tl.float32).to(tl.uint32, bitcast=True).to(tl.int64) | (FLAG << 32)


@triton.jit
def _unpack(w):
    return (w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True), w >> 32


@triton.jit
def _publish(slot_ptr, slot_stride, a, b, m, cmask, FLAG: tl.constexpr, THIRD: tl.constexpr):
    """Write a segment's (a, b[, m]) with its flag (1: the aggregate, 2: the inclusive prefix),
    each float32 in one 64-bit word beside the flag, written and read by 64-bit atomics (a plain
    vector access may split a word): a reader sees a value and its flag together or neither, with
    no fence and no barrier. The inclusive prefix overwrites the aggregate."""
    tl.atomic_xchg(slot_ptr, _pack(a, FLAG), mask=cmask, sem="relaxed")
    tl.atomic_xchg(slot_ptr + slot_stride, _pack(b, FLAG), mask=cmask, sem="relaxed")
    if THIRD:
        tl.atomic_xchg(slot_ptr + 2 * slot_stride, _pack(m, FLAG), mask=cmask, sem="relaxed")


@triton.jit
def _read(slot_ptr, slot_stride, j, D, live, THIRD: tl.constexpr):
    """Segment j's published values and whether all of them show flag 2, or all flag 1."""
    got_a, flag_a = _unpack(tl.atomic_add(slot_ptr + j * D, 0, mask=live, sem="relaxed"))
    got_b, flag_b = _unpack(tl.atomic_add(slot_ptr + slot_stride + j * D, 0, mask=live, sem="relaxed"))
    whole, part = (flag_a == 2) & (flag_b == 2), (flag_a == 1) & (flag_b == 1)
    got_m = tl.zeros_like(got_b)
    if THIRD:
        got_m, flag_m = _unpack(tl.atomic_add(slot_ptr + 2 * slot_stride + j * D, 0, mask=live, sem="relaxed"))
        whole, part = whole & (flag_m == 2), part & (flag_m == 1)
    return got_a, got_b, got_m, live & whole, live & part


@triton.jit
def _look_back(slot_ptr, slot_stride, seg, end, D, entry_a, entry_b, entry_m, cmask, LOG_FORM: tl.constexpr,
               THIRD: tl.constexpr, STEP: tl.constexpr):
    """The carry into segment `seg`, per lane: walk over the segments before it in the scan's
    direction (STEP -1: time order, down to 0; +1: reverse time, up to the last; `end` is one past
    the walk's last segment), folding each one's aggregate until one shows its inclusive prefix
    (or the walk passes the first segment, whose carry is the entry state); a segment that shows
    neither yet is read again. Every segment before `seg` holds a lower ticket, so it is running
    or done."""
    if LOG_FORM:
        acc_a = tl.zeros(entry_a.shape, tl.float32)
        acc_b = tl.full(entry_b.shape, float("-inf"), tl.float32)
    else:
        acc_a = tl.full(entry_a.shape, 1.0, tl.float32)
        acc_b = tl.zeros(entry_b.shape, tl.float32)
    acc_m = tl.zeros(entry_m.shape, tl.float32)
    base_a, base_b, base_m = entry_a, entry_b, entry_m
    j = tl.where(cmask, seg + STEP, end)
    go = seg + STEP != end
    while go:
        got_a, got_b, got_m, whole, part = _read(slot_ptr, slot_stride, j, D, j != end, THIRD)
        base_a, base_b, base_m = tl.where(whole, got_a, base_a), tl.where(whole, got_b, base_b), \
            tl.where(whole, got_m, base_m)
        fold_a, fold_b, fold_m = _then(got_a, got_b, got_m, acc_a, acc_b, acc_m, LOG_FORM)
        acc_a, acc_b, acc_m = tl.where(part, fold_a, acc_a), tl.where(part, fold_b, acc_b), \
            tl.where(part, fold_m, acc_m)
        j = tl.where(whole, end, tl.where(part, j + STEP, j))
        go = tl.max((j != end).to(tl.int32), 0) > 0
    return _then(base_a, base_b, base_m, acc_a, acc_b, acc_m, LOG_FORM)


@triton.jit
def _ticket(slot_ptr, segments, D, BLOCK: tl.constexpr, WORDS: tl.constexpr):
    """This program's place in a single pass: programs take tickets in launch order (the counter
    sits after the slots (WORDS, B, segments, D)); segment-major tickets put every segment a program
    may wait on before it. Returns (k: the segment's rank in the scan's direction, batch row,
    channels, slot stride)."""
    n = tl.num_programs(0)
    lanes = tl.cdiv(D, BLOCK)
    per_seg = n // segments
    slot_stride = per_seg // lanes * segments * D
    ticket = tl.atomic_add(slot_ptr + WORDS * slot_stride, 1).to(tl.int32)
    cols = (ticket % lanes) * BLOCK + tl.arange(0, BLOCK)
    return ticket // per_seg, ((ticket % per_seg) // lanes).to(tl.int64), cols, slot_stride


@triton.jit
def _lookback_kernel(x_ptr, y_ptr, h0_ptr, bias_ptr, out_a_ptr, out_h_ptr, slot_ptr, T, D, SX, segments,
                     MODE: tl.constexpr, HAS_H0: tl.constexpr, HAS_BIAS: tl.constexpr,
                     TILE: tl.constexpr, BLOCK: tl.constexpr):
    """The forward in one pass, one tile per program (float32 state): scan the tile from the
    identity, publish its aggregate, take the carry from the tiles before it (`_look_back`),
    publish the inclusive prefix, then write the outputs. Programs take their (lanes, batch row,
    tile) in ticket order (`_ticket`), tiles in time order, so a program waits only on earlier
    tickets."""
    seg, b, cols, slot_stride = _ticket(slot_ptr, segments, D, BLOCK, 2)
    cmask = cols < D
    base, lv_base, x_base = b * T * D, b * (T + 1) * D, b * T * SX
    y_base = lv_base + D if MODE == LOG else x_base
    bias_k, bias_c, bias_s = _bias(bias_ptr, cols, cmask, D, MODE, HAS_BIAS, False)
    offs, in_offs, mask = _tile_offsets(seg * TILE, T, cols, cmask, D, SX, TILE)
    x, y = _load_inputs(x_ptr + x_base, y_ptr + y_base, in_offs, mask, bias_k, bias_c, bias_s, D, MODE, HAS_BIAS,
                        False)
    if MODE == LOG:
        lc = tl.cumsum(x, 0)  # log of the tile's running product of coefficients
        x, y = tl.exp(x), tl.exp(y)
    a_loc, b_loc = tl.associative_scan((x, y), 0, affine_combine)
    agg_a, agg_b = last_row(a_loc), last_row(b_loc)
    if MODE == LOG:
        agg_a, agg_b = last_row(lc), tl.log(agg_b)

    slot = slot_ptr + b * segments * D + cols
    none = tl.zeros([BLOCK], tl.float32)  # the forward has no third value
    if seg > 0:
        _publish(slot + seg * D, slot_stride, agg_a, agg_b, none, cmask, 1, False)
    entry_a, entry_b = _entry(x_ptr, y_ptr, h0_ptr, b, cols, cmask, D, lv_base, MODE, HAS_H0, False)
    carry_a, carry_b, _ = _look_back(slot, slot_stride, seg, -1, D, entry_a, entry_b, none, cmask, MODE == LOG,
                                     False, -1)
    incl_a, incl_b, _ = _then(carry_a, carry_b, none, agg_a, agg_b, none, MODE == LOG)
    _publish(slot + seg * D, slot_stride, incl_a, incl_b, none, cmask, 2, False)

    if MODE == LOG:
        h = tl.exp(lc + carry_b[None, :]) + b_loc
    else:
        h = a_loc * carry_b[None, :] + b_loc
        if MODE == SCAN:
            tl.store(out_a_ptr + base + offs, (a_loc * carry_a[None, :]).to(out_a_ptr.dtype.element_ty), mask=mask)
    tl.store(out_h_ptr + base + offs, h.to(out_h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _input_grads(lam_t, mu_t, x_ptr, y_ptr, h0_ptr, out_a_ptr, out_h_ptr, dx_ptr, dy_ptr, b, cols, cmask, base,
                 x_base, lv_base, offs, in_offs, mask, prev_mask, first, bias_k, bias_c, bias_s, D, MODE: tl.constexpr,
                 HAS_H0: tl.constexpr, HAS_BIAS: tl.constexpr, F64: tl.constexpr):
    """Store one tile of the input gradients from the adjoints lam_t (of h / Bc) and mu_t (of A),
    and return it (dx, dy, and SIGN's ds: its third part, 2D past dx; else dy again); the gradients
    have the inputs' layout (x_base + in_offs), the outputs are read at base + offs."""
    dx_mask = mask
    if MODE == SCAN:  # A_{-1} = 1, Bc_{-1} = 0
        a_prev = _acc(tl.load(out_a_ptr + base + offs - D, mask=prev_mask, other=1.0), F64)
        b_prev = _acc(tl.load(out_h_ptr + base + offs - D, mask=prev_mask, other=0.0), F64)
        dx = mu_t * a_prev + lam_t * b_prev
        dy = lam_t
    elif MODE == REC or MODE == GATE or MODE >= SIGN:
        h_prev = _acc(tl.load(out_h_ptr + base + offs - D, mask=prev_mask, other=0.0), F64)
        if HAS_H0:
            h0 = _acc(tl.load(h0_ptr + b * D + cols, mask=cmask, other=0.0), F64)
            h_prev = tl.where(first, h0[None, :], h_prev)
        if MODE == GATE:  # h_t = (1 - z) h_{t-1} + z g(c): d/dk = z (1 - z) (g(c) - h_{t-1})
            z = tl.sigmoid(_biased(_acc(tl.load(x_ptr + x_base + in_offs, mask=mask, other=0.0), F64),
                                   bias_k[None, :], HAS_BIAS))
            g_c, dg_c = _candidate(_biased(_acc(tl.load(y_ptr + x_base + in_offs, mask=mask, other=0.0), F64),
                                           bias_c[None, :], HAS_BIAS))
            dx = lam_t * z * (1.0 - z) * (g_c - h_prev)
            dy = lam_t * z * dg_c
        elif MODE >= SIGN:  # h_t = a h_{t-1} + z c: da = lam h_{t-1}, db = lam
            k = _biased(_acc(tl.load(x_ptr + x_base + in_offs, mask=mask, other=0.0), F64), bias_k[None, :], HAS_BIAS)
            c = _biased(_acc(tl.load(y_ptr + x_base + in_offs, mask=mask, other=0.0), F64), bias_c[None, :], HAS_BIAS)
            s = _biased(_acc(tl.load(x_ptr + x_base + 2 * D + in_offs, mask=mask, other=0.0), F64), bias_s[None, :],
                        HAS_BIAS)
            _, _, z, u = _signed_gates(k, c, s, MODE)
            da = lam_t * h_prev
            dy = lam_t * z
            if MODE == SIGN_COUPLED:  # a = (1 - z) u
                ds = da * tl.sigmoid(-k) * (1.0 - u * u)
                dx = z * (1.0 - z) * (lam_t * c - da * u)
            else:
                ds = da * (1.0 - u * u)
                dx = lam_t * c * z * (1.0 - z)
            tl.store(dx_ptr + x_base + 2 * D + in_offs, ds.to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            dx = lam_t * h_prev
            dy = lam_t
    else:
        lc = _acc(tl.load(x_ptr + x_base + in_offs, mask=mask, other=0.0), F64)
        lv = _acc(tl.load(y_ptr + lv_base + D + offs, mask=mask, other=0.0), F64)
        h_prev = _acc(tl.load(out_h_ptr + base + offs - D, mask=prev_mask, other=0.0), F64)
        dx = lam_t * tl.exp(lc) * h_prev
        dy = lam_t * tl.exp(lv)
        dx_mask = prev_mask  # step 1 needs e^{lc_1 + lv_0}: written after the loop
    tl.store(dx_ptr + x_base + in_offs, dx.to(dx_ptr.dtype.element_ty), mask=dx_mask)
    if MODE == LOG:
        tl.store(dy_ptr + lv_base + D + offs, dy.to(dy_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dy_ptr + x_base + in_offs, dy.to(dy_ptr.dtype.element_ty), mask=mask)
    if MODE < SIGN:
        ds = dy
    return dx, dy, ds


@triton.jit
def _initial_grad(lam, x_ptr, y_ptr, dx_ptr, dy_ptr, dh0_ptr, b, cols, cmask, x_base, lv_base, bias_k, bias_s, D,
                  MODE: tl.constexpr, HAS_H0: tl.constexpr, HAS_BIAS: tl.constexpr, F64: tl.constexpr):
    """The gradient of the initial state: a_1 lam_1 (log space: e^{lc_1 + lv_0} lam_1)."""
    x0 = _acc(tl.load(x_ptr + x_base + cols, mask=cmask, other=0.0), F64)
    if MODE == GATE:
        x0 = tl.sigmoid(-_biased(x0, bias_k, HAS_BIAS))
    elif MODE >= SIGN:
        s0 = _biased(_acc(tl.load(x_ptr + x_base + 2 * D + cols, mask=cmask, other=0.0), F64), bias_s, HAS_BIAS)
        k0 = _biased(x0, bias_k, HAS_BIAS)
        x0 = _signed_gates(k0, k0, s0, MODE)[0]
    if MODE == LOG:
        # a_1 h_0 as one exp, so a huge or -inf log h0 gives a finite value or exactly 0;
        # it is also the gradient of lc_1, since d h_1 / d lc_1 = a_1 h_0 too
        lv0 = _acc(tl.load(y_ptr + lv_base + cols, mask=cmask, other=0.0), F64)
        d0 = lam * tl.exp(x0 + lv0)
        tl.store(dy_ptr + lv_base + cols, d0.to(dy_ptr.dtype.element_ty), mask=cmask)
        tl.store(dx_ptr + x_base + cols, d0.to(dx_ptr.dtype.element_ty), mask=cmask)
    elif HAS_H0:
        tl.store(dh0_ptr + b * D + cols, (lam * x0).to(dh0_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _reverse_offsets(t_hi, t_begin, T, cols, cmask, D, SX, TILE: tl.constexpr):
    """A backward tile: row r holds time t_hi - r (rows before t_begin are padding). Returns the
    output and input offsets and the masks: of the tile, of its rows whose next step exists, of its
    rows with a previous step, of the row at t = 0, of its valid rows. (No pointer enters here: the
    compiler's mutation analysis would count every pointer a call takes as reaching the offsets it
    returns, so the tensors stored through them would look like inputs.)"""
    t = t_hi - tl.arange(0, TILE)
    valid = t >= t_begin
    mask = valid[:, None] & cmask[None, :]
    next_mask = (valid & (t + 1 < T))[:, None] & cmask[None, :]
    prev_mask = (valid & (t >= 1))[:, None] & cmask[None, :]
    offs = t.to(tl.int64)[:, None] * D + cols[None, :]
    in_offs = t.to(tl.int64)[:, None] * SX + cols[None, :]
    return offs, in_offs, mask, next_mask, prev_mask, (t == 0)[:, None], valid[:, None]


@triton.jit
def _reverse_loads(x_ptr, g_ptr, ga_ptr, offs, in_offs, mask, next_mask, valid, bias_k, bias_s, D, SX,
                   MODE: tl.constexpr, HAS_BIAS: tl.constexpr, F64: tl.constexpr):
    """A backward tile's coefficients of the reverse recurrence c_t = a_{t+1} (0 past the end, 1 on
    padding rows) and its cotangents g (of h / Bc) and ga (of A, SCAN only; else g)."""
    next_x = x_ptr + in_offs + SX
    if MODE == LOG:
        c = tl.exp(_acc(tl.load(next_x, mask=next_mask, other=float("-inf")), F64))
    elif MODE == GATE:  # a = 1 - sigmoid(k) = sigmoid(-k); k = +inf past the end
        c = tl.sigmoid(-_biased(_acc(tl.load(next_x, mask=next_mask, other=float("inf")), F64), bias_k[None, :],
                                HAS_BIAS))
    elif MODE >= SIGN:  # a biased pad is no longer 0: zeroed past the end explicitly
        k = _biased(_acc(tl.load(next_x, mask=next_mask, other=0.0), F64), bias_k[None, :], HAS_BIAS)
        s = _biased(_acc(tl.load(next_x + 2 * D, mask=next_mask, other=0.0), F64), bias_s[None, :], HAS_BIAS)
        c = tl.where(next_mask, _signed_gates(k, k, s, MODE)[0], 0.0)
    else:
        c = _acc(tl.load(next_x, mask=next_mask, other=0.0), F64)
    c = tl.where(valid, c, 1.0)
    g = _acc(tl.load(g_ptr + offs, mask=mask, other=0.0), F64)
    ga = g
    if MODE == SCAN:
        ga = _acc(tl.load(ga_ptr + offs, mask=mask, other=0.0), F64)
    return c, g, ga


@triton.jit
def _store_bias_partials(dbias_ptr, b, seg, segments, cols, cmask, D, dbias_k, dbias_c, dbias_s, MODE: tl.constexpr):
    """A program's sums of the k, c (and SIGN's s) gradients: row (b, seg) of the partials
    (B, segments, 2D), SIGN's (B, segments, 3D)."""
    if MODE >= SIGN:
        row = dbias_ptr + (b * segments + seg) * 3 * D + cols
        tl.store(row + 2 * D, dbias_s, mask=cmask)
    else:
        row = dbias_ptr + (b * segments + seg) * 2 * D + cols
    tl.store(row, dbias_k, mask=cmask)
    tl.store(row + D, dbias_c, mask=cmask)


@triton.jit
def _backward_kernel(x_ptr, y_ptr, h0_ptr, bias_ptr, g_ptr, ga_ptr, out_h_ptr, out_a_ptr,
                     dx_ptr, dy_ptr, dh0_ptr, dbias_ptr, agg_ptr, T, D, SX, seg_len, segments,
                     MODE: tl.constexpr, AGG_PASS: tl.constexpr, HAS_H0: tl.constexpr, HAS_BIAS: tl.constexpr,
                     F64: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    b, seg, cols, cmask, t_begin, t_end, base, lv_base, agg_off, agg_stride = _program(T, D, seg_len, segments, BLOCK)
    x_base = b * T * SX  # inputs and their gradients: rows of SX elements (see the forward)
    bias_k, bias_c, bias_s = _bias(bias_ptr, cols, cmask, D, MODE, HAS_BIAS, F64)
    dbias_k = _acc(tl.zeros([BLOCK], tl.float32), F64)  # this program's sums of the k, c and s gradients
    dbias_c = dbias_k
    dbias_s = dbias_k

    # Reverse-time carries: lam (adjoint of h / Bc), mu (adjoint of A, SCAN only), and the
    # product of the coefficients (needed only for a segment's aggregate).
    lam = _acc(tl.zeros([BLOCK], tl.float32), F64)
    mu = _acc(tl.zeros([BLOCK], tl.float32), F64)
    c_prod = _acc(tl.full([BLOCK], 1.0, tl.float32), F64)
    if not AGG_PASS:
        for i in range(0, segments - 1 - seg):  # fold in the later segments, last one first
            s = segments - 1 - i
            agg_c = tl.load(agg_ptr + agg_off + s * D, mask=cmask, other=0.0)
            lam = agg_c * lam + tl.load(agg_ptr + agg_stride + agg_off + s * D, mask=cmask, other=0.0)
            if MODE == SCAN:
                mu = agg_c * mu + tl.load(agg_ptr + 2 * agg_stride + agg_off + s * D, mask=cmask, other=0.0)

    n_tiles = tl.cdiv(t_end - t_begin, TILE)
    for i in range(0, n_tiles):
        offs, in_offs, mask, next_mask, prev_mask, first, valid = _reverse_offsets(t_end - 1 - i * TILE, t_begin, T,
                                                                                   cols, cmask, D, SX, TILE)
        c, g, ga = _reverse_loads(x_ptr + x_base, g_ptr + base, ga_ptr + base, offs, in_offs, mask, next_mask, valid,
                                  bias_k, bias_s, D, SX, MODE, HAS_BIAS, F64)
        if AGG_PASS:  # the aggregate also needs the product of the coefficients
            _, lam_t, c_prod, lam = carry_scan(c, g, c_prod, lam)
        else:
            lam_t, lam = state_scan(c, g, lam)
        mu_t = lam_t  # read only by SCAN
        if MODE == SCAN:
            mu_t, mu = state_scan(c, ga, mu)

        if not AGG_PASS:
            dx, dy, ds = _input_grads(lam_t, mu_t, x_ptr, y_ptr, h0_ptr, out_a_ptr, out_h_ptr, dx_ptr, dy_ptr, b, cols,
                                      cmask, base, x_base, lv_base, offs, in_offs, mask, prev_mask, first, bias_k,
                                      bias_c, bias_s, D, MODE, HAS_H0, HAS_BIAS, F64)
            if HAS_BIAS:
                dbias_k += tl.sum(tl.where(mask, dx, 0.0), axis=0)
                dbias_c += tl.sum(tl.where(mask, dy, 0.0), axis=0)
                if MODE >= SIGN:
                    dbias_s += tl.sum(tl.where(mask, ds, 0.0), axis=0)

    if AGG_PASS:
        tl.store(agg_ptr + agg_off + seg * D, c_prod, mask=cmask)
        tl.store(agg_ptr + agg_stride + agg_off + seg * D, lam, mask=cmask)
        if MODE == SCAN:
            tl.store(agg_ptr + 2 * agg_stride + agg_off + seg * D, mu, mask=cmask)
    else:
        if MODE != SCAN and seg == 0:
            _initial_grad(lam, x_ptr, y_ptr, dx_ptr, dy_ptr, dh0_ptr, b, cols, cmask, x_base, lv_base, bias_k, bias_s,
                          D, MODE, HAS_H0, HAS_BIAS, F64)
        if HAS_BIAS:
            _store_bias_partials(dbias_ptr, b, seg, segments, cols, cmask, D, dbias_k, dbias_c, dbias_s, MODE)


@triton.jit
def _lookback_backward_kernel(x_ptr, y_ptr, h0_ptr, bias_ptr, g_ptr, ga_ptr, out_h_ptr, out_a_ptr, dx_ptr, dy_ptr,
                              dh0_ptr, dbias_ptr, slot_ptr, T, D, SX, segments, MODE: tl.constexpr,
                              HAS_H0: tl.constexpr, HAS_BIAS: tl.constexpr, TILE: tl.constexpr,
                              BLOCK: tl.constexpr):
    """The backward in one pass, one tile per program, tiles taken in reverse time: scan the tile's
    adjoints from zero, publish the aggregate (the product of its coefficients, and lam's and, for
    SCAN, mu's offsets), take the carry from the later tiles (`_look_back`), publish the inclusive
    prefix, then write the input gradients (and this tile's row of bias-gradient partials)."""
    k, b, cols, slot_stride = _ticket(slot_ptr, segments, D, BLOCK, 3 if MODE == SCAN else 2)
    seg = segments - 1 - k
    cmask = cols < D
    base, lv_base, x_base = b * T * D, b * (T + 1) * D, b * T * SX
    bias_k, bias_c, bias_s = _bias(bias_ptr, cols, cmask, D, MODE, HAS_BIAS, False)
    t_begin = seg * TILE
    offs, in_offs, mask, next_mask, prev_mask, first, valid = _reverse_offsets(tl.minimum(t_begin + TILE, T) - 1,
                                                                               t_begin, T, cols, cmask, D, SX, TILE)
    c, g, ga = _reverse_loads(x_ptr + x_base, g_ptr + base, ga_ptr + base, offs, in_offs, mask, next_mask, valid,
                              bias_k, bias_s, D, SX, MODE, HAS_BIAS, False)
    c_loc, lam_loc = tl.associative_scan((c, g), 0, affine_combine)
    mu_loc = lam_loc
    if MODE == SCAN:
        _, mu_loc = tl.associative_scan((c, ga), 0, affine_combine)
    agg_c, agg_lam, agg_mu = last_row(c_loc), last_row(lam_loc), last_row(mu_loc)

    slot = slot_ptr + b * segments * D + cols
    if seg < segments - 1:
        _publish(slot + seg * D, slot_stride, agg_c, agg_lam, agg_mu, cmask, 1, MODE == SCAN)
    one = tl.full([BLOCK], 1.0, tl.float32)
    zero = tl.zeros([BLOCK], tl.float32)
    carry_c, lam, mu = _look_back(slot, slot_stride, seg, segments, D, one, zero, zero, cmask, False, MODE == SCAN, 1)
    incl_c, incl_lam, incl_mu = _then(carry_c, lam, mu, agg_c, agg_lam, agg_mu, False)
    _publish(slot + seg * D, slot_stride, incl_c, incl_lam, incl_mu, cmask, 2, MODE == SCAN)

    lam_t = lam_loc + c_loc * lam[None, :]
    mu_t = lam_t
    if MODE == SCAN:
        mu_t = mu_loc + c_loc * mu[None, :]
    dx, dy, ds = _input_grads(lam_t, mu_t, x_ptr, y_ptr, h0_ptr, out_a_ptr, out_h_ptr, dx_ptr, dy_ptr, b, cols, cmask,
                              base, x_base, lv_base, offs, in_offs, mask, prev_mask, first, bias_k, bias_c, bias_s, D,
                              MODE, HAS_H0, HAS_BIAS, False)
    if MODE != SCAN and seg == 0:
        _initial_grad(last_row(lam_t), x_ptr, y_ptr, dx_ptr, dy_ptr, dh0_ptr, b, cols, cmask, x_base, lv_base, bias_k,
                      bias_s, D, MODE, HAS_H0, HAS_BIAS, False)
    if HAS_BIAS:
        dbias_s = tl.zeros([BLOCK], tl.float32)
        if MODE >= SIGN:
            dbias_s = tl.sum(tl.where(mask, ds, 0.0), axis=0)
        _store_bias_partials(dbias_ptr, b, seg, segments, cols, cmask, D, tl.sum(tl.where(mask, dx, 0.0), axis=0),
                             tl.sum(tl.where(mask, dy, 0.0), axis=0), dbias_s, MODE)


class _Launch(NamedTuple):
    kernel: object
    grid: tuple
    args: dict        # every argument besides the tensors
    acc: torch.dtype  # the dtype kernels accumulate in (that of the aggregates and bias partials)
    slots: Optional[tuple]     # the single pass's zeroed 64-bit slots (words, B, segments, D) + its ticket
    agg: Optional[tuple]       # the two-pass split's aggregates (words, B, segments, D); its first pass runs
    partials: Optional[tuple]  # the backward's bias-gradient partials (B, segments, parts * D)


@planned
def _plan(mode, direction, shape, parts, has_h0, has_bias, dtype, device, forced):
    """The `_Launch` of `direction`'s kernels in MODE `mode` (its value) for inputs of `shape`
    (B, T, parts * D: rows of `parts` stacked inputs, GATE's k | cand or SIGN's k | cand | s; else
    parts = 1). forced is layout's forced layout, which the planner reads: it keys the memo."""
    B, T, SX = shape
    D = SX // parts
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    lay = layout.diagonal(B, T, D, device, direction, FORMS[mode], single_pass=acc == torch.float32)
    args = dict(T=T, D=D, SX=SX, MODE=mode, HAS_H0=has_h0, HAS_BIAS=has_bias,
                TILE=lay.tile, BLOCK=lay.block, num_warps=lay.warps, segments=lay.segments)
    words = 3 if mode == SCAN.value and direction == "backward" else 2  # values per segment and lane
    partials = (B, lay.segments, SX) if direction == "backward" and has_bias else None
    if lay.lookback:
        kernel = _lookback_kernel if direction == "forward" else _lookback_backward_kernel
        return _Launch(kernel, (cdiv(D, lay.block) * B * lay.segments,), args, acc,
                       (words * B * lay.segments * D + 1,), None, partials)
    args.update(seg_len=lay.seg_len, F64=acc == torch.float64, num_stages=lay.stages)
    if direction == "forward":
        args["PREFETCH"] = lay.prefetch
    kernel = _forward_kernel if direction == "forward" else _backward_kernel
    agg = (words, B, lay.segments, D) if lay.segments > 1 else None
    return _Launch(kernel, (cdiv(D, lay.block), B, lay.segments), args, acc, None, agg, partials)


def _launch(mode, direction, x, tensors, has_h0, parts=1, bias=None):
    """Run `direction`'s kernels over the plan (the aggregate pass first when time is split in two
    passes). x (B, T, D), or (B, T, parts * D) rows of stacked inputs with their bias (parts * D,)
    or None. Returns the backward's bias-gradient partials (B, segments, parts * D) when it has a
    bias."""
    plan = _plan(mode.value, direction, x.shape, parts, has_h0, bias is not None, x.dtype, x.device, layout._forced)
    more = dict(tensors, bias_ptr=x if bias is None else bias)
    partials = None if plan.partials is None else torch.empty(plan.partials, dtype=plan.acc, device=x.device)
    if direction == "backward":
        more["dbias_ptr"] = x if partials is None else partials
    if plan.slots is not None:
        more["slot_ptr"] = torch.zeros(plan.slots, dtype=torch.int64, device=x.device)
    else:
        more["agg_ptr"] = x if plan.agg is None else torch.empty(plan.agg, dtype=plan.acc, device=x.device)
        if plan.agg is not None:
            launch(plan.kernel, plan.grid, plan.args, AGG_PASS=True, **more)
        more["AGG_PASS"] = False
    launch(plan.kernel, plan.grid, plan.args, **more)
    return partials


def _forward(mode, x, y, h0, out_a, out_h, parts=1, bias=None):
    _launch(mode, "forward", x, dict(x_ptr=x, y_ptr=y, h0_ptr=x if h0 is None else h0, out_a_ptr=out_a,
                                     out_h_ptr=out_h), h0 is not None, parts, bias)


def _backward(mode, x, y, h0, g, ga, out_h, out_a, dx, dy, dh0, parts=1, bias=None):
    """Fill the input gradients dx, dy, dh0; returns the bias's gradient (summed partials) if `bias`."""
    tensors = dict(x_ptr=x, y_ptr=y, h0_ptr=x if h0 is None else h0, g_ptr=g, ga_ptr=ga, out_h_ptr=out_h,
                   out_a_ptr=out_a, dx_ptr=dx, dy_ptr=dy, dh0_ptr=dh0)
    partials = _launch(mode, "backward", x, tensors, h0 is not None, parts, bias)
    return None if partials is None else partials.sum((0, 1)).to(bias.dtype)


# ---- linear_scan -------------------------------------------------------------------------

def _linear_scan_fwd(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = a.contiguous(), b.contiguous()
    A, Bc = torch.empty_like(a), torch.empty_like(b)
    _forward(SCAN, a, b, None, A, Bc)
    return A, Bc


def _linear_scan_bwd(a: torch.Tensor, A: torch.Tensor, Bc: torch.Tensor, gA: torch.Tensor,
                     gB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, gA, gB = a.contiguous(), gA.contiguous(), gB.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(a)
    _backward(SCAN, a, a, None, gB, gA, Bc, A, da, db, da)
    return da, db


_linear_scan = scan_op("linear_scan", _linear_scan_fwd, _linear_scan_bwd, saved=(0,))


# ---- linear_recurrence --------------------------------------------------------------------

def _linear_recurrence_fwd(a: torch.Tensor, b: torch.Tensor, h0: Optional[torch.Tensor]) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    h0 = None if h0 is None else h0.contiguous()
    h = torch.empty_like(b)
    _forward(REC, a, b, h0, h, h)
    return h


def _linear_recurrence_bwd(a: torch.Tensor, h0: Optional[torch.Tensor], h: torch.Tensor,
                           g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, g = a.contiguous(), g.contiguous()
    h0 = None if h0 is None else h0.contiguous()
    da, db = torch.empty_like(a), torch.empty_like(a)
    dh0 = a.new_empty(a.shape[0], a.shape[2])
    _backward(REC, a, a, h0, g, g, h, h, da, db, dh0)
    return da, db, dh0


_linear_recurrence = scan_op("linear_recurrence", _linear_recurrence_fwd, _linear_recurrence_bwd, saved=(0, 2),
                             optional=(2,))


# ---- parallel_scan_log --------------------------------------------------------------------

def _parallel_scan_log_fwd(log_coeffs: torch.Tensor, log_values: torch.Tensor) -> torch.Tensor:
    lc, lv = log_coeffs.contiguous(), log_values.contiguous()
    h = torch.empty_like(lc)
    _forward(LOG, lc, lv, None, h, h)
    return h


def _parallel_scan_log_bwd(log_coeffs: torch.Tensor, log_values: torch.Tensor, h: torch.Tensor,
                           g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lc, lv, g = log_coeffs.contiguous(), log_values.contiguous(), g.contiguous()
    dlc, dlv = torch.empty_like(lc), torch.empty_like(lv)
    _backward(LOG, lc, lv, None, g, g, h, h, dlc, dlv, dlc)
    return dlc, dlv


_parallel_scan_log = scan_op("parallel_scan_log", _parallel_scan_log_fwd, _parallel_scan_log_bwd, saved=(0, 1))


# ---- gated_recurrence ---------------------------------------------------------------------

def _gated_recurrence_fwd(k: torch.Tensor, cand: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    k, cand, h0 = k.contiguous(), cand.contiguous(), h0.contiguous()
    h = torch.empty_like(k)
    _forward(GATE, k, cand, h0, h, h)
    return h


def _gated_recurrence_bwd(k: torch.Tensor, cand: torch.Tensor, h0: torch.Tensor, h: torch.Tensor,
                          g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k, cand, h0, g = k.contiguous(), cand.contiguous(), h0.contiguous(), g.contiguous()
    dk, dcand, dh0 = torch.empty_like(k), torch.empty_like(k), torch.empty_like(h0)
    _backward(GATE, k, cand, h0, g, g, h, h, dk, dcand, dh0)
    return dk, dcand, dh0


_gated_recurrence = scan_op("gated_recurrence", _gated_recurrence_fwd, _gated_recurrence_bwd, saved=(0, 1, 2))


# ---- the stacked forms: one projection output holding k | cand (| s) side by side -----------

def _stacked_op(name, mode, parts):
    """scan_op `name` over (B, T, parts * D) rows of stacked pre-activations in MODE `mode`, an
    initial state (B, D) and their bias (parts * D,) or None. The kernels read the second part (cand)
    through a view whose pointer starts D into each row, the others from the first part's."""
    def second(x):
        D = x.shape[-1] // parts
        return x[..., D:2 * D]

    def forward(x: torch.Tensor, h0: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x, h0 = x.contiguous(), h0.contiguous()
        h = x.new_empty(h0.shape[0], x.shape[1], h0.shape[1])
        _forward(mode, x, second(x), h0, h, h, parts, None if bias is None else bias.contiguous())
        return h

    def backward(x: torch.Tensor, h0: torch.Tensor, bias: Optional[torch.Tensor], h: torch.Tensor,
                 g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, h0, g = x.contiguous(), h0.contiguous(), g.contiguous()
        dx, dh0 = torch.empty_like(x), torch.empty_like(h0)
        dbias = _backward(mode, x, second(x), h0, g, g, h, h, dx, second(dx), dh0, parts,
                          None if bias is None else bias.contiguous())
        return dx, dh0, x.new_empty(0) if dbias is None else dbias

    return scan_op(name, forward, backward, saved=(0, 1, 2), optional=(2,))


_gated_recurrence_stacked = _stacked_op("gated_recurrence_stacked", GATE, 2)
_signed_recurrence_stacked = {False: _stacked_op("signed_recurrence_stacked", SIGN, 3),
                              True: _stacked_op("signed_recurrence_coupled_stacked", SIGN_COUPLED, 3)}


# ---- entry points (inputs already validated by mingru.ops) -------------------------------

def linear_scan(a, b):
    check_envelope(a, batch=a.shape[0])
    return _linear_scan(a, b)


def linear_recurrence(a, b, h0=None):
    check_envelope(a, batch=a.shape[0])
    return _linear_recurrence(a, b, h0)


def parallel_scan_log(log_coeffs, log_values):
    check_envelope(log_coeffs, batch=log_coeffs.shape[0])
    return _parallel_scan_log(log_coeffs, log_values)


def gated_recurrence(k, cand, h0):
    check_envelope(k, batch=k.shape[0])
    return _gated_recurrence(k, cand, h0)


def gated_recurrence_stacked(kc, h0, bias=None):
    check_envelope(kc, batch=kc.shape[0])
    return _gated_recurrence_stacked(kc, h0, bias)


def signed_recurrence_stacked(kcs, h0, bias=None, coupled=False):
    check_envelope(kcs, batch=kcs.shape[0])
    return _signed_recurrence_stacked[coupled](kcs, h0, bias)
