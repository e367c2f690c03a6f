"""The TF32 trap, measured: matrix_affine_scan's error vs float64, with and without the IEEE guard.

On NVIDIA GPUs since Ampere a float32 `tl.dot` large enough for the tensor cores runs in TF32
(10 mantissa bits) unless told `input_precision="ieee"`. The matrix kernels pass "ieee" everywhere;
`allow_tf32_dots()` lifts the guard so this harness can show what it prevents
(`python -m mingru.bench precision`). The fused delta rule's rows show the third choice its
chunk-local kernels ship with, "tf32x3" (three TF32 products, float32 accuracy), beside all-IEEE
dots and TF32.
"""
import torch
import torch.nn.functional as F

from mingru import ops, scans
from mingru.bench import kernel_hooks
from mingru.bench.timing import kernel_us, max_err, median_us, scan_impl

from mingru.validate import BLOCK_SIZES as KS  # noqa: E402
GATE = 1e-5  # the float32 output gate of the parity harness for the affine scans (absolute)
NAME, SUBJECT = "precision", "variant"
SHAPE, QUICK_SHAPE = (16, 256, 8), (1, 9, 2)  # B, T, n
QUICK_KS = (2, 4)  # the interpreter is slow and ignores input_precision anyway
MATRIX, DELTA = "matrix_affine_scan", "delta_rule"  # the rows' ops
DELTA_SHAPE, QUICK_DELTA_SHAPE = (16, 1024, 4, 64), (1, 9, 1, 16)  # B, T, heads, d_k = d_v


def scan_inputs(B, T, n, k, v, device, seed=0):
    """A GivensMinGRU-like step: A = decay * random orthogonal block, injection (1 - decay) * N(0, 1).

    The state stays of order one over any T, so the rounding of every step accumulates visibly.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed + k)
    q, _ = torch.linalg.qr(torch.randn(B, T, n, k, k, generator=gen, dtype=torch.float64))
    decay = 0.9 + 0.1 * torch.rand(B, T, n, 1, 1, generator=gen, dtype=torch.float64)
    A = (decay * q).float().to(device)
    Bm = ((1 - decay) * torch.randn(B, T, n, k, v, generator=gen, dtype=torch.float64)).float().to(device)
    return A, Bm


def _float64_reference(A, Bm, cot):
    A64, B64 = A.double().requires_grad_(), Bm.double().requires_grad_()
    outs = scans.matrix_affine_scan(A64, B64)
    torch.autograd.backward(outs, [c.double() for c in cot])
    return [o.detach() for o in outs], [A64.grad, B64.grad]


def _run(A, Bm, cot):
    A, Bm = A.clone().requires_grad_(), Bm.clone().requires_grad_()
    outs = ops.matrix_affine_scan(A, Bm)
    torch.autograd.backward(outs, cot)
    return [o.detach() for o in outs], [A.grad, Bm.grad]


def errors(ks=KS, B=16, T=256, n=8, device="cuda", time_it=True, keep=lambda name: True):
    """One row per (k, v, variant): max abs error of outputs and gradients vs float64, and time."""
    variants = {"ieee": (lambda: kernel_hooks.allow_tf32_dots(False), "triton"),
                "tf32": (lambda: kernel_hooks.allow_tf32_dots(True), "triton"),
                "eager": (lambda: kernel_hooks.allow_tf32_dots(False), "eager")}
    variants = {name: v for name, v in variants.items() if keep(name)}
    rows = []
    for k in ks:
        for v in sorted({1, k}):
            A, Bm = scan_inputs(B, T, n, k, v, device)
            cot = [torch.randn_like(A), torch.randn_like(Bm)]
            ref_out, ref_grad = _float64_reference(A, Bm, cot)
            scale = max(r.abs().max().item() for r in ref_out)
            for name, (guard, impl) in variants.items():
                with guard(), scan_impl(impl):
                    out, grad = _run(A, Bm, cot)
                    call = lambda: ops.matrix_affine_scan(A, Bm)  # noqa: E731
                    us = median_us(call, device) if time_it else None
                    gpu = kernel_us(call, device) if time_it else None
                err = max_err(out, ref_out)
                rows.append({"op": MATRIX, "k": k, "v": v, "variant": name, "err_out": err,
                             "err_grad": max_err(grad, ref_grad), "max_abs_out": scale, "fwd_us": us, "gpu_us": gpu,
                             "passes_gate": err <= GATE})
    return rows


def delta_inputs(B, T, H, d, device, seed=0):
    """The fused delta rule's float32 inputs (nh = 1) as DeltaMinGRU forms them: unit keys, write
    strengths in (0, 2), a mild decay (log gamma in about (-0.07, 0)) so the state sums many
    tokens, and an initial state; with float64 copies for the reference."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    exact = [draw(B, T, H, d), F.normalize(draw(B, T, 1, H, d), dim=-1), draw(B, T, 1, H, d),
             2 * torch.sigmoid(draw(B, T, 1, H)), -0.05 * F.softplus(draw(B, T, H)), draw(B, H, d, d)]
    return [x.float().to(device) for x in exact], [x.to(device) for x in exact]


