"""Figures and tables drawn from result files only, so anyone can regenerate them.

`draw(name)` writes the PNGs of one result file into <results>/figures/; `results_table(name)`
returns its Markdown table (pandas-free) for a notebook to display. Figures are matplotlib Figure
objects built without pyplot, so they render inline in notebooks and save headless anywhere.
"""
from collections import defaultdict
from pathlib import Path

from matplotlib.figure import Figure

from mingru.bench import kernel_hooks, precision, report, scaling
from mingru.bench.places import RESULTS
from mingru.bench.results import read

TINY = 1e-12  # log axes cannot show an exact zero error
NAN = float("nan")  # a missing value draws no bar


def results_table(name, results_dir=RESULTS, columns=None):
    """The Markdown page of a result file (title, environment line, notes, table)."""
    data = name if isinstance(name, dict) else read(name, results_dir)
    return report.render(data, columns)


def _where(data):
    env = data["env"]
    return "CPU smoke run, not GPU numbers" if env.get("smoke") else (env.get("gpu") or "CPU")


def _ok(rows, key):
    return [r for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def _legend(ax, **kwargs):
    if ax.get_legend_handles_labels()[0]:  # an empty smoke-run panel has nothing to name
        ax.legend(**kwargs)


def _grouped_bars(ax, groups, series):
    """One bar per series in every group; series: [(label, {group: value}, color)]. Returns the x's."""
    width = 0.8 / max(len(series), 1)
    positions = []
    for j, (label, values, color) in enumerate(series):
        xs = [g + (j - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [values.get(group) or NAN for group in groups], width, label=label, color=color)
        positions.append(xs)
    return positions


def speedup(data):
    """Bars of eager time / competitor time per op, one panel per shape, log scale."""
    rows = _ok(data["rows"], "eager_us")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig = Figure(figsize=(14, 4.2 * max(len(shapes), 1)), layout="constrained")
    series = [("compile_x", "fwd"), ("compile_x", "fwd+bwd"), ("triton_x", "fwd"), ("triton_x", "fwd+bwd")]
    colors = ["#9ecae1", "#3182bd", "#fdae6b", "#e6550d"]
    for i, shape in enumerate(shapes):
        ax = fig.add_subplot(len(shapes), 1, i + 1)
        # An op can appear at two layouts (rotation_recurrence k=8 and k=2): group by op and dims.
        groups = list(dict.fromkeys((r["op"], r["dims"]) for r in rows if r["shape"] == shape))
        _grouped_bars(ax, groups, [
            (f"{key[:-2]} {direction}", {(r["op"], r["dims"]): r.get(key) for r in rows
                                        if r["shape"] == shape and r["direction"] == direction}, color)
            for (key, direction), color in zip(series, colors)])
        ax.axhline(1, color="black", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(groups)), [f"{op}\n{dims}" for op, dims in groups],
                      rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speedup over eager (x, log)")
        ax.set_title(f"{shape}: speedup over eager PyTorch by wall clock (host included), {_where(data)}")
        _legend(ax, fontsize=8, ncol=4)
    return fig


def _roofline_grid(data, key, ylabel, title, copy_line):
    rows = _ok(data["rows"], key)
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig = Figure(figsize=(12, 3.6 * max(len(ops), 1)), layout="constrained")
    if not ops:  # a smoke run has no GPU clock: say so rather than save a blank image
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, f"no row with {key} in this file", ha="center", va="center")
        ax.set_axis_off()
    for i, op in enumerate(ops):
        for j, direction in enumerate(("fwd", "fwd+bwd")):
            ax = fig.add_subplot(len(ops), 2, 2 * i + j + 1)
            lines = defaultdict(list)
            for r in rows:
                if r["op"] == op and r["direction"] == direction:
                    lines[(r["B"] * r["D"], r["B"], r["D"])].append((r["T"], r[key]))
            for (_, B, D), points in sorted(lines.items()):
                points.sort()
                ax.plot(*zip(*points), marker="o", ms=3, label=f"B={B}, D={D}")
            if copy_line:
                ax.axhline(data["env"]["copy_gbps"], color="black", ls="--", lw=1, label="copy bandwidth")
                ax.set_ylim(bottom=0)
            else:
                ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{op} {direction}", fontsize=10)
            _legend(ax, fontsize=7)
    fig.suptitle(f"{title}, {_where(data)}")
    return fig


def bandwidth(data):
    """Achieved GB/s against T, one line per (B, D), with this run's copy bandwidth."""
    return _roofline_grid(data, "gbps", "achieved GB/s (minimum bytes)", "Triton bandwidth vs T", True)


def bandwidth_gpu(data):
    """The same, from the kernels' durations in a profiler trace: the GPU's own time, without the
    host's per-call cost."""
    return _roofline_grid(data, "gpu_gbps", "achieved GB/s, GPU time (minimum bytes)",
                          "Triton bandwidth vs T, GPU time only", True)


def time_vs_T(data):
    """Triton GPU time against T (log-log): a linear-time scan is a straight line of slope 1. The GPU
    clock, because at short T a call's wall clock is the host's launch cost, flat in T."""
    return _roofline_grid(data, "gpu_us", "GPU time per call (µs, log)", "Triton GPU time vs T", False)


def _memory_key(rows):
    return "peak_mb" if _ok(rows, "peak_mb") else "saved_mb"


def memory_vs_T(data):
    rows = [r for r in data["rows"] if r.get("case") == "vs-T"]
    key = _memory_key(rows)
    fig = Figure(figsize=(9, 5.5), layout="constrained")
    ax = fig.add_subplot()
    lines = defaultdict(list)
    for r in _ok(rows, key):
        lines[(r["mixer"], r["impl"])].append((r["T"], r[key]))
    mixers = sorted({mixer for mixer, _ in lines})
    for (mixer, impl), points in sorted(lines.items()):
        points.sort()
        ax.plot(*zip(*points), marker="o", ms=3, color=f"C{mixers.index(mixer)}",
                ls="-" if impl == "triton" else ":", label=f"{mixer} {impl}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("peak allocated (MiB, log)" if key == "peak_mb" else "saved for backward (MiB, log)")
    ax.set_title(f"Memory of forward + backward vs T, {_where(data)}")
    _legend(ax, fontsize=7, ncol=2)
    return fig


def memory_lab(data):
    """Peak memory per mixer path at the lab shape: one group per path, one bar per implementation
    (log scale, each bar labelled in MiB)."""
    rows = [r for r in data["rows"] if r.get("case") == "lab"]
    key = _memory_key(rows)
    rows = _ok(rows, key)
    mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    colors = {"eager": "#3182bd", "triton": "#e6550d"}
    width = 0.8 / max(len(impls), 1)
    for j, impl in enumerate(impls):
        values = {r["mixer"]: r[key] for r in rows if r["impl"] == impl}
        xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(mixers))]
        bars = ax.bar(xs, [values.get(m, NAN) for m in mixers], width, label=f"MINGRU_SCAN={impl}",
                      color=colors.get(impl))
        ax.bar_label(bars, labels=[f"{values[m]:.3g}" if m in values else "" for m in mixers], fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(mixers)), [m.replace("[", "\n[") for m in mixers], fontsize=9)
    ax.set_ylabel("peak allocated (MiB, log)" if key == "peak_mb" else "saved for backward (MiB, log)")
    dims = f"B={rows[0]['B']}, T={rows[0]['T']}, d={rows[0]['d']}" if rows else ""
    ax.set_title(f"Forward + backward of one mixer, {dims}, {_where(data)}", fontsize=10)
    _legend(ax, fontsize=8)
    return fig


