"""The controller's end of a run: every worker's records merged into one report under the
run's policy (``report.merge``), written (``report.render``), the run's leftovers cleared,
pytest's exit status made to agree with the verdict, and the verdict printed."""

from __future__ import annotations

import dataclasses
import pathlib
import time

import pytest

from attncheck import scheduling, selection
from attncheck.report import accepted, merge, model, render
from attncheck.report import records as rec
from attncheck.report.policy import Policy
from attncheck.session.outcomes import Outcomes


@dataclasses.dataclass(eq=False)  # a plugin: pluggy tells plugins apart by identity
class Finish:
    config: pytest.Config
    options: selection.Options
    shard: scheduling.Shard | None
    policy: Policy
    accepted_path: str | None
    report_dir: pathlib.Path
    run_id: str
    started: float
    stop_file: pathlib.Path
    outcomes: Outcomes
    report: model.Report | None = None

    def after_hang(self, test: str, limit_s: float, reason: str) -> None:
        """A run without workers ends at a hung test: its verdict first."""
        self._merge_and_write(merge.RunOutcome(
            complete=False, wall_s=time.time() - self.started,
            failed_tests={**self.outcomes.failed_tests(), test: reason},
            session_problems=(f"the run ended at {test}: it ran past its limit of {limit_s:g} s. Without xdist "
                              "workers (-n 0) a test that hangs ends the run; with -n 1 or more its worker is "
                              "replaced and the run goes on (`attncheck gate` always runs one)",)))

    def _merge_and_write(self, outcome: merge.RunOutcome, shard: model.ShardInfo | None = None) -> model.Report:
        report = merge.merge(self.report_dir, self.run_id, outcome, self.policy, shard=shard)
        render.write(self.report_dir, report, regression_floor=self.policy.regression_floor,
                     accepted=accepted.read(pathlib.Path(self.accepted_path)) if self.accepted_path else None)
        return report

    def _shard_info(self, asked: dict, unavailable: tuple) -> model.ShardInfo | None:
        if self.shard is None:
            return None
        collection = rec.Collection.read(self.report_dir, self.run_id)  # as the process that collected wrote it
        return model.ShardInfo(
            self.shard.index, self.shard.count, tests=len(self.outcomes.collected),
            collection_size=None if collection is None else collection.size,
            collection_digest=None if collection is None else collection.digest,
            asked={target: dict(outcomes) for target, outcomes in asked.items()}, unavailable=unavailable,
            policy=self.policy)

    def pytest_sessionfinish(self, session, exitstatus):
        interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or bool(session.shouldstop)
        asked = {} if self.config.getoption("collectonly") else self.outcomes.asked()
        outcome = merge.RunOutcome(
            complete=not interrupted, wall_s=time.time() - self.started, failed_tests=self.outcomes.failed_tests(),
            asked={target: model.describe_tests(outcomes) for target, outcomes in asked.items()},
            unavailable=tuple(selection.unavailable_requests(self.options)),
            session_problems=tuple(_session_problems(session, exitstatus)))
        self.report = self._merge_and_write(outcome, self._shard_info(asked, outcome.unavailable))
        rec.clear_stale_records(self.report_dir, self.run_id)
        self.stop_file.unlink(missing_ok=True)
        if self.report.verdict != model.PASS and session.exitstatus in (pytest.ExitCode.OK,
                                                                        pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        report = self.report
        if report is None:
            return
        terminalreporter.write_sep("=", f"attncheck: {report.verdict}")
        terminalreporter.write_line(f"report: {self.report_dir}/report.md")
        for line in report.unverified:
            terminalreporter.write_line(f"NO CASES: {line}", yellow=True)
        for problem in report.problems:
            terminalreporter.write_line(f"GATE FAILURE: {problem}", red=True)
        for record in [r for r in report.records if r.reason.startswith(rec.UNFINISHED)]:
            # A crashed or killed process: pytest names the test, this the case and the cause.
            terminalreporter.write_line(f"LOST CASE: {record.case_id} ({record.impl}, {record.backend}): "
                                        f"{record.reason}", red=True)
        for line in report.limitations:
            terminalreporter.write_line(f"NOT RUNNABLE: {line}", yellow=True)


def _session_problems(session, exitstatus) -> list[str]:
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
        return []  # failures are reported test by test; no tests is NO CASES
    if exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop:
        return []  # the merge marks the run incomplete
    return [f"pytest ended with exit status {int(exitstatus)} ({exitstatus.name})"]
