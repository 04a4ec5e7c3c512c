"""One attncheck gate run inside a pytest session: its setup, its hooks and its state.

Registered by the plugin (``attncheck.pytest_plugin``) only when a session asks for
attncheck. The controller (the only process without xdist, else the xdist controller)
owns the report directory for the run: it locks it, marks it INCOMPLETE until the merge,
orders the tests, and merges every worker's records into the report at the end.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import fcntl
import gc
import io
import os
import pathlib
import signal
import sys
import threading
import time

import pytest
from hypothesis import settings

from attncheck import compile_cache, env, expectations, profiles, scheduling, selection, specs, watchdog
from attncheck.report import DEFAULT_DIR as DEFAULT_REPORT_DIR
from attncheck.report import accepted, errormap, merge, model, render
from attncheck.report import records as rec
from attncheck.report.policy import REGRESSION_FLOOR, Policy

LOCK_FILE = ".attncheck.lock"
# The per-test timeout of an attncheck run whose project set none (a kernel that hangs).
DEFAULT_TIMEOUT_S = 900


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


class MaxfailStop:
    """Controller-side: once pytest's session has reached ``--maxfail`` (``-x``), says so
    in a file the workers look for before each case.

    xdist stops handing out tests at the first failure, but every worker still finishes
    the tests it already holds, a drawn test minutes long among them: measured, a planted
    bug reported 55 s into the run ended it only after 208 s. The gate's tests skip
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


# The garbage collector's thresholds in a process of a run (Python's default: 700, 10, 10).
# Tracing a kernel makes millions of short-lived objects; with the defaults an xdist worker
# of the gate ran about 6,700 collections, 22 of them full ones over 2 million live objects,
# 12-13 s of its 190-200 s. With these, 141-155 collections, one full: 2.7-3.3 s, the peak
# memory unchanged (3.1-3.8 GB).
GC_THRESHOLDS = (20000, 20, 20)


