"""The benchmark harness on CPU: each `--quick` subcommand end to end (eager + the Triton
interpreter), its JSON schema, Markdown and figures; and the checks that must catch a bad row."""
import json

import pytest
import torch

import mingru
from mingru.bench import HARNESSES, cases, layout, main, parity, peers, places, plots, report, speed
from mingru.bench.timing import scan_impl, within

ENV_KEYS = ("gpu", "driver", "cuda", "torch", "triton", "python", "git_commit", "git_dirty", "date",
            "copy_gbps", "copy_method", "smoke")
STATUS_PREFIXES = ("ok", "fallback:", "failed:", "wrong:", "skipped:", "not installed", "import failed:",
                   "compile ", "triton ", "not measured", "needs >= 2 GPUs")
NAMES = {"speed": "scan_bench", "roofline": "roofline", "memory": "scan_memory", "parity": "scan_parity",
         "peers": "peers", "layout": "kernel_layout", "precision": "precision", "seed": "seed", "layer": "layer",
         "layer_cpu": "layer_cpu", "scaling": "scaling"}
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU path")


@interpreted
@pytest.mark.parametrize("what", HARNESSES)
def test_quick_run_writes_json_markdown_and_figures(what, tmp_path, capsys):
    main([what, "--quick", "--out", str(tmp_path)])
    name = NAMES[what]
    data = json.loads((tmp_path / f"{name}.json").read_text())
    env = data["env"]
    assert set(ENV_KEYS) <= set(env) and env["smoke"] is True and env["copy_gbps"] > 0
    assert json.loads((tmp_path / "env.json").read_text())["git_commit"] == env["git_commit"]
    assert data["rows"], "a harness must write rows"
    for row in data["rows"]:
        for key in [k for k in row if k == "status" or k.endswith("_status")]:
            assert row[key].startswith(STATUS_PREFIXES), row
    if env["triton_interpret"]:
        assert not any(str(row.get("status")).startswith("skipped") for row in data["rows"])
    md = (tmp_path / f"{name}.md").read_text()
    assert report.env_line(env) in md and "smoke run" in md
    assert "| " + " | ".join(data["meta"]["columns"]) + " |" in md
    assert md.count("\n| ") == len(data["rows"]) + 1
    for figure in plots.FIGURES[name]:
        png = tmp_path / "figures" / f"{name}_{figure}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    CHECKS.get(what, lambda data: None)(data)
    assert str(tmp_path / f"{name}.json") in capsys.readouterr().out


def _speed(data):
    for row in data["rows"]:
        assert row["eager_us"] > 0
        if row["triton_us"] is not None:
            assert row["triton_x"] == pytest.approx(row["eager_us"] / row["triton_us"])
    assert {r["direction"] for r in data["rows"]} == {"fwd", "fwd+bwd"}


def _roofline(data):
    for row in data["rows"]:
        if row["status"] == "ok":
            assert row["gbps"] == pytest.approx(row["bytes"] / row["us"] / 1e3)
            assert row["pct_copy"] == pytest.approx(100 * row["gbps"] / data["env"]["copy_gbps"])


def _memory(data):
    assert {r["case"] for r in data["rows"]} >= {"lab", "vs-T"}
    for row in data["rows"]:
        if row["status"] == "ok":
            assert row["saved_mb"] > 0 and row["peak_mb"] is None  # no CUDA: no peak claimed


def _parity(data):
    summary = data["meta"]["summary"]
    assert summary["passed"] + summary["failed"] + summary["not_run"] == len(data["rows"])
    for row in data["rows"]:
        if row["status"] == "ok":  # the kernels ran: they must agree with eager within the gates
            assert row["pass"] is True, row


def _peers(data):
    assert {r["competitor"] for r in data["rows"]} == set(peers.competitors()) | set(peers.delta_competitors())
    assert all(r["status"] != "ok" or r["us"] > 0 for r in data["rows"])