def parity_worst(data):
    """Worst error / allowed tolerance per op and dtype, outputs and gradients (log), a line at 1."""
    rows = [r for r in data["rows"] if isinstance(r.get("out_err"), (int, float))]
    fig = Figure(figsize=(13, 7), layout="constrained")
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    for i, (part, what) in enumerate((("out", "outputs"), ("grad", "gradients"))):
        ax = fig.add_subplot(2, 1, i + 1)
        worst, bound = defaultdict(dict), defaultdict(dict)
        for r in rows:
            ratio, exact = tolerance_ratio(r, part)
            if ratio is not None:
                into = worst if exact else bound
                into[r["dtype"]][r["op"]] = max(into[r["dtype"]].get(r["op"], TINY), ratio, TINY)
        for j, (dtype, xs) in enumerate(zip(dtypes, _grouped_bars(
                ax, ops, [(f"{dtype}", worst[dtype], f"C{j}") for j, dtype in enumerate(dtypes)]))):
            if bound[dtype]:
                ax.bar(xs, [bound[dtype].get(op) or NAN for op in ops], 0.8 / len(dtypes), fill=False,
                       hatch="//", edgecolor=f"C{j}",
                       label=f"{dtype}: error / atol, an upper bound (the file records no relative scale)")
        ax.axhline(1, color="black", ls="--", lw=1, label="allowed: atol + rtol |eager| (pass at or below 1)")
        ax.set_yscale("log")
        ax.set_ylim(bottom=1e-4)  # an exact match (ratio 0) shows as no bar
        ax.set_xticks(range(len(ops)), ops, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(f"worst |triton - eager| / allowed\n{what} (log)")
        _legend(ax, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    summary = data["meta"].get("summary", {})
    fig.suptitle(f"Parity with eager: worst row per op, error over its tolerance "
                 f"({summary.get('passed', '?')} of {summary.get('rows', len(data['rows']))} rows pass), {_where(data)}")
    return fig


def peers_time(data):
    """Time per call of every competitor at every shape: GPU clock (left) and wall clock (right)."""
    fig = Figure(figsize=(15, 8), layout="constrained")
    shapes = list(dict.fromkeys((r["B"], r["T"], r["D"]) for r in data["rows"]))
    names = list(dict.fromkeys(r["competitor"] for r in data["rows"]))
    for j, (key, clock) in enumerate((("gpu_us", "GPU clock"), ("us", "wall clock"))):
        rows = _ok(data["rows"], key)
        for i, direction in enumerate(("fwd", "fwd+bwd")):
            ax = fig.add_subplot(2, 2, 2 * i + j + 1)
            _grouped_bars(ax, shapes, [(name, {(r["B"], r["T"], r["D"]): r[key] for r in rows
                                               if r["competitor"] == name and r["direction"] == direction}, None)
                                       for name in names])
            ax.set_yscale("log")
            ax.set_xticks(range(len(shapes)), [f"B{b}-T{t}-D{d}" for b, t, d in shapes], fontsize=7,
                          rotation=20, ha="right")
            ax.set_xlabel("shape")
            ax.set_ylabel(f"{direction} time, {clock} (µs, log)")
            ax.set_title(f"{direction}, {clock}" + ("" if rows else " (not in this file)"), fontsize=10)
            if i == 0 and j == 1:
                _legend(ax, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("h_t = exp(g_t) h_(t-1) + x_t, and the delta rule (its own shapes, bfloat16), against peers "
                 f"(missing bars: see the table), {_where(data)}")
    return fig


def layout_sweeps(data):
    """Left: time against T at B = 1 per layout (log-log; the slope is the cost of a step).
    Right: bandwidth against B at fixed T, with the copy bandwidth of the same run."""
    key = data["meta"].get("clock", "us")
    rows = _ok(data["rows"], key)
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, name in enumerate(dict.fromkeys(r["layout"] for r in rows)):
        length = [r for r in rows if r["sweep"] == "length" and r["layout"] == name]
        width = [r for r in rows if r["sweep"] == "width" and r["layout"] == name]
        left.loglog([r["T"] for r in length], [r[key] for r in length], "o-", color=f"C{i}", label=name)
        gbps = "gpu_gbps" if key == "gpu_us" else "gbps"
        right.semilogx([r["B"] for r in width], [r[gbps] for r in width], "o-", color=f"C{i}", label=name)
    if data["env"].get("copy_gbps") and not data["env"].get("smoke"):
        right.axhline(data["env"]["copy_gbps"], color="k", ls=":", label="device copy bandwidth")
    clock = "GPU time" if key == "gpu_us" else "wall time"
    D = rows[0]["D"] if rows else "?"
    left.set(xlabel=f"sequence length T (B = 1, D = {D})", ylabel=f"forward {clock} (µs)", title="latency regime")
    width_T = next((r["T"] for r in rows if r["sweep"] == "width"), "?")
    right.set(xlabel=f"batch B (T = {width_T}, D = {D})", ylabel=f"achieved GB/s ({clock})", title="width sweep")
    _legend(left, fontsize=8)
    _legend(right, fontsize=8)
    fig.suptitle(f"linear_scan forward by layout, {_where(data)}")
    return fig


def seed_ratios(data):
    """seed / ours per row by GPU clock and by wall clock (log), with the goals (2x GPU, 1x wall) as lines;
    panels: the ops' fwd, the ops' fwd+bwd, the mixers' fwd+bwd (with seed / ours peak memory)."""
    fig = Figure(figsize=(14, 11), layout="constrained")
    panels = [("ops, fwd", lambda r: r["shape"] != "mixer" and r["direction"] == "fwd"),
              ("ops, fwd+bwd", lambda r: r["shape"] != "mixer" and r["direction"] == "fwd+bwd"),
              ("mixers, fwd+bwd (default constructors)", lambda r: r["shape"] == "mixer")]
    for i, (title, pick) in enumerate(panels):
        ax = fig.add_subplot(3, 1, i + 1)
        mine = [r for r in data["rows"] if pick(r)]
        groups = list(dict.fromkeys((r["op"], r["dims"]) for r in mine))
        series = []
        for dtype in dict.fromkeys(r["dtype"] for r in mine):
            for key, clock in (("x_gpu", "GPU clock"), ("x_wall", "wall clock")):
                series.append((f"{dtype}, {clock}", {(r["op"], r["dims"]): r.get(key) for r in mine
                                                     if r["dtype"] == dtype}, None))
        if i == 2:
            series.append(("peak memory (seed / ours)", {(r["op"], r["dims"]): report.ratio(r.get("seed_peak_mb"),
                                                                                    r.get("ours_peak_mb"))
                                                         for r in mine}, None))
        _grouped_bars(ax, groups, series)
        ax.axhline(2, color="black", ls="--", lw=1, label="goal by GPU clock: 2x")
        ax.axhline(1, color="black", lw=0.8, label="goal by wall clock (and memory): 1x")
        ax.set_yscale("log")
        ax.set_xticks(range(len(groups)), [f"{op}\n{dims}" for op, dims in groups], rotation=30, ha="right",
                      fontsize=7)
        ax.set_ylabel("seed / ours (x, log)")
        ax.set_title(title + ("" if mine else " (not in this file)"), fontsize=10)
        _legend(ax, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"Ours vs mingru-scans 0.2.0, same run (above 1: ours faster; missing bars: see the table), "
                 f"{_where(data)}")
    return fig


def layer_steps(data):
    """Training-step GPU clock, wall clock and peak memory per competitor and shape (log)."""
    rows = data["rows"]
    shapes = list(dict.fromkeys((r["B"], r["T"], r["d"]) for r in rows))
    names = list(dict.fromkeys(r["competitor"] for r in rows))
    fig = Figure(figsize=(13, 11), layout="constrained")
    for i, (key, label) in enumerate((("gpu_us", "GPU clock (µs, log)"), ("us", "wall clock (µs, log)"),
                                      ("peak_mb", "peak memory (MiB, log)"))):
        ax = fig.add_subplot(3, 1, i + 1)
        _grouped_bars(ax, shapes, [(name, {(r["B"], r["T"], r["d"]): r.get(key) for r in rows
                                           if r["competitor"] == name}, None) for name in names])
        ax.set_yscale("log")
        ax.set_xticks(range(len(shapes)), [f"B{b}-T{t}-d{d}" for b, t, d in shapes])
        ax.set_xlabel("shape (batch, sequence length, width)")
        ax.set_ylabel(f"fwd+bwd step, {label}")
        ax.set_title(label.split(" (")[0] + ("" if _ok(rows, key) else " (not in this file)"), fontsize=10)
        if i == 0:
            _legend(ax, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"One recurrent layer's training step (missing bars: see the table), {_where(data)}")
    return fig


def layer_cpu_steps(data):
    rows = data["rows"]
    groups = list(dict.fromkeys((r["mixer"], r["B"], r["T"], r["d"]) for r in rows))
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax = fig.add_subplot()
    _grouped_bars(ax, groups, [(who, {(r["mixer"], r["B"], r["T"], r["d"]): r.get(f"{who}_ms") for r in rows}, None)
                               for who in ("ours", "seed")])
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), [f"{m}\nB{b}-T{t}-d{d}" for m, b, t, d in groups], rotation=30, ha="right",
                  fontsize=7)
    ax.set_ylabel("fwd+bwd step on the CPU (ms, log)")
    _legend(ax, fontsize=8)
    fig.suptitle(f"Default path on a CPU: ours vs mingru-scans 0.2.0, {data['env'].get('cpu') or 'CPU'}")
    return fig


def host_share(data):
    """Wall clock against GPU clock of every Triton call (log-log): on the diagonal the GPU is the cost;
    far above it the host (Python, autograd, launches) is, and no kernel change moves the point down."""
    rows = [r for r in _ok(data["rows"], "triton_gpu_us") if _ok([r], "triton_us")]
    fig = Figure(figsize=(8, 6), layout="constrained")
    ax = fig.add_subplot()
    marks = {"fwd": "o", "fwd+bwd": "s"}
    for i, shape in enumerate(dict.fromkeys(r["shape"] for r in rows)):
        for direction, mark in marks.items():
            pts = [(r["triton_gpu_us"], r["triton_us"]) for r in rows if r["shape"] == shape
                   and r["direction"] == direction]
            if pts:
                ax.scatter(*zip(*pts), marker=mark, color=f"C{i}", label=f"{shape} {direction}")
    if rows:
        lo = min(min(r["triton_gpu_us"], r["triton_us"]) for r in rows)
        hi = max(max(r["triton_gpu_us"], r["triton_us"]) for r in rows)
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="wall = GPU (no host cost)")
        ax.plot([lo, hi], [2 * lo, 2 * hi], color="black", ls="--", lw=0.8, label="wall = 2 x GPU")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("GPU clock per call (µs, log)")
    ax.set_ylabel("wall clock per call (µs, log)")
    ax.set_title("Triton calls: wall clock vs GPU clock" + ("" if rows else " (no GPU clock in this file)")
                 + f", {_where(data)}")
    _legend(ax, fontsize=8)
    return fig


