"""Device probe for the angle-fused rotation kernel (issue 4), one call: correctness on CUDA against
the float64 loop, then forward and forward+backward timings (triton.testing.do_bench, median) and
peak memory against the dense-transition paths, then a launch-config sweep. Prints compact tables.

    python3 tools/probe_rotation.py            # on the GPU (about 2-3 minutes, cold compile cache)
    python3 tools/probe_rotation.py --smoke    # CPU: the same code paths, tiny, through the interpreter
"""
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["MINGRU_SCAN"] = "triton"

import torch  # noqa: E402

import mingru  # noqa: E402
from mingru import naive, scans  # noqa: E402
from mingru.kernels import rotation as R  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
START, BUDGET = time.time(), float(os.environ.get("PROBE_BUDGET_S", "165"))
MIXERS = {"givens": dict(n=8, k=8, L=6), "rotation": dict(n=32, k=2, L=1)}  # d = 64
SHAPES = [(2, 5)] if SMOKE else [(128, 64), (16, 1024)]


def left():
    return BUDGET - (time.time() - START)


def inputs(B, T, n, k, L, dtype=torch.float32, h0=False, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    xs = [torch.randn(B, T, n, L, k // 2, generator=g, device=DEV) * 1.5,
          0.3 + 0.65 * torch.rand(B, T, n, generator=g, device=DEV),
          torch.randn(B, T, n, k, generator=g, device=DEV),
          torch.randn(B, n, k, generator=g, device=DEV) if h0 else None]
    return [None if x is None else x.to(dtype) for x in xs]


def fwd_bwd(fn, xs, cot):
    xs = [None if x is None else x.detach().requires_grad_() for x in xs]
    h = fn(*xs)
    return h, torch.autograd.grad(h, [x for x in xs if x is not None], cot.to(h.dtype))


def worst(got, want, atol, rtol):
    """max |got - want| / (atol + rtol |want|): <= 1 passes, like torch.testing.assert_close."""
    return max(((a.double() - b).abs() / (atol + rtol * b.abs())).max().item() for a, b in zip(got, want))


def bench(fn):
    if SMOKE:
        fn()
        return float("nan")
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # µs


def peak_mb(fn):
    """Peak MB allocated during fn, counting what is live at the start (inputs, parameters). Run
    before any do_bench: Triton keeps its L2-flush buffer (64 MiB seen on the H200) alive after it."""
    if SMOKE:
        fn()
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 1e6


def section(title):
    print(f"\n== {title}  (t={time.time() - START:.0f}s)", flush=True)


def correctness():
    section("correctness vs float64 naive (ratio = max err / (atol + rtol|ref|), pass <= 1)")
    tol = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
    cases = [(7, 37, 5, 2, 1, torch.float32, True), (7, 37, 5, 4, 2, torch.float32, False),
             (7, 37, 5, 8, 6, torch.float32, True), (7, 37, 5, 16, 6, torch.float32, False),
             (3, 1, 5, 8, 6, torch.float32, True), (7, 37, 5, 8, 6, torch.bfloat16, True),
             (64, 64, 8, 8, 6, torch.float32, True)]
    if SMOKE:
        cases = [(2, 5, 3, 8, 6, torch.float32, True), (2, 5, 3, 2, 1, torch.bfloat16, False)]
    ok = True
    for B, T, n, k, L, dtype, h0 in cases:
        xs = inputs(B, T, n, k, L, dtype, h0, seed=k * 100 + L)
        cot = torch.randn(B, T, n, k, device=DEV, dtype=torch.float64)
        got = fwd_bwd(mingru.rotation_recurrence, xs, cot)
        want = fwd_bwd(naive.rotation_recurrence_naive, [None if x is None else x.double() for x in xs], cot)
        r = worst([got[0], *got[1]], [want[0], *want[1]], *tol[dtype])
        ok &= r <= 1
        print(f"B{B}-T{T}-n{n}-k{k}-L{L}-{'h0' if h0 else 'zero_h0'}-{str(dtype)[6:]:9s} ratio {r:7.4f} "
              f"{'PASS' if r <= 1 else 'FAIL'}")
    # strided views, as GivensMinGRU passes them
    B, T, n, k, L = 4, 19, 3, 8, 6
    proj = torch.randn(B, T, n * L * k // 2 + n + n * k, device=DEV)
    a, d, u = proj.split([n * L * k // 2, n, n * k], dim=-1)
    d.sigmoid_()
    xs = [a.reshape(B, T, n, L, k // 2), d, u.reshape(B, T, n, k), torch.randn(B, k, n, device=DEV).transpose(1, 2)]
    cot = torch.randn(B, T, n, k, device=DEV, dtype=torch.float64)
    got = fwd_bwd(mingru.rotation_recurrence, xs, cot)
    want = fwd_bwd(naive.rotation_recurrence_naive, [x.double() for x in xs], cot)
    r = worst([got[0], *got[1]], [want[0], *want[1]], *tol[torch.float32])
    ok &= r <= 1
    print(f"strided views k8-L6 float32          ratio {r:7.4f} {'PASS' if r <= 1 else 'FAIL'}")
    return ok


def dense_eager(a, d, u, h0=None):
    return scans.matrix_recurrence(scans.givens_matrices(a, d), u.unsqueeze(-1)).squeeze(-1)


def dense_generic(a, d, u, h0=None):
    return mingru.matrix_recurrence(scans.givens_matrices(a, d), u.unsqueeze(-1)).squeeze(-1)


def gbytes(xs, h, backward):
    """Fewest bytes moved: inputs read once, outputs written once (backward: g, angles, decay, h in;
    the four gradients out)."""
    a, d, u = xs[:3]
    size = lambda x: x.numel() * x.element_size()  # noqa: E731
    if backward:
        return (2 * size(h) + 2 * size(a) + 2 * size(d) + size(h)) / 1e9
    return (size(a) + size(d) + size(u) + size(h)) / 1e9


def timings():
    section("fwd and fwd+bwd µs (do_bench median), float32; kernel = launches only, op = through "
            "dispatch + autograd")
    print(f"{'mixer':9s} {'B':>4s} {'T':>5s} {'path':15s} {'fwd':>9s} {'fwd+bwd':>9s} {'note'}")
    for name, m in MIXERS.items():
        for B, T in SHAPES:
            if left() < 40:
                print("   (skipped: probe budget)")
                return
            xs = inputs(B, T, m["n"], m["k"], m["L"])
            cot = torch.randn(B, T, m["n"], m["k"], device=DEV)
            req = [x.detach().requires_grad_() for x in xs[:3]]
            rows = []
            # kernels only: the forward launch, and forward + backward launches
            h = R._launch_fwd(*xs)
            tf = bench(lambda: R._launch_fwd(*xs))
            tb = bench(lambda: R._launch_bwd(cot, xs[0], xs[1], None, R._launch_fwd(*xs)))
            gbs = f"fwd {gbytes(xs, h, False) / tf * 1e6:6.1f} GB/s, bwd {gbytes(xs, h, True) / (tb - tf) * 1e6:6.1f} GB/s, " \
                  f"{tf / T * 1e3:6.1f} ns/step fwd"
            rows.append(("fused kernels", tf, tb, gbs))
            for path, fn in [("fused op", mingru.rotation_recurrence), ("dense generic", dense_generic),
                             ("dense eager", dense_eager)]:
                try:
                    with torch.no_grad():
                        t1 = bench(lambda: fn(*xs[:3]))
                    t2 = bench(lambda: torch.autograd.grad(fn(*req), req, cot))
                    rows.append((path, t1, t2, ""))
                except Exception as err:  # a path another engineer owns may not run yet
                    rows.append((path, float("nan"), float("nan"), f"{type(err).__name__}: {err}"[:90]))
            for path, t1, t2, note in rows:
                print(f"{name:9s} {B:4d} {T:5d} {path:15s} {t1:9.1f} {t2:9.1f} {note}", flush=True)
            del xs, req, h


def memory():
    section(f"peak MB of fwd+bwd, inputs and parameters included (measured before any do_bench; "
            f"{torch.cuda.memory_allocated() / 1e6 if not SMOKE else 0:.1f} MB live beforehand)")
    print(f"{'what':9s} {'B':>4s} {'T':>5s} {'path':15s} {'peak MB':>8s}")
    for name, m in MIXERS.items():  # the op alone
        for B, T in SHAPES:
            xs = [x.requires_grad_() for x in inputs(B, T, m["n"], m["k"], m["L"])[:3]]
            cot = torch.randn(B, T, m["n"], m["k"], device=DEV)
            for path, fn in [("fused op", mingru.rotation_recurrence), ("dense generic", dense_generic),
                             ("dense eager", dense_eager)]:
                try:
                    mb = peak_mb(lambda: torch.autograd.grad(fn(*xs), xs, cot))
                    print(f"op-{name:6s} {B:4d} {T:5d} {path:15s} {mb:8.2f}", flush=True)
                except Exception as err:
                    print(f"op-{name:6s} {B:4d} {T:5d} {path:15s} {type(err).__name__}: {err}"[:150])
            del xs, cot
    for label, step in mixer_runs(long=True):
        try:
            print(f"{label} {peak_mb(step):8.2f}", flush=True)
        except Exception as err:
            print(f"{label} {type(err).__name__}: {err}"[:150])


def mixer_runs(long=False):
    """(label, step) per d=64 mixer, shape and path; step is one fwd+bwd under that path's MINGRU_SCAN."""
    for name, cls in [("givens", mingru.GivensMinGRU), ("rotation", mingru.RotationMinGRU)]:
        extra = [(128, 256), (128, 1024), (128, 4096)] if long and name == "givens" and not SMOKE else []
        for B, T in SHAPES + extra:
            for path, fused, mode in [("fused", True, "triton"), ("dense generic", False, "triton"),
                                      ("eager", True, "eager")]:
                if T > 1024 and path != "fused":
                    continue
                os.environ["MINGRU_SCAN"] = mode
                try:
                    mixer = cls(64, 64, fused=fused).to(DEV)
                    x = torch.randn(B, T, 64, device=DEV, requires_grad=True)
                    yield (f"{name:9s} {B:4d} {T:5d} {path:15s}",
                           lambda: torch.autograd.grad(mixer(x).square().mean(), [x, *mixer.parameters()]))
                finally:
                    os.environ["MINGRU_SCAN"] = "triton"


def mixer_timings():
    section("GivensMinGRU / RotationMinGRU (d=64) fwd+bwd µs")
    for label, step in mixer_runs():
        if left() < 25:
            return
        try:
            print(f"{label} {bench(step):10.1f}", flush=True)
        except Exception as err:
            print(f"{label} {type(err).__name__}: {err}"[:150])


def sweep():
    section("launch-config sweep, fused kernels, givens float32: µs (fwd) and µs (bwd launch alone)")
    m = MIXERS["givens"]
    print(f"{'B':>4s} {'T':>5s} {'BLOCK_N':>7s} {'warps':>5s} {'stages':>6s} {'fwd':>8s} {'bwd':>8s} {'check'}")
    for B, T in SHAPES:
        xs = inputs(B, T, m["n"], m["k"], m["L"], h0=True)
        cot = torch.randn(B, T, m["n"], m["k"], device=DEV)
        h_ref = R._launch_fwd(*xs)
        g_ref = R._launch_bwd(cot, xs[0], xs[1], xs[3], h_ref)
        configs = [(32, s, 1) for s in (1, 2, 3, 4, 6)] + [(64, 3, 2), (128, 3, 4)]
        for cfg in configs:
            if left() < 15:
                print("   (skipped: probe budget)")
                return
            h = R._launch_fwd(*xs, config=cfg)
            g = R._launch_bwd(cot, xs[0], xs[1], xs[3], h_ref, config=cfg)
            same = torch.allclose(h, h_ref, atol=1e-5) and all(torch.allclose(a, b, atol=1e-4) for a, b in zip(g, g_ref))
            tf = bench(lambda: R._launch_fwd(*xs, config=cfg))
            tb = bench(lambda: R._launch_bwd(cot, xs[0], xs[1], xs[3], h_ref, config=cfg))
            print(f"{B:4d} {T:5d} {cfg[0]:7d} {cfg[2]:5d} {cfg[1]:6d} {tf:8.1f} {tb:8.1f} {'same' if same else 'DIFFERS'}",
                  flush=True)
        print(f"   default config: fwd {R._config(m['L'], m['k'] // 2, 4, False)}, bwd {R._config(m['L'], m['k'] // 2, 4, True)}")


def bf16():
    section("bfloat16 fused op µs (16-bit loads are not cp.async-pipelined)")
    for name, m in MIXERS.items():
        for B, T in SHAPES:
            if left() < 15:
                return
            xs = inputs(B, T, m["n"], m["k"], m["L"], torch.bfloat16)
            cot = torch.randn(B, T, m["n"], m["k"], device=DEV, dtype=torch.bfloat16)
            req = [x.detach().requires_grad_() for x in xs[:3]]
            with torch.no_grad():
                t1 = bench(lambda: mingru.rotation_recurrence(*xs[:3]))
            t2 = bench(lambda: torch.autograd.grad(mingru.rotation_recurrence(*req), req, cot))
            print(f"{name:9s} {B:4d} {T:5d} fwd {t1:9.1f} fwd+bwd {t2:9.1f}", flush=True)


def compiled():
    section("torch.compile(fullgraph=True) of GivensMinGRU fwd+bwd, and opcheck")
    if SMOKE or left() < 30:
        print("   (skipped)")
        return
    try:
        xs = [x.requires_grad_() for x in inputs(2, 9, 3, 8, 6, h0=True)]
        op = lambda a, d, u, h0: torch.ops.mingru.rotation_recurrence(a, d, u, h0).square().sum()  # noqa: E731
        want = torch.autograd.grad(op(*xs), xs)
        got = torch.autograd.grad(torch.compile(op, fullgraph=True)(*xs), xs)
        print(f"compile op: max |diff| {max((a - b).abs().max().item() for a, b in zip(got, want)):.2e}")
    except Exception as err:
        print(f"compile op FAILED: {type(err).__name__}: {err}"[:300])
    try:
        mixer = mingru.GivensMinGRU(64, 64).to(DEV)
        x = torch.randn(4, 33, 64, device=DEV, requires_grad=True)
        want = torch.autograd.grad(mixer(x).sum(), x)[0]
        got = torch.autograd.grad(torch.compile(mixer, fullgraph=True)(x).sum(), x)[0]
        print(f"compile mixer: max |diff| {(got - want).abs().max().item():.2e}")
    except Exception as err:
        print(f"compile mixer FAILED: {type(err).__name__}: {err}"[:300])
    try:
        xs = inputs(2, 9, 3, 8, 6, h0=True)
        torch.library.opcheck(torch.ops.mingru.rotation_recurrence.default, tuple(xs))
        print("opcheck: passed")
    except Exception as err:
        print(f"opcheck FAILED: {type(err).__name__}: {err}"[:300])


if __name__ == "__main__":
    import triton
    name = "interpreter" if SMOKE else torch.cuda.get_device_name()
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}")
    ok = correctness()
    if ok or SMOKE:
        memory()
        timings()
        sweep()
        mixer_timings()
        bf16()
        compiled()
    print(f"\ndone in {time.time() - START:.0f}s, correctness {'PASS' if ok else 'FAIL'}")