def _seed(data):
    rows = data["rows"]
    assert {r["op"] for r in rows} >= {"linear_scan", "matrix_affine_scan", "MinGRU"}
    for row in rows:
        assert row["ours_status"] == "ok" and row["ours_us"] > 0, row
        if places.SEED.is_dir():
            assert row["seed_status"] == "ok" and row["seed_us"] > 0, row
            assert row["x_wall"] == pytest.approx(row["seed_us"] / row["ours_us"])
        else:
            assert row["seed_status"].startswith("not measured") and row["x_wall"] is None
        assert row["meets_goal"] is None  # no GPU clock on a CPU: the goal cannot be judged


def _layer(data):
    names = {r["competitor"] for r in data["rows"]}
    assert {"torch.nn.GRU (cuDNN)", "ours MinGRU (auto)", "ours MinGRU (compiled)", "seed MinGRU (auto)"} <= names
    assert all(r["us"] > 0 for r in data["rows"] if r["status"] == "ok")


def _layer_cpu(data):
    for row in data["rows"]:
        assert row["ours_status"] == "ok" and row["ours_ms"] > 0
        assert len(row["ours_wall_rounds"]) == 2  # --quick: two rounds, each side's median of them
        if row["seed_ms"]:
            assert row["meets_goal"] == (row["seed_ms"] >= row["ours_ms"])
            assert len(row["seed_wall_rounds"]) == 2


def _layout(data):
    ok = [r for r in data["rows"] if r["status"] == "ok"]
    assert {r["layout"] for r in ok} == set(layout.LAYOUTS)
    walk = [r for r in ok if r["layout"].startswith("sequential")]
    assert walk and all(r["chunk"] == 1 and r["segments"] == 1 for r in walk)
    assert set(data["meta"]["slopes"]) == set(layout.LAYOUTS)
    for row in ok:
        assert row["gbps"] == pytest.approx(4 * row["B"] * row["T"] * row["D"] * 4 / 1e9 / (row["us"] * 1e-6))


def test_layout_slope_is_the_cost_of_one_more_step():
    rows = [{"T": T, "us": 5.0 + 0.25 * T} for T in (16, 64, 256)]
    assert layout.slope(rows, "us") == pytest.approx(0.25)
    assert layout.slope(rows[:1], "us") is None


CHECKS = {"speed": _speed, "roofline": _roofline, "memory": _memory, "parity": _parity, "peers": _peers,
          "layout": _layout, "seed": _seed, "layer": _layer, "layer_cpu": _layer_cpu}


def test_full_parity_grid_covers_the_envelope_with_few_trivial_rows():
    rows = list(parity.grid(quick=False))
    kv = {(d["k"], d["v"]) for op, d, _ in rows if op == "matrix_affine_scan"}
    assert kv == {(k, v) for k in parity.BLOCKS for v in parity.BLOCKS}
    Ts = {d["T"] for _, d, _ in rows}
    assert 1 in Ts and any(T & (T - 1) for T in Ts)  # T = 1 and non-powers of two
    ops = {op for op, _, _ in rows}
    trivial = [op for op, d, _ in rows if d["T"] == 1]
    assert len(trivial) <= 2 * len(ops) + 2  # T = 1 once per op and dtype (+ linear_recurrence with h0)
    assert len(rows) < 400
    assert {op for op, _, _ in rows} == set(cases.OPS) | set(parity.MIXERS)
    wide = {(d["k"], d["v"]) for op, d, _ in rows if op == "matrix_recurrence" and d["k"] not in parity.BLOCKS}
    assert wide == {(k, v) for k in (32, 64) for v in (32, 64)}  # every pair the wide kernel takes
    scaled = {(d["k"], d["L"], dtype) for op, d, dtype in rows if op == "rotation_recurrence" and d.get("scale")}
    assert {(2, 1, torch.float32), (2, 1, torch.bfloat16)} <= scaled  # RotationMinGRU's transition
    assert {dtype for _, _, dtype in rows} == {torch.float32, torch.bfloat16}


