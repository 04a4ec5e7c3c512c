"""pytest plugin: options, hypothesis profiles, multi-device setup, records and the merge.

Loaded through the ``pytest11`` entry point, i.e. in every xdist worker before any test
module imports jax: that is where the host-platform device count must be set.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import pathlib
import signal
import threading
import time

from attncheck import compile_cache, scheduling, xla_env

xla_env.configure_before_jax_import()

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

from attncheck.report import records as rec  # noqa: E402

DEFAULT_REPORT_DIR = "reports/latest"
# The CI profile skips shrinking: interpret mode makes each shrink step cost seconds, and
# the recorded case id already is an exact, one-command reproducer.
CI_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)
# Examples per (spec, backend) are set by each spec for the ci profile; others scale them.
PROFILE_SCALE = {"dev": 0.34, "ci": 1.0, "nightly": 8.0}

settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, database=None, phases=CI_PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "dev", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "nightly", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev")


def examples_for(base: int) -> int:
    """Scale a spec's CI example count to the active hypothesis profile."""
    scale = PROFILE_SCALE.get(settings.get_current_profile_name(), 1.0)
    return max(1, round(base * scale))


def draw_seed(*names: str) -> int | None:
    """The seed of a gate test's draws under a derandomized profile, from what the test
    verifies (family, backend): hypothesis would otherwise derive it from the test
    function's source, so any edit of the test body would change every case drawn. None
    (hypothesis' own random seed) in the other profiles."""
    if not settings.default.derandomize:
        return None
    return int.from_bytes(hashlib.sha256("/".join(names).encode()).digest()[:8], "little")


def pytest_addoption(parser):
    group = parser.getgroup("attncheck")
    group.addoption("--attncheck-backend", default=None,
                    help="comma-separated backends to run (default: every available one)")
    group.addoption("--attncheck-kernel", default=None,
                    help="comma-separated kernel families to verify (default: all)")
    group.addoption("--attncheck-report", default=DEFAULT_REPORT_DIR,
                    help="report directory (default: %(default)s)")
    group.addoption("--attncheck-impl", action="append", default=[], metavar="FAMILY=MOD:FN",
                    help="verify this implementation for a kernel family instead of the built-in one")
    group.addoption("--attncheck-spec", action="append", default=[], metavar="MODULE",
                    help="also verify the kernel family whose KernelSpec this module exposes as SPEC")
    group.addoption("--attncheck-only-spec", action="store_true",
                    help="verify only the families given with --attncheck-spec")
    group.addoption("--attncheck-baseline", default=None, metavar="PATH",
                    help="fail on a numerics regression against this baseline.json")
    group.addoption("--attncheck-regression-floor", type=float, default=None, metavar="BUDGET",
                    help="budgets below this never count as a regression (default: 1/3, the measured "
                         "run-to-run spread of worst cases)")
    group.addoption("--attncheck-compile-cache", default=None, metavar="DIR",
                    help="persistent XLA compilation cache shared by all workers and runs (default: "
                         "$JAX_COMPILATION_CACHE_DIR, else none: see attncheck/compile_cache.py for the "
                         "interpret-mode deadlock a warm cache provoked)")
    group.addoption("--attncheck-durations", default=str(scheduling.DEFAULT_FILE), metavar="PATH",
                    help="test durations of an earlier run (relative to the project root): tests run "
                         "longest first (default: %(default)s)")
    group.addoption("--attncheck-require-coverage", action="store_true",
                    help="fail the run if a bug class that applies to a kernel was never exercised")


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def report_dir(config) -> pathlib.Path:
    return pathlib.Path(config.getoption("--attncheck-report")).resolve()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    from attncheck import specs

    config.addinivalue_line("markers", f"{scheduling.FAIL_FAST_MARKER}(lead=False): runs before the other tests "
                                       "(lead: before the other fail-fast tests)")
    if config.getoption("--attncheck-only-spec"):
        specs.SPEC_MODULES.clear()
    specs.add_spec_modules(config.getoption("--attncheck-spec"))
    cache = compile_cache.resolve(config.getoption("--attncheck-compile-cache"))
    if cache is not None:
        compile_cache.enable(cache)
    if _is_worker(config):
        config._attncheck_run_id = config.workerinput["attncheck_run_id"]
        return
    config._attncheck_run_id = f"{time.strftime('%Y%m%dT%H%M%S')}{os.getpid()}"
    config._attncheck_started = time.time()
    config._attncheck_durations = DurationRecorder()
    config.pluginmanager.register(config._attncheck_durations, "attncheck-durations")
    # xdist's default hands each worker a quarter of its share up front, which undoes the
    # longest-first order; one test at a time keeps it.
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
    directory = report_dir(config)
    if getattr(config.option, "xmlpath", None) is None and hasattr(config.option, "xmlpath"):
        directory.mkdir(parents=True, exist_ok=True)
        config.option.xmlpath = str(directory / "junit.xml")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["attncheck_run_id"] = node.config._attncheck_run_id


