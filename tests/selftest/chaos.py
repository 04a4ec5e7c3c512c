"""Misbehaving implementations of the toy conventions, for the reliability self-tests.

Each has the toy family's calling convention ``fn(q, k, v, *, causal, sm_scale)`` and
breaks the gate's assumptions in one way: it hangs (while tracing, inside a jax host
callback, or inside a host callback behind interpret-mode Pallas kernels, where XLA runs
it off the main thread as it runs an interpreted kernel's deadlock), kills its process, returns the wrong
shape, dtype or structure, returns NaN everywhere, raises with markup in its message, or
handles invalid input its own way (accepts it, rejects it vaguely, or with its own
exception class); or it is correct and slow, each case inside the limit and its test past it.
Those that kill their process do it on their ``MISBEHAVE_AT``-th case, after earlier cases
recorded normally; they run eagerly so that their N-th call is the N-th case. Those that
hang reject invalid inputs first, as the convention requires (the gate's invalid-input tests
call them too): they misbehave in one way only.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tests.selftest import toy_spec
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


# If set, the file hang_behind_pallas's callback writes the name of the thread it runs on.
CALLBACK_THREAD_ENV = "ATTNCHECK_CHAOS_CALLBACK_THREAD"


def _doubled(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def _interpreted(x):
    """A real Pallas kernel in TPU interpret mode, over a grid of 8-row blocks."""
    return pl.pallas_call(_doubled, grid=(x.shape[0] // 8,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=pltpu.InterpretParams())(x)


def _forever_off_the_main_thread(*_):
    if path := os.environ.get(CALLBACK_THREAD_ENV):
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{threading.current_thread() is threading.main_thread()}\n")
    _forever()


def hang_behind_pallas(q, k, v, *, causal: bool, sm_scale: float):
    """On each of 2 simulated devices, an interpret-mode Pallas kernel, then a host callback
    that never returns. XLA runs a program of several devices on threads of its own while
    the main thread waits in native code for them (with jax 0.12 the callbacks' threads
    are never the main one), as it does a ring kernel whose interpreted DMA or
    semaphore wait hangs: pytest-timeout's SIGALRM never reaches the test, and only the
    watchdog ends it."""
    validate(q, k, v)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("devices",))

    def per_device(x):
        done = _interpreted(x)
        return jax.pure_callback(_forever_off_the_main_thread, jax.ShapeDtypeStruct(done.shape, done.dtype), done)

    x = jax.lax.stop_gradient(jnp.broadcast_to(q.sum().astype(jnp.float32), (16, 128)))
    spec = jax.sharding.PartitionSpec("devices")
    stuck = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale) + jax.lax.stop_gradient(stuck.sum()).astype(q.dtype)


# How long each call of slow_in_callback waits (it is called once per case), well inside the
# self-tests' short limit; a test of its four drawn cases takes more than the limit.
SLOW_CALL_S = 2.0


def _wait(x):
    time.sleep(SLOW_CALL_S)
    return x


def slow_in_callback(q, k, v, *, causal: bool, sm_scale: float):
    """Correct, and slow in a host callback on every call: a case takes a fraction of the
    limit, its test more than all of it."""
    validate(q, k, v)
    wait = jax.pure_callback(_wait, jax.ShapeDtypeStruct((), jnp.float32), jnp.zeros((), jnp.float32))
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale) + jax.lax.stop_gradient(wait).astype(q.dtype)


def _on_call(name: str, misbehave) -> None:
    _calls[name] += 1
    if _calls[name] >= MISBEHAVE_AT:
        misbehave()


def exit_process(q, k, v, *, causal: bool, sm_scale: float):
    _on_call("exit", lambda: os._exit(13))
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


# What abort_process writes to file descriptor 2 before it aborts, as XLA does its reason.
NATIVE_LAST_WORDS = "F0000 00:00:00.000000 toy.cc:1] Check failed: the toy's native invariant"


def _abort_with_a_native_message() -> None:
    os.write(2, f"{NATIVE_LAST_WORDS}\n".encode())
    os.abort()


def abort_process(q, k, v, *, causal: bool, sm_scale: float):
    _on_call("abort", _abort_with_a_native_message)
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


# Set, deviates_on_causal is also wrong where its table declares nothing (a planted bug).
PLANT_ENV = "ATTNCHECK_CHAOS_PLANT"


def deviates_on_causal(q, k, v, *, causal: bool, sm_scale: float):
    """A kernel that knowingly deviates: wrong on causal cases (the scale applied twice), and
    it does not check the kv head dim (accepts that invalid call). With PLANT_ENV set, also
    wrong on non-causal bfloat16 cases."""
    if q.ndim != 4:
        raise ValueError(f"q must have rank 4 [batch, heads, seq, head_dim], got shape {q.shape}")
    wrong = causal or (os.environ.get(PLANT_ENV) and q.dtype == jnp.bfloat16)
    logits = toy_spec._logits(q, k, causal, sm_scale * (sm_scale if wrong else 1.0))
    return toy_spec._weighted(jax.nn.softmax(logits, axis=-1), v, q.dtype)


REFUSAL = "causal masking is not supported by this kernel"


def refuses_causal(q, k, v, *, causal: bool, sm_scale: float):
    """A kernel that refuses a configuration it does not support, by name (as tokamax's
    Pallas path refuses what it cannot tile); right on everything it runs."""
    if causal:
        raise NotImplementedError(f"{REFUSAL} (got causal={causal})")
    return toy_attention(q, k, v, causal=causal, sm_scale=sm_scale)


def refuses_everything(q, k, v, *, causal: bool, sm_scale: float):
    """A kernel that refuses every configuration: a run of it verifies nothing."""
    raise NotImplementedError(f"{REFUSAL} (nor anything else)")
