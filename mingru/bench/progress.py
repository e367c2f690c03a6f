"""A harness's sweep: a tqdm bar (case count, rate, ETA) and a time budget.

Past its budget a sweep stops handing out cases (it always hands out the first); the harness records how many it left out, so a
run stays bounded and says what it did not measure.
"""
import sys
import time

BUDGETS = {}  # harness name -> seconds; set by `python -m mingru.bench --budget` or a caller
SKIPPED = {}  # harness name -> cases left out by the last sweep of that name


class Sweep:
    def __init__(self, name, todo, describe=str, budget=None):
        self.name, self.todo, self.describe = name, list(todo), describe
        self.budget = BUDGETS.get(name) if budget is None else budget
        SKIPPED[name] = 0

    def __iter__(self):
        from tqdm import tqdm

        start = time.monotonic()
        with tqdm(total=len(self.todo), desc=self.name, file=sys.stderr, mininterval=1.0,
                  unit="case", dynamic_ncols=True) as bar:
            for i, case in enumerate(self.todo):
                if i and self.budget is not None and time.monotonic() - start > self.budget:
                    SKIPPED[self.name] = len(self.todo) - i
                    bar.write(f"{self.name}: time budget of {self.budget:.0f} s spent; "
                              f"{SKIPPED[self.name]} of {len(self.todo)} cases not measured", file=sys.stderr)
                    return
                bar.set_postfix_str(self.describe(case)[:60], refresh=False)
                yield case
                bar.update()


def budget_note(name):
    """The note a result file carries when its sweep ran out of time (None when it did not)."""
    left = SKIPPED.get(name, 0)
    if not left:
        return None
    return f"not measured: {left} cases left out when the {BUDGETS.get(name, 0):.0f} s time budget was spent"
