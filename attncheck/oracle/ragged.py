"""Float64 reference for ragged paged attention v2 (forward only), built on dense.attention.

Layouts and semantics follow tpu_inference's ragged_paged_attention v2 (seed
shared/seeds/003_8f6e01bc71f3475d.txt, `ref_ragged_paged_attention`):
  queries      [T, Hq, D], sequences packed back to back: sequence s owns tokens
               cu_q_lens[s]:cu_q_lens[s + 1]; only sequences s < num_seqs exist.
  kv_pages     [total_pages, page_size, 2 * Hkv, D]: K and V interleaved on the
               combined-heads axis, K of kv head h at combined head 2h and V at 2h + 1
               (seed `kv_pages[indices, :, 0::2, :]` / `1::2`, lines 123-126; the
               kernel's strided_load_kv reads `start::step` / `start + 1::step`, line 360).
  page_indices [max_num_seqs, pages_per_seq]: token t of sequence s lives in page
               page_indices[s, t // page_size], slot t % page_size.
  Query i of a sequence with q_len queries and kv_len keys sits at position
  kv_len - q_len + i (bottom-right causal alignment, seed lines 140-143), key j at j;
  query head h reads kv head h // (Hq // Hkv) (seed's jnp.repeat, lines 133-134).
  sliding_window masks a key when q_pos - sliding_window >= kv_pos (seed line 145,
  kernel line 518), i.e. a key is visible iff q_pos - kv_pos < sliding_window: the
  dense oracle's window condition exactly.
  logits = soft_cap * tanh(sm_scale * q . (k * k_scale) / soft_cap): the cap is applied
  after scaling (seed lines 139, 147); v is used as v * v_scale.
Not modelled, on purpose: the seed rounds k * k_scale and v * v_scale back to the
query dtype (lines 127-132) and the probabilities to v's dtype (line 149); that
rounding is kernel numerics for the tolerance model to account for, not semantics.

Only the page-table slots and pages a sequence's kv_len needs are read (neither
validated nor touched otherwise), as the kernel reads them, so stale or NaN pages
cannot reach the result. Output rows of tokens >= cu_q_lens[num_seqs] are zero.
Because q_len <= kv_len and the diagonal key is always visible, no row is ever
fully masked.
"""

import dataclasses

import numpy as np

from attncheck.oracle import dense


@dataclasses.dataclass(frozen=True)
class RaggedResult:
    out: np.ndarray  # [max_num_batched_tokens, Hq, D] float64, zeros on don't-care rows
    valid_rows: np.ndarray  # [max_num_batched_tokens] bool: True for tokens < cu_q_lens[num_seqs]


def _int_table(name, x, shape_desc, shape):
    a = dense._int_array(name, x)
    if a.shape != shape:
        dense._fail(name, f"shape {shape_desc} = {shape}", f"shape {a.shape}")
    return a


def _seq_count(num_seqs, max_num_seqs):
    # The kernel takes num_seqs as an i32[1] array; a plain int is accepted too.
    n = dense._int_array("num_seqs", num_seqs)
    if n.shape not in ((), (1,)):
        dense._fail("num_seqs", "an int or a shape (1,) integer array", f"shape {n.shape}")
    n = int(n.reshape(()))
    if not 0 <= n <= max_num_seqs:
        dense._fail("num_seqs", f"0 <= num_seqs <= max_num_seqs = {max_num_seqs} (page_indices.shape[0])", n)
    return n


def sequence_bounds(cu_q_lens: np.ndarray, n: int, num_tokens: int, count: str, tokens: str) -> np.ndarray:
    """cu_q_lens[:n + 1], checked: non-decreasing from 0 to at most the token count."""
    bounds = cu_q_lens[: n + 1]
    if bounds[0] != 0 or np.any(np.diff(bounds) < 0) or bounds[-1] > num_tokens:
        dense._fail("cu_q_lens", f"cu_q_lens[:{count} + 1] non-decreasing from 0 to at most {tokens} = {num_tokens}",
                    bounds.tolist())
    return bounds


