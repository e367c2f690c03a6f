"""The affine monoid the diagonal kernels scan tiles with (the matrix and rotation kernels walk
time step by step instead).

An element (a, b) stands for the affine map h -> a*h + b; composing "first 1, then 2" gives
(a1, b1) o (a2, b2) = (a1*a2, a2*b1 + b2), with identity (1, 0). Tiles are [TILE, BLOCK] with
time along axis 0; padded rows must hold the identity, so a tile's last row is its aggregate.
"""
import triton
import triton.language as tl


@triton.jit
def affine_combine(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def last_row(x):
    rows = tl.arange(0, x.shape[0])
    return tl.sum(tl.where(rows[:, None] == x.shape[0] - 1, x, 0.0), axis=0)


@triton.jit
def carry_scan(a, b, carry_a, carry_b):
    """Scan a tile along time from the state (carry_a, carry_b).

    Returns the prefix tiles (A, B) and the carry after the tile: A_t = carry_a * prod a,
    B_t = the affine recurrence started at carry_b.
    """
    a_loc, b_loc = tl.associative_scan((a, b), 0, affine_combine)
    big_a = a_loc * carry_a[None, :]
    big_b = a_loc * carry_b[None, :] + b_loc
    return big_a, big_b, last_row(big_a), last_row(big_b)


@triton.jit
def state_scan(a, b, h):
    """carry_scan when only the states h_t = a_t h_{t-1} + b_t are wanted: returns (h tile, h after)."""
    a_loc, b_loc = tl.associative_scan((a, b), 0, affine_combine)
    h_tile = a_loc * h[None, :] + b_loc
    return h_tile, last_row(h_tile)


@triton.jit
def log_add_exp(x, y):
    m = tl.maximum(x, y)
    m = tl.where(m == float("-inf"), 0.0, m)  # both -inf: keep -inf instead of nan
    return m + tl.log(tl.exp(x - m) + tl.exp(y - m))