def delta_errors(B, T, H, d, device="cuda", time_it=True, keep=lambda name: True):
    """One row per variant of the fused delta rule: max abs error of (y, h_T) and of the six
    gradients vs the float64 sequential rule, and forward and forward+backward GPU time."""
    from mingru.delta import delta_rule_chunked, delta_rule_recurrent
    inputs, exact = delta_inputs(B, T, H, d, device)
    cot = [torch.randn(B, T, H, d, device=device), torch.randn(B, H, d, d, device=device)]
    exact = [x.requires_grad_() for x in exact]
    ref_out = delta_rule_recurrent(*exact)
    ref_grad = torch.autograd.grad(ref_out, exact, [c.double() for c in cot])
    scale = max(r.abs().max().item() for r in ref_out)
    variants = {"ieee": (lambda: kernel_hooks.split_delta_dots(False), "triton"),
                "tf32x3": (lambda: kernel_hooks.split_delta_dots(True), "triton"),
                "tf32": (lambda: kernel_hooks.allow_tf32_dots(True), "triton"),
                "eager": (lambda: kernel_hooks.allow_tf32_dots(False), "eager")}
    rows = []
    for name, (guard, impl) in variants.items():
        if not keep(name):
            continue
        leaves = [x.clone().requires_grad_() for x in inputs]
        call = lambda: delta_rule_chunked(*leaves, across="fused")  # noqa: E731
        train = lambda: torch.autograd.grad(call(), leaves, cot)  # noqa: E731
        with guard(), scan_impl(impl):
            out, grad = [o.detach() for o in call()], train()
            gpu, gpu_train = (kernel_us(call, device), kernel_us(train, device)) if time_it else (None, None)
            us = median_us(call, device) if time_it else None
        err = max_err(out, ref_out)
        rows.append({"op": DELTA, "k": d, "v": d, "variant": name, "err_out": err, "err_grad": max_err(grad, ref_grad),
                     "max_abs_out": scale, "fwd_us": us, "gpu_us": gpu, "fwd_bwd_gpu_us": gpu_train,
                     "passes_gate": err <= GATE * max(1.0, scale)})
    return rows


def matrix_rows(data):
    """The matrix_affine_scan rows of a precision result (files written before the delta rows had no op)."""
    return [r for r in data["rows"] if r.get("op", MATRIX) == MATRIX]


def compile_plan(device, quick, env, keep=lambda name: True):
    """[(target, cases)] that the compile pool runs once before the sweep: each k's IEEE and TF32 variants."""
    B, T, n = QUICK_SHAPE if quick else SHAPE
    return [("mingru.bench.precision:errors", [((k,), B, T, n, device, False) for k in (QUICK_KS if quick else KS)]),
            ("mingru.bench.precision:delta_errors", [(*(QUICK_DELTA_SHAPE if quick else DELTA_SHAPE), device, False)])]


def measure(device, quick, env, keep=lambda name: True):
    B, T, n = QUICK_SHAPE if quick else SHAPE
    time_it = torch.device(device).type == "cuda"
    return (errors(QUICK_KS if quick else KS, B=B, T=T, n=n, device=device, time_it=time_it, keep=keep)
            + delta_errors(*(QUICK_DELTA_SHAPE if quick else DELTA_SHAPE), device=device, time_it=time_it, keep=keep))


