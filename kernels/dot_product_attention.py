"""jax.nn.dot_product_attention's calling convention on this project's flash kernel.

``dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
local_window_size=None)`` with query [B, T, N, H], key/value [B, S, K, H] (N a multiple
of K: query head n reads kv head n // (N // K)), bias and mask 4-D and broadcastable to
[B, N, T, S] (head axis 1 or N), lengths int32 [B], a window int w (= (w, w)) or
(left, right): key j is visible to query i iff i - left <= j <= i + right.

Semantics (jax.nn's): logits = scale * q.k + bias; key j is visible to query i iff the
mask, causal (top-left: j <= i, whatever T and S), the window and j < kv length allow it;
a query that sees no key outputs the mean of v over all S keys (the gradient of that
mean: nothing reaches q, k or bias); rows past a query length output 0.

A thin adapter: it pads to the kernel's tiles (T to a multiple of 8, S to one of 128, H
to 64 or a multiple of 128; zeros, sliced off again), repeats kv heads (autodiff sums
dk/dv back), and hands the kernel bias / |scale| as ``ab`` (the kernel computes
(q.k + ab) * sm_scale) with the sign of the scale on q (exact): a hidden key's MASKED_AB
must stay the lowest logit whatever the scale's sign, and a scale of 0 leaves the logits
equal to the bias, as jax.nn's (q is zeroed, sm_scale 1). Any visibility other than plain
causal over unpadded keys is folded into ``ab`` (MASKED_AB where a key is hidden, the
kernel run non-causal); rows that see no key are then replaced by an explicit mean of v,
which is jax.nn's value and gradient.
"""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp
import numpy as np

from attncheck_kernels import flash_attention as fa

# A hidden key's ab: the kernel's contract lets a -inf ab entry take no part, and a row whose
# keys are all hidden comes out 0 (replaced below by jax.nn's mean of v). A finite -1e30 did
# not survive a scale that is no power of two on CPU: XLA fuses the scale's product into the
# softmax's s - max(s), so a row of equal -1.01e30 logits had s - max(s) of about 1e22
# (the product's rounding error), and the padded query rows came out inf, their NaN
# gradients reaching every dk and dv.
MASKED_AB = -jnp.inf
DTYPES = (jnp.float32, jnp.bfloat16)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padded_head_dim(h: int) -> int:
    small = fa.SUPPORTED_SMALL_HEAD_DIMS[0]
    return small if h <= small else _round_up(h, fa.NUM_LANES)


def _validate(query, key, value, bias, mask, scale, query_seq_lengths, key_value_seq_lengths, local_window_size):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {getattr(x, 'shape', None)}")
    b, _, n, h = query.shape
    _, s, k, _ = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {value.shape} must equal key shape {key.shape}")
    if (query.shape[0], query.shape[3]) != (b, key.shape[3]) or key.shape[0] != b:
        raise ValueError(f"query shape {query.shape}: batch and head_dim must match key shape {key.shape}")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if query.dtype not in DTYPES:
        raise ValueError(f"query dtype {query.dtype} is not supported by the flash kernel (float32 or bfloat16)")
    if n % k:
        raise ValueError(f"query heads ({n}) must be a multiple of key/value heads ({k})")
    full = (b, n, query.shape[1], s)
    for name, x, floating in (("bias", bias, True), ("mask", mask, False)):
        if x is None:
            continue
        if getattr(x, "ndim", None) != 4 or any(d not in (1, f) for d, f in zip(x.shape, full)):
            raise ValueError(f"{name} must be 4-D and broadcastable to [B, N, T, S] = {list(full)}, "
                             f"got shape {getattr(x, 'shape', None)}")
        if jnp.issubdtype(x.dtype, jnp.floating) != floating or (not floating and x.dtype != jnp.bool_):
            raise ValueError(f"{name} dtype must be {'floating' if floating else 'bool'}, got {x.dtype}")
    for name, x in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is not None and (getattr(x, "shape", None) != (b,) or x.dtype != jnp.int32):
            raise ValueError(f"{name} must be int32 of shape ({b},), got {getattr(x, 'dtype', None)} "
                             f"{getattr(x, 'shape', None)}")
    window = (local_window_size,) * 2 if isinstance(local_window_size, numbers.Integral) else local_window_size
    if window is not None and (len(window) != 2 or any(not isinstance(w, numbers.Integral) or w < 0
                                                       for w in window)):
        raise ValueError(f"local_window_size must be an int >= 0 or a pair of them, got {local_window_size!r}")
    if scale is not None and (not isinstance(scale, numbers.Real) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return window


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None):
    window = _validate(query, key, value, bias, mask, scale, query_seq_lengths, key_value_seq_lengths,
                       local_window_size)
    b, t, n, h = query.shape
    s, k = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    sign, sm_scale = (math.copysign(1.0, scale), abs(scale)) if scale else (0.0, 1.0)
    t_pad, s_pad, h_pad = _round_up(t, fa.NUM_SUBLANES), _round_up(s, fa.NUM_LANES), _padded_head_dim(h)

    def heads_major(x, length, length_pad, repeat=1):  # [B, L, heads, H] -> padded [B, heads, L, H]
        x = jnp.repeat(x.transpose(0, 2, 1, 3), repeat, axis=1)
        return jnp.pad(x, ((0, 0), (0, 0), (0, length_pad - length), (0, h_pad - h)))

    q = heads_major(query if sign == 1.0 else query * jnp.asarray(sign, query.dtype), t, t_pad)
    kk, vv = (heads_major(x, s, s_pad, n // k) for x in (key, value))
    ab = None if bias is None else jnp.broadcast_to(bias.astype(jnp.float32) / sm_scale, (b, n, t, s))
    folded = mask is not None or window is not None or key_value_seq_lengths is not None or s_pad != s
    if folded:
        i, j = np.arange(t)[:, None], np.arange(s)[None, :]
        visible = jnp.ones((b, n, t, s), bool) if mask is None else jnp.broadcast_to(mask, (b, n, t, s))
        if is_causal:
            visible = visible & (j <= i)
        if window is not None:
            visible = visible & (i - window[0] <= j) & (j <= i + window[1])
        if key_value_seq_lengths is not None:
            visible = visible & (j[None] < key_value_seq_lengths[:, None, None])[:, None]
        ab = jnp.where(visible, 0.0 if ab is None else ab, MASKED_AB)
        ab = jnp.pad(ab, ((0, 0), (0, 0), (0, t_pad - t), (0, s_pad - s)), constant_values=MASKED_AB)
    elif ab is not None:
        ab = jnp.pad(ab, ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))
    out = fa.flash_attention(q, kk, vv, ab, None, causal=bool(is_causal) and not folded, sm_scale=sm_scale)
    out = out[:, :, :t, :h]
    if folded:
        mean_v = jnp.mean(vv[:, :, :s, :h].astype(jnp.float32), axis=2, keepdims=True)
        out = jnp.where(~visible.any(axis=-1)[..., None], mean_v.astype(out.dtype), out)
    out = out.transpose(0, 2, 1, 3)
    if query_seq_lengths is not None:
        out = out * (jnp.arange(t)[None, :] < query_seq_lengths[:, None])[:, :, None, None].astype(out.dtype)
    return out
