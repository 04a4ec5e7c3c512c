"""The ragged paged attention v2 family's invalid calls."""

from __future__ import annotations

import numpy as np

from attncheck.specs.base import InvalidCall, positional_invalid_calls
from attncheck.specs.ragged.params import ARRAY_ARGS, HEAD_DIM


def invalid_ragged_calls(impl) -> list[InvalidCall]:
    page_size, pages, seqs, tokens, hq, hkv = 16, 8, 2, 16, 4, 2
    good = dict(queries=np.zeros((tokens, hq, HEAD_DIM), np.float32),
                kv_pages=np.zeros((pages * seqs, page_size, 2 * hkv, HEAD_DIM), np.float32),
                kv_lens=np.array([8, 8], np.int32),
                page_indices=np.arange(pages * seqs, dtype=np.int32).reshape(seqs, pages),
                cu_q_lens=np.array([0, 4, 8], np.int32), num_seqs=np.array([2], np.int32))
    bad = {
        "q_len_gt_kv_len": (dict(kv_lens=np.array([2, 8], np.int32)), r"q_len|kv_len"),
        "num_seqs_gt_max": (dict(num_seqs=np.array([3], np.int32)), r"num_seqs"),
        "kv_len_past_page_table": (dict(kv_lens=np.array([8, pages * page_size + 1], np.int32)), r"kv_len|pages"),
        "page_index_out_of_range": (dict(page_indices=np.full((seqs, pages), pages * seqs + 5, np.int32)),
                                    r"page_ind"),
        "metadata_not_int32": (dict(kv_lens=np.array([8, 8], np.int64)), r"kv_lens"),
        "cu_q_lens_decreasing": (dict(cu_q_lens=np.array([0, 6, 4], np.int32)), r"cu_q_lens"),
        "cu_q_lens_past_tokens": (dict(cu_q_lens=np.array([0, 4, tokens + 8], np.int32),
                                       kv_lens=np.array([8, 32], np.int32)), r"cu_q_lens"),
        "odd_combined_heads": (dict(kv_pages=np.zeros((pages * seqs, page_size, 3, HEAD_DIM), np.float32)),
                               r"kv_pages|heads"),
        "head_dim_mismatch": (dict(queries=np.zeros((tokens, hq, 64), np.float32)), r"head_dim|queries"),
        "q_heads_not_multiple": (dict(queries=np.zeros((tokens, 3, HEAD_DIM), np.float32)), r"heads"),
        "unsupported_kv_dtype": (dict(kv_pages=np.zeros((pages * seqs, page_size, 2 * hkv, HEAD_DIM), np.float16)),
                                 r"kv_pages"),
        "metadata_not_array": (dict(kv_lens=[8, 8]), r"kv_lens"),
        "queries_rank": (dict(queries=np.zeros((tokens, hq * HEAD_DIM), np.float32)), r"queries"),
        "unsupported_q_dtype": (dict(queries=np.zeros((tokens, hq, HEAD_DIM), np.float16)), r"queries"),
        "num_seqs_shape": (dict(num_seqs=np.array([2, 2], np.int32)), r"num_seqs"),
        "no_query_tokens": (dict(queries=np.zeros((0, hq, HEAD_DIM), np.float32)), r"queries"),
        "empty_page_table": (dict(page_indices=np.zeros((seqs, 0), np.int32)), r"page_indices"),
        "no_kv_pages": (dict(kv_pages=np.zeros((0, page_size, 2 * hkv, HEAD_DIM), np.float32)), r"kv_pages"),
        "kv_heads_not_tileable": (dict(queries=np.zeros((tokens, 6, HEAD_DIM), np.float32),
                                       kv_pages=np.zeros((pages * seqs, page_size, 6, HEAD_DIM), np.float32)),
                                  r"kv_pages"),
        "kv_lens_shape": (dict(kv_lens=np.array([8, 8, 8], np.int32)), r"kv_lens"),
        "cu_q_lens_shape": (dict(cu_q_lens=np.array([0, 4], np.int32)), r"cu_q_lens"),
        "cu_q_lens_negative_start": (dict(cu_q_lens=np.array([-1, 4, 8], np.int32)), r"cu_q_lens"),
        "kv_lens_negative": (dict(kv_lens=np.array([-1, 8], np.int32), cu_q_lens=np.array([0, 0, 4], np.int32)),
                             r"kv_lens"),
    }
    options = {
        "window_zero": (dict(sliding_window=0), r"sliding_window"),
        "soft_cap_zero": (dict(soft_cap=0.0), r"soft_cap"),
        "kv_block_zero": (dict(num_kv_pages_per_block=0), r"num_kv_pages_per_block"),
        "query_block_not_int": (dict(num_queries_per_block=2.5), r"num_queries_per_block"),
        "soft_cap_not_number": (dict(soft_cap="1.0"), r"soft_cap"),
        "sm_scale_not_finite": (dict(sm_scale=float("inf")), r"sm_scale"),
        "mask_value_not_negative": (dict(mask_value=0.0), r"mask_value"),
    }

    return positional_invalid_calls(impl, ARRAY_ARGS, good, bad, options, sm_scale=0.1)