def tolerance_ratio(row, part):
    """(worst error / allowed tolerance, exact) of a parity row's outputs (part 'out') or gradients
    ('grad'): the recorded `<part>_ratio` when present (atol and rtol parts both counted); else, for
    a gate without a relative part, error / atol, which is the same; else error / atol, an upper
    bound, with exact False. (None, False) when the row has no error."""
    if isinstance(row.get(f"{part}_ratio"), (int, float)):
        return row[f"{part}_ratio"], True
    err, gate = row.get(f"{part}_err"), row.get(f"{part}_gate")
    if not isinstance(err, (int, float)) or not gate:
        return None, False
    if err == 0:
        return 0.0, True
    atol, rtol = (float(x) for x in gate.split()[0].split("/"))
    return (err / atol, rtol == 0) if atol > 0 else (None, False)


def parity_summary(data):
    """Per op and dtype: rows, passes, worst error / tolerance (outputs, gradients; '<=' marks an
    upper bound), and the worst distance of each path to the float64 loop."""
    groups = defaultdict(list)
    for r in data["rows"]:
        if r.get("dtype"):
            groups[(r["op"], r["dtype"])].append(r)

    def worst_ratio(rs, part):
        found = [tolerance_ratio(r, part) for r in rs]
        found = [(v, exact) for v, exact in found if v is not None]
        if not found:
            return None
        value, exact = max(found)
        return report.fmt(value) if exact else f"<= {report.fmt(value)}"

    def worst(rs, key):
        return max((r[key] for r in _ok(rs, key)), default=None)
    return [{"op": op, "dtype": dtype, "rows": len(rs), "passed": sum(r.get("pass") is True for r in rs),
             "out / tol": worst_ratio(rs, "out"), "grad / tol": worst_ratio(rs, "grad"),
             "triton_vs_f64": worst(rs, "triton_vs_f64"), "eager_vs_f64": worst(rs, "eager_vs_f64")}
            for (op, dtype), rs in groups.items()]


