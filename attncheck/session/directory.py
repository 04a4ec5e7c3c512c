"""The run's report directory, owned by the controller for the life of the run: locked,
marked INCOMPLETE until the merge, and the file that tells workers the run stopped."""

from __future__ import annotations

import fcntl
import os
import pathlib
import time

import pytest

from attncheck import scheduling
from attncheck.report import model, render
from attncheck.report import records as rec

LOCK_FILE = ".attncheck.lock"


class ReportDirLock:
    """An exclusive lock on a report directory for the life of a run: two live runs
    writing one report would leave one's verdict under the other's records. The kernel
    drops the lock when the process dies, so a dead run never blocks the next one."""

    def __init__(self, directory: pathlib.Path, run_id: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOCK_FILE
        self._file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held for the run
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another run"
            self._file.close()
            raise pytest.UsageError(
                f"--attncheck-report {directory}: in use by {holder}; wait for it to finish or give this run "
                "another report directory") from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"run {run_id} (pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def stop_file(report_dir: pathlib.Path, run_id: str) -> pathlib.Path:
    """The file whose existence tells every worker the run stopped at --maxfail."""
    return report_dir / f".stop-{run_id}"


def take(config, report_dir: pathlib.Path, info: rec.RunInfo) -> ReportDirLock:
    """Lock the directory for this run and say, until the merge, that the run is in
    progress: a run that dies must not leave the previous run's PASS in place."""
    lock = ReportDirLock(report_dir, info.run_id)
    render.write(report_dir, model.placeholder(info.run_id))
    for stale in ("junit.xml", scheduling.REPORT_FILE):
        (report_dir / stale).unlink(missing_ok=True)
    info.write(report_dir)
    # xdist's default hands each worker a quarter of its share up front, which undoes the
    # longest-first order; one test at a time keeps it.
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
    if getattr(config.option, "xmlpath", None) is None and hasattr(config.option, "xmlpath"):
        config.option.xmlpath = str(report_dir / "junit.xml")
    return lock


class MaxfailStop:
    """Controller-side: once pytest's session has reached ``--maxfail`` (``-x``), says so
    in the stop file the workers look for before each case.

    xdist stops handing out tests at the first failure, but every worker still finishes
    the tests it already holds, a drawn test minutes long among them. The gate's tests skip
    their remaining cases when the file exists (``attncheck_stop_point``). The counting is
    pytest's own (``Session.shouldfail``, set by its tryfirst logreport hook, which sees
    the reports xdist relays); this hook runs after it.
    """

    def __init__(self, session, stop_file: pathlib.Path):
        self.session = session
        self.stop_file = stop_file

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        if self.session.shouldfail:
            self.stop_file.parent.mkdir(parents=True, exist_ok=True)
            self.stop_file.touch()
