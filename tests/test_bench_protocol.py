"""The measuring protocol's guarantees: no CPU run overwrites GPU results, budgets bound a sweep,
goals are judged from the data, the seed runs only in its own process, provenance counts commits."""
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from mingru.bench import layer, main, places, precision, progress, results, seed, seed_runner, timing, warm
from mingru.bench import refusal, run

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


@no_gpu
@pytest.mark.parametrize("what", ["precision", "seed", "layer", "speed,layer_cpu"])
def test_without_a_gpu_no_harness_writes_gpu_results(what, capsys):
    before = {p: p.stat().st_mtime for p in places.RESULTS.glob("*.json")}
    with pytest.raises(SystemExit):
        main([what])
    assert "need a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        run(what)
    assert {p: p.stat().st_mtime for p in places.RESULTS.glob("*.json")} == before


def test_quick_never_writes_into_results_and_defaults_to_scratch(capsys):
    with pytest.raises(SystemExit):
        main(["precision", "--quick", "--out", str(places.RESULTS)])
    assert "never writes into results/" in capsys.readouterr().err
    assert refusal(("precision",), True, places.SCRATCH, has_gpu=False) is None
    from mingru.bench import default_out
    assert default_out(True) == places.SCRATCH and default_out(False) == places.RESULTS
    assert default_out(False, has_gpu=False) == places.SCRATCH
    # the CPU column is a CPU measurement: a full run is valid anywhere, but only a GPU run writes results/
    assert refusal(("layer_cpu",), False, places.SCRATCH, has_gpu=False) is None
    assert "nothing writes into results/" in refusal(("layer_cpu",), False, places.RESULTS, has_gpu=False)
    assert refusal(("layer_cpu", "speed"), False, places.RESULTS, has_gpu=True) is None


def test_a_sweep_stops_at_its_budget_and_says_so():
    progress.BUDGETS["unit"] = 0.0
    try:
        seen = []
        for case in progress.Sweep("unit", range(5)):
            seen.append(case)
            import time
            time.sleep(0.001)
        assert seen == [0] and progress.SKIPPED["unit"] == 4
        assert progress.budget_note("unit").startswith("not measured: 4 cases")
        assert list(progress.Sweep("unit", range(3), budget=60)) == [0, 1, 2]
        assert progress.budget_note("unit") is None
    finally:
        progress.BUDGETS.pop("unit")


def test_compile_pool_runs_every_case_in_worker_processes(tmp_path):
    marks = [(str(tmp_path / f"m{i}"),) for i in range(4)]
    assert warm.warm("os:mkdir", [], 2) == 0.0
    assert warm.warm("os:mkdir", marks, 1) == 0.0  # no pool below two workers
    assert not any((tmp_path / f"m{i}").exists() for i in range(4))
    assert warm.warm("os:mkdir", marks, 2) > 0
    assert all((tmp_path / f"m{i}").is_dir() for i in range(4)) and "os:mkdir" not in warm.FAILED
    # a call that raises is counted, not hidden: its case then compiles in the sweep, one by one
    assert warm.warm("os:mkdir", marks[:3], 2) > 0  # they exist now: FileExistsError
    count, first = warm.FAILED["os:mkdir"]
    assert count == 3 and first.startswith("FileExistsError")


def test_default_workers_follow_the_device_and_the_environment(monkeypatch):
    monkeypatch.delenv(warm.WORKERS_ENV, raising=False)
    assert warm.default_workers("cpu") == 0
    assert 0 <= warm.default_workers("cuda") <= 16
    monkeypatch.setenv(warm.WORKERS_ENV, "3")
    assert warm.default_workers("cuda") == 3


def test_default_workers_share_the_gpus_memory(monkeypatch):
    monkeypatch.delenv(warm.WORKERS_ENV, raising=False)
    by_cores = max(0, min(16, os.cpu_count() or 2))
    for gib, cap in ((24, 4), (80, 13), (141, 23)):
        props = types.SimpleNamespace(total_memory=gib * 2**30)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, props=props: props)
        assert warm.default_workers("cuda") == min(by_cores, cap)


