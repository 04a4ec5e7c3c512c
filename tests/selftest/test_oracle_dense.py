"""Self-tests of the dense float64 oracle and the ring helpers.

The oracle is checked against code that shares nothing with it: a separately
written jax float64 attention (and jax.grad of it), jax.nn.dot_product_attention,
central finite differences, closed forms, and a visibility mask evaluated one
(query, key) pair at a time straight from the spec text.
"""

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from attncheck import oracle

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# jax compiles every new shape (about a second on a busy CPU): fewer examples there;
# the NumPy-only references carry the volume.
JAX_EXAMPLES = settings(EXAMPLES, max_examples=15)
FLOAT64_TOL = dict(rtol=1e-12, atol=1e-12)
# jax.nn.dot_product_attention runs its softmax in float32 whatever the input dtype.
JAX_NN_TOL = dict(rtol=1e-5, atol=1e-5)
FD_STEP = 1e-5
FD_RTOL = 1e-6
# Rounding in the two loss evaluations, amplified by 1 / (2 * FD_STEP): the finite
# difference cannot resolve a directional derivative below this times sum|d_out * out|.
FD_NOISE = 10 * np.finfo(np.float64).eps / FD_STEP
POSITION_OFFSETS = (0, 40_000, 2**33)  # within int16, past int16, past int32
MAX_POSITION_SPREAD = 12
HUGE_BIAS = 1e4  # exp(-HUGE_BIAS + any logit here) underflows to exactly 0


@dataclasses.dataclass(frozen=True)
class Case:
    inputs: dict  # q, k, v and, when present, bias: everything the VJP differentiates
    d_out: np.ndarray
    options: dict  # every other keyword of oracle.attention, None where unused

    @property
    def shape(self):
        """(B, Hq, Q, K)"""
        return self.inputs["q"].shape[:3] + self.inputs["k"].shape[2:3]


def _or_none(strategy):
    return st.none() | strategy


