"""Probe the matrix kernels on a GPU: correctness vs float64 first, then layouts timed against eager.

    python3 tools/probe_matrix.py            # the whole probe; prints compact tables
    python3 tools/probe_matrix.py --warm I N # (internal) compile share I of N of the kernels

Compiling every kernel variant serially would take most of a device call, so worker processes
first run each configuration once in parallel and fill Triton's on-disk cache.
"""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["MINGRU_SCAN"] = "triton"

import torch  # noqa: E402
import triton  # noqa: E402

import mingru  # noqa: E402
from mingru import naive, scans  # noqa: E402
from mingru.kernels import matrix  # noqa: E402
from mingru.kernels.common import allow_tf32_dots  # noqa: E402

DEV = "cuda"
SHAPES = {"lab": (128, 64), "long-T": (16, 1024)}
OPS = {  # name: (public op, eager Hillis-Steele, n, k, v)
    "matrix_scan": (mingru.matrix_scan, scans.matrix_scan, 32, 2, 1),
    "matrix_affine_scan": (mingru.matrix_affine_scan, scans.matrix_affine_scan, 8, 8, 1),
    "matrix_recurrence": (mingru.matrix_recurrence, scans.matrix_recurrence, 8, 8, 1),
}
# issue 3's measurements of the seed's Triton kernels on this H200 (us): fwd, fwd+bwd
SEED_US = {("matrix_scan", "lab"): (62, 802), ("matrix_scan", "long-T"): (424, 918),
           ("matrix_affine_scan", "lab"): (94, 481), ("matrix_affine_scan", "long-T"): (743, 1759)}


def inputs(op, B, T, n, k, v, dtype=torch.float32, grad=False):
    A = torch.randn(B, T, n, k, k, device=DEV) * (0.5 / k ** 0.5)
    xs = [A, torch.randn(B, T, n, k, device=DEV) if op == "matrix_scan" else torch.randn(B, T, n, k, v, device=DEV)]
    if op == "matrix_recurrence":
        xs.append(torch.randn(B, n, k, v, device=DEV))
    return [x.to(dtype).requires_grad_(grad) for x in xs]


def as_list(out):
    return list(out) if isinstance(out, tuple) else [out]


def fwd_bwd(fn, xs, cot):
    outs = as_list(fn(*xs))
    torch.autograd.backward(outs, cot)
    return outs, [x.grad for x in xs]


