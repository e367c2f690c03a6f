"""GPU probe for the diagonal kernels: CUDA correctness first, then timings against copy bandwidth.

Run on the device: `python3 tools/probe_diagonal.py [--quick]`. Prints compact tables: per shape
and variant the median time (triton.testing.do_bench) and GB/s with bytes = inputs read once +
outputs written once (backward: its minimum bytes), next to a device-to-device copy.
"""
import argparse
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


def forward_with(mode, xs, outs, lay):
    x, y = xs[0], xs[1]
    dg._launch(dg._forward_kernel, mode, x, lay, (x, y, x, outs[0], outs[1]), False, 2, PREFETCH=lay.prefetch)


def layout(B, T, D, chunk, block_d, warps, segments, stages=3, prefetch=False):
    seg_len = triton.cdiv(triton.cdiv(T, segments), chunk) * chunk
    return dg.Layout(chunk, block_d, warps, triton.cdiv(T, seg_len), seg_len, stages, prefetch)


def cfg_name(lay):
    return f"{lay.chunk}/{lay.block_d}/{lay.warps}/{lay.stages}{'p' if lay.prefetch else ''}/{lay.segments}"


def sweep(copy_gbs, shapes, configs, seg_options):
    print("== forward tile sweep (fp32): us and % of copy; cfg = CHUNK/BLOCK_D/warps/stages[p=prefetch]/segments")
    for op, mode in (("linear_scan", dg.SCAN), ("parallel_scan_log", dg.LOG)):
        for B, T, D in shapes:
            if out_of_time("sweep"):
                return
            xs = [x.detach() for x in inputs(op, B, T, D)]
            outs = [torch.empty(B, T, D, device=DEV) for _ in range(2)]
            nbytes = FWD_UNITS[op] * B * T * D * 4
            auto = dg.plan(B, T, D, xs[0].device)
            cells = []
            for cfg in configs:
                for segs in seg_options(B, T, D, cfg[1]):
                    lay = layout(B, T, D, cfg[0], cfg[1], cfg[2], segs, *cfg[3:])
                    try:
                        t = bench(lambda: forward_with(mode, xs, outs, lay))
                        cells.append((t, cfg_name(lay)))
                    except Exception as err:  # a config that does not compile is reported, not fatal
                        cells.append((float("inf"), f"{cfg_name(lay)} ERR {type(err).__name__}: {err}"[:200]))
            cells.sort()
            pct = lambda t: 100 * nbytes / t / 1e3 / copy_gbs  # noqa: E731
            print(f"{op} B{B}-T{T}-D{D} auto={cfg_name(auto)}: " + ", ".join(
                f"{c}={t:.0f}us({pct(t):.0f}%)" for t, c in cells[:6]) + f"; worst {cells[-1][1]}={cells[-1][0]:.0f}us")
            base = [f"{c}={t:.0f}" for t, c in cells if c.startswith("32/64/4/3/")]
            print(f"   base 32/64/4/3 by segments: {', '.join(sorted(base, key=lambda x: int(x.split('/')[4].split('=')[0])))}")


def timings(copy_gbs, shapes, with_eager):
    print("== auto layout, public ops (MINGRU_SCAN=triton vs eager): us, GB/s, % copy")
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


def compile_check():
    print("== torch.compile(fullgraph=True) + backward through the ops")
    os.environ["MINGRU_SCAN"] = "triton"
    for op, fn in OPS.items():
        xs = inputs(op, 2, 100, 40, grad=True)
        f = torch.compile(lambda *z: sum(o.square().sum() for o in as_tuple(fn(*z))), fullgraph=True)
        got = torch.autograd.grad(f(*xs), xs)
        want = torch.autograd.grad(sum(o.square().sum() for o in as_tuple(fn(*xs))), xs)
        print(op, "max grad diff", max((g - w).abs().max().item() for g, w in zip(got, want)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="correctness and auto timings only")
    args = parser.parse_args()
    print(torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)", "torch", torch.__version__,
          "triton", triton.__version__)
    big = [(16, 1024, 1024), (8, 4096, 2048), (2, 16384, 1024)]
    small = [(128, 64, 64), (16, 1024, 64)]
    configs = [(32, 64, 4, 3), (32, 64, 4, 1), (32, 64, 4, 1, True), (16, 64, 4, 3), (64, 64, 4, 3),
               (32, 128, 4, 3), (16, 128, 4, 1, True), (32, 32, 2, 3), (16, 256, 4, 3), (64, 32, 4, 1, True)]
    if DEV == "cpu":
        big, small, configs = [(1, 40, 70)], [(2, 16, 8)], configs[:2]

    def seg_options(B, T, D, block_d):
        lanes = B * triton.cdiv(D, block_d)
        return [1] if lanes >= 512 else sorted({1, 8, 16, 32, triton.cdiv(528, lanes)})

    copy_gbs = [4200.0]
    sections = [("correctness", correctness),
                ("copy", lambda: copy_gbs.__setitem__(0, copy_bandwidth())),
                ("timings", lambda: timings(copy_gbs[0], small + big, lambda B, T, D: B * T * D <= 2 ** 20))]
    if not args.quick:
        sections.append(("sweep", lambda: sweep(copy_gbs[0], big + small[1:], configs, seg_options)))
    if DEV == "cuda":
        sections.append(("compile", compile_check))
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