def pytest_report_header(config):
    from attncheck import backends

    lines = []
    for name, backend in backends.BACKENDS.items():
        reason = backend.unavailable_reason()
        lines.append(f"  {name}: {'available' if reason is None else 'skipped: ' + reason}")
    return ["attncheck backends:", *lines,
            f"attncheck report: {report_dir(config)}  hypothesis profile: "
            f"{settings.get_current_profile_name()}"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    durations = scheduling.load(config.rootpath / config.getoption("--attncheck-durations"))
    items[:] = scheduling.run_order(items, durations)


class DurationRecorder:
    """Controller-side: setup + call + teardown seconds of every test, from the reports
    (xdist relays the workers' reports here), written next to the run's report."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()

    def pytest_runtest_logreport(self, report):
        # A test skipped partway (the run stopped at --maxfail) would be recorded as short
        # and scheduled last next time; a skipped test costs nothing wherever it runs.
        if not report.skipped:
            self.seconds[report.nodeid] += report.duration


def _stop_file(config) -> pathlib.Path:
    return report_dir(config) / f".stop-{config._attncheck_run_id}"


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

    def __init__(self, session):
        self.session = session

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        if self.session.shouldfail:
            stop = _stop_file(self.session.config)
            stop.parent.mkdir(parents=True, exist_ok=True)
            stop.touch()


def pytest_sessionstart(session):
    if not _is_worker(session.config):
        session.config.pluginmanager.register(MaxfailStop(session), "attncheck-maxfail-stop")


@pytest.fixture
def attncheck_stop_point(request):
    """A callable to call before each case: skips the rest of the test once the run has
    stopped at ``--maxfail`` on another worker."""
    path = _stop_file(request.config)

    def check() -> None:
        if path.exists():
            pytest.skip(f"not run: the run stopped at --maxfail={request.config.getoption('maxfail')}")

    return check


@pytest.fixture(scope="session")
def attncheck_writer(request):
    config = request.config
    worker = config.workerinput["workerid"] if _is_worker(config) else "main"
    return rec.RecordWriter(report_dir(config), config._attncheck_run_id, worker)


@pytest.fixture
def attncheck_record(request, attncheck_writer):
    """Write one record, stamped with the test that produced it."""

    def write(record: dict) -> None:
        attncheck_writer.write({**record, "nodeid": request.node.nodeid})

    return write


@pytest.fixture
def attncheck_kernel_time(attncheck_writer):
    """A context manager around kernel calls a test makes itself, outside gate.check_case:
    the bench counts their time as kernel time instead of harness time."""

    @contextlib.contextmanager
    def timed():
        start = time.perf_counter()
        try:
            yield
        finally:
            attncheck_writer.write_kernel_time(time.perf_counter() - start)

    return timed


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """Re-arm pytest-timeout's SIGALRM on every expiry.

    The signal fires once per test, but hypothesis then replays the failing example to
    report it: a kernel that hangs would hang that replay forever with no timer left. With
    the timer re-armed the replay times out too and the test fails with the timeout message.
    """
    result = yield
    handler = signal.getsignal(signal.SIGALRM)
    if settings.method == "signal" and callable(handler) and threading.current_thread() is threading.main_thread():
        def rearm(signum, frame):
            __tracebackhide__ = True
            signal.setitimer(signal.ITIMER_REAL, settings.timeout)
            handler(signum, frame)

        signal.signal(signal.SIGALRM, rearm)
    return result


def _failed_tests(config) -> dict[str, str]:
    """nodeid -> one-line reason of every test (or collection) that failed or errored."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter is not None else {}
    failed = {}
    for report in [*stats.get("failed", []), *stats.get("error", [])]:
        crash = getattr(report.longrepr, "reprcrash", None)
        lines = str(crash.message if crash is not None else report.longrepr).strip().splitlines() or ["failed"]
        # A crash message starts with the exception; a plain longrepr ends with it.
        failed.setdefault(report.nodeid, lines[0] if crash is not None else lines[-1])
    return failed


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if _is_worker(config):
        return
    from attncheck.report import render

    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop
    result = render.write_reports(
        report_dir(config), run_id=config._attncheck_run_id,
        complete=not interrupted, selected_backends=config.getoption("--attncheck-backend"),
        baseline_path=config.getoption("--attncheck-baseline"),
        require_coverage=config.getoption("--attncheck-require-coverage"),
        wall_s=time.time() - config._attncheck_started, failed_tests=_failed_tests(config),
        **({} if config.getoption("--attncheck-regression-floor") is None
           else {"regression_floor": config.getoption("--attncheck-regression-floor")}))
    rec.clear_stale_records(report_dir(config), config._attncheck_run_id)
    _stop_file(config).unlink(missing_ok=True)
    scheduling.write(report_dir(config) / scheduling.REPORT_FILE, config._attncheck_durations.seconds)
    config._attncheck_gate_problems = result.problems
    if result.problems and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _is_worker(config):
        return
    problems = getattr(config, "_attncheck_gate_problems", [])
    terminalreporter.write_sep("=", "attncheck")
    terminalreporter.write_line(f"report: {report_dir(config)}/report.md")
    for problem in problems:
        terminalreporter.write_line(f"GATE FAILURE: {problem}", red=True)
