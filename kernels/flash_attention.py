"""Pallas TPU flash attention (forward + backward) for jax 0.12.

Layout is ``[batch, heads, seq, head_dim]`` throughout; ``q_len`` may differ
from ``kv_len``.

Semantics
=========
``logits = (q @ k^T + ab) * sm_scale`` (the bias is added *before* scaling),
then a masked softmax over the key axis, then ``@ v``.

Positions are *global* token positions: a query at row ``i`` of this call has
position ``q_offset + i`` and a key at column ``j`` has position
``kv_offset + j``.  The public :func:`flash_attention` uses offsets 0; the ring
building blocks (``flash_attention_*_step``) take them as (possibly traced)
int32 scalars.

Two kinds of mask, with deliberately different conventions:

* **Segment mask** (``segment_ids``): a key whose segment id differs from the
  query's gets the logit ``DEFAULT_MASK_VALUE`` (a large *finite* negative
  number).  A row that has at least one admissible key is unaffected (the
  masked keys get weight ``exp(MASK - max) == 0`` exactly in float32).
* **Causal mask** (``causal=True``): key ``kv_offset + j`` is visible to query
  ``q_offset + i`` iff ``kv_offset + j <= q_offset + i`` (top-left aligned in
  global positions).  An invisible key gets probability *exactly 0*: it takes
  no part in the row max, the normaliser or the output.  This is what makes the
  result independent of block sizes and of causal block skipping (below).

Fully masked rows (the convention, exactly)
-------------------------------------------
Let ``V(i)`` be the keys causally visible to query ``i`` (all keys of the call,
or of all ring chunks, when ``causal=False``).

* If some key in ``V(i)`` has the query's segment id: ordinary softmax over
  those keys.
* If ``V(i)`` is non-empty but none of its keys shares the query's segment id
  (e.g. a query whose segment id is absent from kv): every key in ``V(i)`` has
  the same logit ``DEFAULT_MASK_VALUE``, so the output row is the **unweighted
  mean of v over V(i)**, i.e. over all keys when non-causal and over keys
  ``kv_offset + j <= q_offset + i`` when causal.  Its gradient is that of an
  *additive* mask, ``softmax(logits + where(seg_eq, 0, MASK))``: the mask
  value swamps the logits' values but not their derivative (jax's bundled
  kernel, which adds the mask, gives the same non-causally).  With
  ``p_ij = 1/|V(i)|`` on ``V(i)``, ``dp_ij = do_i . v_j`` and
  ``ds_ij = p_ij (dp_ij - sum_k p_ik dp_ik)`` (the gradient of the scaled
  logits): ``dv_j += p_ij do_i``, ``dq_i = sm_scale sum_j ds_ij k_j``,
  ``dk_j += sm_scale ds_ij q_i`` and ``d_ab_ij = sm_scale ds_ij``, all
  non-zero in general.  (Autodiff of ``softmax(where(seg_eq, logits, MASK))``
  would give zero dq/dk/d_ab for such rows instead; this kernel does not.)
* If ``V(i)`` is empty (only possible with ``causal=True`` and
  ``kv_offset > q_offset + i``, so only in the ring building blocks, e.g. a
  ring chunk entirely in the future: the public API has offsets 0, and key 0
  is visible to every query): the row contributes nothing.  A ring step
  leaves its ``l`` unchanged and its ``o`` unchanged up to one rounding
  (``o`` is rescaled by ``l`` and back); ``m`` may move from ``-inf`` to the
  floor ``DEFAULT_MASK_VALUE``, which is equivalent.  A row that saw no key in
  any chunk finalizes to **0**, and the backward steps give it zero dq and no
  dk/dv/d_ab contribution.
* Causal block skipping never changes any of the above: a skipped block holds
  only invisible keys, whose weight is exactly 0 anyway.  (The seeds instead
  *added* the mask value for causally masked keys, so a fully masked row came
  out as the mean of v over whichever keys happened to lie in non-skipped
  blocks -- a block-size-dependent answer, and one that differed between the
  forward blocks and the backward blocks.)
* ``ab`` only counts where the key is in ``V(i)`` *and* shares the query's
  segment: elsewhere the mask replaces the logit (or a causally skipped block
  is never read), so any value there, ``-inf``, ``+inf`` or NaN, is ignored
  (in particular a query whose segment is absent averages over ``V(i)`` even
  where ``ab`` is ``-inf``).  Where it counts, an entry equal to ``-inf`` gets
  weight exactly 0 and d_ab 0 (the running max is floored at
  ``DEFAULT_MASK_VALUE``, so no ``-inf - -inf`` NaN).  A row whose
  same-segment keys in ``V(i)`` are all ``-inf`` comes out as 0 with zero
  gradient when ``V(i)`` holds no key of another segment, and otherwise as the
  unweighted mean of v over the other-segment keys of ``V(i)`` (their logit
  ``DEFAULT_MASK_VALUE`` beats ``-inf``), with the additive-mask gradient
  above.  ``+inf`` or NaN where it counts makes that row NaN (out, dq, d_ab)
  and, through the sums over rows, all of dk and dv.

Carry (ring attention building blocks)
======================================
``carry = (o, l, m)``:

* ``o``: ``[B, H, Q, D]`` float32, the *normalised* attention output over all kv
  chunks folded so far (``sum_j p_j v_j / l``), 0 for rows that saw no key.
* ``l``: ``[B, H, Q, MIN_BLOCK_SIZE]`` float32, ``sum_j exp(s_j - m)`` over the
  keys folded so far (replicated across the last, lane, axis).
* ``m``: ``[B, H, Q, MIN_BLOCK_SIZE]`` float32, running row max of the masked
  logits, ``-inf`` before any key was seen (replicated across lanes).

``flash_attention_init_carry(q)`` gives ``(0, 0, -inf)``;
``flash_attention_fwd_step`` folds one kv chunk in (order does not matter);
``flash_attention_finalize(carry, dtype)`` casts ``o``.  For the backward,
``l``/``m`` are the *final* carry statistics and ``di = sum(o * do, -1)`` uses the
*final* output; the bwd step functions accept ``l``, ``m``, ``di`` as
``[B, H, Q]`` or ``[B, H, Q, MIN_BLOCK_SIZE]``.

Supported shapes (checked up front, ``ValueError`` naming what is wrong)
========================================================================
* q/k/v rank 4, same batch/heads, k and v same length, q/k/v same head_dim and
  same dtype (float32 or bfloat16).
* head_dim: a multiple of 128, or exactly 64.  ``jax.export(...,
  platforms=["tpu"])`` (the Pallas -> Mosaic lowering) accepts every head_dim
  <= 128 and every multiple of 128, but it does not run Mosaic's layout passes,
  so it cannot vouch for sub-128 tiles; 64 is the one sub-lane-tile size known
  to compile (the bundled jax kernel's ``l[:, :head_dim]`` path, used in
  production with head_dim 64).  Other sizes: pad head_dim to 128.
* ``ab``: exactly ``[B, H, Q, K]``, any float dtype.  To use a bias that is
  shared across batch/heads/rows, pass ``jnp.broadcast_to(bias, (B, H, Q, K))``:
  JAX then sums ``d_ab`` back to the small shape for you.
* ``segment_ids``: ``SegmentIds(q=[B, Q], kv=[B, K])``, integer dtype.
* q-side blocks (``block_q``, ``block_q_major_dkv``, ``block_q_dkv``,
  ``block_q_dq``): multiples of NUM_SUBLANES (8) that divide ``q_len``.
* kv-side blocks (``block_k_major``, ``block_k``, ``block_k_major_dkv``,
  ``block_k_dkv``, ``block_k_major_dq``, ``block_k_dq``): multiples of
  NUM_LANES (128) that divide ``kv_len``; each minor block divides its major.
* ``block_b`` divides the batch (forward only; the backward uses 1).

Gradients: dq, dk, dv, and d_ab (computed in the dq kernel, which already holds
``ds = d logits``; ``d_ab = ds`` because the bias is added before scaling and
``ds`` already includes ``sm_scale``).  They come back in the input dtypes.
No gradient flows to ``segment_ids`` or to the offsets.  Higher-order AD is not
supported.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = [
    "BlockSizes",
    "DEFAULT_MASK_VALUE",
    "DEFAULT_VMEM_LIMIT_BYTES",
    "MIN_BLOCK_SIZE",
    "NUM_LANES",
    "NUM_SUBLANES",
    "SegmentIds",
    "flash_attention",
    "flash_attention_bwd_dkv_step",
    "flash_attention_bwd_dq_step",
    "flash_attention_finalize",
    "flash_attention_fwd_step",
    "flash_attention_init_carry",
]

# -0.7 * float32 max rather than -inf or -max: finite, so exp(MASK - MASK) == 1
# (a fully masked row stays a well-defined mean instead of NaN), and with
# headroom, so that subtracting a real logit from it cannot overflow to -inf.
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# TPU vreg tile is [8 sublanes, 128 lanes]: the last (lane) dim of every VMEM
# tile wants multiples of 128 and the second-to-last multiples of 8.
NUM_LANES = 128
NUM_SUBLANES = 8
# Row statistics (l, m, di) are stored replicated across one full lane tile so
# that loads/stores are lane-dense and broadcasting to [block_q, block_k] is a
# whole-vreg tile instead of a cross-lane broadcast.
MIN_BLOCK_SIZE = NUM_LANES
# Head dims below one lane tile that we accept (see the module docstring for
# why only 64); larger head dims must be multiples of NUM_LANES.
SUPPORTED_SMALL_HEAD_DIMS = (64,)
# 32 MiB: twice the 16 MiB default scoped-VMEM limit Mosaic uses on v5e/v5p (so
# 512-sized blocks with f32 accumulators, [512, 512] f32 temporaries and a
# double-buffered ab tile fit), and at most half of the physical VMEM of every
# current generation (v5e/v6e 128 MiB, v5p/v7 64 MiB, per
# pltpu.get_tpu_info_for_chip).  v4 and older have only 16 MiB physical VMEM:
# there pass vmem_limit_bytes <= 16 MiB (and blocks of 128-256).
DEFAULT_VMEM_LIMIT_BYTES = 32 * 1024 * 1024

# dot_general dimension numbers for  x @ y^T  (contract the last dims).
TRANS_B_DIM_NUMBERS = (((1,), (1,)), ((), ()))


class SegmentIds(NamedTuple):
    """Segment ids for packed sequences: only equal ids attend to each other.

    Attributes:
      q: ``[batch, q_len]`` integer segment id of every query.
      kv: ``[batch, kv_len]`` integer segment id of every key.
    """

    q: jax.Array
    kv: jax.Array


_Q_SIDE_FIELDS = ("block_q", "block_q_major_dkv", "block_q_dkv", "block_q_dq")
_KV_SIDE_FIELDS = (
    "block_k_major",
    "block_k",
    "block_k_major_dkv",
    "block_k_dkv",
    "block_k_major_dq",
    "block_k_dq",
)
# (major, minor) pairs: the kernel loops over minor sub-blocks of a major tile.
_MAJOR_MINOR_PAIRS = (
    ("block_k_major", "block_k"),
    ("block_q_major_dkv", "block_q_dkv"),
    ("block_k_major_dkv", "block_k_dkv"),
    ("block_k_major_dq", "block_k_dq"),
)
# Backward fields default to the forward block they mirror.
_BWD_DEFAULT_SOURCE = {
    "block_q_major_dkv": "block_q",
    "block_k_major_dkv": "block_k_major",
    "block_k_dkv": "block_k",
    "block_q_dkv": "block_q",
    "block_k_major_dq": "block_k_major",
    "block_k_dq": "block_k",
    "block_q_dq": "block_q",
}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels (numerics-neutral, performance-critical).

    Forward: a ``[block_b, block_q]`` query tile meets ``block_k_major`` keys per
    grid step, processed in sub-blocks of ``block_k``.
    dkv kernel: a ``block_k_major_dkv`` key tile (sub-blocks ``block_k_dkv``)
    meets ``block_q_major_dkv`` queries per grid step (sub-blocks
    ``block_q_dkv``).  dq kernel: a ``block_q_dq`` query tile meets
    ``block_k_major_dq`` keys per grid step (sub-blocks ``block_k_dq``).

    Backward fields left as ``None`` copy the forward block they mirror
    (``block_q`` / ``block_k_major`` / ``block_k``).  The constructor checks
    what does not depend on the sequence lengths (positive ints, minor divides
    major, lane/sublane multiples); divisibility of the lengths is checked when
    the kernels are called.
    """

    block_q: int
    block_k_major: int
    block_k: int
    block_b: int = 1
    block_q_major_dkv: int | None = None
    block_k_major_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dkv: int | None = None
    block_k_major_dq: int | None = None
    block_k_dq: int | None = None
    block_q_dq: int | None = None

    def __post_init__(self):
        for name, source in _BWD_DEFAULT_SOURCE.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, source))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"BlockSizes.{f.name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"BlockSizes.{f.name} must be positive, got {value}")
            object.__setattr__(self, f.name, int(value))
        for name in _Q_SIDE_FIELDS:
            value = getattr(self, name)
            if value % NUM_SUBLANES:
                raise ValueError(
                    f"BlockSizes.{name}={value} must be a multiple of "
                    f"NUM_SUBLANES={NUM_SUBLANES} (q-side blocks are the sublane "
                    "dim of the [block_q, *] tiles)")
        for name in _KV_SIDE_FIELDS:
            value = getattr(self, name)
            if value % NUM_LANES:
                raise ValueError(
                    f"BlockSizes.{name}={value} must be a multiple of "
                    f"NUM_LANES={NUM_LANES} (kv-side blocks are the lane dim of the "
                    "[block_q, block_k] logits tile)")
        for major, minor in _MAJOR_MINOR_PAIRS:
            a, b = getattr(self, major), getattr(self, minor)
            if a % b:
                raise ValueError(
                    f"BlockSizes.{minor}={b} must divide BlockSizes.{major}={a} "
                    f"({a} % {b} = {a % b})")

    @classmethod
    def get_default(cls, batch_size: int | None = None, num_heads: int | None = None,
                    q_seq_len: int | None = None, kv_seq_len: int | None = None,
                    head_dim: int | None = None) -> "BlockSizes":
        """Default block sizes.

        Without arguments: 128 everywhere (block_b=1), valid whenever q_len and
        kv_len are multiples of 128.  Given the sequence lengths: a length of at
        most 512 is covered by one block (so kv_len <= 512 takes the single-step
        forward path), longer ones use the largest of 512/256/128 (q side also
        64..8) that divides them.  Blocks stay <= 512 so that the f32
        [block_q, block_k] temporaries (1 MiB each) fit comfortably in
        DEFAULT_VMEM_LIMIT_BYTES.
        """
        del batch_size, num_heads, head_dim  # Unused by the heuristic.
        block_q = _default_block(q_seq_len, NUM_SUBLANES, (512, 256, 128, 64, 32, 16, 8))
        block_k = _default_block(kv_seq_len, NUM_LANES, (512, 256, 128))
        return cls(block_q=block_q, block_k_major=block_k, block_k=block_k, block_b=1)


