"""On a TPU runner: the same inputs through interpret mode and the real chip, compared.

Interpret mode is what the CPU gate trusts; this measures how far the chip's numerics are
from it (ulp distance per direction, recorded like any comparison) so a divergence between
the simulator and the hardware is visible in the report. Accuracy itself is judged against
the oracle by the gate's ``tpu`` backend; here the test fails only where the two must agree
exactly: the positions of NaN and Inf. Skipped, with the reason, without a TPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from attncheck import backends, numerics
from attncheck.specs import all_specs, resolve_impl

pytestmark = pytest.mark.gate
TPU_REASON = backends.BACKENDS["tpu"].unavailable_reason()
DIFFERENTIAL_EXAMPLES = 4


@pytest.mark.skipif(TPU_REASON is not None, reason=f"interpret-vs-TPU differential needs a TPU: {TPU_REASON}")
@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name, marks=pytest.mark.attncheck_family(s.name))
                                  for s in all_specs().values() if "tpu" in s.backends])
def test_interpret_matches_tpu(spec, attncheck_record):
    impl = resolve_impl(spec.default_impls["builtin"])

    @settings(max_examples=DIFFERENTIAL_EXAMPLES)
    @given(case=spec.cases())
    def check(case):
        inputs = spec.inputs(case)
        with backends.BACKENDS["interpret"].context(case.seed):
            simulated = spec.run(impl, case, inputs)
        native = spec.run(impl, case, inputs)
        care, dtypes = spec.care(case, inputs), spec.output_dtypes(case)
        for direction, value in simulated.items():
            cmp = numerics.compare(native[direction], np.asarray(value, np.float64), value,
                                   dtype=dtypes[direction], direction=direction, care=care.get(direction))
            nonfinite = cmp.reason if cmp.budget == float("inf") else None
            attncheck_record({"case_id": case.id, "case": case.to_json(), "kernel": spec.name, "impl": "builtin",
                              "impl_ref": spec.default_impls["builtin"], "backend": "tpu-vs-interpret",
                              "direction": direction, "dtype": str(np.dtype(dtypes[direction])),
                              "outcome": "fail" if nonfinite else "pass",
                              "reason": nonfinite or f"ulp distance p99 {cmp.ulp_p99:.3g}, max {cmp.ulp_max:.3g}",
                              "metrics": cmp.to_json(), "budget": numerics._json_float(cmp.budget),
                              "repro": f"attncheck repro {case.id} --backend tpu", "classes": spec.classes(case),
                              "seq_len": spec.seq_len(case), "device_count": spec.device_count(case)})
            assert not nonfinite, f"{direction}: chip vs interpreter: {nonfinite}"

    check()
