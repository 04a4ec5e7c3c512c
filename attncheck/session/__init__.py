"""One attncheck gate run inside a pytest session: its setup, and the parts that do its work.

Registered by the plugin (``attncheck.pytest_plugin``) only when a session asks for
attncheck. ``GateSession`` validates the options, reads the declared deviations, builds
the run's policy and registers one plugin per concern:

- ``parametrize``: what the gate's tests (``attncheck/gate/test_gate.py``) run;
- ``order``: the tests' order and this shard's part of them;
- ``guards``: the process' stderr, time limits, watchdog and garbage collector;
- on the controller (the only process without xdist, else the xdist controller), which
  owns the report directory for the run: ``directory`` (locked, marked INCOMPLETE until
  the merge), ``outcomes`` (what the tests did) and ``finish`` (the merge and the verdict).
"""

from __future__ import annotations

import os
import pathlib
import time

import pytest
from hypothesis import settings

from attncheck import compile_cache, env, expectations, profiles, scheduling, selection, specs
from attncheck.report import DEFAULT_DIR as DEFAULT_REPORT_DIR
from attncheck.report import accepted, errormap
from attncheck.report import records as rec
from attncheck.report.policy import REGRESSION_FLOOR, Policy
from attncheck.session import directory
from attncheck.session.finish import Finish
from attncheck.session.guards import ProcessGuards
from attncheck.session.order import Ordering
from attncheck.session.outcomes import Outcomes
from attncheck.session.parametrize import Parametrization

# The per-test timeout of an attncheck run whose project set none (a kernel that hangs).
DEFAULT_TIMEOUT_S = 900


class GateSession:
    """The setup of one attncheck run in one pytest process, and what its gate tests read."""

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
        compiled = compile_cache.resolve(config.getoption("attncheck_compile_cache"))
        compile_cache.configure(compiled)
        if compiled is not None and not self.is_worker:
            compile_cache.trim(compiled)
        self.writer = rec.RecordWriter(self.report_dir, self.run_id, self.worker)
        self.error_maps = errormap.PastBudget()  # which records carry an error map
        self.stop_file = directory.stop_file(self.report_dir, self.run_id)
        self.lock = None
        finish = None
        parts = [Parametrization(self.options, self.expectations),
                 Ordering(config, self.options, self.shard, self.report_dir, self.run_id, self._warn,
                          is_worker=self.is_worker)]
        if not self.is_worker:
            self.lock = directory.take(config, self.report_dir, rec.RunInfo(
                self.run_id, self.started, tuple(config.invocation_params.args),
                None if self.shard is None else str(self.shard), self.policy, self.platform,
                self.profile, tuple(selection.skipped_backends(self.options))))
            outcomes = Outcomes(config, self.options, self.report_dir, self.run_id)
            finish = Finish(config, self.options, self.shard, self.policy, self.accepted_path, self.report_dir,
                            self.run_id, self.started, self.stop_file, outcomes)
            parts += [outcomes, finish]
        self.guards = ProcessGuards(config, self.writer, on_hang=None if finish is None else finish.after_hang,
                                    is_worker=self.is_worker)
        self._finish = finish
        for part in [*parts, self.guards]:
            config.pluginmanager.register(part, f"attncheck-{type(part).__name__.lower()}")

    @property
    def report(self):
        """The run's merged report, once the controller has written it."""
        return None if self._finish is None else self._finish.report

    def case_started(self, case_run: rec.CaseRun) -> None:
        self.guards.case_started(case_run)

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

    def pytest_sessionstart(self, session):
        if not self.is_worker:
            self.config.pluginmanager.register(directory.MaxfailStop(session, self.stop_file),
                                               "attncheck-maxfail-stop")

    def pytest_unconfigure(self, config):
        if self.lock is not None:
            self.lock.release()


def _invalid_call_names(spec, ref: str) -> list[str]:
    """The descriptions of a family's invalid calls for an implementation (an entry of a
    table names one)."""
    try:
        return [call.description for call in spec.invalid_calls(specs.resolve_impl(ref))]
    except Exception as exc:  # noqa: BLE001 - the entry's implementation cannot be used: say so
        raise expectations.ExpectationError(f"{spec.name}: the invalid calls of {ref} cannot be built "
                                            f"({type(exc).__name__}: {exc})") from None
