"""A forward-only variant of the toy family (``toy_forward``): the output alone is judged,
as for the ragged paged attention family. Load it with
``--attncheck-spec tests.selftest.toy_forward_spec --attncheck-only-spec``."""

from __future__ import annotations

import numpy as np

from tests.selftest import toy_spec


class ToyForwardSpec(toy_spec.ToySpec):
    name = "toy_forward"
    directions = {"out": toy_spec.ToySpec.directions["out"]}
    default_impls = {"builtin": "tests.selftest.toy_spec:toy_attention"}

    def evaluate(self, impl, case, inputs):
        return {"out": np.asarray(self._forward(impl, case.params)(inputs["q"], inputs["k"], inputs["v"]))}

    def oracle(self, case, inputs):
        return {"out": super().oracle(case, inputs)["out"]}

    def yardstick(self, case, inputs):
        return {"out": super().yardstick(case, inputs)["out"]}

    def invalid_calls(self, impl):
        return []  # the toy family's convention: its invalid calls are tested there


SPEC = ToyForwardSpec()
