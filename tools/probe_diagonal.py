"""GPU probe for the diagonal kernels: CUDA correctness first, then timings against copy bandwidth.

Run on the device: `python3 tools/probe_diagonal.py [--quick]`. Prints compact tables: per shape
and variant the median time (triton.testing.do_bench) and GB/s with bytes = inputs read once +
outputs written once (backward: its minimum bytes), next to a device-to-device copy.
"""
import contextlib
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run through the interpreter
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported
import triton  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import mingru  # noqa: E402
from mingru import naive  # noqa: E402
from mingru.kernels import diagonal as dg  # noqa: E402

START = time.time()
BUDGET_S = float(os.environ.get("PROBE_BUDGET_S", "200"))


def bench(fn, grad_to_none=None):
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=40, grad_to_none=grad_to_none, return_mode="median") * 1e3


def out_of_time(section):
    if time.time() - START > BUDGET_S:
        print(f"[skipped {section}: {time.time() - START:.0f}s elapsed]")
        return True
    return False


def inputs(op, B, T, D, dtype=torch.float32, grad=False):
    g = torch.Generator(device=DEV).manual_seed(B * 7 + T * 13 + D)
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)  # noqa: E731
    if op == "parallel_scan_log":
        xs = [-F.softplus(r(B, T, D)), r(B, T + 1, D)]
    else:
        sign = torch.where(r(B, T, D) > 0, 1.0, -1.0)
        xs = [sign * (0.5 + 0.5 * torch.rand(B, T, D, device=DEV, generator=g)), r(B, T, D)]
        if op == "linear_recurrence":
            xs.append(r(B, D))
    return [x.to(dtype).requires_grad_(grad) for x in xs]


OPS = {"linear_scan": mingru.linear_scan, "linear_recurrence": mingru.linear_recurrence,
       "parallel_scan_log": mingru.parallel_scan_log}
REFS = {"linear_scan": naive.linear_scan_naive, "linear_recurrence": naive.linear_recurrence_naive,
        "parallel_scan_log": naive.parallel_scan_log_naive}
FWD_UNITS = {"linear_scan": 4, "linear_recurrence": 3, "parallel_scan_log": 3}
BWD_UNITS = {"linear_scan": 7, "linear_recurrence": 5, "parallel_scan_log": 6}


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def run_grads(fn, xs, cots):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    outs = as_tuple(fn(*xs))
    torch.autograd.backward(outs, [c.to(o.dtype) for o, c in zip(outs, cots)])
    return list(outs) + [x.grad for x in xs]


def correctness():
    print("== CUDA correctness vs float64 loops (max |err| / (1 + max|ref|) over outputs and grads)")
    os.environ["MINGRU_SCAN"] = "triton"
    cases = [(2, 300, 70, (0, 0)), (3, 1000, 1030, (0, 0)), (2, 77, 33, (8, 5)), (4, 1, 9, (0, 0))]
    if DEV == "cpu":
        cases = [(2, 30, 7, (0, 0)), (2, 17, 33, (4, 3))]
    worst = 0.0
    for op in OPS:
        for dtype in (torch.float32, torch.bfloat16):
            for B, T, D, forced in cases:
                xs = inputs(op, B, T, D, dtype)
                with torch.no_grad():
                    shapes = [o.shape for o in as_tuple(REFS[op](*xs))]
                cots = [torch.randn(s, device=DEV).to(dtype).double() for s in shapes]
                want = run_grads(REFS[op], [x.double() for x in xs], cots)
                with dg.forced_layout(*forced):
                    got = run_grads(OPS[op], xs, cots)
                errs = [((g.double() - w).abs().max() / (1 + w.abs().max())).item() for g, w in zip(got, want)]
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                flag = "ok" if max(errs) < tol else "FAIL"
                worst = max(worst, max(errs)) if dtype == torch.float32 else worst
                print(f"{op:18s} {str(dtype)[6:]:8s} B{B}-T{T}-D{D} forced{forced}: "
                      f"{' '.join(f'{e:.1e}' for e in errs)} {flag}")
    lc, lv = inputs("parallel_scan_log", 2, 500 if DEV == "cuda" else 20, 40)
    lv[:, 0] = 100.0
    lc[:, 0] = -30.0
    h = mingru.parallel_scan_log(lc, lv)
    ref = naive.parallel_scan_log_naive(lc, lv)
    print(f"log carry e^100 h0: finite={torch.isfinite(h).all().item()} "
          f"rel err={((h.double() - ref).abs() / ref.abs()).max().item():.1e}")
    print(f"worst float32 relative error: {worst:.1e}")


def copy_bandwidth():
    src = torch.randn(2 ** 28 if DEV == "cuda" else 2 ** 16, device=DEV)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    gbs = 2 * src.numel() * 4 / t / 1e3
    print(f"== device copy 1 GiB: {t:.0f} us, {gbs:.0f} GB/s")
    return gbs


MODES = {"linear_scan": dg.SCAN, "linear_recurrence": dg.REC, "parallel_scan_log": dg.LOG}