def _default_block(length: int | None, multiple: int, candidates: tuple[int, ...]) -> int:
    if length is None:
        return 128
    if 0 < length <= candidates[0] and length % multiple == 0:
        return length
    for c in candidates:
        if length % c == 0:
            return c
    # Nothing fits; return 128 and let the shape validation explain why.
    return 128


# ----------------------------------------------------------------------------
# Validation (all of it runs before any pallas_call is built).
# ----------------------------------------------------------------------------


def _check_head_dim(head_dim: int) -> None:
    if head_dim % NUM_LANES and head_dim not in SUPPORTED_SMALL_HEAD_DIMS:
        raise ValueError(
            f"head_dim={head_dim} is not supported: it must be a multiple of "
            f"NUM_LANES={NUM_LANES} or one of {SUPPORTED_SMALL_HEAD_DIMS} (pad it)")


def _validate_qkv(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, heads, seq, head_dim], got shape "
                f"{getattr(x, 'shape', None)}")
    (b, h, _, d), (bk, hk, lk, dk), (bv, hv, lv, dv) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise ValueError(f"batch mismatch: q {b}, k {bk}, v {bv}")
    if not h == hk == hv:
        raise ValueError(f"num_heads mismatch: q {h}, k {hk}, v {hv}")
    if lk != lv:
        raise ValueError(f"kv_len mismatch: k {lk}, v {lv}")
    if not d == dk == dv:
        raise ValueError(f"head_dim mismatch: q {d}, k {dk}, v {dv}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q/k/v dtype must be float32 or bfloat16, got {q.dtype}")
    _check_head_dim(d)


