"""The yardstick is close to the float64 oracle wherever the policy scales by it: a yardstick
that is wrong somewhere would widen (or make impossible) the tolerance there."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from attncheck import oracle, yardstick

B, H, Q, K, D = 1, 2, 8, 16, 8


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in
            ((B, H, Q, D), (B, H, K, D), (B, H, K, D), (B, H, Q, D))]


@pytest.mark.parametrize("masked_rows", ["mean_of_v", "zero"])
@pytest.mark.parametrize("seq_major", [False, True])
def test_fully_masked_rows_with_a_cotangent_follow_the_convention_in_every_direction(masked_rows, seq_major):
    """Rows whose segment is absent from kv, with a nonzero cotangent: the forward and every
    gradient agree with the oracle's convention (a recomputed P of 1 instead of 1/K for such
    a row puts dv far off under mean_of_v)."""
    q, k, v, d_out = _inputs()
    q_ids = np.array([0, 0, 0, 1, 1, 9, 9, 9], np.int32)[None]  # segment 9 is absent from kv
    kv_ids = np.repeat(np.array([0, 1], np.int32), K // 2)[None]
    visible = yardstick.visibility(np.arange(Q), np.arange(K), causal=False, q_segment_ids=q_ids,
                                   kv_segment_ids=kv_ids)
    # seq_major: the same [B, H, S, D] arrays, computed in the [B, S, H, D] layout inside.
    got = yardstick.attention_with_grads(q, k, v, d_out, scale=D ** -0.5, visible=visible,
                                         masked_rows=masked_rows, seq_major=seq_major)
    sem = dict(scale=D ** -0.5, q_segment_ids=q_ids, kv_segment_ids=kv_ids, masked_rows=masked_rows)
    truth = {"out": oracle.attention(q, k, v, **sem).out, **oracle.attention_vjp(q, k, v, d_out, **sem)}
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], truth[name], atol=2e-5, rtol=1e-4, err_msg=name)


def test_fallback_rows_follow_the_oracle_in_every_direction():
    """Causal attention whose absent-segment rows fall back on the causally visible keys
    of other segments, and a row whose visible keys all have a -inf bias (nothing to fall
    back on: zero): the yardstick follows the oracle's convention, gradients included."""
    q, k, v, d_out = _inputs(1)
    rng = np.random.default_rng(2)
    bias = rng.standard_normal((B, H, Q, K)).astype(np.float32)
    q_ids = np.array([0, 0, 0, 9, 9, 1, 1, 1], np.int32)[None]  # rows 3-4: segment 9 is absent
    kv_ids = np.repeat(np.array([0, 1], np.int32), K // 2)[None]
    causal = np.arange(K)[None, :] <= np.arange(Q)[:, None] + K - Q
    same = q_ids[0][:, None] == kv_ids[0][None, :]
    bias[:, :, 1, same[1]] = -np.inf  # row 1: every same-segment key hidden by the bias
    visible = (causal & same)[None, None] & (bias != -np.inf)
    fallback = np.broadcast_to((causal & ~same)[None, None], visible.shape)
    fallback = fallback & ~np.isin(np.arange(Q), [1])[None, None, :, None]  # row 1 has nothing to fall back on
    got = yardstick.attention_with_grads(q, k, v, d_out, scale=D ** -0.5, bias=bias, visible=visible,
                                         fallback=fallback, masked_rows="zero")
    sem = dict(scale=D ** -0.5, bias=np.where(visible, bias, 0.0), visible=visible, fallback=fallback,
               masked_rows="zero")
    truth = {"out": oracle.attention(q, k, v, **sem).out, **oracle.attention_vjp(q, k, v, d_out, **sem)}
    assert np.all(got["out"][:, :, 1] == 0) and np.abs(truth["dq"][:, :, 3]).max() > 1e-3
    for name in ("out", "dq", "dk", "dv", "dbias"):
        np.testing.assert_allclose(got[name], truth[name], atol=3e-5, rtol=1e-4, err_msg=name)


def _naive_paged_attention(q, k_pages, v_pages, k_scales, v_scales, lengths, page_indices):
    """The paged convention as a jax user writes it in float32: dequantise the int8 pages
    (``weight * scales / 127.5``), gather them through the page table, softmax over the
    visible tokens, the query heads of a kv head in one [G, D] x [D, L] product."""
    import jax.numpy as jnp

    batch, q_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    tokens = page_indices.shape[1] * page_size
    t = jnp.arange(tokens)

    visible = (t[None, :] < lengths[:, None])[:, None, :, None]  # [B, 1, L, 1]

    def dense(pages, scales):  # [B, Hkv, L, D], 0 where no token is (pages there hold NaN)
        pages = pages.astype(jnp.float32) * scales / 127.5
        return jnp.where(visible, pages[:, page_indices[:, t // page_size], t % page_size].transpose(1, 0, 2, 3), 0)

    k, v = dense(k_pages, k_scales), dense(v_pages, v_scales)
    grouped = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    logits = jnp.where(visible[..., 0][:, :, None], jnp.einsum("bhgd,bhld->bhgl", grouped, k), -jnp.inf)
    return jnp.einsum("bhgl,bhld->bhgd", jax.nn.softmax(logits, axis=-1), v).reshape(q.shape)


def test_a_naive_jax_program_of_the_paged_convention_is_within_its_yardsticks_tolerance():
    """int8 pages of "large" values, where jax's paged kernel fails a yardstick that
    dequantises in NumPy: XLA computes ``/ 127.5`` as a product with the rounded reciprocal,
    which moves these logits, and NumPy's division is closer to the oracle than any jax
    program can be. The yardstick dequantises as XLA does."""
    from attncheck import numerics
    from attncheck.specs import all_specs

    spec = all_specs()["paged_attention"]
    case = spec.case(154, dtype="float32", page_dtype="int8", batch=4, q_heads=16, kv_heads=2, head_dim=128,
                     page_size=8, pages_per_sequence=4, pages_per_compute_block=1, lengths=(26, 25, 20, 6),
                     megacore_mode="kv_head", inline_seq_dim=True, soft_cap=None, values="large", mask_value=-1e30)
    inputs = spec.inputs(case)
    naive = np.asarray(jax.jit(_naive_paged_attention)(*(inputs[n] for n in (
        "q", "k_pages", "v_pages", "k_scales", "v_scales", "lengths", "page_indices"))))
    cmp = numerics.compare(naive, spec.oracle(case, inputs)["out"], spec.yardstick(case, inputs)["out"],
                           dtype=np.float32, direction="out")
    assert cmp.passed, cmp.reason


def test_the_reversed_order_computes_the_same_attention_with_other_roundings():
    """Queries, keys and head dims reversed before and restored after: every direction
    matches the forward order's to rounding, bit-identical nowhere it matters."""
    q, k, v, d_out = _inputs(3)
    rng = np.random.default_rng(4)
    bias = rng.standard_normal((B, H, Q, K)).astype(np.float32)
    visible = yardstick.visibility(np.arange(Q) + K - Q, np.arange(K), causal=True)
    sem = dict(scale=D ** -0.5, bias=bias, visible=visible, masked_rows="zero")
    forward = yardstick.attention_with_grads(q, k, v, d_out, **sem)
    with yardstick.summation_order(1):
        backward = yardstick.attention_with_grads(q, k, v, d_out, **sem)
        out = yardstick.attention(q, k, v, **sem)
    truth = {"out": oracle.attention(q, k, v, **sem).out, **oracle.attention_vjp(q, k, v, d_out, **sem)}
    assert np.array_equal(out, backward["out"])
    for name in ("out", "dq", "dk", "dv", "dbias"):
        np.testing.assert_allclose(backward[name], truth[name], atol=3e-5, rtol=1e-4, err_msg=name)
    assert any(not np.array_equal(forward[n], backward[n]) for n in forward)  # another rounding somewhere


def test_the_tolerance_scales_by_the_larger_error_of_the_yardsticks():
    """A direction of few elements (jax.nn's convention through this repository's flash
    kernel, dbias of a 1-query case: 28 elements) gives the yardstick's orders worst errors
    far apart, and a correct kernel may pass against the larger and fail against the
    smaller. One order's worst error is one sample."""
    from attncheck import numerics

    truth = np.zeros(8)
    near, far = truth + 1e-7, truth - 3e-7
    one = numerics.compare(truth + 4e-7, truth, near, dtype=np.float32, direction="dq")
    both = numerics.compare(truth + 4e-7, truth, (near, far), dtype=np.float32, direction="dq")
    assert one.yardstick_err == pytest.approx(1e-7) and both.yardstick_err == pytest.approx(3e-7)
    assert not one.passed and both.passed


def _builtin_passes(family: str, backend: str, seed: int, **params) -> None:
    """This repository's implementation of ``family`` passes the gate on one case."""
    from attncheck import check
    from attncheck.backends import BACKENDS
    from attncheck.specs import all_specs, resolve_impl

    spec = all_specs()[family]
    target = check.Target(spec, "builtin", resolve_impl(spec.default_impls["builtin"]), BACKENDS[backend])
    outcome = check.check_case(target, spec.case(seed, **params))
    assert outcome.records and not outcome.failures, outcome.summary()


def test_a_chunked_ffn_is_held_to_the_error_of_a_loops_sum():
    """This repository's blockwise FFN, float32, hidden 256, large values, in chunks of 16
    rows of [2, 2, 96, 64]. Its chunks' dots sum term by term on CPU (bit for bit), a few
    times further from the oracle than the whole array's blocked dot, in either order: held
    to the blocked dot alone, the correct kernel fails. The FFN's other orders are a loop's."""
    _builtin_passes("blockwise_ffn", "xla", 579, dtype="float32", lead=(2, 2), seq_len=96, chunk_size=16, features=64,
                    features_out=24, hidden=256, b_in=True, b_out=True, values="large", stochastic=False, remat=False,
                    policy="none", prevent_cse=True)


def test_a_gradient_carried_by_few_elements_is_held_to_more_than_two_orders():
    """This repository's blockwise ring attention, float32, 5 queries seeing 5 keys (the
    rest absent segments), a full bias, values offset by a constant, so dq and dk cancel over
    the 5 keys. The yardstick's dk in the given and the reversed order is far below what
    shuffles of its head dim reach, and the correct kernel's dk lands among the shuffles:
    held to two orders, it fails."""
    _builtin_passes("ring_attention", "xla", 1416, batch=1, bias="full", causal=False, check_vma=False, devices=1,
                    dropout_rate=0.0, dtype="float32", float32_logits=True, head_dim=32, heads=1,
                    highest_precision=True, key_chunk_size=8, per_device=16, placement="count", query_chunk_size=8,
                    segment_dtype="int32", segment_starts=(0, 5), segments="absent", seq_len=16,
                    single_segment_ids=False, sm_scale=0.3, values="offset")