def rel(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


# ---- correctness --------------------------------------------------------------------------

NAIVE = {"matrix_scan": naive.matrix_scan_naive, "matrix_affine_scan": naive.matrix_affine_scan_naive,
         "matrix_recurrence": naive.matrix_recurrence_naive}


def correctness_cases():
    cases = []
    for k in (1, 2, 4, 8, 16):
        for v in sorted({1, k}):
            for op in ("matrix_affine_scan", "matrix_recurrence"):
                for split in (False, True):
                    cases.append((op, k, v, split, torch.float32, "ieee"))
    cases += [("matrix_scan", 2, 1, s, torch.float32, "ieee") for s in (False, True)]
    cases += [("matrix_affine_scan", 8, 1, True, torch.bfloat16, "ieee"),
              ("matrix_recurrence", 16, 16, False, torch.float32, "tf32"),
              ("matrix_affine_scan", 16, 16, False, torch.float32, "tf32")]
    return cases


def check(op, k, v, split, dtype, prec):
    torch.manual_seed(k * 100 + v)
    xs = inputs(op, 3, 50, 5, k, v, dtype, grad=True)
    ref_xs = [x.detach().double().requires_grad_() for x in xs]
    ref_outs = as_list(NAIVE[op](*ref_xs))
    cot = [torch.randn_like(o).to(dtype) for o in ref_outs]
    ref_outs, ref_grads = fwd_bwd(NAIVE[op], ref_xs, [c.double() for c in cot])
    for x in xs:
        x.grad = None
    with matrix.forced_plan(**(dict(chunk=8) if split else {})), allow_tf32_dots(prec == "tf32"):
        outs, grads = fwd_bwd(OPS[op][0], xs, cot)
    torch.cuda.synchronize()
    e_out = max(rel(g, w) for g, w in zip(outs, ref_outs))
    e_grad = max(rel(g, w) for g, w in zip(grads, ref_grads))
    return e_out, e_grad


# ---- timing -------------------------------------------------------------------------------

def timing_configs():
    """(op, shape, variant, forced plan fields); variant 'eager' is the Hillis-Steele reference."""
    configs = []
    for op in ("matrix_scan", "matrix_affine_scan"):
        for shape, (B, T) in SHAPES.items():
            configs += [(op, shape, "eager", None), (op, shape, "auto", {})]
            configs += [(op, shape, "unroll1", dict(unroll=1)), (op, shape, "stages3", dict(stages=3)),
                        (op, shape, "unroll1-stages3", dict(unroll=1, stages=3))]
            chunks = (16, 32) if shape == "lab" else (32, 64, 128, 256)
            configs += [(op, shape, "sequential", dict(chunk=T))]
            configs += [(op, shape, f"chunk{c}", dict(chunk=c)) for c in chunks]
            configs += [(op, shape, "warps2", dict(num_warps=2)), (op, shape, "warps8", dict(num_warps=8)),
                        (op, shape, "block_n/4", dict(block_n=32 if op == "matrix_scan" else 1))]
    for shape in SHAPES:
        configs += [("matrix_recurrence", shape, "eager", None), ("matrix_recurrence", shape, "auto", {})]
    return configs


def nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def time_config(op, shape, variant, fields, bench=True):
    fn_triton, fn_eager, n, k, v = OPS[op]
    B, T = SHAPES[shape]
    fn = fn_eager if fields is None else fn_triton
    xs = inputs(op, B, T, n, k, v)
    xg = [x.clone().requires_grad_() for x in xs]
    with torch.no_grad():
        outs = as_list(fn(*xs))
    cot = [torch.randn_like(o) for o in outs]
    with matrix.forced_plan(**(fields or {})):
        if not bench:  # warm-up worker: compile forward and backward once
            fwd_bwd(fn, xg, cot)
            torch.cuda.synchronize()
            return None
        with torch.no_grad():
            t_f = triton.testing.do_bench(lambda: fn(*xs), warmup=25, rep=60, return_mode="median")
        t_fb = triton.testing.do_bench(lambda: fwd_bwd(fn, xg, cot), warmup=25, rep=60, grad_to_none=xg,
                                       return_mode="median")
        t_graph = float("nan")
        if variant == "auto":  # GPU time alone: the launches replayed from a CUDA graph
            try:
                with torch.no_grad():
                    t_graph = triton.testing.do_bench_cudagraph(lambda: fn(*xs), rep=100, return_mode="median")
            except Exception as err:
                print(f"cudagraph {op} {shape}: {type(err).__name__}: {str(err)[:200]}")
        lay = None if fields is None else matrix.plan(B * n, T, k, v + (0 if op == "matrix_recurrence" else k),
                                                      torch.device(DEV))
    b_f = nbytes(xs) + nbytes(outs)
    b_fb = b_f + nbytes(xs) + nbytes(outs) + nbytes(cot) + nbytes(xs)  # bwd: A, outputs, cotangents in; grads out
    return t_f * 1e3, t_fb * 1e3, b_f / (t_f * 1e-3) / 1e9, b_fb / (t_fb * 1e-3) / 1e9, lay, t_graph * 1e3


def warm(index, count):
    torch.manual_seed(index)
    jobs = [("check", c) for c in correctness_cases()] + [("time", c) for c in timing_configs()]
    for j, (kind, c) in enumerate(jobs):
        if j % count != index or (kind == "time" and c[3] is None):
            continue
        try:
            check(*c) if kind == "check" else time_config(*c, bench=False)
        except Exception as err:  # reported again, with context, by the main process
            print(f"warm {kind} {c}: {type(err).__name__}: {str(err)[:300]}", file=sys.stderr)


def compile_and_opcheck():
    """torch.compile(fullgraph=True) over the recurrence fwd+bwd, and opcheck of the three ops."""
    A, X, h0 = [x.requires_grad_() for x in inputs("matrix_recurrence", 2, 37, 3, 4, 2)]

    def step(A, X, h0):
        return mingru.matrix_recurrence(A, X, h0).square().sum()

    want = torch.autograd.grad(step(A, X, h0), (A, X, h0))
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(A, X, h0), (A, X, h0))
    err = max(rel(g, w.double()) for g, w in zip(got, want))
    print(f"torch.compile(fullgraph) matrix_recurrence fwd+bwd: max rel err vs uncompiled {err:.1e}")
    args = {"matrix_scan": inputs("matrix_scan", 2, 37, 3, 2, 1, grad=True),
            "matrix_affine_scan": inputs("matrix_affine_scan", 2, 37, 3, 4, 2, grad=True),
            "matrix_recurrence": inputs("matrix_recurrence", 2, 37, 3, 4, 2, grad=True)}
    for name, xs in args.items():
        try:
            torch.library.opcheck(getattr(torch.ops.mingru, name).default, xs)
            print(f"opcheck {name}: ok")
        except Exception as err:
            print(f"opcheck {name}: FAIL {type(err).__name__}: {str(err)[:300]}")


