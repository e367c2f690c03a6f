"""Writers: results/<name>.json (the source of truth) and results/<name>.md (a rendered table)."""
import json
import math
from pathlib import Path

TITLES = {
    "scan_bench": "Scan speed: eager vs torch.compile(eager) vs Triton",
    "roofline": "Achieved bandwidth of the diagonal kernels",
    "scan_memory": "Peak memory of the mixers' forward + backward",
    "scan_parity": "Parity of every kernel with the eager reference",
    "peers": "Diagonal recurrences against peer libraries",
    "kernel_layout": "linear_scan forward by kernel layout",
    "scaling": "Sequence parallelism: one rank's cost and scaling over ranks",
}


def times(x):
    """A ratio as text, two decimals, three where two would round it onto a goal's threshold (0.999 is
    not shown as 1.00, nor 1.996 as 2.00)."""
    text = f"{x:.2f}"
    return f"{x:.3f}" if float(text) in (1.0, 2.0) and x != float(text) else text


def _clean(x):
    """JSON has no NaN or inf: write them as strings so the file stays standard."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write(out_dir, name, env, rows, meta):
    """Write <name>.json and <name>.md under out_dir; return both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = _clean({"name": name, "env": env, "meta": meta, "rows": rows})
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    md_path.write_text(render(data))
    return json_path, md_path


def write_env(out_dir, env):
    path = Path(out_dir) / "env.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(env), indent=1) + "\n")
    return path


def load(path):
    return json.loads(Path(path).read_text())


def env_line(env):
    """One line naming where the numbers come from."""
    where = env.get("gpu") or "CPU"
    if env.get("smoke"):
        where = f"{where} smoke run (--quick: tiny shapes, no GPU numbers)"
    commit = (env.get("git_commit") or "unknown")[:10] + (" (dirty)" if env.get("git_dirty") else "")
    parts = [where, f"driver {env.get('driver')}" if env.get("driver") else None,
             f"CUDA {env['cuda']}" if env.get("cuda") else None, f"torch {env.get('torch')}",
             f"triton {env.get('triton')}", f"python {env.get('python')}", f"commit {commit}",
             env.get("date"), f"copy {fmt(env.get('copy_gbps'))} GB/s"]
    return " · ".join(p for p in parts if p)


def fmt(x):
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "pass" if x else "FAIL"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:.3g}" if (x == 0 or 1e-3 <= abs(x) < 1e5) else f"{x:.2e}"
    return str(x).replace("|", "\\|").replace("\n", " ")


def table_markdown(rows, columns=None):
    """A pandas-free Markdown table: one line per row, the given columns (default: all keys)."""
    if not rows:
        return "(no rows)\n"
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render(data, columns=None):
    """The whole Markdown page of one result file: title, env line, notes, table."""
    meta = data.get("meta", {})
    parts = [f"# {TITLES.get(data['name'], data['name'])}", "", env_line(data["env"]), ""]
    parts += [f"- {note}" for note in meta.get("notes", [])]
    if meta.get("notes"):
        parts.append("")
    parts.append(table_markdown(data["rows"], columns or meta.get("columns")))
    return "\n".join(parts)


# Chapter 4 (speed): every row of a result file kept, every goal judged from the data.

BANDWIDTH_GOAL_PCT = {"fwd": 80, "fwd+bwd": 65}  # goal: share of this run's copy bandwidth at the large shapes
HOST_BOUND = 2.0  # wall clock / GPU clock at or above this: a call's wall time is mostly the host's


def _num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def ratio(a, b):
    """a / b when both are numbers and b is not zero, else None."""
    return a / b if _num(a) and _num(b) and b else None


def verdict(ok):
    """A goal column's cell: yes, NO, or not judged (a side was not measured)."""
    return "not judged" if ok is None else ("yes" if ok else "NO")


def listing(items, empty="none", limit=None):
    """'a; b; c' or `empty`: the rows a take-away names; past `limit` items, how many more the table holds."""
    items = list(items)
    if not items:
        return empty
    if limit is None or len(items) <= limit:
        return "; ".join(items)
    return "; ".join(items[:limit]) + f"; and {len(items) - limit} more (see the table)"


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return None if not n else (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)


SPEED_COLUMNS = ["op", "shape", "dims", "eager_us", "compile_us", "triton_us", "triton_gpu_us", "wall_over_gpu",
                 "triton_x", "triton_vs_compile", "status"]


def speed_rows(data, direction):
    """Every scan_bench row of one direction, in file order, with wall_over_gpu = wall / GPU clock of the
    Triton call (how many times the host's time the kernels' own time is)."""
    return [{**r, "wall_over_gpu": ratio(r.get("triton_us"), r.get("triton_gpu_us"))}
            for r in data["rows"] if r.get("direction") == direction]


