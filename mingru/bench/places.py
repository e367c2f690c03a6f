"""Where things live: the repository, its committed results, the scratch folder of smoke runs,
and the measured competitors unpacked by `make peers` (one folder each under .peers/)."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
SCRATCH = REPO / "scratch_out" / "results"
PEERS = REPO / ".peers"
SEED = PEERS / "mingru-scans"  # mingru-scans 0.2.0: imports as `mingru`, so only a subprocess may use it
NOT_MEASURED = "not measured: {} is not unpacked (run `make peers`)"


def peer_on_path(name):
    """Put .peers/<name> on sys.path (never the seed's folder: it would shadow this package); True if it exists."""
    folder = PEERS / name
    if folder == SEED:
        raise ValueError("the seed imports as `mingru`: measure it in a subprocess (mingru.bench.seed)")
    if not folder.is_dir():
        return False
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    return True


def is_committed_results(out):
    """True when `out` is the repository's results/ folder (where only GPU runs may write)."""
    return Path(out).resolve() == RESULTS.resolve()
