"""dot_product_attention's KernelSpec: its cases, inputs, the call of an implementation and
its mapping onto the dense oracle and the yardstick."""

from __future__ import annotations

import dataclasses

import numpy as np

from attncheck import backends, domain, oracle, yardstick
from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.compiled import compiled, impl_key, with_vjp
from attncheck.specs.base import BIAS_AXES, KernelSpec, resolve_impl
from attncheck.specs.dpa.classes import BUG_CLASSES, CONTRACTS
from attncheck.specs.dpa.draws import dpa_cases, dpa_data, dpa_inputs, proves_something
from attncheck.specs.dpa.invalid import invalid_dpa_calls
from attncheck.specs.dpa.params import FAMILY, TO_HEADS_MAJOR, DPAParams, _query_valid, effective_scale, visibility


class DPASpec(KernelSpec[DPAParams]):
    name = FAMILY
    params_type = DPAParams
    directions = {"out": ("batch", "query", "head", "dim"), "dq": ("batch", "query", "head", "dim"),
                  "dk": ("batch", "key", "kv_head", "dim"), "dv": ("batch", "key", "kv_head", "dim"),
                  "dbias": BIAS_AXES}
    default_impls = {"jax_nn": "jax.nn:dot_product_attention",
                     "flash": "attncheck_kernels.dot_product_attention:dot_product_attention"}
    backends = ("xla", "interpret", "interpret-hazards", "tpu-lower", "tpu")
    impl_backends = {"jax_nn": ("xla",), "flash": ("interpret", "interpret-hazards", "tpu-lower", "tpu")}
    bug_classes = BUG_CLASSES
    examples = {"xla": 8, "interpret": 4, "interpret-hazards": 2, "tpu-lower": 4, "tpu": 16}
    # Rows that see every key with the weights their values are drawn for: a rare draw.
    explicit_examples = {name: Case(FAMILY, DPAParams(
        dtype="bfloat16", batch=1, q_len=16, kv_len=4 * S.LONG_REDUCTION, q_heads=2, kv_heads=1, head_dim=64,
        scale=None, bias="none", mask="none", mask_empties_rows=False, is_causal=False, window=None,
        q_lengths=None, kv_lengths=None, values=values), 0)
        for name, values in (("long_reduction_offset_values", "offset"), ("long_reduction_sink", S.SINK))}
    contracts = CONTRACTS
    fixed_parameters = {
        "mask.dtype": "the convention's mask is boolean (another dtype is an invalid call)",
        "*_seq_lengths.dtype": "the convention's lengths are int32 (another dtype is an invalid call)",
        "local_window_size.len": "a window given as a tuple is (left, right); an int is drawn too",
        "implementation": "jax.nn's backend selector: on CPU None and 'xla' run the same XLA path, 'cudnn' "
                          "needs a GPU",
        "return_residual": "jax.nn's logsumexp residual is not part of the convention's output (the flash "
                           "adapter has none): not judged"}

    def cases(self):
        return dpa_cases()

    def program(self, params):
        # Values, masks and lengths are data; only whether they are given changes the program.
        return dataclasses.replace(params, values="", mask_empties_rows=False,
                                   q_lengths=params.q_lengths and (), kv_lengths=params.kv_lengths and ())

    def other_data(self, params):
        return dpa_data(params)

    def variants(self, case, count):
        return super().variants(case, count).map(lambda cases: [c for c in cases if proves_something(c)])

    def inputs(self, case):
        return dpa_inputs(case)

    def fit_sequences(self, params, multiple):
        """T and S rounded up to the multiple, T < S, T = S and T > S kept as drawn; the
        lengths stay (they are at most the old T and S)."""
        t, s = (domain.round_up(n, multiple) for n in (params.q_len, params.kv_len))
        if params.q_len < params.kv_len and t >= s:
            s = t + multiple
        if params.q_len > params.kv_len and s >= t:
            t = s + multiple
        return dataclasses.replace(params, q_len=t, kv_len=s)

    # ------------------------------------------------------------------ running
    @staticmethod
    def _call(impl, p: DPAParams):
        def forward(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths):
            return impl(query, key, value, bias, mask, scale=p.scale, is_causal=p.is_causal,
                        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                        local_window_size=p.window)

        return forward

    @staticmethod
    def _operands(inputs):
        """(primals, the rest of the call's arguments): the bias is a primal when given."""
        primals = [inputs[n] for n in ("query", "key", "value", "bias") if n in inputs]
        rest = ([] if "bias" in inputs else [None]) + [inputs.get(n) for n in ("mask", "query_seq_lengths",
                                                                                "key_value_seq_lengths")]
        return primals, rest

    def evaluate(self, impl, case, inputs):
        p = case.params
        primals, rest = self._operands(inputs)
        fn = compiled((FAMILY, impl_key(impl), self.program(p)), lambda: with_vjp(self._call(impl, p)))
        out, grads = fn(primals, inputs["d_out"], *rest)
        return {d: np.asarray(r) for d, r in zip(self.directions, (out, *grads))}

    def lower(self, impl, case):
        inputs = self.inputs(case)
        primals, rest = self._operands(inputs)
        return backends.tpu_exports(self._call(impl, case.params), primals, inputs["d_out"], *rest)

    # ------------------------------------------------------------------ judging
    def _heads_major(self, inputs):
        return [inputs[n].transpose(TO_HEADS_MAJOR) for n in ("query", "key", "value", "d_out")]

    def _semantics(self, case, inputs):
        p = case.params
        return dict(scale=effective_scale(p), bias=inputs.get("bias"),
                    visible=visibility(p, inputs.get("mask")), masked_rows="mean_of_v")

    def oracle(self, case, inputs):
        q, k, v, d_out = self._heads_major(inputs)
        sem = self._semantics(case, inputs)
        valid = _query_valid(case.params)
        grads = oracle.attention_vjp(q, k, v, np.where(valid, d_out, 0.0), **sem)
        result = {"out": np.where(valid, oracle.attention(q, k, v, **sem).out, 0.0), "dq": grads["dq"],
                  "dk": grads["dk"], "dv": grads["dv"]}
        if "bias" in inputs:
            result["dbias"] = grads["dbias"]
        return {d: (x if d == "dbias" else x.transpose(TO_HEADS_MAJOR)) for d, x in result.items()}

    def yardstick(self, case, inputs):
        """Naive attention in jax.nn's own layout ([B, T, N, H]: seq_major)."""
        q, k, v, d_out = self._heads_major(inputs)
        sem = self._semantics(case, inputs)
        valid = _query_valid(case.params)
        result = yardstick.attention_with_grads(q, k, v, np.where(valid, d_out, 0).astype(d_out.dtype),
                                                seq_major=True, **sem)
        result["out"] = np.where(valid, result["out"], 0).astype(result["out"].dtype)
        return {d: (x if d == "dbias" else x.transpose(TO_HEADS_MAJOR)) for d, x in result.items()}

    def invalid_calls(self, impl):
        return invalid_dpa_calls(impl, adapter=impl is resolve_impl(self.default_impls["flash"]))


SPEC = DPASpec()
