"""dot_product_attention family: the convention of ``jax.nn.dot_product_attention(query, key,
value, bias=None, mask=None, *, scale, is_causal, query_seq_lengths, key_value_seq_lengths,
local_window_size)`` on [B, T, N, H] / [B, S, K, H], outputs and gradients.

Two default implementations of the convention: jax.nn's own (XLA, backend ``xla``) and this
project's flash kernel behind a thin adapter (``kernels/dot_product_attention.py``, the
Pallas backends). Any other kernel with this signature (tokamax's ``dot_product_attention``)
is verified with ``--attncheck-impl dot_product_attention=pkg.mod:fn``, on every backend.

Mapped onto the dense oracle (head-major, [B, N, T, H]):
- logits = scale * q.k + bias (scale defaults to 1 / sqrt(H)); query head n reads kv head
  n // (N / K); bias [B|1, N|1, T, S] and its gradient summed back to its shape;
- visible = mask AND causal (top-left: key j <= query i, whatever T and S) AND window
  (i - left <= j <= i + right) AND j < kv length AND i < query length, as an explicit mask;
- a row that sees no key outputs the mean of v over all S keys, with the gradient of that
  mean ("mean_of_v"): what jax.nn's large finite mask value gives;
- rows past a query length output 0 and take no gradient (their cotangent is zeroed).
"""

from __future__ import annotations

import dataclasses
import math

import hypothesis
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from attncheck import backends, bugclasses, domain, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.compiled import compiled, impl_key, with_vjp
from attncheck.expectations import Contract
from attncheck.specs.base import BIAS_AXES, FLOAT32_ACCUMULATION, InvalidCall, KernelSpec, resolve_impl, values_by_dtype

FAMILY = "dot_product_attention"
# (batch, T, S, N, K, H): sizes off the usual tiles (the flash adapter pads them) and one on them.
SHAPES = (
    (2, 6, 8, 4, 2, 16),  # T < S, two query heads per kv head
    (1, 8, 5, 2, 2, 8),  # T > S: under top-left causal the rows past S see every key
    (2, 1, 7, 4, 1, 16),  # one query token (decode), one kv head
    (1, 136, 128, 2, 1, 64),  # the flash kernel's own tiles (no padding; its causal path), T > S
    (1, 16, 4 * S.LONG_REDUCTION, 2, 1, 64),  # a long reduction over the keys (32 blocks of 128)
)
BIAS_LAYOUTS = {"none": None, "full": "BNTS", "per_head": "1NTS", "per_key": "B11S"}
MASK_LAYOUTS = {"none": None, "per_head": "BNTS", "shared": "11TS"}
MASK_DENSITY = 0.6
EMPTIED_ROWS = 0.25  # the share of mask rows emptied where the mask empties rows
WINDOWS = (None, 3, (4, 0), (2, 1))  # local_window_size: an int is (w, w)
TO_HEADS_MAJOR = (0, 2, 1, 3)  # [B, T, N, H] <-> [B, N, T, H]
# Large logits or tied keys over a handful of keys saturate or balance every softmax: the
# gradients are then rounding noise around a tiny truth (the yardstick thousands of ulps
# from it), which proves nothing. They are drawn where rows see many keys.
LARGE_VALUES_MIN_KV_LEN = 128
# An implementation may sum in blocks: the sink shows its running denominator (strategies.SINK).
VALUE_KINDS = (*S.VALUE_KINDS, S.SINK)


@dataclasses.dataclass(frozen=True)
class DPAParams(Params):
    dtype: str
    batch: int
    q_len: int  # T
    kv_len: int  # S
    q_heads: int  # N
    kv_heads: int  # K
    head_dim: int  # H
    scale: float | None  # None: jax.nn's default 1 / sqrt(H)
    bias: str  # a BIAS_LAYOUTS key
    mask: str  # a MASK_LAYOUTS key
    mask_empties_rows: bool  # the mask hides every key of some rows
    is_causal: bool
    window: int | tuple[int, int] | None
    q_lengths: tuple[int, ...] | None
    kv_lengths: tuple[int, ...] | None
    values: str  # a VALUE_KINDS distribution

    @property
    def sequence_length(self) -> int:
        return self.kv_len

    @property
    def window_sides(self) -> tuple[int, int] | None:
        return (self.window, self.window) if isinstance(self.window, int) else self.window


# jax.nn takes any finite scale: its default, below and above 1, one that is no power of
# two, and 0 and negative ones (logits = scale * q.k + bias: a kernel that folds its mask
# into a bias it scales hides nothing there).
SCALES = (None, 0.5, 1.0, 1.7, 0.0, -0.5)


def effective_scale(p: DPAParams) -> float:
    return 1.0 / math.sqrt(p.head_dim) if p.scale is None else p.scale