@pytest.mark.parametrize("seed_gpu, seed_wall, ours_peak, seed_peak, memory, expected", [
    (20.0, 20.0, None, None, False, True),     # 2x by GPU clock, faster by wall
    (19.0, 20.0, None, None, False, False),    # 1.9x by GPU clock
    (40.0, 9.0, None, None, False, False),     # slower by wall clock
    (40.0, 20.0, 5.0, 4.0, True, False),       # more memory than the seed
    (40.0, 20.0, 4.0, 4.0, True, True),
    (None, 20.0, None, None, False, None),     # not measured: no verdict
])
def test_seed_goal_is_judged_from_the_data(seed_gpu, seed_wall, ours_peak, seed_peak, memory, expected):
    mine = {"us": 10.0, "gpu_us": 10.0, "status": "ok", "peak_mb": ours_peak}
    theirs = {"us": seed_wall, "gpu_us": seed_gpu, "status": "ok", "peak_mb": seed_peak}
    row = seed.compare({}, mine, theirs, memory)
    assert row["meets_goal"] is expected


def test_seed_bound_is_the_least_bytes_at_copy_bandwidth():
    inputs = (torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bfloat16))  # 24 + 12 bytes in
    job = {"inputs": inputs, "want_out": (torch.ones(5), None)}           # 5 outputs of 2 bytes out
    for direction, least in (("fwd", 36 + 10), ("fwd+bwd", 3 * 36 + 2 * 10)):
        row = seed.bound({"dtype": "bfloat16", "direction": direction, "seed_gpu_us": 4.0}, job, copy_gbps=1.0)
        assert row["bound_gpu_us"] == pytest.approx(least / 1e3)
        assert row["x_bound"] == pytest.approx(4.0 / (least / 1e3))
    assert seed.bound({"dtype": "float32", "direction": "fwd", "seed_gpu_us": None}, job, 1.0)["x_bound"] is None


def test_seed_short_rows_say_what_they_fall_short_of():
    row = dict(op="matrix_affine_scan", dims="B1", dtype="float32", meets_goal=False, x_gpu=1.5, x_wall=1.2)
    rows = [dict(row, direction="fwd", x_bound=1.6), dict(row, direction="fwd+bwd", x_bound=2.5, x_wall=0.9),
            dict(row, direction="fwd", dtype="bfloat16", x_bound=None), dict(row, direction="fwd", meets_goal=True)]
    short = seed.summarize(rows, {})["notes"][-1]
    assert "B1 float32 fwd [GPU 1.50x < 2 (2x needs 125 % of copy bandwidth)]" in short
    assert "B1 float32 fwd+bwd [GPU 1.50x < 2 (2x needs 80 % of copy bandwidth); wall 0.90x < 1]" in short
    assert "B1 bfloat16 fwd [GPU 1.50x < 2]" in short and short.count("matrix_affine_scan") == 3


def test_missing_seed_means_not_measured(monkeypatch, tmp_path):
    monkeypatch.setattr(places, "SEED", tmp_path / "absent")
    got, why = seed.run_seed([], "cpu")
    assert got is None and why.startswith("not measured") and "make peers" in why


