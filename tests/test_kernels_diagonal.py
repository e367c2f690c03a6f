"""Diagonal Triton kernels (linear_scan, linear_recurrence, parallel_scan_log, gated_recurrence and
its stacked form, signed_recurrence_stacked) vs the float64 loops.

On a CPU machine they run through the Triton interpreter (conftest sets TRITON_INTERPRET=1), so the
shapes stay tiny. `forced_layout` shrinks the tile to cross tile boundaries and forces the time
splits the GPU picks for small B*D: the backward's two passes, and the forward's single look-back
pass (one tile per program, LOOKBACK below) as well as its two-pass form.
Tolerances: float32 accumulates in float32 over T <= 64 steps, a few ulps per step, so 1e-5 abs /
1e-4 rel; bfloat16 rounds the outputs (and the saved outputs the backward reads) to 8 bits, so 2e-2.
"""
import pytest
import torch
import torch.nn.functional as F

import mingru
from gradutil import as_tuple, outputs_and_grads as _run
from mingru import naive

diagonal = pytest.importorskip("mingru.kernels.diagonal")
from mingru.kernels import layout  # noqa: E402
pytestmark = [pytest.mark.usefixtures("triton_mode"),
              # numpy (the interpreter) warns on log(0) = -inf, a legitimate log h, and on exp
              # overflowing in a tl.where branch that is not selected
              pytest.mark.filterwarnings("ignore:(divide by zero|overflow) encountered:RuntimeWarning")]

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _signed(g, B, T, D):
    """Coefficients in +-[0.5, 1): negative ones included, products stay in range for T <= 64."""
    sign = torch.randint(0, 2, (B, T, D), generator=g) * 2 - 1
    return sign * (0.5 + 0.5 * torch.rand(B, T, D, generator=g))


def _inputs(op, B, T, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if op == "linear_scan":
        xs = [_signed(g, B, T, D), torch.randn(B, T, D, generator=g)]
    elif op == "linear_recurrence":
        xs = [_signed(g, B, T, D), torch.randn(B, T, D, generator=g), torch.randn(B, D, generator=g)]
    elif op == "gated_recurrence":  # pre-activations wide enough to saturate some gates
        xs = [3 * torch.randn(B, T, D, generator=g), 2 * torch.randn(B, T, D, generator=g), torch.rand(B, D, generator=g)]
    elif op == "signed_recurrence":  # k, cand, s; a state of either sign
        xs = [3 * torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g),
              2 * torch.randn(B, T, D, generator=g), torch.randn(B, D, generator=g)]
    else:
        xs = [-F.softplus(torch.randn(B, T, D, generator=g)), torch.randn(B, T + 1, D, generator=g)]
    return [x.to(device=device, dtype=dtype) for x in xs]


def _case_inputs(name, B, T, D, dtype, device, seed=0):
    """The inputs of OPS[name]: its op's, less h0 for "-no_h0", plus a bias for "-bias" (one (D,)
    piece per stacked part)."""
    xs = _inputs(name.split("-")[0], B, T, D, dtype, device, seed)
    if name.endswith("no_h0"):
        return xs[:2]
    if name.endswith("bias"):
        g = torch.Generator().manual_seed(seed + 100)
        xs.append(torch.randn((len(xs) - 1) * D, generator=g).to(device=device, dtype=dtype))
    return xs


