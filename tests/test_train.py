"""mingru.train: the selective-copy task, TinyLM's step/chunk agreement, and the seeded loop."""
import os

import pytest
import torch

from mingru import train as tr

TASK = tr.SelectiveCopy(seq_len=8, n_data=2, vocab=6)


def test_selective_copy_places_the_data_before_the_markers():
    inputs, targets = TASK.batch(5, torch.Generator().manual_seed(1))
    assert inputs.shape == targets.shape == (5, TASK.length)
    head, tail = inputs[:, :TASK.seq_len], inputs[:, TASK.seq_len:]
    assert (tail == tr.MARKER).all()
    assert ((head != tr.NOISE).sum(1) == TASK.n_data).all()
    # the targets are the data tokens in their order of appearance, and nothing else
    assert (head[head != tr.NOISE].view(5, TASK.n_data) == targets[:, TASK.seq_len:]).all()
    assert (targets[:, :TASK.seq_len] == tr.IGNORE).all()
    again = TASK.batch(5, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], inputs)


@pytest.mark.parametrize("kwargs, match", [(dict(vocab=2), "vocab"), (dict(n_data=9), "n_data")])
def test_selective_copy_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tr.SelectiveCopy(**{**dict(seq_len=8, n_data=2, vocab=6), **kwargs})


@pytest.mark.parametrize("mixer", ["log", "signed", "givens", "delta"])
def test_step_decoding_and_chunks_equal_forward(mixer, eager_mode):
    kwargs = dict(block_size=4, rounds=2) if mixer == "givens" else None
    model = tr.build(TASK, 0, d_model=8, n_layers=2, mixer=mixer, mixer_kwargs=kwargs).double()
    tokens = TASK.batch(3, torch.Generator().manual_seed(2))[0]
    with torch.no_grad():
        full, state = model(tokens)
        stepped, step_state = tr.decode(model, tokens)
        chunked, _ = tr.forward_chunks(model, tokens, chunk=3)
    torch.testing.assert_close(stepped, full)
    torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(step_state[-1], state[-1].reshape_as(step_state[-1]))


def test_build_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    a, b = tr.build(TASK, 3, d_model=8), tr.build(TASK, 3, d_model=8)
    assert torch.equal(torch.rand(1), before)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    c = tr.build(TASK, 4, d_model=8)
    assert not torch.equal(a.head.weight, c.head.weight)


def test_train_is_reproducible_and_tbptt_sees_the_same_first_loss(eager_mode):
    runs = [tr.train(tr.build(TASK, 0, d_model=8, n_layers=1), TASK, steps=3, batch=4, seed=7, tbptt=t)
            for t in (None, None, TASK.length, 4)]
    assert runs[0].losses == runs[1].losses == runs[2].losses
    # chained state gives the same forward, so the first loss agrees; later steps differ by the gradient
    assert runs[3].losses[0] == pytest.approx(runs[0].losses[0], rel=1e-6)
    assert runs[3].losses[1:] != runs[0].losses[1:]
    assert runs[0].tokens_per_s > 0 and 0 <= runs[0].accuracy <= 1


def test_triton_training_matches_eager():
    pytest.importorskip("triton")
    runs = {mode: tr.train(tr.build(TASK, 0, d_model=8, n_layers=1), TASK, steps=3, batch=2, scan=mode)
            for mode in ("eager", "triton")}
    torch.testing.assert_close(runs["triton"].losses, runs["eager"].losses, rtol=1e-5, atol=1e-6)


def test_train_restores_the_scan_mode(monkeypatch):
    monkeypatch.setenv("MINGRU_SCAN", "auto")
    tr.train(tr.build(TASK, 0, d_model=8, n_layers=1), TASK, steps=2, batch=2, scan="eager")
    assert os.environ["MINGRU_SCAN"] == "auto"


def test_forward_chunks_and_train_reject_bad_arguments():
    model = tr.build(TASK, 0, d_model=8, n_layers=1)
    with pytest.raises(ValueError, match="chunk"):
        tr.forward_chunks(model, torch.zeros(1, 4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="steps"):
        tr.train(model, TASK, steps=1, batch=2)


def test_the_compile_pool_warms_the_runs_the_chapter_trains(monkeypatch):
    """warm_run builds what chapter 7 builds for each of its runs (the sizes come from tr.demo, which
    the notebook reads too) and trains it two steps; demo_runs' cases pickle for spawned workers."""
    import pickle
    seen = []
    monkeypatch.setattr(tr, "demo", lambda on_gpu: tr.Demo(tr.SelectiveCopy(seq_len=8, n_data=2, vocab=6),
                                                            dict(d_model=8, n_layers=1), 2, 3,
                                                            dict(d_model=16, n_layers=1), 1, 3))
    monkeypatch.setattr(tr, "train", lambda net, task, steps, batch, scan=None, tbptt=None: seen.append(
        (net, steps, batch, scan, tbptt)))
    runs = tr.demo_runs("cpu")
    assert pickle.loads(pickle.dumps(runs)) == runs and runs[0][0] == "compiled"
    for case in runs:
        tr.warm_run(*case)
    by_kind = dict(zip([(k, a) for k, a, _ in runs], seen))
    mixers = {a: type(by_kind[("mixer", a)][0].stack.blocks[0].mingru).__name__ for a in tr.DEMO_MIXERS}
    assert mixers == {"log": "MinGRU", "signed": "SignedMinGRU", "rotation": "RotationMinGRU",
                      "givens": "GivensMinGRU", "delta": "DeltaMinGRU"}
    assert by_kind[("givens", False)][0].stack.blocks[0].mingru.fused is False
    assert by_kind[("givens", True)][2:4] == (1, "triton")  # kernel batch, through the kernels
    assert next(by_kind[("bfloat16", None)][0].parameters()).dtype == torch.bfloat16
    assert by_kind[("tbptt", None)][4] == tr.demo(True).chunk
    assert by_kind[("compiled", None)][3] == "triton" and hasattr(by_kind[("compiled", None)][0], "_orig_mod")
    assert all(steps == 2 for _, steps, *_ in seen)