def test_parity_row_fails_when_the_kernel_is_wrong(monkeypatch):
    """The gate must be able to fail: a 'kernel' off by 1e-4 is caught at float32."""
    def off_by_a_bit(a, b):
        A, Bc = mingru.scans.linear_scan(a, b)
        return A, Bc + 1e-4
    monkeypatch.setattr(mingru.dispatch, "triton_impl", lambda name: off_by_a_bit)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    row = parity.check("linear_scan", dict(B=2, T=9, D=3), torch.float32, torch.device("cpu"))
    assert row["status"] == "ok" and row["pass"] is False and row["out_err"] == pytest.approx(1e-4, rel=0.05)


def test_within_reads_none_as_a_zero_gradient():
    zero, one = torch.zeros(3), torch.ones(3)
    assert within((None,), (zero,), 0, 0) and within((zero,), (None,), 0, 0)
    assert not within((None,), (one,), 1e-3, 0) and not within((one,), (None,), 1e-3, 0)
    assert not within((torch.tensor([float("nan")]),), (zero[:1],), 1, 1)


def test_normwise_gate_scales_with_the_largest_entry_only_when_asked():
    want = torch.tensor([100.0, 0.01])
    got = want + torch.tensor([0.0, 0.5])  # small entry off by 0.5: 0.5% of the tensor's scale
    assert not within((got,), (want,), 0.05, 0.05)
    assert within((got,), (want,), 0.05, 0.05, normwise=True)
    assert not within((want + 6,), (want,), 0.05, 0.05, normwise=True)
    assert parity.gate("linear_scan", torch.bfloat16)["grad_normwise"]
    assert not parity.gate("linear_scan", torch.float32)["grad_normwise"]
    assert parity.gate("GivensMinGRU[fused]", torch.float32)["grad_normwise"]  # weight gradients sum B*T terms


