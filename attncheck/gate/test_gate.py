"""The gate: every kernel family x implementation x backend against the oracle.

For each case the forward output and every gradient are compared with the float64 oracle
under the tolerance policy (attncheck.numerics); one record per comparison goes to the
report. A failing case fails the test with its reproducer. The attncheck plugin
parametrizes both tests (``attncheck.selection``).
"""

from __future__ import annotations

import re

import pytest
from hypothesis import assume, given, seed, settings

from attncheck import check, coverage, selection
from attncheck.backends import BACKENDS
from attncheck.profiles import draw_seed, examples_for
from attncheck.pytest_plugin import gate_run


def test_kernel_matches_oracle(request, gate_target: selection.GateTest, attncheck_writer, attncheck_stop_point):
    run = gate_run(request.config)
    spec, target = gate_target.spec, gate_target.target()
    nodeid = request.node.nodeid
    outcomes: dict[str, check.Outcome] = {}  # by case id: hypothesis replays a failing example

    def check_one(case) -> check.Outcome:
        if case.id in outcomes:
            outcome = outcomes[case.id]
        else:
            attncheck_stop_point()
            try:
                outcome = check.check_case(target, case, report_dir=run.report_arg, nodeid=nodeid,
                                           started=attncheck_writer.started, maps=run.error_maps)
            except BaseException as exc:
                # A timeout anywhere else in the case: its started marker names it in the
                # report; a replay must not run (and hang) it again.
                timeout = check.timeout_in(exc)
                if timeout:
                    outcomes[case.id] = check.Outcome([], fatal=timeout)
                raise
            outcomes[case.id] = outcome
            for record in outcome.records:
                attncheck_writer.write(record)
        if outcome.fatal:
            pytest.fail(f"{outcome.fatal} in case {case.id}, the test stops: {outcome.summary()}", pytrace=False)
        return outcome

    # The simplest case of every bug class, so that no class goes unexercised by the luck
    # of the draw. All of them run and every failing one is reported, unless the run is to
    # stop early (-x, --maxfail): then the first failing case ends the test.
    if gate_target.part == selection.COVERAGE:
        failures = []
        for case in gate_target.share.of(coverage.examples(spec)):
            outcome = check_one(case)
            if outcome.failures:
                failures.append(outcome.summary())
                if request.config.getoption("maxfail"):
                    break
        assert not failures, "\n\n".join(failures)
        return

    first_backend = gate_target.backend_name == spec.backends_for(gate_target.impl_name)[0]
    covered = {case.id for case in coverage.examples(spec)} if first_backend else set()

    @settings(max_examples=examples_for(spec.examples_for(gate_target.backend_name)))
    @given(case=spec.cases())
    def drawn(case):
        assume(case.id not in covered)  # the coverage test runs those already
        assume(target.backend.runs_devices(case.params.device_count))
        outcome = check_one(case)
        assert not outcome.failures, outcome.summary()

    fixed = draw_seed(spec.name, gate_target.backend_name)
    (drawn if fixed is None else seed(fixed)(drawn))()


def test_invalid_input_is_rejected_clearly(gate_invalid, attncheck_kernel_time):
    invalid = gate_invalid
    with BACKENDS["interpret"].context(), attncheck_kernel_time():
        with pytest.raises(invalid.error) as info:
            invalid.call()
    assert re.search(invalid.match, str(info.value)), (
        f"{invalid.description}: message {str(info.value)!r} does not match {invalid.match!r}")
