"""Flash attention's hypothesis strategies: the cases, the data of a case's program and
the block sizes of a shape."""

from __future__ import annotations

import dataclasses
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
    bias_values = _bias_pattern(draw, bias)
    return Case(FAMILY, FlashParams(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), batch=batch, heads=heads,
        q_len=q_len, kv_len=kv_len, head_dim=head_dim, causal=causal,
        sm_scale=draw(st.sampled_from((1.0 / math.sqrt(head_dim), *SM_SCALES))),
        bias=bias, segments=segments,
        segment_starts=S.drawn_segment_layout(draw, segments, min(q_len, kv_len)),
        values=draw(st.sampled_from(VALUE_KINDS)), blocks=draw(block_sizes(q_len, kv_len, batch)),
        bias_values=bias_values, emptied_row=_emptied_row(draw, q_len, bias_values),
        segment_dtype=draw(st.sampled_from(SEGMENT_DTYPES)) if segments != "none" else "int32",
        vmem_limit_bytes=draw(st.sampled_from(VMEM_LIMITS))), seed)


# The draws of a case's data, shared by its first draw and its variants' (each takes
# ``draw``: a value fixed by the program is drawn from nothing).
def _bias_pattern(draw, bias: bool) -> str:
    return draw(st.sampled_from(BIAS_VALUE_KINDS)) if bias else "normal"


def _emptied_row(draw, q_len: int, bias_values: str) -> int | None:
    return draw(st.integers(0, q_len - 1)) if bias_values == "neg_inf_row" else None


@st.composite
def flash_data(draw, p: FlashParams) -> FlashParams:
    """The params with another draw of what the kernel is given as data
    (``FlashSpec.program``): the values, the ab pattern, the segment layout."""
    bias_values = _bias_pattern(draw, p.bias)
    return dataclasses.replace(p, values=draw(st.sampled_from(VALUE_KINDS)), bias_values=bias_values,
                               segment_starts=S.drawn_segment_layout(draw, p.segments, min(p.q_len, p.kv_len)),
                               emptied_row=_emptied_row(draw, p.q_len, bias_values))
