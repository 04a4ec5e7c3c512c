"""The ragged paged attention v2 family's bug classes, the predicates behind them, its
pairwise partitions and its contracts."""

from __future__ import annotations

import math

import numpy as np

from attncheck import bugclasses, parameters
from attncheck import strategies as S
from attncheck.expectations import Contract
from attncheck.specs.base import FLOAT32_ACCUMULATION, values_by_dtype
from attncheck.specs.ragged.params import VALUE_KINDS, RaggedParams


def empty_seq_before_another(p: RaggedParams) -> bool:
    """A sequence with no key (so no query) comes before one with keys: the pipeline that
    fetches a sequence's first page while it computes the one before must skip it, neither
    reading its page-table row (every slot unused: past the buffer, ``RaggedSpec.inputs``)
    nor serving that page to the sequence after it."""
    empty = [i for i, (_, k) in enumerate(p.seqs) if k == 0]
    return bool(empty) and any(k for _, k in p.seqs[empty[0] + 1:])


def some_query_sees_several_keys(p: RaggedParams) -> bool:
    # A sequence's last query sees min(window, kv_len) keys (bottom-right causal).
    window = p.sliding_window or math.inf
    return any(q_len and min(window, kv_len) >= 2 for q_len, kv_len in p.seqs)


def seqs_share_a_q_block(p: RaggedParams) -> bool:
    """Some sequence's first query token lies in the q block of the previous sequence's
    last one (block size as asked for; the kernel's default depends on the shapes)."""
    block = p.num_queries_per_block
    starts = np.cumsum([0] + [q_len for q_len, _ in p.seqs])[:-1]
    boundaries = [start for start, (q_len, _) in zip(starts, p.seqs) if q_len][1:]
    return block is not None and any(b % block for b in boundaries)


def expected_max_rises(p: RaggedParams, block_tokens: int) -> float:
    """Expected rises of the running max over every query row (bottom-right causal, window)."""
    window = p.sliding_window or math.inf
    rows = [(int(max(0, pos + 1 - window)), pos + 1) for q_len, kv_len in p.seqs
            for pos in range(kv_len - q_len, kv_len)]
    return bugclasses.expected_max_rises(rows, block_tokens) * p.num_q_heads


def _seq_kind(q_len: int, kv_len: int) -> str:
    if q_len == 0:
        return "zero_length_seq"
    if q_len == 1:
        return "decode"
    return "chunked_prefill" if q_len < kv_len else "full_prefill"


def _has_seq(kind: str):
    return lambda p: any(_seq_kind(q, k) == kind for q, k in p.seqs)


def _with_several_keys(predicate):
    """What changes the logits (soft cap, k scale and dequantization, bf16 rounding of
    scores) shows only where a softmax spans several keys: over one key it is 1 whatever
    the logit, so a decode step on a 1-token sequence cannot tell them apart."""
    return lambda p: some_query_sees_several_keys(p) and predicate(p)


def long_reduction_offset_values(p: RaggedParams) -> bool:
    """A bfloat16 row over thousands of keys of v offset from 0, in many kv blocks: where
    an accumulator held in the value dtype between blocks loses each block's low bits."""
    block = p.kv_block_pages * p.page_size
    return p.dtype == "bfloat16" and p.values == "offset" and any(
        q and k >= S.LONG_REDUCTION and k >= S.MANY_KV_BLOCKS * block for q, k in p.seqs)


def long_reduction_sink(p: RaggedParams) -> bool:
    """A bfloat16 sequence whose query rows see its sink and many kv blocks after it, at the
    scale the sink's margins are drawn for, with nothing that caps or hides the sink's
    logit: where a softmax denominator held in the value dtype loses those blocks."""
    block = p.kv_block_pages * p.page_size
    return (p.dtype == "bfloat16" and p.values == S.SINK and S.sink_scale(p.sm_scale, p.shapes.head_dim)
            and p.sliding_window is None and p.soft_cap is None and p.k_scale in (None, 1.0)
            and any(q > 1 and k >= S.SINK_KV_BLOCKS * block for q, k in p.seqs))