def kernel_call(op, direction, B, T, D):
    """A closure running one direction of `op` through the kernels alone (no autograd, no checks)."""
    mode = MODES[op]
    xs = [x.detach() for x in inputs(op, B, T, D)]
    x, y = xs[0], xs[1]
    h0 = xs[2] if op == "linear_recurrence" else None
    outs = [torch.empty_like(x) for _ in range(2)]
    if direction == "forward":
        return lambda: dg._forward(mode, x, y, h0, outs[0], outs[1])
    g, ga, dx, dy, dh0 = torch.randn_like(x), torch.randn_like(x), torch.empty_like(x), torch.empty_like(y), x[:, 0].clone()
    dg._forward(mode, x, y, h0, outs[0], outs[1])
    return lambda: dg._backward(mode, x, y, h0, g, ga, outs[1], outs[0], dx, dy, dh0)


def gpu_time(fn):
    """GPU time alone (CUDA-graph replay), so the Python launch overhead does not count."""
    if DEV == "cpu":
        return bench(fn)
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def set_tiles(direction, op, cfg):
    dg.TILES[direction, MODES[op].value] = cfg
    dg._plan.cache_clear()


def cfg_name(cfg):
    chunk, block_d, warps, stages, prefetch = cfg
    return f"{chunk}/{block_d}/{warps}/{stages}{'p' if prefetch else ''}"


def sweep(copy_gbs, shapes, candidates, per_sm_options, deadline):
    """Kernel-only GPU time per tile config; the least summed slowdown over the shapes wins."""
    print("== kernel tile sweep (fp32, CUDA-graph GPU time, us and % of copy); cfg = CHUNK/BLOCK_D/warps/stages[p=prefetch]")
    winners = {}
    for direction in ("forward", "backward"):
        for op in MODES:
            units = FWD_UNITS[op] if direction == "forward" else BWD_UNITS[op]
            results = {}
            for cfg in candidates[direction, op]:
                if time.time() - START > deadline:
                    break
                set_tiles(direction, op, cfg)
                row = []
                for B, T, D in shapes:
                    try:
                        row.append(gpu_time(kernel_call(op, direction, B, T, D)))
                    except Exception as err:  # a config that does not compile is reported, not fatal
                        print(f"   {direction} {op} {cfg_name(cfg)} B{B}-T{T}-D{D}: {type(err).__name__}: {str(err)[:150]}")
                        row.append(float("inf"))
                results[cfg] = row
            if not results:
                continue
            fastest = [min(row[i] for row in results.values()) for i in range(len(shapes))]
            score = {c: sum(t / f for t, f in zip(row, fastest)) for c, row in results.items()}
            best = min(score, key=score.get)  # least summed slowdown against the fastest per shape
            winners[direction, op] = best
            set_tiles(direction, op, best)
            for cfg, row in sorted(results.items(), key=lambda kv: score[kv[0]]):
                cells = "  ".join(f"{t:7.1f} ({100 * units * B * T * D * 4 / t / 1e3 / copy_gbs:3.0f}%)"
                                  for t, (B, T, D) in zip(row, shapes))
                print(f"{direction:8s} {op:18s} {cfg_name(cfg):12s} {cells}{'  <- best' if cfg == best else ''}")
    # programs per SM below which time is split: matters for the small-B*D shape only
    small = [s for s in shapes if s[0] * s[2] <= 4096]
    if small and time.time() - START < deadline:
        totals = {}
        for per_sm in per_sm_options:
            dg.PROGRAMS_PER_SM = per_sm
            dg._plan.cache_clear()
            row = [gpu_time(kernel_call(op, direction, *small[0])) for direction in ("forward", "backward")
                   for op in MODES]
            totals[per_sm] = row
            segs = dg.plan(*small[0], torch.device(DEV)).segments
            print(f"PROGRAMS_PER_SM={per_sm:2d} (segments {segs}) B{small[0][0]}-T{small[0][1]}-D{small[0][2]}: "
                  f"fwd/bwd scan, rec, log = {' '.join(f'{t:.0f}' for t in row)} us")
        dg.PROGRAMS_PER_SM = min(totals, key=lambda k: sum(totals[k]))
        dg._plan.cache_clear()
    print("chosen: TILES =", {f"{d}/{op}": c for (d, op), c in winners.items()}, "PROGRAMS_PER_SM =", dg.PROGRAMS_PER_SM,
          "SPLIT_BELOW_PER_SM =", dg.SPLIT_BELOW_PER_SM)


