"""Float64 reference for ragged paged attention v3 (tpu-inference's ``v3/kernel.py``): the
attention output and the updated KV cache, built on dense.attention.

Layouts (the kernel's docstrings and ``get_kv_cache_shape``/``merge_kv``):
  queries       [T, Hq, D]; keys, values [T, Hkv, D]: the new tokens, sequences packed
                back to back (sequence s owns tokens cu_q_lens[s]:cu_q_lens[s + 1]).
  kv_cache      [total_pages, page_size, C // packing, packing, Dp]: C = 2 * Hkv rounded
                up to the cache dtype's packing (32 bits / its width), Dp = D rounded up to
                128. Token t's combined head c (c // packing, c % packing): K of kv head h
                at c = 2h, V at 2h + 1; the combined heads past 2 * Hkv and the lanes past D
                are zero.
  page_indices  [max_num_seqs * pages_per_seq], flat: token t of sequence s lives in page
                page_indices[s * pages_per_seq + t // page_size], slot t % page_size.
  distribution  [3] = (i, j, k): sequences [0, i) decode (q_len 1), [i, j) chunked
                prefill (q_len == chunk_prefill_size), [j, k) mixed; k sequences exist.
Semantics (the kernel's ``ref_ragged_paged_attention``):
  - The new tokens are the last q_len of a sequence's kv_len: their K/V are written into
    the cache at positions kv_len - q_len .. kv_len - 1 (as merged, zero pads included);
    nothing else in the cache changes.
  - Query i sits at kv_len - q_len + i (bottom-right causal); a key j is visible iff
    j <= q_pos and q_pos - j < sliding_window.
  - logits = soft_cap * tanh(x / soft_cap), x = sm_scale * k_scale * q_scale *
    (q_quantized . k), where with a q_scale q_quantized is q / q_scale clipped to the
    cache dtype's range and rounded to it (the kernel quantizes queries to the cache
    dtype); out = softmax . v * v_scale.
  - Rows of tokens past cu_q_lens[k] belong to no sequence: the kernel leaves them as
    they were (the output aliases the queries' buffer); ``valid_rows`` says which count.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from attncheck.oracle import dense
from attncheck.oracle.ragged import attention_options, sequence_bounds


@dataclasses.dataclass(frozen=True)
class RaggedV3Result:
    out: np.ndarray  # [T, Hq, D] float64, zeros on rows of no sequence
    kv_cache: np.ndarray  # the cache after the update, in the cache's dtype
    valid_rows: np.ndarray  # [T] bool


def packing(dtype) -> int:
    """Values of the cache dtype per 32-bit word."""
    return 4 // np.dtype(dtype).itemsize


def merged(k: np.ndarray, v: np.ndarray, cache_shape: tuple[int, ...]) -> np.ndarray:
    """New tokens' K and V in the cache's per-token layout [T, C // packing, packing, Dp]."""
    tokens, kv_heads, head_dim = k.shape
    per_word, lanes = cache_shape[3], cache_shape[4]
    combined = np.zeros((tokens, cache_shape[2] * per_word, lanes), dtype=k.dtype)
    combined[:, 0:2 * kv_heads:2, :head_dim] = k
    combined[:, 1:2 * kv_heads:2, :head_dim] = v
    return combined.reshape(tokens, cache_shape[2], per_word, lanes)


def _quantized(q: np.ndarray, scale: float, dtype) -> np.ndarray:
    info = ml_dtypes.finfo(np.dtype(dtype))
    return np.clip(q / scale, float(info.min), float(info.max)).astype(dtype).astype(np.float64)


def ragged_paged_attention_v3(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
                              sm_scale, sliding_window=None, soft_cap=None, q_scale=None, k_scale=None,
                              v_scale=None, chunk_prefill_size=None) -> RaggedV3Result:
    queries = dense._float_array("queries", queries)
    if queries.ndim != 3:
        dense._fail("queries", "3-D [max_num_tokens, Hq, D]", f"shape {queries.shape}")
    num_tokens, q_heads, head_dim = queries.shape
    keys, values, kv_cache = np.asarray(keys), np.asarray(values), np.asarray(kv_cache)
    if keys.ndim != 3 or keys.shape[0] != num_tokens or keys.shape[2] != head_dim or q_heads % keys.shape[1]:
        dense._fail("keys", f"3-D [max_num_tokens, Hkv, D] with max_num_tokens={num_tokens}, D={head_dim} and Hkv "
                    f"dividing Hq={q_heads}", f"shape {keys.shape}")
    if values.shape != keys.shape or values.dtype != keys.dtype:
        dense._fail("values", f"keys' shape {keys.shape} and dtype {keys.dtype}", f"{values.shape} {values.dtype}")
    if kv_cache.dtype != keys.dtype:
        dense._fail("kv_cache", f"the dtype of keys and values ({keys.dtype})", kv_cache.dtype)
    kv_heads = keys.shape[1]
    per_word = packing(kv_cache.dtype)
    combined = -(-2 * kv_heads // per_word) * per_word
    lanes = -(-head_dim // 128) * 128
    if kv_cache.ndim != 5 or kv_cache.shape[2:] != (combined // per_word, per_word, lanes):
        dense._fail("kv_cache", f"5-D [total_pages, page_size, {combined // per_word}, {per_word}, {lanes}]",
                    f"shape {kv_cache.shape}")
    total_pages, page_size = kv_cache.shape[:2]
    kv_lens = dense._int_array("kv_lens", kv_lens)
    max_num_seqs = kv_lens.shape[0]
    page_indices = dense._int_array("page_indices", page_indices)
    if page_indices.ndim != 1 or page_indices.shape[0] % max_num_seqs:
        dense._fail("page_indices", f"1-D [max_num_seqs * pages_per_seq], max_num_seqs = {max_num_seqs}",
                    f"shape {page_indices.shape}")
    pages_per_seq = page_indices.shape[0] // max_num_seqs
    cu_q_lens = dense._int_array("cu_q_lens", cu_q_lens)
    if cu_q_lens.shape != (max_num_seqs + 1,):
        dense._fail("cu_q_lens", f"shape ({max_num_seqs + 1},)", f"shape {cu_q_lens.shape}")
    distribution = dense._int_array("distribution", distribution)
    if distribution.shape != (3,) or not 0 <= distribution[0] <= distribution[1] <= distribution[2] <= max_num_seqs:
        dense._fail("distribution", f"(i, j, k) with 0 <= i <= j <= k <= max_num_seqs = {max_num_seqs}",
                    distribution.tolist())
    n = int(distribution[2])
    bounds = sequence_bounds(cu_q_lens, n, num_tokens, "distribution[2]", "max_num_tokens")
    options = attention_options(sm_scale, sliding_window, soft_cap, k_scale, v_scale)
    q_scale = None if q_scale is None else dense._real("q_scale", q_scale, positive=True)
    q_lens = np.diff(bounds)
    for s in range(n):
        kind = "decode" if s < distribution[0] else "chunked prefill" if s < distribution[1] else "mixed"
        if kind == "decode" and q_lens[s] != 1:
            dense._fail("cu_q_lens", f"q_len 1 for decode sequence {s} (distribution {distribution.tolist()})",
                        int(q_lens[s]))
        if kind == "chunked prefill" and q_lens[s] != chunk_prefill_size:
            dense._fail("cu_q_lens", f"q_len == chunk_prefill_size = {chunk_prefill_size} for chunked-prefill "
                        f"sequence {s}", int(q_lens[s]))
        if not q_lens[s] <= kv_lens[s] <= pages_per_seq * page_size:
            dense._fail("kv_lens", f"q_len = {q_lens[s]} <= kv_lens[{s}] <= pages_per_seq * page_size = "
                        f"{pages_per_seq * page_size}", int(kv_lens[s]))

    new_cache = kv_cache.copy()
    flat = new_cache.reshape(total_pages * page_size, *kv_cache.shape[2:])
    new = merged(keys, values, kv_cache.shape)
    out = np.zeros((num_tokens, q_heads, head_dim))
    for s in range(n):
        q_start, q_len, kv_len = int(bounds[s]), int(q_lens[s]), int(kv_lens[s])
        slots = page_indices[s * pages_per_seq: s * pages_per_seq + -(-kv_len // page_size)]
        if np.any((slots < 0) | (slots >= total_pages)):
            dense._fail("page_indices", f"the page slots of sequence {s} in [0, {total_pages})", slots.tolist())
        positions = np.arange(kv_len)
        rows = slots[positions // page_size] * page_size + positions % page_size
        flat[rows[kv_len - q_len:]] = new[q_start:q_start + q_len]
        if q_len == 0:
            continue
        kv = flat[rows].reshape(kv_len, -1, lanes)[:, :2 * kv_heads, :head_dim].astype(np.float64)
        q = queries[q_start:q_start + q_len]
        if q_scale is not None:
            q = _quantized(q, q_scale, kv_cache.dtype) * q_scale
        result = dense.attention(q.transpose(1, 0, 2)[None], kv[:, 0::2].transpose(1, 0, 2)[None],
                                 kv[:, 1::2].transpose(1, 0, 2)[None], q_positions=np.arange(kv_len - q_len, kv_len),
                                 kv_positions=positions, causal=True, **options)
        out[q_start:q_start + q_len] = result.out[0].transpose(1, 0, 2)
    return RaggedV3Result(out=out, kv_cache=new_cache, valid_rows=np.arange(num_tokens) < bounds[-1])