def rows_end_in_different_kv_blocks(p: RaggedParams) -> bool:
    """One grid step holds two consecutive query rows of a sequence whose last visible keys
    lie in different kv blocks: the step processes the later row's last block, which is
    wholly masked for the earlier row. The online softmax must carry that row's running
    max through it; one that takes the block's max instead sinks to the mask value, and
    rescales by exp(max - mask value)."""
    block = p.kv_block_pages * p.page_size
    token = 0
    for q_len, kv_len in p.seqs:
        for row in range(q_len - 1):
            last_key = kv_len - q_len + row  # causal: row r sees keys 0..kv_len - q_len + r
            same_step = (token + row) // p.q_block_tokens == (token + row + 1) // p.q_block_tokens
            if same_step and last_key // block != (last_key + 1) // block:
                return True
        token += q_len
    return False


def _padding_rows(case, inputs) -> dict[str, np.ndarray]:
    """The output rows of tokens past cu_q_lens[num_seqs]."""
    tokens = np.arange(case.params.shapes.max_tokens)
    return {"out": (tokens >= inputs["cu_q_lens"][inputs["num_seqs"][0]])[:, None, None]}


K_SCALE = bugclasses.numbers("k_scale", lambda p: p.k_scale, ("in (0, 1)", "one", "above 1"))
KV_DTYPE = bugclasses.partition("kv_dtype", as_q=lambda p: p.kv_dtype == p.dtype,
                                other_float=lambda p: p.kv_dtype != p.dtype and p.kv_dtype in S.DTYPES,
                                quantized=lambda p: p.kv_dtype not in S.DTYPES)


def _kv_span(p: RaggedParams) -> set[str]:
    """Where the sequences' keys end against the kv blocks: within the first, on a block's
    edge after it, inside a later one."""
    block = p.kv_block_pages * p.page_size
    return {"first_block" if k <= block else "later_block_edge" if k % block == 0 else "inside_later_block"
            for _, k in p.seqs if k}


# Crossed pairwise: the kv block, where the keys end in it, the kv dtype and the query
# heads against the kv heads; and the quantized kv dtypes with their scales.
PAIRS = bugclasses.pairwise(
    bugclasses.partition("kv_block", one_page=lambda p: p.kv_block_pages == 1,
                         several_pages=lambda p: p.kv_block_pages > 1),
    bugclasses.partition("kv_span", **{span: (lambda p, span=span: span in _kv_span(p))
                                       for span in ("first_block", "later_block_edge", "inside_later_block")}),
    KV_DTYPE,
    bugclasses.partition("heads", mha=lambda p: p.num_q_heads == p.num_kv_heads,
                         gqa=lambda p: p.num_q_heads > p.num_kv_heads),
) + bugclasses.pairwise(KV_DTYPE, K_SCALE)