def speed_summary(data):
    """Counts and named rows for the take-away: slower than eager or compile, host-bound, not timed."""
    rows = speed_rows(data, "fwd") + speed_rows(data, "fwd+bwd")
    name = lambda r: f"{r['op']} {r.get('dims', '')} {r['direction']}"  # noqa: E731
    timed = [r for r in rows if _num(r.get("triton_x"))]
    compiled = [r for r in rows if _num(r.get("triton_vs_compile"))]
    gpu = [r for r in rows if _num(r["wall_over_gpu"])]
    shapes = dict.fromkeys(r.get("shape") for r in gpu)
    return {
        "rows": len(data["rows"]), "shown": len(rows), "timed": len(timed),
        "slower_than_eager": [f"{name(r)} ({times(r['triton_x'])}x)" for r in timed if r["triton_x"] < 1],
        "compiled": len(compiled),
        "slower_than_compile": [f"{name(r)} ({times(r['triton_vs_compile'])}x)" for r in compiled
                                if r["triton_vs_compile"] < 1],
        "not_ok": [f"{name(r)}: {r.get('status')}" for r in rows if r.get("status") != "ok"],
        "gpu_timed": len(gpu),
        "host_bound": [r for r in gpu if r["wall_over_gpu"] >= HOST_BOUND],
        "wall_over_gpu": {s: _median([r["wall_over_gpu"] for r in gpu if r.get("shape") == s]) for s in shapes},
        "best": max(timed, key=lambda r: r["triton_x"], default=None),
    }


SEED_COLUMNS = ["op", "shape", "dims", "dtype", "direction", "ours_us", "seed_us", "x_wall", "ours_gpu_us",
                "seed_gpu_us", "x_gpu", "x_bound", "meets", "short_of"]
SEED_MIXER_COLUMNS = ["op", "dims", "ours_us", "seed_us", "x_wall", "ours_gpu_us", "seed_gpu_us", "x_gpu",
                      "ours_peak_mb", "seed_peak_mb", "meets", "short_of"]


def seed_short_of(r):
    """Why a seed row misses its goal, or which side has no number."""
    if r.get("meets_goal") is None:
        bad = [f"{side}: {r.get(f'{side}_status')}" for side in ("ours", "seed") if r.get(f"{side}_status") != "ok"]
        return listing(bad, "no GPU clock in this run")
    why = []
    if r["x_gpu"] < 2:
        at = f" (2x needs {200 / r['x_bound']:.0f} % of copy bandwidth)" if _num(r.get("x_bound")) else ""
        why.append(f"GPU {times(r['x_gpu'])}x < 2{at}")
    if r["x_wall"] < 1:
        why.append(f"wall {times(r['x_wall'])}x < 1")
    if _num(r.get("ours_peak_mb")) and _num(r.get("seed_peak_mb")) and r["ours_peak_mb"] > r["seed_peak_mb"]:
        why.append(f"memory {r['ours_peak_mb']:.1f} > {r['seed_peak_mb']:.1f} MiB")
    return listing(why, "")


def seed_rows(data, mixers=False):
    """The seed file's op rows (or mixer rows), every one, with the verdict and what it falls short of."""
    return [{**r, "meets": verdict(r.get("meets_goal")), "short_of": seed_short_of(r)}
            for r in data["rows"] if (r.get("shape") == "mixer") == mixers]


def goal_tally(rows, key="meets_goal"):
    """(met, judged, not judged) over rows whose goal column is True / False / None."""
    judged = [r for r in rows if r.get(key) is not None]
    return sum(bool(r[key]) for r in judged), len(judged), len(rows) - len(judged)


def seed_summary(data, mixers=False):
    rows = seed_rows(data, mixers)
    met, judged, unjudged = goal_tally(rows)
    name = lambda r: f"{r['op']} {r['dims']}" + ("" if mixers else f" {r['dtype']} {r['direction']}")  # noqa: E731
    gpu = [r["x_gpu"] for r in rows if _num(r.get("x_gpu"))]
    short = [r for r in rows if r.get("meets_goal") is False]
    return {"rows": len(rows), "met": met, "judged": judged, "not_judged": unjudged,
            "short": [f"{name(r)} ({r['short_of']})" for r in short],
            "short_by": {part: sum(part in r["short_of"] for r in short) for part in ("GPU", "wall", "memory")},
            "x_gpu_range": (min(gpu), max(gpu)) if gpu else None,
            "slower_gpu": [f"{name(r)} ({times(r['x_gpu'])}x)" for r in rows if _num(r.get("x_gpu")) and r["x_gpu"] < 1],
            "slower_wall": [f"{name(r)} ({times(r['x_wall'])}x)" for r in rows
                            if _num(r.get("x_wall")) and r["x_wall"] < 1]}


