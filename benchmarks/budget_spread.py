"""How far worst budgets move where nothing about the kernels changed: the data the
numerics-regression rule (``attncheck.accepted``) is set from.

Give it labelled report directories of gate runs of the same commit that differ in one
respect: the platform (``ATTNCHECK_CPU_ISA``), the draws (another hypothesis seed or
profile), or nothing (the same run again). For each pair it compares every summary row's
worst budget (kernel x impl x backend x dtype x direction) and prints:

- the records whose numbers differ (``records.numbers_differ``: 0 between two runs of one
  platform and profile is what "one commit, one verdict" means);
- the ratio of the worst budgets, row by row (quantiles and the largest);
- for each candidate rule (factor F, floor L: a row regresses when its budget exceeds
  F x max(accepted, L)), how many rows of the later run the earlier one would flag, and
  whether the run as a whole would have been red: the rule's false-alarm rate on a
  change that is no regression.

    python benchmarks/budget_spread.py avx2=DIR host=DIR [seed1=DIR ...] [--pairs a:b,a:c]
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import statistics
import sys

from attncheck.report.records import Record, numbers_differ

FACTORS = (1.25, 1.5, 2.0, 3.0, 4.0)
FLOORS = (0.0, 0.1, 0.2, 1 / 3, 0.5)
KEY = ("kernel", "impl", "backend", "dtype", "direction")


def _load(directory: pathlib.Path) -> tuple[dict[tuple, float], list[Record]]:
    report = json.loads((directory / "report.json").read_text())
    rows = {tuple(row[k] for k in KEY): float(row["worst_budget"]) for row in report["summary"]
            if row["failures"] == 0}
    return rows, [Record.from_json(r) for r in report["records"]]


def compare(name_a: str, a: pathlib.Path, name_b: str, b: pathlib.Path) -> dict:
    rows_a, records_a = _load(a)
    rows_b, records_b = _load(b)
    common = sorted(rows_a.keys() & rows_b.keys())
    ratios = sorted(rows_b[k] / rows_a[k] for k in common if rows_a[k] > 0 and rows_b[k] > 0)
    alarms = {}
    for factor, floor in itertools.product(FACTORS, FLOORS):
        flagged = [k for k in common if rows_b[k] > factor * max(rows_a[k], floor)]
        alarms[f"{factor:g}x, floor {floor:.2g}"] = len(flagged)
    worst = max(common, key=lambda k: rows_b[k] / rows_a[k] if rows_a[k] > 0 else 0.0, default=None)
    return {"pair": f"{name_a} -> {name_b}", "rows": len(common), "records_differing": len(
        numbers_differ(records_a, records_b)), "records": len(records_b),
        "ratio": {"p50": statistics.median(ratios) if ratios else None,
                  "p90": ratios[int(0.9 * (len(ratios) - 1))] if ratios else None,
                  "max": ratios[-1] if ratios else None,
                  "worst_row": None if worst is None else "/".join(worst),
                  "worst_row_budgets": None if worst is None else [rows_a[worst], rows_b[worst]]},
        "flagged_rows": alarms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="NAME=DIR")
    parser.add_argument("--pairs", default=None, help="comma-separated a:b pairs (default: the first against each)")
    parser.add_argument("--output", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    runs = dict(arg.split("=", 1) for arg in args.runs)
    pairs = ([p.split(":") for p in args.pairs.split(",")] if args.pairs
             else [(next(iter(runs)), other) for other in list(runs)[1:]])
    results = [compare(a, pathlib.Path(runs[a]), b, pathlib.Path(runs[b])) for a, b in pairs]
    for r in results:
        ratio = r["ratio"]
        print(f"{r['pair']}: {r['rows']} rows, {r['records_differing']} of {r['records']} records differ in their "
              f"numbers; budget ratio p50 {ratio['p50']:.3g}, p90 {ratio['p90']:.3g}, max {ratio['max']:.3g} "
              f"({ratio['worst_row']}: {ratio['worst_row_budgets'][0]:.3g} -> {ratio['worst_row_budgets'][1]:.3g})")
        print("    rows flagged: " + "; ".join(f"{rule}: {n}" for rule, n in r["flagged_rows"].items()))
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
