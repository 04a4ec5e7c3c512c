"""Ragged paged attention (v2) as a Pallas TPU kernel, for jax 0.12.

One call serves a batch that mixes decode (q_len 1), chunked prefill
(q_len < kv_len) and full prefill (q_len == kv_len) sequences.  The queries of
all sequences are concatenated along the token axis (``cu_q_lens`` holds the
offsets) and every sequence reads its K/V from a shared paged cache through its
row of ``page_indices``.

Conventions (the public contract; the gate's oracles rely on them):

* ``kv_pages`` is ``[total_num_pages, page_size, num_combined_kv_heads,
  head_dim]`` with K and V interleaved on the head axis: combined head ``2*h``
  is K of kv head ``h`` and ``2*h + 1`` is V of kv head ``h``.
* GQA: query head ``qh`` reads kv head ``qh // (num_q_heads // num_kv_heads)``
  (the grouping of ``jnp.repeat``).
* Causal alignment is bottom-right: token ``i`` (0-based) of a sequence with
  ``q_len`` queries and ``kv_len`` keys sits at ``q_pos = kv_len - q_len + i``
  and sees key ``j`` iff ``j <= q_pos``.  With ``sliding_window=W`` it
  additionally needs ``q_pos - j < W`` (it sees itself and the ``W - 1``
  keys before it); this is the seed's ``q_pos - W >= j`` mask, inverted.
* Logits are ``sm_scale * q.k``; ``soft_cap`` is applied after that scaling
  (``soft_cap * tanh(logits / soft_cap)``), then the mask.
* Masked keys get probability exactly 0 only because their logit
  ``mask_value`` underflows: ``exp(mask_value - row max) == 0`` in float32.
  The default (``DEFAULT_MASK_VALUE``, -0.7 * float32 max) does for any row
  max above it by more than ~104, i.e. any realistic logits.  A ``mask_value``
  that does not (e.g. -1 with logits of order 1) is accepted but gives no
  defined result: it is the logit only of the masked keys in the K/V blocks
  the kernel visits, and of the slots past ``kv_len`` in its last block, so
  the output depends on ``num_kv_pages_per_block`` and differs from
  :func:`ref_ragged_paged_attention`, which gives it to every masked key.
* ``k_scale`` / ``v_scale``: K (V) is converted to float32, multiplied by the
  scale and cast to the query dtype before use.  Without a scale, 8-bit K/V
  (int8, fp8) is cast to the query dtype and 16/32-bit float K/V is used in
  ``promote_types(q.dtype, kv.dtype)``.  The probabilities are cast to that
  K/V compute dtype for the P@V product; all accumulation is float32.
* Rows of the output that belong to no sequence (tokens before
  ``cu_q_lens[0]`` or at/after ``cu_q_lens[num_seqs]``) are written as zeros;
  callers must treat them as don't-care.

Kernel structure.  The grid is ``(num_heads_blks, num_q_blks)``.  Each grid
step owns ``num_queries_per_block`` consecutive query tokens for one block of
heads, finds the first sequence that has tokens in that range by binary search
over ``cu_q_lens``, and walks the overlapping sequences and, for each, only the
K/V blocks that some of its rows in this step can see (causal upper bound and
sliding-window lower bound).  K/V pages are DMA'd from HBM into a two-slot VMEM
buffer: while block ``n`` is being computed, block ``n + 1`` (possibly of the
next sequence) is already in flight.  Every DMA started in a grid step is
waited in that same step, so grid steps share no state and both grid axes are
``parallel`` (megacore may split either).  The price is that the first block
of each step is not overlapped with compute (the seed prefetched across grid
steps through SMEM state that made every step depend on the previous one).

Only pages that hold keys of the sequence (``page < cdiv(kv_len, page_size)``)
are fetched; the remaining slots of the buffer keep whatever an earlier block
left there (or uninitialized memory), and the rows of the last page past
``kv_len`` hold whatever the cache holds.  Those rows are replaced by zeros in
K *and* V before any arithmetic: masking the probabilities alone is not enough
because ``0 * NaN == NaN`` in the P@V product.

Validation: ``static_validate_inputs`` (shapes, dtypes, options) always runs in
``ragged_paged_attention``.  ``dynamic_validate_inputs`` (values of the
metadata) runs there too when the metadata is concrete (not traced), and is
public so that a caller who jits the kernel can run it on concrete arrays.
Under ``jax.jit`` nothing checks the values: out-of-range page indices would
make the kernel read outside the cache.
"""
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# TPU vector register geometry: 8 sublanes x 128 lanes of 32-bit words.
NUM_LANES = 128
NUM_SUBLANES = 8
# Bits per 32-bit word; a dtype of b bits packs 32 // b values per word.
WORD_BITS = 32

# Finite, very negative logit for masked entries.  Finite (not -inf) so that a
# row whose every entry in a block is masked still has a finite running max
# and exp() never sees inf - inf.
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.dtype("float32")).max)

# Default block-size rule (get_tuned_block_sizes needs a TPU to ask for its
# version, so it cannot be used on CPU; this rule is deterministic in shapes):
#   num_kv_pages_per_block = clamp(DEFAULT_KV_TOKENS_PER_BLOCK // page_size,
#                                  1, pages_per_seq)
#   num_queries_per_block  = min(DEFAULT_MAX_QUERIES_PER_BLOCK,
#                                round_up(num_tokens, NUM_SUBLANES))
# 128 keys per block fill the MXU's contraction width; 32 query tokens per
# block keeps GQA row counts (32 * group) within a few vregs of scratch.
DEFAULT_KV_TOKENS_PER_BLOCK = 128
DEFAULT_MAX_QUERIES_PER_BLOCK = 32

