"""The v3 oracle on literal data: a decode step's output by hand, the new token written into
its slot of the packed cache (zero pads included), nothing else changed, and invalid
metadata named."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attncheck import oracle

NAN = np.nan


def _decode_step():
    """One sequence: token 0 (k=1, v=10) in the cache, token 1 (k=0, v=20) new, q=1.
    Pages of 2 slots; the sequence's page table is (page 1, page 0)."""
    cache = np.full((2, 2, 2, 1, 128), NAN, np.float32)
    cache[1, 0] = 0.0
    cache[1, 0, 0, 0, 0], cache[1, 0, 1, 0, 0] = 1.0, 10.0
    return dict(queries=np.ones((1, 1, 1), np.float32), keys=np.zeros((1, 1, 1), np.float32),
                values=np.full((1, 1, 1), 20.0, np.float32), kv_cache=cache, kv_lens=np.array([2], np.int32),
                page_indices=np.array([1, 0], np.int32), cu_q_lens=np.array([0, 1], np.int32),
                distribution=np.array([1, 1, 1], np.int32))


def test_a_decode_step_attends_to_the_history_and_its_own_token():
    result = oracle.ragged_paged_attention_v3(**_decode_step(), sm_scale=1.0)
    e = math.e
    assert result.out[0, 0, 0] == pytest.approx((10 * e + 20) / (e + 1), rel=1e-15)


def test_the_new_token_is_written_into_its_slot_and_nothing_else_changes():
    step = _decode_step()
    result = oracle.ragged_paged_attention_v3(**step, sm_scale=1.0)
    want = step["kv_cache"].copy()
    want[1, 1] = 0.0  # K and V of kv head 0, zero lanes past head_dim 1
    want[1, 1, 1, 0, 0] = 20.0
    np.testing.assert_array_equal(result.kv_cache, want)


def test_the_window_hides_the_history_and_the_scales_apply():
    result = oracle.ragged_paged_attention_v3(**_decode_step(), sm_scale=1.0, sliding_window=1, v_scale=0.5)
    assert result.out[0, 0, 0] == 10.0  # its own token alone: v = 20, times 0.5


@pytest.mark.parametrize("change, match", [
    (dict(kv_lens=np.array([0], np.int32)), "kv_lens"),
    (dict(distribution=np.array([1, 0, 1], np.int32)), "distribution"),
    (dict(kv_cache=np.zeros((2, 2, 1, 2, 128), np.float32)), "kv_cache"),
    (dict(cu_q_lens=np.array([0, 2], np.int32), queries=np.ones((2, 1, 1), np.float32),
          keys=np.zeros((2, 1, 1), np.float32), values=np.zeros((2, 1, 1), np.float32)), "decode"),
])
def test_invalid_metadata_is_named(change, match):
    with pytest.raises(ValueError, match=match):
        oracle.ragged_paged_attention_v3(**{**_decode_step(), **change}, sm_scale=1.0)
