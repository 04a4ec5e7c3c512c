"""Blockwise FFN family: ``blockwise_ffn(ffn, params, inputs, *, chunk_size, rng=None)``
applies a position-wise ``ffn(params, x)`` chunk by chunk (scan + remat); it must equal the
dense FFN ``gelu(x @ w_in + b_in) @ w_out + b_out`` (tanh gelu, jax.nn.gelu's default) for
the output and for the gradients of x and every weight, for inputs of any rank and any
number of output features. With ``rng`` the ffn is called as ``ffn(params, x, rng=...)``
and chunk i gets ``jax.random.fold_in(rng, i)`` (the kernel's documented contract): the
gate's stochastic ffn applies inverted dropout from that key, and the oracle is given the
masks the contract implies. An implementation's own knobs (``remat``, ``policy``,
``prevent_cse``) are varied where it has them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from attncheck import bugclasses, oracle, yardstick
from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.compiled import compiled, impl_key, impl_module, with_vjp
from attncheck.expectations import Contract
from attncheck.layouts import ErrorMapLayout, every
from attncheck.specs.base import FLOAT32_ACCUMULATION, InvalidCall, KernelSpec, accepted_keywords, values_by_dtype

FAMILY = "blockwise_ffn"
SEQ_LENS = S.Shapes(ci=(64, 96, 256), nightly=(40, 64, 96, 256, 512))
FEATURES = S.Shapes(ci=(16, 32), nightly=(8, 16, 32, 64))
FEATURES_OUT = (16, 24)
HIDDEN = S.Shapes(ci=(64, 128), nightly=(32, 64, 128, 256))
# The leading axes of the inputs: none, a batch, two.
LEADS = ((), (1,), (2,), (2, 2))
PARAM_NAMES = ("w_in", "b_in", "w_out", "b_out")
DROPOUT_RATE = 0.25
POLICIES = {"none": None, "dots_saveable": jax.checkpoint_policies.dots_saveable}
# The axes of each input that the dense FFN sums over (features, hidden units): the
# yardstick permutes them in each summation order, and its gradients back.
_SUMMED_AXES = {"x": (-1,), "w_in": (0, 1), "b_in": (0,), "w_out": (0,)}


@dataclasses.dataclass(frozen=True)
class FFNParams(Params):
    dtype: str
    lead: tuple[int, ...]  # leading axes of the inputs
    seq_len: int
    chunk_size: int
    features: int
    features_out: int
    hidden: int
    b_in: bool  # given, each bias apart from the other
    b_out: bool
    values: str  # "normal" or "large"
    stochastic: bool  # an ffn with dropout from the rng the kernel hands each chunk
    remat: bool
    policy: str  # a POLICIES name
    prevent_cse: bool

    @property
    def sequence_length(self) -> int:
        return self.seq_len

    def shape(self, features: int) -> tuple[int, ...]:
        return (*self.lead, self.seq_len, features)


@st.composite
def ffn_cases(draw) -> Case[FFNParams]:
    seq = draw(st.sampled_from(SEQ_LENS()))
    chunk = draw(st.sampled_from([c for c in S.divisors(seq, 8) if c <= seq]))
    seed = draw(S.seeds)
    features = draw(st.sampled_from(FEATURES()))
    return Case(FAMILY, FFNParams(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), lead=draw(st.sampled_from(LEADS)), seq_len=seq,
        chunk_size=chunk, features=features, features_out=draw(st.sampled_from((features,) + FEATURES_OUT)),
        hidden=draw(st.sampled_from(HIDDEN())), b_in=draw(st.booleans()), b_out=draw(st.booleans()),
        values=draw(st.sampled_from(S.NORMAL_AND_LARGE)), stochastic=draw(st.booleans()),
        remat=draw(st.booleans()), policy=draw(st.sampled_from(tuple(POLICIES))), prevent_cse=draw(st.booleans())),
        seed)


def _dot(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def _dot_term_by_term(a, b):
    """a @ b in float32, its contraction summed one term at a time, first to last: a loop's
    order, and the one XLA's CPU code sums a chunk's small dot in (bit for bit),
    where a whole array's dot is summed in Eigen's blocks."""
    def add_term(total, term):
        a_k, b_k = term
        return total + a_k[..., None].astype(jnp.float32) * b_k.astype(jnp.float32), None

    total = jnp.zeros((*a.shape[:-1], b.shape[-1]), jnp.float32)
    return jax.lax.scan(add_term, total, (jnp.moveaxis(a, -1, 0), b))[0]


def _dense_ffn(params, x, dot=_dot):
    """The naive XLA FFN in the working precision: matmuls accumulate in float32."""
    w_in, b_in, w_out, b_out = params
    h = dot(x, w_in)
    if b_in is not None:
        h = h + b_in
    y = dot(jax.nn.gelu(h).astype(x.dtype), w_out)
    if b_out is not None:
        y = y + b_out
    return y.astype(x.dtype)


class BlockwiseFFNSpec(KernelSpec[FFNParams]):
    name = FAMILY
    params_type = FFNParams
    # Of the trailing axes: the inputs' leading axes vary in number.
    directions = {"out": ("position", "feature"), "dx": ("position", "feature"), "dw_in": ("feature", "hidden"),
                  "db_in": ("hidden",), "dw_out": ("hidden", "feature"), "db_out": ("feature",)}
    default_impls = {"builtin": "attncheck_kernels.blockwise_ffn:blockwise_ffn"}
    backends = ("xla",)
    bug_classes = bugclasses.bug_classes(
        single_chunk=lambda p: p.chunk_size == p.seq_len,
        multi_chunk=lambda p: p.chunk_size != p.seq_len,
        bf16=lambda p: p.dtype == "bfloat16",
        large_values=lambda p: p.values == "large",
        # A chunk's dropout key must be its own: only several chunks show which one it got.
        stochastic_chunks=lambda p: p.stochastic and p.chunk_size < p.seq_len,
        features_out_ne_features=lambda p: p.features_out != p.features,
        no_leading_axes=lambda p: not p.lead,
        two_leading_axes=lambda p: len(p.lead) > 1,
        no_remat=lambda p: not p.remat and p.chunk_size < p.seq_len) + values_by_dtype(S.NORMAL_AND_LARGE) + (
        bugclasses.presences(b_in=lambda p: p.b_in, b_out=lambda p: p.b_out, rng=lambda p: p.stochastic))
    fixed_parameters = {"ffn": "the convention passes the position-wise FFN of the implementation's own module "
                               "(a dropout wrapper of it with rng)",
                        "rng.dtype": "the key type of jax.random.key, the convention's rng"}
    examples = {"xla": 56}
    contracts = (FLOAT32_ACCUMULATION,
                 Contract("dropout_per_chunk", "with rng, chunk i calls ffn(params, x_i, rng=fold_in(rng, i)): the "
                          "oracle applies the dropout masks that contract implies"),)

    def cases(self):
        return ffn_cases()

    def program(self, params):
        return dataclasses.replace(params, values="")

    def other_data(self, params):
        return st.sampled_from(S.NORMAL_AND_LARGE).map(lambda values: dataclasses.replace(params, values=values))

    def inputs(self, case):
        p = case.params
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(p.dtype)
        f, f_out, h = p.features, p.features_out, p.hidden
        spread = 4.0 if p.values == "large" else 1.0
        out = {"x": S.round_to(rng.standard_normal(p.shape(f)) * spread, dt),
               "w_in": S.round_to(rng.standard_normal((f, h)) / np.sqrt(f), dt),
               "w_out": S.round_to(rng.standard_normal((h, f_out)) / np.sqrt(h), dt),
               "d_out": S.round_to(rng.standard_normal(p.shape(f_out)), dt)}
        b_in, b_out = rng.standard_normal(h), rng.standard_normal(f_out)
        if p.b_in:
            out["b_in"] = S.round_to(b_in, dt)
        if p.b_out:
            out["b_out"] = S.round_to(b_out, dt)
        if p.stochastic:
            out["dropout"] = _dropout_multiplier(p, case.seed)
        return out

    def evaluate(self, impl, case, inputs):
        p = case.params
        position_wise, pack = _convention(impl)
        ffn = _with_dropout(position_wise) if p.stochastic else position_wise
        knobs = accepted_keywords(impl, remat=p.remat, policy=POLICIES[p.policy], prevent_cse=p.prevent_cse)

        def call(params, x, seed):
            rng = {"rng": jax.random.key(seed)} if p.stochastic else {}
            return impl(ffn, pack(*params), x, chunk_size=p.chunk_size, **rng, **knobs)

        return _grads(call, (impl_key(impl), self.program(p)), inputs, np.uint32(case.seed))

    def _judged(self, inputs):
        """x, the weights, and the cotangent the dense FFN gets: with dropout, the output is
        the dense FFN times the multiplier, so its cotangent is d_out times it."""
        multiplier = inputs.get("dropout", 1.0)
        return [inputs["x"]] + [inputs.get(n) for n in PARAM_NAMES], multiplier

    def oracle(self, case, inputs):
        args, multiplier = self._judged(inputs)
        result = {"out": oracle.feed_forward(*args) * multiplier}
        result.update(oracle.feed_forward_vjp(*args, np.asarray(inputs["d_out"], np.float64) * multiplier))
        return result

    def yardstick(self, case, inputs):
        # Chunking is the kernel's business: one compiled dense FFN serves every chunk size.
        # In its given order its dots are whole arrays, which XLA's CPU code sums in Eigen's
        # blocks; in every other order it sums them term by term, over that order's
        # permutation of the features and hidden units. A blocked dot's worst error is a few
        # times smaller than a loop's, and a correct chunked kernel is a loop on CPU (this
        # repository's kernel is the term-by-term sum bit for bit): held to the blocked dot
        # alone, it fails on cases of large values.
        term_by_term = yardstick.order() > 0
        dense = functools.partial(_dense_ffn, dot=_dot_term_by_term) if term_by_term else _dense_ffn
        dense = _with_dropout_multiplier(dense) if case.params.stochastic else dense
        extra = (inputs["dropout"].astype(np.float32),) if case.params.stochastic else ()
        permuted = {n: yardstick.permute(a, *_SUMMED_AXES[n]) if n in _SUMMED_AXES else a for n, a in inputs.items()}
        result = _grads(dense, ("yardstick", case.params.stochastic, term_by_term), permuted, *extra)
        return {d: yardstick.restore(y, *_SUMMED_AXES.get(d.removeprefix("d"), ())) for d, y in result.items()}

    def error_map_layout(self, case, direction):
        # Positions on the chunks the kernel scans; the weights' gradients sum over every
        # chunk, so they have no block structure of their own (the default layout).
        if direction in ("out", "dx"):
            p = case.params
            names = tuple(f"axis{i}" for i in range(len(p.lead))) + self.index_names(direction)
            return ErrorMapLayout(names, len(names) - 2, len(names) - 1, (every("chunk", p.chunk_size, p.seq_len),))
        return super().error_map_layout(case, direction)

    def invalid_calls(self, impl):
        return invalid_ffn_calls(impl)


def _with_dropout(position_wise):
    """The stochastic ffn of the convention: inverted dropout of the position-wise FFN's
    output, from the key the kernel passes (each chunk its own)."""
    def stochastic(params, x, rng):
        y = position_wise(params, x)
        keep = jax.random.bernoulli(rng, 1.0 - DROPOUT_RATE, y.shape)
        return jnp.where(keep, y / (1.0 - DROPOUT_RATE), 0).astype(y.dtype)

    return stochastic


def _dropout_multiplier(p: FFNParams, seed: int) -> np.ndarray:
    """keep / (1 - rate) over the whole output, as the contract makes it: chunk i's mask
    drawn from fold_in(key(seed), i) in the shape of that chunk's output."""
    key = jax.random.key(np.uint32(seed))
    chunk_shape = (*p.lead, p.chunk_size, p.features_out)
    keeps = [np.asarray(jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - DROPOUT_RATE, chunk_shape))
             for i in range(p.seq_len // p.chunk_size)]
    return np.concatenate(keeps, axis=-2) / (1.0 - DROPOUT_RATE)


def _with_dropout_multiplier(dense):
    """The yardstick's dense FFN times the dropout multiplier, in the working precision."""
    def stochastic(params, x, multiplier):
        y = dense(params, x)
        return (y.astype(jnp.float32) * multiplier).astype(y.dtype)

    return stochastic


def _convention(impl):
    """The position-wise FFN and params container that go with an implementation: its
    module's own ``feed_forward``/``FeedForwardParams`` when it has them, else ours."""
    module = impl_module(impl)
    if hasattr(module, "feed_forward") and hasattr(module, "FeedForwardParams"):
        return module.feed_forward, module.FeedForwardParams
    return _dense_ffn, lambda *params: tuple(params)


def _grads(call, key, inputs, *rest):
    """Output and gradients of x and every given weight: one compiled function per ``key``
    and set of given weights (jit itself keys its executables by shape and dtype); ``rest``
    goes to ``call`` after params and x, undifferentiated."""
    names = [n for n in PARAM_NAMES if n in inputs]

    def forward(x, *weights_and_rest):
        weights, extra = weights_and_rest[:len(names)], weights_and_rest[len(names):]
        given = dict(zip(names, weights))
        return call(tuple(given.get(n) for n in PARAM_NAMES), x, *extra)

    fn = compiled(("ffn", key, tuple(names)), lambda: with_vjp(forward))
    out, grads = fn([inputs["x"], *(inputs[n] for n in names)], inputs["d_out"], *rest)
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
