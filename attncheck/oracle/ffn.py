"""Float64 reference for the position-wise feed-forward network and its VJP (NumPy only).

    y = gelu(x @ w_in + b_in) @ w_out + b_out,   gelu(h) = h/2 * (1 + tanh(c * (h + 0.044715 h^3)))

with c = sqrt(2/pi): the tanh form, which is jax.nn.gelu's default (approximate=True).
x is [..., S, F]; every position is independent, so chunking must not change anything.
"""

from __future__ import annotations

import math

import numpy as np

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def _mm(a, b):
    """a @ b over the last axis of a, by NumPy's own loops: ``@`` calls the BLAS library,
    whose kernels (and so roundings) differ by the host's CPU; einsum's do not."""
    return np.einsum("...i,ij->...j", a, b)


def _gelu_and_derivative(h):
    inner = _GELU_C * (h + _GELU_CUBIC * h**3)
    t = np.tanh(inner)
    value = 0.5 * h * (1.0 + t)
    derivative = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t**2) * _GELU_C * (1.0 + 3.0 * _GELU_CUBIC * h**2)
    return value, derivative


def _f64(name, x, ndim=None):
    arr = np.asarray(x, dtype=np.float64)
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {arr.shape}")
    return arr


def _check(x, w_in, b_in, w_out, b_out):
    x = _f64("x", x)
    if x.ndim < 2:
        raise ValueError(f"x: expected [..., seq, features], got shape {x.shape}")
    w_in, w_out = _f64("w_in", w_in, 2), _f64("w_out", w_out, 2)
    if w_in.shape[0] != x.shape[-1]:
        raise ValueError(f"w_in: expected [{x.shape[-1]}, hidden] to match x's features, got {w_in.shape}")
    if w_out.shape[0] != w_in.shape[1]:
        raise ValueError(f"w_out: expected [{w_in.shape[1]}, out] to match w_in's hidden, got {w_out.shape}")
    b_in = None if b_in is None else _f64("b_in", b_in, 1)
    b_out = None if b_out is None else _f64("b_out", b_out, 1)
    if b_in is not None and b_in.shape != (w_in.shape[1],):
        raise ValueError(f"b_in: expected shape ({w_in.shape[1]},), got {b_in.shape}")
    if b_out is not None and b_out.shape != (w_out.shape[1],):
        raise ValueError(f"b_out: expected shape ({w_out.shape[1]},), got {b_out.shape}")
    return x, w_in, b_in, w_out, b_out


def feed_forward(x, w_in, b_in, w_out, b_out) -> np.ndarray:
    x, w_in, b_in, w_out, b_out = _check(x, w_in, b_in, w_out, b_out)
    h = _mm(x, w_in) + (0.0 if b_in is None else b_in)
    return _mm(_gelu_and_derivative(h)[0], w_out) + (0.0 if b_out is None else b_out)


def feed_forward_vjp(x, w_in, b_in, w_out, b_out, d_out) -> dict[str, np.ndarray]:
    """Gradients "dx", "dw_in", "dw_out" and "db_in"/"db_out" for the biases given."""
    x, w_in, b_in, w_out, b_out = _check(x, w_in, b_in, w_out, b_out)
    d_out = _f64("d_out", d_out)
    h = _mm(x, w_in) + (0.0 if b_in is None else b_in)
    a, da_dh = _gelu_and_derivative(h)
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731  (positions x features)
    dh = _mm(d_out, w_out.T) * da_dh
    grads = {"dx": _mm(dh, w_in.T), "dw_in": _mm(flat(x).T, flat(dh)), "dw_out": _mm(flat(a).T, flat(d_out))}
    if b_in is not None:
        grads["db_in"] = flat(dh).sum(axis=0)
    if b_out is not None:
        grads["db_out"] = flat(d_out).sum(axis=0)
    return grads