METADATA_DTYPE = jnp.dtype(jnp.int32)
SUPPORTED_Q_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# 8-bit K/V ("packed": four values per 32-bit word) are dequantized in-kernel.
PACKED_KV_DTYPES = (
    jnp.dtype(jnp.int8),
    jnp.dtype(jnp.float8_e4m3fn),
    jnp.dtype(jnp.float8_e5m2),
)
SUPPORTED_KV_DTYPES = SUPPORTED_Q_DTYPES + PACKED_KV_DTYPES

# Number of scalar-prefetch operands: kv_lens, page_indices, cu_q_lens,
# num_seqs.
NUM_SCALAR_PREFETCH = 4
# Two VMEM slots for K/V blocks: compute on one while the DMA fills the other.
NUM_KV_BUFFERS = 2


class InputDtypeError(TypeError, ValueError):
  """Wrong dtype of an argument.

  Both a TypeError (it is one) and a ValueError (the seed raised ValueError for
  non-int32 metadata, and callers may catch that).
  """


# ----------------------------------------------------------------------------
# Small helpers.
# ----------------------------------------------------------------------------


def cdiv(a, b):
  """Ceiling division for Python ints and traced int32 scalars alike."""
  return (a + b - 1) // b


def get_dtype_packing(dtype) -> int:
  """How many values of `dtype` share one 32-bit word."""
  bits = jnp.dtype(dtype).itemsize * 8
  return WORD_BITS // bits


def _sublane_tile(dtype) -> int:
  """Rows of one native (sublane x lane) tile for `dtype`: 8, 16 or 32."""
  return NUM_SUBLANES * get_dtype_packing(dtype)


def can_be_xla_fully_tiled(x: int, packing: int) -> bool:
  """Whether a second-minor extent `x` tiles XLA's HBM layout without padding.

  XLA picks small tiles (1, 2, 4 or 8 words of sublanes) for small second-minor
  extents and 8-word tiles otherwise; a DMA that slices the combined-head axis
  must cover whole tiles.
  """
  if x % packing:
    return False
  words = x // packing
  return words in (1, 2, 4, 8) or words % NUM_SUBLANES == 0


def _is_tile_aligned_block(block: int, full: int, dtype) -> bool:
  """A block extent on a second-minor axis is legal if it is the whole axis or
  a whole number of native tiles."""
  return block == full or block % _sublane_tile(dtype) == 0


def get_min_heads_per_blk(num_q_heads, num_combined_kv_heads, q_dtype,
                          kv_dtype):
  """Smallest head block (q heads, combined kv heads) that is tile aligned.

  The kv heads of a block are a divisor of num_kv_heads; the block must be
  tile aligned (or whole) on both the combined-kv-head axis (it is sliced by
  the K/V DMA) and the q-head axis (it is a BlockSpec's second-minor extent).
  Smaller head blocks mean more grid steps for megacore to split and less VMEM.
  """
  num_kv_heads = num_combined_kv_heads // 2
  group = num_q_heads // num_kv_heads
  for kv_heads_per_blk in range(1, num_kv_heads + 1):
    if num_kv_heads % kv_heads_per_blk:
      continue
    combined = 2 * kv_heads_per_blk
    q_heads = kv_heads_per_blk * group
    if (_is_tile_aligned_block(combined, num_combined_kv_heads, kv_dtype) and
        _is_tile_aligned_block(q_heads, num_q_heads, q_dtype)):
      return q_heads, combined
  return num_q_heads, num_combined_kv_heads


