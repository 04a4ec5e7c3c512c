"""Blockwise FFN family: ``blockwise_ffn(ffn, params, inputs, *, chunk_size)`` applies a
position-wise ``ffn(params, x)`` chunk by chunk (scan + remat); it must equal the dense
FFN ``gelu(x @ w_in + b_in) @ w_out + b_out`` (tanh gelu, jax.nn.gelu's default) for the
output and for the gradients of x and every weight.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from attncheck import oracle
from attncheck import strategies as S
from attncheck.specs.base import Case, InvalidCall, KernelSpec, make_case, resolve_impl

FAMILY = "blockwise_ffn"
SEQ_LENS = (64, 96, 256)
FEATURES = (16, 32)
HIDDEN = (64,)
PARAM_NAMES = ("w_in", "b_in", "w_out", "b_out")


@st.composite
def ffn_cases(draw) -> Case:
    seq = draw(st.sampled_from(SEQ_LENS))
    chunk = draw(st.sampled_from([c for c in S.divisors(seq, 8) if c <= seq]))
    return make_case(FAMILY, draw(S.seeds), dtype=draw(st.sampled_from(tuple(S.DTYPES))),
                     batch=draw(st.sampled_from((1, 2))), seq_len=seq, chunk_size=chunk,
                     features=draw(st.sampled_from(FEATURES)), hidden=draw(st.sampled_from(HIDDEN)),
                     biases=draw(st.booleans()), values=draw(st.sampled_from(("normal", "large"))))


def _dense_ffn(params, x):
    """The naive XLA FFN in the working precision: matmuls accumulate in float32."""
    w_in, b_in, w_out, b_out = params
    h = jnp.matmul(x, w_in, preferred_element_type=jnp.float32)
    if b_in is not None:
        h = h + b_in
    y = jnp.matmul(jax.nn.gelu(h).astype(x.dtype), w_out, preferred_element_type=jnp.float32)
    if b_out is not None:
        y = y + b_out
    return y.astype(x.dtype)


class BlockwiseFFNSpec(KernelSpec):
    name = FAMILY
    default_impls = {"builtin": "kernels.blockwise_ffn:blockwise_ffn"}
    backends = ("xla",)
    coverage_classes = ("single_chunk", "multi_chunk", "bf16", "large_values", "no_bias", "biases")
    examples = {"xla": 64}

    def cases(self):
        return ffn_cases()

    def inputs(self, case):
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(case["dtype"])
        b, s, f, h = case["batch"], case["seq_len"], case["features"], case["hidden"]
        spread = 4.0 if case["values"] == "large" else 1.0
        out = {"x": S.round_to(rng.standard_normal((b, s, f)) * spread, dt),
               "w_in": S.round_to(rng.standard_normal((f, h)) / np.sqrt(f), dt),
               "w_out": S.round_to(rng.standard_normal((h, f)) / np.sqrt(h), dt),
               "d_out": S.round_to(rng.standard_normal((b, s, f)), dt)}
        if case["biases"]:
            out["b_in"] = S.round_to(rng.standard_normal(h), dt)
            out["b_out"] = S.round_to(rng.standard_normal(f), dt)
        return out

    def run(self, impl, case, inputs):
        position_wise, pack = _convention(impl)

        def call(params, x):
            return impl(position_wise, pack(*params), x, chunk_size=case["chunk_size"])

        return _grads(call, _static_key(impl, case), inputs)

    def lower(self, impl, case):
        return {}

    def oracle(self, case, inputs):
        args = [inputs["x"]] + [inputs.get(n) for n in PARAM_NAMES]
        result = {"out": oracle.feed_forward(*args)}
        result.update(oracle.feed_forward_vjp(*args, inputs["d_out"]))
        return result

    def baseline(self, case, inputs):
        # Chunking is the kernel's business: one compiled dense FFN serves every chunk size.
        return _grads(_dense_ffn, "baseline", inputs)

    def output_dtypes(self, case):
        dt = S.dtype_of(case["dtype"])
        return {d: dt for d in ("out", "dx", "dw_in", "db_in", "dw_out", "db_out")}

    def classes(self, case):
        tags = {"single_chunk" if case["chunk_size"] == case["seq_len"] else "multi_chunk"}
        if case["dtype"] == "bfloat16":
            tags.add("bf16")
        if case["values"] == "large":
            tags.add("large_values")
        tags.add("biases" if case["biases"] else "no_bias")
        return sorted(tags)

    def index_names(self, direction):
        return {"out": ("batch", "position", "feature"), "dx": ("batch", "position", "feature")}.get(direction)

    def invalid_calls(self):
        return invalid_ffn_calls(self.default_impls["builtin"])


def _convention(impl):
    """The position-wise FFN and params container that go with an implementation: its
    module's own ``feed_forward``/``FeedForwardParams`` when it has them, else ours."""
    module = sys.modules[impl.__module__]
    if hasattr(module, "feed_forward") and hasattr(module, "FeedForwardParams"):
        return module.feed_forward, module.FeedForwardParams
    return _dense_ffn, lambda *params: tuple(params)


def _static_key(impl, case):
    static = {k: v for k, v in case.params.items() if k != "values"}
    return (getattr(impl, "__module__", None), getattr(impl, "__qualname__", None), tuple(sorted(static.items())))


_JITTED: dict = {}


def _grads(call, key, inputs):
    """Output and gradients of x and every given weight: one jitted function per ``key``
    and set of given weights (jit itself keys its executables by shape and dtype)."""
    names = [n for n in PARAM_NAMES if n in inputs]
    key = (key, tuple(names))
    fn = _JITTED.get(key)
    if fn is None:
        def forward_and_grads(x, weights, d_out):
            full = dict(zip(names, weights))

            def f(x, weights):
                params = tuple(dict(zip(names, weights)).get(n, full.get(n)) for n in PARAM_NAMES)
                return call(params, x)

            out, vjp = jax.vjp(f, x, weights)
            dx, dweights = vjp(d_out)
            return out, dx, dweights

        fn = _JITTED[key] = jax.jit(forward_and_grads)
    out, dx, dweights = fn(inputs["x"], [inputs[n] for n in names], inputs["d_out"])
    result = {"out": np.asarray(out), "dx": np.asarray(dx)}
    result.update({"d" + n: np.asarray(g) for n, g in zip(names, dweights)})
    return result


def invalid_ffn_calls(ref: str) -> list[InvalidCall]:
    impl = resolve_impl(ref)
    position_wise, pack = _convention(impl)
    x = jnp.zeros((1, 64, 16), jnp.float32)
    params = pack(jnp.zeros((16, 32)), None, jnp.zeros((32, 16)), None)
    return [
        InvalidCall("chunk_not_dividing", lambda: impl(position_wise, params, x, chunk_size=48), ValueError,
                    r"chunk_size"),
        InvalidCall("chunk_zero", lambda: impl(position_wise, params, x, chunk_size=0), ValueError, r"chunk_size"),
        InvalidCall("rank", lambda: impl(position_wise, params, x[0, 0], chunk_size=8), ValueError, r"inputs"),
        InvalidCall("ffn_not_position_wise",
                    lambda: impl(lambda p, h: position_wise(p, h)[..., :1, :], params, x, chunk_size=8),
                    ValueError, r"ffn"),
    ]


SPEC = BlockwiseFFNSpec()