def _shape(r, width="d"):
    return f"B{r['B']}-T{r['T']}-{width}{r[width]}"


def layer_pivot(data):
    """One line per competitor, one column per shape: 'GPU µs / wall µs / peak MiB' (or its status)."""
    shapes = list(dict.fromkeys(_shape(r) for r in data["rows"]))
    table = {}
    for r in data["rows"]:
        line = table.setdefault(r["competitor"], {"competitor": r["competitor"]})
        cell = " / ".join(fmt(r.get(k)) for k in ("gpu_us", "us", "peak_mb"))
        line[_shape(r)] = cell if r.get("status") == "ok" or _num(r.get("us")) else fmt(r.get("status"))
    return list(table.values()), ["competitor"] + shapes


LAYER_GOAL_COLUMNS = ["shape", "gpu_us", "lucidrains_compiled_gpu_us", "lucidrains_eager_gpu_us",
                      "vs_lucidrains_compiled_x", "vs_lucidrains_eager_x", "vs_gru_x", "vs_seed_x", "meets"]


def layer_goal_rows(data, ours="ours MinGRU (auto)"):
    """Our auto layer per shape beside lucidrains' times by GPU clock and the goal's verdict."""
    by = {(r["competitor"], _shape(r)): r for r in data["rows"]}
    out = []
    for r in data["rows"]:
        if r["competitor"] != ours:
            continue
        s = _shape(r)
        out.append({**r, "shape": s, "meets": verdict(r.get("meets_goal")),
                    "lucidrains_compiled_gpu_us": by.get(("lucidrains minGRU (compiled)", s), {}).get("gpu_us"),
                    "lucidrains_eager_gpu_us": by.get(("lucidrains minGRU (eager)", s), {}).get("gpu_us")})
    return out


def layer_summary(data, ours="ours MinGRU (auto)"):
    """Per shape: the fastest competitor by GPU clock (wall when no GPU clock) and who beats ours."""
    key = "gpu_us" if any(_num(r.get("gpu_us")) for r in data["rows"]) else "us"
    shapes = {}
    for r in data["rows"]:
        if _num(r.get(key)):
            shapes.setdefault(_shape(r), []).append(r)
    fastest, beaten = {}, []
    for s, rows in shapes.items():
        best = min(rows, key=lambda r: r[key])
        fastest[s] = f"{best['competitor']} ({fmt(best[key])} µs)"
        mine = next((r for r in rows if r["competitor"] == ours), None)
        if mine:
            beaten += [f"{s}: {r['competitor']} {times(mine[key] / r[key])}x faster" for r in rows
                       if r["competitor"] != ours and r[key] < mine[key]]
    goal = layer_goal_rows(data, ours)
    met, judged, unjudged = goal_tally(goal)
    return {"clock": "GPU" if key == "gpu_us" else "wall", "fastest": fastest, "beats_ours": beaten,
            "met": met, "judged": judged, "not_judged": unjudged,
            "short": [r["shape"] for r in goal if r.get("meets_goal") is False]}


def layer_cpu_summary(data):
    rows = data["rows"]
    met, judged, unjudged = goal_tally(rows)
    name = lambda r: f"{r['mixer']} {_shape(r)}"  # noqa: E731
    return {"met": met, "judged": judged, "not_judged": unjudged,
            "short": [f"{name(r)} ({times(r['seed_x'])}x)" for r in rows if r.get("meets_goal") is False],
            "ahead": [f"{name(r)} ({times(r['seed_x'])}x)" for r in rows if r.get("meets_goal")]}


BANDWIDTH_COLUMNS = ["op", "B", "T", "D", "direction", "us", "gpu_us", "pct_copy", "gpu_pct_copy", "goal_pct",
                     "meets", "meets_wall", "status"]


def bandwidth_targets(data, shapes):
    """One line per (op, shape, direction) of the goal shapes, measured or not: the share of the copy
    bandwidth by GPU clock against the goal (meets) and by the flushed clock, `us` (meets_wall)."""
    found = {(r.get("op"), r.get("B"), r.get("T"), r.get("D"), r.get("direction")): r for r in data["rows"]}
    ops = [op for op in dict.fromkeys(r.get("op") for r in data["rows"]) if op != "all"] or ["(no op measured)"]
    out = []
    for op in ops:
        for B, T, D in shapes:
            for direction, goal in BANDWIDTH_GOAL_PCT.items():
                r = found.get((op, B, T, D, direction))
                row = {"op": op, "B": B, "T": T, "D": D, "direction": direction, "goal_pct": goal}
                if r is None:
                    out.append({**row, "meets": verdict(None), "meets_wall": verdict(None),
                                "status": "not in this file"})
                    continue
                gpu, wall = r.get("gpu_pct_copy"), r.get("pct_copy")
                out.append({**r, **row, "meets": verdict(gpu >= goal if _num(gpu) else None),
                            "meets_wall": verdict(wall >= goal if _num(wall) else None)})
    return out


