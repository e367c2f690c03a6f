"""Sequence parallelism against one process: gloo on CPU, spawned ranks, sub-groups of 2, 3 and 4.

Spawning is slow, so one spawn of 4 ranks runs every check: each rank computes the whole sequence
itself and compares its slice of the sharded result (outputs and every gradient) at the parity gates.
"""
import os

import pytest
import torch
import torch.distributed as dist

import mingru
from mingru import distributed, naive
from mingru.bench import parity, scaling
from mingru.bench.timing import scan_impl

OP_DIMS = {"linear_recurrence": dict(B=2, D=3, h0=True), "parallel_scan_log": dict(B=2, D=3),
           "gated_recurrence": dict(B=2, D=3),
           "matrix_recurrence": dict(B=2, n=2, k=2, v=2, h0=True),
           "rotation_recurrence": dict(B=1, n=2, k=4, L=2, h0=True)}
MIXERS = ("MinGRU", "SignedMinGRU", "RotationMinGRU", "GivensMinGRU[generic]")
MIXER_DIMS = dict(B=2, d=4, k=2, L=2)
LENGTHS = {2: 7, 3: 10, 4: 9}  # never a multiple of the world size


def _close(what, mine, whole, gate, normwise):
    atol, rtol = gate
    scale = whole.abs().max() if normwise else whole.abs()
    err = (mine.double() - whole.double()).abs()
    bad = err > atol + rtol * scale.double()
    assert not bad.any(), f"{what}: max |sharded - whole| = {err.max().item():.3g}"


def _check(name, dims, dtype, bounds, group):
    gate = parity.gate(name, dtype)
    for what, mine, whole in scaling.sharded_vs_whole(name, dims, dtype, bounds, group):
        grad = what != "out"
        _close(f"{name} {dtype} ranks={len(bounds)} {what}", mine, whole,
               gate["grad" if grad else "out"], grad and gate["grad_normwise"])


def _payloads(group):
    """Bytes each call hands to all_gather: equal to payload_bytes and the same for T = 4 and 40."""
    counted, gather = [], distributed._gather

    def counting(x, grp):
        counted.append(x.numel() * x.element_size())
        return gather(x, grp)
    distributed._gather = counting
    try:
        for T in (4, 40):
            torch.manual_seed(0)
            A = (0.3 * torch.randn(2, T, 3, 2, 2)).requires_grad_()
            X = torch.randn(2, T, 3, 2, 5, requires_grad=True)
            counted.clear()
            distributed.matrix_recurrence(A, X, group=group).sum().backward()
            want = distributed.payload_bytes("matrix_recurrence", A, X)
            assert counted == [8 * distributed.META_LEN, want["forward"] - 8 * distributed.META_LEN,
                               want["backward"]], (T, counted, want)
    finally:
        distributed._gather = gather


def _errors(rank, group):
    B = 2 if rank == 0 else 3
    with pytest.raises(ValueError, match="disagree on the shapes"):
        distributed.linear_recurrence(torch.rand(B, 3, 4), torch.rand(B, 3, 4), group=group)
    dtype = torch.float32 if rank == 0 else torch.float64
    with pytest.raises(ValueError, match="disagree on the dtype"):
        distributed.linear_recurrence(torch.rand(2, 3, 4, dtype=dtype), torch.rand(2, 3, 4, dtype=dtype),
                                      group=group)
    with pytest.raises(RuntimeError, match="no sequence-parallel form"):
        with distributed.sequence_parallel(group):
            import mingru
            mingru.linear_scan(torch.rand(2, 3, 4), torch.rand(2, 3, 4))


def _negative_gated_state(rank, group, bounds):
    """gated_recurrence from a negative h0 under slow gates: the carries stay negative on every rank."""
    g = torch.Generator().manual_seed(0)
    T = bounds[-1][1]
    k, cand = -4 + torch.randn(2, T, 3, generator=g), 2 * torch.randn(2, T, 3, generator=g)
    h0 = -1 - torch.rand(2, 3, generator=g)
    start, stop = bounds[rank]
    with distributed.sequence_parallel(group):
        mine = mingru.gated_recurrence(k[:, start:stop], cand[:, start:stop], h0)
    whole = naive.gated_recurrence_naive(k, cand, h0)[:, start:stop]
    torch.testing.assert_close(mine.double(), whole, atol=1e-5, rtol=1e-5)


