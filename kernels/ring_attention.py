"""Ring attention over a sequence-sharded 1-D device mesh.

RingAttention (Liu, Zaharia, Abbeel 2023, https://arxiv.org/abs/2310.01889):
every device keeps its query block and passes its key/value block to the next
device around the ring; after ``n`` steps each query block has seen every key
block, with the softmax carried online (running max ``m``, running sum ``l``,
running numerator).  The backward pass runs the ring again, accumulating
``dq`` locally while ``dk``/``dv`` travel with their key/value block and arrive
back on the block's home device after the ``n``-th rotation.

Three variants share the ring loop (:func:`_ring_loop`), the argument
validation and the sharding contract:

* :func:`ring_attention` -- blockwise (chunked) attention in pure JAX inside
  each ring step, with causal chunk skipping, additive bias, segment ids and
  dropout.
* :func:`ring_attention_standard` -- one un-chunked boolean-masked block per
  ring step (the same core with a single chunk and a mask).
* :func:`ring_flash_attention_tpu` -- the Pallas TPU flash kernels of
  :mod:`attncheck_kernels.flash_attention` inside each ring step.

The three functions are *per-device* functions: call them inside
``jax.shard_map`` over a 1-D mesh whose axis is ``axis_name``.  The
``*_sharded`` wrappers take global arrays plus ``num_devices`` (or a ``mesh``)
and run the ``shard_map`` for you.

Conventions
-----------
Layout
    ``q``, ``k``, ``v`` are ``[batch, seq, heads, head_dim]``.  Inside
    shard_map ``seq`` is the device-local length; device ``i`` holds global
    tokens ``[i * seq, (i + 1) * seq)`` (contiguous sharding, ring order =
    mesh order).

Scale and bias
    ``logits = (q . k) * sm_scale + bias``: the scale multiplies the dot
    product only; the bias is added *after* scaling, in float32.
    ``sm_scale`` defaults to ``1 / sqrt(head_dim)``.

Masking
    Causal (global key index <= global query index), segment ids (equal ids
    attend) and ``attn_mask`` (True = attend) remove logits exactly
    (probability exactly 0).  A bias entry of ``-inf`` masks too.  A query
    row that can see no key at all (possible with ``attn_mask``, ``-inf``
    bias, or a ``(q, kv)`` segment-id pair whose query id is absent from the
    keys; with one shared segment-id array a token always sees itself) has
    output 0 and contributes no gradient.

Segment ids
    ``segment_ids`` is an int array ``[batch, seq]`` used for queries and
    keys (self-attention), or any ``(q, kv)`` pair with attributes ``.q`` /
    ``.kv`` (e.g. ``flash_attention.SegmentIds``) of shapes ``[batch, q_seq]``
    / ``[batch, kv_seq]``.  They are sharded on the sequence axis like
    ``q``/``k``; the key ids travel around the ring with ``k``/``v``, so no
    global slicing of a sharded array ever happens.

Bias / mask sharding contract
    ``attn_bias`` (float) and ``attn_mask`` (bool) are
    ``[batch or 1, heads or 1, q_seq or 1, kv_seq_global]``: sharded on the
    query axis (device-local ``q_seq``, or 1 = broadcast over queries and then
    replicated) and *replicated* on the key axis (the full global key length
    on every device, sliced per ring step at the key block's global offset).
    Anything else -- a key axis that is sharded, a query axis that is neither
    1 nor the local query length -- is rejected with a ValueError naming the
    argument and the expected vs actual shape, instead of being silently
    clamped by ``dynamic_slice``.  ``attn_bias`` is differentiable (its
    cotangent is reduced over broadcast dimensions, and psum-ed over the ring
    when the bias is replicated); masks and segment ids are not.

Dropout
    Inverted dropout on the attention probabilities (flax convention):
    ``out = (softmax(logits) * keep / (1 - rate)) @ v``.  The keep mask is a
    counter-based Threefry hash of ``(rng, batch, head, global query index,
    global key index)``, so it does not depend on the number of devices or on
    the chunk sizes, the backward pass regenerates exactly the forward mask,
    and :func:`attention_dropout_mask` reproduces it for a dense reference.

Dtypes
    Softmax statistics and accumulators are float32.  ``float32_logits=True``
    upcasts the matmul operands to float32; ``False`` feeds them in the input
    dtype with float32 accumulation (the TPU MXU behaviour).  The output has
    ``q``'s dtype and every gradient comes back in its input's dtype.

check_vma
    All three variants trace under ``jax.shard_map``'s default ``check_vma=True``
    (and with ``False``): the accumulators are cast to device-varying before the
    scans and conds (:func:`_as_varying`), a replicated bias gets its cotangent
    psum-ed (:func:`_cotangent_like`), and the flash kernels type their Pallas
    outputs as varying over every mesh axis their inputs vary over
    (``attncheck_kernels.flash_attention._output_struct``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from attncheck_kernels import flash_attention as _flash

__all__ = [
    "DEFAULT_AXIS_NAME",
    "attention_dropout_mask",
    "ring_attention",
    "ring_attention_sharded",
    "ring_attention_standard",
    "ring_attention_standard_sharded",
    "ring_flash_attention_tpu",
    "ring_flash_attention_tpu_sharded",
]

# Mesh axis name used by the ``*_sharded`` wrappers when none is given.
DEFAULT_AXIS_NAME = "sp"

# Softmax statistics and all accumulators are kept in this dtype.
_ACC_DTYPE = jnp.float32

# Query-major arrays (bias, mask) are [batch, heads, q_seq, kv_seq].
_QUERY_MAJOR_NDIM = 4


# --------------------------------------------------------------------------
# vma (varying manual axes) helpers
# --------------------------------------------------------------------------


def _is_varying(x, axis_name) -> bool:
    return axis_name in jax.typeof(x).mat.varying


def _as_varying(tree, axis_name):
    """Marks fresh per-device values (zeros, axis-invariant casts) as varying.

    Scan carries and cond branches must have identical types under
    ``check_vma=True``; accumulators start as device-invariant zeros but the
    loop body makes them device-varying, so they are cast up front.  With
    ``check_vma=False`` nothing is ever varying and ``pcast`` is a no-op.
    """

    def cast(x):
        return x if _is_varying(x, axis_name) else lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)


def _cotangent_like(ct, primal, axis_name):
    """Sums a per-device cotangent over the ring when its primal is replicated.

    A device-invariant primal (e.g. a bias broadcast over queries, replicated
    by shard_map) received contributions from every device.  Under
    ``check_vma=True`` custom_vjp demands the cotangent have the primal's
    type, so we psum.  Under ``check_vma=False`` neither is varying and
    shard_map's own transpose does the sum.
    """
    if ct is None:
        return None
    ct = ct.astype(primal.dtype)
    if _is_varying(ct, axis_name) and not _is_varying(primal, axis_name):
        ct = lax.psum(ct, axis_name)
    return ct


def _zeros(shape, axis_name, dtype=_ACC_DTYPE):
    return _as_varying(jnp.zeros(shape, dtype), axis_name)


# --------------------------------------------------------------------------
# The ring loop shared by every variant
# --------------------------------------------------------------------------


def _rotate(tree, axis_name):
    """Sends every leaf from device i to device i + 1 (mod n)."""
    n = lax.axis_size(axis_name)
    if n == 1:
        return tree
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _ring_loop(step, carry, kv_state, kv_grads, *, axis_name):
    """Runs ``step`` once per ring step and returns ``(carry, kv_grads)``.

    ``step(carry, kv_state, kv_grads, kv_block) -> (carry, kv_grads)`` where
    ``kv_block`` is the ring position (a traced int32) whose key/value block
    ``kv_state`` currently holds.  Because blocks move i -> i + 1, after ``t``
    rotations device ``i`` holds block ``(i - t) mod n``.

    ``kv_state`` (k, v, key segment ids) rotates between steps only: after the
    last step nobody needs it, so n - 1 rotations.  ``kv_grads`` (dk, dv
    accumulators of the held block) also rotate after the last step, n
    rotations in all, which brings each block's gradient back to its home.
    """
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)

    def body(state, t):
        carry, kv_state, kv_grads = state
        carry, kv_grads = step(carry, kv_state, kv_grads, (me - t) % n)
        return (carry, _rotate(kv_state, axis_name), _rotate(kv_grads, axis_name)), None

    (carry, kv_state, kv_grads), _ = lax.scan(
        body, (carry, kv_state, kv_grads), jnp.arange(n - 1, dtype=jnp.int32)
    )
    carry, kv_grads = step(carry, kv_state, kv_grads, (me + 1) % n)
    return carry, _rotate(kv_grads, axis_name)


# --------------------------------------------------------------------------
# Validation shared by every variant
# --------------------------------------------------------------------------


def _check_qkv(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must be [batch, seq, heads, head_dim]; got shape {x.shape}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point; got dtype {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {k.shape}, v {v.shape}")
    b, _, h, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d):
        raise ValueError(
            "q and k must agree on batch, heads and head_dim; got "
            f"q {q.shape}, k {k.shape}"
        )


def _check_query_major(name, x, *, batch, heads, q_len, kv_len_global, dtype_kind):
    """Enforces the bias/mask sharding contract (see module docstring)."""
    if x is None:
        return
    expected = (
        f"per-device [batch 1|{batch}, heads 1|{heads}, queries 1|{q_len} (local), "
        f"keys {kv_len_global} (global)]: query axis sharded like q or broadcast, "
        f"key axis replicated"
    )
    if x.ndim != _QUERY_MAJOR_NDIM:
        raise ValueError(f"{name} must be rank {_QUERY_MAJOR_NDIM}: expected {expected}; got shape {x.shape}")
    ok = (
        x.shape[0] in (1, batch)
        and x.shape[1] in (1, heads)
        and x.shape[2] in (1, q_len)
        and x.shape[3] == kv_len_global
    )
    if not ok:
        raise ValueError(f"{name} has the wrong per-device shape: expected {expected}; got {x.shape}")
    if dtype_kind == "bool" and x.dtype != jnp.bool_:
        raise ValueError(f"{name} must be boolean (True = attend); got dtype {x.dtype}")
    if dtype_kind == "float" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point; got dtype {x.dtype}")


def _split_segment_ids(segment_ids, q, k):
    """Returns (q_segment_ids, kv_segment_ids), validated, or (None, None)."""
    if segment_ids is None:
        return None, None
    if hasattr(segment_ids, "q") and hasattr(segment_ids, "kv"):
        q_ids, kv_ids = segment_ids.q, segment_ids.kv
    else:
        q_ids = kv_ids = segment_ids
    for name, ids, ref in (("segment_ids (query)", q_ids, q), ("segment_ids (key)", kv_ids, k)):
        expected = (ref.shape[0], ref.shape[1])
        if ids.shape != expected:
            raise ValueError(
                f"{name} must be [batch, seq] sharded on seq like q/k: expected "
                f"per-device shape {expected}; got {ids.shape}"
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer; got dtype {ids.dtype}")
    return q_ids, kv_ids


def _check_chunk(name, chunk, length, what):
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"{name} must be a positive int; got {chunk!r}")
    if length % chunk:
        raise ValueError(
            f"{name}={chunk} must divide the per-device {what} length {length}"
        )


def _default_scale(sm_scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


# --------------------------------------------------------------------------
# Dropout: counter-based keep mask over global indices
# --------------------------------------------------------------------------


def _dropout_seed(dropout_rng):
    """Two uint32 words derived from any JAX PRNG key (typed or raw)."""
    return jax.random.bits(dropout_rng, (2,), jnp.uint32)


def _threefry(key0, key1, x0, x1):
    shape = jnp.broadcast_shapes(key0.shape, key1.shape, x0.shape, x1.shape)
    args = [jnp.broadcast_to(a.astype(jnp.uint32), shape) for a in (key0, key1, x0, x1)]
    return jex_random.threefry2x32_p.bind(*args)


def _dropout_keep(seed, rate, num_batch, num_heads, q_pos, k_pos):
    """Keep mask [batch, q, heads, k] for global positions q_pos, k_pos."""
    b = jnp.arange(num_batch, dtype=jnp.uint32)[:, None, None, None]
    h = jnp.arange(num_heads, dtype=jnp.uint32)[None, None, :, None]
    # Round 1 derives a key per (batch, head); round 2 hashes the position pair.
    kb0, kb1 = _threefry(seed[0], seed[1], b, h)
    bits, _ = _threefry(kb0, kb1, q_pos[None, :, None, None], k_pos[None, None, None, :])
    threshold = np.uint32(min(round(rate * 2.0**32), 2**32 - 1))
    return bits >= threshold


def attention_dropout_mask(dropout_rng, rate, batch, num_heads, q_len, kv_len):
    """The global keep mask ``[batch, heads, q_len, kv_len]`` ring attention uses.

    For building a dense reference: position (b, h, i, j) is kept iff this is
    True, for any device count and chunking.
    """
    keep = _dropout_keep(
        _dropout_seed(dropout_rng), rate, batch, num_heads,
        jnp.arange(q_len, dtype=jnp.uint32), jnp.arange(kv_len, dtype=jnp.uint32),
    )
    return jnp.transpose(keep, (0, 2, 1, 3))


# --------------------------------------------------------------------------
# Blockwise core (used by ring_attention and ring_attention_standard)
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _BlockwiseConfig:
    axis_name: Any
    causal: bool
    query_chunk_size: int
    key_chunk_size: int
    sm_scale: float
    float32_logits: bool
    dropout_rate: float  # 0.0 when deterministic
    precision: Any

    def compute_dtype(self, dtype):
        return jnp.float32 if self.float32_logits else dtype


def _to_chunks(x, chunk):
    """[B, S, ...] -> [S // chunk, B, chunk, ...] (scan-major)."""
    if x is None:
        return None
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // chunk, chunk, *x.shape[2:]), 1, 0)


def _from_chunks(x):
    """Inverse of :func:`_to_chunks`."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _key_columns(x, k_start, k_size):
    """Columns ``[k_start, k_start + k_size)`` of a [B|1, H|1, Q|1, K_global] bias/mask.

    ``k_start`` is a *global* key offset: valid because the key axis is
    replicated (validated by :func:`_check_query_major`).
    """
    return None if x is None else lax.dynamic_slice_in_dim(x, k_start, k_size, axis=3)


def _query_major_chunk(x, q_start, k_start, q_size, k_size):
    """Chunk of a [B|1, H|1, Q|1, K] bias/mask, transposed to [B|1, Q|1, H|1, K].

    ``q_start`` is a *device-local* query offset (the query axis is sharded),
    ``k_start`` a *global* key offset.
    """
    if x is None:
        return None
    cols = _key_columns(x, k_start, k_size)
    if x.shape[2] > 1:  # else it broadcasts over queries
        cols = lax.dynamic_slice_in_dim(cols, q_start, q_size, axis=2)
    return jnp.transpose(cols, (0, 2, 1, 3))


def _einsum(cfg, spec, a, b):
    return jnp.einsum(spec, a, b, precision=cfg.precision, preferred_element_type=_ACC_DTYPE)


@dataclasses.dataclass(frozen=True)
class _ChunkInputs:
    """Everything needed to form the logits of one (query chunk, key chunk)."""

    q: jax.Array  # [B, qc, H, D]
    k: jax.Array  # [B, kc, H, D]
    q_pos: jax.Array  # [qc] global query indices
    k_pos: jax.Array  # [kc] global key indices
    bias: jax.Array | None  # [B|1, qc|1, H|1, kc]
    mask: jax.Array | None
    q_seg: jax.Array | None  # [B, qc]
    kv_seg: jax.Array | None  # [B, kc]


def _masked_logits(cfg, c: _ChunkInputs):
    """Float32 logits [B, qc, H, kc]; hidden entries are exactly -inf."""
    s = _einsum(cfg, "bqhd,bkhd->bqhk", c.q, c.k) * cfg.sm_scale
    if c.bias is not None:
        s = s + c.bias.astype(_ACC_DTYPE)
    visible = []
    if cfg.causal:
        visible.append((c.q_pos[:, None] >= c.k_pos[None, :])[None, :, None, :])
    if c.q_seg is not None:
        visible.append((c.q_seg[:, :, None] == c.kv_seg[:, None, :])[:, :, None, :])
    if c.mask is not None:
        visible.append(c.mask)
    if visible:
        s = jnp.where(functools.reduce(jnp.logical_and, visible), s, -jnp.inf)
    return s


def _keep_scale(cfg, seed, c: _ChunkInputs):
    """Dropout multiplier keep / (1 - rate), or None without dropout."""
    if cfg.dropout_rate == 0.0:
        return None
    keep = _dropout_keep(seed, cfg.dropout_rate, c.q.shape[0], c.q.shape[2],
                         c.q_pos.astype(jnp.uint32), c.k_pos.astype(jnp.uint32))
    return jnp.where(keep, 1.0 / (1.0 - cfg.dropout_rate), 0.0).astype(_ACC_DTYPE)


def _unless_causally_hidden(cfg, q_last, k_first, compute, skipped, operand):
    """Runs ``compute(operand)`` unless causality hides the whole chunk pair."""
    if not cfg.causal:
        return compute(operand)
    return lax.cond(k_first > q_last, skipped, compute, operand)


@dataclasses.dataclass(frozen=True)
class _RingContext:
    """Per-device inputs of the blockwise core that stay put around the ring."""

    q: jax.Array  # [B, Sq, H, D], input dtype
    bias: jax.Array | None  # [B|1, H|1, Sq|1, Sk_global]
    mask: jax.Array | None  # same layout, bool
    q_seg: jax.Array | None  # [B, Sq]
    seed: jax.Array | None  # uint32[2] dropout seed
    q_offset: jax.Array  # global index of this device's first query


def _chunk_grid(cfg, ctx: _RingContext, kv, kv_offset, per_pair, q_state, q_xs, kv_out_shapes):
    """One ring step: scans query chunks (outer) x key chunks (inner).

    ``per_pair(chunk, v_chunk, ik, state, xs) -> (state, kv_out)`` handles one
    visible chunk pair; causally hidden pairs keep ``state`` and emit zeros.

    ``q_state`` / ``q_xs`` are chunk-major ``[num_q_chunks, ...]`` per-query
    state (threaded through the inner scan) and read-only inputs.
    ``kv_out_shapes`` describes one key chunk's outputs (ShapeDtypeStructs);
    they are summed over query chunks.  Returns ``(q_state, kv_out)`` with
    ``kv_out`` chunk-major ``[num_k_chunks, ...]``.
    """
    k, v, kv_seg = kv
    qc, kc = cfg.query_chunk_size, cfg.key_chunk_size
    cdt = cfg.compute_dtype(ctx.q.dtype)
    q_chunks = _to_chunks(ctx.q.astype(cdt), qc)
    k_chunks = _to_chunks(k.astype(cdt), kc)
    v_chunks = _to_chunks(v.astype(cdt), kc)
    num_q, num_k = q_chunks.shape[0], k_chunks.shape[0]

    def zeros_out(lead=()):
        return jax.tree.map(lambda s: _zeros((*lead, *s.shape), cfg.axis_name, s.dtype), kv_out_shapes)

    def over_q(kv_acc, xs):
        iq, q_c, q_seg_c, state, state_xs = xs
        q_pos = ctx.q_offset + iq * qc + jnp.arange(qc, dtype=jnp.int32)

        def over_k(state, ys):
            ik, k_c, v_c, kv_seg_c = ys
            k_start = kv_offset + ik * kc
            chunk = _ChunkInputs(
                q=q_c, k=k_c, q_pos=q_pos, k_pos=k_start + jnp.arange(kc, dtype=jnp.int32),
                bias=_query_major_chunk(ctx.bias, iq * qc, k_start, qc, kc),
                mask=_query_major_chunk(ctx.mask, iq * qc, k_start, qc, kc),
                q_seg=q_seg_c, kv_seg=kv_seg_c,
            )
            return _unless_causally_hidden(
                cfg, q_pos[-1], k_start,
                lambda st: per_pair(chunk, v_c, ik, st, state_xs),
                lambda st: (st, zeros_out()),
                state,
            )

        state, kv_out = lax.scan(
            over_k, state,
            (jnp.arange(num_k, dtype=jnp.int32), k_chunks, v_chunks, _to_chunks(kv_seg, kc)),
        )
        return jax.tree.map(jnp.add, kv_acc, kv_out), state

    kv_out, q_state = lax.scan(
        over_q, zeros_out((num_k,)),
        (jnp.arange(num_q, dtype=jnp.int32), q_chunks, _to_chunks(ctx.q_seg, qc), q_state, q_xs),
    )
    return q_state, kv_out


def _fwd_pair(cfg, seed, chunk: _ChunkInputs, v_c, ik, state, xs):
    """Online-softmax update of one query chunk with one key chunk."""
    del ik, xs
    acc, l, m = state  # [B, qc, H, D], [B, qc, H], [B, qc, H]
    s = _masked_logits(cfg, chunk)
    m_new = jnp.maximum(m, s.max(axis=-1))
    # Rows that have seen only hidden keys keep m = -inf; shift them by 0 so
    # exp(-inf - shift) = 0 instead of exp(-inf + inf) = nan.
    m_shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(s - m_shift[..., None])
    alpha = jnp.exp(m - m_shift)
    l = l * alpha + p.sum(axis=-1)
    keep = _keep_scale(cfg, seed, chunk)
    p_dropped = p if keep is None else p * keep  # the normaliser l uses undropped p
    acc = acc * alpha[..., None] + _einsum(cfg, "bqhk,bkhd->bqhd", p_dropped.astype(v_c.dtype), v_c)
    return (acc, l, m_new), ()


def _sum_to_shape(x, shape):
    """Sums the dimensions of ``x`` that ``shape`` broadcasts (size 1)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def _bwd_pair(cfg, seed, chunk: _ChunkInputs, v_c, ik, state, xs):
    """Gradient contributions of one (query chunk, key chunk) pair."""
    dq, dbias = state  # [B, qc, H, D] f32, [B|1, qc|1, H|1, Sk] f32 or None
    g, lse, di = xs  # [B, qc, H, D] compute dtype, [B, qc, H] f32 x2
    cdt = g.dtype
    s = _masked_logits(cfg, chunk)
    # lse = +inf on rows that see no key: p = 0 there, no nan.
    p = jnp.exp(s - lse[..., None])
    keep = _keep_scale(cfg, seed, chunk)
    p_dropped = p if keep is None else p * keep
    dv = _einsum(cfg, "bqhk,bqhd->bkhd", p_dropped.astype(cdt), g)
    dp = _einsum(cfg, "bqhd,bkhd->bqhk", g, v_c)
    if keep is not None:
        dp = dp * keep
    ds = p * (dp - di[..., None])  # d loss / d logits
    dq = dq + _einsum(cfg, "bqhk,bkhd->bqhd", ds.astype(cdt), chunk.k) * cfg.sm_scale
    dk = _einsum(cfg, "bqhk,bqhd->bkhd", ds.astype(cdt), chunk.q) * cfg.sm_scale
    if dbias is not None:
        # The bias is added after scaling, so d bias = d logits (reduced over
        # the dimensions the bias broadcasts).  Each (query chunk, key chunk)
        # pair owns a distinct slice, so an update (not an add) is exact.
        db = _sum_to_shape(ds, chunk.bias.shape)
        dbias = lax.dynamic_update_slice_in_dim(dbias, db, ik * cfg.key_chunk_size, axis=3)
    return (dq, dbias), (dk, dv)


def _blockwise_ring_fwd(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed):
    b, sq, h, d = q.shape
    sk = k.shape[1]
    num_q = sq // cfg.query_chunk_size
    ctx = _RingContext(q, bias, mask, q_seg, seed, lax.axis_index(cfg.axis_name) * sq)
    stats_shape = (num_q, b, cfg.query_chunk_size, h)
    state = _as_varying(
        (jnp.zeros((*stats_shape, d), _ACC_DTYPE),
         jnp.zeros(stats_shape, _ACC_DTYPE),
         jnp.full(stats_shape, -jnp.inf, _ACC_DTYPE)),
        cfg.axis_name,
    )

    def step(state, kv, kv_grads, kv_block):
        state, _ = _chunk_grid(cfg, ctx, kv, kv_block * sk,
                               functools.partial(_fwd_pair, cfg, seed), state, (), ())
        return state, kv_grads

    state, _ = _ring_loop(step, state, (k, v, kv_seg), (), axis_name=cfg.axis_name)
    acc, l, m = map(_from_chunks, state)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    # The backward's di = rowsum(dO * O) takes O before its rounding to q.dtype: a bfloat16 O
    # errs by ~2^-9 |O|, and where a row's weight is split between keys of distant values the
    # difference dP - di amplifies that into dq and dk (3x the naive attention's error).
    return out.astype(q.dtype), (q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse)


def _blockwise_ring_bwd(cfg, res, g):
    q, k, v, bias, mask, q_seg, kv_seg, seed, out, lse = res
    b, sq, h, d = q.shape
    sk = k.shape[1]
    qc, kc, ax = cfg.query_chunk_size, cfg.key_chunk_size, cfg.axis_name
    cdt = cfg.compute_dtype(q.dtype)
    ctx = _RingContext(q, bias, mask, q_seg, seed, lax.axis_index(ax) * sq)
    di = jnp.sum(g.astype(_ACC_DTYPE) * out, axis=-1)  # [B, Sq, H]; out is float32
    q_xs = (_to_chunks(g.astype(cdt), qc), _to_chunks(lse, qc), _to_chunks(di, qc))
    kv_out_shapes = (jax.ShapeDtypeStruct((b, kc, h, d), _ACC_DTYPE),) * 2

    # d bias is kept transposed like the bias chunks: [B|1, Sq|1, H|1, Sk_global].
    dbias_shape = None if bias is None else (bias.shape[0], bias.shape[2], bias.shape[1], bias.shape[3])
    dbias_block_shape = None
    if bias is not None:
        q_rows = qc if bias.shape[2] > 1 else 1
        dbias_block_shape = (sq // qc, bias.shape[0], q_rows, bias.shape[1], sk)

    def step(carry, kv, kv_grads, kv_block):
        dq, dbias = carry
        kv_offset = kv_block * sk
        dbias_block = None if bias is None else _zeros(dbias_block_shape, ax)
        (dq, dbias_block), (dk_c, dv_c) = _chunk_grid(
            cfg, ctx, kv, kv_offset, functools.partial(_bwd_pair, cfg, seed),
            (dq, dbias_block), q_xs, kv_out_shapes,
        )
        if bias is not None:
            # [num_q, B|1, qc|1, H|1, Sk] -> [B|1, Sq|1, H|1, Sk]
            block = dbias_block.sum(axis=0) if bias.shape[2] == 1 else _from_chunks(dbias_block)
            dbias = lax.dynamic_update_slice_in_dim(dbias, block, kv_offset, axis=3)
        dk, dv = kv_grads
        return (dq, dbias), (dk + _from_chunks(dk_c), dv + _from_chunks(dv_c))

    carry = (_zeros((sq // qc, b, qc, h, d), ax),
             None if bias is None else _zeros(dbias_shape, ax))
    kv_grads = (_zeros(k.shape, ax), _zeros(v.shape, ax))
    (dq, dbias), (dk, dv) = _ring_loop(step, carry, (k, v, kv_seg), kv_grads, axis_name=ax)
    if dbias is not None:
        dbias = jnp.transpose(dbias, (0, 2, 1, 3))
    return (
        _cotangent_like(_from_chunks(dq), q, ax),
        _cotangent_like(dk, k, ax),
        _cotangent_like(dv, v, ax),
        _cotangent_like(dbias, bias, ax),
        None, None, None, None,  # mask, segment ids and seed are not differentiable
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise_ring(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed):
    return _blockwise_ring_fwd(cfg, q, k, v, bias, mask, q_seg, kv_seg, seed)[0]


_blockwise_ring.defvjp(_blockwise_ring_fwd, _blockwise_ring_bwd)


def _dropout_rate(attn_pdrop, deterministic, dropout_rng):
    if deterministic or attn_pdrop == 0.0:
        return 0.0
    if not 0.0 < attn_pdrop < 1.0:
        raise ValueError(f"attn_pdrop must be in [0, 1); got {attn_pdrop}")
    if dropout_rng is None:
        raise ValueError("dropout needs dropout_rng when deterministic=False and attn_pdrop > 0")
    return float(attn_pdrop)


# --------------------------------------------------------------------------
# Ring flash core (Pallas TPU kernels of attncheck_kernels.flash_attention)
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _FlashConfig:
    axis_name: Any
    causal: bool
    sm_scale: float
    float32_logits: bool
    block_sizes: Any  # flash_attention.BlockSizes or None (fitted per call)
    vmem_limit_bytes: int | None

    def compute_dtype(self, dtype):
        return jnp.float32 if self.float32_logits else dtype

    def kernel_kwargs(self, q_offset, kv_offset):
        return dict(q_offset=q_offset, kv_offset=kv_offset, causal=self.causal,
                    sm_scale=self.sm_scale, block_sizes=self.block_sizes,
                    vmem_limit_bytes=self.vmem_limit_bytes)


def _heads_major(x):
    """[B, S, H, D] <-> [B, H, S, D] (the flash kernels' layout)."""
    return jnp.swapaxes(x, 1, 2)


def _flash_bias(cfg, bias, kv_offset, kv_len, ab_shape):
    """This kv block's bias in the kernel's convention, or None.

    The kernel computes ``(q.k + ab) * sm_scale`` while this module promises
    ``q.k * sm_scale + bias``, so ``ab = bias / sm_scale`` (in float32, so the
    division adds no bf16 rounding); the kernel wants the full [B, H, Q, K].
    """
    if bias is None:
        return None
    cols = _key_columns(bias, kv_offset, kv_len).astype(_ACC_DTYPE) / cfg.sm_scale
    return jnp.broadcast_to(cols, ab_shape)


def _flash_segments(q_seg, kv_seg):
    return None if q_seg is None else _flash.SegmentIds(q=q_seg, kv=kv_seg)


def _ring_flash_fwd(cfg, q, k, v, bias, q_seg, kv_seg):
    ax = cfg.axis_name
    b, sq, h, d = q.shape
    sk = k.shape[1]
    cdt = cfg.compute_dtype(q.dtype)
    q_h = _heads_major(q).astype(cdt)
    q_offset = lax.axis_index(ax) * sq

    def step(carry, kv, kv_grads, kv_block):
        k_h, v_h, kv_seg_blk = kv
        kv_offset = kv_block * sk
        carry = _flash.flash_attention_fwd_step(
            q_h, k_h.astype(cdt), v_h.astype(cdt),
            _flash_bias(cfg, bias, kv_offset, sk, (b, h, sq, sk)),
            _flash_segments(q_seg, kv_seg_blk), carry, **cfg.kernel_kwargs(q_offset, kv_offset))
        return carry, kv_grads

    # k/v rotate in their input dtype (half the traffic of float32 copies for bf16).
    carry = _as_varying(_flash.flash_attention_init_carry(q_h), ax)
    (o, l, m), _ = _ring_loop(step, carry, (_heads_major(k), _heads_major(v), kv_seg), (), axis_name=ax)
    l, m = l[..., 0], m[..., 0]
    # The kernel floors the running max at DEFAULT_MASK_VALUE and gives a
    # segment-masked key exactly that logit, so m > DEFAULT_MASK_VALUE iff the
    # row saw a visible key.  Rows that saw none (a query whose segment has no
    # key, or an all -inf bias row) follow this module's convention: output 0
    # and no gradient (the kernel alone would give the mean of v for the former).
    seen = m > _flash.DEFAULT_MASK_VALUE
    # As in the blockwise core, the backward's di takes the float32 output, before rounding.
    out_h = _flash.flash_attention_finalize((jnp.where(seen[..., None], o, 0.0), l, m), _ACC_DTYPE)
    return _heads_major(out_h.astype(q.dtype)), (q, k, v, bias, q_seg, kv_seg, out_h, l, m, seen)


def _ring_flash_bwd(cfg, res, g):
    q, k, v, bias, q_seg, kv_seg, out_h, l, m, seen = res
    ax = cfg.axis_name
    b, sq, h, d = q.shape
    sk = k.shape[1]
    cdt = cfg.compute_dtype(q.dtype)
    q_h = _heads_major(q).astype(cdt)
    q_offset = lax.axis_index(ax) * sq
    # Zero cotangent on rows that saw no key makes their dq, dk, dv, dbias
    # contributions vanish (dp = 0 and di = 0, so ds = 0).
    do = jnp.where(seen[..., None], _heads_major(g), 0.0).astype(cdt)
    di = jnp.sum(out_h * do.astype(_ACC_DTYPE), axis=-1)

    def step(carry, kv, kv_grads, kv_block):
        dq, dbias = carry
        k_h, v_h, kv_seg_blk = kv
        kv_offset = kv_block * sk
        args = (q_h, k_h.astype(cdt), v_h.astype(cdt),
                _flash_bias(cfg, bias, kv_offset, sk, (b, h, sq, sk)),
                _flash_segments(q_seg, kv_seg_blk), l, m, do, di)
        kwargs = cfg.kernel_kwargs(q_offset, kv_offset)
        dk_i, dv_i = _flash.flash_attention_bwd_dkv_step(*args, **kwargs)
        dq_out = _flash.flash_attention_bwd_dq_step(*args, **kwargs)
        if bias is None:
            dq_i = dq_out
        else:
            dq_i, dab = dq_out
            # ab = bias / sm_scale  =>  d bias = d ab / sm_scale.
            block = _sum_to_shape(dab.astype(_ACC_DTYPE), (*bias.shape[:3], sk)) / cfg.sm_scale
            dbias = lax.dynamic_update_slice_in_dim(dbias, block, kv_offset, axis=3)
        dk, dv = kv_grads
        return (dq + dq_i, dbias), (dk + dk_i, dv + dv_i)

    carry = (_zeros(q_h.shape, ax), None if bias is None else _zeros(bias.shape, ax))
    kv_grads = (_zeros((b, h, sk, d), ax), _zeros((b, h, sk, d), ax))
    (dq, dbias), (dk, dv) = _ring_loop(
        step, carry, (_heads_major(k), _heads_major(v), kv_seg), kv_grads, axis_name=ax)
    return (
        _cotangent_like(_heads_major(dq), q, ax),
        _cotangent_like(_heads_major(dk), k, ax),
        _cotangent_like(_heads_major(dv), v, ax),
        _cotangent_like(dbias, bias, ax),
        None, None,  # segment ids are not differentiable
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_flash(cfg, q, k, v, bias, q_seg, kv_seg):
    return _ring_flash_fwd(cfg, q, k, v, bias, q_seg, kv_seg)[0]


_ring_flash.defvjp(_ring_flash_fwd, _ring_flash_bwd)


# --------------------------------------------------------------------------
# Public per-device functions (call inside shard_map)
# --------------------------------------------------------------------------


def _validate_ring_inputs(q, k, v, extra_name, extra, segment_ids, axis_name):
    """Checks shared by every public variant; returns (q_seg, kv_seg).

    ``extra`` is the query-major ``attn_bias`` (float) or ``attn_mask`` (bool).
    """
    _check_qkv(q, k, v)
    b, sq, h, _ = q.shape
    _check_query_major(extra_name, extra, batch=b, heads=h, q_len=sq,
                       kv_len_global=k.shape[1] * lax.axis_size(axis_name),
                       dtype_kind="bool" if extra_name == "attn_mask" else "float")
    return _split_segment_ids(segment_ids, q, k)


def ring_attention(
    q, k, v, attn_bias=None, segment_ids=None, *,
    axis_name, causal=False, query_chunk_size=None, key_chunk_size=None,
    sm_scale=None, float32_logits=True,
    dropout_rng=None, attn_pdrop=0.0, deterministic=True, precision=None,
):
    """Blockwise ring attention (pure JAX); per-device, inside shard_map.

    Args:
      q, k, v: ``[batch, seq_local, heads, head_dim]``.
      attn_bias: optional float ``[batch|1, heads|1, q_local|1, kv_global]``
        (sharded on queries, replicated on keys), added after scaling.
      segment_ids: optional int ``[batch, seq_local]`` or a ``(q, kv)`` pair.
      axis_name: the 1-D mesh axis the sequence is sharded over.
      causal: global causal masking; fully hidden chunk pairs are skipped.
      query_chunk_size, key_chunk_size: chunking inside each ring step
        (default: the whole local length); must divide the local lengths.
      sm_scale: logit scale, default ``1 / sqrt(head_dim)``.
      float32_logits: upcast matmul operands to float32.
      dropout_rng, attn_pdrop, deterministic: attention-probability dropout.
      precision: ``lax.Precision`` for the matmuls.

    Returns ``[batch, q_local, heads, head_dim]`` in ``q.dtype``.

    There is no remat ``policy`` argument (the seed had one): the custom VJP's
    backward recomputes every chunk from ``(q, k, v, out, logsumexp)``, and
    JAX never differentiates the forward, so ``jax.checkpoint`` inside would
    change nothing.  Memory is O(chunk^2) per step either way.
    """
    q_seg, kv_seg = _validate_ring_inputs(q, k, v, "attn_bias", attn_bias, segment_ids, axis_name)
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    qc = sq if query_chunk_size is None else query_chunk_size
    kc = sk if key_chunk_size is None else key_chunk_size
    _check_chunk("query_chunk_size", qc, sq, "query")
    _check_chunk("key_chunk_size", kc, sk, "key")
    rate = _dropout_rate(attn_pdrop, deterministic, dropout_rng)
    seed = _dropout_seed(dropout_rng) if rate else None
    cfg = _BlockwiseConfig(axis_name, bool(causal), qc, kc, _default_scale(sm_scale, d),
                           bool(float32_logits), rate, precision)
    return _blockwise_ring(cfg, q, k, v, attn_bias, None, q_seg, kv_seg, seed)


def ring_attention_standard(
    q, k, v, attn_mask=None, *, axis_name, float32_logits=True, sm_scale=None, precision=None,
):
    """Mask-based ring attention, one un-chunked block per ring step.

    ``attn_mask``: optional bool ``[batch|1, heads|1, q_local|1, kv_global]``
    (True = attend; sharded on queries, replicated on keys).  Rows with no
    visible key return 0.  Per-device, inside shard_map.
    """
    _validate_ring_inputs(q, k, v, "attn_mask", attn_mask, None, axis_name)
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    cfg = _BlockwiseConfig(axis_name, False, sq, sk, _default_scale(sm_scale, d),
                           bool(float32_logits), 0.0, precision)
    return _blockwise_ring(cfg, q, k, v, None, attn_mask, None, None, None)


def ring_flash_attention_tpu(
    q, k, v, attn_bias=None, segment_ids=None, *,
    axis_name, causal=False, sm_scale=None, float32_logits=True,
    block_sizes=None, vmem_limit_bytes=None,
):
    """Ring attention with the Pallas TPU flash kernels; per-device, inside shard_map.

    Same conventions as :func:`ring_attention` (layout ``[batch, seq, heads,
    head_dim]``, ``q.k * sm_scale + bias``, bias/segment-id sharding, rows
    with no visible key -> 0) without chunking or dropout.  The kernels
    require (per device): head_dim a multiple of 128 or exactly 64, kv length
    a multiple of 128, q length a multiple of 8, float32 or bfloat16.

    Args:
      block_sizes: ``flash_attention.BlockSizes`` for one (q block, kv block)
        pair of per-device lengths, or None for the kernel's defaults (a kv
        block of 128/256/512 tokens then takes the single-step path).
      vmem_limit_bytes: scoped VMEM limit for the kernels (None: their default).
    """
    q_seg, kv_seg = _validate_ring_inputs(q, k, v, "attn_bias", attn_bias, segment_ids, axis_name)
    scale = _default_scale(sm_scale, q.shape[3])
    if attn_bias is not None and scale == 0.0:
        raise ValueError("sm_scale must be non-zero with attn_bias: the kernel adds the bias "
                         "before scaling, so it is passed as attn_bias / sm_scale")
    cfg = _FlashConfig(axis_name, bool(causal), scale, bool(float32_logits),
                       block_sizes, vmem_limit_bytes)
    return _ring_flash(cfg, q, k, v, attn_bias, q_seg, kv_seg)


# --------------------------------------------------------------------------
# Convenience wrappers over global arrays
# --------------------------------------------------------------------------


def _ring_mesh(num_devices, mesh, axis_name):
    if mesh is not None:
        if tuple(mesh.axis_names) != (axis_name,):
            raise ValueError(f"mesh must be 1-D with axis {axis_name!r}; got axes {mesh.axis_names}")
        if num_devices is not None and mesh.size != num_devices:
            raise ValueError(f"num_devices={num_devices} disagrees with the mesh size {mesh.size}")
        return mesh
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"num_devices={n} but {len(devices)} devices are available")
    return Mesh(np.array(devices[:n]), (axis_name,))


def _seq_spec(x, axis_name):
    """[batch, seq, ...] arrays and segment-id pytrees: sharded on seq."""
    return None if x is None else jax.tree.map(lambda _: P(None, axis_name), x)


def _query_major_spec(x, axis_name):
    """Bias/mask: sharded on the query axis, or replicated if it broadcasts."""
    if x is None:
        return None
    return P() if x.ndim == _QUERY_MAJOR_NDIM and x.shape[2] == 1 else P(None, None, axis_name, None)


def _shard_over_sequence(per_device, args, in_specs, *, num_devices, mesh, axis_name, check_vma):
    """Runs ``per_device(*args)`` under shard_map; output sharded on seq."""
    mesh = _ring_mesh(num_devices, mesh, axis_name)
    n = mesh.size
    for name in ("q", "k", "v"):
        x = args[name]
        if x.ndim != 4 or x.shape[1] % n:
            raise ValueError(
                f"{name} must be [batch, seq, heads, head_dim] with seq divisible by the "
                f"{n} devices; got shape {x.shape}"
            )
    fn = jax.shard_map(
        lambda kw: per_device(**kw), mesh=mesh,
        in_specs=({key: in_specs[key] for key in args},), out_specs=P(None, axis_name),
        check_vma=check_vma,
    )
    return fn(args)


def ring_attention_sharded(
    q, k, v, attn_bias=None, segment_ids=None, *, num_devices=None, mesh=None,
    axis_name=DEFAULT_AXIS_NAME, check_vma=True, dropout_rng=None, **kwargs,
):
    """:func:`ring_attention` on global ``[batch, seq, heads, head_dim]`` arrays.

    ``attn_bias`` is global ``[batch|1, heads|1, seq_q|1, seq_kv]``,
    ``segment_ids`` global ``[batch, seq]`` (or a ``(q, kv)`` pair).  Runs over
    the first ``num_devices`` devices (default: all) or over ``mesh``.
    ``kwargs`` go to :func:`ring_attention`.
    """
    args = dict(q=q, k=k, v=v, attn_bias=attn_bias, segment_ids=segment_ids, dropout_rng=dropout_rng)
    specs = dict(q=_seq_spec(q, axis_name), k=_seq_spec(k, axis_name), v=_seq_spec(v, axis_name),
                 attn_bias=_query_major_spec(attn_bias, axis_name),
                 segment_ids=_seq_spec(segment_ids, axis_name),
                 dropout_rng=None if dropout_rng is None else P())
    return _shard_over_sequence(
        functools.partial(ring_attention, axis_name=axis_name, **kwargs), args, specs,
        num_devices=num_devices, mesh=mesh, axis_name=axis_name, check_vma=check_vma)


def ring_attention_standard_sharded(
    q, k, v, attn_mask=None, *, num_devices=None, mesh=None,
    axis_name=DEFAULT_AXIS_NAME, check_vma=True, **kwargs,
):
    """:func:`ring_attention_standard` on global arrays (see :func:`ring_attention_sharded`)."""
    args = dict(q=q, k=k, v=v, attn_mask=attn_mask)
    specs = dict(q=_seq_spec(q, axis_name), k=_seq_spec(k, axis_name), v=_seq_spec(v, axis_name),
                 attn_mask=_query_major_spec(attn_mask, axis_name))
    return _shard_over_sequence(
        functools.partial(ring_attention_standard, axis_name=axis_name, **kwargs), args, specs,
        num_devices=num_devices, mesh=mesh, axis_name=axis_name, check_vma=check_vma)


def ring_flash_attention_tpu_sharded(
    q, k, v, attn_bias=None, segment_ids=None, *, num_devices=None, mesh=None,
    axis_name=DEFAULT_AXIS_NAME, check_vma=True, **kwargs,
):
    """:func:`ring_flash_attention_tpu` on global arrays (see :func:`ring_attention_sharded`)."""
    args = dict(q=q, k=k, v=v, attn_bias=attn_bias, segment_ids=segment_ids)
    specs = dict(q=_seq_spec(q, axis_name), k=_seq_spec(k, axis_name), v=_seq_spec(v, axis_name),
                 attn_bias=_query_major_spec(attn_bias, axis_name),
                 segment_ids=_seq_spec(segment_ids, axis_name))
    return _shard_over_sequence(
        functools.partial(ring_flash_attention_tpu, axis_name=axis_name, **kwargs), args, specs,
        num_devices=num_devices, mesh=mesh, axis_name=axis_name, check_vma=check_vma)
