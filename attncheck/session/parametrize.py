"""What the gate's two tests run: ``attncheck/gate/test_gate.py``'s parameters, one gate
test per family x implementation x backend x part and one invalid-input test per family x
implementation under test x invalid call (``attncheck.selection``)."""

from __future__ import annotations

import pytest

from attncheck import expectations, scheduling, selection


class Parametrization:
    def __init__(self, options: selection.Options, declared: tuple[expectations.Expectation, ...]):
        self.options = options
        self.declared = declared

    def pytest_generate_tests(self, metafunc):
        if "gate_target" in metafunc.fixturenames:
            metafunc.parametrize("gate_target", [
                pytest.param(test, id=test.id, marks=self._marks(test))
                for test in selection.gate_tests(self.options)])
        if "gate_invalid" in metafunc.fixturenames:
            # A user's implementation must reject what the convention rejects; a family that
            # declares no invalid call contributes no test. A declared deviation of a call
            # is a strict xfail: it fails once the call is rejected.
            metafunc.parametrize("gate_invalid", [
                pytest.param(test, id=test.id, marks=[pytest.mark.attncheck_family(test.spec.name)] + (
                    [pytest.mark.xfail(strict=True, reason=f"expected deviation ({entry.source}): {entry.reason}")]
                    if (entry := test.expected(self.declared)) else []))
                for test in selection.invalid_input_tests(self.options)])

    @staticmethod
    def _marks(test: selection.GateTest) -> list:
        marks = [pytest.mark.attncheck_family(test.spec.name)]
        if test.unavailable:
            marks.append(pytest.mark.skip(reason=f"backend {test.backend_name} unavailable: {test.unavailable}"))
        if test.part == selection.COVERAGE:
            marks.append(getattr(pytest.mark, scheduling.FAIL_FAST_MARKER)(lead=test.share.index == 0))
        return marks
