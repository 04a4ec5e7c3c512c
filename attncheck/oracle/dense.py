"""Float64 reference for dense multi-head attention and its VJP (NumPy only).

Shapes: q [B, Hq, Q, D], k [B, Hkv, K, D], v [B, Hkv, K, Dv], Hq % Hkv == 0.
Query head h reads kv head h // (Hq // Hkv) (GQA/MQA: consecutive query heads
share a kv head). Inputs (f32, bf16, fp8 via ml_dtypes, ...) are upcast exactly
to float64 and all arithmetic is float64: no kernel rounding is modelled.

    logits  = scale * q . (k * k_scale) + bias          (bias broadcasts to [B, Hq, Q, K])
    logits  = soft_cap * tanh(logits / soft_cap)        (only when soft_cap is given)
    out     = (softmax over visible keys of logits) * M, times (v * v_scale)

M is dropout_multiplier (default 1), broadcastable to [B, Hq, Q, K]: inverted dropout
passes keep / (1 - rate). It scales the weights given to v, not the normaliser (lse).
(k_scale and v_scale default to 1.)

Key j is visible to query i of query head h iff all of
    q_segment_ids[b, i] == kv_segment_ids[b, j]         (when segment ids are given)
    kv_pos[j] <= q_pos[i]                               (when causal)
    q_pos[i] - kv_pos[j] < window                       (when window is given)
    visible[b, h, i, j]                                 (when visible is given)
visible is an explicit boolean mask given as data: a 4-D bool array of shape
[B|1, Hq|1, Q|1, K|1] (an axis of length 1 broadcasts), so any mask (block-sparse,
per query head, key padding, a user's boolean mask) is expressed directly. Its head
axis counts query heads (with GQA, query heads sharing a kv head may see different keys).
Positions default to arange(Q) and arange(K) (top-left alignment); they and the
segment ids are integer arrays of shape [L] (shared by the batch) or [B, L],
compared in int64 (positions past 2**31 are fine).
Masked keys are excluded by selection, never by adding a large negative number,
so no overflow, NaN or warning can come from the mask itself.

Fully masked rows (no visible key) follow the convention named by masked_rows;
lse is -inf for them under every convention:
  "zero"      out = 0. Gradient: the row contributes nothing to dq, dk, dv, dbias.
  "mean_of_v" out = mean over all K keys of v * v_scale for that (batch, kv head):
              what a kernel computes when it adds a large finite negative mask value
              (all logits equal, so the softmax is uniform). Gradient: every key j
              gets dv[j] += v_scale * d_out_row / K; nothing reaches dq, dk or dbias
              (the mask value swamps the logits, so they have no influence).
  "nan"       out = NaN. Gradient: dq of that row is NaN; dk, dv and dbias get no
              contribution. It exists so a caller can declare such rows poisoned:
              any use of them downstream shows up as NaN instead of a silent value.

fallback (optional, a bool mask shaped like visible) names, for rows with no visible key,
the keys such a row averages instead: the keys a kernel hides by *replacing* their logit
with a large finite mask value (a segment mismatch) rather than dropping them (a causal
or window boundary, a -inf bias). Such a row's weights are uniform over its fallback keys
(the mask value absorbs the logits in the kernel's float32), and its gradient is the
softmax gradient at those uniform probabilities, flowing through the logits to q, k and
bias as an additive mask's does: dS = P * (dP - rowsum(P * dP)). Rows with neither
visible nor fallback keys follow masked_rows.
"""

import dataclasses
import math
import numbers

import numpy as np

MASKED_ROW_CONVENTIONS = ("zero", "mean_of_v", "nan")


@dataclasses.dataclass(frozen=True)
class AttentionResult:
    out: np.ndarray  # [B, Hq, Q, Dv] float64
    lse: np.ndarray  # [B, Hq, Q] float64 log-sum-exp of the (capped, masked) logits; -inf for fully masked rows
    fully_masked: np.ndarray  # [B, Hq, Q] bool: rows with no visible (and no fallback) key