OPS = {
    "linear_scan": (mingru.linear_scan, naive.linear_scan_naive),
    "linear_recurrence": (mingru.linear_recurrence, naive.linear_recurrence_naive),
    "linear_recurrence-no_h0": (lambda a, b: mingru.linear_recurrence(a, b), naive.linear_recurrence_naive),
    "parallel_scan_log": (mingru.parallel_scan_log, naive.parallel_scan_log_naive),
    "gated_recurrence": (mingru.gated_recurrence, naive.gated_recurrence_naive),
    # k | cand stacked in one tensor, as MinGRU's single projection matmul writes them
    "gated_recurrence-stacked": (lambda k, cand, h0: mingru.gated_recurrence_stacked(torch.cat([k, cand], -1), h0),
                                 naive.gated_recurrence_naive),
    # and with the two projections' biases, which the kernel adds as it loads k | cand
    "gated_recurrence-stacked-bias": (
        lambda k, cand, h0, bias: mingru.gated_recurrence_stacked(torch.cat([k, cand], -1), h0, bias),
        lambda k, cand, h0, bias: naive.gated_recurrence_naive(k + bias[:k.shape[-1]], cand + bias[k.shape[-1]:], h0)),
    # SignedMinGRU's k | cand | s, as its single projection matmul writes them: plain, and coupled
    # with the three projections' biases
    "signed_recurrence-stacked": (
        lambda k, cand, s, h0: mingru.signed_recurrence_stacked(torch.cat([k, cand, s], -1), h0),
        naive.signed_recurrence_naive),
    "signed_recurrence-coupled-bias": (
        lambda k, cand, s, h0, bias: mingru.signed_recurrence_stacked(torch.cat([k, cand, s], -1), h0, bias, True),
        lambda k, cand, s, h0, bias: naive.signed_recurrence_naive(*(x + piece for x, piece in zip(
            (k, cand, s), bias.chunk(3))), h0, coupled=True)),
}


def _check(name, inputs, tol, forced=(0, 0)):
    """Outputs and gradients (random cotangents on every output) of the kernel vs float64."""
    op, ref = OPS[name]
    with torch.no_grad():
        shapes = [o.shape for o in as_tuple(ref(*inputs))]
    g = torch.Generator().manual_seed(1)
    # cotangents rounded to the input dtype, so both sides differentiate against the same values
    cot = [torch.randn(s, generator=g).to(inputs[0].dtype).double().to(inputs[0].device) for s in shapes]
    ref_outs, ref_grads = _run(ref, [x.double() for x in inputs], cot)
    with layout.forced_layout(*forced):
        outs, grads = _run(op, inputs, cot)
    for got, want, x in zip(outs + grads, ref_outs + ref_grads, inputs + inputs):
        assert got.dtype == x.dtype
        torch.testing.assert_close(got.double(), want.to(x.dtype).double(), **tol)


# (T, forced tile, forced segments): T=1, a short T, a T crossing tiles and segments, one full tile;
# bfloat16 (loads and stores converted, the scan in float32) at the two that cross tiles and segments
CASES = [(1, 0, 0), (7, 0, 0), (7, 2, 3), (37, 8, 0), (37, 8, 3), (64, 0, 0)]
DTYPE_CASES = [(torch.float32, *c) for c in CASES] + [(torch.bfloat16, *c) for c in CASES if c[2]]


@pytest.mark.parametrize("dtype,T,tile,segments", DTYPE_CASES,
                         ids=[f"T{t}-tile{c or 'auto'}-seg{s or 'auto'}-{str(d)[6:]}" for d, t, c, s in DTYPE_CASES])
@pytest.mark.parametrize("name", list(OPS))
def test_matches_float64_reference(name, T, tile, segments, dtype, device):
    B, D = 2, 5
    inputs = _case_inputs(name, B, T, D, dtype, device)
    _check(name, inputs, TOL[dtype], (tile, segments))


def LOOKBACK(tile):
    """The forced layout of the forward's single pass: one tile of `tile` steps per program."""
    return (tile, 0, 0, True)


# (T, forced tile) of the single pass: one tile, a partial last tile, many tiles (and a tile of 1)
LOOKBACK_CASES = [(1, 0), (37, 8), (64, 4), (6, 1)]


@pytest.mark.parametrize("T,tile", LOOKBACK_CASES, ids=[f"T{t}-tile{c or 'auto'}" for t, c in LOOKBACK_CASES])
@pytest.mark.parametrize("name", list(OPS))
def test_single_pass_forward(name, T, tile, device):
    """The look-back forward (every segment's carry from the published aggregates and prefixes of
    the ones before it), with the two-pass backward."""
    with layout.forced_layout(*LOOKBACK(tile)):
        lay = layout.diagonal(2, T, 5, torch.device(device), "forward", "rec")
    assert lay.lookback and lay.seg_len == lay.tile and lay.segments * lay.tile >= T
    _check(name, _case_inputs(name, 2, T, 5, torch.float32, device), TOL[torch.float32], LOOKBACK(tile))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bfloat16", "float64"])
