"""The gate: every kernel family x implementation x backend against the oracle.

For each case the forward output and every gradient are compared with the float64 oracle
under the tolerance policy (attncheck.numerics); one record per comparison goes to the
report. A failing case fails the test with its reproducer. The attncheck plugin
parametrizes both tests (``attncheck.selection``).
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from attncheck import check, coverage, selection
from attncheck.backends import BACKENDS
from attncheck.profiles import cases_per_program, draw_seed, examples_for
from attncheck.pytest_plugin import gate_run


def test_kernel_matches_oracle(request, gate_target: selection.GateTest, attncheck_writer, attncheck_stop_point):
    run = gate_run(request.config)
    spec, target = gate_target.spec, gate_target.target(run.expectations)
    nodeid = request.node.nodeid
    outcomes: dict[str, check.Outcome] = {}  # by case id: hypothesis replays a failing example

    def check_one(case) -> check.Outcome:
        if case.id in outcomes:
            outcome = outcomes[case.id]
        else:
            attncheck_stop_point()
            try:
                outcome = check.check_case(target, case, report_dir=run.report_arg, nodeid=nodeid,
                                           started=run.case_started, maps=run.error_maps)
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
        # Each fitted to the implementation's declared domain (attncheck.domain): a class
        # the fit loses is a hole in the coverage table, not a refusal of every example.
        for case in map(target.fit, gate_target.share.of(coverage.examples(spec))):
            if not target.backend.runs(case.params):
                continue  # verified on the family's other backends (its classes count there)
            outcome = check_one(case)
            if outcome.failures:
                failures.append(outcome.summary())
                if request.config.getoption("maxfail"):
                    break
        assert not failures, "\n\n".join(failures)
        return

    covered = {target.fit(case).id for case in coverage.examples(spec)} if gate_target.runs_coverage else set()

    def runnable(case) -> bool:
        # The coverage test runs the covered cases already.
        return case.id not in covered and target.backend.runs(case.params)

    # Each example spends ``per_program`` cases on one compile: a drawn case, then cases of
    # its program with other data; one, where the implementation's declared domain leaves the
    # case out (its variants would be refused alike). What a test draws depends on nothing
    # a case's outcome says, and every drawn case runs unless the run is to stop early: a
    # run with deviations declared draws the cases of the run without them that
    # ``attncheck expectations init`` read.
    cases = examples_for(spec.examples_for(gate_target.backend_name))
    per_program = cases_per_program(cases) if target.backend.reuses_programs else 1
    failures = []

    def verify(case) -> None:
        outcome = check_one(case)
        if outcome.failures:
            failures.append(outcome.summary())
            assert not request.config.getoption("maxfail"), outcome.summary()

    @settings(max_examples=math.ceil(cases / per_program))
    @given(data=st.data())
    def drawn(data):
        spent = 0
        while spent < per_program:
            case = data.draw(spec.cases().map(target.fit).filter(runnable), label="program")
            verify(case)
            spent += 1
            if target.refusal(case) is None and spent < per_program:
                for variant in data.draw(spec.variants(case, per_program - spent), label="variants"):
                    verify(target.fit(variant))
                    spent += 1

    fixed = draw_seed(spec.name, gate_target.backend_name)
    (drawn if fixed is None else seed(fixed)(drawn))()
    assert not failures, "\n\n".join(failures)


def test_invalid_input_is_rejected_clearly(gate_invalid: selection.InvalidInputTest, attncheck_kernel_time):
    """The implementation under test rejects the call with an error whose message names the
    offending argument: the contract for any implementation (a user's may raise its own
    exception class); the family's own implementations also raise the class it declares."""
    test, invalid = gate_invalid, gate_invalid.call
    who = f"{test.spec.name}/{test.impl_name} ({test.impl_ref})"
    if invalid is None:
        pytest.fail(f"{who}: the family's invalid calls could not be built for this implementation: "
                    f"{test.unbuilt}", pytrace=False)
    rejected = None
    with BACKENDS["interpret"].context(), attncheck_kernel_time():
        try:
            invalid.call()
        except Exception as exc:  # noqa: BLE001 - whatever the implementation raises is judged below
            rejected = exc
    if rejected is None:
        pytest.fail(f"{who} accepted invalid input silently: {invalid.description} returned without an error "
                    f"(expected one whose message matches {invalid.match!r})", pytrace=False)
    # An error raised inside an interpreter callback is judged by its own line, not by the
    # callback's traceback (whose source lines name every argument).
    message = check.error_text(rejected, interpreted=True)
    assert re.search(invalid.match, message), (
        f"{who} rejected {invalid.description} without naming the argument: {message!r} does not match "
        f"{invalid.match!r}")
    assert not test.shipped or isinstance(rejected, invalid.error), (
        f"{who} rejected {invalid.description} with {type(rejected).__name__}, expected {invalid.error}: {message!r}")