def hides_keys(p) -> bool:
    """Some query has a key it must not see."""
    return p.mask != "none" or p.window is not None or p.kv_lengths is not None or p.is_causal


@st.composite
def dpa_cases(draw) -> Case[DPAParams]:
    batch, t, s, n, k, h = draw(st.sampled_from(SHAPES))
    mask = draw(st.sampled_from(tuple(MASK_LAYOUTS)))

    def lengths(full):
        return st.none() | st.lists(st.integers(0, full), min_size=batch, max_size=batch).map(tuple)

    case = Case(FAMILY, DPAParams(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), batch=batch, q_len=t, kv_len=s, q_heads=n, kv_heads=k,
        head_dim=h, scale=draw(st.sampled_from(SCALES)), bias=draw(st.sampled_from(tuple(BIAS_LAYOUTS))),
        mask=mask, mask_empties_rows=mask != "none" and draw(st.booleans()), is_causal=draw(st.booleans()),
        window=draw(st.sampled_from(WINDOWS)), q_lengths=draw(lengths(t)), kv_lengths=draw(lengths(s)),
        values=draw(st.sampled_from(VALUE_KINDS if s >= LARGE_VALUES_MIN_KV_LEN else ("normal",)))),
        draw(S.seeds))
    # Where no query row sees two keys, every gradient but dv is 0 by definition and
    # rounding noise in any implementation (di = rowsum(dO * O) against dO . v): against
    # an all-zero truth the tolerance floor is zero, and the case proves nothing. The
    # top-left convention makes this common (a decode step under causal sees key 0 only).
    hypothesis.assume((visibility(case.params, dpa_inputs(case).get("mask")).sum(axis=-1) >= 2).any())
    return case


def dpa_inputs(case: Case[DPAParams]) -> dict[str, np.ndarray]:
    p = case.params
    rng = np.random.default_rng(case.seed)
    dt = S.dtype_of(p.dtype)
    # Drawn heads-major (the helpers tie keys along the sequence axis), handed over [B, L, heads, H].
    q_shape, kv_shape = (p.batch, p.q_heads, p.q_len, p.head_dim), (p.batch, p.kv_heads, p.kv_len, p.head_dim)
    out = {name: S.round_to(S.attention_values(rng, p.values, shape, role=role), dt).transpose(TO_HEADS_MAJOR)
           for name, role, shape in (("query", "q", q_shape), ("key", "k", kv_shape), ("value", "v", kv_shape),
                                     ("d_out", "d_out", q_shape))}
    if BIAS_LAYOUTS[p.bias]:
        out["bias"] = S.round_to(rng.standard_normal(_layout_shape(BIAS_LAYOUTS[p.bias], p)), dt)
    if MASK_LAYOUTS[p.mask]:
        mask = rng.random(_layout_shape(MASK_LAYOUTS[p.mask], p)) < MASK_DENSITY
        if p.mask_empties_rows:
            mask &= rng.random(mask.shape[:-1] + (1,)) >= EMPTIED_ROWS
        out["mask"] = mask
    for name, lengths in (("query_seq_lengths", p.q_lengths), ("key_value_seq_lengths", p.kv_lengths)):
        if lengths is not None:
            out[name] = np.array(lengths, np.int32)
    return out


def _layout_shape(layout: str, p: DPAParams) -> tuple[int, ...]:
    sizes = {"B": p.batch, "N": p.q_heads, "T": p.q_len, "S": p.kv_len, "1": 1}
    return tuple(sizes[axis] for axis in layout)


def visibility(p: DPAParams, mask) -> np.ndarray:
    """[B, N, T, S] bool: what the convention lets query i of head n see."""
    i, j = np.arange(p.q_len)[:, None], np.arange(p.kv_len)[None, :]
    visible = np.ones((p.batch, p.q_heads, p.q_len, p.kv_len), bool)
    if mask is not None:
        visible &= mask
    if p.is_causal:
        visible &= j <= i
    if p.window is not None:
        left, right = p.window_sides
        visible &= (i - left <= j) & (j <= i + right)
    if p.kv_lengths is not None:
        visible &= (j[None] < np.array(p.kv_lengths)[:, None, None])[:, None]
    return visible & _query_valid(p)


def _query_valid(p: DPAParams) -> np.ndarray:
    """[B, 1, T, 1]: rows before each query length."""
    lengths = np.full(p.batch, p.q_len) if p.q_lengths is None else np.array(p.q_lengths)
    return (np.arange(p.q_len)[None, :] < lengths[:, None])[:, None, :, None]


def _padded_rows(case: Case[DPAParams], inputs) -> dict[str, np.ndarray]:
    """Where padded query rows show: their output rows, and all of dv of a batch that has
    some (a padded row's cotangent reaches every key it would see)."""
    valid = _query_valid(case.params)[:, 0, :, 0]  # [B, T]
    return {"out": ~valid[:, :, None, None], "dv": ~valid.all(axis=1)[:, None, None, None]}


