"""Positions past int16 (kv length > 32767) on the pure-JAX ring path and the oracle.

A kernel that keeps positions or offsets in 16 bits wraps at 32768 and puts the causal
boundary in the wrong place. The whole sequence runs through the kernel; the oracle judges
the last query rows (all past 32767) against every key, using explicit positions, which
keeps the float64 reference small.
"""

from __future__ import annotations

import numpy as np
import pytest

from attncheck import numerics, oracle, yardstick
from attncheck import strategies as S

pytestmark = [pytest.mark.gate, pytest.mark.attncheck_family("ring_attention")]
SEQ = 34 * 1024  # > 32767, and 2 devices x 17 chunks of 1024
CHECKED_ROWS = 64
HEAD_DIM = 8


def test_causal_ring_attention_past_int16_positions(attncheck_kernel_time):
    from attncheck_kernels.ring_attention import ring_attention_sharded

    rng = np.random.default_rng(0)
    q, k, v = (S.round_to(rng.standard_normal((1, SEQ, 1, HEAD_DIM)), np.float32) for _ in range(3))
    with attncheck_kernel_time():
        out = np.asarray(ring_attention_sharded(q, k, v, num_devices=2, causal=True, query_chunk_size=1024,
                                                key_chunk_size=1024))
    rows = np.arange(SEQ - CHECKED_ROWS, SEQ)
    head_major = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    q_rows = head_major(q)[:, :, rows]
    truth = oracle.attention(q_rows, head_major(k), head_major(v), scale=HEAD_DIM ** -0.5, causal=True,
                             q_positions=rows, kv_positions=np.arange(SEQ)).out
    visible = yardstick.visibility(rows, np.arange(SEQ), causal=True)
    reference = yardstick.attention(q_rows, head_major(k), head_major(v), scale=HEAD_DIM ** -0.5, visible=visible,
                                   masked_rows="zero")
    cmp = numerics.compare(head_major(out)[:, :, rows], truth, reference, dtype=np.float32, direction="out")
    assert cmp.passed, cmp.reason
