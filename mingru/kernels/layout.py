"""The one planner: how a scan's lanes and time steps are spread over programs (see the vocabulary
in `mingru.kernels`).

Every family gets a `Plan`. The block (lanes per program) is the family's own rule; the time split
is shared: when the lane blocks alone leave the GPU short of programs, T is cut into segments,
each at least a minimum length, until there are about a target number of programs per SM (the
family's own). A split costs a first pass over the inputs (each segment's aggregate), so long
blocks of work stay whole.
Plans are cached per concrete shape and device; `forced_layout` overrides them for tests and
benchmark harnesses.
"""
import contextlib
import functools
from typing import NamedTuple

import torch

from mingru.kernels.common import cdiv, next_pow2

MATRIX_PROGRAMS_PER_SM = 4  # the target of a matrix walk's time split
CPU_SMS = 4  # what the interpreter counts as SMs, so CPU tests take the splits a small GPU takes


class Plan(NamedTuple):
    block: int     # lanes per program
    tile: int      # time steps loaded and combined together (a multiple of it starts every segment)
    segments: int  # programs along time; more than one adds the aggregate pass
    seg_len: int   # time steps per segment (with one segment, at least T)
    warps: int
    stages: int    # num_stages of the time loop
    prefetch: bool = False  # registers hold the next tile while this one is combined
    lookback: bool = False  # one tile per segment, in one pass: each program takes its carry from
                            # the segments before it as they publish it (diagonal scans only)


AUTO = (0, 0, 0, False, 0, 0)  # (tile, segments, block, lookback, warps, stages); 0 = the planner's choice
_forced = AUTO


@contextlib.contextmanager
def forced_layout(tile=0, segments=0, block=0, lookback=False, warps=0, stages=0):
    """Force the tile length, the number of time segments and the lanes per program (0: automatic)
    of every diagonal and matrix plan made inside the block; rotation plans take only `block`.
    `lookback` forces a diagonal scan's single pass, one tile per segment (`segments` is then
    ignored). `warps` and `stages` (0: automatic) apply to diagonal and matrix plans (the single
    pass takes only `warps`)."""
    global _forced
    old, _forced = _forced, (int(tile), int(segments), int(block), bool(lookback), int(warps), int(stages))
    try:
        yield
    finally:
        _forced = old


@functools.lru_cache(maxsize=None)
def sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else CPU_SMS


