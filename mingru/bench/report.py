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