def test_seed_runner_refuses_when_mingru_is_not_the_seed(tmp_path):
    empty = tmp_path / "no-seed"
    empty.mkdir()
    done = subprocess.run([sys.executable, seed_runner.__file__, str(empty), "x", "y"], capture_output=True,
                          text=True, env={"PYTHONPATH": str(places.REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "not the seed" in done.stderr


def test_layer_goal_reads_lucidrains_rows():
    def row(name, gpu):
        return {"competitor": name, "B": 1, "T": 2, "d": 3, "gpu_us": gpu}
    rows = [row(layer.OURS, 10.0), row("lucidrains minGRU (compiled)", 12.0), row("lucidrains minGRU (eager)", 19.0)]
    assert layer.judge(rows) == ["B1-T2-d3"]  # eager is only 1.9x ours
    assert rows[0]["vs_lucidrains_compiled_x"] == pytest.approx(1.2) and rows[0]["meets_goal"] is False
    rows[2]["gpu_us"] = 20.0
    assert layer.judge(rows) == [] and rows[0]["meets_goal"] is True


def test_provenance_counts_the_commits_between(tmp_path):
    git = lambda *a: subprocess.run(["git", *a], cwd=places.REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    head = git("rev-parse", "HEAD")
    # a commit with one parent, so that its parent is exactly one commit behind it (HEAD may be a merge)
    child = git("rev-list", "--no-merges", "-n", "1", "HEAD")
    parent = git("rev-parse", f"{child}~1")
    assert results.commits_between(head) == 0 and results.commits_between(child, head=child) == 0
    assert results.commits_between(parent, head=child) == 1
    assert "1 commit(s) after" in results.provenance({"git_commit": parent, "gpu": "G", "date": "d"}, head=child)
    assert "not in this clone" in results.provenance({"git_commit": "f" * 40, "gpu": "G", "date": "d"})
    assert results.provenance({"gpu": "G", "cpu": "C", "date": "d"}, cpu=True).startswith("measured on the CPU (C) of the G machine")
    (tmp_path / "x.json").write_text(json.dumps({"env": {"git_commit": head, "gpu": "G", "date": "d"}, "rows": []}))
    assert results.load("x", tmp_path, quiet=True)["rows"] == []
    assert results.load("absent", tmp_path) is None


def test_precision_is_a_harness_with_a_figure():
    assert precision.NAME == "precision" and callable(precision.measure) and callable(precision.summarize)


def test_tolerance_ratio_agrees_with_within():
    """The parity figure plots error / tolerance: ratio <= 1 must be exactly the gate within() applies."""
    from mingru.bench.timing import tolerance_ratio, within
    torch.manual_seed(0)
    want = (torch.randn(50), torch.randn(3, 4))
    for scale in (1e-7, 1e-5, 1e-3, 1e-1):
        got = tuple(w + scale * torch.randn_like(w) for w in want)
        for normwise in (False, True):
            ratio = tolerance_ratio(got, want, 1e-5, 1e-4, normwise)
            assert (ratio <= 1) == within(got, want, 1e-5, 1e-4, normwise), (scale, normwise, ratio)


@pytest.mark.parametrize("name", ["speed", "parity", "layer", "peers", "precision", "seed", "memory"])
def test_compile_plans_name_an_importable_target_and_pickle(name):
    """The compile pool spawns workers: each harness's plan names a function its workers can import,
    and every case it hands them must pickle (a lambda builder did not)."""
    import importlib
    import pickle

    module = importlib.import_module(f"mingru.bench.{name}")
    env = {"triton_interpret": False, "smoke": False, "device": "cuda"}
    plans = module.compile_plan(torch.device("cuda"), False, env)
    assert plans
    for target, cases_ in plans:
        mod, _, fn = target.partition(":")
        assert callable(getattr(importlib.import_module(mod), fn))
        assert cases_ or name == "peers" or target.endswith("warm_seed")  # none without the unpacked peers
        assert all(pickle.loads(pickle.dumps(c)) == c for c in cases_)


def test_one_pool_for_several_harnesses_marks_their_targets_done(tmp_path):
    plans = [("os:mkdir", [(str(tmp_path / "a"),), (str(tmp_path / "b"),)]),
             ("os:makedirs", [(str(tmp_path / "c" / "d"),)])]
    try:
        assert warm.warm_all(plans, 1) == 0.0 and not warm.DONE
        assert warm.warm_all(plans, 2) > 0
        assert all((tmp_path / p).is_dir() for p in ("a", "b", "c/d"))
        assert warm.DONE == {"os:mkdir", "os:makedirs"}
        # a harness's own pool is then skipped
        assert warm.warm("os:mkdir", [(str(tmp_path / "e"),), (str(tmp_path / "f"),)], 2) == 0.0
        assert not (tmp_path / "e").exists()
    finally:
        warm.DONE.clear()


def test_compile_ahead_runs_the_harnesses_plans_in_one_pool(monkeypatch):
    """compile_ahead on the CPU smoke path: precision's cases run in two workers (through the
    interpreter), the CPU-only harness contributes nothing, and the target is then marked done."""
    from mingru import bench
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env = {"triton_interpret": True, "smoke": True, "device": "cpu"}
    try:
        assert bench.compile_ahead(["precision", "layer_cpu"], quick=True, env=env, workers=0) == 0.0
        assert bench.compile_ahead(["precision", "layer_cpu"], quick=True, env=env, workers=2) > 0
        assert warm.DONE == {"mingru.bench.precision:errors", "mingru.bench.precision:delta_errors"}
    finally:
        warm.DONE.clear()


def test_parity_mixer_rows_gate_outputs_normwise_and_measure_both_paths_against_float64():
    from mingru.bench import parity
    assert parity.gate("GivensMinGRU[fused]", torch.float32)["out_normwise"]
    assert not parity.gate("linear_scan", torch.float32)["out_normwise"]
    row = parity.check("GivensMinGRU[fused]", dict(B=1, T=3, d=4, k=2, L=1), torch.float32, torch.device("cpu"))
    assert row["status"] == "ok" and row["pass"] is True, row
    assert row["out_gate"].endswith("normwise")
    assert 0 < row["eager_vs_f64"] < 1e-5 and 0 < row["triton_vs_f64"] < 1e-5


def test_reps_zero_checks_without_timing():
    want = ((torch.ones(3),), ())
    calls = []
    got = timing.check_then_time(lambda: ((torch.ones(3),), ()), want, timing.gate((0, 0), (0, 0)),
                                 lambda: calls.append(1), "cpu", reps=0)
    assert got == {"us": None, "gpu_us": None, "err": 0.0, "status": "ok"} and not calls
    bad = timing.check_then_time(lambda: ((2 * torch.ones(3),), ()), want, timing.gate((0, 0), (0, 0)),
                                 lambda: calls.append(1), "cpu", reps=0)
    assert bad["status"].startswith("wrong") and not calls


def test_peers_delta_rows_check_ours_in_bfloat16_against_float64():
    from mingru.bench import peers
    entry = peers.delta_competitors()["mingru.delta_rule_chunked"]
    rows = peers.race_delta("mingru.delta_rule_chunked", entry, 1, 9, 2, 4, torch.device("cpu"), True, True)
    assert [r["direction"] for r in rows] == ["fwd", "fwd+bwd"]
    assert all(r["status"] == "ok" and r["dtype"] == "bfloat16" and r["D"] == 8 and 0 < r["err"] for r in rows)
    names = {(n, delta) for n, _, delta in peers._todo(False, lambda name: True)}
    assert ("fla.chunk_delta_rule", True) in names and ("accelerated_scan", False) in names


def test_pools_record_worker_seconds_per_target(tmp_path):
    plans = [("os:mkdir", [(str(tmp_path / "a"),), (str(tmp_path / "b"),)]), ("time:sleep", [(0.2,)])]
    warm.SPENT.clear()
    try:
        warm.warm_all(plans, 2)
        assert set(warm.SPENT) == {"os:mkdir", "time:sleep"} and warm.SPENT["time:sleep"] >= 0.2
    finally:
        warm.DONE.clear()
        warm.SPENT.clear()


def test_compile_ahead_deals_the_longest_kinds_of_call_first(monkeypatch):
    """The pool hands out calls in plan order: the peers' autotuning, inductor compiles and the seed's
    processes go before the many short kernel checks, whatever order the harnesses were named in, and
    our side of the seed's cases (kernels the others compile too) goes last."""
    from mingru import bench
    got = []
    monkeypatch.setattr(warm, "warm_all", lambda plans, workers: got.extend(t for t, _ in plans) or 1.0)
    env = {"triton_interpret": True, "smoke": True, "device": "cpu"}
    extra = [("mingru.train:warm_run", [("mixer", "log", "cpu")])]
    bench.compile_ahead(["parity", "memory", "precision", "seed", "layer", "peers"], quick=True, env=env, workers=2,
                        extra=extra)
    assert got[:4] == ["mingru.bench.peers:warm_race", "mingru.train:warm_run", "mingru.bench.layer:step_row",
                       "mingru.bench.seed:warm_seed"]
    assert got[-2:] == ["mingru.bench.parity:compile_case", "mingru.bench.seed:warm_ours"]
    assert got.index("mingru.bench.precision:errors") < got.index("mingru.bench.memory:compile_case")


def test_accelerated_scan_runs_as_published_with_room_for_its_backward_read():
    from mingru.bench import peers
    places.peer_on_path("accelerated-scan")
    scalar = pytest.importorskip("accelerated_scan.scalar")
    ours = peers.competitors()["accelerated_scan"][0]
    for B, C, T in [(2, 3, 8), (1, 2, 5)]:
        f = torch.rand(B, C, T).requires_grad_()
        x = torch.randn(B, C, T).requires_grad_()
        a, b = ours(f, x), scalar.scan(f, x)
        g = torch.randn_like(a)
        assert torch.equal(a, b) and a.untyped_storage().nbytes() >= (a.numel() + peers.ACCELERATED_BLOCK) * 4
        for mine, theirs in zip(torch.autograd.grad(a, (f, x), g), torch.autograd.grad(b, (f, x), g)):
            assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="contiguous gates and tokens"):
        ours(torch.rand(1, 2, 4).transpose(1, 2), torch.rand(1, 4, 2))


def test_a_worker_whose_cuda_context_died_hands_its_calls_to_fresh_workers(tmp_path, capsys):
    # one worker: the CUDA error poisons it, so every later call must come back and run in a new pool
    fault = ("builtins:exec", ("raise RuntimeError('CUDA error: an illegal memory access was encountered')",))
    marks = [("os:mkdir", (str(tmp_path / f"m{i}"),)) for i in range(3)]
    for target in ("builtins:exec", "os:mkdir"):
        warm._forget(target)
    warm._pool([fault, *marks], 1)
    assert all((tmp_path / f"m{i}").is_dir() for i in range(3)) and "os:mkdir" not in warm.FAILED
    count, first = warm.FAILED["builtins:exec"]
    assert count == 1 and "CUDA error" in first
    assert "the 3 call(s) it handed back run in fresh workers" in capsys.readouterr().err
    # every pool poisoned: what is still unrun after the last one is a failure, not a silent gap
    warm._forget("os:mkdir")
    warm._pool([fault] * warm.POOL_ROUNDS + [("os:mkdir", (str(tmp_path / "late"),))], 1)
    assert warm.FAILED["os:mkdir"][0] == 1 and warm.FAILED["os:mkdir"][1].startswith("not run: CUDA errors")
    assert not (tmp_path / "late").exists() and warm.FAILED["builtins:exec"][0] == 1 + warm.POOL_ROUNDS


def test_the_wall_clock_times_a_loop_of_calls_between_synchronizations():
    calls, syncs = [], []
    leaf = torch.ones(2, requires_grad=True)

    def fn():  # each call must start with its gradient cleared
        calls.append(leaf.grad is None)
        leaf.grad = torch.ones(2)
        time.sleep(0.002)

    us = timing._loop_us(fn, [leaf], lambda: syncs.append(1))
    # a sleep of 2 ms per call; the bounds only catch a wrong unit or a lost division by the batch size
    assert 1500 < us < 20000 and all(calls)
    batch = max(1, int(timing.BATCH_S / 0.002))
    # each batch sits between two synchronizations: sizing, warm-up and three or more timed batches
    assert len(calls) >= 1 + 3 * batch and len(syncs) % 2 == 0 and len(syncs) >= 2 * 5
    assert timing.flushed_us(lambda: time.sleep(0.001), "cpu", reps=3) > 500  # on a CPU: median_us


def test_seed_and_ours_take_turns(monkeypatch, tmp_path):
    """The seed's runner starts a job only when its result is asked for: between two results it waits,
    so our side of a job is timed while the seed's process is idle."""
    fake = tmp_path / "fake-seed" / "mingru"
    fake.mkdir(parents=True)
    calls = tmp_path / "calls"
    (fake / "__init__.py").write_text(
        f"def linear_scan(*xs):\n    open({str(calls)!r}, 'a').write('call\\n')\n    return xs[0]\n")
    monkeypatch.setattr(places, "SEED", fake.parent)
    count = lambda: len(calls.read_text().splitlines()) if calls.exists() else 0  # noqa: E731
    jobs = [seed.op_job("linear_scan", {"B": 1, "T": 3, "D": 2}, "float32", "fwd", "cpu", 0) for _ in range(3)]
    results = seed.seed_results(jobs, "cpu")
    first = next(results)
    time.sleep(1.0)  # were the runner not waiting, it would run the next jobs meanwhile
    assert count() == 1 and first["status"].startswith("wrong")  # the stub returns its input, not the scan
    next(results)
    time.sleep(0.5)
    assert count() == 2 and seed.VERSION["seed"] == "unknown"
    results.close()
    assert count() == 2


def test_again_times_the_last_timed_step_once_more():
    x = torch.ones(3)
    step = lambda: x * 2  # noqa: E731
    got = timing.check_then_time(lambda: ((x * 2,), ()), ((x * 2,), ()), seed.TOLERANCE["float32"], step, "cpu",
                                 reps=3, gpu_time=False, rounds=3)
    assert got["status"] == "ok" and got["us"] > 0 and timing.again() > 0
    wrong = timing.check_then_time(lambda: ((x,), ()), ((x * 2,), ()), seed.TOLERANCE["float32"], step, "cpu",
                                   reps=3, gpu_time=False, rounds=3)
    assert wrong["status"].startswith("wrong") and timing.again() is None  # nothing timed: no round


def test_wall_rounds_alternate_and_take_each_sides_median(monkeypatch):
    order = []

    def theirs():  # seed_results between two jobs: each send("wall") answers one round
        ask = yield {"us": 20.0, "status": "ok"}
        for us in (30.0, 10.0):
            assert ask == "wall"
            order.append("seed")
            ask = yield us
    rounds = iter([50.0, 20.0])

    def ours_again():
        order.append("ours")
        return next(rounds)
    monkeypatch.setattr(timing, "again", ours_again)
    lockstep = theirs()
    seed_got, mine = next(lockstep), {"us": 40.0, "status": "ok"}
    seed.alternate_wall(lockstep, seed_got, mine, 3)
    assert order == ["seed", "ours", "seed", "ours"]
    assert seed_got["wall_rounds"] == [20.0, 30.0, 10.0] and seed_got["us"] == 20.0
    assert mine["wall_rounds"] == [40.0, 50.0, 20.0] and mine["us"] == 40.0
    failed = {"us": None, "status": "wrong"}
    seed.alternate_wall(theirs(), failed, {"us": None, "status": "wrong"}, 3)  # no first time: no rounds
    assert "wall_rounds" not in failed and order == ["seed", "ours", "seed", "ours"]


def test_the_seed_runner_answers_a_wall_round(monkeypatch, tmp_path):
    """After a job the runner times its step once more on `wall` (null when the job was not timed),
    and the lockstep generator hands the answer back from send("wall")."""
    fake = tmp_path / "fake-seed" / "mingru"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("def linear_scan(*xs):\n    return xs[0]\n")
    monkeypatch.setattr(places, "SEED", fake.parent)
    jobs = [{**seed.op_job("linear_scan", {"B": 1, "T": 3, "D": 2}, "float32", "fwd", "cpu", 1), "wall_rounds": 3}
            for _ in range(2)]
    results = seed.seed_results(jobs, "cpu")
    assert next(results)["status"].startswith("wrong")
    assert results.send("wall") is None  # the stub's answer is wrong: it was never timed
    assert next(results)["status"].startswith("wrong")  # the lockstep goes on to the next job
    results.close()