def attention_options(sm_scale, sliding_window, soft_cap, k_scale, v_scale) -> dict:
    """dense.attention's options, checked here, not left to it, so that errors name the
    ragged function's arguments and come even when no sequence has queries."""
    return dict(
        scale=dense._real("sm_scale", sm_scale),
        window=None if sliding_window is None else dense._positive_int("sliding_window", sliding_window),
        soft_cap=None if soft_cap is None else dense._real("soft_cap", soft_cap, positive=True),
        k_scale=None if k_scale is None else dense._real("k_scale", k_scale),
        v_scale=None if v_scale is None else dense._real("v_scale", v_scale),
    )


def ragged_paged_attention(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, k_scale=None,
                           v_scale=None) -> RaggedResult:
    queries = dense._float_array("queries", queries)
    if queries.ndim != 3:
        dense._fail("queries", "3-D [max_num_batched_tokens, Hq, D]", f"shape {queries.shape}")
    num_tokens, q_heads, head_dim = queries.shape
    # Upcast only after gathering: unread pages stay unread (and cost no float64 copy).
    kv_pages = np.asarray(kv_pages)
    # A quantized cache is int8 (with k/v scales): integers up-cast to float64 exactly.
    if kv_pages.dtype != np.int8:
        dense._check_float_dtype("kv_pages", kv_pages.dtype)
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2 or kv_pages.shape[2] < 2 or kv_pages.shape[3] != head_dim \
            or q_heads % (kv_pages.shape[2] // 2):
        dense._fail("kv_pages", f"4-D [total_pages, page_size, 2 * Hkv, D] with D={head_dim} matching queries "
                    f"and Hkv dividing Hq={q_heads}", f"shape {kv_pages.shape}")
    total_pages, page_size, combined_heads, _ = kv_pages.shape
    page_indices = dense._int_array("page_indices", page_indices)
    if page_indices.ndim != 2:
        dense._fail("page_indices", "2-D [max_num_seqs, pages_per_seq]", f"shape {page_indices.shape}")
    max_num_seqs, pages_per_seq = page_indices.shape
    kv_lens = _int_table("kv_lens", kv_lens, "[max_num_seqs]", (max_num_seqs,))
    cu_q_lens = _int_table("cu_q_lens", cu_q_lens, "[max_num_seqs + 1]", (max_num_seqs + 1,))
    n = _seq_count(num_seqs, max_num_seqs)
    bounds = sequence_bounds(cu_q_lens, n, num_tokens, "num_seqs", "max_num_batched_tokens")
    options = attention_options(sm_scale, sliding_window, soft_cap, k_scale, v_scale)
    sequences = []
    for s in range(n):
        q_len, kv_len = bounds[s + 1] - bounds[s], kv_lens[s]
        if q_len > kv_len:
            dense._fail("kv_lens", f"kv_lens[{s}] >= q_len = {q_len} of sequence {s}", kv_len)
        num_pages = -(-kv_len // page_size)
        if num_pages > pages_per_seq:
            dense._fail("page_indices", f"at least {num_pages} page slots per sequence for kv_lens[{s}] = {kv_len} "
                        f"with page_size {page_size}", f"pages_per_seq = {pages_per_seq}")
        slots = page_indices[s, :num_pages]
        if np.any((slots < 0) | (slots >= total_pages)):
            dense._fail("page_indices", f"page_indices[{s}, :{num_pages}] in [0, {total_pages})", slots.tolist())
        sequences.append((bounds[s], q_len, kv_len, slots))

    out = np.zeros((num_tokens, q_heads, head_dim))
    for q_start, q_len, kv_len, slots in sequences:
        if q_len == 0:
            continue  # nothing to compute, and dense.attention needs at least one key
        kv = np.asarray(kv_pages[slots].reshape(-1, combined_heads, head_dim)[:kv_len], dtype=np.float64)
        per_head = kv.transpose(1, 0, 2)[None]  # [1, 2 * Hkv, kv_len, D]
        result = dense.attention(
            queries[q_start:q_start + q_len].transpose(1, 0, 2)[None],
            per_head[:, 0::2],
            per_head[:, 1::2],
            q_positions=np.arange(kv_len - q_len, kv_len),
            kv_positions=np.arange(kv_len),
            causal=True,
            **options,
        )
        out[q_start:q_start + q_len] = result.out[0].transpose(1, 0, 2)
    return RaggedResult(out=out, valid_rows=np.arange(num_tokens) < bounds[-1])
