"""The shared monoid core, jitted: every scan kernel is an instance of these few functions.

An element (a, b) stands for the affine map h -> a*h + b; composing "first 1, then 2" gives
(a1, b1) o (a2, b2) = (a1*a2, a2*b1 + b2), with identity (1, 0). The same monoid has two
numerical realizations: linear space (`carry_scan`) and a log-space carry for positive
recurrences whose state may leave the float range while the answer does not (`log_carry_scan`).
Tiles are [CHUNK, BLOCK] with time along axis 0; padded rows must hold the identity.
"""
import triton
import triton.language as tl


@triton.jit
def affine_combine(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def last_row(x):
    """Row CHUNK-1 of a tile; with identity padding it is the aggregate of the whole tile."""
    rows = tl.arange(0, x.shape[0])
    return tl.sum(tl.where(rows[:, None] == x.shape[0] - 1, x, 0.0), axis=0)


@triton.jit
def carry_scan(a, b, carry_a, carry_b):
    """Scan a tile along time, starting from the state (carry_a, carry_b).

    Returns the prefix tiles (A, B) and the carry after the tile: A_t = carry_a * prod a,
    B_t = the affine recurrence started at carry_b.
    """
    a_loc, b_loc = tl.associative_scan((a, b), 0, affine_combine)
    big_a = a_loc * carry_a[None, :]
    big_b = a_loc * carry_b[None, :] + b_loc
    return big_a, big_b, last_row(big_a), last_row(big_b)


@triton.jit
def log_add_exp(x, y):
    m = tl.maximum(x, y)
    m = tl.where(m == float("-inf"), 0.0, m)  # both -inf: keep -inf instead of nan
    return m + tl.log(tl.exp(x - m) + tl.exp(y - m))


@triton.jit
def log_carry_scan(log_a, log_b, carry_sum, carry_log_h):
    """h_t = exp(log_a_t) h_{t-1} + exp(log_b_t) over a tile, the carry held as log h.

    Inside the tile the scan runs in linear space; the incoming state enters as
    exp(cumsum(log_a) + log h), so a carry far outside the float range still yields every
    output that is itself representable. Returns h, and the new (sum of log_a, log h).
    """
    _, b_loc = tl.associative_scan((tl.exp(log_a), tl.exp(log_b)), 0, affine_combine)
    cum = tl.cumsum(log_a, 0)
    h = tl.exp(cum + carry_log_h[None, :]) + b_loc
    cum_last = last_row(cum)
    new_log_h = log_add_exp(cum_last + carry_log_h, tl.log(last_row(b_loc)))
    return h, carry_sum + cum_last, new_log_h
