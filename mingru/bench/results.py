"""The one way notebooks read results: `load(name)` returns a result file and prints where its
numbers come from (GPU, commit, date) and, when they come from another commit than the code
being run, how many commits lie between."""
import os
import subprocess
from pathlib import Path

from mingru.bench import report
from mingru.bench.places import REPO, RESULTS


def read(name, results_dir=RESULTS):
    """The parsed <results_dir>/<name>.json (name may also be a path to a .json file)."""
    path = Path(name)
    return report.load(path if path.suffix == ".json" else Path(results_dir) / f"{name}.json")


def _git(*args):
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commits_between(recorded, head=None):
    """Commits from `recorded` to `head` (default HEAD): 0 when equal, None when git cannot tell."""
    # MINGRU_COMMIT names the commit a copied working tree (without its own history) was taken from
    head = head or os.environ.get("MINGRU_COMMIT") or _git("rev-parse", "HEAD")
    if not recorded or not head:
        return None
    if head.startswith(recorded) or recorded.startswith(head):
        return 0
    count = _git("rev-list", "--count", f"{recorded}..{head}")
    return int(count) if count is not None and count.isdigit() else None


def provenance(env, head=None, cpu=False):
    """One or two lines: where the numbers were measured, and how far their commit is from HEAD. cpu: the
    harness timed the CPU (named with the machine's GPU, if it has one)."""
    commit = env.get("git_commit") or "unknown"
    if cpu:
        where = f"the CPU ({env.get('cpu')})" + (f" of the {env['gpu']} machine" if env.get("gpu") else "")
    else:
        where = "a CPU smoke run (no GPU numbers)" if env.get("smoke") or not env.get("gpu") else env["gpu"]
    line = f"measured on {where} at commit {commit[:10]} ({env.get('date')})"
    between = commits_between(commit, head)
    if between is None:
        return line + "\n  (commit not in this clone's history: cannot say how far it is from the code here)"
    if between:
        return line + f"\n  the code here is {between} commit(s) after the commit these results were measured at"
    return line


def load(name, results_dir=RESULTS, quiet=False):
    """Read <results_dir>/<name>.json and print its provenance; None (with a hint) if it is absent."""
    path = Path(results_dir) / f"{name}.json"
    if not path.exists():
        print(f"{name}.json is not in {results_dir}: `make reproduce` on a GPU writes it.")
        return None
    data = read(name, results_dir)
    if not quiet:
        print(f"{name}: {provenance(data['env'], cpu=data.get('meta', {}).get('device') == 'cpu')}")
    return data