def test_single_pass_forward_dtypes(dtype, device):
    """bfloat16 inputs scan in float32; float64 ones take the two passes (the single pass publishes
    float32 states)."""
    inputs = _case_inputs("gated_recurrence-stacked-bias", 2, 37, 5, dtype, device)
    _check("gated_recurrence-stacked-bias", inputs, TOL[dtype], LOOKBACK(8))


@pytest.mark.parametrize("forced", [(4, 2), LOOKBACK(4)], ids=["two-pass", "lookback"])
@pytest.mark.parametrize("name", list(OPS))
def test_wide_d_and_noncontiguous_inputs(name, forced, device):
    """D spanning two channel blocks, inputs given as transposed views."""
    inputs = _case_inputs(name, 1, 9, 70, torch.float32, device, seed=3)
    inputs = [x.transpose(1, 2).contiguous().transpose(1, 2) if x.dim() == 3 else x for x in inputs]
    assert not inputs[0].is_contiguous()
    _check(name, inputs, TOL[torch.float32], forced)


@pytest.mark.parametrize("forced", [(4, 13), LOOKBACK(4)], ids=["two-pass", "lookback"])
@pytest.mark.parametrize("name", list(OPS))
def test_many_segments(name, forced, device):
    """Thirteen segments: each folds the aggregates of every earlier (forward) or later (backward)
    one; in the look-back forward each waits on and walks back over the ones before it."""
    inputs = _case_inputs(name, 1, 52, 3, torch.float32, device, seed=11)
    with layout.forced_layout(*forced):
        assert layout.diagonal(1, 52, 3, inputs[0].device, "forward", "rec").segments == 13
    _check(name, inputs, TOL[torch.float32], forced)


@pytest.mark.parametrize("name", list(OPS))
def test_float64_gradcheck(name, device):
    inputs = [x.requires_grad_() for x in _case_inputs(name, 2, 6, 3, torch.float64, device)]
    with layout.forced_layout(tile=2, segments=2):
        assert torch.autograd.gradcheck(OPS[name][0], inputs, fast_mode=True)


@pytest.mark.parametrize("h0", ["signed", "zero"])
def test_gated_recurrence_takes_any_h0(h0, device):
    """The kernel's linear-space gates give exact states and gradients for a negative h0, and the
    true h0 gradient at h0 = 0."""
    inputs = _inputs("gated_recurrence", 2, 37, 5, torch.float32, device, seed=7)
    inputs[2] = torch.randn_like(inputs[2]) if h0 == "signed" else torch.zeros_like(inputs[2])
    _check("gated_recurrence", inputs, TOL[torch.float32], (8, 3))


@pytest.mark.parametrize("name", ["linear_scan", "linear_recurrence"])
def test_zero_coefficients(name, device):
    """a_t = 0 resets the state; the backward must not divide by it."""
    inputs = _inputs(name, 2, 11, 6, torch.float32, device, seed=5)
    inputs[0][:, 4] = 0.0
    inputs[0][0, :, 2] = 0.0
    _check(name, inputs, TOL[torch.float32], (4, 2))


@pytest.mark.parametrize("forced", [(0, 0), (2, 0), (2, 3), LOOKBACK(2)],
                         ids=["tile-auto", "tile2", "tile2-seg3", "lookback"])