def summarize(rows, env):
    B, T, n = QUICK_SHAPE if env.get("smoke") else SHAPE
    dB = QUICK_DELTA_SHAPE if env.get("smoke") else DELTA_SHAPE
    interp = not str(env.get("device", "cpu")).startswith("cuda")
    notes = [f"matrix_affine_scan on float32 inputs, B={B}, T={T}, n={n}, v in {{1, k}}; A_t = decay * "
             "orthogonal with decay in [0.9, 1], Bm = (1 - decay) N(0, 1)",
             "err_out / err_grad: max abs difference vs the float64 eager scan (outputs; gradients of a "
             "random-cotangent backward); fwd_us: forward median (wall clock); gpu_us: the kernels' own time "
             "from a profiler trace (host removed)",
             "variants: ieee = the kernels as shipped; tf32 = inside allow_tf32_dots(); eager = the "
             "float32 chunked eager reference",
             f"passes_gate: err_out <= {GATE:g}, the parity harness's float32 gate for the affine scans",
             f"{DELTA} rows: the fused delta rule (delta_rule_chunked(..., across='fused')) at B, T, heads, "
             f"d_k = d_v = {', '.join(map(str, dB))}, nh = 1, with decay and an initial state, against the float64 "
             "sequential rule; err_grad over the gradients of q, k, v, beta, log gamma and h_0; variants: ieee = "
             "every dot IEEE; tf32x3 = as shipped (the walks and the gradient kernels IEEE, the chunks' solve and "
             "readouts tf32x3 on GPUs with TF32 tensor cores); tf32 = inside allow_tf32_dots(); eager = the "
             "default chunked form in float32; fwd_bwd_gpu_us: forward and backward, GPU clock; passes_gate: "
             f"err_out <= {GATE:g} max(1, max_abs_out)"]
    if interp:
        notes.append("CPU smoke run: the Triton interpreter computes tl.dot with numpy and ignores "
                     "input_precision, so ieee and tf32 agree here; only a GPU shows the difference")
    ieee = [r for r in matrix_rows({"rows": rows}) if r.get("variant") == "ieee"]
    worst = max(ieee, key=lambda r: r["err_out"], default=None)
    if worst:
        notes.append(f"worst IEEE output error {worst['err_out']:.2e} at k={worst['k']}, v={worst['v']}")
    return {"columns": ["op", "k", "v", "variant", "err_out", "err_grad", "max_abs_out", "fwd_us", "gpu_us",
                        "fwd_bwd_gpu_us", "passes_gate"],
            "notes": notes, "shape": {"B": B, "T": T, "n": n}, "gate": GATE}


def plot(data):
    """Error vs k per variant (v = k), the parity gate as a line, and the forward time beside it."""
    from matplotlib.figure import Figure

    rows = [r for r in matrix_rows(data) if r["v"] == r["k"]]
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    err_ax, time_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    styles = {"ieee": ("C0", "o", "Triton, IEEE guard (shipped)"), "tf32": ("C3", "s", "Triton, TF32 allowed"),
              "eager": ("0.5", "^", "eager float32")}
    for variant, (color, marker, label) in styles.items():
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        ks = [r["k"] for r in mine]
        err_ax.plot(ks, [max(r["err_out"], 1e-12) for r in mine], color=color, marker=marker, label=label)
        clock = "gpu_us" if all(r.get("gpu_us") is not None for r in mine) else "fwd_us"
        if variant != "eager" and all(r[clock] is not None for r in mine):
            time_ax.plot(ks, [r[clock] for r in mine], color=color, marker=marker, label=label)
    if not time_ax.lines:
        time_ax.text(0.5, 0.5, "not timed in this run", ha="center", va="center", transform=time_ax.transAxes)
    err_ax.axhline(data["meta"].get("gate", GATE), color="k", ls=":", lw=1, label="parity gate")
    err_ax.set(xscale="log", yscale="log", xlabel="block size k (v = k)",
               ylabel="max abs error vs float64", title="matrix_affine_scan outputs, float32")
    time_ax.set(xscale="log", yscale="log", xlabel="block size k (v = k)", ylabel="forward time (µs)",
                title="what the guard costs")
    for ax in (err_ax, time_ax):
        ax.set_xticks(KS, [str(k) for k in KS])
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    where = data["env"].get("gpu") or "CPU interpreter (tl.dot precision ignored)"
    fig.suptitle(f"TF32 vs IEEE tl.dot — {where}", fontsize=10)
    return fig
