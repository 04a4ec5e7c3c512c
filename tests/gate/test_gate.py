"""The pull-request gate: every kernel family x implementation x backend against the oracle.

For each drawn case the forward output and every gradient are compared with the float64
oracle under the tolerance policy (attncheck.numerics); one record per comparison goes to
the report. A failing case fails the test with its reproducer.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import assume, given, seed, settings

from attncheck import backends, gate
from attncheck.pytest_plugin import draw_seed, examples_for
from attncheck.specs import resolve_impl
from attncheck.specs.base import coverage_examples

pytestmark = pytest.mark.gate


def test_kernel_matches_oracle(request, gate_target, attncheck_record, attncheck_stop_point):
    spec, impl_name, ref, backend_name, part, share = gate_target
    impl = resolve_impl(ref)
    backend = backends.BACKENDS[backend_name]
    recorded = set()  # hypothesis replays a failing example: record each case once

    def check(case) -> gate.Outcome:
        attncheck_stop_point()
        outcome = gate.check_case(spec, impl_name, impl, case, backend)
        if case.id not in recorded:
            recorded.add(case.id)
            for record in outcome.records:
                attncheck_record(record)
        return outcome

    # The simplest case of every bug class, so that no class goes unexercised by the luck
    # of the draw. All of them run and every failing one is reported, unless the run is to
    # stop early (-x, --maxfail): then the first failing case ends the test.
    if part == gate.COVERAGE:
        failures = []
        for case in gate.coverage_share(coverage_examples(spec), share):
            outcome = check(case)
            if outcome.failures:
                failures.append(outcome.summary())
                if request.config.getoption("maxfail"):
                    break
        assert not failures, "\n\n".join(failures)
        return

    covered = {case.id for case in coverage_examples(spec)} if backend_name == spec.backends[0] else set()

    @settings(max_examples=examples_for(spec.examples.get(backend_name, 4)))
    @given(case=spec.cases())
    def drawn(case):
        assume(case.id not in covered)  # the coverage test runs those already
        assume(backend.runs_devices(spec.device_count(case)))
        outcome = check(case)
        assert not outcome.failures, outcome.summary()

    fixed = draw_seed(spec.name, backend_name)
    (drawn if fixed is None else seed(fixed)(drawn))()


def test_invalid_input_is_rejected_clearly(gate_invalid, attncheck_kernel_time):
    invalid = gate_invalid
    with backends.BACKENDS["interpret"].context(), attncheck_kernel_time():
        with pytest.raises(invalid.error) as info:
            invalid.call()
    assert re.search(invalid.match, str(info.value)), (
        f"{invalid.description}: message {str(info.value)!r} does not match {invalid.match!r}")
