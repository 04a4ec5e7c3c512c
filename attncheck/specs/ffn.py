"""Blockwise FFN family: ``blockwise_ffn(ffn, params, inputs, *, chunk_size)`` applies a
position-wise ``ffn(params, x)`` chunk by chunk (scan + remat); it must equal the dense
FFN ``gelu(x @ w_in + b_in) @ w_out + b_out`` (tanh gelu, jax.nn.gelu's default) for the
output and for the gradients of x and every weight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from attncheck import coverage, oracle
from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.compiled import compiled, impl_key, impl_module, with_vjp
from attncheck.report.errormap import ErrorMapLayout, every
from attncheck.specs.base import InvalidCall, KernelSpec

FAMILY = "blockwise_ffn"
SEQ_LENS = (64, 96, 256)
FEATURES = (16, 32)
HIDDEN = (64,)
PARAM_NAMES = ("w_in", "b_in", "w_out", "b_out")


@dataclasses.dataclass(frozen=True)
class FFNParams(Params):
    dtype: str
    batch: int
    seq_len: int
    chunk_size: int
    features: int
    hidden: int
    biases: bool
    values: str  # "normal" or "large"

    @property
    def sequence_length(self) -> int:
        return self.seq_len


@st.composite
def ffn_cases(draw) -> Case[FFNParams]:
    seq = draw(st.sampled_from(SEQ_LENS))
    chunk = draw(st.sampled_from([c for c in S.divisors(seq, 8) if c <= seq]))
    seed = draw(S.seeds)
    return Case(FAMILY, FFNParams(dtype=draw(st.sampled_from(tuple(S.DTYPES))),
                                  batch=draw(st.sampled_from((1, 2))), seq_len=seq, chunk_size=chunk,
                                  features=draw(st.sampled_from(FEATURES)), hidden=draw(st.sampled_from(HIDDEN)),
                                  biases=draw(st.booleans()), values=draw(st.sampled_from(("normal", "large")))),
                seed)


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


class BlockwiseFFNSpec(KernelSpec[FFNParams]):
    name = FAMILY
    params_type = FFNParams
    default_impls = {"builtin": "kernels.blockwise_ffn:blockwise_ffn"}
    backends = ("xla",)
    bug_classes = coverage.bug_classes(
        single_chunk=lambda p: p.chunk_size == p.seq_len,
        multi_chunk=lambda p: p.chunk_size != p.seq_len,
        bf16=lambda p: p.dtype == "bfloat16",
        large_values=lambda p: p.values == "large",
        no_bias=lambda p: not p.biases,
        biases=lambda p: p.biases)
    examples = {"xla": 64}

    def cases(self):
        return ffn_cases()

    def inputs(self, case):
        p = case.params
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(p.dtype)
        b, s, f, h = p.batch, p.seq_len, p.features, p.hidden
        spread = 4.0 if p.values == "large" else 1.0
        out = {"x": S.round_to(rng.standard_normal((b, s, f)) * spread, dt),
               "w_in": S.round_to(rng.standard_normal((f, h)) / np.sqrt(f), dt),
               "w_out": S.round_to(rng.standard_normal((h, f)) / np.sqrt(h), dt),
               "d_out": S.round_to(rng.standard_normal((b, s, f)), dt)}
        if p.biases:
            out["b_in"] = S.round_to(rng.standard_normal(h), dt)
            out["b_out"] = S.round_to(rng.standard_normal(f), dt)
        return out

    def run(self, impl, case, inputs):
        position_wise, pack = _convention(impl)

        def call(params, x):
            return impl(position_wise, pack(*params), x, chunk_size=case.params.chunk_size)

        return _grads(call, (impl_key(impl), dataclasses.replace(case.params, values="")), inputs)

    def oracle(self, case, inputs):
        args = [inputs["x"]] + [inputs.get(n) for n in PARAM_NAMES]
        result = {"out": oracle.feed_forward(*args)}
        result.update(oracle.feed_forward_vjp(*args, inputs["d_out"]))
        return result

    def yardstick(self, case, inputs):
        # Chunking is the kernel's business: one compiled dense FFN serves every chunk size.
        return _grads(_dense_ffn, "yardstick", inputs)

    def output_dtypes(self, case):
        dt = S.dtype_of(case.params.dtype)
        return {d: dt for d in ("out", "dx", "dw_in", "db_in", "dw_out", "db_out")}

    def index_names(self, direction):
        return {"out": ("batch", "position", "feature"), "dx": ("batch", "position", "feature"),
                "dw_in": ("feature", "hidden"), "dw_out": ("hidden", "feature"), "db_in": ("hidden",),
                "db_out": ("feature",)}.get(direction)

    def error_map_layout(self, case, direction):
        # Positions on the chunks the kernel scans; the weights' gradients sum over every
        # chunk, so they have no block structure of their own (the default layout).
        if direction in ("out", "dx"):
            p = case.params
            return ErrorMapLayout(self.index_names(direction), 1, 2, (every("chunk", p.chunk_size, p.seq_len),))
        return super().error_map_layout(case, direction)

    def invalid_calls(self, impl):
        return invalid_ffn_calls(impl)


def _convention(impl):
    """The position-wise FFN and params container that go with an implementation: its
    module's own ``feed_forward``/``FeedForwardParams`` when it has them, else ours."""
    module = impl_module(impl)
    if hasattr(module, "feed_forward") and hasattr(module, "FeedForwardParams"):
        return module.feed_forward, module.FeedForwardParams
    return _dense_ffn, lambda *params: tuple(params)


def _grads(call, key, inputs):
    """Output and gradients of x and every given weight: one compiled function per ``key``
    and set of given weights (jit itself keys its executables by shape and dtype)."""
    names = [n for n in PARAM_NAMES if n in inputs]

    def forward(x, *weights):
        given = dict(zip(names, weights))
        return call(tuple(given.get(n) for n in PARAM_NAMES), x)

    fn = compiled(("ffn", key, tuple(names)), lambda: with_vjp(forward))
    out, grads = fn([inputs["x"], *(inputs[n] for n in names)], inputs["d_out"])
    result = {"out": np.asarray(out), "dx": np.asarray(grads[0])}
    result.update({"d" + n: np.asarray(g) for n, g in zip(names, grads[1:])})
    return result


def invalid_ffn_calls(impl) -> list[InvalidCall]:
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