def overhead():
    """Where the time of a small call goes: CPU wall time per call vs the GPU time of the same call."""
    print("== launch overhead at B128-T64-D64 linear_scan fp32: wall us per call (CPU-bound loop)")
    os.environ["MINGRU_SCAN"] = "triton"
    B, T, D, reps = (128, 64, 64, 200) if DEV == "cuda" else (2, 8, 8, 2)
    a, b = inputs("linear_scan", B, T, D)
    A, Bc = torch.empty_like(a), torch.empty_like(a)
    lay = dg.plan(B, T, D, a.device)
    grid = (-(-D // lay.block_d), B, 1)

    def bare():
        dg._forward_kernel[grid](a, b, a, A, Bc, a, T, D, lay.seg_len, 1, MODE=0, AGG_PASS=False, HAS_H0=False,
                                 F64=False, CHUNK=lay.chunk, BLOCK_D=lay.block_d, PREFETCH=lay.prefetch,
                                 num_warps=lay.warps, num_stages=lay.stages)
    ag = a.detach().clone().requires_grad_()
    cots = [torch.randn_like(a), torch.randn_like(a)]
    calls = {"bare triton launch": bare,
             "dg._forward (wrap_triton)": lambda: dg._forward(dg.SCAN, a, b, None, A, Bc),
             "torch.ops.mingru.linear_scan": lambda: torch.ops.mingru.linear_scan(a, b),
             "mingru.linear_scan (public)": lambda: mingru.linear_scan(a, b),
             "public fwd+bwd": lambda: torch.autograd.backward(mingru.linear_scan(ag, b), cots)}
    for name, fn in calls.items():
        with torch.no_grad() if "bwd" not in name else contextlib.nullcontext():
            fn()
            torch.cuda.synchronize() if DEV == "cuda" else None
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize() if DEV == "cuda" else None
            print(f"   {name:32s} {(time.perf_counter() - t) / reps * 1e6:7.1f} us")
    print(f"   GPU time of the forward kernel (graph replay): {gpu_time(calls['dg._forward (wrap_triton)']):.1f} us")


def timings(copy_gbs, shapes, with_eager):
    print("== public ops, do_bench median (MINGRU_SCAN=triton vs eager): us, GB/s, % copy")
    print(f"{'op':18s} {'shape':18s} {'fwd us':>8s} {'GB/s':>6s} {'%':>4s} {'f+b us':>8s} {'GB/s':>6s} {'%':>4s}"
          f" {'eager fwd':>9s} {'eager f+b':>9s}")
    for op, fn in OPS.items():
        for B, T, D in shapes:
            if out_of_time("timings"):
                return
            xs = inputs(op, B, T, D, grad=True)
            n = B * T * D * 4
            row = []
            for mode in ("triton", "eager") if with_eager(B, T, D) else ("triton",):
                os.environ["MINGRU_SCAN"] = mode
                with torch.no_grad():
                    tf = bench(lambda: fn(*xs))
                outs = as_tuple(fn(*xs))
                cots = [torch.randn_like(o) for o in outs]
                tb = bench(lambda: torch.autograd.backward(as_tuple(fn(*xs)), cots), grad_to_none=xs)
                row.append((tf, tb))
            (tf, tb) = row[0]
            gf = FWD_UNITS[op] * n / tf / 1e3
            gb = (FWD_UNITS[op] + BWD_UNITS[op]) * n / tb / 1e3
            eager = f"{row[1][0]:9.0f} {row[1][1]:9.0f}" if len(row) > 1 else f"{'-':>9s} {'-':>9s}"
            print(f"{op:18s} B{B}-T{T}-D{D:<6d} {tf:8.1f} {gf:6.0f} {100 * gf / copy_gbs:4.0f} {tb:8.1f} {gb:6.0f}"
                  f" {100 * gb / copy_gbs:4.0f} {eager}")
    os.environ["MINGRU_SCAN"] = "triton"


def main():
    print(torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)", "torch", torch.__version__,
          "triton", triton.__version__)
    big = [(16, 1024, 1024), (8, 4096, 2048), (2, 16384, 1024)]
    small = [(128, 64, 64), (16, 1024, 64)]
    linear = [(64, 64, 4, 3, False), (32, 64, 4, 3, False), (64, 64, 4, 1, True), (32, 128, 4, 3, False),
              (64, 32, 4, 3, False)]
    log = [(32, 64, 4, 1, True), (64, 32, 4, 1, True), (64, 64, 4, 1, True), (64, 64, 4, 3, False),
           (32, 64, 4, 3, False)]
    back = [(32, 64, 4, 3, False), (16, 64, 4, 3, False), (64, 64, 4, 3, False), (32, 32, 2, 3, False)]
    candidates = {("forward", "linear_scan"): linear, ("forward", "linear_recurrence"): linear[:3],
                  ("forward", "parallel_scan_log"): log}
    candidates.update({("backward", op): back for op in MODES})
    if DEV == "cpu":
        big, small = [(1, 40, 70), (2, 64, 16)], [(2, 8, 8)]
        candidates = {k: v[:2] for k, v in candidates.items()}
    copy_gbs = [4200.0]
    sections = [("correctness", correctness),
                ("copy", lambda: copy_gbs.__setitem__(0, copy_bandwidth())),
                ("overhead", overhead),
                ("sweep", lambda: sweep(copy_gbs[0], big, candidates, (2, 4, 8), BUDGET_S - 45)),
                ("timings", lambda: timings(copy_gbs[0], small + big, lambda B, T, D: B * T * D <= 2 ** 20))]
    for name, fn in sections:
        if out_of_time(name):
            continue
        t = time.time()
        try:
            fn()
        except Exception:
            print(f"[{name} failed]")
            traceback.print_exc(limit=4)
        print(f"[{name}: {time.time() - t:.0f}s]", flush=True)


if __name__ == "__main__":
    main()