def memory_seed_rows(data):
    """The mixer rows of seed.json as a peak-memory table: ours, the seed's, their ratio and whether
    ours meets the goal (peak <= the seed's); None where a side has no peak (not measured, CPU)."""
    out = []
    for r in data["rows"]:
        if r.get("shape") != "mixer":
            continue
        ours, seed = r.get("ours_peak_mb"), r.get("seed_peak_mb")
        both = isinstance(ours, (int, float)) and isinstance(seed, (int, float))
        out.append({"mixer": r["op"], "dims": r["dims"], "dtype": r["dtype"], "ours MiB": ours, "seed MiB": seed,
                    "ours / seed": ours / seed if both and seed else None,
                    "meets goal: peak <= seed": (ours <= seed) if both else None,
                    "ours status": r.get("ours_status"), "seed status": r.get("seed_status")})
    return out


def memory_vs_seed(data):
    """Peak memory of each mixer's training step, ours vs mingru-scans 0.2.0, per shape (log)."""
    rows = memory_seed_rows(data)
    groups = list(dict.fromkeys((r["mixer"], r["dims"]) for r in rows))
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax = fig.add_subplot()
    _grouped_bars(ax, groups, [(f"{who} peak", {(r["mixer"], r["dims"]): r[f"{who} MiB"] for r in rows}, color)
                               for who, color in (("ours", "#e6550d"), ("seed", "#756bb1"))])
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), [f"{m}\n{d}" for m, d in groups], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("peak allocated in fwd+bwd (MiB, log)")
    _legend(ax, fontsize=8)
    ax.set_title(f"Mixer training step, ours vs mingru-scans 0.2.0 (missing bars: not measured), {_where(data)}",
                 fontsize=10)
    return fig


