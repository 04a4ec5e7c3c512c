"""The ragged paged attention v3 family's bug classes, the predicates behind them and its
contracts."""

from __future__ import annotations

import numpy as np

from attncheck import bugclasses
from attncheck import strategies as S
from attncheck.expectations import Contract
from attncheck.oracle.ragged_v3 import packing
from attncheck.specs.ragged_v3.params import BLOCKS, KV_DTYPES, RaggedV3Params


def _has_kind(kind: str):
    return lambda p: any(p.kind_of(s) == kind for s in range(len(p.seqs)))


def window_starts_past_first_kv_block(p: RaggedV3Params) -> bool:
    """A windowed sequence whose first visible key lies past its first kv block: the kernel
    starts its kv loop at that block, not at 0 (tpu-inference #1169: a start hard-coded
    to 0)."""
    block = p.kv_block
    return p.sliding_window is not None and block is not None and any(
        k - q - p.sliding_window >= block for q, k in p.seqs)


def windowed_new_tokens_over_several_q_blocks(p: RaggedV3Params) -> bool:
    """A windowed mixed sequence whose new tokens span several q blocks of the mixed kernel:
    each q block's kv loop starts where its own window does, and the new K/V of every block
    must still reach the cache (sglang-jax #1606: v3 skipped writing them with a window,
    while its output stayed right)."""
    chosen = BLOCKS[p.blocks]
    return p.sliding_window is not None and chosen is not None and any(
        p.kind_of(s) == "mixed" and q > chosen["m_block_sizes"][0] for s, (q, _) in enumerate(p.seqs))


_BLOCK_SIZES_OF_KIND = {"decode": "d_block_sizes", "chunked_prefill": "p_block_sizes", "mixed": "m_block_sizes"}


def inexact_mask_value_over_a_hidden_chunk(p: RaggedV3Params) -> bool:
    """A caller's mask value that the working precision (the output dtype's) rounds away from
    zero, and a windowed query whose kv loop starts a whole compute chunk before its first
    visible key: that chunk's logits are all the mask value, and a running max kept in the
    working precision lies below them (exp overflows). Block sizes the kernel picks itself
    are not known here: a chunk holds whole pages, so it may be one page, in the one kv
    block these layouts' defaults give a sequence."""
    working = p.out_dtype or ("float32" if p.dtype == "float32" else "bfloat16")
    if p.mask_value is None or p.sliding_window is None or working == "float32":
        return False
    if float(np.float32(p.mask_value).astype(S.DTYPES[working])) >= float(np.float32(p.mask_value)):
        return False
    for s, (q, k) in enumerate(p.seqs):
        chosen = BLOCKS[p.blocks]
        bq, bkv, _, bkv_csz = ((q, k, q, p.page_size) if chosen is None
                               else chosen[_BLOCK_SIZES_OF_KIND[p.kind_of(s)]])
        for first_row in range(k - q, k, bq):  # each q block's first query, the one that sees the least
            loop_start = max(first_row - p.sliding_window, 0) // bkv * bkv
            if max(first_row - p.sliding_window + 1, 0) - loop_start >= bkv_csz:
                return True
    return False


def new_tokens_cross_a_page(p: RaggedV3Params) -> bool:
    """A sequence's new tokens are written into two pages or more."""
    return any((k - q) // p.page_size != (k - 1) // p.page_size for q, k in p.seqs)


def _several_keys(predicate):
    """What changes the logits shows only where a softmax spans several keys."""
    return lambda p: any(min(p.sliding_window or np.inf, k) >= 2 for _, k in p.seqs) and predicate(p)


def _valid_rows(case, inputs) -> dict[str, np.ndarray]:
    tokens = np.arange(case.params.shapes.max_tokens)
    return {"out": (tokens < inputs["cu_q_lens"][case.params.distribution[2]])[:, None, None]}


BUG_CLASSES = bugclasses.bug_classes(
    decode=_has_kind("decode"),
    chunked_prefill=_has_kind("chunked_prefill"),
    mixed=_has_kind("mixed"),
    decode_only=lambda p: p.distribution[0] == p.distribution[2],
    mixed_only=lambda p: p.distribution[1] == 0,
    all_three_kinds=lambda p: 0 < p.distribution[0] < p.distribution[1] < p.distribution[2],
    full_prefill=lambda p: any(q == k and q > 1 for q, k in p.seqs),
    seqs_lt_max=lambda p: len(p.seqs) < p.shapes.max_seqs,
    kv_len_on_page_edge=lambda p: any(k % p.page_size == 0 for _, k in p.seqs),
    kv_len_inside_page=lambda p: any(k % p.page_size for _, k in p.seqs),
    kv_len_on_block_edge=lambda p: p.kv_block is not None and any(k % p.kv_block == 0 for _, k in p.seqs),
    several_kv_blocks=lambda p: p.kv_block is not None and any(k > p.kv_block for _, k in p.seqs),
    new_tokens_cross_a_page=new_tokens_cross_a_page,
    window_clips_keys=lambda p: p.sliding_window is not None and any(k > p.sliding_window for _, k in p.seqs),
    window_starts_past_first_kv_block=window_starts_past_first_kv_block,
    windowed_new_tokens_over_several_q_blocks=windowed_new_tokens_over_several_q_blocks,
    inexact_mask_value_over_a_hidden_chunk=inexact_mask_value_over_a_hidden_chunk,
    soft_cap=_several_keys(lambda p: p.soft_cap is not None),
    q_scale=_several_keys(lambda p: p.q_scale is not None),
    kv_scales=_several_keys(lambda p: p.k_scale is not None),
    fp8_cache=_several_keys(lambda p: p.kv_dtype == "float8_e4m3fn"),
    bf16_cache=_several_keys(lambda p: p.kv_dtype == "bfloat16"),
    # A combined-heads word holds K and V of several kv heads, and the last one is
    # partly padding.
    partly_filled_word=lambda p: (2 * p.num_kv_heads) % packing(KV_DTYPES[p.kv_dtype]) != 0,
    # The kernel's out_dtype (its accumulator's) wider than the queries' dtype.
    accumulator_wider_than_queries=lambda p: p.out_dtype == "float32" and p.dtype == "bfloat16",
    head_dim_64=lambda p: p.head_dim == 64,
    head_dim_128=lambda p: p.head_dim == 128,
    gqa=lambda p: p.num_q_heads > p.num_kv_heads,
    large_logits=_several_keys(lambda p: p.values == "large"),
) + (bugclasses.partition("blocks", default=lambda p: p.blocks == "default",
                          small=lambda p: p.blocks == "small").classes
     + bugclasses.presences(sliding_window=lambda p: p.sliding_window is not None,
                            chunk_prefill_size=lambda p: p.chunk_prefill_size is not None))

CONTRACTS = (Contract("cache_update_is_exact", "the updated kv_cache holds each new token's K/V (zero pads "
                      "included) in its slot, bit for bit, and every other element as it was"),
             Contract("rows_of_no_sequence_are_not_judged", "output rows of tokens past cu_q_lens[distribution[2]] "
                      "belong to no sequence; the kernel leaves them as the queries' buffer held them",
                      elements=_valid_rows))
