"""`python -m mingru.reproduce`: argument handling, the notebooks' shared contract, and the CPU smoke path."""
import json
import os

import pytest

from mingru import reproduce

NOTEBOOKS = sorted(reproduce.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("text", ["4", "04", "04_speedups"])
def test_chapter_names(text):
    assert reproduce.chapter_key(text) == "04"


@pytest.mark.parametrize("text", ["9", "00", "abc", "04_memory", ""])
def test_bad_chapter_is_a_clear_usage_error(text, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main([text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown chapter {text!r}" in err and "04 (04_speedups)" in err


def test_every_notebook_is_a_chapter_and_every_harness_has_one():
    assert list(reproduce.chapters().values()) == [p.stem for p in NOTEBOOKS]
    from mingru.bench import HARNESSES
    assert set(reproduce.HARNESSES) == set(HARNESSES)
    assert {chapter for chapter, _ in reproduce.HARNESSES.values()} <= set(reproduce.chapters())


def test_the_measuring_and_notebook_budgets_fit_eight_minutes():
    """The sweeps' and notebooks' budgets alone fit the eight minutes; the cold compile pool comes on top
    (its budget is printed with the plan, and reproduce.json records what it took)."""
    steps = reproduce.plan(list(reproduce.HARNESSES), list(reproduce.chapters().values()))
    assert not any(label == "compile ahead" for label, _ in steps)
    assert sum(budget for _, budget in steps) <= 480 - 30  # the rest: process start, imports, the env record
    with_pool = reproduce.plan(list(reproduce.HARNESSES), list(reproduce.chapters().values()), compile_first=True)
    assert with_pool[0] == ("compile ahead", reproduce.COMPILE_BUDGET_S) and with_pool[1:] == steps


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_contract(path):
    """Kernel python3, and exactly one `parameters` cell that declares what reproduce passes."""
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1
    source = "".join(tagged[0]["source"])
    for name in ("SMOKE", "RESULTS_DIR", "DEVICE", "MEASURE"):
        assert f"{name} =" in source
    assert "widgets" not in nb["metadata"]


def test_smoke_path_runs_chapter_01(tmp_path, capsys):
    pytest.importorskip("papermill")
    committed = (reproduce.NOTEBOOKS / "01_monoid.ipynb").read_text()
    assert reproduce.main(["01", "--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("reproduce: 1 steps, budget")  # the plan comes first
    assert "== notebook 01_monoid: ok in" in out
    assert "nothing in this chapter needs a GPU" in out
    record = json.loads((tmp_path / "results" / "reproduce.json").read_text())
    assert record["smoke"] is True
    assert [s["step"] for s in record["steps"]] == ["notebook 01_monoid"] and record["steps"][0]["ok"]
    assert record["total_s"] >= record["steps"][0]["seconds"] and record["triton_cache"] in ("cold", "warm")
    assert len(record["git_commit"]) == 40
    executed = json.loads((tmp_path / "notebooks" / "01_monoid.ipynb").read_text())
    injected = [c for c in executed["cells"] if "injected-parameters" in c["metadata"].get("tags", [])]
    assert "SMOKE = True" in "".join(injected[0]["source"])
    outputs = [o for c in executed["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert outputs and not [o for o in outputs if o["output_type"] == "error"]
    assert (reproduce.NOTEBOOKS / "01_monoid.ipynb").read_text() == committed, "smoke runs never write in place"


def test_a_failed_step_is_reported_and_sets_the_exit_code(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("cell 3 raised ZeroDivisionError")
    monkeypatch.setattr(reproduce, "run_notebook", broken)
    assert reproduce.main(["02", "--smoke", "--no-measure", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "== notebook 02_kernel_layout: FAILED" in captured.out and "ZeroDivisionError" in captured.out
    assert "1 step(s) failed: notebook 02_kernel_layout" in captured.err
    assert json.loads((tmp_path / "results" / "reproduce.json").read_text())["complete"] is False


def test_the_record_is_written_after_each_harness(tmp_path, monkeypatch):
    """A run stopped from outside still leaves the times of the steps it finished (complete: false)."""
    seen = []
    monkeypatch.setattr(reproduce, "run_harness", lambda name, smoke, results_dir, env, budget: None)
    monkeypatch.setattr(reproduce, "run_notebook", lambda key, smoke, out, kernel, results_dir, timeout=None:
                        seen.append(json.loads((results_dir / "reproduce.json").read_text())))
    assert reproduce.main(["03", "--smoke", "--out", str(tmp_path)]) == 0
    assert seen and seen[0]["complete"] is False
    assert [s["step"] for s in seen[0]["steps"]] == ["bench precision"]
    final = json.loads((tmp_path / "results" / "reproduce.json").read_text())
    assert final["complete"] is True
    # the figures are drawn beside the notebooks, after the harnesses
    assert [s["step"] for s in final["steps"]][0] == "bench precision"
    assert {s["step"] for s in final["steps"][1:]} == {"figures", "notebook 03_tf32_ieee_guard"}


def test_an_isolated_harness_runs_in_a_child_and_its_failure_comes_back(tmp_path):
    """peers runs other projects' kernels in a spawned child: its error is raised here, in the parent,
    which stays usable (a CUDA fault in the child would leave this process's context alone)."""
    assert "peers" in reproduce.ISOLATED
    blocker = tmp_path / "results"
    blocker.write_text("a file where the results folder should be")
    env = {"device": "cpu", "smoke": True, "gpu": None}
    with pytest.raises(FileExistsError):  # raised in the child, where the harness writes its files
        reproduce.run_harness("peers", True, blocker, env, 1)
    assert blocker.read_text().startswith("a file")


def _fake_papermill(tmp_path, monkeypatch, replies):
    """Point run_notebook at a copy of chapter 01 and answer its papermill calls from `replies`:
    (returncode, stderr) each; a successful reply writes the partial notebook, as papermill would."""
    import shutil
    import subprocess
    import nbformat
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    shutil.copy(NOTEBOOKS[0], notebooks / NOTEBOOKS[0].name)
    monkeypatch.setattr(reproduce, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        code, err = replies[len(calls) - 1]
        source, partial = tmp_path / cmd[3], tmp_path / cmd[4]
        nb = nbformat.read(source, as_version=nbformat.NO_CONVERT)
        for cell in nb.cells:  # papermill clears the outputs first, then runs the cells
            if cell.cell_type == "code":
                cell.outputs = [] if code else [nbformat.v4.new_output("stream", text="ran\n")]
        nb.metadata.papermill = {"output_path": cmd[4]}
        nbformat.write(nb, partial)
        return subprocess.CompletedProcess(cmd, code, "", err)
    monkeypatch.setattr(reproduce.subprocess, "run", run)
    return notebooks / NOTEBOOKS[0].name, calls


def test_a_failed_in_place_run_leaves_the_notebook_as_it_was(tmp_path, monkeypatch):
    chapter, calls = _fake_papermill(tmp_path, monkeypatch, [(1, "ZeroDivisionError in cell 3")])
    before = chapter.read_text()
    with pytest.raises(RuntimeError, match="keeps its earlier outputs"):
        reproduce.run_notebook("01", False, tmp_path / "out", "python3", tmp_path)
    assert len(calls) == 1, "a failure inside a cell is not retried"
    assert chapter.read_text() == before


def test_a_kernel_that_dies_at_start_up_is_started_again(tmp_path, monkeypatch, capsys):
    died = (1, f"RuntimeError: {reproduce.KERNEL_START_FAILURE}")
    chapter, calls = _fake_papermill(tmp_path, monkeypatch, [died, died, (0, "")])
    assert reproduce.run_notebook("01", False, tmp_path / "out", "python3", tmp_path) == chapter
    assert len(calls) == 3 and "starting it again (2 of 3)" in capsys.readouterr().out
    import nbformat
    executed = nbformat.read(chapter, as_version=nbformat.NO_CONVERT)
    assert executed.metadata.papermill.output_path == f"notebooks/{chapter.name}"
    assert any(c.outputs for c in executed.cells if c.cell_type == "code")
    assert not list(chapter.parent.glob(".*.partial.ipynb"))


def test_a_kernel_that_keeps_dying_fails_after_the_last_try(tmp_path, monkeypatch):
    died = (1, f"RuntimeError: {reproduce.KERNEL_START_FAILURE}")
    chapter, calls = _fake_papermill(tmp_path, monkeypatch, [died] * reproduce.KERNEL_START_TRIES)
    before = chapter.read_text()
    with pytest.raises(RuntimeError, match="papermill exited with 1"):
        reproduce.run_notebook("01", False, tmp_path / "out", "python3", tmp_path)
    assert len(calls) == reproduce.KERNEL_START_TRIES and chapter.read_text() == before


def test_the_triton_cache_folder_is_pinned_for_the_run(monkeypatch, tmp_path):
    """inductor points an unset TRITON_CACHE_DIR at its own folder when it first compiles, which would
    hide the compile pool's kernels from the main process: a run pins the folder first, keeping a
    folder the user chose."""
    from mingru.bench import warm
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    default = str(tmp_path / ".triton" / "cache")
    assert warm.pin_triton_cache() == default and os.environ["TRITON_CACHE_DIR"] == default
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert warm.pin_triton_cache() == str(tmp_path / "mine")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    reproduce.triton_cache_state()
    assert os.environ["TRITON_CACHE_DIR"] == default


def test_cases_left_out_by_a_budget_make_the_run_incomplete(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reproduce, "run_harness", lambda name, smoke, results_dir, env, budget: None)
    monkeypatch.setattr(reproduce, "run_notebook", lambda *args, **kw: None)
    monkeypatch.setattr(reproduce, "left_out", lambda name: 2)
    assert reproduce.main(["03", "--smoke", "--out", str(tmp_path)]) == 0
    assert "bench precision 2" in capsys.readouterr().out
    final = json.loads((tmp_path / "results" / "reproduce.json").read_text())
    assert final["complete"] is False and final["steps"][0]["left_out"] == 2


def test_budget_scale_multiplies_every_harness_budget(tmp_path, monkeypatch, capsys):
    got = {}
    monkeypatch.setattr(reproduce, "has_gpu", lambda: True)  # the GPU path, without its measuring
    monkeypatch.setattr(reproduce, "compile_ahead", lambda *args: None)
    monkeypatch.setattr(reproduce, "start_children", lambda names: None)
    monkeypatch.setattr(reproduce, "run_harness", lambda name, smoke, results_dir, env, budget: got.update({name: budget}))
    monkeypatch.setattr(reproduce, "run_notebook", lambda *args, **kw: None)
    monkeypatch.setattr(reproduce, "RESULTS", tmp_path)
    monkeypatch.setattr(reproduce, "write_record", lambda *args, **kw: None)
    from mingru.bench import env as environment
    monkeypatch.setattr(environment, "environment", lambda *args, **kw: {})
    assert reproduce.main(["03", "--budget-scale", "2.5"]) == 0
    assert got == {"precision": round(2.5 * reproduce.HARNESSES["precision"][1])}
    assert "harnesses' budgets x 2.5" in capsys.readouterr().out
    steps = reproduce.plan(["seed"], [], budget_scale=3)
    assert steps[0] == ("bench seed", 3 * reproduce.HARNESSES["seed"][1])


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "two"])
def test_budget_scale_must_be_a_positive_number(bad, capsys):
    with pytest.raises(SystemExit):
        reproduce.parse_args(["--budget-scale", bad])
    assert "--budget-scale: expected a positive number" in capsys.readouterr().err


def test_chapter_kernels_share_the_cores_unless_the_caller_chose(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(reproduce.os, "cpu_count", lambda: 4 * (reproduce.NOTEBOOK_WORKERS + 1))
    assert reproduce.kernel_env()["OMP_NUM_THREADS"] == "4"
    monkeypatch.setattr(reproduce.os, "cpu_count", lambda: 2)
    assert reproduce.kernel_env()["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert reproduce.kernel_env()["OMP_NUM_THREADS"] == "3"