def test_log_scan_carry_beyond_float32(forced, device):
    """h0 = e^100 overflows float32 but h_1 = e^100 e^-30 does not: the carry must stay in log form."""
    lc, lv = _inputs("parallel_scan_log", 1, 9, 4, torch.float32, device, seed=7)
    lv[:, 0] = 100.0
    lc[:, 0] = -30.0
    lc[:, 1] = -10.0
    with layout.forced_layout(*forced):
        h = mingru.parallel_scan_log(lc, lv)
    assert torch.isfinite(h).all()
    _check("parallel_scan_log", [lc, lv], dict(atol=1e-5, rtol=1e-5), forced)


@pytest.mark.parametrize("forced", [(0, 0), (2, 3), LOOKBACK(2)], ids=["tile-auto", "tile2-seg3", "lookback"])
def test_log_scan_zero_initial_state(forced, device):
    """log h0 = -inf means h0 = 0: outputs and gradients stay finite."""
    lc, lv = _inputs("parallel_scan_log", 2, 8, 5, torch.float32, device, seed=9)
    lv[:, 0] = float("-inf")
    _check("parallel_scan_log", [lc, lv], TOL[torch.float32], forced)


def test_plan_splits_time_only_for_small_b_times_d():
    tiles, auto = layout.DIAGONAL_TILES["backward", "scan"], layout.AUTO
    assert layout._diagonal(16, 1024, 1024, 132, tiles, auto).segments == 1
    lay = layout._diagonal(2, 16384, 1024, 132, tiles, auto)
    assert lay.segments > 1 and lay.seg_len % lay.tile == 0 and not lay.lookback
    assert (lay.segments - 1) * lay.seg_len < 16384 <= lay.segments * lay.seg_len
    assert layout._diagonal(2, 16384, 1024, 0, tiles, auto).segments == 1  # no SMs known: no split


def test_unsplit_walks_take_the_forms_walk_block_and_fill_the_sms():
    auto, min_block = layout.AUTO, layout.DIAGONAL_MIN_WALK_BLOCK
    gate, scan = layout.DIAGONAL_TILES["forward", "gate"], layout.DIAGONAL_TILES["forward", "scan"]
    assert gate.walk_block < gate.block  # the gate forward's narrower walk
    for tiles in (gate, scan):  # lane blocks enough for every SM: the form's walk block
        lay = layout._diagonal(16, 1024, 1024, 132, tiles, auto)
        assert (lay.block, lay.segments) == (tiles.walk_block, 1)
    lab = layout._diagonal(128, 64, 64, 132, scan, auto)  # 128 blocks of 64 lanes, 132 SMs: halved once
    assert (lab.block, lab.segments) == (32, 1)
    assert layout._diagonal(1, 64, 64, 132, scan, auto).block == min_block  # halved down to the floor only
    assert layout._diagonal(128, 64, 64, 132, scan, (0, 0, 64, False, 0, 0)).block == 64  # a forced block stays
    # the split is decided at the form's block: 64 gate blocks of 64 lanes split, though 16 lanes would fill
    lay = layout._diagonal(4, 4096, 1024, 132, gate, auto, layout.LOOKBACK_TILES["forward", "gate"])
    assert lay.lookback and lay.segments > 1


