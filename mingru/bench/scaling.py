"""Scaling: sequence parallelism over P ranks (mingru.distributed), measured and modelled.

With >= 2 visible GPUs: weak scaling (T per rank fixed) and strong scaling (total T fixed) of one
forward + backward over NCCL, time per token and bytes exchanged per rank. On any device: the cost
model of one rank, the local scan of T/P steps plus the fold of P simulated rank aggregates.
"""
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mingru import distributed
from mingru.bench import cases
from mingru.bench.parity import failure
from mingru.bench.progress import Sweep
from mingru.bench.timing import median_us

NAME, SUBJECT = "scaling", "subject"
SUBJECTS = ("MinGRU", "GivensMinGRU[fused]")
DIMS, QUICK_DIMS = dict(B=4, d=256), dict(B=1, d=4)
T_PER_RANK, QUICK_T_PER_RANK = 16384, 8
RANKS, QUICK_RANKS = (1, 2, 4, 8), (1, 2)
NEEDS = "needs >= 2 GPUs"
REPS = 15
METHOD = ("One forward + backward of a mixer whose input is sharded along T (sequence_parallel), "
          "float32, MINGRU_SCAN=auto (Triton on CUDA). multi-GPU rows: NCCL, one process per GPU, "
          "the slowest rank's median; weak: T_rank fixed, strong: T_total fixed; bytes_per_rank: what "
          "one rank hands to all_gather per step (metadata + aggregates + carry gradients). model "
          "rows (one device, no communication): local_us = the plain step on T_total/P steps, "
          "rank_us = that slice as the last of P simulated ranks (zero-state scan, fold, fix-up or "
          "rerun, both folds), model_speedup = local_us at P=1 / rank_us.")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, world, *args, backend="gloo"):
    """Run fn(rank, world, *args) in `world` spawned processes joined in one process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    mp.spawn(_entry, args=(world, backend, fn, args), nprocs=world, join=True)


def _entry(rank, world, backend, fn, args):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _subject(name, dims, dtype, device, seed):
    torch.manual_seed(seed)
    job = cases.make(name, dims, dtype, device)
    cot = torch.randn(cases.outputs(job.fn, job.inputs)[0].shape, dtype=dtype, device=device)
    return job.requiring_grad(), cot


H0_OPS = ("linear_recurrence", "gated_recurrence", "matrix_recurrence", "rotation_recurrence")


def _time_parts(name, inputs, start, stop):
    """Per input: its slice [start, stop) along T (log_values: one more, slot 0 first); h0: itself."""
    n_time = len(inputs) - (name in H0_OPS) if name in cases.OPS else len(inputs)
    extra = [int(name == "parallel_scan_log" and i == 1) for i in range(len(inputs))]
    return [x if i >= n_time or x is None else (start, stop + extra[i]) for i, x in enumerate(inputs)]


def sharded_vs_whole(name, dims, dtype, bounds, group=None, device="cpu", seed=0):
    """[(what, sharded, whole)] for subject `name`: its output and every gradient, this rank's part.

    The whole sequence runs in this process; the sharded call gets this rank's slice bounds[rank]
    inside sequence_parallel(group). Parameter gradients are summed over the group first; h0 and
    log_values' slot 0 belong to rank 0, whose copies elsewhere must get no gradient.
    """
    rank = dist.get_rank(group)
    start, stop = bounds[rank]
    whole, cot = _subject(name, dims, dtype, device, seed)
    out, grads = cases.forward_backward(whole, (cot,))
    part, _ = _subject(name, dims, dtype, device, seed)
    spans = _time_parts(name, part.inputs, start, stop)
    inputs = tuple(x if not isinstance(span, tuple) else x[:, span[0]:span[1]].detach().requires_grad_()
                   for x, span in zip(part.inputs, spans))
    part = cases.Job(name, part.fn, inputs, part.params)
    with distributed.sequence_parallel(group):
        mine, my_grads = cases.forward_backward(part, (cot[:, start:stop],))
    pairs = [("out", mine[0], out[0][:, start:stop])]
    leaf_spans = [span for x, span in zip(inputs, spans) if x is not None]
    for i, (span, g_mine, g_whole) in enumerate(zip(leaf_spans, my_grads, grads)):
        if not isinstance(span, tuple):  # h0
            if rank > 0:
                assert g_mine is None or not g_mine.any(), "h0 on a rank > 0 received a gradient"
                continue
        else:
            first = int(rank > 0 and span[1] - span[0] > stop - start)  # log_values' slot 0 off rank 0
            if first:
                assert not g_mine[:, 0].any(), "log_values slot 0 on a rank > 0 received a gradient"
            g_mine, g_whole = g_mine[:, first:], g_whole[:, span[0] + first:span[1]]
        pairs.append((f"grad {i}", g_mine, g_whole))
    for j, (g_mine, g_whole) in enumerate(zip(my_grads[len(leaf_spans):], grads[len(leaf_spans):])):
        # a learned h0 only reaches the scan on rank 0: elsewhere it gets no gradient (None)
        g_mine = torch.zeros_like(g_whole) if g_mine is None else g_mine.clone()
        dist.all_reduce(g_mine, group=group)
        pairs.append((f"param grad {j}", g_mine, g_whole))
    return pairs


def max_errors(pairs):
    return {what: (a.double() - b.double()).abs().max().item() for what, a, b in pairs}


def _demo_worker(rank, world, subjects, dims, path):
    bounds = distributed.slices(dims["T"], world, weights=range(1, world + 1))
    rows = []
    for name in subjects:
        errors = max_errors(sharded_vs_whole(name, dims, torch.float32, bounds))
        worst = torch.tensor(max(errors.values()))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rows.append({"subject": name, "ranks": world, "T": dims["T"], "slices": bounds,
                     "max_abs_diff": worst.item()})
    if rank == 0:
        torch.save(rows, path)


def demo(world=2, subjects=("MinGRU", "SignedMinGRU", "GivensMinGRU[fused]"), dims=None):
    """Sharded against one process on `world` gloo CPU ranks with uneven slices: one row per subject."""
    dims = dims or dict(B=2, T=11, d=8, k=4, L=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.pt")
        launch(_demo_worker, world, subjects, dims, path)
        return torch.load(path)


def _step(name, dims, device):
    job, cot = _subject(name, dims, torch.float32, device, 0)
    return lambda: cases.forward_backward(job, (cot,)), job.leaves


def model_rows(device, quick, keep):
    """Per P: the plain step on T_total/P steps, and the same slice run as the last of P simulated
    ranks (fix-up or rerun, both folds; the messages are copies, nothing is sent)."""
    dims, t_rank, ranks = (QUICK_DIMS, QUICK_T_PER_RANK, QUICK_RANKS) if quick else (DIMS, T_PER_RANK, RANKS)
    total = t_rank * max(ranks)
    todo = [(name, P) for name in SUBJECTS if keep(name) for P in ranks]
    rows = []
    for name, P in Sweep("scaling", todo, lambda c: f"{c[0]} P={c[1]}"):
        run_dims = {**dims, "T": total // P, **({"k": 4, "L": 2} if quick and "Givens" in name else {})}
        row = {"case": "model", "subject": name, "ranks": P, "T_total": total, "T_rank": total // P, **dims}
        try:
            step, leaves = _step(name, run_dims, device)
            local = median_us(step, device, grad_to_none=leaves)
            with distributed.sequence_parallel(distributed.Simulated(P - 1, P)):
                rank = median_us(step, device, grad_to_none=leaves)
            rows.append({**row, "local_us": local, "rank_us": rank,
                         "ns_per_token": 1e3 * rank / (dims["B"] * total), "status": "ok"})
        except Exception as exc:  # noqa: BLE001  (an out-of-memory becomes a row)
            rows.append({**row, "status": failure(exc)})
    one = {r["subject"]: r["local_us"] for r in rows if r.get("ranks") == 1 and r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok" and r["subject"] in one:
            r["model_speedup"] = one[r["subject"]] / r["rank_us"]
    return rows


def _collective_us(step, leaves, reps=REPS):
    """Median of `reps` timed steps, the same count on every rank (an adaptive rep count, as in
    median_us, could differ between ranks and leave a collective waiting)."""
    times = []
    for _ in range(reps):
        for x in leaves:
            x.grad = None
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]


def _scaling_worker(rank, world, name, dims, case, path):
    counted = []
    gather = distributed._gather

    def counting(x, group):
        counted.append(x.numel() * x.element_size())
        return gather(x, group)
    distributed._gather = counting
    device = torch.device("cuda", rank)
    T_rank = dims["T"] // world if case == "strong" else dims["T"]
    step, leaves = _step(name, {**dims, "T": T_rank}, device)
    with distributed.sequence_parallel():
        step()
        counted.clear()
        step()
        sent = sum(counted)
        us = torch.tensor(_collective_us(step, leaves), device=device)
    dist.all_reduce(us, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save({"time_us": us.item(), "T_rank": T_rank, "T_total": T_rank * world,
                    "bytes_per_rank": sent,
                    "ns_per_token": 1e3 * us.item() / (dims["B"] * T_rank * world)}, path)


def multi_gpu_rows(device, quick, keep):
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    subjects = [name for name in SUBJECTS if keep(name)]
    if quick or gpus < 2:
        return [{"case": case, "subject": name, "status": NEEDS} for case in ("weak", "strong")
                for name in subjects]
    rows = []
    for case in ("weak", "strong"):
        for name in subjects:
            for P in [p for p in RANKS if 2 <= p <= gpus]:
                T = T_PER_RANK * (1 if case == "weak" else max(RANKS))
                row = {"case": case, "subject": name, "ranks": P, **DIMS}
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        path = os.path.join(tmp, "row.pt")
                        launch(_scaling_worker, P, name, {**DIMS, "T": T}, case, path, backend="nccl")
                        rows.append({**row, **torch.load(path), "status": "ok"})
                except Exception as exc:  # noqa: BLE001
                    rows.append({**row, "status": failure(exc)})
    return rows


def measure(device, quick, env, keep=lambda name: True):
    return model_rows(device, quick, keep) + multi_gpu_rows(device, quick, keep)


def summarize(rows, env):
    return {"method": METHOD,
            "columns": ["case", "subject", "ranks", "T_total", "T_rank", "B", "d", "local_us", "rank_us",
                        "model_speedup", "time_us", "ns_per_token", "bytes_per_rank", "status"],
            "notes": [METHOD] + [f"{r['case']} {r['subject']}: {NEEDS}" for r in rows
                                 if r.get("status") == NEEDS]}


def figure(data):
    """Time per token against ranks: the one-device model, and the NCCL runs where measured."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), layout="constrained")
    model, measured = fig.subplots(1, 2)
    for case, ax in (("model", model), ("weak", measured), ("strong", measured)):
        for name in SUBJECTS:
            pts = sorted((r["ranks"], r["ns_per_token"]) for r in data["rows"]
                         if r.get("case") == case and r.get("subject") == name and r.get("status") == "ok")
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{name} {case}" if case != "model" else name)
    gpu = data["env"].get("gpu") or "CPU smoke run"
    model.set(xscale="log", yscale="log", xlabel="ranks P", ylabel="ns per token (slowest rank)",
              title=f"model: one rank's share, no communication ({gpu})")
    measured.set(xscale="log", yscale="log", xlabel="ranks P (GPUs)", ylabel="ns per token",
                 title="NCCL, weak and strong scaling" if measured.lines else NEEDS)
    for ax in (model, measured):
        if ax.lines:
            ax.legend(fontsize=8)
    return fig
