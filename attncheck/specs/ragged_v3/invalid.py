"""The ragged paged attention v3 family's invalid calls."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from attncheck import domain
from attncheck.specs.base import InvalidCall, positional_invalid_calls
from attncheck.specs.ragged_v3.params import ARRAY_ARGS


def invalid_v3_calls(impl) -> list[InvalidCall]:
    """The calls the convention rejects, each naming its argument, of the head_dim the
    implementation takes (its Domain)."""
    tokens, hq, hkv, page_size, pages_per_seq = 8, 4, 2, 16, 4
    head_dim = domain.of(impl).takes.get("head_dim", 128)
    cache_shape = (8, page_size, 2 * hkv // 2, 2, -(-head_dim // 128) * 128)
    bf16 = ml_dtypes.bfloat16
    good = dict(queries=np.zeros((tokens, hq, head_dim), bf16), keys=np.zeros((tokens, hkv, head_dim), bf16),
                values=np.zeros((tokens, hkv, head_dim), bf16), kv_cache=np.zeros(cache_shape, bf16),
                kv_lens=np.array([4, 8], np.int32), page_indices=np.arange(2 * pages_per_seq, dtype=np.int32),
                cu_q_lens=np.array([0, 1, 5], np.int32), distribution=np.array([1, 1, 2], np.int32))
    bad = {
        "q_len_gt_kv_len": (dict(kv_lens=np.array([4, 2], np.int32)), r"kv_len|q_len"),
        "empty_sequence": (dict(cu_q_lens=np.array([0, 1, 1], np.int32)), r"q_len|cu_q_lens"),
        "cache_dtype_unlike_kv": (dict(kv_cache=np.zeros(cache_shape, np.float32)), r"kv_cache|dtype"),
        "cache_shape_unlike_layout": (dict(kv_cache=np.zeros((8, page_size, 4, 1, head_dim), bf16)), r"kv_cache"),
        "distribution_decreasing": (dict(distribution=np.array([2, 1, 2], np.int32)), r"distribution"),
        "more_seqs_than_max": (dict(distribution=np.array([1, 1, 3], np.int32)), r"distribution|num_seqs"),
        "metadata_not_int32": (dict(kv_lens=np.array([4, 8], np.int64)), r"kv_lens|int32"),
    }
    options = {"window_zero": (dict(sliding_window=0), r"sliding_window"),
               "soft_cap_zero": (dict(soft_cap=0.0), r"soft_cap")}

    return positional_invalid_calls(impl, ARRAY_ARGS, good, bad, options, sm_scale=0.1)