def peers_rows(data):
    """Every peers row with its verdict (ours faster by GPU clock); peers' own rows only carry one."""
    return [{**r, "meets": verdict(r.get("meets_goal")) if r.get("meets_goal") is not None else
             ("ours" if r["competitor"].startswith("mingru.") else verdict(None))} for r in data["rows"]]


PEERS_COLUMNS = ["competitor", "B", "T", "D", "dtype", "direction", "us", "gpu_us", "ours_x", "ours_gpu_x", "meets",
                 "status"]


def peers_summary(data):
    """Per peer: rows, rows where ours is faster by GPU clock and by wall clock, the rows where the peer is
    at least as fast (its speed as a multiple of ours), and the statuses of rows without a time."""
    out = {}
    for r in data["rows"]:
        if r["competitor"].startswith("mingru."):
            continue
        p = out.setdefault(r["competitor"], {"rows": 0, "gpu_judged": 0, "gpu_ours": 0, "wall_judged": 0,
                                             "wall_ours": 0, "losses": [], "wall_losses": [], "missing": set()})
        p["rows"] += 1
        label = f"{_shape(r, 'D')} {r['direction']}"
        for clock, key in (("gpu", "ours_gpu_x"), ("wall", "ours_x")):
            if _num(r.get(key)):
                p[f"{clock}_judged"] += 1
                p[f"{clock}_ours"] += r[key] > 1
                if r[key] <= 1:
                    p["losses" if clock == "gpu" else "wall_losses"].append((1 / r[key], label))
        if not _num(r.get("us")):
            p["missing"].add(str(r.get("status")))
    for p in out.values():  # the largest loss first
        for part in ("losses", "wall_losses"):
            p[part] = [f"{label} ({times(x)}x as fast)" for x, label in sorted(p[part], key=lambda e: -e[0])]
    return out


def chapter_goals(seed=None, layer=None, layer_cpu=None, roofline=None, peers=None, bandwidth_shapes=()):
    """One line per goal this chapter judges: rows met, judged and not judged, from the files given."""
    lines = []

    def add(goal, where, met, judged, unjudged):
        lines.append({"goal": goal, "file": where, "met": met, "judged": judged, "not_judged": unjudged,
                      "all_met": verdict(met == judged if judged else None)})

    if seed:
        add("seed ops: >= 2x by GPU clock, >= 1x by wall", "seed.json", *goal_tally(seed_rows(seed)))
        add("seed mixers: as ops, and peak memory <= the seed's", "seed.json", *goal_tally(seed_rows(seed, True)))
    if layer:
        add("layer: GPU clock <= lucidrains compiled and <= half its eager", "layer.json",
            *goal_tally(layer_goal_rows(layer)))
    if layer_cpu:
        add("CPU: our default path no slower than the seed's eager", "layer_cpu.json", *goal_tally(layer_cpu["rows"]))
    if roofline:
        rows = bandwidth_targets(roofline, bandwidth_shapes)
        judged = [r for r in rows if r["meets"] != "not judged"]
        goal = ", ".join(f"{d} >= {pct} %" for d, pct in BANDWIDTH_GOAL_PCT.items())
        add(f"bandwidth at the large shapes: {goal} of copy (GPU clock)", "roofline.json",
            sum(r["meets"] == "yes" for r in judged), len(judged), len(rows) - len(judged))
    if peers:
        rows = [r for r in peers["rows"] if not r["competitor"].startswith("mingru.")]
        add("peers: ours faster by GPU clock", "peers.json", *goal_tally(rows))
    return lines


def paired_ratio(rows, numerator, denominator, key, match=("B", "T", "D", "direction")):
    """Median over matching rows of numerator's `key` / denominator's `key` (two competitors, same shape)."""
    theirs = {tuple(r.get(m) for m in match): r.get(key) for r in rows if r.get("competitor") == denominator}
    pairs = [ratio(r.get(key), theirs.get(tuple(r.get(m) for m in match)))
             for r in rows if r.get("competitor") == numerator]
    return _median([p for p in pairs if p is not None]), len([p for p in pairs if p is not None])


def has(rows, key):
    """Whether any row holds a number under `key`."""
    return any(_num(r.get(key)) for r in rows)


def with_verdict(rows, key="meets_goal"):
    """The rows with a `meets` column: yes, NO or not judged."""
    return [{**r, "meets": verdict(r.get(key))} for r in rows]


LAYER_CPU_COLUMNS = ["mixer", "B", "T", "d", "ours_ms", "seed_ms", "seed_x", "meets", "ours_status", "seed_status"]
