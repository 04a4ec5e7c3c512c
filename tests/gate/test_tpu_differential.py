"""On a TPU runner: the same inputs through interpret mode and the real chip, compared.

Interpret mode is what the CPU gate trusts; this measures how far the chip's numerics are
from it (ulp distance per direction, recorded like any comparison) so a divergence between
the simulator and the hardware is visible in the report. Accuracy itself is judged against
the oracle by the gate's ``tpu`` backend; here the test fails only where the two must agree
exactly: the positions of NaN and Inf. Skipped, with the reason, without a TPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings

from attncheck import backends, check, numerics
from attncheck.report.records import Record
from attncheck.specs import all_specs, resolve_impl

pytestmark = pytest.mark.gate
TPU_REASON = backends.BACKENDS["tpu"].unavailable_reason()
DIFFERENTIAL_EXAMPLES = 4


@pytest.mark.skipif(TPU_REASON is not None, reason=f"interpret-vs-TPU differential needs a TPU: {TPU_REASON}")
@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name, marks=pytest.mark.attncheck_family(s.name))
                                  for s in all_specs().values() if "tpu" in s.backends])
def test_interpret_matches_tpu(spec, attncheck_record):
    target = check.Target(spec, "builtin", resolve_impl(spec.default_impls["builtin"]), backends.BACKENDS["tpu"])

    @settings(max_examples=DIFFERENTIAL_EXAMPLES)
    @given(case=spec.cases())
    def compare(case):
        inputs = spec.inputs(case)
        with backends.BACKENDS["interpret"].context(case.seed):
            simulated = spec.evaluate(target.impl, case, inputs)
        native = spec.evaluate(target.impl, case, inputs)
        care, dtypes = spec.care(case, inputs), spec.output_dtypes(case)
        base = dataclasses.asdict(check.case_run(target, case))
        for direction, value in simulated.items():
            cmp = numerics.compare(native[direction], np.asarray(value, np.float64), value,
                                   dtype=dtypes[direction], direction=direction, care=care.get(direction))
            nonfinite = cmp.reason if cmp.budget == float("inf") else None
            attncheck_record(Record(**{**base, "backend": "tpu-vs-interpret"}, direction=direction,
                                    outcome="fail" if nonfinite else "pass", metrics=cmp,
                                    reason=nonfinite or f"ulp distance p99 {cmp.ulp_p99:.3g}, max {cmp.ulp_max:.3g}"))
            assert not nonfinite, f"{direction}: chip vs interpreter: {nonfinite}"

    compare()
