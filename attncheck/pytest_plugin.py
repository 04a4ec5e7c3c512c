"""pytest plugin of attncheck: inert unless a run asks for it.

Installed through the ``pytest11`` entry point, so it is loaded into every pytest session
of the environment; it changes nothing there (environment, hypothesis profile, junit path,
test order, report files) unless the session asks for attncheck: ``--attncheck``, any
``--attncheck-*`` option, or the gate package (``pytest --pyargs attncheck.gate``) among the
arguments. Then a :class:`GateSession` is registered: it sets up the process (CPU platform
unless a TPU is present, simulated devices), parametrizes the generic gate, orders the
tests, and merges the records into the report with its verdict. Its state lives in
``config.stash``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from typing import TYPE_CHECKING

import pytest

from attncheck import scheduling
from attncheck.report import DEFAULT_DIR as DEFAULT_REPORT_DIR

if TYPE_CHECKING:  # the run imports jax: only an attncheck session loads it
    from attncheck.session import GateSession

GATE_PACKAGE = "attncheck.gate"
GATE_DIR = pathlib.Path(__file__).resolve().parent / "gate"
# ------------------------------------------------------------------ options
# attncheck's options that take no value; every other --attncheck-* option takes one.
FLAG_OPTIONS = ("--attncheck", "--attncheck-only-spec", "--attncheck-require-coverage")


def pytest_addoption(parser):
    group = parser.getgroup("attncheck")
    group.addoption("--attncheck", action="store_true", default=False,
                    help="run as an attncheck gate (implied by any --attncheck-* option and by "
                         f"collecting {GATE_PACKAGE})")
    group.addoption("--attncheck-backend", default=None,
                    help="comma-separated backends to run (default: every available one)")
    group.addoption("--attncheck-kernel", default=None,
                    help="comma-separated kernel families to verify (default: all)")
    group.addoption("--attncheck-report", default=None,
                    help=f"report directory (default: {DEFAULT_REPORT_DIR})")
    group.addoption("--attncheck-impl", action="append", default=[], metavar="FAMILY=MOD:FN",
                    help="verify this implementation for a kernel family instead of the built-in one")
    group.addoption("--attncheck-spec", action="append", default=[], metavar="MODULE",
                    help="also verify the kernel family whose KernelSpec this module exposes as SPEC")
    group.addoption("--attncheck-only-spec", action="store_true", default=False,
                    help="verify only the families given with --attncheck-spec")
    group.addoption("--attncheck-accepted-budgets", default=None, metavar="PATH",
                    help="fail on a numerics regression against these accepted worst budgets "
                         "(written by `attncheck budgets accept`)")
    group.addoption("--attncheck-baseline", default=None, metavar="PATH",
                    help="deprecated name of --attncheck-accepted-budgets")
    group.addoption("--attncheck-regression-floor", type=float, default=None, metavar="BUDGET",
                    help="budgets below this never count as a regression (default: 1/3, the measured "
                         "run-to-run spread of worst cases)")
    group.addoption("--attncheck-compile-cache", default=None, metavar="DIR",
                    help="persistent XLA compilation cache shared by all workers and runs, 'none' for "
                         "none (default: xla/ under $ATTNCHECK_CACHE_DIR, else under .attncheck_cache; "
                         "see attncheck/compile_cache.py)")
    group.addoption("--attncheck-durations", default=None, metavar="PATH",
                    help="test durations of an earlier run (relative to the project root): tests run "
                         f"longest first (default: {scheduling.DEFAULT_FILE})")
    group.addoption("--attncheck-shard", default=None, metavar="K/N",
                    help="run only the K-th of N shards of the run, balanced by the durations; "
                         "`attncheck report merge DIR...` makes the report of the whole run from theirs")
    group.addoption("--attncheck-expectations", default=None, metavar="PATH",
                    help="the declared deviations of your implementations (a TOML file of [[expect]] entries; "
                         "default: [[tool.attncheck.expect]] of the root directory's pyproject.toml; "
                         "`attncheck expectations init` writes them)")
    group.addoption("--attncheck-require-coverage", action="store_true", default=False,
                    help="fail the run if a bug class that applies to a kernel was never exercised")


def _why_active(config) -> str | None:
    """What in this session asks for attncheck, or None."""
    if config.getoption("attncheck"):
        return "--attncheck"
    for option in config._parser.getgroup("attncheck").options:
        dest = option.dest
        if dest != "attncheck" and config.getoption(dest) not in (None, False, []):
            return option.names()[0]
    for arg in config.args:
        path = arg.split("::")[0]
        if path == GATE_PACKAGE or path.startswith(GATE_PACKAGE + "."):
            return arg
        resolved = pathlib.Path(config.invocation_params.dir, path).resolve()
        if resolved == GATE_DIR or GATE_DIR in resolved.parents:
            return arg
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "attncheck_family(name): the kernel family a gate test verifies "
                                       "(--attncheck-kernel selects by it)")
    config.addinivalue_line("markers", f"{scheduling.FAIL_FAST_MARKER}(lead=False): runs before the other "
                                       "tests (lead: before the other fail-fast tests)")
    why = _why_active(config)
    if why is None:
        return
    from attncheck import env

    # Before attncheck.session imports jax and NumPy: both fix their code when they start.
    try:
        setup_warnings = env.configure()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    from attncheck.session import GateSession

    run = GateSession(config, why, setup_warnings)
    config.stash[RUN] = run
    config.pluginmanager.register(run, "attncheck-run")


RUN = pytest.StashKey["GateSession"]()


def gate_run(config) -> GateSession:
    if RUN not in config.stash:
        raise pytest.UsageError("this test is an attncheck gate test: run it with --attncheck "
                                f"(or `attncheck gate`, or `pytest --pyargs {GATE_PACKAGE}`)")
    return config.stash[RUN]


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def attncheck_writer(request):
    return gate_run(request.config).writer


@pytest.fixture
def attncheck_record(request, attncheck_writer):
    """Write one record (a ``Record``), stamped with the test that produced it."""

    def write(record) -> None:
        attncheck_writer.write(dataclasses.replace(record, nodeid=request.node.nodeid))

    return write


@pytest.fixture
def attncheck_kernel_time(attncheck_writer):
    """A context manager around kernel calls a test makes itself, outside check_case:
    the bench counts their time as kernel time instead of harness time."""

    @contextlib.contextmanager
    def timed():
        start = time.perf_counter()
        try:
            yield
        finally:
            attncheck_writer.write_kernel_time(time.perf_counter() - start)

    return timed


@pytest.fixture
def attncheck_stop_point(request):
    """A callable to call before each case: skips the rest of the test once the run has
    stopped at ``--maxfail`` on another worker."""
    path = gate_run(request.config).stop_file

    def check() -> None:
        if path.exists():
            pytest.skip(f"not run: the run stopped at --maxfail={request.config.getoption('maxfail')}")

    return check


@pytest.fixture
def gate_target(request):
    """The generic gate test's parameter; parametrized by an attncheck run."""
    gate_run(request.config)
    raise pytest.UsageError("gate_target is parametrized by the attncheck plugin only for attncheck.gate")


@pytest.fixture
def gate_invalid(request):
    """The invalid-input test's parameter; parametrized by an attncheck run."""
    gate_run(request.config)
    raise pytest.UsageError("gate_invalid is parametrized by the attncheck plugin only for attncheck.gate")