def main():
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    workers = min(12, os.cpu_count() or 4)
    procs = [subprocess.Popen([sys.executable, __file__, "--warm", str(i), str(workers)]) for i in range(workers)]
    for p in procs:
        p.wait()
    print(f"parallel compile: {time.time() - t0:.0f} s")

    print("\n## correctness vs float64 naive (B3 T50 n5, rel. Frobenius error; split = chunk 8)")
    print("| op | k | v | layout | dtype | dots | outputs | grads |")
    print("|---|---|---|---|---|---|---|---|")
    for op, k, v, split, dtype, prec in correctness_cases():
        try:
            e_o, e_g = check(op, k, v, split, dtype, prec)
            res = f"{e_o:.1e} | {e_g:.1e}"
        except Exception as err:
            res = f"FAIL {type(err).__name__}: {str(err)[:200]} |"
        print(f"| {op} | {k} | {v} | {'split' if split else 'seq'} | {str(dtype)[6:]} | {prec} | {res} |")
    print(f"[{time.time() - t0:.0f} s]")

    print("\n## timings (us, median of do_bench; GB/s = bytes read+written once / time)")
    print("| op | shape | variant | plan (block_n, chunk, warps, unroll, stages) | fwd | fwd graph | fwd+bwd "
          "| fwd GB/s | fwd+bwd GB/s | x eager fwd / fwd+bwd | x seed fwd / fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    eager = {}
    for op, shape, variant, fields in timing_configs():
        try:
            t_f, t_fb, g_f, g_fb, lay, t_graph = time_config(op, shape, variant, fields)
        except Exception as err:
            print(f"| {op} | {shape} | {variant} | FAIL {type(err).__name__}: {str(err)[:200]} |")
            continue
        if fields is None:
            eager[op, shape] = (t_f, t_fb)
        e_f, e_fb = eager.get((op, shape), (float("nan"),) * 2)
        s_f, s_fb = SEED_US.get((op, shape), (float("nan"),) * 2)
        plan = "-" if lay is None else f"{lay.block_n}, {lay.chunk}, {lay.num_warps}, {lay.unroll}, {lay.stages}"
        print(f"| {op} | {shape} | {variant} | {plan} | {t_f:.1f} | {t_graph:.1f} | {t_fb:.1f} | {g_f:.0f} | "
              f"{g_fb:.0f} | {e_f / t_f:.1f} / {e_fb / t_fb:.1f} | {s_f / t_f:.1f} / {s_fb / t_fb:.1f} |")
    print(f"[{time.time() - t0:.0f} s]")
    if time.time() - t0 < 160:
        try:
            compile_and_opcheck()
        except Exception as err:
            print(f"compile check FAIL {type(err).__name__}: {str(err)[:500]}")
    print(f"[{time.time() - t0:.0f} s]")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--warm"]:
        warm(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