@st.composite
def cases(draw, conventions=oracle.MASKED_ROW_CONVENTIONS, with_soft_cap=True, same_head_dim=False, with_mask=True):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 4))
    q_heads = kv_heads * draw(st.integers(1, 4 // kv_heads))
    q_len, kv_len, head_dim = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(1, 8))
    v_dim = head_dim if same_head_dim else draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    inputs = dict(
        q=rng.normal(size=(batch, q_heads, q_len, head_dim)),
        k=rng.normal(size=(batch, kv_heads, kv_len, head_dim)),
        v=rng.normal(size=(batch, kv_heads, kv_len, v_dim)),
    )
    if draw(st.booleans()):
        full = (batch, q_heads, q_len, kv_len)
        shape = tuple(n if draw(st.booleans()) else 1 for n in full)
        inputs["bias"] = rng.normal(size=shape[draw(st.integers(0, 2)):])  # 4-D, 3-D or 2-D
    options = dict(
        scale=draw(st.floats(0.1, 1.5)),
        causal=draw(st.booleans()),
        window=draw(_or_none(st.integers(1, 9))),
        soft_cap=draw(_or_none(st.floats(0.5, 5.0))) if with_soft_cap else None,
        k_scale=draw(_or_none(st.floats(0.25, 2.0))),
        v_scale=draw(_or_none(st.floats(0.25, 2.0))),
        masked_rows=draw(st.sampled_from(conventions)),
        q_segment_ids=None,
        kv_segment_ids=None,
        q_positions=None,
        kv_positions=None,
        visible=None,
    )
    if with_mask == "per_head" or (with_mask and draw(st.booleans())):
        # An explicit mask, ANDed with the rules: each axis full or broadcast (a head axis
        # of Hq gives per-head masks); sparse enough to mask whole rows at times.
        full = (batch, q_heads, q_len, kv_len)
        shape = tuple(n if draw(st.booleans()) or (axis == 1 and with_mask == "per_head") else 1
                      for axis, n in enumerate(full))
        options["visible"] = rng.random(shape) < draw(st.sampled_from((0.3, 0.8)))
    if draw(st.booleans()):
        # Query segment 2 never occurs among the keys: those rows are fully masked.
        options["q_segment_ids"] = rng.integers(0, 3, (batch, q_len))
        options["kv_segment_ids"] = rng.integers(0, 2, (batch, kv_len))
    layout = draw(st.sampled_from(["default", "shared", "per_batch"]))
    if layout != "default":
        offset = draw(st.sampled_from(POSITION_OFFSETS))
        lead = (batch,) if layout == "per_batch" else ()
        options["q_positions"] = offset + rng.integers(0, MAX_POSITION_SPREAD, lead + (q_len,))
        options["kv_positions"] = offset + rng.integers(0, MAX_POSITION_SPREAD, lead + (kv_len,))
    return Case(inputs, rng.normal(size=(batch, q_heads, q_len, v_dim)), options)


def visible_by_definition(case):
    """[B, Hq, Q, K] bool, one (query, key) pair at a time with Python ints, as the spec reads."""
    o = case.options
    batch, q_heads, q_len, kv_len = case.shape

    def positions(name, length, b):
        x = o[name]
        return list(range(length)) if x is None else [int(p) for p in (x[b] if x.ndim == 2 else x)]

    visible = np.zeros((batch, q_len, kv_len), dtype=bool)
    for b in range(batch):
        q_pos, kv_pos = positions("q_positions", q_len, b), positions("kv_positions", kv_len, b)
        for i in range(q_len):
            for j in range(kv_len):
                visible[b, i, j] = (
                    (o["q_segment_ids"] is None or o["q_segment_ids"][b][i] == o["kv_segment_ids"][b][j])
                    and (not o["causal"] or kv_pos[j] <= q_pos[i])
                    and (o["window"] is None or q_pos[i] - kv_pos[j] < o["window"])
                )
    visible = np.repeat(visible[:, None], q_heads, axis=1)
    if o["visible"] is not None:
        mask = o["visible"]
        for b, h, i, j in np.ndindex(visible.shape):
            index = tuple(x if n > 1 else 0 for x, n in zip((b, h, i, j), mask.shape))
            visible[b, h, i, j] &= bool(mask[index])
    return visible


def _scale_or_one(x):
    return 1.0 if x is None else x


def jax_attention(q, k, v, bias=None, *, visible, options):
    """Separately written attention in jax; float64 when called under jax.enable_x64."""
    o = options
    group = q.shape[1] // k.shape[1]
    keys = jnp.repeat(k * _scale_or_one(o["k_scale"]), group, axis=1)
    values = jnp.repeat(v * _scale_or_one(o["v_scale"]), group, axis=1)
    logits = o["scale"] * jnp.einsum("bhqd,bhkd->bhqk", q, keys)
    if bias is not None:
        logits = logits + bias
    if o["soft_cap"] is not None:
        logits = o["soft_cap"] * jnp.tanh(logits / o["soft_cap"])
    visible = jnp.asarray(visible)
    empty = ~visible.any(axis=-1, keepdims=True)
    shift = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    weights = jnp.where(visible, jnp.exp(logits - shift), 0.0)
    total = jnp.where(empty, 1.0, weights.sum(axis=-1, keepdims=True))
    out = (weights / total) @ values
    if o["masked_rows"] == "mean_of_v":
        out = jnp.where(empty, values.mean(axis=2, keepdims=True), out)
    elif o["masked_rows"] == "nan":
        out = jnp.where(empty, jnp.nan, out)
    lse = jnp.where(empty, -jnp.inf, shift + jnp.log(total))[..., 0]
    return out, lse


def _oracle_kwargs(case):
    return case.inputs | case.options


def per_query_reference(case):
    """(out, lse) one query row at a time, visible keys picked by boolean indexing."""
    o = case.options
    q, k, v = case.inputs["q"], case.inputs["k"], case.inputs["v"]
    batch, q_heads, q_len, _ = case.shape
    group = q_heads // k.shape[1]
    bias = np.broadcast_to(case.inputs.get("bias", 0.0), case.shape)
    visible = visible_by_definition(case)
    out, lse = np.zeros(case.d_out.shape), np.full(case.shape[:3], -np.inf)
    for b, h, i in np.ndindex(batch, q_heads, q_len):
        keys, values = visible[b, h, i], v[b, h // group] * _scale_or_one(o["v_scale"])
        if not keys.any():
            out[b, h, i] = {"zero": 0.0, "mean_of_v": values.mean(axis=0), "nan": np.nan}[o["masked_rows"]]
            continue
        logits = o["scale"] * (k[b, h // group, keys] * _scale_or_one(o["k_scale"])) @ q[b, h, i] + bias[b, h, i, keys]
        if o["soft_cap"] is not None:
            logits = o["soft_cap"] * np.tanh(logits / o["soft_cap"])
        weights = np.exp(logits - logits.max())
        out[b, h, i] = weights @ values[keys] / weights.sum()
        lse[b, h, i] = logits.max() + np.log(weights.sum())
    return out, lse


@EXAMPLES
@given(cases())
def test_forward_matches_per_query_reference(case):
    out, lse = per_query_reference(case)
    result = oracle.attention(**_oracle_kwargs(case))
    np.testing.assert_allclose(result.out, out, **FLOAT64_TOL)
    np.testing.assert_allclose(result.lse, lse, **FLOAT64_TOL)
    np.testing.assert_array_equal(result.fully_masked, np.isneginf(lse))


@JAX_EXAMPLES
@given(cases(conventions=("zero", "mean_of_v")))
def test_forward_and_vjp_match_jax_grad_of_independent_float64(case):
    visible = visible_by_definition(case)
    with jax.enable_x64(True):
        def loss(inputs):
            out, lse = jax_attention(**inputs, visible=visible, options=case.options)
            return jnp.sum(out * case.d_out), (out, lse)

        (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            {name: jnp.asarray(x) for name, x in case.inputs.items()})
        expected = {"out": out, "lse": lse} | {f"d{name}": g for name, g in grads.items()}
    result = oracle.attention(**_oracle_kwargs(case))
    actual = {"out": result.out, "lse": result.lse} | oracle.attention_vjp(d_out=case.d_out, **_oracle_kwargs(case))
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(actual[name], np.asarray(value), **FLOAT64_TOL, err_msg=name)


def assert_vjp_matches_central_finite_differences(case):
    grads = oracle.attention_vjp(d_out=case.d_out, **_oracle_kwargs(case))
    noise = FD_NOISE * np.sum(np.abs(oracle.attention(**_oracle_kwargs(case)).out * case.d_out))
    rng = np.random.default_rng(0)
    for name, x in case.inputs.items():
        direction = rng.normal(size=x.shape)

        def loss(step):
            moved = _oracle_kwargs(case) | {name: x + step * direction}
            return np.sum(oracle.attention(**moved).out * case.d_out)

        finite_difference = (loss(FD_STEP) - loss(-FD_STEP)) / (2 * FD_STEP)
        grad = grads[f"d{name}"]
        # Relative to |grad| |direction|, which bounds the directional derivative, so a
        # near-cancelling sum is not held to a precision finite differences lack.
        scale = np.linalg.norm(grad) * np.linalg.norm(direction)
        np.testing.assert_allclose(finite_difference, np.sum(grad * direction), rtol=FD_RTOL,
                                   atol=FD_RTOL * scale + noise, err_msg=name)


@EXAMPLES
@given(cases(conventions=("zero", "mean_of_v")))
def test_vjp_matches_central_finite_differences(case):
    assert_vjp_matches_central_finite_differences(case)


@JAX_EXAMPLES
@given(cases(conventions=("mean_of_v",), with_soft_cap=False, same_head_dim=True))
def test_matches_jax_nn_dot_product_attention(case):
    """jax.nn masks with a large finite negative value: the "mean_of_v" convention.
    It has no soft cap, no k/v scale (applied to its inputs here) and needs Dv == D."""
    o = case.options
    kv_len = case.shape[3]
    if o["q_segment_ids"] is None and o["q_positions"] is None and o["visible"] is None:
        # Its own causal and window masks check the oracle's default-position semantics.
        masks = dict(is_causal=o["causal"],
                     local_window_size=None if o["window"] is None else (o["window"] - 1, 0 if o["causal"] else kv_len))
    else:
        masks = dict(mask=visible_by_definition(case))
    to_btnh = (0, 2, 1, 3)
    with jax.enable_x64(True):
        out = jax.nn.dot_product_attention(
            case.inputs["q"].transpose(to_btnh),
            (case.inputs["k"] * _scale_or_one(o["k_scale"])).transpose(to_btnh),
            (case.inputs["v"] * _scale_or_one(o["v_scale"])).transpose(to_btnh),
            bias=case.inputs.get("bias"),
            scale=o["scale"],
            **masks,
        )
        out = np.asarray(out).transpose(to_btnh)
    np.testing.assert_allclose(oracle.attention(**_oracle_kwargs(case)).out, out, **JAX_NN_TOL)


RULES = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions", "window")


def _oracle_results(kwargs, d_out):
    result = oracle.attention(**kwargs)
    return dict(out=result.out, lse=result.lse, fully_masked=result.fully_masked) | oracle.attention_vjp(
        d_out=d_out, **kwargs)


@EXAMPLES
@given(cases())
def test_explicit_mask_equals_the_rules_it_replaces(case):
    """The visibility the rules (segments, causal, window, positions) and any drawn mask
    define, given instead as one explicit mask, gives bit-identical outputs and gradients
    under every convention: the mask is ANDed with the rules, broadcast per axis."""
    as_data = _oracle_kwargs(case) | dict.fromkeys(RULES) | dict(causal=False, visible=visible_by_definition(case))
    expected, actual = _oracle_results(_oracle_kwargs(case), case.d_out), _oracle_results(as_data, case.d_out)
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(actual[name], value, err_msg=name)


@EXAMPLES
@given(cases(conventions=("zero", "mean_of_v"), with_mask="per_head"))
def test_vjp_with_per_head_mask_matches_central_finite_differences(case):
    assert_vjp_matches_central_finite_differences(case)


@pytest.mark.parametrize("masked_rows", oracle.MASKED_ROW_CONVENTIONS)
@pytest.mark.parametrize("q_heads, kv_heads", [(2, 1), (4, 2), (3, 3)])
def test_per_head_mask_applies_to_its_query_head_only(q_heads, kv_heads, masked_rows):
    """Each query head's rows, values and dq equal attention over that head alone with its
    own mask; dk and dv are the sums over the query heads sharing a kv head."""
    rng = np.random.default_rng(q_heads)
    q, k = rng.normal(size=(2, q_heads, 5, 3)), rng.normal(size=(2, kv_heads, 6, 3))
    v = rng.normal(size=(2, kv_heads, 6, 4))
    bias, d_out = rng.normal(size=(2, q_heads, 5, 6)), rng.normal(size=(2, q_heads, 5, 4))
    visible = rng.random((1, q_heads, 5, 6)) < 0.5
    visible[:, 0, 1] = False  # a row fully masked in head 0 only
    visible[:, 1:, 1, 0] = True
    options = dict(scale=0.6, soft_cap=2.5, v_scale=1.5, masked_rows=masked_rows)
    result = oracle.attention(q, k, v, bias=bias, visible=visible, **options)
    grads = oracle.attention_vjp(q, k, v, d_out, bias=bias, visible=visible, **options)
    assert result.fully_masked[:, 0, 1].all() and not result.fully_masked[:, 1:, 1].any()
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    group = q_heads // kv_heads
    for h in range(q_heads):
        kv = np.s_[:, h // group:h // group + 1]
        alone = dict(q=q[:, h:h + 1], k=k[kv], v=v[kv], bias=bias[:, h:h + 1], visible=visible[:, h:h + 1]) | options
        expected = oracle.attention(**alone)
        expected_grads = oracle.attention_vjp(d_out=d_out[:, h:h + 1], **alone)
        np.testing.assert_array_equal(result.out[:, h], expected.out[:, 0])
        np.testing.assert_array_equal(result.lse[:, h], expected.lse[:, 0])
        np.testing.assert_array_equal(result.fully_masked[:, h], expected.fully_masked[:, 0])
        np.testing.assert_array_equal(grads["dq"][:, h], expected_grads["dq"][:, 0])
        np.testing.assert_array_equal(grads["dbias"][:, h], expected_grads["dbias"][:, 0])
        dk[kv] += expected_grads["dk"]
        dv[kv] += expected_grads["dv"]
    np.testing.assert_allclose(grads["dk"], dk, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(grads["dv"], dv, rtol=1e-13, atol=1e-14)


def _random(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


@pytest.mark.parametrize("q_heads, kv_heads", [(1, 1), (4, 2), (3, 1)])
def test_equal_logits_give_mean_of_visible_v(q_heads, kv_heads):
    v = _random((2, kv_heads, 6, 3))
    out = oracle.attention(np.zeros((2, q_heads, 6, 4)), _random((2, kv_heads, 6, 4)), v, scale=1.0, causal=True).out
    prefix_means = np.cumsum(v, axis=2) / np.arange(1, 7)[:, None]
    np.testing.assert_allclose(out, np.repeat(prefix_means, q_heads // kv_heads, axis=1), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("q_heads, kv_heads", [(1, 1), (4, 2), (4, 1)])
def test_single_visible_key_gives_exactly_its_value(q_heads, kv_heads):
    # causal with window 1: query i sees key i only, whatever the bias and cap.
    v = _random((2, kv_heads, 5, 3), seed=1)
    out = oracle.attention(_random((2, q_heads, 5, 4)), _random((2, kv_heads, 5, 4)), v, scale=0.7, causal=True,
                           window=1, bias=_random((5, 5), seed=2), soft_cap=3.0, v_scale=0.5).out
    np.testing.assert_array_equal(out, np.repeat(v * 0.5, q_heads // kv_heads, axis=1))


def test_huge_bias_selects_its_key_exactly():
    chosen = np.array([3, 0, 4, 4, 1])
    bias = np.zeros((1, 2, 5, 5))
    bias[..., np.arange(5), chosen] = HUGE_BIAS
    v = _random((1, 1, 5, 3), seed=1)
    out = oracle.attention(_random((1, 2, 5, 4)), _random((1, 1, 5, 4)), v, scale=1.0, bias=bias).out
    np.testing.assert_array_equal(out, np.broadcast_to(v[:, :, chosen], out.shape))


def test_one_query_and_two_keys_give_the_hand_computed_output_and_gradients():
    """Small enough to compute by hand: the arithmetic is in the comments, not in the oracle."""
    # [B, H, Q or K, D] = [1, 1, 1, 2] and [1, 1, 2, 2]; scale 1.
    q = np.array([1.0, 2.0]).reshape(1, 1, 1, 2)
    k = np.array([[0.0, 0.0], [np.log(3.0), 0.0]]).reshape(1, 1, 2, 2)
    v = np.array([[4.0, 0.0], [0.0, 8.0]]).reshape(1, 1, 2, 2)
    d_out = np.array([1.0, 1.0]).reshape(1, 1, 1, 2)
    # logits: s0 = 1*0 + 2*0 = 0, s1 = 1*ln3 + 2*0 = ln3
    # exp: e^0 = 1, e^ln3 = 3, sum 4: p = [1/4, 3/4], lse = ln4
    # out = 1/4*[4, 0] + 3/4*[0, 8] = [1, 0] + [0, 6] = [1, 6]
    result = oracle.attention(q, k, v, scale=1.0)
    np.testing.assert_allclose(result.out, np.array([1.0, 6.0]).reshape(1, 1, 1, 2), **FLOAT64_TOL)
    np.testing.assert_allclose(result.lse, np.log(4.0) * np.ones((1, 1, 1)), **FLOAT64_TOL)
    # dP_j = d_out . v_j: dP0 = 1*4 + 1*0 = 4, dP1 = 1*0 + 1*8 = 8
    # rowsum(p * dP) = 1/4*4 + 3/4*8 = 1 + 6 = 7 (= d_out . out = 1 + 6)
    # dS_j = p_j (dP_j - 7): dS0 = 1/4 * (4 - 7) = -3/4, dS1 = 3/4 * (8 - 7) = 3/4
    # dq = dS0 k0 + dS1 k1 = -3/4*[0, 0] + 3/4*[ln3, 0] = [3/4 ln3, 0]
    # dk_j = dS_j q: dk0 = -3/4*[1, 2] = [-3/4, -3/2], dk1 = 3/4*[1, 2] = [3/4, 3/2]
    # dv_j = p_j d_out: dv0 = 1/4*[1, 1] = [1/4, 1/4], dv1 = 3/4*[1, 1] = [3/4, 3/4]
    grads = oracle.attention_vjp(q, k, v, d_out, scale=1.0)
    np.testing.assert_allclose(grads["dq"], np.array([0.75 * np.log(3.0), 0.0]).reshape(1, 1, 1, 2), **FLOAT64_TOL)
    np.testing.assert_allclose(grads["dk"], np.array([[-0.75, -1.5], [0.75, 1.5]]).reshape(1, 1, 2, 2),
                               **FLOAT64_TOL)
    np.testing.assert_allclose(grads["dv"], np.array([[0.25, 0.25], [0.75, 0.75]]).reshape(1, 1, 2, 2),
                               **FLOAT64_TOL)


def _fully_masked_problem():
    """Queries 3 and 4 carry segment 9, which no key has. Two query heads share each kv head."""
    kwargs = dict(q=_random((2, 4, 5, 3)), k=_random((2, 2, 6, 3), seed=1), v=_random((2, 2, 6, 2), seed=2),
                  bias=_random((4, 5, 6), seed=3), q_segment_ids=np.array([0, 1, 0, 9, 9]),
                  kv_segment_ids=np.array([0, 1, 1, 0, 0, 1]), scale=0.8, causal=True, soft_cap=2.0, v_scale=1.5)
    return kwargs, _random((2, 4, 5, 2), seed=4)


@pytest.mark.parametrize("masked_rows", oracle.MASKED_ROW_CONVENTIONS)
def test_fully_masked_rows_follow_their_convention(masked_rows):
    kwargs, d_out = _fully_masked_problem()
    masked, kept = np.s_[:, :, 3:], np.s_[:, :, :3]
    result = oracle.attention(**kwargs, masked_rows=masked_rows)
    expected_masked_out = {
        "zero": np.zeros((2, 4, 2, 2)),
        "mean_of_v": np.broadcast_to(np.repeat(kwargs["v"] * 1.5, 2, axis=1).mean(axis=2, keepdims=True), (2, 4, 2, 2)),
        "nan": np.full((2, 4, 2, 2), np.nan),
    }[masked_rows]
    np.testing.assert_allclose(result.out[masked], expected_masked_out, rtol=1e-15)
    np.testing.assert_array_equal(result.lse[masked], -np.inf)
    np.testing.assert_array_equal(result.fully_masked, np.broadcast_to([False] * 3 + [True] * 2, (2, 4, 5)))

    # The visible rows alone, with the masked queries removed, are the baseline.
    trimmed = kwargs | dict(q=kwargs["q"][kept], bias=kwargs["bias"][:, :3], q_segment_ids=kwargs["q_segment_ids"][:3])
    np.testing.assert_array_equal(result.out[kept], oracle.attention(**trimmed).out)
    baseline = oracle.attention_vjp(**trimmed, d_out=d_out[kept])
    grads = oracle.attention_vjp(**kwargs, d_out=d_out, masked_rows=masked_rows)
    np.testing.assert_array_equal(grads["dq"][kept], baseline["dq"])
    np.testing.assert_array_equal(grads["dq"][masked], {"nan": np.nan}.get(masked_rows, 0.0))
    np.testing.assert_array_equal(grads["dk"], baseline["dk"])
    np.testing.assert_array_equal(grads["dbias"][:, :3], baseline["dbias"])
    np.testing.assert_array_equal(grads["dbias"][:, 3:], 0.0)
    dv_from_masked = 0.0
    if masked_rows == "mean_of_v":
        # d_out of every masked row, summed over the two query heads of each kv head, spread over the 6 keys.
        dv_from_masked = 1.5 * d_out[masked].reshape(2, 2, 2, 2, 2).sum(axis=(2, 3))[:, :, None] / 6
    np.testing.assert_allclose(grads["dv"], baseline["dv"] + dv_from_masked, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("masked_rows", oracle.MASKED_ROW_CONVENTIONS)
def test_rows_hidden_by_an_explicit_mask_equal_rows_hidden_by_segments(masked_rows):
    """The segment-9 rows of _fully_masked_problem, hidden instead by a [1, 1, Q, K] mask:
    identical results, so they follow their convention as that test shows."""
    kwargs, d_out = _fully_masked_problem()
    same_segment = kwargs["q_segment_ids"][:, None] == kwargs["kv_segment_ids"][None, :]
    as_mask = kwargs | dict(q_segment_ids=None, kv_segment_ids=None, visible=same_segment[None, None],
                            masked_rows=masked_rows)
    expected = _oracle_results(kwargs | dict(masked_rows=masked_rows), d_out)
    actual = _oracle_results(as_mask, d_out)
    assert actual["fully_masked"][:, :, 3:].all() and not actual["fully_masked"][:, :, :3].any()
    for name, value in expected.items():
        np.testing.assert_array_equal(actual[name], value, err_msg=name)


@pytest.mark.parametrize("masked_rows", oracle.MASKED_ROW_CONVENTIONS)
def test_row_masked_in_one_head_follows_its_convention_alone(masked_rows):
    """Query 2 of query head 1 sees no key; head 0 shares its kv head and sees every key.
    Everything else is the unmasked attention with that row's cotangent removed."""
    kwargs, d_out = _fully_masked_problem()
    kwargs = kwargs | dict(q_segment_ids=None, kv_segment_ids=None)
    visible = np.ones((1, 4, 5, 6), dtype=bool)
    visible[:, 1, 2] = False
    row = np.s_[:, 1, 2]
    result = oracle.attention(**kwargs, visible=visible, masked_rows=masked_rows)
    unmasked = oracle.attention(**kwargs)
    expected_fully_masked = np.zeros((2, 4, 5), dtype=bool)
    expected_fully_masked[row] = True
    np.testing.assert_array_equal(result.fully_masked, expected_fully_masked)
    np.testing.assert_array_equal(result.lse[row], -np.inf)
    np.testing.assert_array_equal(result.lse[~expected_fully_masked], unmasked.lse[~expected_fully_masked])
    np.testing.assert_array_equal(result.out[~expected_fully_masked], unmasked.out[~expected_fully_masked])
    v = kwargs["v"] * 1.5  # v_scale
    np.testing.assert_allclose(result.out[row], {"zero": np.zeros((2, 2)), "mean_of_v": v[:, 0].mean(axis=1),
                                                 "nan": np.full((2, 2), np.nan)}[masked_rows], rtol=1e-15)

    grads = oracle.attention_vjp(**kwargs, d_out=d_out, visible=visible, masked_rows=masked_rows)
    without_row = d_out.copy()
    without_row[row] = 0.0
    baseline = oracle.attention_vjp(**kwargs, d_out=without_row)
    np.testing.assert_array_equal(grads["dq"][row], {"nan": np.nan}.get(masked_rows, 0.0))
    np.testing.assert_array_equal(grads["dq"][~expected_fully_masked], baseline["dq"][~expected_fully_masked])
    np.testing.assert_allclose(grads["dk"], baseline["dk"], rtol=1e-14, atol=1e-15)
    np.testing.assert_array_equal(grads["dbias"], baseline["dbias"])
    dv_from_row = np.zeros_like(kwargs["v"])
    if masked_rows == "mean_of_v":
        dv_from_row[:, 0] = 1.5 * d_out[row][:, None] / 6  # kv head 0, spread over the 6 keys
    np.testing.assert_allclose(grads["dv"], baseline["dv"] + dv_from_row, rtol=1e-14, atol=1e-15)


def test_low_precision_inputs_are_upcast_exactly():
    shapes = [(1, 2, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)]
    q, k, v = (_random(shape, seed).astype(ml_dtypes.bfloat16) for seed, shape in enumerate(shapes))
    exact = [np.asarray(x, dtype=np.float64) for x in (q, k, v)]
    np.testing.assert_array_equal(oracle.attention(q, k, v, scale=0.3).out, oracle.attention(*exact, scale=0.3).out)


@EXAMPLES
@given(num_devices=st.integers(1, 4), seq_per_device=st.integers(1, 4), window=_or_none(st.integers(1, 9)),
       seed=st.integers(0, 2**32 - 1))
def test_ring_blocks_merged_by_lse_equal_global_attention(num_devices, seq_per_device, window, seed):
    """Each device attends to the kv chunk it holds at every ring step; merging the partial
    results by lse must give the global causal attention. This checks lse and the ring helpers."""
    total = num_devices * seq_per_device
    q, k, v = _random((1, 2, total, 3), seed), _random((1, 1, total, 3), seed + 1), _random((1, 1, total, 2), seed + 2)
    expected = oracle.attention(q, k, v, scale=0.5, causal=True, window=window).out
    q_positions, kv_positions = oracle.global_positions(num_devices, seq_per_device)
    for device in range(num_devices):
        lses, outs = [], []
        for step in range(num_devices):
            q_offset, kv_offset = oracle.ring_step_offsets(num_devices, device, step, seq_per_device=seq_per_device)
            holder = (device - step) % num_devices
            assert (q_offset, kv_offset) == (q_positions[device, 0], kv_positions[holder, 0])
            rows, keys = slice(q_offset, q_offset + seq_per_device), slice(kv_offset, kv_offset + seq_per_device)
            part = oracle.attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], scale=0.5, causal=True, window=window,
                                    q_positions=q_positions[device], kv_positions=kv_positions[holder])
            lses.append(part.lse)
            outs.append(part.out)
        lse = np.logaddexp.reduce(lses, axis=0)  # finite: each query sees its own key
        merged = sum(np.exp(part_lse - lse)[..., None] * out for part_lse, out in zip(lses, outs))
        np.testing.assert_allclose(merged, expected[:, :, device * seq_per_device:(device + 1) * seq_per_device],
                                   **FLOAT64_TOL)


def _valid_problem():
    return dict(q=_random((1, 2, 3, 4)), k=_random((1, 1, 5, 4)), v=_random((1, 1, 5, 2)), scale=0.5)


@pytest.mark.parametrize("override, match", [
    (dict(q=np.zeros((2, 3, 4))), r"^q: expected 4-D"),
    (dict(q=np.zeros((1, 2, 3, 4), np.int32)), r"^q: expected a floating-point array, got dtype int32"),
    (dict(k=np.zeros((1, 1, 5, 3))),
     r"^k: expected 4-D \[B, Hkv, K, D\] with B=1, D=4 matching q.*got shape \(1, 1, 5, 3\)"),
    (dict(k=np.zeros((1, 3, 5, 4)), v=np.zeros((1, 3, 5, 2))), r"^k: .*Hkv dividing Hq=2"),
    (dict(k=np.zeros((1, 1, 0, 4)), v=np.zeros((1, 1, 0, 2))), r"^k: .*K >= 1"),
    (dict(v=np.zeros((1, 1, 4, 2))), r"^v: .*matching k, got shape \(1, 1, 4, 2\)"),
    (dict(bias=np.zeros((3, 4))), r"^bias: .*broadcastable to \[B, Hq, Q, K\] = \[1, 2, 3, 5\]"),
    (dict(bias=np.zeros((1, 1, 1, 3, 5))), r"^bias: "),
    (dict(q_segment_ids=np.zeros((1, 3), int)), r"kv_segment_ids: expected both or neither"),
    (dict(q_segment_ids=np.zeros((1, 4), int), kv_segment_ids=np.zeros((1, 5), int)), r"^q_segment_ids: .*shape"),
    (dict(q_positions=np.arange(3.0)), r"^q_positions: expected an integer array"),
    (dict(kv_positions=np.arange(4)), r"^kv_positions: expected shape \(5,\) or \(1, 5\)"),
    (dict(window=0), r"^window: "),
    (dict(soft_cap=0.0), r"^soft_cap: .*positive"),
    (dict(scale=float("nan")), r"^scale: "),
    (dict(k_scale="2"), r"^k_scale: "),
    (dict(v_scale=np.inf), r"^v_scale: "),
    (dict(masked_rows="ignore"), r"^masked_rows: expected one of \('zero', 'mean_of_v', 'nan'\)"),
    (dict(visible=np.ones((1, 2, 3, 5), int)), r"^visible: expected a bool array, got dtype int64"),
    (dict(visible=np.ones((3, 5), bool)), r"^visible: expected 4-D .*got shape \(3, 5\)"),
    (dict(visible=np.ones((1, 4, 3, 5), bool)),
     r"^visible: .*\[B, Hq, Q, K\] = \[1, 2, 3, 5\], got shape \(1, 4, 3, 5\)"),
])
def test_invalid_input_raises_naming_the_argument(override, match):
    with pytest.raises(ValueError, match=match):
        oracle.attention(**_valid_problem() | override)


def test_vjp_rejects_d_out_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"^d_out: .*\(1, 2, 3, 2\).*got shape \(1, 2, 3, 4\)"):
        oracle.attention_vjp(**_valid_problem(), d_out=np.zeros((1, 2, 3, 4)))


@pytest.mark.parametrize("call, match", [
    (lambda: oracle.ring_step_offsets(4, 4, 0, seq_per_device=2), r"^device: "),
    (lambda: oracle.ring_step_offsets(4, 1, -1, seq_per_device=2), r"^step: "),
    (lambda: oracle.global_positions(0, 2), r"^num_devices: "),
    (lambda: oracle.global_positions(2, 0), r"^seq_per_device: "),
])
def test_ring_helpers_reject_out_of_range_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------ fallback rows
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def _fallback_problem(seed: int = 0, soft_cap=None):
    """Query 0 sees keys 0-2; query 1 sees nothing and falls back to keys 3-5; query 2
    sees key 4 (its fallback keys must not matter); query 3 sees nothing, falls back on
    nothing: masked_rows decides."""
    rng = np.random.default_rng(seed)
    q, k, v, d_out = (rng.standard_normal((1, 2, n, 4)) for n in (4, 6, 6, 4))
    bias = rng.standard_normal((1, 2, 4, 6))
    visible = np.zeros((1, 1, 4, 6), bool)
    visible[..., 0, :3] = visible[..., 2, 4] = True
    fallback = np.zeros((1, 1, 4, 6), bool)
    fallback[..., 1, 3:] = fallback[..., 2, :2] = True
    options = dict(scale=0.7, bias=bias, visible=visible, fallback=fallback, soft_cap=soft_cap, masked_rows="zero")
    return (q, k, v), d_out, options


@pytest.mark.parametrize("soft_cap", [None, 2.5])
def test_a_row_without_visible_keys_averages_its_fallback_keys_and_others_are_untouched(soft_cap):
    (q, k, v), _, options = _fallback_problem(soft_cap=soft_cap)
    got = oracle.attention(q, k, v, **options)
    without = oracle.attention(q, k, v, **{**options, "fallback": None})
    np.testing.assert_allclose(got.out[:, :, 1], v[:, :, 3:].mean(axis=2), **FLOAT64_TOL)
    for row in (0, 2, 3):  # a visible key wins over fallback keys; no fallback: masked_rows
        np.testing.assert_array_equal(got.out[:, :, row], without.out[:, :, row])
    assert np.all(got.out[:, :, 3] == 0) and list(got.fully_masked[0, 0]) == [False, False, False, True]
    assert np.all(np.isneginf(got.lse[:, :, 1]))


@pytest.mark.parametrize("soft_cap", [None, 2.5])
def test_the_gradient_of_a_fallback_row_is_an_additive_masks_in_float32(soft_cap):
    """Independent: jax autodiff of attention with an additive float32 mask value, which
    absorbs the logits of a row that has only masked keys (uniform weights) while its
    derivative still flows through them."""
    (q, k, v), d_out, options = _fallback_problem(seed=1, soft_cap=soft_cap)
    rows = np.array([0, 1, 2])  # row 3 (no key at all) is NaN there: masked_rows handles it

    def additive(q, k, v, bias):
        logits = options["scale"] * jnp.einsum("bhqd,bhkd->bhqk", q, k) + bias
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(options["visible"], logits,
                           jnp.where(options["fallback"], logits + MASK_VALUE, -jnp.inf))
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(logits[:, :, rows], axis=-1), v)

    inputs = [jnp.asarray(x, jnp.float32) for x in (q, k, v, options["bias"])]
    out, vjp = jax.vjp(additive, *inputs)
    dq, dk, dv, dbias = vjp(jnp.asarray(d_out[:, :, rows], jnp.float32))
    truth = oracle.attention_vjp(q, k, v, np.where(np.isin(np.arange(4), rows)[:, None], d_out, 0), **options)
    np.testing.assert_allclose(np.asarray(out), oracle.attention(q, k, v, **options).out[:, :, rows], rtol=2e-5,
                               atol=2e-6)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        np.testing.assert_allclose(np.asarray(got), truth[name], rtol=2e-5, atol=2e-6, err_msg=name)
    assert np.abs(truth["dq"][:, :, 1]).max() > 1e-3  # the fallback row's gradient reaches q


def test_fallback_is_validated_like_visible():
    (q, k, v), _, options = _fallback_problem()
    with pytest.raises(ValueError, match=r"fallback: expected a bool array, got dtype int64"):
        oracle.attention(q, k, v, **{**options, "fallback": options["fallback"].astype(np.int64)})
    with pytest.raises(ValueError, match=r"fallback: expected 4-D"):
        oracle.attention(q, k, v, **{**options, "fallback": options["fallback"][0]})