def _validate_ab_and_segments(ab, segment_ids, batch, heads, q_len, kv_len) -> None:
    if ab is not None:
        expected = (batch, heads, q_len, kv_len)
        if getattr(ab, "shape", None) != expected:
            raise ValueError(
                f"ab must have shape [batch, heads, q_len, kv_len] = {expected}, got "
                f"{getattr(ab, 'shape', None)} (broadcast a smaller bias with "
                "jnp.broadcast_to first)")
        if not jnp.issubdtype(ab.dtype, jnp.floating):
            raise ValueError(f"ab must have a floating dtype, got {ab.dtype}")
    if segment_ids is not None:
        if not isinstance(segment_ids, SegmentIds):
            raise ValueError(
                f"segment_ids must be a SegmentIds(q, kv), got {type(segment_ids)}")
        for name, ids, expected in (("q", segment_ids.q, (batch, q_len)),
                                    ("kv", segment_ids.kv, (batch, kv_len))):
            if getattr(ids, "shape", None) != expected:
                raise ValueError(
                    f"segment_ids.{name} must have shape {expected}, got "
                    f"{getattr(ids, 'shape', None)}")
            if not jnp.issubdtype(ids.dtype, jnp.integer):
                raise ValueError(
                    f"segment_ids.{name} must have an integer dtype, got {ids.dtype}")


def _check_block_divides(name: str, block: int, dim_name: str, dim: int) -> None:
    if block > dim or dim % block:
        raise ValueError(
            f"BlockSizes.{name}={block} must divide {dim_name}={dim} "
            f"({dim} % {block} = {dim % block})")


def _validate_block_sizes(block_sizes, batch, q_len, kv_len, *, fwd: bool,
                          dkv: bool, dq: bool) -> None:
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes)}")
    if q_len % NUM_SUBLANES:
        raise ValueError(
            f"q_len={q_len} must be a multiple of NUM_SUBLANES={NUM_SUBLANES}")
    if kv_len % NUM_LANES:
        raise ValueError(f"kv_len={kv_len} must be a multiple of NUM_LANES={NUM_LANES}")
    names = []
    if fwd:
        names += ["block_q", "block_k_major", "block_k"]
        _check_block_divides("block_b", block_sizes.block_b, "batch", batch)
    if dkv:
        names += ["block_q_major_dkv", "block_q_dkv", "block_k_major_dkv", "block_k_dkv"]
    if dq:
        names += ["block_q_dq", "block_k_major_dq", "block_k_dq"]
    for name in names:
        if name in _Q_SIDE_FIELDS:
            _check_block_divides(name, getattr(block_sizes, name), "q_len", q_len)
        else:
            _check_block_divides(name, getattr(block_sizes, name), "kv_len", kv_len)


def _static_scale(sm_scale) -> float:
    try:
        return float(sm_scale)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
        # ValueError: float("abc"), whose own message would not name the argument.
        raise TypeError(
            f"sm_scale must be a static Python number, got {sm_scale!r}") from e


def _prepare_offset(offset, name: str) -> jax.Array:
    """A python int or (traced) integer scalar -> int32[1] for scalar prefetch."""
    x = jnp.asarray(offset)
    if x.shape not in ((), (1,)):
        raise ValueError(f"{name} must be a scalar, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer, got dtype {x.dtype}")
    return x.astype(jnp.int32).reshape((1,))


def _resolve_block_sizes(block_sizes, q, k):
    if block_sizes is None:
        b, h, q_len, d = q.shape
        return BlockSizes.get_default(b, h, q_len, k.shape[2], d)
    return block_sizes


def _row_stat(x, name: str, shape) -> jax.Array:
    """l/m/di as [B, H, Q] or [B, H, Q, MIN_BLOCK_SIZE] -> f32 [..., MIN_BLOCK_SIZE]."""
    full = (*shape, MIN_BLOCK_SIZE)
    if x.shape == tuple(shape):
        x = x[..., None]
    elif x.shape != full:
        raise ValueError(f"{name} must have shape {tuple(shape)} or {full}, got {x.shape}")
    return jnp.broadcast_to(x.astype(jnp.float32), full)


# ----------------------------------------------------------------------------
# Causal visibility and block skipping (all in global token positions).
# ----------------------------------------------------------------------------


def _block_has_visible(q_start, q_block, kv_start):
    """True iff the first key of a kv block is visible to the last query of a q block.

    ``q_start``/``kv_start`` are the global positions of the first query/key.
    The bottom-left corner is the most visible element of a block, so the block
    holds at least one visible (key <= query) pair iff this holds.  (The seeds
    used ``>`` here, which drops a block whose only visible element is that
    corner -- reachable once offsets are arbitrary token positions.)
    """
    return kv_start <= q_start + q_block - 1


def _last_visible_kv_block(q_start, q_block, kv_offset, kv_block):
    """Index of the last kv block holding a key visible to a q block, floored at 0."""
    return lax.div(jnp.maximum(q_start + q_block - 1 - kv_offset, 0), kv_block)


def _first_visible_q_block(kv_start, q_offset, q_block):
    """Index of the first q block holding a query that sees key ``kv_start``."""
    return lax.div(jnp.maximum(kv_start - q_offset, 0), q_block)


def _fwd_kv_block_index(q_idx, kv_idx, q_off_ref, kv_off_ref, *, causal, block_q,
                        block_kv):
    """kv block to fetch at grid step (q_idx, kv_idx).

    A causally skipped step re-requests the last block that was actually used,
    so the pipeline sees an unchanged block index and issues no DMA.
    """
    if not causal:
        return kv_idx
    q_start = q_off_ref[0] + q_idx * block_q
    last = _last_visible_kv_block(q_start, block_q, kv_off_ref[0], block_kv)
    return jnp.minimum(kv_idx, last)


