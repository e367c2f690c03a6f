"""Chapters 2 and 3 read their claims from these helpers: the layout cost model and the guard's cost
(pure Python on synthetic result files, plus the planner hooks, no GPU)."""
import pytest

from mingru.bench import kernel_hooks, plots

STEP_BYTES = 1024  # bytes per step of one program in the synthetic sweep below
COSTS = {"walk": (1, 100.0, 400.0), "chunk": (64, 20.0, 25.0)}  # tile, ns per step warm (L2), cold (HBM)


def _row(sweep, layout, B, T, segments, gpu_ns_per_step, wall_ns_per_step, chunk, host_us=0.0):
    byte_count = STEP_BYTES * B * T
    gpu, wall = T * gpu_ns_per_step * 1e-3, T * wall_ns_per_step * 1e-3 + host_us
    return {"sweep": sweep, "layout": layout, "B": B, "T": T, "D": 64, "chunk": chunk, "segments": segments,
            "us": wall, "gpu_us": gpu, "gbps": byte_count / (wall * 1e3), "status": "ok"}


def _layout_data():
    rows = []
    for kind, (tile, warm, cold) in COSTS.items():
        for T in (256, 1024, 4096):
            rows.append(_row("length", kind, 1, T, 1, warm, cold, tile, host_us=30.0))
        rows.append(_row("width", kind, 16, 4096, 1, cold, cold, tile))  # data no longer in L2
    return {"rows": rows, "env": {"copy_gbps": 1e6, "gpu": "test"}, "meta": {}}


def test_slopes_remove_the_host_and_compare_with_one_round_trip_per_tile():
    slopes = {r["kind"]: r for r in plots.layout_slopes(_layout_data())}
    assert slopes["walk"]["ns/step GPU clock (L2)"] == pytest.approx(100.0)
    assert slopes["walk"]["ns/step wall clock (HBM)"] == pytest.approx(400.0)  # the host constant drops out
    assert slopes["chunk"]["tile cost / walk step"] == pytest.approx(64 * 20.0 / 100.0)
    assert slopes["chunk"]["measured / that model"] == pytest.approx(20.0 / (100.0 / 64))


def test_model_reproduces_rows_made_by_it_and_picks_the_cache_by_working_set():
    data = _layout_data()
    for l2 in (None, 8 * 2**20):
        model = plots.layout_model(data, l2)
        assert len(model) == len(data["rows"])
        assert all(r["measured / predicted"] == pytest.approx(1.0, rel=1e-6) for r in model)
        width = {r["kind"]: r for r in model if r["sweep"] == "width"}
        assert width["walk"]["cache"] == "HBM" and width["chunk"]["cache"] == "HBM"
        assert all(r["bound"] == "program" for r in model)  # the copy bandwidth is far above every row
    picked = {r["picked by"] for r in plots.layout_model(data, 8 * 2**20)}
    assert picked == {"working set vs L2"}


def test_a_split_pays_the_first_pass_and_the_carry_fold():
    data = _layout_data()
    data["rows"].append({**_row("width", "auto", 1, 4096, 1, 1.0, 1.0, 64), "segments": 16, "gpu_us": 1.0})
    split = next(r for r in plots.layout_model(data) if r["kind"] == "auto")
    want = (1.5 * 256 * 20.0 + 15 * 100.0) * 1e-3
    assert split["predicted µs, L2"] == pytest.approx(want)


def _precision(ratios):
    rows = []
    for (k, v), ratio in ratios.items():
        rows += [{"k": k, "v": v, "variant": "ieee", "gpu_us": 10.0 * ratio, "fwd_us": 50.0},
                 {"k": k, "v": v, "variant": "tf32", "gpu_us": 10.0, "fwd_us": 50.0}]
    return {"rows": rows, "env": {}, "meta": {}}


def test_guard_cost_is_judged_against_the_spread_of_identical_code():
    data = _precision({(4, 4): 0.95, (8, 8): 1.05, (16, 1): 1.5, (16, 16): 1.0, (16, 2): 0.5})
    clock, rows, band = plots.guard_cost_rows(data, lambda k, v: k >= 16)
    assert clock == "gpu_us" and band == pytest.approx((0.95, 1.05))
    verdict = {(r["k"], r["v"]): r["vs noise"] for r in rows}
    assert verdict == {(4, 4): None, (8, 8): None, (16, 1): "guard slower", (16, 16): "within",
                       (16, 2): "guard faster"}


def test_guard_cost_falls_back_to_the_event_clock():
    data = _precision({(4, 4): 1.0})
    for r in data["rows"]:
        r["gpu_us"] = None
    clock, rows, band = plots.guard_cost_rows(data, lambda k, v: False)
    assert clock == "fwd_us" and rows[0]["ieee / tf32"] == 1.0 and band == (1.0, 1.0)


def test_planner_hooks_answer_for_any_sm_count():
    few, many = kernel_hooks.diagonal_plan(64, 4096, 64, sms=8), kernel_hooks.diagonal_plan(64, 4096, 64, sms=1024)
    assert few.segments == 1 < many.segments  # 64 rows fill 8 SMs; 1024 SMs want a split
    lab, long = kernel_hooks.matrix_plan(128, 64, 8, 8, 8, sms=8), kernel_hooks.matrix_plan(2, 4096, 8, 8, 8, sms=8)
    assert lab.segments == 1 and long.segments > 1
    assert kernel_hooks.rotation_plan(64, 3, 8, 4).segments == 1
    fig, grids = plots.plan_maps(lambda r, c, sms: r * c + sms, {"a": 1, "b": 2}, [1, 2], [3], "rows", "cols", "x")
    assert grids == {"a": [[4], [7]], "b": [[5], [8]]}