def get_default_block_sizes(page_size: int, pages_per_seq: int,
                            num_tokens: int) -> tuple[int, int]:
  """(num_kv_pages_per_block, num_queries_per_block) from shapes alone."""
  kv_pages = max(1, min(pages_per_seq,
                         DEFAULT_KV_TOKENS_PER_BLOCK // page_size))
  rounded_tokens = cdiv(num_tokens, NUM_SUBLANES) * NUM_SUBLANES
  queries = min(DEFAULT_MAX_QUERIES_PER_BLOCK, rounded_tokens)
  return kv_pages, queries


def kv_compute_dtype(q_dtype, kv_dtype, scale):
  """dtype K (or V) is used in, given the scale that applies to it."""
  q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
  if scale is not None or kv_dtype in PACKED_KV_DTYPES:
    return q_dtype
  return jnp.promote_types(q_dtype, kv_dtype)


def _convert_kv(x, scale, compute_dtype):
  """Dequantize / convert a K or V tile (seed: through float32 because not
  every dtype pair converts directly on TPU)."""
  if scale is not None:
    return (x.astype(jnp.float32) * scale).astype(compute_dtype)
  if x.dtype != compute_dtype:
    return x.astype(jnp.float32).astype(compute_dtype)
  return x


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _is_real_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


# ----------------------------------------------------------------------------
# Validation.
# ----------------------------------------------------------------------------


def _check_int_option(name, value, *, low, high=None):
  if value is None:
    return
  if not _is_int(value):
    raise TypeError(f"{name} must be an int or None, got {value!r} "
                    f"({type(value).__name__}).")
  if value < low or (high is not None and value > high):
    rng = f"in [{low}, {high}]" if high is not None else f">= {low}"
    raise ValueError(f"{name} must be {rng}, got {value}.")


def _check_float_option(name, value, *, allow_none=True):
  if value is None and allow_none:
    return
  if not _is_real_number(value):
    or_none = " or None" if allow_none else ""
    raise TypeError(f"{name} must be a real number{or_none}, got {value!r} "
                    f"({type(value).__name__}).")
  if not math.isfinite(float(value)):
    raise ValueError(f"{name} must be finite, got {value}.")


def static_validate_inputs(
    queries,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages,  # [total_num_pages, page_size, num_combined_kv_heads, head_dim]
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale=None,
    sliding_window=None,
    soft_cap=None,
    mask_value=None,
    k_scale=None,
    v_scale=None,
    num_kv_pages_per_block=None,
    num_queries_per_block=None,
    vmem_limit_bytes=None,
):
  """Checks shapes, dtypes and options; works on tracers and ShapeDtypeStructs.

  Options left at None are not checked.  Raises ValueError (shapes, ranges),
  TypeError (option types) or InputDtypeError (a TypeError and a ValueError)
  for dtypes.
  """
  # Ranks first: everything below unpacks shapes.
  for name, arr, rank in (("queries", queries, 3), ("kv_pages", kv_pages, 4),
                          ("kv_lens", kv_lens, 1),
                          ("page_indices", page_indices, 2),
                          ("cu_q_lens", cu_q_lens, 1),
                          ("num_seqs", num_seqs, 1)):
    if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(arr).__name__}.")
    if len(arr.shape) != rank:
      raise ValueError(
          f"{name} must have rank {rank}, got shape {tuple(arr.shape)}.")

  num_tokens, num_q_heads, head_dim = queries.shape
  total_num_pages, page_size, num_combined_kv_heads, head_dim_kv = (
      kv_pages.shape)
  max_num_seqs, pages_per_seq = page_indices.shape

  # Dtypes.
  for name, arr in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
    if jnp.dtype(arr.dtype) != METADATA_DTYPE:
      raise InputDtypeError(
          f"{name} must have dtype int32, got {jnp.dtype(arr.dtype)}.")
  if jnp.dtype(queries.dtype) not in SUPPORTED_Q_DTYPES:
    raise InputDtypeError(
        f"queries dtype must be one of {[str(d) for d in SUPPORTED_Q_DTYPES]},"
        f" got {jnp.dtype(queries.dtype)}.")
  if jnp.dtype(kv_pages.dtype) not in SUPPORTED_KV_DTYPES:
    raise InputDtypeError(
        f"kv_pages dtype must be one of "
        f"{[str(d) for d in SUPPORTED_KV_DTYPES]}, got "
        f"{jnp.dtype(kv_pages.dtype)}.")

  # Shapes.
  if num_seqs.shape != (1,):
    raise ValueError(f"num_seqs must have shape (1,), got {num_seqs.shape}.")
  if num_tokens < 1:
    raise ValueError(
        f"queries must have at least one token (shape[0] >= 1), got shape "
        f"{queries.shape}.")
  if max_num_seqs < 1 or pages_per_seq < 1:
    raise ValueError(
        "page_indices must have shape (max_num_seqs >= 1, pages_per_seq >= 1),"
        f" got {page_indices.shape}.")
  if total_num_pages < 1 or page_size < 1:
    raise ValueError(
        "kv_pages must have total_num_pages >= 1 and page_size >= 1, got "
        f"shape {kv_pages.shape}.")
  if head_dim < 1 or head_dim_kv != head_dim:
    raise ValueError(
        f"head_dim of queries ({head_dim}) must equal head_dim of kv_pages "
        f"({head_dim_kv}) and be >= 1.")
  if num_combined_kv_heads < 2 or num_combined_kv_heads % 2:
    raise ValueError(
        "kv_pages.shape[2] (num_combined_kv_heads: K and V interleaved) must "
        f"be a positive even number, got {num_combined_kv_heads}.")
  num_kv_heads = num_combined_kv_heads // 2
  if num_q_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(
        f"queries.shape[1] (num_q_heads={num_q_heads}) must be a positive "
        f"multiple of num_kv_heads={num_kv_heads} (kv_pages.shape[2] // 2).")
  kv_packing = get_dtype_packing(kv_pages.dtype)
  if not can_be_xla_fully_tiled(num_combined_kv_heads, kv_packing):
    raise ValueError(
        f"Not implemented: kv_pages.shape[2] (num_combined_kv_heads="
        f"{num_combined_kv_heads}) cannot be tiled without padding for "
        f"kv_pages dtype {jnp.dtype(kv_pages.dtype)} (packing {kv_packing}): it"
        f" must be a multiple of {kv_packing} and the number of 32-bit rows "
        f"({num_combined_kv_heads / kv_packing:g}) must be 1, 2, 4, 8 or a "
        f"multiple of {NUM_SUBLANES}.")
  if kv_lens.shape != (max_num_seqs,):
    raise ValueError(
        f"kv_lens must have shape ({max_num_seqs},) (max_num_seqs = "
        f"page_indices.shape[0]), got {kv_lens.shape}.")
  if cu_q_lens.shape != (max_num_seqs + 1,):
    raise ValueError(
        f"cu_q_lens must have shape ({max_num_seqs + 1},) (max_num_seqs + 1), "
        f"got {cu_q_lens.shape}.")

  # Options.
  _check_float_option("sm_scale", sm_scale)
  _check_int_option("sliding_window", sliding_window, low=1)
  _check_float_option("soft_cap", soft_cap)
  if soft_cap is not None and soft_cap == 0:
    raise ValueError(f"soft_cap must not be 0, got {soft_cap}.")
  _check_float_option("mask_value", mask_value)
  if mask_value is not None and mask_value >= 0:
    raise ValueError(
        f"mask_value must be negative (it replaces masked logits), got "
        f"{mask_value}.")
  _check_float_option("k_scale", k_scale)
  _check_float_option("v_scale", v_scale)
  _check_int_option("num_kv_pages_per_block", num_kv_pages_per_block, low=1,
                    high=pages_per_seq)
  _check_int_option("num_queries_per_block", num_queries_per_block, low=1)
  _check_int_option("vmem_limit_bytes", vmem_limit_bytes, low=1)


def dynamic_validate_inputs(
    queries,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=None,
    sliding_window=None,
    soft_cap=None,
    mask_value=None,
    k_scale=None,
    v_scale=None,
    num_kv_pages_per_block=None,
    num_queries_per_block=None,
    vmem_limit_bytes=None,
):
  """Static checks plus checks of the metadata values (needs concrete arrays).

  Only the first num_seqs entries of kv_lens / page_indices rows and the first
  num_seqs + 1 entries of cu_q_lens are meaningful and checked; the rest is
  padding.  Page-table slots past cdiv(kv_len, page_size) are never read and
  are not checked.
  """
  static_validate_inputs(
      queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
      mask_value=mask_value, k_scale=k_scale, v_scale=v_scale,
      num_kv_pages_per_block=num_kv_pages_per_block,
      num_queries_per_block=num_queries_per_block,
      vmem_limit_bytes=vmem_limit_bytes)
  for name, arr in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
    if not _is_concrete(arr):
      raise ValueError(
          f"dynamic_validate_inputs needs concrete arrays; {name} is traced.")
  kv_lens = np.asarray(kv_lens)
  page_indices = np.asarray(page_indices)
  cu_q_lens = np.asarray(cu_q_lens)
  n = int(np.asarray(num_seqs)[0])
  num_tokens = queries.shape[0]
  total_num_pages, page_size = kv_pages.shape[:2]
  max_num_seqs, pages_per_seq = page_indices.shape

  if not 0 <= n <= max_num_seqs:
    raise ValueError(
        f"num_seqs[0] must be in [0, max_num_seqs={max_num_seqs}], got {n}.")
  cu = cu_q_lens[:n + 1].astype(np.int64)
  if cu[0] < 0:
    raise ValueError(f"cu_q_lens[0] must be >= 0, got {cu[0]}.")
  steps = np.diff(cu)
  if np.any(steps < 0):
    i = int(np.argmax(steps < 0))
    raise ValueError(
        f"cu_q_lens must be non-decreasing over its first num_seqs + 1 = "
        f"{n + 1} entries, got cu_q_lens[{i}]={cu[i]} > "
        f"cu_q_lens[{i + 1}]={cu[i + 1]}.")
  if cu[n] > num_tokens:
    raise ValueError(
        f"cu_q_lens[num_seqs]={cu[n]} (total query tokens) must be <= the "
        f"number of query tokens queries.shape[0]={num_tokens}.")
  for s in range(n):
    kv_len = int(kv_lens[s])
    q_len = int(cu[s + 1] - cu[s])
    if kv_len < 0:
      raise ValueError(f"kv_lens[{s}] must be >= 0, got {kv_len}.")
    if q_len > kv_len:
      raise ValueError(
          f"sequence {s}: q_len={q_len} (cu_q_lens[{s + 1}] - cu_q_lens[{s}])"
          f" must be <= kv_lens[{s}]={kv_len}.")
    pages_needed = cdiv(kv_len, page_size)
    if pages_needed > pages_per_seq:
      raise ValueError(
          f"sequence {s}: kv_lens[{s}]={kv_len} needs {pages_needed} pages of "
          f"page_size={page_size}, but page_indices has only pages_per_seq="
          f"{pages_per_seq} slots.")
    used = page_indices[s, :pages_needed]
    bad = (used < 0) | (used >= total_num_pages)
    if np.any(bad):
      j = int(np.argmax(bad))
      raise ValueError(
          f"page_indices[{s}, {j}]={int(used[j])} is out of range: page "
          f"indices used by sequence {s} must be in [0, total_num_pages="
          f"{total_num_pages}).")


# ----------------------------------------------------------------------------
# Reference.
# ----------------------------------------------------------------------------


def ref_ragged_paged_attention(
    queries,
    kv_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=1.0,
    sliding_window=None,
    soft_cap=None,
    mask_value=DEFAULT_MASK_VALUE,
    k_scale=None,
    v_scale=None,
):
  """Plain-jnp reference with the kernel's semantics (needs concrete metadata).

  Equal to the kernel for any mask_value that underflows (see the module
  docstring); with one that does not, the two differ.

  Unlike the seed's reference (which returns only the cu_q_lens[num_seqs]
  valid rows), this returns an array shaped like `queries` with zeros in the
  rows that belong to no sequence, as the kernel does.
  """
  dynamic_validate_inputs(
      queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
      mask_value=mask_value, k_scale=k_scale, v_scale=v_scale)
  if mask_value is None:
    mask_value = DEFAULT_MASK_VALUE
  _, page_size, num_combined_kv_heads, head_dim = kv_pages.shape
  num_kv_heads = num_combined_kv_heads // 2
  group = queries.shape[1] // num_kv_heads
  k_dtype = kv_compute_dtype(queries.dtype, kv_pages.dtype, k_scale)
  v_dtype = kv_compute_dtype(queries.dtype, kv_pages.dtype, v_scale)
  kv_lens = np.asarray(kv_lens)
  cu_q_lens = np.asarray(cu_q_lens)
  page_indices = np.asarray(page_indices)
  out = jnp.zeros_like(queries)
  for s in range(int(np.asarray(num_seqs)[0])):
    q_start, q_end = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
    q_len, kv_len = q_end - q_start, int(kv_lens[s])
    if q_len == 0:
      continue
    pages = page_indices[s, :cdiv(kv_len, page_size)]
    kv = kv_pages[pages].reshape(-1, num_combined_kv_heads, head_dim)[:kv_len]
    k = _convert_kv(kv[:, 0::2], k_scale, k_dtype)
    v = _convert_kv(kv[:, 1::2], v_scale, v_dtype)
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    q = queries[q_start:q_end]
    logits = jnp.einsum("qhd,khd->hqk", q.astype(k.dtype), k,
                        preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
      logits = soft_cap * jnp.tanh(logits / soft_cap)
    q_pos = kv_len - q_len + jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(kv_len)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
      visible &= q_pos - k_pos < sliding_window
    logits = jnp.where(visible[None], logits, mask_value)
    probs = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum("hqk,khd->qhd", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    out = out.at[q_start:q_end].set(o.astype(queries.dtype))
  return out


# ----------------------------------------------------------------------------
# Kernel.
# ----------------------------------------------------------------------------


def _fold_rows(x):
  """[a, b, d] -> [a * b, d] (leading axis folded into the sublane axis).

  Like the seed's fold_on_2nd_minor: when b is not a whole number of packed
  rows the fold goes through float32, whose (8, 128) tiling Mosaic can fold.
  """
  a, b, d = x.shape
  if b % get_dtype_packing(x.dtype):
    return x.astype(jnp.float32).reshape(a * b, d).astype(x.dtype)
  return x.reshape(a * b, d)


def _ragged_paged_attention_kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # i32[max_num_seqs]
    page_indices_ref,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    num_seqs_ref,  # i32[1]
    # Inputs.
    q_ref,  # [num_q_per_blk, num_q_heads_per_blk, head_dim] (VMEM block)
    # [total_num_pages, page_size, num_combined_kv_heads, head_dim] (HBM)
    kv_pages_hbm_ref,
    # Output.
    o_ref,  # [num_q_per_blk, num_q_heads_per_blk, head_dim] (VMEM block)
    # Scratch.
    # [2, num_kv_pages_per_blk, page_size, num_combined_kv_heads_per_blk,
    #  head_dim]
    kv_bufs,
    sems,  # DMA semaphores [2], one per buffer slot
    m_ref,  # f32[num_kv_heads_per_blk, num_q_per_blk * group, NUM_LANES]
    l_ref,  # f32[num_kv_heads_per_blk, num_q_per_blk * group, NUM_LANES]
    acc_ref,  # f32[num_kv_heads_per_blk, num_q_per_blk * group, head_dim]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    k_scale: float | None,
    v_scale: float | None,
):
  num_q_per_blk, num_q_heads_per_blk, head_dim = q_ref.shape
  _, num_kv_pages_per_blk, page_size, num_combined_kv_heads_per_blk, _ = (
      kv_bufs.shape)
  num_kv_heads_per_blk = num_combined_kv_heads_per_blk // 2
  group = num_q_heads_per_blk // num_kv_heads_per_blk
  num_rows = num_q_per_blk * group  # rows of the per-kv-head q matrix
  num_kv_per_blk = num_kv_pages_per_blk * page_size
  max_num_seqs, pages_per_seq = page_indices_ref.shape
  k_dtype = kv_compute_dtype(q_ref.dtype, kv_bufs.dtype, k_scale)
  v_dtype = kv_compute_dtype(q_ref.dtype, kv_bufs.dtype, v_scale)

  heads_blk_idx = pl.program_id(0)
  q_blk_idx = pl.program_id(1)
  heads_start = heads_blk_idx * num_combined_kv_heads_per_blk
  q_blk_start = q_blk_idx * num_q_per_blk
  q_blk_end = q_blk_start + num_q_per_blk
  # Clamped so that every SMEM index below stays in range even for garbage
  # num_seqs (under jit nothing validates values).
  num_seqs = jnp.clip(num_seqs_ref[0], 0, max_num_seqs)

  # Rows owned by no sequence must not keep stale VMEM: start from zeros.
  o_ref[...] = jnp.zeros_like(o_ref)

  def seq_info(seq_idx):
    """(q_start, q_end, kv_len) of a sequence; any seq_idx reads in range."""
    s = jnp.clip(seq_idx, 0, max_num_seqs - 1)
    return cu_q_lens_ref[s], cu_q_lens_ref[s + 1], kv_lens_ref[s]

  def seq_plan(seq_idx):
    """K/V blocks [blk_start, blk_end) that the sequence's rows in this grid
    step can see, and whether there is anything to do at all."""
    q_start, q_end, kv_len = seq_info(seq_idx)
    q_len = q_end - q_start
    first_tok = jnp.maximum(q_start, q_blk_start)
    end_tok = jnp.minimum(q_end, q_blk_end)
    context = kv_len - q_len  # q_pos of token t is context + (t - q_start)
    last_pos = context + (end_tok - 1 - q_start)
    # Never past the keys the page table can hold (guards SMEM reads).
    num_keys = jnp.minimum(kv_len, pages_per_seq * page_size)
    blk_end = cdiv(jnp.minimum(last_pos + 1, num_keys), num_kv_per_blk)
    if sliding_window is None:
      blk_start = jnp.int32(0)
    else:
      first_pos = context + (first_tok - q_start)
      first_key = jnp.maximum(first_pos - sliding_window + 1, 0)
      blk_start = first_key // num_kv_per_blk
    has_work = ((seq_idx < num_seqs) & (q_len > 0) & (first_tok < end_tok) &
                (blk_start < blk_end))
    return blk_start, blk_end, has_work

  def kv_block_copies(seq_idx, kv_blk_idx, buf_idx):
    """One DMA per page of the block, each with its predicate: only pages that
    hold keys of the sequence are fetched (the rest of the slot is stale and
    gets masked)."""
    _, _, kv_len = seq_info(seq_idx)
    s = jnp.clip(seq_idx, 0, max_num_seqs - 1)
    num_pages = jnp.minimum(cdiv(kv_len, page_size), pages_per_seq)
    copies = []
    for p in range(num_kv_pages_per_blk):
      slot = kv_blk_idx * num_kv_pages_per_blk + p
      page = page_indices_ref[s, jnp.minimum(slot, pages_per_seq - 1)]
      copy = pltpu.make_async_copy(
          kv_pages_hbm_ref.at[page, :,
                              pl.ds(heads_start, num_combined_kv_heads_per_blk),
                              :],
          kv_bufs.at[buf_idx, p],
          sems.at[buf_idx],
      )
      copies.append((slot < num_pages, copy))
    return copies

  def start_kv_block(seq_idx, kv_blk_idx, buf_idx):
    for needed, copy in kv_block_copies(seq_idx, kv_blk_idx, buf_idx):
      pl.when(needed)(copy.start)

  def wait_kv_block(seq_idx, kv_blk_idx, buf_idx):
    # Same predicates as the start: every started copy is waited exactly once.
    for needed, copy in kv_block_copies(seq_idx, kv_blk_idx, buf_idx):
      pl.when(needed)(copy.wait)

  def init_softmax_state():
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def attend_kv_block(seq_idx, kv_blk_idx, buf_idx):
    """Online-softmax update of every kv head of the block with one K/V
    block."""
    q_start, q_end, kv_len = seq_info(seq_idx)
    kv_blk_start = kv_blk_idx * num_kv_per_blk
    # K/V rows at or past kv_len are stale buffer contents or cache garbage.
    kv_row = lax.broadcasted_iota(jnp.int32, (num_kv_per_blk, head_dim), 0)
    kv_row_valid = kv_row < kv_len - kv_blk_start
    # Row r of the q matrix is token r // group of the block (token-major).
    tok = q_blk_start + lax.broadcasted_iota(
        jnp.int32, (num_rows, num_kv_per_blk), 0) // group
    q_pos = (kv_len - (q_end - q_start)) + (tok - q_start)
    k_pos = kv_blk_start + lax.broadcasted_iota(
        jnp.int32, (num_rows, num_kv_per_blk), 1)
    visible = k_pos <= q_pos
    if sliding_window is not None:
      visible = jnp.logical_and(visible, q_pos - k_pos < sliding_window)

    for h in range(num_kv_heads_per_blk):
      # Load values, then fold: a reshape of the *ref* is not supported by the
      # TPU interpreter (ReshapeTransform), a reshape of the loaded value is.
      k = _fold_rows(kv_bufs[buf_idx, :, :, 2 * h, :])
      v = _fold_rows(kv_bufs[buf_idx, :, :, 2 * h + 1, :])
      # Zero K and V past kv_len.  V matters most: masked probabilities are 0
      # and 0 * NaN = NaN would reach valid outputs through P @ V.
      k = jnp.where(kv_row_valid, _convert_kv(k, k_scale, k_dtype), 0)
      v = jnp.where(kv_row_valid, _convert_kv(v, v_scale, v_dtype), 0)
      q = _fold_rows(q_ref[:, h * group:(h + 1) * group, :])
      logits = lax.dot_general(
          q.astype(k.dtype), k, (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32) * sm_scale
      if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
      logits = jnp.where(visible, logits, mask_value)

      m_prev = m_ref[h]  # [num_rows, NUM_LANES], lanes replicated
      l_prev = l_ref[h]
      m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
      alpha = jnp.exp(m_prev - m_next)
      probs = jnp.exp(logits - m_next[:, :1])
      l_ref[h] = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)
      m_ref[h] = m_next
      pv = jnp.dot(probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
      acc_ref[h] = acc_ref[h] * alpha[:, :1] + pv

  def write_sequence_output(seq_idx):
    """Normalize and write the rows of this sequence into o_ref.

    Read-modify-write with jnp.where instead of a masked store: masked stores
    (pltpu.store(..., mask=)) on 3-D refs raise spurious out-of-bounds errors
    in the TPU interpreter, and Mosaic only masks 32-bit stores.  A full store
    of the selected block is correct on both.
    """
    q_start, q_end, _ = seq_info(seq_idx)
    tok = q_blk_start + lax.broadcasted_iota(
        jnp.int32, (num_q_per_blk, group, head_dim), 0)
    owned = jnp.logical_and(tok >= q_start, tok < q_end)
    for h in range(num_kv_heads_per_blk):
      out = acc_ref[h] / l_ref[h][:, :1]
      out = out.reshape(num_q_per_blk, group, head_dim).astype(o_ref.dtype)
      heads = slice(h * group, (h + 1) * group)
      o_ref[:, heads, :] = jnp.where(owned, out, o_ref[:, heads, :])

  # First sequence with a token at or after q_blk_start: binary search for the
  # number of sequences s with cu_q_lens[s + 1] <= q_blk_start.
  def search_step(_, bounds):
    lo, hi = bounds
    mid = (lo + hi) // 2
    end = cu_q_lens_ref[jnp.minimum(mid + 1, max_num_seqs)]
    ends_before = end <= q_blk_start
    active = lo < hi
    lo = jnp.where(active & ends_before, mid + 1, lo)
    hi = jnp.where(active & jnp.logical_not(ends_before), mid, hi)
    return lo, hi

  first_seq, _ = lax.fori_loop(0, max_num_seqs.bit_length() + 1, search_step,
                               (jnp.int32(0), num_seqs))

  def seq_cond(carry):
    seq_idx, _, _ = carry
    q_start, _, _ = seq_info(seq_idx)
    return jnp.logical_and(seq_idx < num_seqs, q_start < q_blk_end)

  def seq_body(carry):
    # in_flight: block `blk_start` of this sequence is already being DMA'd
    # into slot buf_idx (prefetched during the previous sequence).
    seq_idx, buf_idx, in_flight = carry
    blk_start, blk_end, has_work = seq_plan(seq_idx)
    next_blk_start, _, next_has_work = seq_plan(seq_idx + 1)
    pl.when(has_work)(init_softmax_state)

    def kv_cond(kv_carry):
      kv_blk_idx, _, _ = kv_carry
      return jnp.logical_and(has_work, kv_blk_idx < blk_end)

    def kv_body(kv_carry):
      kv_blk_idx, buf_idx, in_flight = kv_carry

      @pl.when(in_flight == 0)
      def _():
        start_kv_block(seq_idx, kv_blk_idx, buf_idx)

      # Prefetch the next block (of this sequence, else the first block of the
      # next sequence if it has work in this grid step) into the other slot.
      # Its previous contents were consumed by the previous iteration.
      more_here = kv_blk_idx + 1 < blk_end
      has_next = jnp.logical_or(more_here, next_has_work)
      next_seq = jnp.where(more_here, seq_idx, seq_idx + 1)
      next_blk = jnp.where(more_here, kv_blk_idx + 1, next_blk_start)
      next_buf = 1 - buf_idx

      @pl.when(has_next)
      def _():
        start_kv_block(next_seq, next_blk, next_buf)

      wait_kv_block(seq_idx, kv_blk_idx, buf_idx)
      attend_kv_block(seq_idx, kv_blk_idx, buf_idx)
      return kv_blk_idx + 1, next_buf, has_next.astype(jnp.int32)

    _, buf_idx, in_flight = lax.while_loop(
        kv_cond, kv_body, (blk_start, buf_idx, in_flight))
    pl.when(has_work)(functools.partial(write_sequence_output, seq_idx))
    return seq_idx + 1, buf_idx, in_flight

  lax.while_loop(seq_cond, seq_body, (first_seq, jnp.int32(0), jnp.int32(0)))


def _q_index_map(heads_blk_idx, q_blk_idx, *_scalar_prefetch_refs):
  return (q_blk_idx, heads_blk_idx, 0)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "mask_value", "k_scale",
        "v_scale", "num_kv_pages_per_block", "num_queries_per_block",
        "vmem_limit_bytes"),
)
def _ragged_paged_attention_impl(queries, kv_pages, kv_lens, page_indices,
                                 cu_q_lens, num_seqs, *, sm_scale,
                                 sliding_window, soft_cap, mask_value, k_scale,
                                 v_scale, num_kv_pages_per_block,
                                 num_queries_per_block, vmem_limit_bytes):
  num_tokens, num_q_heads, head_dim = queries.shape
  _, page_size, num_combined_kv_heads, _ = kv_pages.shape
  num_kv_heads = num_combined_kv_heads // 2
  group = num_q_heads // num_kv_heads
  num_q_heads_per_blk, num_combined_kv_heads_per_blk = get_min_heads_per_blk(
      num_q_heads, num_combined_kv_heads, queries.dtype, kv_pages.dtype)
  num_kv_heads_per_blk = num_combined_kv_heads_per_blk // 2
  num_heads_blks = num_q_heads // num_q_heads_per_blk
  num_q_blks = cdiv(num_tokens, num_queries_per_block)

  q_block_spec = pl.BlockSpec(
      (num_queries_per_block, num_q_heads_per_blk, head_dim), _q_index_map)
  softmax_stat_scratch = pltpu.VMEM(
      # NUM_LANES wide (replicated) rather than 1: Mosaic has no unaligned
      # lane slices of scratch.
      (num_kv_heads_per_blk, num_queries_per_block * group, NUM_LANES),
      jnp.float32)
  scratch_shapes = [
      pltpu.VMEM((NUM_KV_BUFFERS, num_kv_pages_per_block, page_size,
                  num_combined_kv_heads_per_blk, head_dim), kv_pages.dtype),
      pltpu.SemaphoreType.DMA((NUM_KV_BUFFERS,)),
      softmax_stat_scratch,  # m
      softmax_stat_scratch,  # l
      pltpu.VMEM((num_kv_heads_per_blk, num_queries_per_block * group,
                  head_dim), jnp.float32),  # acc
  ]
  kernel = pl.pallas_call(
      functools.partial(
          _ragged_paged_attention_kernel,
          sm_scale=sm_scale,
          sliding_window=sliding_window,
          soft_cap=soft_cap,
          mask_value=mask_value,
          k_scale=k_scale,
          v_scale=v_scale,
      ),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=NUM_SCALAR_PREFETCH,
          in_specs=[q_block_spec, pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=q_block_spec,
          grid=(num_heads_blks, num_q_blks),
          scratch_shapes=scratch_shapes,
      ),
      compiler_params=pltpu.CompilerParams(
          # Grid steps share no state (every DMA is waited in the step that
          # started it), so both axes may be split across cores.
          dimension_semantics=("parallel", "parallel"),
          vmem_limit_bytes=vmem_limit_bytes,
      ),
      out_shape=jax.ShapeDtypeStruct(queries.shape, queries.dtype),
      name="ragged_paged_attention_kernel",
  )
  return kernel(kv_lens, page_indices, cu_q_lens, num_seqs, queries, kv_pages)


def ragged_paged_attention(
    queries,  # [max_num_batched_tokens, num_q_heads, head_dim]
    kv_pages,  # [total_num_pages, page_size, num_combined_kv_heads, head_dim]
    kv_lens,  # i32[max_num_seqs]
    page_indices,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens,  # i32[max_num_seqs + 1]
    num_seqs,  # i32[1]
    *,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    mask_value: float | None = DEFAULT_MASK_VALUE,
    k_scale: float | None = None,
    v_scale: float | None = None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
):
  """Ragged paged attention over mixed prefill / decode sequences.

  Args:
    queries: all sequences' query tokens, concatenated (padding allowed after
      cu_q_lens[num_seqs]).
    kv_pages: the paged K/V cache, K and V interleaved on axis 2.
    kv_lens: per-sequence kv length; entries past num_seqs are padding.
    page_indices: per-sequence page table; only slots below
      cdiv(kv_len, page_size) are read.
    cu_q_lens: cumulative query lengths; entries past num_seqs + 1 are padding.
    num_seqs: i32[1], the number of real sequences.
    sm_scale: multiplies q.k before the soft cap.
    sliding_window: a query sees keys j with q_pos - j < sliding_window.
    soft_cap: logits become soft_cap * tanh(logits / soft_cap).
    mask_value: logit of masked entries (None: DEFAULT_MASK_VALUE); must be
      low enough that exp(mask_value - row max) underflows to 0 in float32
      (see the module docstring), else the result depends on the block sizes.
    k_scale, v_scale: dequantization scales of K and V.
    num_kv_pages_per_block: pages per K/V block (None: default rule).
    num_queries_per_block: query tokens per grid step (None: default rule).
    vmem_limit_bytes: Mosaic scoped VMEM limit.

  Returns:
    [max_num_batched_tokens, num_q_heads, head_dim] in queries.dtype; rows that
    belong to no sequence are zeros.
  """
  options = dict(sm_scale=sm_scale, sliding_window=sliding_window,
                 soft_cap=soft_cap, mask_value=mask_value, k_scale=k_scale,
                 v_scale=v_scale,
                 num_kv_pages_per_block=num_kv_pages_per_block,
                 num_queries_per_block=num_queries_per_block,
                 vmem_limit_bytes=vmem_limit_bytes)
  static_validate_inputs(queries, kv_pages, kv_lens, page_indices, cu_q_lens,
                         num_seqs, **options)
  # None means "not checked" in static_validate_inputs; here a scale is needed.
  _check_float_option("sm_scale", sm_scale, allow_none=False)
  if all(_is_concrete(x) for x in (kv_lens, page_indices, cu_q_lens, num_seqs)):
    dynamic_validate_inputs(queries, kv_pages, kv_lens, page_indices,
                            cu_q_lens, num_seqs, **options)
  default_kv_pages, default_queries = get_default_block_sizes(
      kv_pages.shape[1], page_indices.shape[1], queries.shape[0])
  if num_kv_pages_per_block is None:
    num_kv_pages_per_block = default_kv_pages
  if num_queries_per_block is None:
    num_queries_per_block = default_queries

  def as_float(x):
    return None if x is None else float(x)

  return _ragged_paged_attention_impl(
      queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
      sm_scale=float(sm_scale),
      sliding_window=None if sliding_window is None else int(sliding_window),
      soft_cap=as_float(soft_cap),
      mask_value=(DEFAULT_MASK_VALUE if mask_value is None
                  else float(mask_value)),
      k_scale=as_float(k_scale),
      v_scale=as_float(v_scale),
      num_kv_pages_per_block=int(num_kv_pages_per_block),
      num_queries_per_block=int(num_queries_per_block),
      vmem_limit_bytes=vmem_limit_bytes,
  )