def split_time(T, programs, sms, tile, min_len, min_segments, split_below, per_sm, max_segments, forced=0):
    """(segments, seg_len) for `programs` lane blocks walking T steps.

    Split only with fewer than split_below * sms programs and room for min_segments segments of
    min_len steps; then aim at per_sm programs per SM, with at most max_segments segments (each
    folds the aggregates of all the segments before it in turn). seg_len is a multiple of tile.
    """
    segments = forced or 1
    if not forced and programs < split_below * sms and T // min_len >= min_segments:
        segments = min(cdiv(per_sm * sms, programs), T // min_len, max_segments)
    seg_len = cdiv(cdiv(T, segments), tile) * tile
    return cdiv(T, seg_len), seg_len


# ---- diagonal: one lane per channel, a block of channels per program ------------------------

class Tiles(NamedTuple):
    """A diagonal form's layout: the tile and program shape, and how far it splits time."""
    tile: int
    block: int      # lanes per program; the split is decided with it
    warps: int
    stages: int
    prefetch: bool
    per_sm: int     # the split's target of programs per SM: each walk is a chain of dependent
                    # tiles, so more and shorter walks keep more loads in flight
    min_tiles: int  # a time segment is at least this many tiles long
    walk_block: int  # lanes per program of a walk that time is not split for


# Per (direction, op form), chosen by measurement on the H200 (sweeps over tile, block, warps,
# segments). The log forward splits least: each segment folds the earlier segments' aggregates
# by a log-add-exp apiece, so many segments cost more than they hide. The gate forward's unsplit
# walk takes 16 lanes a program: on an H100 (B128 T64 D64, B64 T256 D512, B16 T1024 D1024,
# B8 T4096 D2048) gated_recurrence's forward ran 1.3-2.2x faster by GPU clock with 16 lanes than
# with 64. At the last three, 16 lanes made its backward at most 4 % faster (14 % slower at
# B64 T256 D512) and the other forms' forward no faster or slower (32 lanes: from 8 % faster to 26 %
# slower); the first is the case of DIAGONAL_MIN_WALK_BLOCK.
DIAGONAL_TILES = {
    ("forward", "scan"): Tiles(64, 64, 4, 3, False, 8, 1, 64),
    ("forward", "rec"): Tiles(64, 64, 4, 3, False, 8, 1, 64),
    ("forward", "log"): Tiles(32, 64, 4, 1, True, 4, 4, 64),
    ("forward", "gate"): Tiles(32, 64, 4, 3, False, 8, 1, 16),
    ("backward", "scan"): Tiles(64, 64, 4, 3, False, 8, 1, 64),
    ("backward", "rec"): Tiles(64, 64, 4, 3, False, 8, 1, 64),
    ("backward", "log"): Tiles(32, 64, 4, 3, False, 8, 1, 64),
    ("backward", "gate"): Tiles(32, 64, 4, 3, False, 8, 1, 64),
}
# The single pass that replaces a two-pass split: (tile, block, warps) per (direction, op form). Each
# program loads one tile, publishes its aggregate, and takes its carry from the tiles before it in
# the scan's direction (decoupled look-back), so the inputs are read once. The choices come from sweeps
# on the H200; the backward's (tile 64, 128, 256; block 32, 64; 1, 2, 4 warps), of linear_scan at
# B2 T16384 D1024, B4 T16384 D1024 and B1 T65536 D256: its one choice for all forms was fastest at the
# first two and 8 % behind 1 warp at the third. The gate forward's comes from an H100 sweep of eight
# layouts (tiles 32-128, blocks 16-64, 1-4 warps) of gated_recurrence and its stacked form at
# B1 T65536 D256, B2 T16384 D1024, B4 T4096 D1024 and B16 T1024 D256: 7-16 % faster by GPU clock than
# the (64, 32, 2) it had, at each (at the last, two others ran up to 5 % faster still).
LOOKBACK_TILES = {("forward", "scan"): (128, 32, 4), ("forward", "rec"): (64, 32, 2),
                  ("forward", "log"): (64, 32, 1), ("forward", "gate"): (128, 16, 4),
                  **{("backward", form): (64, 32, 2) for form in ("scan", "rec", "log", "gate")}}
DIAGONAL_SPLIT_BELOW = 0.5  # split time only with fewer lane blocks than half the SMs
# An unsplit walk whose lane blocks are fewer than the SMs halves its lanes per program, down to this,
# until they are not (idle SMs otherwise). On an H100 at the seed's lab shape (B128 T64 D64: 128 blocks
# of 64 lanes, 132 SMs) 32 lanes ran the scan, recurrence and log forms 8-20 % faster by GPU clock,
# forward and fwd+bwd.
DIAGONAL_MIN_WALK_BLOCK = 16
DIAGONAL_MAX_SEGMENTS = 128


def diagonal(B, T, D, device, direction, form, single_pass=True):
    """Plan of a (B, T, D) diagonal scan: the form's Tiles (tile no longer than T, block no wider
    than D); time split only below DIAGONAL_SPLIT_BELOW lane blocks per SM (counted at the form's
    block), then up to the form's programs per SM and DIAGONAL_MAX_SEGMENTS segments; a split
    becomes the single look-back pass (LOOKBACK_TILES) unless the number of segments is forced or
    `single_pass` is False (a float64 scan: the single pass publishes float32 states). A walk time
    is not split for takes the form's walk_block lanes a program, halved (not below
    DIAGONAL_MIN_WALK_BLOCK) while its lane blocks are fewer than the SMs."""
    # int(): under torch.compile with dynamic shapes the sizes arrive as SymInts, which do not hash
    return _diagonal(int(B), int(T), int(D), sm_count(device), DIAGONAL_TILES[direction, form], _forced,
                     LOOKBACK_TILES[direction, form] if single_pass else None)


@functools.lru_cache(maxsize=4096)
def _diagonal(B, T, D, sms, tiles, forced, single=None):
    """`single`: the (tile, block, warps) of the single pass, None to keep a split in two passes."""
    if forced[3] and single:
        return _lookback(T, D, single, forced)
    tile = forced[0] or min(tiles.tile, next_pow2(T))
    block = forced[2] or min(tiles.block, next_pow2(D))
    segments, seg_len = split_time(T, B * cdiv(D, block), sms, tile, tiles.min_tiles * tile, 2, DIAGONAL_SPLIT_BELOW,
                                   tiles.per_sm, DIAGONAL_MAX_SEGMENTS, forced[1])
    if segments > 1 and single and not forced[1]:
        return _lookback(T, D, single, forced)
    if segments == 1 and not forced[2]:
        block = min(tiles.walk_block, next_pow2(D))
        while block > DIAGONAL_MIN_WALK_BLOCK and B * cdiv(D, block) < sms:
            block //= 2
    return Plan(block, tile, segments, seg_len, forced[4] or tiles.warps, forced[5] or tiles.stages, tiles.prefetch)


def _lookback(T, D, single, forced):
    tile, block, warps = single
    tile = forced[0] or min(tile, next_pow2(T))
    block = forced[2] or min(block, next_pow2(D))
    return Plan(block, tile, cdiv(T, tile), tile, forced[4] or warps, 1, lookback=True)


# ---- matrix: one lane per (b, n), a k x width state in registers ----------------------------

PRODUCTS_PER_PROGRAM = 4096  # broadcast-matmul products per step: ~32 registers a thread at 4 warps
MATRIX_TILE = 4              # steps whose loads are issued before the first product waits
MATRIX_MIN_SEGMENT = 32      # a segment pays the first pass and a carry walk: keep it long
MATRIX_MIN_SEGMENTS = 4      # a walk splits only with room for this many minimum segments
# k whose short walks split too: a segment as short as T/8 (never under 2 tiles) where T is under
# 8 minimum segments. At the seed's lab shape (T = 64) on an H200 that split ran faster at k = 4,
# and slower at k = 8 and 16 (their products make the first pass and the carry fold dearer). On an
# H100, k = 4 without the split ran slower by GPU clock in both directions and both dtypes, with the
# product budget's 32 lanes per program. Where the lanes alone fill the GPU, such a short walk takes
# one lane and one warp per program and no split instead: on an H100 at B128 T64 n16 k4 v4 (2048
# lanes) that ran the forward in about the split's GPU time with one launch instead of two, and the
# backward faster in float32, slower in bfloat16 (a sweep of blocks 1 to 32, warps 1 and 4, 1 to 8
# segments; chapter 4's seed table measures the plan it chose against the seed's kernels).
SHORT_SPLIT_K = 4
# (k, direction) whose tile is not MATRIX_TILE. Sweeps of tiles 1, 2, 4 on the H200 at B128 T64 and
# B16 T1024: at k = 8 one step at a time ran fastest both ways (batched loads cost the walk more than
# they hide there); k = 4's backward ran fastest at 2; k = 16 keeps 4 (k = 2 was not swept). At k = 16
# tiles 1 and 4 x 1, 2, 4, 8 lanes x 1, 2, 4 warps gave no plan faster than this one in float32 by more
# than a few per cent, and one lane with four warps stays. (In bfloat16 at B128 T64 a tile of 1 ran
# faster both ways; long T was not swept in bfloat16, so the tile does not depend on the dtype yet.)
MATRIX_TILES = {(4, "backward"): 2, (8, "forward"): 1, (8, "backward"): 1}
# A walk of one step at a time holds the next step's inputs in registers. At k = 8 on the H200 (B128 T64,
# B16 T1024) that ran faster than loading each step when it is used and than Triton's pipeliner.
MATRIX_PREFETCH = True
# k whose lanes, when they alone fill the GPU, walk one lane per program with one warp, else four
# lanes per program with four warps (the same sweeps, blocks 1 to 8 and 1 to 4 warps).
LANE_K = 8


def matrix(lanes, T, k, width, device, direction="forward"):
    """Plan of a walk over `lanes` states of k x `width` along T steps in `direction`: the most lanes
    (a power of two, <= 128, never 2) whose broadcast products fit PRODUCTS_PER_PROGRAM, with 4 warps
    and MATRIX_TILES' tile (prefetching the next step's inputs at a tile of 1); at k = LANE_K, one
    lane and one warp per program when the lanes give MATRIX_PROGRAMS_PER_SM programs per SM, else
    four lanes; at k = SHORT_SPLIT_K one lane and one warp too when those lanes fill the GPU and T
    holds fewer than MATRIX_MIN_SEGMENTS minimum segments. The walk is latency-bound, so T is split
    below MATRIX_PROGRAMS_PER_SM programs per SM once it holds MATRIX_MIN_SEGMENTS minimum segments
    (MATRIX_MIN_SEGMENT steps; for k = SHORT_SPLIT_K, T/8 where that is shorter)."""
    return _matrix(int(lanes), int(T), int(k), int(width), sm_count(device), direction, _forced)


@functools.lru_cache(maxsize=1024)
def _matrix(lanes, T, k, width, sms, direction, forced):
    block = max(1, min(128, next_pow2(lanes), _pow2_floor(PRODUCTS_PER_PROGRAM // (k * k * width))))
    if block == 2:
        block = 1  # two lanes per program ran slower than one (and than four) in both directions
    warps = 4
    fills = lanes >= MATRIX_PROGRAMS_PER_SM * sms
    short = T < MATRIX_MIN_SEGMENTS * MATRIX_MIN_SEGMENT  # no room for the usual split's segments
    if k == LANE_K:
        block, warps = (1, 1) if fills else (4, 4)
    elif k == SHORT_SPLIT_K and short and fills:
        block, warps = 1, 1
    block, warps = forced[2] or block, forced[4] or warps
    tile = forced[0] or MATRIX_TILES.get((k, direction), MATRIX_TILE)
    min_len = MATRIX_MIN_SEGMENT
    if k == SHORT_SPLIT_K:
        min_len = max(2 * tile, min(min_len, T // 8))
    segments, seg_len = split_time(T, cdiv(lanes, block), sms, tile, min_len, MATRIX_MIN_SEGMENTS,
                                   MATRIX_PROGRAMS_PER_SM, MATRIX_PROGRAMS_PER_SM, T, forced[1])
    return Plan(block, tile, segments, seg_len if segments > 1 else T, warps, forced[5] or 1,
                prefetch=MATRIX_PREFETCH and tile == 1)


def _pow2_floor(n):
    return 1 << (max(int(n), 1).bit_length() - 1)


# ---- rotation: one warp of lanes per program, the whole sequence -----------------------------

ROTATION_SMEM = 40 * 1024  # bytes of prefetch buffers: leaves room on GPUs with ~100 KB per SM
# An H100 sweep of 4, 8, 16 and 32 lanes per program (GivensMinGRU k = 8, three rounds, fwd+bwd at
# B16 T1024 d64, B128 T64 d64 and B4 T4096 d256; RotationMinGRU at the first two) was fastest at 8
# on every Givens shape and within 1 % of the fastest on the Rotation ones.
ROTATION_LANES = 8


def rotation(T, layers, half, itemsize, backward):
    """One warp of ROTATION_LANES lanes per program walking all of T (latency, not bandwidth, bounds
    it, so more programs beat wider ones: a lane's k/2 rows spread over the warp's threads, which
    share out its sines and cosines) and as many prefetched steps (<= 4) as fit ROTATION_SMEM."""
    per_lane = (5 * half + 2 * layers * half) if backward else (3 * half + layers * half)  # loads per step
    block = _forced[2] or ROTATION_LANES
    stages = 1 + ROTATION_SMEM // (per_lane * block * max(itemsize, 4))
    return Plan(block, 1, 1, T, 1, max(1, min(stages, 4)))