def _dkv_q_block_index(kv_idx, q_idx, q_off_ref, kv_off_ref, *, causal, block_q,
                       block_kv, num_q_blocks):
    """q block to fetch at dkv grid step (kv_idx, q_idx): skipped steps (the
    leading ones) prefetch the first q block that will actually be used."""
    if not causal:
        return q_idx
    kv_start = kv_off_ref[0] + kv_idx * block_kv
    first = _first_visible_q_block(kv_start, q_off_ref[0], block_q)
    return jnp.minimum(jnp.maximum(q_idx, first), num_q_blocks - 1)


# ----------------------------------------------------------------------------
# In-kernel math shared by the three kernels.
# ----------------------------------------------------------------------------


def _lanes_to(x, width: int):
    """Lane-replicated [rows, MIN_BLOCK_SIZE] -> [rows, width]."""
    if width == MIN_BLOCK_SIZE:
        return x
    if width % MIN_BLOCK_SIZE == 0:
        return jnp.tile(x, (1, width // MIN_BLOCK_SIZE))
    if width < MIN_BLOCK_SIZE:
        return x[:, :width]
    raise NotImplementedError(f"width={width}")  # Excluded by validation.


def _masked_logits(q, k, ab, q_seg, kv_seg, *, q_start, kv_start, causal, sm_scale,
                   mask_value):
    """Masked logits [bq, bk] (f32) and the causal visibility mask (or None).

    q_seg: [bq, NUM_LANES] lane-replicated query ids; kv_seg: [1, bk] key ids.
    """
    s = lax.dot_general(q, k, TRANS_B_DIM_NUMBERS, preferred_element_type=jnp.float32)
    if ab is not None:
        s = s + ab.astype(jnp.float32)
    if sm_scale != 1.0:
        s = s * sm_scale
    if ab is not None and sm_scale <= 0.0:
        # A -inf entry of ab hides its key whatever the scale's sign: times a negative
        # scale it would be the largest logit, times 0 a NaN.
        s = jnp.where(ab == -jnp.inf, -jnp.inf, s)
    if q_seg is not None:
        q_ids = jnp.tile(q_seg, (1, s.shape[1] // NUM_LANES))
        s = jnp.where(q_ids == kv_seg, s, mask_value)
    visible = None
    if causal:
        rows = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = kv_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        visible = cols <= rows
        # Also masked for the max, so that logits of invisible keys can never
        # dominate (and underflow) the visible ones.
        s = jnp.where(visible, s, mask_value)
    return s, visible


def _probs(s, visible, m, inv_l):
    """Normalised probabilities from the saved row statistics (backward)."""
    width = s.shape[1]
    p = jnp.exp(s - _lanes_to(m, width)) * _lanes_to(inv_l, width)
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    return p


def _safe_inv(l):
    # l == 0 only for rows that saw no visible key; their accumulators are 0.
    return jnp.where(l == 0.0, 1.0, 1.0 / l)


# ----------------------------------------------------------------------------
# Forward kernel.
# ----------------------------------------------------------------------------


def _fwd_kernel(q_off_ref, kv_off_ref,  # scalar prefetch (SMEM), int32[1]
                q_ref, k_ref, v_ref, o_in_ref, l_in_ref, m_in_ref, ab_ref,
                q_seg_ref, kv_seg_ref,  # inputs
                o_ref, l_ref, m_ref,  # outputs
                *scratch, causal, sm_scale, block_k, mask_value):
    """One grid step (b, h, q block, kv major block) of the forward.

    With ``scratch == ()`` (single-step path: one block covers kv) the online
    softmax state lives in values; otherwise it lives in VMEM scratch
    ``(m, l, acc)`` that persists across the kv ("arbitrary") grid axis.
    ``acc`` holds the *unnormalised* accumulator; the output is divided by
    ``l`` once, at the last kv step.
    """
    block_b, _, block_q, head_dim = q_ref.shape
    block_k_major = k_ref.shape[2]
    num_sub = block_k_major // block_k
    q_idx, kv_idx = pl.program_id(2), pl.program_id(3)
    num_kv = pl.num_programs(3)
    q_start = q_off_ref[0] + q_idx * block_q
    kv_start = kv_off_ref[0] + kv_idx * block_k_major
    has_carry = o_in_ref is not None

    def sub_block_visible(i):
        return _block_has_visible(q_start, block_q, kv_start + i * block_k)

    def logits(b, i):
        ks = pl.ds(i * block_k, block_k)
        return _masked_logits(
            q_ref[b, 0], k_ref[b, 0, ks, :],
            None if ab_ref is None else ab_ref[b, 0, :, ks],
            None if q_seg_ref is None else q_seg_ref[b],
            None if kv_seg_ref is None else kv_seg_ref[b, :1, ks],
            q_start=q_start, kv_start=kv_start + i * block_k, causal=causal,
            sm_scale=sm_scale, mask_value=mask_value)

    def update(state, b, i):
        """Fold sub-block i into the online-softmax state (m, l, acc)."""
        s, visible = logits(b, i)
        v = v_ref[b, 0, pl.ds(i * block_k, block_k), :]
        m_prev, l_prev, acc_prev = state
        m_curr = jnp.max(s, axis=1, keepdims=True)  # [bq, 1]
        # Floor at mask_value: m never stays -inf, so alpha and p are never
        # exp(-inf - -inf) = NaN (even with -inf entries in ab).
        m_next = jnp.maximum(jnp.maximum(m_prev, m_curr), mask_value)  # [bq, 128]
        p = jnp.exp(s - _lanes_to(m_next, block_k))
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)  # [bq, 128]; 0 when m_prev == -inf
        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_next = _lanes_to(alpha, head_dim) * acc_prev + pv
        return m_next, l_next, acc_next

    def initial_state(b):
        if has_carry:
            l0 = l_in_ref[b, 0]
            return m_in_ref[b, 0], l0, o_in_ref[b, 0] * _lanes_to(l0, head_dim)
        return (jnp.full((block_q, MIN_BLOCK_SIZE), -jnp.inf, jnp.float32),
                jnp.zeros((block_q, MIN_BLOCK_SIZE), jnp.float32),
                jnp.zeros((block_q, head_dim), jnp.float32))

    def write_outputs(b, state):
        m, l, acc = state
        o_ref[b, 0] = (acc * _lanes_to(_safe_inv(l), head_dim)).astype(o_ref.dtype)
        if l_ref is not None:
            l_ref[b, 0] = l
            m_ref[b, 0] = m

    if not scratch:
        # Single-step path: one grid step and one sub-block cover all of kv.
        assert num_sub == 1
        for b in range(block_b):
            def compute(b=b):
                write_outputs(b, update(initial_state(b), b, 0))

            if causal:
                visible = sub_block_visible(0)
                pl.when(visible)(compute)
                pl.when(jnp.logical_not(visible))(
                    lambda b=b: write_outputs(b, initial_state(b)))
            else:
                compute()
        return

    m_scr, l_scr, acc_scr = scratch
    for b in range(block_b):
        @pl.when(kv_idx == 0)
        def _init(b=b):
            m0, l0, acc0 = initial_state(b)
            m_scr[b], l_scr[b], acc_scr[b] = m0, l0, acc0

        for i in range(num_sub):
            def step(b=b, i=i):
                state = (m_scr[b], l_scr[b], acc_scr[b])
                m_scr[b], l_scr[b], acc_scr[b] = update(state, b, i)

            if causal:
                pl.when(sub_block_visible(i))(step)
            else:
                step()

        @pl.when(kv_idx == num_kv - 1)
        def _finish(b=b):
            write_outputs(b, (m_scr[b], l_scr[b], acc_scr[b]))


def _fwd_cost(b, h, q_len, kv_len, d, causal, in_arrays, out_shapes):
    flops = 4 * b * h * q_len * kv_len * d  # q@k^T and p@v
    transcendentals = b * h * q_len * kv_len
    if causal:
        flops, transcendentals = flops // 2, transcendentals // 2
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves((in_arrays, out_shapes)))
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals,
                           bytes_accessed=nbytes)


def _segment_id_tiles(segment_ids, batch, q_len, kv_len):
    """Lane-replicated q ids [B, Q, NUM_LANES] and sublane-replicated kv ids
    [B, NUM_SUBLANES, K], so both kernel tiles are (8, 128)-aligned."""
    if segment_ids is None:
        return None, None
    q_ids = lax.broadcast_in_dim(segment_ids.q.astype(jnp.int32),
                                 (batch, q_len, NUM_LANES), (0, 1))
    kv_ids = lax.broadcast_in_dim(segment_ids.kv.astype(jnp.int32),
                                  (batch, NUM_SUBLANES, kv_len), (0, 2))
    return q_ids, kv_ids


def _output_struct(shape, dtype, inputs, offsets):
    """A pallas_call output type that varies over every manual mesh axis any input does.

    Inside ``jax.shard_map`` with ``check_vma=True`` (the default) an output's type must
    say which mesh axes it varies over, and ``pallas_call`` inserts no ``pvary`` itself:
    a ring step's output varies wherever its q/k/v chunks or its offsets do.
    """
    varying = frozenset()
    for x in jax.tree.leaves((inputs, offsets)):
        varying |= frozenset(jax.typeof(x).mat.varying)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _fwd_call(q, k, v, ab, segment_ids, carry, q_offset, kv_offset, *, causal,
              sm_scale, block_sizes, vmem_limit_bytes, out_dtype, save_stats):
    """Shared forward: returns (o, l, m); l/m are None unless save_stats."""
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    block_b, block_q = block_sizes.block_b, block_sizes.block_q
    block_k_major, block_k = block_sizes.block_k_major, block_sizes.block_k
    num_q, num_kv = q_len // block_q, kv_len // block_k_major
    single_step = block_k == kv_len  # implies block_k_major == kv_len
    grid = (batch // block_b, heads, num_q, num_kv)

    def q_map(b, h, qi, ki, q_off, kv_off):
        return (b, h, qi, 0)

    def kv_map(b, h, qi, ki, q_off, kv_off):
        return (b, h, _fwd_kv_block_index(qi, ki, q_off, kv_off, causal=causal,
                                          block_q=block_q, block_kv=block_k_major), 0)

    def ab_map(b, h, qi, ki, q_off, kv_off):
        return (b, h, qi, _fwd_kv_block_index(qi, ki, q_off, kv_off, causal=causal,
                                              block_q=block_q, block_kv=block_k_major))

    def q_seg_map(b, h, qi, ki, q_off, kv_off):
        return (b, qi, 0)

    def kv_seg_map(b, h, qi, ki, q_off, kv_off):
        return (b, 0, _fwd_kv_block_index(qi, ki, q_off, kv_off, causal=causal,
                                          block_q=block_q, block_kv=block_k_major))

    q_spec = pl.BlockSpec((block_b, 1, block_q, head_dim), q_map)
    kv_spec = pl.BlockSpec((block_b, 1, block_k_major, head_dim), kv_map)
    stat_spec = pl.BlockSpec((block_b, 1, block_q, MIN_BLOCK_SIZE), q_map)

    o_in = l_in = m_in = None
    if carry is not None:
        o_in, l_in, m_in = carry
    q_ids, kv_ids = _segment_id_tiles(segment_ids, batch, q_len, kv_len)
    in_specs = [
        q_spec, kv_spec, kv_spec,
        None if o_in is None else q_spec,
        None if l_in is None else stat_spec,
        None if m_in is None else stat_spec,
        None if ab is None else pl.BlockSpec((block_b, 1, block_q, block_k_major), ab_map),
        None if q_ids is None else pl.BlockSpec((block_b, block_q, NUM_LANES), q_seg_map),
        None if kv_ids is None else pl.BlockSpec(
            (block_b, NUM_SUBLANES, block_k_major), kv_seg_map),
    ]
    inputs = [q, k, v, o_in, l_in, m_in, ab, q_ids, kv_ids]

    offsets = (q_offset, kv_offset)
    stat_shape = _output_struct((batch, heads, q_len, MIN_BLOCK_SIZE), jnp.float32, inputs, offsets)
    out_shape = [_output_struct(q.shape, out_dtype, inputs, offsets),
                 stat_shape if save_stats else None,
                 stat_shape if save_stats else None]
    out_specs = [q_spec, stat_spec if save_stats else None,
                 stat_spec if save_stats else None]

    scratch_shapes = []
    if not single_step:
        scratch_shapes = [
            pltpu.VMEM((block_b, block_q, MIN_BLOCK_SIZE), jnp.float32),  # m
            pltpu.VMEM((block_b, block_q, MIN_BLOCK_SIZE), jnp.float32),  # l
            pltpu.VMEM((block_b, block_q, head_dim), jnp.float32),  # acc
        ]

    # The carry is updated in place: operands are (q_offset, kv_offset, q, k, v,
    # o, l, m, ...), so flat operands 5, 6, 7 alias outputs 0, 1, 2.  Each
    # output block is written only by the grid steps that read its input block.
    aliases = {5: 0, 6: 1, 7: 2} if carry is not None else {}
    kernel = functools.partial(_fwd_kernel, causal=causal, sm_scale=sm_scale,
                               block_k=block_k, mask_value=DEFAULT_MASK_VALUE)
    o, l, m = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch_shapes),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes or DEFAULT_VMEM_LIMIT_BYTES),
        cost_estimate=_fwd_cost(batch, heads, q_len, kv_len, head_dim, causal,
                                inputs, out_shape),
        name=f"flash_fwd_bq{block_q}_bkm{block_k_major}_bk{block_k}",
    )(q_offset, kv_offset, *inputs)
    return o, l, m


