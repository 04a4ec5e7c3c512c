"""The yardstick is close to the float64 oracle wherever the policy scales by it: a yardstick
that is wrong somewhere would widen (or make impossible) the tolerance there."""

from __future__ import annotations

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
    gradient agree with the oracle's convention (measured before the fix: dv off by 1.76
    under mean_of_v, the recomputed P of such a row being 1 instead of 1/K)."""
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
