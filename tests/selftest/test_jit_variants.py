"""A verdict does not depend on the kernel being jitted: the gate runs every kernel as one
jitted forward and VJP (``compiled.compiled``), and the records of a case are the same when
the kernel's callable is instead a chex variant, with jit and without (called op by op).

A kernel whose numbers depend on jit, or a ``compiled`` whose jit changes what the kernel
computes (the ordered-collectives wrapper, a static argument taken for data), shows here.
The blockwise FFN family: pure jax on the ``xla`` backend, a scan over chunks with remat
and a dropout key folded per chunk, and cheap to run op by op.
"""

from __future__ import annotations

from unittest import mock

import chex

from attncheck import check, compiled
from attncheck.backends import BACKENDS
from attncheck.specs import ffn
from attncheck.specs.base import resolve_impl

CASE = dict(dtype="float32", lead=(2,), seq_len=64, chunk_size=16, features=16, features_out=24, hidden=64,
            b_in=True, b_out=False, values="normal", stochastic=True, remat=True, policy="dots_saveable",
            prevent_cse=False)


def _verdicts(records) -> list[tuple[str, str]]:
    return [(r.direction, r.outcome) for r in records]


class TheVerdictWithAndWithoutJit(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_is_the_gates(self):
        impl = resolve_impl(ffn.SPEC.default_impls["builtin"])
        target = check.Target(ffn.SPEC, "builtin", impl, BACKENDS["xla"])
        case = ffn.SPEC.case(5, **CASE)
        gate = check.check_case(target, case).records

        varied_calls = []

        def the_kernel_as_variant(key, build):
            # The kernel's own callable only: the yardstick's (and the parameter probe's)
            # stay as the gate compiles them.
            if key[1][0] != compiled.impl_key(impl):
                return compiled.compiled(key, build)
            varied_calls.append(key)
            return self.variant(build())

        with mock.patch.object(ffn, "compiled", the_kernel_as_variant):
            varied = check.check_case(target, case).records
        self.assertTrue(varied_calls)  # the kernel ran as the variant
        self.assertEqual(_verdicts(varied), _verdicts(gate))
        self.assertEqual({outcome for _, outcome in _verdicts(varied)}, {"pass"},
                         [(r.direction, r.reason) for r in varied])