# ---- chapter 3: the IEEE guard, judged against the gate and priced by the clock the file holds ----

def guard_clock(data):
    """The key of the precision rows' best clock: the kernels' GPU time when the file has it, else
    the CUDA-event time of one call (host launches included)."""
    return "gpu_us" if _ok(precision.matrix_rows(data), "gpu_us") else "fwd_us"


def guard_cost_rows(data, uses_dot):
    """One row per (k, v) timed with and without the guard: ieee / tf32 time and whether any product
    reaches tl.dot (`uses_dot(k, v)`). Rows without tl.dot run the same instructions in both variants,
    so the spread of their ratios is the run's timing noise, `band` = (min, max); "vs noise" places
    each tl.dot row's ratio above, below or within it."""
    key = guard_clock(data)
    timed = {(r["k"], r["v"], r["variant"]): r[key] for r in _ok(precision.matrix_rows(data), key)}
    rows = []
    for k, v in dict.fromkeys((k, v) for k, v, _ in timed):
        if (k, v, "ieee") in timed and (k, v, "tf32") in timed:
            ieee, tf32 = timed[k, v, "ieee"], timed[k, v, "tf32"]
            rows.append({"k": k, "v": v, "tl.dot": uses_dot(k, v), "ieee_us": ieee, "tf32_us": tf32,
                         "ieee / tf32": ieee / tf32})
    same = [r["ieee / tf32"] for r in rows if not r["tl.dot"]]
    band = (min(same), max(same)) if same else None
    for r in rows:
        ratio = r["ieee / tf32"]
        r["vs noise"] = (None if band is None or not r["tl.dot"] else
                         "guard slower" if ratio > band[1] else "guard faster" if ratio < band[0] else "within")
    return key, rows, band