@dataclasses.dataclass(frozen=True)
class _Problem:
    """Validated float64 inputs with k and v already scaled and expanded to query heads."""

    q: np.ndarray  # [B, Hq, Q, D]
    k: np.ndarray  # [B, Hq, K, D], k * k_scale
    v: np.ndarray  # [B, Hq, K, Dv], v * v_scale
    kv_head: np.ndarray  # [Hq] the kv head each query head reads
    kv_shape: tuple  # (B, Hkv, K): where dk and dv are summed back to
    bias: np.ndarray | None
    visible: np.ndarray  # [B, 1 or Hq, Q, K] bool
    fallback: np.ndarray | None  # [B|1, Hq|1, Q, K] bool: what a row with no visible key averages
    scale: float
    soft_cap: float | None
    k_scale: float
    v_scale: float
    masked_rows: str
    dropout_multiplier: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class _Forward:
    weights: np.ndarray  # [B, Hq, Q, K] what out averages v with (uniform on "mean_of_v" masked rows)
    probs: np.ndarray  # [B, Hq, Q, K] softmax over visible keys, all zero on fully masked rows
    tanh: np.ndarray | None  # tanh(logits / soft_cap), kept for the soft cap derivative
    result: AttentionResult


def _fail(name, expected, got):
    raise ValueError(f"{name}: expected {expected}, got {got}")


def _check_float_dtype(name, dtype):
    # ml_dtypes floats (bfloat16, float8_*) have kind "V"; their names say what they are.
    if not (dtype.kind == "f" or (dtype.kind == "V" and "float" in dtype.name)):
        _fail(name, "a floating-point array", f"dtype {dtype}")


def _float_array(name, x):
    a = np.asarray(x)
    _check_float_dtype(name, a.dtype)
    return np.asarray(a, dtype=np.float64)


def _int_array(name, x):
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        _fail(name, "an integer array", f"dtype {a.dtype}")
    return a.astype(np.int64)


def _real(name, x, *, positive=False):
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or (positive and x <= 0):
        _fail(name, f"a finite {'positive ' if positive else ''}real number", repr(x))
    return float(x)


