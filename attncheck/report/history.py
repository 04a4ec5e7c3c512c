"""The worst budgets of earlier runs in a report directory: is a kernel getting worse?

Each complete run written to a report directory (``render.write``) adds one line to its
``budget_history.jsonl``: the run id, when it was written, its verdict and the worst budget
of every summary row; the file keeps the last ``MAX_RUNS``. report.html draws them on the trend chart next to this run's
worst budgets and the accepted ones. The accepted budgets say what was agreed; the history
says how the numbers moved since. It only draws: a verdict never depends on it, and a line
that does not parse is left out of the chart.

The report directory of a local run keeps it between runs; a CI job keeps it by caching
that one file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Mapping

from attncheck.report.model import Report, SummaryRow

HISTORY_FILE = "budget_history.jsonl"
MAX_RUNS = 20


def group_key(row: SummaryRow) -> str:
    return "/".join((row.kernel, row.impl, row.backend, row.dtype, row.direction))


@dataclasses.dataclass(frozen=True)
class Entry:
    run_id: str
    finished: float  # time.time()
    verdict: str
    budgets: Mapping[str, float]  # group_key -> worst budget

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "finished": self.finished, "verdict": self.verdict,
                "budgets": {k: v if math.isfinite(v) else str(v) for k, v in self.budgets.items()}}

    @classmethod
    def from_json(cls, data: dict) -> Entry:
        return cls(str(data["run_id"]), float(data["finished"]), str(data["verdict"]),
                   {str(k): float(v) for k, v in data["budgets"].items()})


def read(directory: pathlib.Path) -> list[Entry]:
    """The recorded runs, oldest first; lines that do not parse are left out."""
    try:
        lines = (pathlib.Path(directory) / HISTORY_FILE).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    entries = []
    for line in lines:
        try:
            entries.append(Entry.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return entries


def updated(entries: list[Entry], report: Report) -> list[Entry] | None:
    """The history with this run in it (in place of an earlier merge of the same run), or
    None when the run is not to be recorded: an interrupted run's budgets would mislead."""
    if not report.complete or not report.summary:
        return None
    entry = Entry(report.run_id, time.time(), report.verdict, {group_key(row): row.worst_budget
                                                                 for row in report.summary})
    return [e for e in entries if e.run_id != report.run_id][-(MAX_RUNS - 1):] + [entry]


def dumps(entries: list[Entry]) -> str:
    return "".join(json.dumps(e.to_json(), sort_keys=True) + "\n" for e in entries)