def precision_vs_gate(data):
    """Output error / the gate per k and variant, one panel per injection width (v = 1, v = k), with
    the line at 1 that a row must stay under."""
    gate = data["meta"].get("gate") or precision.GATE
    rows = _ok(precision.matrix_rows(data), "err_out")
    fig = Figure(figsize=(11, 3.8), layout="constrained")
    styles = {"ieee": ("C0", "o", "Triton, IEEE guard (shipped)"), "tf32": ("C3", "s", "Triton, TF32 allowed"),
              "eager": ("0.5", "^", "eager float32")}
    for i, (title, pick) in enumerate((("v = 1", lambda r: r["v"] == 1), ("v = k", lambda r: r["v"] == r["k"]))):
        ax = fig.add_subplot(1, 2, i + 1)
        for variant, (color, marker, label) in styles.items():
            mine = sorted((r for r in rows if r["variant"] == variant and pick(r)), key=lambda r: r["k"])
            if mine:
                ax.plot([r["k"] for r in mine], [max(r["err_out"], TINY) / gate for r in mine], color=color,
                        marker=marker, label=label)
        ax.axhline(1, color="k", ls=":", lw=1, label=f"gate ({gate:g} absolute)")
        ax.set(xscale="log", yscale="log", xlabel="block size k", ylabel="max abs output error / gate",
               title=f"matrix_affine_scan outputs, {title}")
        ks = sorted({r["k"] for r in rows})
        ax.set_xticks(ks, [str(k) for k in ks])
        _legend(ax, fontsize=8)
    fig.suptitle(f"Error against float64 in units of the parity gate (below 1 passes), {_where(data)}")
    return fig


def guard_cost(data, uses_dot):
    """ieee / tf32 time per (k, v) by the file's best clock, the no-tl.dot rows' spread shaded as noise."""
    key, rows, band = guard_cost_rows(data, uses_dot)
    fig = Figure(figsize=(8, 3.8), layout="constrained")
    ax = fig.add_subplot()
    labels = [f"k={r['k']}, v={r['v']}" for r in rows]
    ax.bar(range(len(rows)), [r["ieee / tf32"] for r in rows], color=["C3" if r["tl.dot"] else "C0" for r in rows])
    ax.bar([0], [0], color="C0", label="no tl.dot: identical code in both variants")
    ax.bar([0], [0], color="C3", label="tl.dot: IEEE float32 vs TF32 tensor cores")
    if band:
        ax.axhspan(*band, color="0.85", zorder=0, label="spread of the identical-code rows (noise)")
    ax.axhline(1, color="k", lw=0.8, label="no cost")
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    clock = "GPU clock (kernels only)" if key == "gpu_us" else "CUDA-event clock (host launches included)"
    ax.set_ylabel("forward time, guard on / off")
    ax.set_title(f"What the IEEE guard costs, {clock}" + ("" if rows else " (not timed in this file)"), fontsize=10)
    _legend(ax, fontsize=7)
    fig.suptitle(f"matrix_affine_scan forward, {_where(data)}", fontsize=10)
    return fig


# ---- chapter 2: the planner's maps, and a cost model of the layouts read from kernel_layout.json ----

