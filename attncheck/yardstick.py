"""The yardstick: naive XLA attention in the kernel's working precision.

It is what a careful user would write without a kernel: logits accumulated in float32 from
inputs in their own dtype, a float32 softmax, probabilities rounded to the value dtype for
the second matmul, the output rounded to the input dtype; gradients by ``jax.vjp`` of that.
Its distance to the float64 oracle says how much error the working precision itself
costs, which is what the tolerance is scaled by. It is NOT an oracle.

It is written in the family's own layout (``seq_major``: [B, S, H, D] as the ring kernels
take it, else [B, H, S, D]): XLA's CPU dot accumulates differently per layout, by several
times on float32 cases of large logits. A yardstick in another layout than the kernel's
measures the layout, not the kernel.

Its backward is the textbook attention backward every kernel here implements (Dao et
al.): P recomputed as exp(S - LSE), dS = P * (dP - rowsum(dO * O)) with O the delivered
output. S itself is recomputed too, summing the head dim in reverse: a kernel recomputes
its logits in its backward's tiles, and XLA's CPU dot may round another tile shape
otherwise (at head dim 256 most of the logits differ; whether tiles agree at 64 and 128 is
the dot library's choice, not a promise), so its P is not normalised by its own logits. A
flash backward in other tiles than its forward's is then several times further from the
oracle in dv than in the forward's tiles: a yardstick reusing its forward's logits is as
close as the latter and fails the former.

Autodiff of softmax reuses the forward's P and computes rowsum(dP * P), which on float32
cases of large logits is several times more accurate than rowsum(dO * O) and the
recomputed P: a yardstick for a different algorithm.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

# Finite, so fully masked rows become a uniform softmax (the "mean_of_v" convention) and
# never a NaN that a jnp.where would still leak into gradients.
_MASKED_LOGIT = -1e30
# A key that takes no part: underflows against any other logit, the mask value included,
# so a row with fallback keys (the logits a kernel replaces by its mask value) averages
# them alone.
_HIDDEN_LOGIT = -3e38


_ORDER = threading.local()
# The summation orders every yardstick is computed in (``check._yardsticks``): the
# tolerance scales by the largest error of them. One order's worst error is one sample of
# what the working precision costs, and where few elements carry the error (a gradient
# that cancels over a handful of keys) the sample is noisy: the given and the reversed
# order alone may both land far below what other orders of the same sum reach, and a
# correct kernel summing in one of those would fail.
ORDERS = 8


@contextlib.contextmanager
def summation_order(index: int):
    """Every yardstick computed inside sums in its ``index``-th order: 0 as given, 1 the
    reverse, others a seeded shuffle (``permutation``). The shared helpers permute queries,
    keys and head dims before the computation and restore them after it: the same
    arithmetic, another rounding, and a kernel sums in yet another order (tiles, blocks, a
    ring). A spec with a yardstick of its own permutes what it sums (``permute``,
    ``restore``) and may change how it sums (the blockwise FFN's dots term by term)."""
    previous = getattr(_ORDER, "index", 0)
    _ORDER.index = index
    try:
        yield
    finally:
        _ORDER.index = previous


def order() -> int:
    """The index of the summation order the yardstick is being computed in."""
    return getattr(_ORDER, "index", 0)


def permutation(n: int) -> np.ndarray | None:
    """The current order's permutation of n summed terms; None where it keeps them as given.
    A function of the order and n alone, so every array with an axis of n terms (keys in k,
    v and the bias) is permuted alike."""
    index = order()
    if index == 0 or n < 2:
        return None
    if index == 1:
        return np.arange(n)[::-1]
    return np.random.default_rng([index, n]).permutation(n)


def permute(x, *axes):
    """x with these axes in the current order (None stays None; an axis of 1, a broadcast
    one, stays)."""
    return _reorder(x, axes, inverse=False)


def restore(x, *axes):
    """x with these axes put back from the current order into the given one."""
    return _reorder(x, axes, inverse=True)


def _reorder(x, axes, *, inverse: bool):
    if x is None:
        return None
    x = np.asarray(x)
    for axis in axes:
        perm = permutation(x.shape[axis])
        if perm is not None:
            x = np.take(x, np.argsort(perm) if inverse else perm, axis=axis)
    return x


@contextlib.contextmanager
def exact():
    """Every yardstick computed inside computes its arithmetic in float64 (the spec's own
    mapping unchanged): what is left of its distance to the oracle is not rounding. A
    yardstick far from the oracle is trusted only when this one is close to it."""
    previous = getattr(_ORDER, "exact", False)
    _ORDER.exact = True
    try:
        with jax.enable_x64(True):
            yield
    finally:
        _ORDER.exact = previous


def _in_working_precision(*arrays):
    """The arrays as the yardstick computes with them: as given, or as float64 inside
    ``exact()`` (None stays None; a boolean mask stays boolean)."""
    if not getattr(_ORDER, "exact", False):
        return arrays
    return tuple(None if x is None or np.asarray(x).dtype == bool else np.asarray(x, dtype=np.float64)
                 for x in arrays)


def _accumulator(x):
    """float32 for float32 and narrower inputs (what a careful user accumulates in), else
    the input's own wider dtype (``exact()``)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def visibility(q_pos, kv_pos, *, causal, window=None, q_segment_ids=None, kv_segment_ids=None, mask=None):
    """[B|1, H|1, Q, K] bool: key j visible to query i (positions [Q] or [B, Q], segment ids
    [B|1, L]); ``mask``, an explicit bool [B|1, H|1, Q, K] (per-head masks), is ANDed in."""
    q_pos = np.asarray(q_pos)[..., :, None]
    kv_pos = np.asarray(kv_pos)[..., None, :]
    visible = np.ones(np.broadcast_shapes(q_pos.shape, kv_pos.shape), dtype=bool)
    if causal:
        visible &= kv_pos <= q_pos
    if window is not None:
        visible &= (q_pos - kv_pos) < window
    if q_segment_ids is not None:
        visible = visible & (np.asarray(q_segment_ids)[:, :, None] == np.asarray(kv_segment_ids)[:, None, :])
    visible = visible.reshape((-1,) + visible.shape[-2:]) if visible.ndim == 3 else visible[None]
    return visible[:, None] if mask is None else visible[:, None] & np.asarray(mask, dtype=bool)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _softmax_times_v(s, s_again, v, multiplier, seq_major):
    """softmax(s) * multiplier (inverted dropout, else 1) times v; ``s_again``, the same
    logits computed in another summation order, is what the backward recomputes P from."""
    return _softmax_times_v_fwd(s, s_again, v, multiplier, seq_major)[0]


def _softmax_times_v_fwd(s, s_again, v, multiplier, seq_major):
    p_raw = jax.nn.softmax(s, axis=-1)
    p = p_raw * multiplier
    if seq_major:
        out = jnp.einsum("bqhk,bkhd->bqhd", p.astype(v.dtype).swapaxes(1, 2), v.swapaxes(1, 2),
                         preferred_element_type=_accumulator(v)).swapaxes(1, 2)
    else:
        out = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=_accumulator(v))
    return out, (s_again, jax.nn.logsumexp(s, axis=-1, keepdims=True), v, multiplier, out.astype(v.dtype))


def _softmax_times_v_bwd(seq_major, residuals, d_out):
    s, lse, v, multiplier, out = residuals
    # P is recomputed from the logits and the log-sum-exp, as flash backward kernels do. A
    # row without visible keys has lse = its (mask) logit + log n, which rounds to the logit
    # in float32 and would make its P 1 instead of 1/n: its uniform P over the n keys at
    # its maximum is written as such.
    row_max = jnp.max(s, axis=-1, keepdims=True)
    at_max = s == row_max
    p_raw = jnp.where(row_max <= _MASKED_LOGIT, at_max / jnp.sum(at_max, axis=-1, keepdims=True), jnp.exp(s - lse))
    acc = _accumulator(v)
    d_out = d_out.astype(acc)
    dv = jnp.einsum("bhqk,bhqd->bhkd", (p_raw * multiplier).astype(v.dtype), d_out.astype(v.dtype),
                    preferred_element_type=acc).astype(v.dtype)
    dp = jnp.einsum("bhqd,bhkd->bhqk", d_out.astype(v.dtype), v, preferred_element_type=acc)
    # rowsum(dO * O) from its rounded products, apart from dP's dot (fused multiply-adds):
    # a kernel computes it apart from its dP tiles, and where a row's weight sits on one key
    # dP - rowsum(dO * O) is then a rounding of 0, not 0 (the barrier keeps XLA from fusing
    # the products into the sum, which rounds as the dot does).
    delta = jnp.sum(jax.lax.optimization_barrier(d_out * out.astype(acc)), axis=-1, keepdims=True)
    # With weights W = P*M: dS = P * (M*dP - rowsum(dO*O)), since rowsum(W*dP) = dO.O.
    return p_raw * (multiplier * dp - delta), jnp.zeros_like(s), dv, jnp.zeros_like(multiplier)


_softmax_times_v.defvjp(_softmax_times_v_fwd, _softmax_times_v_bwd)


# The scale and the soft cap are traced, not static: drawn cases use several values of each,
# and one compile per value would multiply the yardstick's compiles.
@functools.partial(jax.jit, static_argnames=("masked_rows", "seq_major"))
def _attention(q, k, v, ab, bias, visible, multiplier=None, fallback=None, *, scale, soft_cap, masked_rows,
               seq_major=False):
    group = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    acc = _accumulator(q)

    def logits(q, k):
        if seq_major:
            s = jnp.einsum("bqhd,bkhd->bqhk", q.swapaxes(1, 2), k.swapaxes(1, 2),
                           preferred_element_type=acc).swapaxes(1, 2)
        else:
            s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=acc)
        if ab is not None:  # bias added before the scale (flash's (q.k + ab) * scale)
            s = s + ab.astype(acc)
        s = s * scale
        if bias is not None:
            s = s + bias.astype(acc)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        # A fallback key's logit is replaced as a kernel does with its mask value (s + mask
        # value rounds to it in float32) while its derivative still flows through s.
        hidden = _MASKED_LOGIT if fallback is None else jnp.where(fallback, s + _MASKED_LOGIT, _HIDDEN_LOGIT)
        return jnp.where(visible, s, hidden)

    s = logits(q, k)
    # The backward's logits sum the head dim in reverse: a kernel recomputes them in its
    # backward's tiles, which round otherwise than its forward's.
    s_again = jax.lax.stop_gradient(logits(jnp.flip(q, -1), jnp.flip(k, -1)))
    multiplier = jnp.ones((), acc) if multiplier is None else multiplier.astype(acc)
    out = _softmax_times_v(s, s_again, v, multiplier, seq_major)
    if masked_rows == "zero":
        seen = visible if fallback is None else visible | fallback
        out = jnp.where(jnp.any(seen, axis=-1)[..., None], out, 0.0)
    return out.astype(q.dtype)


def attention(q, k, v, *, scale, ab=None, bias=None, visible=None, soft_cap=None,
              masked_rows="mean_of_v") -> np.ndarray:
    """Yardstick forward output only."""
    q, k, v, ab, bias = _in_working_precision(q, k, v, ab, bias)
    if visible is None:
        visible = np.ones((1, 1, q.shape[2], k.shape[2]), dtype=bool)
    qkv = [permute(x, 2, 3) for x in (q, k, v)]
    pairs = [permute(x, -2, -1) for x in (ab, bias, visible)]
    out = np.asarray(_attention(*qkv, *pairs, scale=scale, soft_cap=soft_cap, masked_rows=masked_rows))
    return restore(out, 2, 3)


def attention_with_grads(q, k, v, d_out, *, scale, ab=None, bias=None, visible=None, fallback=None, soft_cap=None,
                         masked_rows="mean_of_v", seq_major=False, dropout_multiplier=None) -> dict[str, np.ndarray]:
    """Yardstick output and gradients ("out", "dq", "dk", "dv", and "dab"/"dbias" if given);
    ``fallback``: the keys a row with no visible key averages (the oracle's fallback)."""
    q, k, v, d_out, ab, bias, dropout_multiplier = _in_working_precision(q, k, v, d_out, ab, bias, dropout_multiplier)
    if visible is None:
        visible = np.ones((1, 1, q.shape[2], k.shape[2]), dtype=bool)
    names = ["dq", "dk", "dv"] + (["dab"] if ab is not None else []) + (["dbias"] if bias is not None else [])
    # [B, H, S, D] arrays permute S and D; [.., Q, K] ones Q and K (a broadcast axis of 1 stays).
    seqs = [permute(x, 2, 3) for x in (q, k, v, d_out)]
    pairs = [permute(x, -2, -1) for x in (ab, bias, visible, dropout_multiplier, fallback)]
    ab, bias, visible, dropout_multiplier, fallback = pairs
    out, grads = _forward_and_grads(*seqs[:3], ab, bias, visible, dropout_multiplier, fallback, seqs[3], scale=scale,
                                    soft_cap=soft_cap, masked_rows=masked_rows, seq_major=seq_major)
    result = {"out": np.asarray(out)}
    result.update({n: np.asarray(g) for n, g in zip(names, grads)})
    return {n: restore(x, -2, -1) if n in ("dab", "dbias") else restore(x, 2, 3) for n, x in result.items()}


@functools.partial(jax.jit, static_argnames=("masked_rows", "seq_major"))
def _forward_and_grads(q, k, v, ab, bias, visible, multiplier, fallback, d_out, *, scale, soft_cap, masked_rows,
                       seq_major):
    """One compiled forward + VJP per shape and configuration: tracing the VJP per case
    would outweigh the rest of the harness's own time."""
    def f(q, k, v, ab, bias):
        return _attention(q, k, v, ab, bias, visible, multiplier, fallback, scale=scale, soft_cap=soft_cap,
                          masked_rows=masked_rows, seq_major=seq_major)

    differentiable = [x for x in (ab, bias) if x is not None]

    def g(q, k, v, *extra):
        rest = list(extra)
        return f(q, k, v, rest.pop(0) if ab is not None else None, rest.pop(0) if bias is not None else None)

    out, vjp = jax.vjp(g, q, k, v, *differentiable)
    return out, vjp(d_out.astype(out.dtype))