def _off_tiles(p: DPAParams) -> bool:
    return bool(p.q_len % 8 or p.kv_len % 128)


def some_row_sees_no_key(p: DPAParams) -> bool:
    """A row within its query length that sees no key (its mean of v is checked), from the
    parameters alone: an emptied mask row or a kv length of 0."""
    q_lengths = p.q_lengths or (p.q_len,) * p.batch
    return p.mask_empties_rows or any(kv == 0 and q > 0 for q, kv in zip(q_lengths, p.kv_lengths or ()))


SCALE = bugclasses.numbers("scale", lambda p: p.scale, parameters.NUMBER_CELLS)
# Crossed pairwise: the scale, what hides keys, and whether the shape fills the kernels'
# tiles. A hide value that goes through the scale, or padding that the kernel hides in its
# own way, shows only in some of these pairs (a mask under a negative scale).
PAIRS = bugclasses.pairwise(
    SCALE,
    bugclasses.partition("hiding", nothing=lambda p: not hides_keys(p), mask=lambda p: p.mask != "none",
                         kv_lengths=lambda p: p.kv_lengths is not None and min(p.kv_lengths) < p.kv_len,
                         window=lambda p: p.window is not None, causal=lambda p: p.is_causal),
    bugclasses.partition("tiles", on=lambda p: not _off_tiles(p), off=_off_tiles))


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
    bug_classes = bugclasses.bug_classes(
        # Plain causal on the usual tiles (no padding, nothing else hides keys): where a tiled
        # kernel runs its own causal masking and block skipping.
        causal_on_tiles=lambda p: (p.is_causal and not _off_tiles(p) and p.mask == "none" and p.window is None
                                   and p.kv_lengths is None),
        # Top-left alignment shows where T != S; a window would hide part of it.
        causal_q_len_ne_kv_len=lambda p: p.is_causal and p.q_len != p.kv_len and p.window is None,
        bias_full=lambda p: p.bias == "full",
        # dbias summed over the axes the bias broadcasts along.
        bias_broadcast=lambda p: p.bias in ("per_head", "per_key"),
        fully_masked_row=some_row_sees_no_key,
        # Query heads that share a kv head see different keys.
        mask_per_head=lambda p: p.mask == "per_head" and p.q_heads > p.kv_heads,
        mask_shared=lambda p: p.mask == "shared",
        q_padding=bugclasses.Touching(lambda p: p.q_lengths is not None and min(p.q_lengths) < p.q_len,
                                      _padded_rows),
        kv_padding=lambda p: p.kv_lengths is not None and 0 < min(p.kv_lengths) < p.kv_len,
        window_with_causal=lambda p: p.window is not None and p.is_causal,
        # Causal hides what the right side lets through.
        window_right_side=lambda p: p.window is not None and p.window_sides[1] > 0 and not p.is_causal,
        # What changes the logits shows where rows see several keys (every case has one).
        default_scale=lambda p: p.scale is None,
        # A hidden key must stay hidden whatever the scale's sign: a mask value scaled by a
        # negative scale is the largest logit, by 0 a visible one.
        negative_scale_hides_keys=lambda p: p.scale is not None and p.scale < 0 and hides_keys(p),
        zero_scale_hides_keys=lambda p: p.scale == 0 and hides_keys(p),
        # Key lengths alone hide keys where the keys fill the kernel's blocks exactly (no
        # padding, no mask): a kernel that only masks its padding forgets them.
        kv_lengths_alone=lambda p: (p.kv_lengths is not None and min(p.kv_lengths) < p.kv_len and p.kv_len % 128 == 0
                                    and p.mask == "none" and p.window is None),
        bf16=lambda p: p.dtype == "bfloat16",
        large_logits=lambda p: p.values == "large",
        # P @ V over thousands of keys of v far from 0, in bfloat16: where an accumulator
        # narrower than float32 shows (the convention accumulates in float32).
        long_reduction_offset_values=lambda p: (p.kv_len >= S.LONG_REDUCTION and p.values == "offset"
                                                and p.dtype == "bfloat16" and not hides_keys(p)
                                                and S.spread_weights(effective_scale(p), p.head_dim)),
        # The same after a sink, at the scale its margins are drawn for: where a running softmax
        # denominator narrower than float32 shows.
        long_reduction_sink=lambda p: (p.kv_len >= 4 * S.LONG_REDUCTION and p.values == S.SINK
                                       and p.dtype == "bfloat16" and not hides_keys(p)
                                       and S.sink_scale(effective_scale(p), p.head_dim)),
        decode=lambda p: p.q_len == 1,
        gqa=lambda p: 1 < p.kv_heads < p.q_heads,
        mqa=lambda p: p.kv_heads == 1 < p.q_heads,
        # Off the usual tiles (sequences not multiples of 8 / 128): padding must stay hidden.
        shape_off_tiles=_off_tiles,
    ) + SCALE.classes + PAIRS + values_by_dtype(VALUE_KINDS) + bugclasses.presences(
        bias=lambda p: p.bias != "none", mask=lambda p: p.mask != "none",
        query_seq_lengths=lambda p: p.q_lengths is not None, key_value_seq_lengths=lambda p: p.kv_lengths is not None,
        local_window_size=lambda p: p.window is not None)
    examples = {"xla": 8, "interpret": 4, "interpret-hazards": 2, "tpu-lower": 4, "tpu": 16}
    # Rows that see every key with the weights their values are drawn for: a rare draw.
    explicit_examples = {name: Case(FAMILY, DPAParams(
        dtype="bfloat16", batch=1, q_len=16, kv_len=4 * S.LONG_REDUCTION, q_heads=2, kv_heads=1, head_dim=64,
        scale=None, bias="none", mask="none", mask_empties_rows=False, is_causal=False, window=None,
        q_lengths=None, kv_lengths=None, values=values), 0)
        for name, values in (("long_reduction_offset_values", "offset"), ("long_reduction_sink", S.SINK))}
    contracts = (FLOAT32_ACCUMULATION,
                 Contract("unseeing_rows_and_padding", "jax.nn's convention: a row that sees no key outputs the mean "
                          "of v over all keys with that mean's gradient; rows past a query length output 0 and take no "
                          "gradient"),)
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
        # Values, masks and lengths are data; only whether they are given changes the program.
        static = dataclasses.replace(p, values="", mask_empties_rows=False,
                                     q_lengths=p.q_lengths and (), kv_lengths=p.kv_lengths and ())
        primals, rest = self._operands(inputs)
        fn = compiled((FAMILY, impl_key(impl), static), lambda: with_vjp(self._call(impl, p)))
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


