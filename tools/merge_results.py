"""Join one harness's rows measured by parallel processes (`--only` subsets into separate folders).

    python tools/merge_results.py parity OUT DIR1 DIR2 ...

Writes OUT/<name>.json, .md and figures as a single run would, with the first folder's environment.
"""
import importlib
import sys

from mingru import plots
from mingru.bench import report


def main(harness, out, *dirs):
    module = importlib.import_module(f"mingru.bench.{harness}")
    parts = [report.load(f"{d}/{module.NAME}.json") for d in dirs]
    env, rows = parts[0]["env"], [row for part in parts for row in part["rows"]]
    meta = {"smoke": False, "only": None, "merged_from": [], **module.summarize(rows, env)}
    meta["notes"].append(f"measured by {len(parts)} parallel processes, one subset of subjects each")
    report.write(out, module.NAME, env, rows, meta)
    plots.draw(module.NAME, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