def plan_maps(plan, cards, rows, cols, row_label, col_label, what):
    """One heat map per card of `plan(row, col, sms)` (a count, log colour scale), the value in every cell.
    cards: {name: SM count}; the planner is a pure function of the shape and the SM count."""
    from matplotlib.colors import LogNorm

    fig = Figure(figsize=(5 * len(cards), 3.8), layout="constrained")
    grids = {}
    top = max(max(plan(r, c, sms) for r in rows for c in cols) for sms in cards.values())
    for i, (card, sms) in enumerate(cards.items()):
        ax = fig.add_subplot(1, len(cards), i + 1)
        grid = grids[card] = [[plan(r, c, sms) for c in cols] for r in rows]
        image = ax.imshow(grid, cmap="Blues", norm=LogNorm(1, max(top, 2)), aspect="auto")
        for y, line in enumerate(grid):
            for x, value in enumerate(line):
                ax.text(x, y, value, ha="center", va="center", fontsize=7, color="k" if value < top / 4 else "w")
        ax.set_xticks(range(len(cols)), cols)
        ax.set_yticks(range(len(rows)), rows)
        ax.set(title=f"{card} ({sms} SMs)", xlabel=col_label, ylabel=row_label if i == 0 else None)
    fig.colorbar(image, ax=fig.axes, label=f"{what} (log colour)")
    fig.suptitle(f"The planner's {what}: the same rule on each GPU")
    return fig, grids


def _layout_kinds(rows):
    """{layout: 'walk' | 'chunk' | 'auto'} from the length sweep: the walk has tile 1 throughout, the
    chunk loop a longer tile and one segment throughout, the planner's choice anything else."""
    kinds = {}
    for name in dict.fromkeys(r["layout"] for r in rows):
        mine = [r for r in rows if r["layout"] == name and r.get("sweep") == "length" and r.get("chunk")]
        kinds[name] = ("walk" if mine and all(r["chunk"] == 1 for r in mine) else
                       "chunk" if mine and all(r["segments"] == 1 for r in mine) else "auto")
    return kinds


def layout_slopes(data):
    """Per layout, from the B = 1 length sweep: ns per extra step by GPU clock (inputs stay in L2
    between the profiled calls) and by the flushed clock (timing.flushed_us: L2 flushed before every call, so loads
    come from HBM; the host's per-call cost is a constant the slope removes), the tile, and the tile's
    cost in walk steps next to what a one-round-trip-per-tile model predicts (walk slope / tile)."""
    from mingru.bench.layout import slope

    rows = [r for r in data["rows"] if r.get("status") == "ok"]
    kinds = _layout_kinds(rows)
    out, walk = [], {}
    for name, kind in kinds.items():
        length = [r for r in rows if r["layout"] == name and r["sweep"] == "length"]
        warm, cold = slope(length, "gpu_us"), slope(length, "us")
        row = {"layout": name, "kind": kind, "tile": length[-1]["chunk"] if length else None,
               "ns/step GPU clock (L2)": warm and warm * 1e3, "ns/step wall clock (HBM)": cold and cold * 1e3}
        if kind == "walk":
            walk = row
        out.append(row)
    for row in out:
        w, tile, ns = walk.get("ns/step GPU clock (L2)"), row["tile"], row["ns/step GPU clock (L2)"]
        known = bool(w and ns and tile) and row["kind"] != "auto"  # the planner's choice changes with T
        row["tile cost / walk step"] = ns * tile / w if known else None
        row["one-round-trip model ns/step"] = w / tile if known else None
        row["measured / that model"] = ns / (w / tile) if known else None
    return out