# ----------------------------------------------------------------------------
# Backward: dk/dv kernel.
# ----------------------------------------------------------------------------


def _dkv_kernel(q_off_ref, kv_off_ref,  # scalar prefetch
                q_ref, k_ref, v_ref, ab_ref, q_seg_ref, kv_seg_ref, l_ref, m_ref,
                do_ref, di_ref,  # inputs
                dk_ref, dv_ref,  # outputs
                dk_scr, dv_scr,  # scratch [block_k_major, head_dim] f32
                *, causal, sm_scale, block_q, block_k, mask_value):
    """Grid (b, h, kv major block, q major block); q is the reduction axis."""
    block_q_major = q_ref.shape[2]
    block_k_major = k_ref.shape[2]
    kv_idx, q_idx = pl.program_id(2), pl.program_id(3)
    num_q = pl.num_programs(3)
    q_start = q_off_ref[0] + q_idx * block_q_major
    kv_start = kv_off_ref[0] + kv_idx * block_k_major

    @pl.when(q_idx == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def body(j, i):
        qs, ks = pl.ds(j * block_q, block_q), pl.ds(i * block_k, block_k)
        q = q_ref[0, 0, qs, :]
        k = k_ref[0, 0, ks, :]
        v = v_ref[0, 0, ks, :]
        do = do_ref[0, 0, qs, :]
        s, visible = _masked_logits(
            q, k,
            None if ab_ref is None else ab_ref[0, 0, qs, ks],
            None if q_seg_ref is None else q_seg_ref[0, qs, :],
            None if kv_seg_ref is None else kv_seg_ref[0, :1, ks],
            q_start=q_start + j * block_q, kv_start=kv_start + i * block_k,
            causal=causal, sm_scale=sm_scale, mask_value=mask_value)
        m = jnp.maximum(m_ref[0, 0, qs, :], mask_value)
        p = _probs(s, visible, m, _safe_inv(l_ref[0, 0, qs, :]))
        dv_scr[ks, :] += lax.dot(p.T.astype(do.dtype), do,
                                 preferred_element_type=jnp.float32)
        dp = lax.dot_general(do, v, TRANS_B_DIM_NUMBERS,
                             preferred_element_type=jnp.float32)
        # ds = d(loss)/d(q.k + ab): softmax jacobian times the sm_scale chain rule.
        ds = (dp - _lanes_to(di_ref[0, 0, qs, :], block_k)) * p
        if sm_scale != 1.0:
            ds = ds * sm_scale
        dk_scr[ks, :] += lax.dot(ds.T.astype(q.dtype), q,
                                 preferred_element_type=jnp.float32)

    for j in range(block_q_major // block_q):
        for i in range(block_k_major // block_k):
            if causal:
                pl.when(_block_has_visible(q_start + j * block_q, block_q,
                                           kv_start + i * block_k))(
                    functools.partial(body, j, i))
            else:
                body(j, i)

    @pl.when(q_idx == num_q - 1)
    def _finish():
        dk_ref[0, 0] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[0, 0] = dv_scr[...].astype(dv_ref.dtype)


def _bwd_cost(b, h, q_len, kv_len, d, causal, num_matmuls, in_arrays, out_shapes):
    flops = 2 * num_matmuls * b * h * q_len * kv_len * d
    transcendentals = b * h * q_len * kv_len
    if causal:
        flops, transcendentals = flops // 2, transcendentals // 2
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves((in_arrays, out_shapes)))
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals,
                           bytes_accessed=nbytes)


def _dkv_call(q, k, v, ab, segment_ids, l, m, do, di, q_offset, kv_offset, *, causal,
              sm_scale, block_sizes, vmem_limit_bytes, dk_dtype, dv_dtype):
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    block_q_major, block_q = block_sizes.block_q_major_dkv, block_sizes.block_q_dkv
    block_k_major, block_k = block_sizes.block_k_major_dkv, block_sizes.block_k_dkv
    num_q, num_kv = q_len // block_q_major, kv_len // block_k_major
    grid = (batch, heads, num_kv, num_q)

    def q_block(ki, qi, q_off, kv_off):
        return _dkv_q_block_index(ki, qi, q_off, kv_off, causal=causal,
                                  block_q=block_q_major, block_kv=block_k_major,
                                  num_q_blocks=num_q)

    def q_map(b, h, ki, qi, q_off, kv_off):
        return (b, h, q_block(ki, qi, q_off, kv_off), 0)

    def kv_map(b, h, ki, qi, q_off, kv_off):
        return (b, h, ki, 0)

    def ab_map(b, h, ki, qi, q_off, kv_off):
        return (b, h, q_block(ki, qi, q_off, kv_off), ki)

    def q_seg_map(b, h, ki, qi, q_off, kv_off):
        return (b, q_block(ki, qi, q_off, kv_off), 0)

    def kv_seg_map(b, h, ki, qi, q_off, kv_off):
        return (b, 0, ki)

    q_spec = pl.BlockSpec((1, 1, block_q_major, head_dim), q_map)
    kv_spec = pl.BlockSpec((1, 1, block_k_major, head_dim), kv_map)
    stat_spec = pl.BlockSpec((1, 1, block_q_major, MIN_BLOCK_SIZE), q_map)
    q_ids, kv_ids = _segment_id_tiles(segment_ids, batch, q_len, kv_len)
    in_specs = [
        q_spec, kv_spec, kv_spec,
        None if ab is None else pl.BlockSpec((1, 1, block_q_major, block_k_major), ab_map),
        None if q_ids is None else pl.BlockSpec((1, block_q_major, NUM_LANES), q_seg_map),
        None if kv_ids is None else pl.BlockSpec(
            (1, NUM_SUBLANES, block_k_major), kv_seg_map),
        stat_spec, stat_spec, q_spec, stat_spec,
    ]
    inputs = [q, k, v, ab, q_ids, kv_ids, l, m, do, di]
    out_shape = [_output_struct(k.shape, dk_dtype, inputs, (q_offset, kv_offset)),
                 _output_struct(v.shape, dv_dtype, inputs, (q_offset, kv_offset))]
    out_specs = [kv_spec, kv_spec]
    kernel = functools.partial(_dkv_kernel, causal=causal, sm_scale=sm_scale,
                               block_q=block_q, block_k=block_k,
                               mask_value=DEFAULT_MASK_VALUE)
    dk, dv = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((block_k_major, head_dim), jnp.float32),
                            pltpu.VMEM((block_k_major, head_dim), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes or DEFAULT_VMEM_LIMIT_BYTES),
        cost_estimate=_bwd_cost(batch, heads, q_len, kv_len, head_dim, causal, 4,
                                inputs, out_shape),
        name=f"flash_bwd_dkv_bqm{block_q_major}_bq{block_q}_bkm{block_k_major}_bk{block_k}",
    )(q_offset, kv_offset, *inputs)
    return dk, dv