class GateSession:
    """The state and hooks of one attncheck run in one pytest process."""

    def __init__(self, config, why: str, setup_warnings: list[str]):
        self.config = config
        self.why = why
        self.is_worker = hasattr(config, "workerinput")
        self.report_arg = config.getoption("attncheck_report") or DEFAULT_REPORT_DIR
        self.report_dir = pathlib.Path(self.report_arg).resolve()
        self.run_id = (config.workerinput["attncheck_run_id"] if self.is_worker
                       else f"{time.strftime('%Y%m%dT%H%M%S')}{os.getpid()}")
        self.worker = config.workerinput["workerid"] if self.is_worker else "main"
        self.started = time.time()
        self._validate_and_select()
        for warning in setup_warnings:  # of env.configure, called before this module was imported
            self._warn(warning)
        if config.getoption("hypothesis_profile", None) is None:
            profiles.load_default()
        # hypothesis' plugin loads a profile named on the command line after this hook.
        self.profile = config.getoption("hypothesis_profile", None) or settings.get_current_profile_name()
        self.platform = env.current_platform()
        floor = config.getoption("attncheck_regression_floor")
        self.policy = Policy.of_specs(
            specs.all_specs().values(), expectations=self.expectations,
            require_coverage=config.getoption("attncheck_require_coverage"),
            accepted_budgets=self.accepted_path,
            regression_floor=REGRESSION_FLOOR if floor is None else floor)
        if config.getoption("timeout", None) is None and not config.getini("timeout"):
            config.option.timeout = DEFAULT_TIMEOUT_S
            config.option.timeout_method = "signal"
        compile_cache.configure(compile_cache.resolve(config.getoption("attncheck_compile_cache")))
        self.writer = rec.RecordWriter(self.report_dir, self.run_id, self.worker)
        self.error_maps = errormap.PastBudget()  # which records carry an error map
        self.durations = self._load_durations()
        self.seconds: collections.Counter = collections.Counter()  # test key -> seconds (controller)
        self.test_outcomes: dict[str, list[str]] = collections.defaultdict(list)  # target -> outcomes
        self.collected: set[str] = set()
        self.lock = None
        if not self.is_worker:
            self._take_the_report_directory()
        self.gc_thresholds = gc.get_threshold()  # restored at unconfigure
        gc.set_threshold(*GC_THRESHOLDS)

    # ------------------------------------------------------------------ setup
    def _validate_and_select(self) -> None:
        config = self.config
        try:
            specs.use_spec_modules(config.getoption("attncheck_spec"), only=config.getoption("attncheck_only_spec"))
            specs.all_specs()
            self.options = selection.Options(backends=config.getoption("attncheck_backend"),
                                             kernels=config.getoption("attncheck_kernel"),
                                             impls=tuple(config.getoption("attncheck_impl")))
            self.options.validate()
            shard = config.getoption("attncheck_shard")
            self.shard = None if shard is None else scheduling.Shard.parse(shard)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        self.expectations = self._load_expectations()
        self.accepted_path = config.getoption("attncheck_accepted_budgets")
        if config.getoption("attncheck_baseline"):
            self._warn("--attncheck-baseline is deprecated: it names the accepted budgets; use "
                       "--attncheck-accepted-budgets")
            self.accepted_path = self.accepted_path or config.getoption("attncheck_baseline")
        if self.accepted_path:
            try:
                accepted.read(pathlib.Path(self.accepted_path))
            except accepted.AcceptedBudgetsError as exc:
                raise pytest.UsageError(f"--attncheck-accepted-budgets: {exc}") from None

    def _load_expectations(self) -> tuple[expectations.Expectation, ...]:
        """The declared deviations of the run: the families' own, and the table of
        ``--attncheck-expectations`` or, without it, of the root directory's pyproject.toml."""
        path = self.config.getoption("attncheck_expectations")
        try:
            table = (expectations.read(pathlib.Path(path)) if path else
                     expectations.read(self.config.rootpath / expectations.DEFAULT_TABLE, required=False))
            families = specs.all_specs()
            shipped = [e for spec in families.values() for e in expectations.shipped(spec)]
            return tuple(expectations.validate([*shipped, *table], families, _invalid_call_names))
        except expectations.ExpectationError as exc:
            raise pytest.UsageError(f"--attncheck-expectations: {exc}") from None

    def _warn(self, message: str) -> None:
        """A warning of the run's setup, shown in pytest's warnings summary."""
        self.config.issue_config_time_warning(pytest.PytestConfigWarning(f"attncheck: {message}"), stacklevel=2)

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

    def _take_the_report_directory(self) -> None:
        self.lock = ReportDirLock(self.report_dir, self.run_id)
        # Until this run merges, the directory says the run is in progress: a run that dies
        # must not leave the previous run's PASS in place.
        render.write(self.report_dir, model.placeholder(self.run_id))
        for stale in ("junit.xml", scheduling.REPORT_FILE):
            (self.report_dir / stale).unlink(missing_ok=True)
        rec.RunInfo(self.run_id, self.started, tuple(self.config.invocation_params.args),
                    None if self.shard is None else str(self.shard), self.policy, self.platform,
                    self.profile, tuple(selection.skipped_backends(self.options))).write(self.report_dir)
        config = self.config
        # xdist's default hands each worker a quarter of its share up front, which undoes the
        # longest-first order; one test at a time keeps it.
        if getattr(config.option, "maxschedchunk", 0) is None:
            config.option.maxschedchunk = 1
        if getattr(config.option, "xmlpath", None) is None and hasattr(config.option, "xmlpath"):
            config.option.xmlpath = str(self.report_dir / "junit.xml")

    @property
    def stop_file(self) -> pathlib.Path:
        return self.report_dir / f".stop-{self.run_id}"

    # ------------------------------------------------------------------ hooks
    def pytest_report_header(self, config):
        from attncheck import backends

        lines = [f"  {name}: {'available' if (reason := b.unavailable_reason()) is None else 'skipped: ' + reason}"
                 + (f" (emulates {b.tpu_device_kind})" if b.tpu_device_kind else "")
                 for name, b in backends.BACKENDS.items()]
        return ["attncheck backends:", *lines,
                f"attncheck platform: {self.platform.describe()}"
                + ("" if self.platform.isa == env.HOST else f" (fixed by attncheck: {env.ISA_ENV}={env.HOST} leaves "
                   "the code to the host)") + (f"; cpu: {self.platform.cpu}" if self.platform.cpu else ""),
                f"attncheck report: {self.report_dir}  hypothesis profile: {settings.get_current_profile_name()}"
                f"  (active: {self.why})"]

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        node.workerinput["attncheck_run_id"] = self.run_id

    def pytest_generate_tests(self, metafunc):
        if "gate_target" in metafunc.fixturenames:
            metafunc.parametrize("gate_target", [
                pytest.param(test, id=test.id, marks=self._marks(test))
                for test in selection.gate_tests(self.options)])
        if "gate_invalid" in metafunc.fixturenames:
            # One test per validation branch of each family and implementation under test (a
            # user's implementation must reject what the convention rejects); a family that
            # declares none simply contributes no test.
            # A declared deviation of a call is a strict xfail: it fails once the call is rejected.
            metafunc.parametrize("gate_invalid", [
                pytest.param(test, id=test.id, marks=[pytest.mark.attncheck_family(test.spec.name)] + (
                    [pytest.mark.xfail(strict=True, reason=f"expected deviation ({entry.source}): {entry.reason}")]
                    if (entry := test.expected(self.expectations)) else []))
                for test in selection.invalid_input_tests(self.options)])

    @staticmethod
    def _marks(test: selection.GateTest) -> list:
        marks = [pytest.mark.attncheck_family(test.spec.name)]
        if test.unavailable:
            marks.append(pytest.mark.skip(reason=f"backend {test.backend_name} unavailable: {test.unavailable}"))
        if test.part == selection.COVERAGE:
            marks.append(getattr(pytest.mark, scheduling.FAIL_FAST_MARKER)(lead=test.share.index == 0))
        return marks

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

            self._keep(config, items, asked_for)
        items[:] = scheduling.run_order(items, self.durations, self._changed_families())
        if self.shard is not None:
            rec.Collection(len(items), scheduling.collection_digest(i.nodeid for i in items)).write(
                self.report_dir, self.run_id)
            shard_of = scheduling.assign(items, self.durations, self.shard.count)
            self._keep(config, items, lambda item: shard_of[item.nodeid] == self.shard.index)

    @staticmethod
    def _keep(config, items: list, wanted) -> None:
        """Deselect the items ``wanted`` says no to, keeping the order of the others."""
        drop = [item for item in items if not wanted(item)]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [item for item in items if wanted(item)]

    def pytest_collection_finish(self, session):
        if not self.is_worker:  # without xdist the controller collects itself
            self.collected.update(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.collected.update(ids)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        if self.is_worker:
            return
        # A test skipped partway (the run stopped at --maxfail) would be recorded as short
        # and scheduled last next time; a skipped test costs nothing wherever it runs.
        if not report.skipped:
            self.seconds[scheduling.test_key(report.nodeid, report.location[0])] += report.duration
        test = selection.test_of_nodeid(self.options, report.nodeid)
        if test is not None and (report.when == "call" or report.outcome != "passed"):
            reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
            self.test_outcomes[test.target_id].append(f"{report.outcome}{': ' + reason if reason else ''}")
        invalid = selection.invalid_test_of_nodeid(self.options, report.nodeid)
        if invalid is not None and invalid.call is not None and (report.when == "call" or report.outcome != "passed"):
            rec.record_invalid_call(self.report_dir, self.run_id, report.nodeid,
                                    dataclasses.asdict(self._invalid_call_outcome(invalid, report)))

    @staticmethod
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

    def pytest_sessionstart(self, session):
        self.writer.log_faults()  # after pytest's faulthandler plugin has set stderr
        self._keep_native_stderr()
        self.watchdog = watchdog.Watchdog(self._end_hung_test)
        self._timed = None  # (item, settings) of the test pytest-timeout's timer runs for
        self.session = session
        if not self.is_worker:
            self.config.pluginmanager.register(MaxfailStop(session, self.stop_file), "attncheck-maxfail-stop")

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
        draws (the nightly's ring_attention drawn test ran 855 s of a 900 s limit on this
        runner), and a hang is a case that does not end."""
        self.writer.started(case_run)
        if self._timed is not None:
            item, settings = self._timed
            self.config.hook.pytest_timeout_cancel_timer(item=item)
            self.config.hook.pytest_timeout_set_timer(item=item, settings=settings)

    def _end_hung_test(self, test: str, limit_s: float) -> None:
        """The watchdog's end of a test past its limit (on the watchdog's thread): the case
        in flight gets its error record, every thread's stack goes to the faults file, and
        the process ends. A worker's controller then replaces it and the run goes on; a run
        without workers (-n 0) merges its report first, so it ends with a verdict."""
        case = self.writer.in_flight
        reason = (f"timed out after {limit_s:g} s (a case's limit, --timeout): the case did not end within "
                  f"{limit_s * (1 + watchdog.GRACE):g} s, so its process was ended; the stack of every thread is "
                  f"in {self.writer.faults_path.name} in the report's records")
        if case is not None:
            self.writer.write(rec.Record(**{f.name: getattr(case, f.name) for f in dataclasses.fields(rec.CaseRun)},
                                         direction="all", outcome="error", reason=reason))
        self.writer.dump_stacks(f"{rec.TIMED_OUT} after {limit_s:g} s in {test}"
                                + (f", case {case.case_id}" if case is not None else "") + ":")
        if not self.is_worker:
            self._merge_and_write(merge.RunOutcome(
                complete=False, wall_s=time.time() - self.started, failed_tests={**self._failed_tests(), test: reason},
                session_problems=(f"the run ended at {test}: it ran past its limit of {limit_s:g} s. Without xdist "
                                  "workers (-n 0) a test that hangs ends the run; with -n 1 or more its worker is "
                                  "replaced and the run goes on (`attncheck gate` always runs one)",)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(watchdog.EXIT_STATUS)

    # ------------------------------------------------------------------ the merge
    def _failed_tests(self) -> dict[str, str]:
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

    def _asked(self) -> dict[str, collections.Counter]:
        """target id -> what its tests did (outcome -> how many), for every target the run
        collected a test of. A backend that is not there is asked for only by name
        (``unavailable_requests``): the default asks for every *available* backend."""
        asked = {}
        for nodeid in sorted(self.collected):
            test = selection.test_of_nodeid(self.options, nodeid)
            if test is not None and test.unavailable is None:
                asked[test.target_id] = collections.Counter(self.test_outcomes.get(test.target_id, ["not run"]))
        return asked

    def _collection(self) -> dict:
        """The whole run's collection, as the process that collected wrote it."""
        collection = rec.Collection.read(self.report_dir, self.run_id)
        return {"collection_size": None if collection is None else collection.size,
                "collection_digest": None if collection is None else collection.digest}

    @staticmethod
    def _session_problems(session, exitstatus) -> list[str]:
        if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
            return []  # failures are reported test by test; no tests is NO CASES
        if exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop:
            return []  # the merge marks the run incomplete
        return [f"pytest ended with exit status {int(exitstatus)} ({exitstatus.name})"]

    def _merge_and_write(self, outcome: merge.RunOutcome, shard: model.ShardInfo | None = None) -> model.Report:
        report = merge.merge(self.report_dir, self.run_id, outcome, self.policy, shard=shard)
        render.write(self.report_dir, report, regression_floor=self.policy.regression_floor,
                     accepted=accepted.read(pathlib.Path(self.accepted_path)) if self.accepted_path else None)
        return report

    def pytest_sessionfinish(self, session, exitstatus):
        if self.is_worker:
            # Its records are written; the controller now waits for it to end. pytest's
            # unconfigure collects twice more (looking for unraisable exceptions) over the
            # 2 million objects a gate worker holds: frozen, they are not scanned. Then
            # ``_end_worker`` skips jax's teardown. Together they took 4-8 s.
            gc.freeze()
            return
        interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or bool(session.shouldstop)
        collect_only = self.config.getoption("collectonly")
        asked = {} if collect_only else self._asked()
        outcome = merge.RunOutcome(
            complete=not interrupted, wall_s=time.time() - self.started, failed_tests=self._failed_tests(),
            asked={target: model.describe_tests(outcomes) for target, outcomes in asked.items()},
            unavailable=tuple(selection.unavailable_requests(self.options)),
            session_problems=tuple(self._session_problems(session, exitstatus)))
        shard = None if self.shard is None else model.ShardInfo(
            self.shard.index, self.shard.count, tests=len(self.collected), **self._collection(),
            asked={target: dict(outcomes) for target, outcomes in asked.items()}, unavailable=outcome.unavailable,
            policy=self.policy)
        report = self._merge_and_write(outcome, shard)
        rec.clear_stale_records(self.report_dir, self.run_id)
        self.stop_file.unlink(missing_ok=True)
        scheduling.write(self.report_dir / scheduling.REPORT_FILE, self.seconds)
        self.report = report
        if report.verdict != model.PASS and session.exitstatus in (pytest.ExitCode.OK,
                                                                   pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        report = getattr(self, "report", None)
        if self.is_worker or report is None:
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

    def pytest_unconfigure(self, config):
        gc.set_threshold(*self.gc_thresholds)
        if self.lock is not None:
            self.lock.release()
        if self.is_worker:
            atexit.register(_end_worker)  # registered last: the first to run


def _invalid_call_names(spec, ref: str) -> list[str]:
    """The descriptions of a family's invalid calls for an implementation (an entry of a
    table names one)."""
    try:
        return [call.description for call in spec.invalid_calls(specs.resolve_impl(ref))]
    except Exception as exc:  # noqa: BLE001 - the entry's implementation cannot be used: say so
        raise expectations.ExpectationError(f"{spec.name}: the invalid calls of {ref} cannot be built "
                                            f"({type(exc).__name__}: {exc})") from None


def _end_worker() -> None:
    """End an xdist worker without the exit handlers registered before (jax's teardown of
    its backends and caches): everything it reports went to the controller and to its
    record files already."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

