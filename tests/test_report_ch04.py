"""Chapter 4's tables keep every row and judge goals from the numbers (pure Python, no GPU)."""
from mingru.bench import report


def _env():
    return {"gpu": "test", "copy_gbps": 100.0}


def test_speed_rows_keep_two_layouts_of_one_op_at_one_shape():
    rows = [{"op": "rotation_recurrence", "shape": "lab", "dims": dims, "direction": d, "triton_us": 10.0,
             "triton_gpu_us": 2.0, "triton_x": 3.0, "status": "ok"}
            for dims in ("B1-T4-n8-k8-L6", "B1-T4-n32-k2-L1") for d in ("fwd", "fwd+bwd")]
    data = {"rows": rows, "env": _env()}
    shown = report.speed_rows(data, "fwd") + report.speed_rows(data, "fwd+bwd")
    assert len(shown) == len(rows)
    assert {r["dims"] for r in shown} == {"B1-T4-n8-k8-L6", "B1-T4-n32-k2-L1"}
    summary = report.speed_summary(data)
    assert summary["shown"] == summary["rows"] == 4
    assert len(summary["host_bound"]) == 4  # wall 10 us for 2 us of GPU: the host's call


def test_bandwidth_targets_judge_each_row_and_name_missing_shapes():
    rows = [{"op": "linear_scan", "B": 1, "T": 8, "D": 4, "direction": "fwd", "gpu_pct_copy": 85.0,
             "pct_copy": 50.0, "status": "ok"},
            {"op": "linear_scan", "B": 1, "T": 8, "D": 4, "direction": "fwd+bwd", "gpu_pct_copy": 60.0,
             "pct_copy": 60.0, "status": "ok"}]
    out = report.bandwidth_targets({"rows": rows, "env": _env()}, [(1, 8, 4), (2, 16, 4)])
    assert len(out) == 4
    by = {(r["B"], r["direction"]): r for r in out}
    assert by[1, "fwd"]["meets"] == "yes" and by[1, "fwd"]["meets_wall"] == "NO"
    assert by[1, "fwd+bwd"]["meets"] == "NO"  # 60 % against the 65 % goal: never "ok"
    assert by[2, "fwd"]["status"] == "not in this file" and by[2, "fwd"]["meets"] == "not judged"


def test_seed_rows_say_why_a_row_misses():
    row = {"op": "MinGRU", "shape": "mixer", "dims": "B1-T4-d8", "dtype": "float32", "direction": "fwd+bwd",
           "x_gpu": 1.5, "x_wall": 0.5, "ours_peak_mb": 30.0, "seed_peak_mb": 20.0, "meets_goal": False,
           "ours_status": "ok", "seed_status": "ok"}
    missing = {**row, "meets_goal": None, "x_gpu": None, "seed_status": "not measured: no seed"}
    data = {"rows": [row, missing], "env": _env()}
    assert report.seed_rows(data) == []
    short, unjudged = report.seed_rows(data, mixers=True)
    assert short["short_of"] == "GPU 1.50x < 2; wall 0.50x < 1; memory 30.0 > 20.0 MiB"
    assert unjudged["meets"] == "not judged" and "no seed" in unjudged["short_of"]
    summary = report.seed_summary(data, mixers=True)
    assert (summary["met"], summary["judged"], summary["not_judged"]) == (0, 1, 1)
    assert summary["short_by"] == {"GPU": 1, "wall": 1, "memory": 1}
    op = {**row, "op": "matrix_affine_scan", "shape": "lab", "ours_peak_mb": None, "x_wall": 1.0, "x_bound": 2.5}
    assert report.seed_rows({"rows": [op], "env": _env()})[0]["short_of"] == \
        "GPU 1.50x < 2 (2x needs 80 % of copy bandwidth)"


def test_peers_summary_counts_both_clocks_and_layouts():
    rows = [{"competitor": "mingru.linear_recurrence", "B": 1, "T": 8, "D": 4, "direction": "fwd", "us": 10.0,
             "gpu_us": 2.0},
            {"competitor": "accelerated_scan", "B": 1, "T": 8, "D": 4, "direction": "fwd", "us": 20.0,
             "gpu_us": 1.0, "ours_x": 2.0, "ours_gpu_x": 0.5, "meets_goal": False},
            {"competitor": "accelerated_scan (B,T,D)", "B": 1, "T": 8, "D": 4, "direction": "fwd", "us": 30.0,
             "gpu_us": 3.0, "ours_x": 3.0, "ours_gpu_x": 1.5, "meets_goal": True}]
    per = report.peers_summary({"rows": rows, "env": _env()})
    assert per["accelerated_scan"]["gpu_ours"] == 0 and per["accelerated_scan"]["wall_ours"] == 1
    assert per["accelerated_scan"]["losses"] == ["B1-T8-D4 fwd (2.00x as fast)"]
    assert report.paired_ratio(rows, "accelerated_scan (B,T,D)", "accelerated_scan", "gpu_us") == (3.0, 1)
    goals = report.chapter_goals(peers={"rows": rows})
    assert [(g["met"], g["judged"], g["all_met"]) for g in goals] == [(1, 2, "NO")]


def test_listing_caps_long_lists():
    assert report.listing([]) == "none"
    assert report.listing(["a", "b", "c"], limit=2) == "a; b; and 1 more (see the table)"


def test_ratios_near_a_threshold_keep_a_third_decimal():
    assert [report.times(x) for x in (0.999, 1.0, 1.5, 1.996, 2.004, 16.5)] == \
        ["0.999", "1.00", "1.50", "1.996", "2.004", "16.50"]


def test_peers_losses_list_the_largest_first():
    rows = [{"competitor": "accelerated_scan", "B": 1, "T": T, "D": 4, "direction": "fwd", "us": 20.0,
             "gpu_us": 1.0, "ours_x": 2.0, "ours_gpu_x": x, "meets_goal": False}
            for T, x in ((8, 0.8), (16, 0.25), (32, 0.5))]
    per = report.peers_summary({"rows": rows, "env": _env()})
    assert per["accelerated_scan"]["losses"] == ["B1-T16-D4 fwd (4.00x as fast)", "B1-T32-D4 fwd (2.00x as fast)",
                                                 "B1-T8-D4 fwd (1.25x as fast)"]
