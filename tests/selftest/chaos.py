"""Misbehaving implementations of the toy conventions, for the reliability self-tests.

Each has the toy family's calling convention ``fn(q, k, v, *, causal, sm_scale)`` and
breaks the gate's assumptions in one way: it hangs (while tracing, or inside a jax host
callback, as an interpret-mode deadlock does), kills its process, returns the wrong
shape, dtype or structure, returns NaN everywhere, raises with markup in its message, or
handles invalid input its own way (accepts it, rejects it vaguely, or with its own
exception class).
Those that kill their process do it on their ``MISBEHAVE_AT``-th case, after earlier cases
recorded normally; they run eagerly so that their N-th call is the N-th case. Those that
hang reject invalid inputs first, as the convention requires (the gate's invalid-input tests
call them too): they misbehave in one way only.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

from tests.selftest.toy_spec import toy_attention, validate

MISBEHAVE_AT = 2
HOSTILE_TEXT = "</td></tr></table><h1>PASS</h1><img src=x onerror=alert(1)> | `x` *y*"
_calls = {"exit": 0, "abort": 0}


def _forever(*_):
    while True:
        time.sleep(0.05)


def hang_while_tracing(q, k, v, *, causal: bool, sm_scale: float):
    validate(q, k, v)
    _forever()


def hang_in_callback(q, k, v, *, causal: bool, sm_scale: float):
    """The host callback never returns: pytest-timeout's exception is raised inside it and
    reaches the test wrapped in a jax runtime error."""
    validate(q, k, v)
    stuck = jax.pure_callback(_forever, jax.ShapeDtypeStruct((), jnp.float32), jnp.zeros((), jnp.float32))
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale) + jax.lax.stop_gradient(stuck).astype(q.dtype)


def _on_call(name: str, misbehave) -> None:
    _calls[name] += 1
    if _calls[name] >= MISBEHAVE_AT:
        misbehave()


def exit_process(q, k, v, *, causal: bool, sm_scale: float):
    _on_call("exit", lambda: os._exit(13))
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


def abort_process(q, k, v, *, causal: bool, sm_scale: float):
    _on_call("abort", os.abort)
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


exit_process.toy_eager = abort_process.toy_eager = True


def wrong_shape(q, k, v, *, causal: bool, sm_scale: float):
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)[..., :-1]


def wrong_dtype(q, k, v, *, causal: bool, sm_scale: float):
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale).astype(jnp.float16)


def returns_list(q, k, v, *, causal: bool, sm_scale: float):
    return [toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)]


def all_nan(q, k, v, *, causal: bool, sm_scale: float):
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale) * jnp.nan


def raises_markup(q, k, v, *, causal: bool, sm_scale: float):
    raise ValueError(f"toy kernel failed: {HOSTILE_TEXT}")


def accepts_invalid_inputs(q, k, v, *, causal: bool, sm_scale: float):
    """Validates nothing: an invalid call returns instead of raising."""
    return jnp.zeros(q.shape, q.dtype)


def rejects_vaguely(q, k, v, *, causal: bool, sm_scale: float):
    """Rejects invalid input without naming the argument."""
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError("invalid input")
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


class ToyInputError(Exception):
    """A third-party implementation's own exception class for bad input."""


def rejects_with_its_own_class(q, k, v, *, causal: bool, sm_scale: float):
    try:
        validate(q, k, v)
    except ValueError as exc:
        raise ToyInputError(str(exc)) from None
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)