def test_a_forward_split_is_the_single_pass():
    tiles, auto = layout.DIAGONAL_TILES["forward", "scan"], layout.AUTO
    single = layout.LOOKBACK_TILES["forward", "scan"]
    assert not layout._diagonal(16, 1024, 1024, 132, tiles, auto, single).lookback
    lay = layout._diagonal(2, 16384, 1024, 132, tiles, auto, single)
    assert lay.lookback and lay.seg_len == lay.tile and lay.segments == -(-16384 // lay.tile)
    assert not layout._diagonal(2, 16384, 1024, 132, tiles, (0, 8, 0, False, 0, 0), single).lookback  # forced two-pass


def test_forced_layout_sets_tile_and_segments():
    """The override a benchmark harness uses: tile 1 is the sequential walk, segments 1 no time split."""
    with layout.forced_layout(tile=1, segments=1):
        lay = layout.diagonal(2, 4096, 8, torch.device("cpu"), "forward", "scan")
    assert (lay.tile, lay.segments, lay.seg_len) == (1, 1, 4096)
    with layout.forced_layout(tile=8, segments=3):
        lay = layout.diagonal(2, 37, 8, torch.device("cpu"), "backward", "log")
    assert (lay.tile, lay.segments, lay.seg_len) == (8, 3, 16)
    assert layout.diagonal(2, 37, 8, torch.device("cpu"), "backward", "log").tile == 32


# ---- the single pass's look-back walk, on published values prepared by hand ------------------
# In the interpreter programs run one after another, so every tile a program looks back at has
# already published its inclusive prefix. The walk over aggregates (flag 1) that the GPU takes
# when earlier tiles are still running is tested here directly: per lane, the nearest inclusive
# prefix sits at a different distance, or nowhere (the walk reaches the entry state).

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _walk_kernel(slot_ptr, entry_ptr, out_ptr, slot_stride, seg, end, D, BLOCK: tl.constexpr,
                 LOG_FORM: tl.constexpr, THIRD: tl.constexpr, STEP: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    cmask = cols < D
    entry_a = tl.load(entry_ptr + cols, mask=cmask, other=0.0)
    entry_b = tl.load(entry_ptr + D + cols, mask=cmask, other=0.0)
    entry_m = tl.load(entry_ptr + 2 * D + cols, mask=cmask, other=0.0)
    a, b, m = diagonal._look_back(slot_ptr + cols, slot_stride, seg, end, D, entry_a, entry_b, entry_m, cmask,
                                  LOG_FORM, THIRD, STEP)
    tl.store(out_ptr + cols, a, mask=cmask)
    tl.store(out_ptr + D + cols, b, mask=cmask)
    tl.store(out_ptr + 2 * D + cols, m, mask=cmask)


def _then(x, y, log_form):
    """(a, b, m) of x then y: the affine maps h -> a h + b (m: a second offset under the same a),
    or in log form (a, b) = (log a, log b) composed accordingly (no m)."""
    if log_form:
        return x[0] + y[0], torch.logaddexp(y[0] + x[1], y[1]), x[2]
    return x[0] * y[0], y[0] * x[1] + y[1], y[0] * x[2] + y[2]


@pytest.mark.parametrize("direction,log_form", [("forward", False), ("forward", True), ("backward", False)],
                         ids=["forward", "forward-log", "backward-three-words"])
def test_look_back_folds_aggregates_until_an_inclusive_prefix(direction, log_form, device):
    S, D = 6, 4
    g = torch.Generator().manual_seed(0)
    values = torch.rand(3, S, D, generator=g) + 0.5   # (a, b, m) published by each segment
    if log_form:
        values[0] = -values[0]                        # log coefficients
    entry = torch.rand(3, D, generator=g) + 0.5
    forward = direction == "forward"
    seg, end, step = (S - 1, -1, -1) if forward else (0, S, 1)
    nearest = [seg + step, seg + 3 * step, None, end - step]  # per lane: the segment showing flag 2
    flags = torch.ones(S, D, dtype=torch.int64)
    want = []
    for lane, j0 in enumerate(nearest):
        walk = list(range(seg + step, end, step))
        if j0 is not None:
            flags[j0, lane] = 2
            walk = walk[:walk.index(j0)]
        carry = tuple(values[i, j0, lane].double() if j0 is not None else entry[i, lane].double() for i in range(3))
        for j in reversed(walk):                      # from the base toward `seg`
            carry = _then(carry, tuple(values[i, j, lane].double() for i in range(3)), log_form)
        want.append(torch.stack(carry))
    third = not forward
    words = values[:3 if third else 2].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    slots = (words | (flags << 32)).contiguous()
    out = torch.empty(3, D, device=device)
    _walk_kernel[(1,)](slots.to(device), entry.to(device), out, S * D, seg, end, D, BLOCK=D, LOG_FORM=log_form,
                       THIRD=third, STEP=step)
    want = torch.stack(want, 1).float().to(device)
    rows = 3 if third else 2
    torch.testing.assert_close(out[:rows], want[:rows], atol=1e-6, rtol=1e-6)