def _worker(rank, world):
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    for size, group in groups.items():
        if rank >= size:
            continue
        T = LENGTHS[size]
        bounds = distributed.slices(T, size, weights=range(1, size + 1))
        with scan_impl("eager"):
            for name, dims in OP_DIMS.items():
                _check(name, {**dims, "T": T}, torch.float32, bounds, group)
                if size == 4:
                    _check(name, {**dims, "T": T}, torch.bfloat16, bounds, group)
            if size == 3:
                for name in MIXERS:
                    _check(name, {**MIXER_DIMS, "T": T}, torch.float32, bounds, group)
                _negative_gated_state(rank, group, bounds)
            if size == 4:
                _payloads(group)
        if size == 2:
            with scan_impl("triton"):
                for name, dims in OP_DIMS.items():
                    _check(name, {**dims, "T": 5}, torch.float32, [(0, 2), (2, 5)], group)
                _check("MinGRU", {**MIXER_DIMS, "T": 5}, torch.float32, [(0, 3), (3, 5)], group)
            _errors(rank, group)


def test_sharded_equals_one_process():
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    scaling.launch(_worker, 4)


def test_needs_an_initialized_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        with distributed.sequence_parallel():
            pass


def test_slices_cover_the_sequence_in_order():
    for T, world, weights in ((7, 2, None), (10, 3, (1, 2, 3)), (4, 4, (5, 1, 1, 1))):
        bounds = distributed.slices(T, world, weights)
        assert bounds[0][0] == 0 and bounds[-1][1] == T
        assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    with pytest.raises(ValueError, match="T >= world"):
        distributed.slices(2, 3)


def test_product_matches_a_loop():
    A = torch.randn(2, 5, 3, 2, 2, dtype=torch.float64)
    want = torch.eye(2, dtype=torch.float64).expand(2, 3, 2, 2)
    for t in range(5):
        want = A[:, t] @ want
    torch.testing.assert_close(distributed.product(A), want)


@pytest.mark.parametrize("name", list(OP_DIMS))
def test_simulated_last_rank_starts_from_the_carry(name, eager_mode):
    """As rank 1 of 2 whose rank 0 sent a copy of rank 1's own message, the carry is rank 1's own
    zero-state end state: the output is op(inputs, h0 = that state), and with no later rank the
    gradients are those of the op with that start state held fixed (it came from another rank)."""
    torch.manual_seed(0)
    args = [None if x is None else x.double() for x in scaling.cases.op_inputs(name, {**OP_DIMS[name], "T": 5})]
    op = getattr(scaling.cases.mingru, name)
    time_args = args[:-1] if name in scaling.H0_OPS else args
    if name == "parallel_scan_log":
        start = torch.full_like(args[1][:, :1], float("-inf"))
        end = op(args[0], torch.cat([start, args[1][:, 1:]], 1))[:, -1]
        want = lambda lc, lv: op(lc, torch.cat([end.log().unsqueeze(1), lv[:, 1:]], 1))  # noqa: E731
    else:
        end = op(*time_args, *([None] if name in scaling.H0_OPS else []))[:, -1]
        want = lambda *xs: op(*xs, end)  # noqa: E731
    group = distributed.Simulated(1, 2)
    sharded = lambda *xs: getattr(distributed, name)(*xs, *args[len(time_args):], group=group)  # noqa: E731
    inputs = [x.detach().requires_grad_() for x in time_args]
    out = sharded(*inputs)
    torch.testing.assert_close(out, want(*time_args))
    cot = torch.randn_like(out)
    expected = torch.autograd.grad(want(*inputs), inputs, cot)
    for got, exp in zip(torch.autograd.grad(out, inputs, cot), expected):
        torch.testing.assert_close(got, exp)
