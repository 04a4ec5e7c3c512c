"""What the run's tests did, as the controller hears it (registered there only): which tests were collected, what
each gate target's tests ended as, what each invalid call did (appended to the run's
records as it reports), and which tests failed. The merge (``session.finish``) reads it."""

from __future__ import annotations

import collections
import dataclasses
import pathlib

import pytest

from attncheck import selection
from attncheck.report import model
from attncheck.report import records as rec


class Outcomes:
    def __init__(self, config, options: selection.Options, report_dir: pathlib.Path, run_id: str):
        self.config = config
        self.options = options
        self.report_dir = report_dir
        self.run_id = run_id
        self.test_outcomes: dict[str, list[str]] = collections.defaultdict(list)  # target -> outcomes
        self.collected: set[str] = set()

    def pytest_collection_finish(self, session):
        # Without xdist the controller collects itself; with it, its workers say what they collected.
        self.collected.update(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.collected.update(ids)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        test = selection.test_of_nodeid(self.options, report.nodeid)
        if test is not None and (report.when == "call" or report.outcome != "passed"):
            reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
            self.test_outcomes[test.target_id].append(f"{report.outcome}{': ' + reason if reason else ''}")
        invalid = selection.invalid_test_of_nodeid(self.options, report.nodeid)
        if invalid is not None and invalid.call is not None and (report.when == "call" or report.outcome != "passed"):
            rec.record_invalid_call(self.report_dir, self.run_id, report.nodeid,
                                    dataclasses.asdict(_invalid_call_outcome(invalid, report)))

    def failed_tests(self) -> dict[str, str]:
        """nodeid -> one-line reason of every test (or collection) that failed or errored."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        stats = reporter.stats if reporter is not None else {}
        failed = {}
        for report in [*stats.get("failed", []), *stats.get("error", [])]:
            crash = getattr(report.longrepr, "reprcrash", None)
            lines = str(crash.message if crash is not None else report.longrepr).strip().splitlines() or ["failed"]
            # A crash message starts with the exception; a plain longrepr ends with it.
            failed.setdefault(report.nodeid, lines[0] if crash is not None else lines[-1])
        return failed

    def asked(self) -> dict[str, collections.Counter]:
        """target id -> what its tests did (outcome -> how many), for every target the run
        collected a test of. A backend that is not there is asked for only by name
        (``unavailable_requests``): the default asks for every *available* backend."""
        asked = {}
        for nodeid in sorted(self.collected):
            test = selection.test_of_nodeid(self.options, nodeid)
            if test is not None and test.unavailable is None:
                asked[test.target_id] = collections.Counter(self.test_outcomes.get(test.target_id, ["not run"]))
        return asked


def _invalid_call_outcome(test: selection.InvalidInputTest, report) -> model.InvalidCallOutcome:
    if report.skipped and hasattr(report, "wasxfail"):
        outcome, reason = "expected", report.wasxfail
    elif report.failed and "XPASS(strict)" in str(report.longrepr):
        outcome, reason = "stale", "rejected as the convention asks, though declared a deviation"
    else:
        crash = getattr(report.longrepr, "reprcrash", None)
        outcome = report.outcome
        reason = "" if report.passed else str(crash.message if crash else report.longrepr).strip()[:500]
    return model.InvalidCallOutcome(test.spec.name, test.impl_name, test.impl_ref, test.call.description,
                                    outcome, reason)
