"""Matrix Triton kernels (matrix_affine_scan, matrix_scan, matrix_recurrence) vs the float64 loops.

On a CPU machine they run through the Triton interpreter (conftest sets TRITON_INTERPRET=1), so the
shapes stay tiny. `forced_layout(segments=3)` cuts T = 11 into segments of 4 steps (with a partial last
one) to run the aggregate pass, the carry walk and the second pass that the GPU picks for few lanes.
Tolerances: float32 accumulates in float32 over T <= 11 steps of k-term dot products, so 1e-5 abs /
1e-4 rel; bfloat16 rounds the outputs (and the saved outputs the backward reads) to 8 bits, so 2e-2.
"""
import pytest
import torch

import mingru
from gradutil import as_tuple, outputs_and_grads as _run
from mingru import naive
from mingru.dispatch import ScanFallback
from mingru.validate import BLOCK_SIZES

matrix = pytest.importorskip("mingru.kernels.matrix")
from mingru.kernels import layout  # noqa: E402
from mingru.kernels.common import allow_tf32_dots  # noqa: E402
pytestmark = pytest.mark.usefixtures("triton_mode")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SPLIT = dict(segments=3, block=4)  # T=11: segments 4 + 4 + 3; with 6 lanes a block spans two batch rows

OPS = {
    "affine": (mingru.matrix_affine_scan, naive.matrix_affine_scan_naive),
    "scan": (mingru.matrix_scan, naive.matrix_scan_naive),
    "recurrence": (mingru.matrix_recurrence, naive.matrix_recurrence_naive),
    "recurrence-no_h0": (lambda A, X: mingru.matrix_recurrence(A, X), naive.matrix_recurrence_naive),
}