def test_speed_reports_a_compile_failure_and_a_wrong_kernel_as_statuses(monkeypatch):
    def broken_compile(fn, **kwargs):
        def call(*args):
            raise RuntimeError("inductor exploded")
        return call
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(mingru.dispatch, "triton_impl", lambda name: lambda a, b, h0: mingru.scans.linear_recurrence(a, b, h0) * 2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dims = dict(B=1, T=4, D=3)
    rows = speed.measure_subject("linear_recurrence", dims, "lab", torch.device("cpu"), True,
                                 {"triton_interpret": True}, "eager")
    for row in rows:
        assert row["eager_us"] > 0 and row["compile_us"] is None and row["triton_us"] is None
        assert "compile failed: RuntimeError: inductor exploded" in row["status"]
        assert "triton wrong: max abs error" in row["status"] and "vs float64" in row["status"]
        assert row["triton_checked_against"] == "float64"  # wrong against eager, then against float64


def test_speed_judges_a_disagreement_with_eager_against_float64(monkeypatch):
    """Where eager float32 is the side off the exact answer, a kernel that matches float64 passes
    (and says so); the same kernel agreeing with eager is checked against eager only."""
    exact_scan = mingru.scans.linear_recurrence

    def eager_off_in_float32(a, b, h0):
        h = exact_scan(a, b, h0)
        return h + 1e-3 if h.dtype == torch.float32 else h
    monkeypatch.setattr(mingru.scans, "linear_recurrence", eager_off_in_float32)
    monkeypatch.setattr(mingru.dispatch, "triton_impl", lambda name: exact_scan)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = speed.measure_subject("linear_recurrence", dict(B=1, T=4, D=3), "lab", torch.device("cpu"), False,
                                 {"triton_interpret": True}, "eager")
    for row in rows:
        assert row["status"] == "ok" and row["triton_us"] > 0, row["status"]
        assert row["triton_checked_against"] == "float64" and row["triton_err"] < 1e-6
    monkeypatch.setattr(mingru.scans, "linear_recurrence", exact_scan)
    rows = speed.measure_subject("linear_recurrence", dict(B=1, T=4, D=3), "lab", torch.device("cpu"), False,
                                 {"triton_interpret": True}, "eager")
    assert all(row["triton_checked_against"] == "eager" and row["status"] == "ok" for row in rows)


def test_gpu_run_needs_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        main(["speed"])
    assert "--quick" in capsys.readouterr().err


def test_markdown_table_renders_every_kind_of_cell():
    rows = [{"op": "a|b", "us": 12.3456, "x": None, "pass": True},
            {"op": "c", "us": 1.5e-7, "pass": False, "extra": 3}]
    lines = report.table_markdown(rows).splitlines()
    assert lines[0] == "| op | us | x | pass | extra |"
    assert lines[1] == "|---|---|---|---|---|"
    assert lines[2] == "| a\\|b | 12.3 | — | pass | — |"
    assert lines[3] == "| c | 1.50e-07 | — | FAIL | 3 |"
    assert report.table_markdown([]) == "(no rows)\n"


def test_results_table_and_json_stay_standard(tmp_path):
    env = {"gpu": "Test GPU", "torch": "x", "triton": "y", "python": "z", "git_commit": "abc",
           "git_dirty": False, "date": "today", "copy_gbps": 1000.0, "smoke": False}
    report.write(tmp_path, "scan_parity", env, [{"op": "linear_scan", "out_err": float("nan")}],
                 {"columns": ["op", "out_err"], "notes": ["a note"]})
    data = json.loads((tmp_path / "scan_parity.json").read_text())  # no bare NaN in the file
    assert data["rows"][0]["out_err"] == "nan"
    md = plots.results_table("scan_parity", tmp_path)
    assert md.startswith("# Parity") and "Test GPU" in md and "- a note" in md
    assert "| linear_scan | nan |" in md


def test_scan_impl_sets_and_restores_the_mode(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "auto")
    with scan_impl("eager"):
        assert mingru.scan_mode() == "eager"
    assert mingru.scan_mode() == "auto"


@interpreted
def test_only_merges_into_an_existing_result(tmp_path):
    main(["peers", "--quick", "--out", str(tmp_path), "--only", "linear_recurrence"])
    first = json.loads((tmp_path / "peers.json").read_text())
    assert {r["competitor"] for r in first["rows"]} == {"mingru.linear_recurrence"}
    main(["peers", "--quick", "--out", str(tmp_path), "--only", "parallel_scan_log"])
    merged = json.loads((tmp_path / "peers.json").read_text())
    assert {r["competitor"] for r in merged["rows"]} == {"mingru.linear_recurrence", "mingru.parallel_scan_log"}
    assert merged["meta"]["merged_from"] == [first["env"]["date"]]


def test_unknown_harness_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["speed,sped", "--quick"])
    assert "unknown harness sped" in capsys.readouterr().err




def _faulty_peers(monkeypatch, error):
    """peers.competitors with a middle entry whose input preparation raises `error`, the others absent."""
    def prepare(g, x, h0):
        raise error
    entries = {"before": (None, None, (), None, "absent"), "faulty": (lambda *xs: xs[0], prepare, ("g",), None, None),
               "after": (None, None, (), None, "absent")}
    monkeypatch.setattr(peers, "competitors", lambda: entries)
    monkeypatch.setattr(peers, "delta_competitors", lambda: {})


def test_peers_keep_their_rows_after_a_cuda_error(monkeypatch):
    _faulty_peers(monkeypatch, RuntimeError("CUDA error: an illegal memory access was encountered"))
    rows = peers.measure(torch.device("cpu"), True, {"triton_interpret": True})
    status = {r["competitor"]: r["status"] for r in rows}
    assert len(rows) == 6 and status["before"] == "absent"
    assert status["faulty"].startswith("failed: RuntimeError: CUDA error: an illegal memory access")
    assert status["after"].startswith("not run: a CUDA error surfaced at faulty 1-8-4")
    assert peers.summarize(rows, {})["notes"][-1].endswith(": 2")


def test_peers_raise_other_errors(monkeypatch):
    _faulty_peers(monkeypatch, ValueError("a bug of ours"))
    with pytest.raises(ValueError, match="a bug of ours"):
        peers.measure(torch.device("cpu"), True, {"triton_interpret": True})