def layout_model(data, l2_bytes=None):
    """Each timed row against a cost model built from the length sweep and the copy bandwidth:

    one program's time = steps it walks x the layout's measured cost per step (the walk's for CHUNK = 1,
    the chunk loop's otherwise; a two-pass time split walks seg_len steps, pays half a step more for
    the first pass and one walk step per earlier segment folded into its carry; a single-pass program
    scans its one tile, its waits on earlier tiles unmodelled); the GPU's time is at least
    bytes / copy bandwidth (x 1.5 with a two-pass split: the inputs are read twice). Each row gets the prediction
    with the per-step costs of data in L2 (GPU clock) and from HBM (wall clock); `cache` picks by the
    working set when `l2_bytes` is known, else the nearer of the two; `bound` says which term is larger."""
    import math

    costs = {r["kind"]: r for r in layout_slopes(data)}
    bw = data["env"].get("copy_gbps")
    rows = [r for r in data["rows"] if r.get("status") == "ok" and r.get("gpu_us")]
    kinds = _layout_kinds(data["rows"])
    walk, chunk = costs.get("walk", {}), costs.get("chunk", {})
    out = []
    for r in rows:
        kind = kinds[r["layout"]]
        byte_count = r["gbps"] * 1e9 * r["us"] * 1e-6  # the harness's bytes (inputs read + outputs written once)
        single = r.get("single_pass", False)
        split = r["segments"] > 1 and not single
        floor = byte_count * (1.5 if split else 1) / (bw * 1e3) if bw else 0.0  # µs
        pred = {}
        for cache, key in (("L2", "ns/step GPU clock (L2)"), ("HBM", "ns/step wall clock (HBM)")):
            step = (walk if r["chunk"] == 1 else chunk).get(key)
            if step is None or walk.get(key) is None:
                continue
            seg_len = math.ceil(r["T"] / r["segments"])
            program = (1.5 * seg_len * step + (r["segments"] - 1) * walk[key]) if split else \
                (r["chunk"] if single else r["T"]) * step
            pred[cache] = max(program * 1e-3, floor)
            bound = "bandwidth" if floor >= program * 1e-3 else "program"
        if not pred:
            continue
        measured = r["gpu_us"]
        if l2_bytes and len(pred) == 2:
            cache, how = ("L2" if byte_count <= l2_bytes else "HBM"), "working set vs L2"
        else:
            cache, how = min(pred, key=lambda c: abs(math.log(measured / pred[c]))), "nearer"
        out.append({"sweep": r["sweep"], "layout": r["layout"], "kind": kind, "B": r["B"], "T": r["T"],
                    "segments": r["segments"], "working set MiB": byte_count / 2**20,
                    "predicted µs, L2": pred.get("L2"), "predicted µs, HBM": pred.get("HBM"),
                    "measured µs (GPU clock)": measured, "cache": cache, "picked by": how,
                    "bound": bound, "measured / predicted": measured / pred[cache]})
    return out


def layout_model_figure(rows, where=""):
    """Measured against predicted GPU time per row (log-log), the diagonal and a factor-2 band."""
    fig = Figure(figsize=(7, 5.5), layout="constrained")
    ax = fig.add_subplot()
    for i, kind in enumerate(("walk", "chunk", "auto")):
        mine = [r for r in rows if r["kind"] == kind]
        for cache, marker in (("L2", "o"), ("HBM", "s")):
            pts = [(r[f"predicted µs, {cache}"], r["measured µs (GPU clock)"]) for r in mine if r["cache"] == cache]
            if pts:
                ax.scatter(*zip(*pts), color=f"C{i}", marker=marker, label=f"{kind}, data in {cache}")
    if rows:
        values = [v for r in rows for v in (r["measured µs (GPU clock)"], r[f"predicted µs, {r['cache']}"])]
        lo, hi = min(values) / 1.5, max(values) * 1.5
        ax.plot([lo, hi], [lo, hi], color="k", lw=0.8, label="measured = predicted")
        ax.fill_between([lo, hi], [lo / 2, hi / 2], [2 * lo, 2 * hi], color="0.9", zorder=0, label="within 2x")
        ax.set(xscale="log", yscale="log")
    ax.set(xlabel="predicted GPU time (µs, log)", ylabel="measured GPU time (µs, log)",
           title="linear_scan forward: the layout cost model against the measurement" + (f", {where}" if where else ""))
    _legend(ax, fontsize=8)
    return fig


FIGURES = {
    "precision": {"tf32": precision.plot, "vs_gate": precision_vs_gate,
                  "guard_cost": lambda data: guard_cost(data, kernel_hooks.matrix_uses_dot)},
    "scaling": {"ranks": scaling.figure},
    "seed": {"ratios": seed_ratios},
    "layer": {"steps": layer_steps},
    "layer_cpu": {"steps": layer_cpu_steps},
    "scan_bench": {"speedup": speedup, "host": host_share},
    "roofline": {"bandwidth": bandwidth, "bandwidth_gpu": bandwidth_gpu, "time": time_vs_T},
    "scan_memory": {"vs_T": memory_vs_T, "lab": memory_lab},
    "scan_parity": {"worst": parity_worst},
    "peers": {"time": peers_time},
    "kernel_layout": {"sweeps": layout_sweeps, "model": lambda data: layout_model_figure(layout_model(data), _where(data))},
}


def draw(name, results_dir=RESULTS):
    """Write the PNGs of results/<name>.json into results/figures/; return their paths."""
    data = read(name, results_dir)
    out = Path(results_dir) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for figure, build in FIGURES.get(name, {}).items():
        path = out / f"{name}_{figure}.png"
        build(data).savefig(path, dpi=110)
        paths.append(path)
    return paths


def draw_all(results_dir=RESULTS):
    return [p for name in FIGURES if (Path(results_dir) / f"{name}.json").exists()
            for p in draw(name, results_dir)]
