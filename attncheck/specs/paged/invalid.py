"""The calls paged_attention's convention rules out."""

from __future__ import annotations

import numpy as np

from attncheck.specs.base import InvalidCall


def invalid_paged_calls(impl) -> list[InvalidCall]:
    batch, q_heads, kv_heads, head_dim, page_size, pages = 2, 4, 2, 128, 16, 4
    pool = np.zeros((kv_heads, batch * pages, page_size, head_dim), np.float32)
    good = dict(q=np.zeros((batch, q_heads, head_dim), np.float32), k_pages=pool, v_pages=pool,
                lengths=np.array([17, 64], np.int32),
                page_indices=np.arange(batch * pages, dtype=np.int32).reshape(batch, pages))
    bad = {
        "kv_pages_shapes_differ": (dict(v_pages=pool[:, :-1]), r"k_pages and v_pages"),
        "q_heads_not_multiple": (dict(q=np.zeros((batch, 3, head_dim), np.float32)), r"(?i)Q heads"),
        "head_dim_mismatch": (dict(q=np.zeros((batch, q_heads, 64), np.float32)), r"head_dim"),
        "block_not_dividing_pages": (dict(pages_per_compute_block=3), r"pages_per_compute_block"),
        "lengths_batch": (dict(lengths=np.array([4, 4, 4], np.int32)), r"lengths"),
        "page_indices_batch": (dict(page_indices=good["page_indices"][:1]), r"page_indices"),
        "lengths_not_int32": (dict(lengths=np.array([4.0, 4.0], np.float32)), r"lengths"),
        "megacore_kv_head_odd_heads": (dict(k_pages=pool[:1], v_pages=pool[:1], megacore_mode="kv_head",
                                            q=np.zeros((batch, 1, head_dim), np.float32)),
                                       r"(?i)KV heads.*megacore_mode"),
        "megacore_batch_odd_batch": (dict(q=good["q"][:1], lengths=good["lengths"][:1],
                                          page_indices=good["page_indices"][:1], megacore_mode="batch"),
                                     r"(?i)batch.*megacore_mode"),
        "megacore_mode_unknown": (dict(megacore_mode="cores"), r"megacore_mode"),
    }
    return [InvalidCall(kind, lambda change=change: impl(**{**good, "pages_per_compute_block": 2, **change}),
                        ValueError, match) for kind, (change, match) in bad.items()]
