"""The pull-request gate: every kernel family x implementation x backend against the oracle.

For each drawn case the forward output and every gradient are compared with the float64
oracle under the tolerance policy (attncheck.numerics); one record per comparison goes to
the report. A failing case fails the test with its reproducer.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings

from attncheck import backends, gate
from attncheck.pytest_plugin import examples_for
from attncheck.specs import resolve_impl
from attncheck.specs.base import coverage_examples

pytestmark = pytest.mark.gate


def test_kernel_matches_oracle(gate_target, attncheck_record):
    spec, impl_name, ref, backend_name = gate_target
    impl = resolve_impl(ref)
    backend = backends.BACKENDS[backend_name]
    recorded = set()  # hypothesis replays a failing example: record each case once

    def check(case):
        outcome = gate.check_case(spec, impl_name, impl, case, backend)
        if case.id not in recorded:
            recorded.add(case.id)
            for record in outcome.records:
                attncheck_record(record)
        assert not outcome.failures, outcome.summary()

    # On the family's first backend, the simplest case of every bug class runs explicitly,
    # so no class can go unexercised by the luck of the draw.
    if backend_name == spec.backends[0]:
        for case in coverage_examples(spec):
            check = example(case=case)(check)
    given(case=spec.cases())(settings(max_examples=examples_for(spec.examples.get(backend_name, 4)))(check))()


def test_invalid_input_is_rejected_clearly(gate_invalid):
    invalid = gate_invalid
    with backends.BACKENDS["interpret"].context():
        with pytest.raises(invalid.error) as info:
            invalid.call()
    assert re.search(invalid.match, str(info.value)), (
        f"{invalid.description}: message {str(info.value)!r} does not match {invalid.match!r}")