def _positive_int(name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        _fail(name, "an integer >= 1", repr(x))
    return int(x)


def _per_batch(name, x, batch, length):
    a = _int_array(name, x)
    if a.shape not in ((length,), (batch, length)):
        _fail(name, f"shape ({length},) or ({batch}, {length})", f"shape {a.shape}")
    return np.broadcast_to(a, (batch, length))


def _explicit_mask(visible, full, name="visible"):
    """The visible= (or fallback=) argument: a 4-D bool array broadcastable to (B, Hq, Q, K)."""
    a = np.asarray(visible)
    if a.dtype != np.bool_:
        _fail(name, "a bool array", f"dtype {a.dtype}")
    if a.ndim != 4 or any(n not in (1, m) for n, m in zip(a.shape, full)):
        _fail(name, f"4-D [B|1, Hq|1, Q|1, K|1] with [B, Hq, Q, K] = {list(full)}", f"shape {a.shape}")
    return a


def _visibility(batch, q_len, kv_len, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal, window):
    if (q_segment_ids is None) != (kv_segment_ids is None):
        given = "q_segment_ids" if kv_segment_ids is None else "kv_segment_ids"
        _fail("q_segment_ids/kv_segment_ids", "both or neither", f"only {given}")
    if window is not None:
        window = _positive_int("window", window)
    q_pos = _per_batch("q_positions", np.arange(q_len) if q_positions is None else q_positions, batch, q_len)
    kv_pos = _per_batch("kv_positions", np.arange(kv_len) if kv_positions is None else kv_positions, batch, kv_len)
    q_pos, kv_pos = q_pos[:, :, None], kv_pos[:, None, :]
    visible = np.ones((batch, q_len, kv_len), dtype=bool)
    if q_segment_ids is not None:
        q_seg = _per_batch("q_segment_ids", q_segment_ids, batch, q_len)
        kv_seg = _per_batch("kv_segment_ids", kv_segment_ids, batch, kv_len)
        visible &= q_seg[:, :, None] == kv_seg[:, None, :]
    if causal:
        visible &= kv_pos <= q_pos
    if window is not None:
        visible &= q_pos - kv_pos < window
    return visible[:, None]


def _prepare(q, k, v, *, scale, bias=None, q_segment_ids=None, kv_segment_ids=None, q_positions=None,
             kv_positions=None, causal=False, window=None, visible=None, fallback=None, soft_cap=None,
             k_scale=None, v_scale=None, masked_rows="zero", dropout_multiplier=None):
    if masked_rows not in MASKED_ROW_CONVENTIONS:
        _fail("masked_rows", f"one of {MASKED_ROW_CONVENTIONS}", repr(masked_rows))
    q = _float_array("q", q)
    if q.ndim != 4:
        _fail("q", "4-D [B, Hq, Q, D]", f"shape {q.shape}")
    batch, q_heads, q_len, head_dim = q.shape
    k = _float_array("k", k)
    if k.ndim != 4 or k.shape[0] != batch or k.shape[3] != head_dim or k.shape[2] < 1 or k.shape[1] < 1 \
            or q_heads % k.shape[1]:
        _fail("k", f"4-D [B, Hkv, K, D] with B={batch}, D={head_dim} matching q, K >= 1 and Hkv dividing "
              f"Hq={q_heads}", f"shape {k.shape}")
    _, kv_heads, kv_len, _ = k.shape
    v = _float_array("v", v)
    if v.ndim != 4 or v.shape[:3] != k.shape[:3]:
        _fail("v", f"4-D [B, Hkv, K, Dv] with [B, Hkv, K] = {list(k.shape[:3])} matching k", f"shape {v.shape}")
    if bias is not None:
        bias = _float_array("bias", bias)
        full = (batch, q_heads, q_len, kv_len)
        if bias.ndim > 4 or any(n not in (1, m) for n, m in zip(bias.shape[::-1], full[::-1])):
            _fail("bias", f"an array broadcastable to [B, Hq, Q, K] = {list(full)}", f"shape {bias.shape}")
    if dropout_multiplier is not None:
        dropout_multiplier = _float_array("dropout_multiplier", dropout_multiplier)
        full = (batch, q_heads, q_len, kv_len)
        if dropout_multiplier.ndim > 4 or any(n not in (1, m) for n, m in zip(dropout_multiplier.shape[::-1],
                                                                             full[::-1])):
            _fail("dropout_multiplier", f"an array broadcastable to [B, Hq, Q, K] = {list(full)}",
                  f"shape {dropout_multiplier.shape}")
    k_scale = 1.0 if k_scale is None else _real("k_scale", k_scale)
    v_scale = 1.0 if v_scale is None else _real("v_scale", v_scale)
    kv_head = np.arange(q_heads) // (q_heads // kv_heads)
    rules = _visibility(batch, q_len, kv_len, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal,
                        window)
    if visible is not None:
        rules = rules & _explicit_mask(visible, (batch, q_heads, q_len, kv_len))
    if fallback is not None:
        fallback = _explicit_mask(fallback, (batch, q_heads, q_len, kv_len), "fallback")
    return _Problem(
        q=q,
        k=k[:, kv_head] * k_scale,
        v=v[:, kv_head] * v_scale,
        kv_head=kv_head,
        kv_shape=(batch, kv_heads, kv_len),
        bias=bias,
        visible=rules,
        fallback=fallback,
        scale=_real("scale", scale),
        soft_cap=None if soft_cap is None else _real("soft_cap", soft_cap, positive=True),
        k_scale=k_scale,
        v_scale=v_scale,
        masked_rows=masked_rows,
        dropout_multiplier=dropout_multiplier,
    )


def _forward(p):
    logits = p.scale * np.einsum("bhqd,bhkd->bhqk", p.q, p.k)
    if p.bias is not None:
        logits = logits + p.bias
    tanh = None
    if p.soft_cap is not None:
        tanh = np.tanh(logits / p.soft_cap)
        logits = p.soft_cap * tanh
    visible = np.broadcast_to(p.visible, logits.shape)
    fully_masked = ~visible.any(axis=-1)
    # The row max is -inf only on fully masked rows; replace it before any arithmetic.
    row_max = np.where(fully_masked, 0.0, np.max(logits, axis=-1, where=visible, initial=-np.inf))
    shifted = np.where(visible, logits - row_max[..., None], 0.0)
    exps = np.where(visible, np.exp(shifted), 0.0)
    denom = np.where(fully_masked, 1.0, exps.sum(axis=-1))
    probs = exps / denom[..., None]
    any_visible = ~fully_masked
    if p.fallback is not None:
        fallback = np.broadcast_to(p.fallback, logits.shape) & fully_masked[..., None]
        count = fallback.sum(axis=-1, keepdims=True)
        probs = np.where(fallback, 1.0 / np.maximum(count, 1), probs)
        fully_masked = fully_masked & (count[..., 0] == 0)
    weights = probs if p.dropout_multiplier is None else probs * p.dropout_multiplier
    if p.masked_rows == "mean_of_v":
        weights = np.where(fully_masked[..., None], 1.0 / p.k.shape[2], probs)
    out = np.einsum("bhqk,bhkd->bhqd", weights, p.v)
    if p.masked_rows == "nan":
        out = np.where(fully_masked[..., None], np.nan, out)
    # A fallback row's normaliser is not a sum over visible keys: its lse is -inf too.
    lse = np.where(any_visible, row_max + np.log(denom), -np.inf)
    return _Forward(weights, probs, tanh, AttentionResult(out, lse, fully_masked))


def _sum_to_shape(x, shape):
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    return x.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)


