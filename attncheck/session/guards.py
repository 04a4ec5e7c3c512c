"""What keeps a run's processes honest and quick: XLA's stderr kept where the merge reads
it, a case's time limit counted again as each case starts, the watchdog for a hang the
timeout's signal cannot reach, the garbage collector tuned for tracing, and a worker's
quick end."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import io
import os
import signal
import sys
import threading
from collections.abc import Callable

import pytest

from attncheck import watchdog
from attncheck.report import records as rec

# The garbage collector's thresholds in a process of a run (Python's default: 700, 10, 10):
# tracing a kernel makes millions of short-lived objects, and with the defaults a gate
# worker spends a tenth of its time in full collections over them (docs/DESIGN.md).
GC_THRESHOLDS = (20000, 20, 20)


class ProcessGuards:
    """The guards of one process of a run. ``on_hang(test, limit_s, reason)`` is called
    (on the watchdog's thread) before the process of a hung test ends: the controller
    writes its verdict there, a worker passes None."""

    def __init__(self, config, writer: rec.RecordWriter, on_hang: Callable[[str, float, str], None] | None, *,
                 is_worker: bool):
        self.config = config
        self.writer = writer
        self.is_worker = is_worker
        self._on_hang = on_hang
        self._timed = None  # (item, settings) of the test pytest-timeout's timer runs for
        self.watchdog = watchdog.Watchdog(self._end_hung_test)
        self._gc_thresholds = gc.get_threshold()  # restored at unconfigure
        gc.set_threshold(*GC_THRESHOLDS)

    def pytest_sessionstart(self, session):
        self.writer.log_faults()  # after pytest's faulthandler plugin has set stderr
        self._keep_native_stderr()

    def _keep_native_stderr(self) -> None:
        """Capture file descriptor 2 of each test into the process' stderr file, not
        pytest's unnamed temporary file: XLA writes why it aborts there just before the
        process dies, and the merge quotes it (``records.fatal_errors``). pytest still reads
        and empties the file after each test, as it did its own. Left as pytest has it when
        pytest does not capture the descriptor (-s)."""
        capman = self.config.pluginmanager.getplugin("capturemanager")
        err = getattr(getattr(capman, "_global_capturing", None), "err", None)
        if err is None or getattr(err, "targetfd", None) != 2 or not hasattr(err, "tmpfile"):
            return
        named = io.TextIOWrapper(open(self.writer.stderr_path, "w+b", buffering=0),  # noqa: SIM115
                                 encoding="utf-8", errors="replace", newline="", write_through=True)
        previous, err.tmpfile = err.tmpfile, named
        if getattr(err.syscapture, "tmpfile", None) is previous:
            err.syscapture.tmpfile = named
        if getattr(err, "_state", None) == "started":
            os.dup2(named.fileno(), 2)
        previous.close()

    @pytest.hookimpl(wrapper=True, optionalhook=True)
    def pytest_timeout_set_timer(self, item, settings):
        """Arm the watchdog (``attncheck.watchdog``: a hang the signal cannot reach), and
        re-arm pytest-timeout's SIGALRM on every expiry.

        The signal fires once per test, but hypothesis then replays the failing example to
        report it: a kernel that hangs anywhere the gate test cannot see would hang that
        replay forever with no timer left.
        """
        result = yield
        self._timed = (item, settings)
        self.watchdog.arm(item.nodeid, settings.timeout)
        handler = signal.getsignal(signal.SIGALRM)
        if settings.method == "signal" and callable(handler) and threading.current_thread() is threading.main_thread():
            def rearm(signum, frame):
                __tracebackhide__ = True
                signal.setitimer(signal.ITIMER_REAL, settings.timeout)
                handler(signum, frame)

            signal.signal(signal.SIGALRM, rearm)
        return result

    @pytest.hookimpl(wrapper=True, optionalhook=True)
    def pytest_timeout_cancel_timer(self, item):
        self._timed = None
        self.watchdog.disarm()
        return (yield)

    def case_started(self, case_run: rec.CaseRun) -> None:
        """A gate test's case is about to run: its started marker, and the test's limit
        (pytest-timeout's timer and the watchdog) counted again from now.

        --timeout bounds a case, not the test: a gate test runs as many cases as the profile
        draws, and a hang is a case that does not end."""
        self.writer.started(case_run)
        if self._timed is not None:
            item, settings = self._timed
            self.config.hook.pytest_timeout_cancel_timer(item=item)
            self.config.hook.pytest_timeout_set_timer(item=item, settings=settings)

    def _end_hung_test(self, test: str, limit_s: float) -> None:
        """The watchdog's end of a test past its limit (on the watchdog's thread): the case
        in flight gets its error record, every thread's stack goes to the faults file, and
        the process ends. A worker's controller then replaces it and the run goes on; a run
        without workers (-n 0) writes its verdict first (``on_hang``)."""
        case = self.writer.in_flight
        reason = (f"timed out after {limit_s:g} s (a case's limit, --timeout): the case did not end within "
                  f"{limit_s * (1 + watchdog.GRACE):g} s, so its process was ended; the stack of every thread is "
                  f"in {self.writer.faults_path.name} in the report's records")
        if case is not None:
            self.writer.write(rec.Record(**{f.name: getattr(case, f.name) for f in dataclasses.fields(rec.CaseRun)},
                                         direction="all", outcome="error", reason=reason))
        self.writer.dump_stacks(f"{rec.TIMED_OUT} after {limit_s:g} s in {test}"
                                + (f", case {case.case_id}" if case is not None else "") + ":")
        if self._on_hang is not None:
            self._on_hang(test, limit_s, reason)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(watchdog.EXIT_STATUS)

    def pytest_sessionfinish(self, session, exitstatus):
        if self.is_worker:
            # Its records are written; the controller now waits for it to end. pytest's
            # unconfigure collects twice more (looking for unraisable exceptions) over the
            # millions of objects a gate worker holds: frozen, they are not scanned. Then
            # ``_end_worker`` skips jax's teardown.
            gc.freeze()

    def pytest_unconfigure(self, config):
        gc.set_threshold(*self._gc_thresholds)
        if self.is_worker:
            atexit.register(_end_worker)  # registered last: the first to run


def _end_worker() -> None:
    """End an xdist worker without the exit handlers registered before (jax's teardown of
    its backends and caches): everything it reports went to the controller and to its
    record files already."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
