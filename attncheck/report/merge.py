"""Merge a run's records into its report: validated records, the cases that started and
never finished, what was asked for and verified nothing, coverage holes, regressions."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping

from attncheck import accepted, coverage
from attncheck.report import records as rec
from attncheck.report.model import Report, SkippedBackend, build, summarize, unverified_targets

MUTATION_FILE = "mutation.json"


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What the test session knows about a run besides its records."""

    complete: bool  # the session ran to its end (not interrupted, not merged after a death)
    wall_s: float | None = None
    # Tests that failed or errored: node id -> pytest's one-line reason (a timeout, a
    # crashed worker, a failing self-test).
    failed_tests: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Targets asked for (target id -> what asked); None when not known (a run merged after
    # it died before collecting).
    asked: Mapping[str, str] | None = None
    unavailable: tuple[str, ...] = ()  # backends asked for by name that cannot run here
    skipped_backends: tuple[SkippedBackend, ...] = ()
    session_problems: tuple[str, ...] = ()  # e.g. pytest's exit status


def merge(directory: pathlib.Path, run_id: str, outcome: RunOutcome, *,
          applicable: Mapping[str, tuple[str, ...]], accepted_path: str | None = None,
          regression_floor: float = accepted.REGRESSION_FLOOR, require_coverage: bool = False) -> Report:
    directory = pathlib.Path(directory)
    records, problems = rec.read_records(directory, run_id)
    started, marker_problems = rec.read_started(directory, run_id)
    problems += marker_problems
    records = sorted(records + rec.unfinished(run_id, started, records, outcome.failed_tests), key=lambda r: r.key)
    if not outcome.complete:
        problems.append("run interrupted: the report holds the records written before the stop")
    problems += outcome.session_problems
    # A test can fail without a failing record (a failing non-gate test, a harness error):
    # the report must not say PASS then.
    failing_tests = {r.nodeid for r in records if not r.passed}
    problems += [f"{nodeid} failed without a failing record: {reason[:300]}"
                 for nodeid, reason in sorted(outcome.failed_tests.items()) if nodeid not in failing_tests]
    if require_coverage:
        counts = coverage.table(records, applicable)
        problems += [f"coverage: {kernel} never exercised {', '.join(names)}"
                     for kernel, names in coverage.missing(counts, applicable).items()]
    regressions = None
    if accepted_path:
        regressions = accepted.regressions(summarize(records), accepted.read(pathlib.Path(accepted_path)),
                                           regression_floor)
    unverified = list(outcome.unavailable)
    if outcome.asked is not None:
        unverified += unverified_targets(records, outcome.asked)
    return build(records, run_id=run_id, complete=outcome.complete, wall_s=outcome.wall_s, problems=problems,
                 unverified=unverified, skipped_backends=list(outcome.skipped_backends), applicable=applicable,
                 regressions=regressions, mutation=_read_json(directory / MUTATION_FILE))


def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
