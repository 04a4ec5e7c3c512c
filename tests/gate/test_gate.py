"""The pull-request gate: every kernel family x implementation x backend against the oracle.

For each drawn case the forward output and every gradient are compared with the float64
oracle under the tolerance policy (attncheck.numerics); one record per comparison goes to
the report. A failing case fails the test with its reproducer.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attncheck import backends, gate
from attncheck.pytest_plugin import examples_for
from attncheck.specs import resolve_impl

pytestmark = pytest.mark.gate


def test_kernel_matches_oracle(gate_target, attncheck_record):
    spec, impl_name, ref, backend_name = gate_target
    impl = resolve_impl(ref)
    backend = backends.BACKENDS[backend_name]
    recorded = set()  # hypothesis replays a failing example: record each case once

    @settings(max_examples=examples_for(spec.examples.get(backend_name, 4)))
    @given(case=spec.cases())
    def check(case):
        outcome = gate.check_case(spec, impl_name, impl, case, backend)
        if case.id not in recorded:
            recorded.add(case.id)
            for record in outcome.records:
                attncheck_record(record)
        assert not outcome.failures, outcome.summary()

    check()


@settings(max_examples=30)
@given(data=st.data())
def test_invalid_input_is_rejected_clearly(gate_spec, data):
    invalid = data.draw(gate_spec.invalid_calls(), label="invalid call")
    with backends.BACKENDS["interpret"].context():
        with pytest.raises(invalid.error) as info:
            invalid.call()
    assert re.search(invalid.match, str(info.value)), (
        f"{invalid.description}: message {str(info.value)!r} does not match {invalid.match!r}")
