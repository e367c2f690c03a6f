"""Kernel layout: linear_scan's forward in three forced layouts, over a length and a width sweep.

The layouts are the sequential walk (CHUNK = 1: one dependent step after another), the chunk loop
with the time split turned off, and whatever the diagonal kernels' planner chooses. The length
sweep runs one program per row (B = 1, D = 64): the latency regime, where the slope of GPU time
against T is the cost of one more step. The width sweep holds T and adds rows, to show where the
time split stops paying. Each forced layout is checked against the automatic one before it is
timed; bytes = a, b read once + A, Bc written once.
"""
from mingru.bench import cases, kernel_hooks
from mingru.bench.parity import SKIPPED
from mingru.bench.progress import Sweep
from mingru.bench.timing import failure, flushed_us, kernel_us, scan_impl, within

NAME, SUBJECT = "kernel_layout", "layout"
LAYOUTS = {"sequential walk (CHUNK=1)": dict(chunk=1, segments=1),
           "chunk loop, no time split": dict(segments=1),
           "automatic (plan)": dict()}
# lengths, batch sizes, channels D, the width sweep's T
SWEEPS = {False: ((256, 1024, 4096, 16384), (1, 4, 16, 64, 256, 1024), 64, 4096),
          True: ((16, 48), (1, 2), 4, 32)}


def shapes(quick):
    lengths, widths, D, width_T = SWEEPS[quick]
    return [("length", 1, T, D) for T in lengths] + [("width", B, width_T, D) for B in widths]


def measure(device, quick, env, keep=lambda name: True):
    layouts = {name: force for name, force in LAYOUTS.items() if keep(name)}
    if not cases.kernels_run(device, env):
        return [{"sweep": "all", "layout": name, "status": SKIPPED} for name in layouts]
    import mingru

    rows = []
    for sweep, B, T, D in Sweep("layout", shapes(quick), lambda c: f"{c[0]} B{c[1]}-T{c[2]}-D{c[3]}"):
        a, b = cases.op_inputs("linear_scan", dict(B=B, T=T, D=D), device=device)
        with scan_impl("triton"):
            want = mingru.linear_scan(a, b)
            for layout, force in layouts.items():
                row = {"sweep": sweep, "layout": layout, "B": B, "T": T, "D": D}
                try:
                    with kernel_hooks.forced_layout(**force):
                        if not within(mingru.linear_scan(a, b), want, 1e-5, 1e-5):
                            raise AssertionError("the forced layout disagrees with the automatic one")
                        call = lambda: mingru.linear_scan(a, b)  # noqa: E731
                        us, gpu = flushed_us(call, device, reps=1 if quick else 3), kernel_us(call, device)
                        lay = kernel_hooks.diagonal_plan(B, T, D, a.device)
                except Exception as exc:  # noqa: BLE001  (a layout that fails is a row, not a crash)
                    rows.append({**row, "status": failure(exc)})
                    continue
                gbytes = 4 * a.numel() * a.element_size() / 1e9
                rows.append({**row, "chunk": lay.chunk, "segments": lay.segments, "single_pass": lay.single_pass,
                             "us": us, "gpu_us": gpu,
                             "gbps": gbytes / (us * 1e-6), "gpu_gbps": gpu and gbytes / (gpu * 1e-6),
                             "status": "ok"})
    return rows


def slope(rows, key):
    """Least-squares slope of `key` (µs) against T: the cost of one more step, in µs."""
    pts = [(r["T"], r[key]) for r in rows if r.get(key)]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def summarize(rows, env):
    key = "gpu_us" if any(r.get("gpu_us") for r in rows) else "us"
    slopes = {}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        length = [r for r in rows if r.get("sweep") == "length" and r["layout"] == layout and r.get("us")]
        per_step = slope(length, key)
        if per_step is not None:
            slopes[layout] = {"ns_per_step": per_step * 1e3, "chunk": length[-1]["chunk"],
                              "segments": length[-1]["segments"]}
    return {
        "clock": key,
        "slopes": slopes,
        "columns": ["sweep", "layout", "B", "T", "D", "chunk", "segments", "us", "gpu_us", "gbps", "gpu_gbps",
                    "status"],
        "notes": ["linear_scan forward, float32; bytes = a, b read + A, Bc written once",
                  "layouts forced through the kernels' test override hook; CHUNK=1 is the sequential walk",
                  "us: one call behind an L2 flush (timing.flushed_us, do_bench median); gpu_us: the kernels' "
                  "own time from a torch.profiler trace; slopes use " + key],
    }