BUG_CLASSES = bugclasses.bug_classes(
    decode=_has_seq("decode"),
    chunked_prefill=_has_seq("chunked_prefill"),
    full_prefill=_has_seq("full_prefill"),
    zero_length_seq=_has_seq("zero_length_seq"),
    num_seqs_lt_max=lambda p: len(p.seqs) < p.shapes.max_seqs,
    kv_len_not_page_multiple=lambda p: any(k % p.page_size for _, k in p.seqs),
    pages_per_seq_not_block_multiple=lambda p: p.shapes.pages_per_seq % p.kv_block_pages != 0,
    # Every case poisons padding with NaN and shuffles its page table.
    nan_padding=lambda p: True,
    shuffled_pages=lambda p: True,
    gqa=lambda p: p.num_q_heads > p.num_kv_heads,
    window_lt_block=lambda p: p.sliding_window is not None and p.sliding_window < p.kv_block_pages * p.page_size,
    window_gt_kv_len=lambda p: p.sliding_window is not None and p.sliding_window > max(k for _, k in p.seqs),
    # Some query has a key exactly `window` positions back, which the window must hide:
    # without it the window's boundary (< vs <=) is never tested.
    window_clips_keys=lambda p: p.sliding_window is not None and any(k > p.sliding_window for q, k in p.seqs if q),
    soft_cap=_with_several_keys(lambda p: p.soft_cap is not None),
    kv_scales=_with_several_keys(lambda p: p.k_scale is not None),
    # One kv scale without the other, the cache's dtype not the queries': the scaled
    # operand is computed in the query dtype, and so must the other be.
    one_kv_scale_cache_unlike_queries=lambda p: ((p.k_scale is None) != (p.v_scale is None)
                                                 and p.kv_dtype != p.dtype),
    several_kv_head_blocks=lambda p: p.num_kv_heads >= 8 and p.kv_dtype == "float32" == p.dtype,
    kv_scales_not_powers_of_two=_with_several_keys(lambda p: p.k_scale is not None
                                                   and math.frexp(p.k_scale)[0] != 0.5),
    bf16=_with_several_keys(lambda p: p.dtype == "bfloat16"),
    packed_kv=_with_several_keys(lambda p: p.kv_dtype not in S.DTYPES),
    q_len_ne_kv_len=lambda p: any(0 < q != k for q, k in p.seqs),
    # The online softmax rescales its normaliser and accumulator only where the running
    # max rises in a later kv block; several queries also put early ones fully masked
    # in a block their later ones see.
    softmax_spans_kv_blocks=lambda p: (any(q >= 2 for q, _ in p.seqs)
                                       and expected_max_rises(p, p.kv_block_pages * p.page_size) >= 3),
    # A grid step owns a block of consecutive query tokens: where two sequences share
    # one, the softmax state must restart at the sequence boundary, not the step's.
    seqs_share_q_block=seqs_share_a_q_block,
    rows_end_in_different_kv_blocks=rows_end_in_different_kv_blocks,
    # The kernel's documented contracts, each where it can be observed.
    rows_past_the_last_sequence=lambda p: sum(q for q, _ in p.seqs) < p.shapes.max_tokens,
    empty_seq_before_another=empty_seq_before_another,
    partial_last_q_block=lambda p: p.num_queries_per_block is not None
    and p.shapes.max_tokens % p.num_queries_per_block != 0,
    compact_layout=lambda p: p.layout == "compact",
    long_reduction_offset_values=long_reduction_offset_values,
    long_reduction_sink=long_reduction_sink,
    explicit_mask_value=lambda p: p.mask_value is not None and some_query_sees_several_keys(p),
) + (bugclasses.numbers("sm_scale", lambda p: p.sm_scale, parameters.NUMBER_CELLS).classes
     + bugclasses.numbers("soft_cap", lambda p: p.soft_cap, ("in (0, 1)", "one", "above 1")).classes
     + K_SCALE.classes + bugclasses.numbers("v_scale", lambda p: p.v_scale, ("in (0, 1)", "one", "above 1")).classes
     + PAIRS + values_by_dtype(VALUE_KINDS)
     + bugclasses.presences(k_scale=lambda p: p.k_scale is not None, v_scale=lambda p: p.v_scale is not None,
                            sliding_window=lambda p: p.sliding_window is not None,
                            soft_cap=lambda p: p.soft_cap is not None))

CONTRACTS = (FLOAT32_ACCUMULATION,
    Contract("padding_rows_are_zero", "output rows of tokens that belong to no sequence (past "
             "cu_q_lens[num_seqs]) are zeros (this family's kernel promises it; an implementation that leaves them "
             "undefined declares it not promised)", elements=_padding_rows),
    Contract("mask_value_and_padding", "an explicit mask_value must underflow like the default (the docstring: "
             "a larger one is block-size dependent); unused pages, page tails and padding tokens hold NaN and must "
             "not leak"))
