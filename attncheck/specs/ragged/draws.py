"""The ragged paged attention v2 family's case strategies."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.specs.ragged.params import (DTYPE_PAIRS, FAMILY, HEAD_LAYOUTS, K_SCALES, KV_DTYPES, LAYOUT_NAMES,
                                           LAYOUTS, MASK_VALUE, PADDING_KINDS, PAGE_SIZES, SEQ_KINDS, SM_SCALES,
                                           SOFT_CAPS, V_SCALES, VALUE_KINDS, RaggedParams)


@st.composite
def sequence(draw, capacity: int, token_budget: int) -> tuple[int, int]:
    """(q_len, kv_len) of one sequence; shrinks toward a one-token decode."""
    kind = draw(st.sampled_from(SEQ_KINDS))
    if kind == "empty" or token_budget == 0:
        return 0, draw(st.sampled_from((0, draw(st.integers(1, capacity)))))
    kv_len = draw(st.integers(1, capacity))
    if kind == "decode" or kv_len == 1:
        return 1, kv_len
    if kind == "full_prefill":
        return min(kv_len, token_budget), kv_len
    return min(draw(st.integers(1, kv_len - 1)), token_budget), kv_len


def _seqs(draw, layout: str, page_size: int) -> tuple[tuple[int, int], ...]:
    """The sequences of a batch that fits the layout's buffers."""
    shapes = LAYOUTS[layout]
    capacity = page_size * shapes.pages_per_seq
    seqs, budget = [], shapes.max_tokens
    for _ in range(draw(st.integers(1, shapes.max_seqs))):
        q_len, kv_len = draw(sequence(capacity, budget))
        budget -= q_len
        seqs.append((q_len, kv_len))
    return tuple(seqs)


@st.composite
def ragged_data(draw, p: RaggedParams) -> RaggedParams:
    """The params with another draw of what the kernel is given as data
    (``RaggedSpec.program``): the sequences, the metadata's padding and the values."""
    return dataclasses.replace(p, seqs=_seqs(draw, p.layout, p.page_size), padding=draw(st.sampled_from(PADDING_KINDS)),
                               values=draw(st.sampled_from(VALUE_KINDS)))


@st.composite
def ragged_cases(draw) -> Case:
    layout = draw(st.sampled_from(LAYOUT_NAMES()))
    shapes = LAYOUTS[layout]
    page_size = draw(st.sampled_from(PAGE_SIZES()))
    capacity = page_size * shapes.pages_per_seq
    seqs = _seqs(draw, layout, page_size)
    q_dtype, kv_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    packed = kv_dtype not in S.DTYPES
    # A packed cache is quantized: it comes with both scales.
    scales = [draw(st.sampled_from(values if packed else (None, *values))) for values in (K_SCALES, V_SCALES)]
    window = draw(st.one_of(st.none(), st.sampled_from((1, 5, page_size * 2 + 3, capacity + 7))))
    # The kernel tiles the combined-heads axis in 32-bit words: with 4 values per word
    # (int8, fp8) 2 * num_kv_heads must be a multiple of 4 (a documented rejection).
    packing = 4 // KV_DTYPES[kv_dtype].itemsize
    heads = draw(st.sampled_from([h for h in HEAD_LAYOUTS if (2 * h[1]) % packing == 0]))
    seed = draw(S.seeds)
    return Case(FAMILY, RaggedParams(
        dtype=q_dtype, kv_dtype=kv_dtype, page_size=page_size,
        num_q_heads=heads[0], num_kv_heads=heads[1], seqs=seqs,
        sliding_window=window, soft_cap=draw(st.sampled_from(SOFT_CAPS)),
        k_scale=scales[0], v_scale=scales[1], sm_scale=draw(st.sampled_from((shapes.head_dim**-0.5, *SM_SCALES))),
        num_kv_pages_per_block=draw(st.sampled_from((None, 1, 3))),
        num_queries_per_block=draw(st.sampled_from((None, 8, 16, 24))),
        padding=draw(st.sampled_from(PADDING_KINDS)), values=draw(st.sampled_from(VALUE_KINDS)),
        layout=layout, mask_value=draw(st.sampled_from((None, MASK_VALUE))),
        vmem_limit_bytes=draw(st.sampled_from((None, 64 * 1024 * 1024)))), seed)