# ----------------------------------------------------------------------------
# Backward: dq (and d_ab) kernel.
# ----------------------------------------------------------------------------


def _dq_kernel(q_off_ref, kv_off_ref,  # scalar prefetch
               q_ref, k_ref, v_ref, ab_ref, q_seg_ref, kv_seg_ref, l_ref, m_ref,
               do_ref, di_ref,  # inputs
               dq_ref, dab_ref,  # outputs
               dq_scr,  # scratch [block_q, head_dim] f32
               *, causal, sm_scale, block_k, mask_value):
    """Grid (b, h, q block, kv major block); kv is the reduction axis."""
    block_q = q_ref.shape[2]
    block_k_major = k_ref.shape[2]
    q_idx, kv_idx = pl.program_id(2), pl.program_id(3)
    num_kv = pl.num_programs(3)
    q_start = q_off_ref[0] + q_idx * block_q
    kv_start = kv_off_ref[0] + kv_idx * block_k_major

    @pl.when(kv_idx == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def body(i):
        ks = pl.ds(i * block_k, block_k)
        q = q_ref[0, 0]
        k = k_ref[0, 0, ks, :]
        v = v_ref[0, 0, ks, :]
        do = do_ref[0, 0]
        s, visible = _masked_logits(
            q, k,
            None if ab_ref is None else ab_ref[0, 0, :, ks],
            None if q_seg_ref is None else q_seg_ref[0],
            None if kv_seg_ref is None else kv_seg_ref[0, :1, ks],
            q_start=q_start, kv_start=kv_start + i * block_k, causal=causal,
            sm_scale=sm_scale, mask_value=mask_value)
        m = jnp.maximum(m_ref[0, 0], mask_value)
        p = _probs(s, visible, m, _safe_inv(l_ref[0, 0]))
        dp = lax.dot_general(do, v, TRANS_B_DIM_NUMBERS,
                             preferred_element_type=jnp.float32)
        ds = (dp - _lanes_to(di_ref[0, 0], block_k)) * p
        if sm_scale != 1.0:
            ds = ds * sm_scale
        if dab_ref is not None:
            # logits = (q.k + ab) * sm_scale, so d_ab is exactly ds.
            dab_ref[0, 0, :, ks] = ds.astype(dab_ref.dtype)
        dq_scr[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    def zero_dab(i):
        # Skipped sub-blocks are still part of this grid step's dab output block.
        dab_ref[0, 0, :, pl.ds(i * block_k, block_k)] = jnp.zeros(
            (block_q, block_k), dab_ref.dtype)

    for i in range(block_k_major // block_k):
        if causal:
            visible = _block_has_visible(q_start, block_q, kv_start + i * block_k)
            pl.when(visible)(functools.partial(body, i))
            if dab_ref is not None:
                pl.when(jnp.logical_not(visible))(functools.partial(zero_dab, i))
        else:
            body(i)

    @pl.when(kv_idx == num_kv - 1)
    def _finish():
        dq_ref[0, 0] = dq_scr[...].astype(dq_ref.dtype)


def _dq_call(q, k, v, ab, segment_ids, l, m, do, di, q_offset, kv_offset, *, causal,
             sm_scale, block_sizes, vmem_limit_bytes, dq_dtype):
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    block_q = block_sizes.block_q_dq
    block_k_major, block_k = block_sizes.block_k_major_dq, block_sizes.block_k_dq
    num_q, num_kv = q_len // block_q, kv_len // block_k_major
    grid = (batch, heads, num_q, num_kv)

    def kv_block(qi, ki, q_off, kv_off):
        return _fwd_kv_block_index(qi, ki, q_off, kv_off, causal=causal,
                                   block_q=block_q, block_kv=block_k_major)

    def q_map(b, h, qi, ki, q_off, kv_off):
        return (b, h, qi, 0)

    def kv_map(b, h, qi, ki, q_off, kv_off):
        return (b, h, kv_block(qi, ki, q_off, kv_off), 0)

    def ab_map(b, h, qi, ki, q_off, kv_off):
        return (b, h, qi, kv_block(qi, ki, q_off, kv_off))

    def dab_map(b, h, qi, ki, q_off, kv_off):
        # Every (q, kv) block of dab is written exactly once (zeros if skipped).
        return (b, h, qi, ki)

    def q_seg_map(b, h, qi, ki, q_off, kv_off):
        return (b, qi, 0)

    def kv_seg_map(b, h, qi, ki, q_off, kv_off):
        return (b, 0, kv_block(qi, ki, q_off, kv_off))

    q_spec = pl.BlockSpec((1, 1, block_q, head_dim), q_map)
    kv_spec = pl.BlockSpec((1, 1, block_k_major, head_dim), kv_map)
    stat_spec = pl.BlockSpec((1, 1, block_q, MIN_BLOCK_SIZE), q_map)
    q_ids, kv_ids = _segment_id_tiles(segment_ids, batch, q_len, kv_len)
    in_specs = [
        q_spec, kv_spec, kv_spec,
        None if ab is None else pl.BlockSpec((1, 1, block_q, block_k_major), ab_map),
        None if q_ids is None else pl.BlockSpec((1, block_q, NUM_LANES), q_seg_map),
        None if kv_ids is None else pl.BlockSpec(
            (1, NUM_SUBLANES, block_k_major), kv_seg_map),
        stat_spec, stat_spec, q_spec, stat_spec,
    ]
    inputs = [q, k, v, ab, q_ids, kv_ids, l, m, do, di]
    out_shape = [_output_struct(q.shape, dq_dtype, inputs, (q_offset, kv_offset)),
                 None if ab is None else _output_struct(ab.shape, ab.dtype, inputs, (q_offset, kv_offset))]
    out_specs = [q_spec,
                 None if ab is None else pl.BlockSpec((1, 1, block_q, block_k_major),
                                                      dab_map)]
    kernel = functools.partial(_dq_kernel, causal=causal, sm_scale=sm_scale,
                               block_k=block_k, mask_value=DEFAULT_MASK_VALUE)
    dq, dab = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((block_q, head_dim), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes or DEFAULT_VMEM_LIMIT_BYTES),
        cost_estimate=_bwd_cost(batch, heads, q_len, kv_len, head_dim, causal, 3,
                                inputs, out_shape),
        name=f"flash_bwd_dq_bq{block_q}_bkm{block_k_major}_bk{block_k}",
    )(q_offset, kv_offset, *inputs)
    return dq, dab


# ----------------------------------------------------------------------------
# Ring-attention building blocks.
# ----------------------------------------------------------------------------


def flash_attention_init_carry(q: jax.Array):
    """Empty carry for ``q`` [B, H, Q, D]: ``(o=0, l=0, m=-inf)``, all float32.

    ``o`` is [B, H, Q, D]; ``l`` and ``m`` are [B, H, Q, MIN_BLOCK_SIZE]
    (lane-replicated row statistics).
    """
    b, h, q_len, d = q.shape
    stat = (b, h, q_len, MIN_BLOCK_SIZE)
    return (jnp.zeros((b, h, q_len, d), jnp.float32),
            jnp.zeros(stat, jnp.float32),
            jnp.full(stat, -jnp.inf, jnp.float32))


def flash_attention_finalize(carry, dtype) -> jax.Array:
    """Attention output from a carry: ``o`` is kept normalised, so just a cast.

    Rows that saw no visible key (possible only with causal offsets) are 0.
    """
    o, _, _ = carry
    return o.astype(dtype)


def _validate_step_common(q, k, v, ab, segment_ids, block_sizes, *, fwd, dkv, dq):
    _validate_qkv(q, k, v)
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    _validate_ab_and_segments(ab, segment_ids, batch, heads, q_len, kv_len)
    block_sizes = _resolve_block_sizes(block_sizes, q, k)
    _validate_block_sizes(block_sizes, batch, q_len, kv_len, fwd=fwd, dkv=dkv, dq=dq)
    return block_sizes


def flash_attention_fwd_step(q, k, v, ab, segment_ids, carry, *, q_offset, kv_offset,
                             causal, sm_scale, block_sizes, vmem_limit_bytes=None):
    """Fold one kv chunk into the running online softmax of one q chunk.

    Args:
      q: [B, H, Q, D] query chunk whose first token has global position
        ``q_offset``.
      k, v: [B, H, K, D] kv chunk whose first token has global position
        ``kv_offset``.
      ab: None or [B, H, Q, K] bias for this (q chunk, kv chunk) pair.
      segment_ids: None or SegmentIds(q=[B, Q] ids of this q chunk,
        kv=[B, K] ids of this kv chunk).
      carry: ``(o, l, m)`` as described in the module docstring (start from
        :func:`flash_attention_init_carry`).
      q_offset, kv_offset: int or traced int32 scalar global token offsets
        (e.g. from ``lax.axis_index`` inside shard_map); fed to the kernel by
        scalar prefetch.  Causal visibility is ``kv_offset + j <= q_offset + i``
        and causal block skipping uses the same global positions; a chunk that
        is entirely invisible leaves the carry unchanged (and costs no kv DMA
        beyond the first block).
      block_sizes: BlockSizes or None (defaults fitted to the chunk lengths);
        only the forward fields are used.

    Returns:
      The new carry ``(o, l, m)``.  Folding chunks in any order gives the same
      result up to rounding.
    """
    block_sizes = _validate_step_common(q, k, v, ab, segment_ids, block_sizes,
                                        fwd=True, dkv=False, dq=False)
    b, h, q_len, d = q.shape
    o_c, l_c, m_c = carry
    if o_c.shape != (b, h, q_len, d):
        raise ValueError(f"carry o must have shape {(b, h, q_len, d)}, got {o_c.shape}")
    l_c = _row_stat(l_c, "carry l", (b, h, q_len))
    m_c = _row_stat(m_c, "carry m", (b, h, q_len))
    o, l, m = _fwd_call(
        q, k, v, ab, segment_ids, (o_c.astype(jnp.float32), l_c, m_c),
        _prepare_offset(q_offset, "q_offset"), _prepare_offset(kv_offset, "kv_offset"),
        causal=bool(causal), sm_scale=_static_scale(sm_scale), block_sizes=block_sizes,
        vmem_limit_bytes=vmem_limit_bytes, out_dtype=jnp.float32, save_stats=True)
    return o, l, m


def _bwd_step_inputs(q, l, m, do, di):
    b, h, q_len, d = q.shape
    if do.shape != q.shape:
        raise ValueError(f"do must have the shape of q {q.shape}, got {do.shape}")
    stats = [_row_stat(x, name, (b, h, q_len)) for x, name in ((l, "l"), (m, "m"),
                                                               (di, "di"))]
    return (*stats, do.astype(q.dtype))


def flash_attention_bwd_dkv_step(q, k, v, ab, segment_ids, l, m, do, di, *, q_offset,
                                 kv_offset, causal, sm_scale, block_sizes,
                                 vmem_limit_bytes=None):
    """dk, dv contribution of one (q chunk, kv chunk) pair.

    ``l``, ``m``: the *final* carry statistics of this q chunk (after all kv
    chunks), [B, H, Q] or [B, H, Q, MIN_BLOCK_SIZE].  ``do``: [B, H, Q, D]
    output cotangent (cast to q.dtype).  ``di = sum(o * do, -1)`` with the final
    output ``o``, [B, H, Q] or [..., MIN_BLOCK_SIZE].  Offsets as in
    :func:`flash_attention_fwd_step`.

    Returns ``(dk, dv)`` in float32 (sum them over q chunks, then cast).  d_ab
    is produced by :func:`flash_attention_bwd_dq_step`.
    """
    block_sizes = _validate_step_common(q, k, v, ab, segment_ids, block_sizes,
                                        fwd=False, dkv=True, dq=False)
    l, m, di, do = _bwd_step_inputs(q, l, m, do, di)
    return _dkv_call(
        q, k, v, ab, segment_ids, l, m, do, di,
        _prepare_offset(q_offset, "q_offset"), _prepare_offset(kv_offset, "kv_offset"),
        causal=bool(causal), sm_scale=_static_scale(sm_scale), block_sizes=block_sizes,
        vmem_limit_bytes=vmem_limit_bytes, dk_dtype=jnp.float32, dv_dtype=jnp.float32)


def flash_attention_bwd_dq_step(q, k, v, ab, segment_ids, l, m, do, di, *, q_offset,
                                kv_offset, causal, sm_scale, block_sizes,
                                vmem_limit_bytes=None):
    """dq contribution (and d_ab) of one (q chunk, kv chunk) pair.

    Inputs as in :func:`flash_attention_bwd_dkv_step`.  Returns ``dq`` (float32,
    sum over kv chunks, then cast) when ``ab is None``, else ``(dq, dab)`` with
    ``dab`` the complete gradient of this pair's [B, H, Q, K] bias, in
    ``ab.dtype``.
    """
    block_sizes = _validate_step_common(q, k, v, ab, segment_ids, block_sizes,
                                        fwd=False, dkv=False, dq=True)
    l, m, di, do = _bwd_step_inputs(q, l, m, do, di)
    dq, dab = _dq_call(
        q, k, v, ab, segment_ids, l, m, do, di,
        _prepare_offset(q_offset, "q_offset"), _prepare_offset(kv_offset, "kv_offset"),
        causal=bool(causal), sm_scale=_static_scale(sm_scale), block_sizes=block_sizes,
        vmem_limit_bytes=vmem_limit_bytes, dq_dtype=jnp.float32)
    return dq if ab is None else (dq, dab)


# ----------------------------------------------------------------------------
# Public, differentiable flash attention (offsets 0, same kernels).
# ----------------------------------------------------------------------------


def flash_attention(q, k, v, ab=None, segment_ids=None, *, causal: bool = False,
                    sm_scale: float = 1.0, block_sizes: BlockSizes | None = None,
                    vmem_limit_bytes: int | None = None) -> jax.Array:
    """Flash attention on [B, H, S, D] inputs; see the module docstring.

    Differentiable (``jax.custom_vjp``) in q, k, v and ab with the Pallas dkv
    and dq kernels; gradients come back in the input dtypes.  ``block_sizes``
    None picks :meth:`BlockSizes.get_default` for the shapes;
    ``vmem_limit_bytes`` None means DEFAULT_VMEM_LIMIT_BYTES.
    """
    _validate_qkv(q, k, v)
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    _validate_ab_and_segments(ab, segment_ids, batch, heads, q_len, kv_len)
    block_sizes = _resolve_block_sizes(block_sizes, q, k)
    # Backward blocks are validated up front too: an error at grad time would
    # surface far from the call that chose the blocks.
    _validate_block_sizes(block_sizes, batch, q_len, kv_len, fwd=True, dkv=True, dq=True)
    return _flash_attention(q, k, v, ab, segment_ids, bool(causal),
                            _static_scale(sm_scale), block_sizes, vmem_limit_bytes)


_ZERO_OFFSET = np.zeros((1,), np.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash_attention(q, k, v, ab, segment_ids, causal, sm_scale, block_sizes,
                     vmem_limit_bytes):
    o, _, _ = _fwd_call(q, k, v, ab, segment_ids, None, _ZERO_OFFSET, _ZERO_OFFSET,
                        causal=causal, sm_scale=sm_scale, block_sizes=block_sizes,
                        vmem_limit_bytes=vmem_limit_bytes, out_dtype=q.dtype,
                        save_stats=False)
    return o


def _flash_attention_vjp_fwd(q, k, v, ab, segment_ids, causal, sm_scale, block_sizes,
                             vmem_limit_bytes):
    o, l, m = _fwd_call(q, k, v, ab, segment_ids, None, _ZERO_OFFSET, _ZERO_OFFSET,
                        causal=causal, sm_scale=sm_scale, block_sizes=block_sizes,
                        vmem_limit_bytes=vmem_limit_bytes, out_dtype=q.dtype,
                        save_stats=True)
    # Keep one lane of the replicated statistics (128x less residual memory).
    return o, (q, k, v, ab, segment_ids, o, l[..., 0], m[..., 0])


def _flash_attention_vjp_bwd(causal, sm_scale, block_sizes, vmem_limit_bytes, res, do):
    q, k, v, ab, segment_ids, o, l, m = res
    shape = q.shape[:3]
    l = _row_stat(l, "l", shape)
    m = _row_stat(m, "m", shape)
    di = _row_stat(jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1),
                   "di", shape)
    do = do.astype(q.dtype)
    common = dict(causal=causal, sm_scale=sm_scale, block_sizes=block_sizes,
                  vmem_limit_bytes=vmem_limit_bytes)
    dk, dv = _dkv_call(q, k, v, ab, segment_ids, l, m, do, di, _ZERO_OFFSET,
                       _ZERO_OFFSET, dk_dtype=k.dtype, dv_dtype=v.dtype, **common)
    dq, dab = _dq_call(q, k, v, ab, segment_ids, l, m, do, di, _ZERO_OFFSET,
                       _ZERO_OFFSET, dq_dtype=q.dtype, **common)
    return dq, dk, dv, dab, None


_flash_attention.defvjp(_flash_attention_vjp_fwd, _flash_attention_vjp_bwd)