def invalid_dpa_calls(impl, *, adapter: bool = False) -> list[InvalidCall]:
    """Calls the convention rules out; every implementation must reject them with an error
    naming the argument (the exception class is the implementation's). The flash adapter
    also rejects what jax.nn lets through: float16 (the kernel has no float16), a mask head
    axis neither 1 nor N (jax.nn: a bare AssertionError), a negative window (jax.nn: accepted).
    Sequence lengths are the implementation's declared multiple (attncheck.domain), so each
    call is refused for what it breaks, not for a sequence the implementation never takes."""
    multiple = domain.of(impl).sequence_multiple
    b, t, s, n, k, h = 2, domain.round_up(8, multiple), domain.round_up(128, multiple), 4, 2, 64
    f32 = jnp.float32
    query, key = jnp.zeros((b, t, n, h), f32), jnp.zeros((b, s, k, h), f32)
    bad = {
        "value_head_dim": (dict(value=jnp.zeros((b, s, k, 32), f32)), r"value"),
        "value_dtype": (dict(value=key.astype(jnp.bfloat16)), r"value"),
        "query_dtype": (dict(query=query.astype(jnp.bfloat16)), r"query"),
        "query_head_dim": (dict(query=jnp.zeros((b, t, n, 32), f32)), r"query"),
        "query_batch": (dict(query=jnp.zeros((1, t, n, h), f32)), r"query"),
        "heads_not_multiple": (dict(query=jnp.zeros((b, t, 3, h), f32)), r"(?i)query heads"),
        "mask_not_bool": (dict(mask=jnp.zeros((b, n, t, s), f32)), r"mask"),
        "mask_rank": (dict(mask=jnp.ones((1, b, n, t, s), bool)), r"mask"),
        "bias_rank": (dict(bias=jnp.zeros((1, b, n, t, s), f32)), r"bias"),
        "query_seq_lengths_shape": (dict(query_seq_lengths=jnp.array([1, 2, 3], jnp.int32)), r"query_seq_lengths"),
        "key_value_seq_lengths_dtype": (dict(key_value_seq_lengths=jnp.array([1.0, 2.0], f32)),
                                        r"key_value_seq_lengths"),
    }
    if adapter:
        bad.update({
            "float16": (dict(query=query.astype(jnp.float16), key=key.astype(jnp.float16),
                             value=key.astype(jnp.float16)), r"query dtype"),
            "mask_heads": (dict(mask=jnp.ones((b, 3, t, s), bool)), r"mask"),
            "negative_window": (dict(local_window_size=(-1, 0)), r"local_window_size"),
        })
    return [InvalidCall(kind, lambda change=change: impl(**{"query": query, "key": key, "value": key, **change}),
                        (ValueError, TypeError), match) for kind, (change, match) in bad.items()]


SPEC = DPASpec()