def _to_kv_heads(p, grad):
    """Sums a per-query-head gradient over the query heads that share each kv head."""
    total = np.zeros(p.kv_shape + grad.shape[3:])
    np.add.at(total, (slice(None), p.kv_head), grad)
    return total


def attention(q, k, v, **options) -> AttentionResult:
    """Forward pass. options: scale (required), bias, q_segment_ids, kv_segment_ids,
    q_positions, kv_positions, causal, window, visible, fallback, soft_cap, k_scale,
    v_scale, masked_rows, dropout_multiplier;
    see the module docstring for their meaning."""
    return _forward(_prepare(q, k, v, **options)).result


def attention_vjp(q, k, v, d_out, **options) -> dict:
    """Gradients of sum(d_out * attention(q, k, v, **options).out).

    Returns {"dq", "dk", "dv"} shaped like q, k, v, plus "dbias" summed down to
    bias's own shape when bias is given. Fully masked rows follow the convention
    in the module docstring.
    """
    p = _prepare(q, k, v, **options)
    fwd = _forward(p)
    d_out = _float_array("d_out", d_out)
    if d_out.shape != fwd.result.out.shape:
        _fail("d_out", f"shape [B, Hq, Q, Dv] = {fwd.result.out.shape} matching the output", f"shape {d_out.shape}")
    d_probs = np.einsum("bhqd,bhkd->bhqk", d_out, p.v)
    if p.dropout_multiplier is not None:
        d_probs = d_probs * p.dropout_multiplier
    # rowsum(P * dP) equals rowsum(d_out * out) on visible rows and, unlike it, stays 0
    # (not NaN or mean_of_v) on fully masked rows, whose probs are all zero anyway.
    d_logits = fwd.probs * (d_probs - np.sum(fwd.probs * d_probs, axis=-1, keepdims=True))
    if fwd.tanh is not None:
        d_logits = d_logits * (1.0 - fwd.tanh**2)
    dq = p.scale * np.einsum("bhqk,bhkd->bhqd", d_logits, p.k)
    if p.masked_rows == "nan":
        dq = np.where(fwd.result.fully_masked[..., None], np.nan, dq)
    grads = {
        "dq": dq,
        "dk": _to_kv_heads(p, p.scale * p.k_scale * np.einsum("bhqk,bhqd->bhkd", d_logits, p.q)),
        "dv": _to_kv_heads(p, p.v_scale * np.einsum("bhqk,bhqd->bhkd", fwd.weights, d_out)),
    }
    if p.bias is not None:
        grads["dbias"] = _sum_to_shape(d_logits, p.bias.shape)
    return grads
