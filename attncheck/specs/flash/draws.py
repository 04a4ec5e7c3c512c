"""Flash attention's hypothesis strategies: the cases and the block sizes of a shape."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.specs.flash.params import (BATCH_HEADS, BIAS_VALUE_KINDS, FAMILY, HEAD_DIMS, LONG_KV_LENS, NUM_LANES,
                                          SEGMENT_DTYPES, SEQ_LENS, SM_SCALES, VALUE_KINDS, VMEM_LIMITS, BlockSizes,
                                          FlashParams)


@st.composite
def block_sizes(draw, q_len: int, kv_len: int, batch: int) -> BlockSizes:
    """Valid block sizes for the shape; several per shape, k_major > k reachable, a
    forward tile over several batch elements reachable."""
    q_blocks = S.divisors(q_len, NUM_LANES)
    k_majors = S.divisors(kv_len, NUM_LANES)
    block_q = draw(st.sampled_from(q_blocks))
    k_major = draw(st.sampled_from(k_majors))
    block_k = draw(st.sampled_from(S.divisors(k_major, NUM_LANES)))
    q_major_dkv = draw(st.sampled_from(q_blocks))
    k_major_dkv = draw(st.sampled_from(k_majors))
    k_major_dq = draw(st.sampled_from(k_majors))
    return BlockSizes(block_q=block_q, block_k_major=k_major, block_k=block_k,
                      block_b=draw(st.sampled_from(S.divisors(batch, 1))),
                      block_q_major_dkv=q_major_dkv, block_k_major_dkv=k_major_dkv,
                      block_k_dkv=draw(st.sampled_from(S.divisors(k_major_dkv, NUM_LANES))),
                      block_q_dkv=draw(st.sampled_from(S.divisors(q_major_dkv, NUM_LANES))),
                      block_k_major_dq=k_major_dq, block_k_dq=draw(st.sampled_from(S.divisors(k_major_dq, NUM_LANES))),
                      block_q_dq=draw(st.sampled_from(q_blocks)))


@st.composite
def flash_cases(draw) -> Case:
    q_len = draw(st.sampled_from(SEQ_LENS()))
    kv_len = draw(st.sampled_from((q_len,) + SEQ_LENS() + LONG_KV_LENS()))  # equal lengths are the common case
    causal = draw(st.booleans())
    segments = draw(st.sampled_from(("none", "packed", "absent")))
    head_dim = draw(st.sampled_from(HEAD_DIMS()))
    batch, heads = draw(st.sampled_from(BATCH_HEADS()))
    seed = draw(S.seeds)
    bias = draw(st.booleans())
    bias_values = draw(st.sampled_from(BIAS_VALUE_KINDS)) if bias else "normal"
    return Case(FAMILY, FlashParams(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), batch=batch, heads=heads,
        q_len=q_len, kv_len=kv_len, head_dim=head_dim, causal=causal,
        sm_scale=draw(st.sampled_from((1.0 / math.sqrt(head_dim), *SM_SCALES))),
        bias=bias, segments=segments,
        segment_starts=draw(S.segment_layout(min(q_len, kv_len))) if segments != "none" else (),
        values=draw(st.sampled_from(VALUE_KINDS)), blocks=draw(block_sizes(q_len, kv_len, batch)),
        bias_values=bias_values, emptied_row=draw(st.integers(0, q_len - 1)) if bias_values == "neg_inf_row" else None,
        segment_dtype=draw(st.sampled_from(SEGMENT_DTYPES)) if segments != "none" else "int32",
        vmem_limit_bytes=draw(st.sampled_from(VMEM_LIMITS))), seed)
