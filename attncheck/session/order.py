"""The order the run's tests go in, and this shard's part of them: --attncheck-kernel's
selection by family marker, the changed families and the longest tests first
(``attncheck.scheduling``), then --attncheck-shard. The controller measures each test's
time for the next run's order."""

from __future__ import annotations

import collections
import pathlib
from collections.abc import Callable

import pytest

from attncheck import scheduling, selection
from attncheck.report import records as rec


class Ordering:
    def __init__(self, config, options: selection.Options, shard: scheduling.Shard | None,
                 report_dir: pathlib.Path, run_id: str, warn: Callable[[str], None], *, is_worker: bool):
        self.config = config
        self.options = options
        self.shard = shard
        self.report_dir = report_dir
        self.run_id = run_id
        self._warn = warn
        self.is_worker = is_worker
        self.durations = self._load_durations()
        self.seconds: collections.Counter = collections.Counter()  # test key -> seconds (controller)

    def _durations_path(self) -> pathlib.Path:
        return self.config.rootpath / (self.config.getoption("attncheck_durations") or str(scheduling.DEFAULT_FILE))

    def _load_durations(self) -> dict[str, float]:
        path = self._durations_path()
        try:
            return scheduling.load_with_packaged(path)
        except (OSError, ValueError) as exc:
            # It only orders the tests: a bad file costs speed, never a verdict.
            self._warn(f"--attncheck-durations: ignoring {path}: {exc}")
            return {}

    def _changed_families(self) -> dict[str, int]:
        path = scheduling.sources_path(self._durations_path())
        # The families' implementations, not their gate tests: listing those would search
        # every family's coverage examples, in a session that may collect none of them.
        refs = {spec.name: set(self.options.implementations(spec).values()) for spec in self.options.selected_specs()}
        try:
            return scheduling.changed_families(refs, scheduling.load_sources(path))
        except (ImportError, OSError, TypeError, ValueError) as exc:  # like the durations: speed only
            self._warn(f"ignoring {path}: {exc}")
            return {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        """--attncheck-kernel also selects the gate's other tests, by their family marker (a
        mutant of one family must be judged by that family's tests alone); then the order,
        then --attncheck-shard keeps this shard's part of it."""
        if self.options.kernels:
            wanted = {spec.name for spec in self.options.selected_specs()}

            def asked_for(item) -> bool:
                marker = item.get_closest_marker(scheduling.FAMILY_MARKER)
                return marker is None or marker.args[0] in wanted

            _keep(config, items, asked_for)
        items[:] = scheduling.run_order(items, self.durations, self._changed_families())
        if self.shard is not None:
            rec.Collection(len(items), scheduling.collection_digest(i.nodeid for i in items)).write(
                self.report_dir, self.run_id)
            shard_of = scheduling.assign(items, self.durations, self.shard.count)
            _keep(config, items, lambda item: shard_of[item.nodeid] == self.shard.index)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        # A test skipped partway (the run stopped at --maxfail) would be recorded as short
        # and scheduled last next time; a skipped test costs nothing wherever it runs.
        if not self.is_worker and not report.skipped:
            self.seconds[scheduling.test_key(report.nodeid, report.location[0])] += report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        if not self.is_worker:
            scheduling.write(self.report_dir / scheduling.REPORT_FILE, self.seconds)


def _keep(config, items: list, wanted: Callable) -> None:
    """Deselect the items ``wanted`` says no to, keeping the order of the others."""
    drop = [item for item in items if not wanted(item)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [item for item in items if wanted(item)]