def _inputs(op, B, T, n, k, v, dtype, device, seed=0):
    """Transitions scaled to spectral radius ~0.5 (stable products), injections and h0 ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(B, T, n, k, k, generator=g) * (0.5 / k ** 0.5)
    if op == "scan":
        xs = [A, torch.randn(B, T, n, k, generator=g)]
    else:
        xs = [A, torch.randn(B, T, n, k, v, generator=g)]
    if op == "recurrence":
        xs.append(torch.randn(B, n, k, v, generator=g))
    return [x.to(device=device, dtype=dtype) for x in xs]


def _check(name, inputs, plan=None):
    """Outputs and gradients (random cotangents on every output, h0 included) vs float64."""
    op, ref = OPS[name]
    dtype = inputs[0].dtype
    with torch.no_grad():
        shapes = [o.shape for o in as_tuple(ref(*inputs))]
    g = torch.Generator().manual_seed(1)
    # cotangents rounded to the input dtype, so both sides differentiate against the same values
    cot = [torch.randn(s, generator=g).to(dtype).double().to(inputs[0].device) for s in shapes]
    ref_outs, ref_grads = _run(ref, [x.double() for x in inputs], cot)
    with layout.forced_layout(**(plan or {})):
        outs, grads = _run(op, inputs, cot)
    for got, want in zip(outs + grads, ref_outs + ref_grads):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want.to(dtype).double(), **TOL[dtype])


def _kv(pairs):
    return pytest.mark.parametrize("k,v", pairs, ids=[f"k{k}-v{v}" for k, v in pairs])


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


@_kv([(k, v) for k in BLOCK_SIZES for v in BLOCK_SIZES])
def test_affine_every_block_size(k, v, device):
    """B2-T5-n2: every (k, v) of the envelope, forward and backward, one sequential walk."""
    _check("affine", _inputs("affine", 2, 5, 2, k, v, torch.float32, device))


@_kv([(1, 1), (2, 4), (8, 2), (16, 16)])
@pytest.mark.parametrize("op", ["affine", "recurrence"])
def test_time_split_chunk_boundaries(op, k, v, device):
    """T=11 in segments of 4: the carry of every segment comes from the aggregates of the earlier ones."""
    _check(op, _inputs(op, 2, 11, 3, k, v, torch.float32, device), SPLIT)


LENGTHS = [(1, {}, torch.float32), (7, {}, torch.float32), (11, SPLIT, torch.float32),
           (11, SPLIT, torch.bfloat16)]
LENGTH_IDS = [f"T{T}{'-split' if plan else ''}-{_dtype_id(d)}" for T, plan, d in LENGTHS]


@pytest.mark.parametrize("T,plan,dtype", LENGTHS, ids=LENGTH_IDS)
def test_matrix_scan(T, plan, dtype, device):
    _check("scan", _inputs("scan", 2, T, 3, 2, 1, dtype, device), plan)


@pytest.mark.parametrize("T,plan,dtype", LENGTHS, ids=LENGTH_IDS)
@pytest.mark.parametrize("op", ["recurrence", "recurrence-no_h0"])
def test_matrix_recurrence(op, T, plan, dtype, device):
    inputs = _inputs("recurrence", 2, T, 3, 4, 2, dtype, device)
    _check(op, inputs if op == "recurrence" else inputs[:2], plan)


@pytest.mark.parametrize("tile", [1, 2], ids=["tile1", "tile2"])
def test_forced_tiles(tile, device):
    """Tiles of 1 and 2 steps (the plan takes 4) through forced_layout: they must agree."""
    _check("affine", _inputs("affine", 2, 7, 2, 2, 1, torch.float32, device), dict(tile=tile))
    _check("recurrence", _inputs("recurrence", 1, 11, 2, 4, 2, torch.float32, device), dict(SPLIT, tile=tile))


@pytest.mark.parametrize("segments", [1, 3], ids=["whole", "split"])
def test_one_lane_per_program(segments, device):
    """block=1 (one lane per program, the per-lane layout) through forced_layout, k8 v1 and k4 v4."""
    _check("affine", _inputs("affine", 2, 11, 3, 8, 1, torch.float32, device), dict(block=1, segments=segments))
    _check("recurrence", _inputs("recurrence", 2, 11, 3, 4, 4, torch.float32, device),
           dict(block=1, segments=segments))


def test_the_planners_one_lane_walk_at_the_short_split_k(device):
    """The plan itself (nothing forced) at k = SHORT_SPLIT_K, T short, lanes B*n enough to fill the
    GPU: one lane and one warp per program, no split, both directions, against float64."""
    B, T, k = 2, 6, layout.SHORT_SPLIT_K
    n = -(-layout.MATRIX_PROGRAMS_PER_SM * layout.sm_count(torch.device(device)) // B)  # B * n lanes fill it
    for direction in ("forward", "backward"):
        plan = layout.matrix(B * n, T, k, 2 * k, torch.device(device), direction)
        assert (plan.block, plan.warps, plan.segments) == (1, 1, 1)
    _check("affine", _inputs("affine", B, T, n, k, k, torch.float32, device))
    _check("recurrence", _inputs("recurrence", B, T, n, k, 1, torch.float32, device))


def test_bfloat16_affine_split(device):
    _check("affine", _inputs("affine", 2, 11, 2, 8, 4, torch.bfloat16, device), SPLIT)


def test_float16_recurrence(device):
    inputs = _inputs("recurrence", 2, 6, 2, 4, 4, torch.float16, device)
    op, ref = OPS["recurrence"]
    torch.testing.assert_close(op(*inputs).double(), ref(*inputs).half().double(), atol=5e-3, rtol=5e-3)


def test_non_contiguous_inputs(device):
    """Transposed inner dims and a time stride that is no multiple of k*v (both copied), a batch
    broadcast (stride 0) and a strided slice over time (both used in place)."""
    A, X, h0 = _inputs("recurrence", 1, 12, 2, 4, 2, torch.float32, device)
    A_t = A.transpose(-1, -2).contiguous().transpose(-1, -2).expand(2, -1, -1, -1, -1)
    padded = torch.cat([torch.cat([X, X + 1], 0).flatten(2), torch.zeros(2, 12, 1, device=device)], 2)
    X_s = padded.as_strided((2, 12, 2, 4, 2), (12 * 17, 17, 8, 2, 1))[:, ::2]
    A_s = A_t[:, ::2]
    h0 = h0.expand(2, -1, -1, -1)
    for plan in ({}, SPLIT):
        with layout.forced_layout(**plan):
            got = mingru.matrix_recurrence(A_s, X_s, h0)
            got_a, got_b = mingru.matrix_affine_scan(A_s, X_s)
        torch.testing.assert_close(got.double(), naive.matrix_recurrence_naive(A_s, X_s, h0), **TOL[torch.float32])
        want_a, want_b = naive.matrix_affine_scan_naive(A_s, X_s)
        torch.testing.assert_close(got_a.double(), want_a, **TOL[torch.float32])
        torch.testing.assert_close(got_b.double(), want_b, **TOL[torch.float32])


def test_tf32_switch_runs_k16(device):
    """allow_tf32_dots only changes tl.dot's precision at k=16 (TF32 ~1e-3; the interpreter ignores it)."""
    A, X = _inputs("affine", 1, 5, 2, 16, 16, torch.float32, device)
    with allow_tf32_dots():
        got_a, got_b = mingru.matrix_affine_scan(A, X)
    want_a, want_b = naive.matrix_affine_scan_naive(A, X)
    torch.testing.assert_close(got_a.double(), want_a, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_b.double(), want_b, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("op", ["affine", "recurrence"])
def test_gradcheck_float64(op, device):
    inputs = [x.requires_grad_() for x in _inputs(op, 1, 6, 1, 2, 1, torch.float64, device)]
    fn = OPS[op][0]
    with layout.forced_layout(segments=2):  # T=6: 4 + 2
        assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


@pytest.mark.parametrize("k,v", [(3, 1), (2, 32)], ids=["k3", "v32"])
def test_outside_envelope_falls_back(k, v, device):
    A, X = _inputs("affine", 1, 3, 1, k, v, torch.float32, device)
    with pytest.raises(ScanFallback):
        matrix.matrix_affine_scan(A, X)
    with pytest.raises(ScanFallback):
        matrix.matrix_recurrence(A, X)
    with pytest.raises(RuntimeError, match="MINGRU_SCAN=triton"):
        mingru.matrix_affine_scan(A, X)


def test_plan_splits_time_only_for_few_lanes():
    cpu = torch.device("cpu")  # counts as layout.CPU_SMS SMs
    few, many, short = (layout.matrix(8, 1024, 8, 9, cpu), layout.matrix(1 << 16, 1024, 2, 3, cpu),
                        layout.matrix(8, 100, 8, 9, cpu))
    assert few.segments > 1 and few.seg_len < 1024 and few.seg_len % few.tile == 0
    assert (many.segments, many.seg_len, short.segments, short.seg_len) == (1, 1024, 1, 100)
    assert many.block == 128 and layout.matrix(8, 64, 16, 32, cpu).block == 1


def test_plan_splits_short_walks_only_at_the_short_split_k():
    cpu = torch.device("cpu")
    k4 = layout.matrix(8, 64, layout.SHORT_SPLIT_K, 8, cpu)  # too few lanes to fill the GPU
    assert k4.segments >= 4 and 2 * k4.tile <= k4.seg_len < layout.MATRIX_MIN_SEGMENT
    assert layout.matrix(8, 64, 8, 9, cpu).segments == 1  # k = 8 keeps T = 64 whole
    long = layout.matrix(64, 1024, layout.SHORT_SPLIT_K, 8, cpu)
    assert long.seg_len >= layout.MATRIX_MIN_SEGMENT  # long walks keep the usual minimum


def test_short_walks_at_the_short_split_k_take_one_lane_once_the_lanes_fill_the_gpu():
    cpu = torch.device("cpu")  # counts as layout.CPU_SMS SMs
    full = layout.MATRIX_PROGRAMS_PER_SM * layout.CPU_SMS
    short = layout.MATRIX_MIN_SEGMENTS * layout.MATRIX_MIN_SEGMENT - 1
    for direction in ("forward", "backward"):
        one = layout.matrix(full, short, layout.SHORT_SPLIT_K, 8, cpu, direction)
        assert (one.block, one.warps, one.segments, one.seg_len) == (1, 1, 1, short)
        split = layout.matrix(full - 1, short, layout.SHORT_SPLIT_K, 8, cpu, direction)
        assert split.block > 1 and split.segments > 1  # too few lanes: the short split stays
        long = layout.matrix(full, short + 1, layout.SHORT_SPLIT_K, 8, cpu, direction)
        assert long.block > 1  # room for the usual split: the product budget's block


def test_plan_never_puts_two_lanes_in_a_program():
    cpu = torch.device("cpu")
    # k = 16, width 6: the product budget allows 2 lanes; the plan takes 1
    assert layout.matrix(1024, 64, 16, 6, cpu).block == 1
    assert layout.matrix(1024, 64, 16, 4, cpu).block == 4  # a budget of 4 keeps 4
    with layout.forced_layout(block=2):
        assert layout.matrix(1024, 64, 16, 6, cpu).block == 2  # a forced layout is obeyed


def test_plan_tiles_and_lanes_per_k_and_direction():
    cpu = torch.device("cpu")  # counts as layout.CPU_SMS SMs
    full = layout.MATRIX_PROGRAMS_PER_SM * layout.CPU_SMS
    for direction in ("forward", "backward"):
        for width in (9, 16, 24):  # k = 8: one lane and one warp per program once the lanes fill the GPU
            assert layout.matrix(full, 64, layout.LANE_K, width, cpu, direction)[:5:4] == (1, 1)
            assert layout.matrix(full - 1, 64, layout.LANE_K, width, cpu, direction)[:5:4] == (4, 4)
        for k in (2, 4, 8, 16):
            want = layout.MATRIX_TILES.get((k, direction), layout.MATRIX_TILE)
            assert layout.matrix(64, 1024, k, k + 1, cpu, direction).tile == want
    assert layout.MATRIX_TILES[8, "forward"] == 1 and layout.MATRIX_TILES[4, "backward"] == 2
    with layout.forced_layout(tile=4, warps=2, block=8):
        assert layout.matrix(full, 64, 8, 9, cpu)[:5] == (8, 4, 1, 64, 2)
