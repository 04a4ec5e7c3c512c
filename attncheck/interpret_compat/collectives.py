"""``ordered_collectives()`` (entered by ``Backend.context`` for a case on several
devices) with ``in_collective_order(fn)`` (applied by ``compiled.compiled``): every
collective runs in program order with the interpreted kernels, the same on every device;
without it a ring deadlocks now and then (see ``ordered_collectives``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator

import numpy as np

from attncheck.interpret_compat.install import _installed

# The collectives XLA lowers to a cross-device rendezvous (jax._src.lax.parallel).
COLLECTIVES = ("ppermute_p", "psum_p", "psum_invariant_p", "pmax_p", "pmin_p", "all_gather_p",
               "all_gather_invariant_p", "all_to_all_p", "ragged_all_to_all_p", "reduce_scatter_p")
# Primitives whose bodies are jaxpr parameters that binding does not trace again (a
# shard_map's body is: ``get_bind_params`` evaluates it).
_BODY_HOLDERS = (("jax._src.lax.control_flow.loops", "scan_p"), ("jax._src.lax.control_flow.loops", "while_p"),
                 ("jax._src.lax.control_flow.conditionals", "cond_p"), ("jax._src.pjit", "jit_p"))


def _ordered_token(*_) -> np.ndarray:
    return np.zeros((), np.int32)


def _after_ordered_effects(xs):
    """``xs``, recomputed from the result of an ordered host callback, so after every
    ordered effect before it (the interpreter's kernels begin and end with one). XLA's CPU
    runtime orders its work by buffers: the dependency must be a value (an optimization
    barrier keeps the same buffer and orders nothing at run time)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    token = io_callback(_ordered_token, jax.ShapeDtypeStruct((), np.int32), ordered=True)
    return [jnp.where(token == 0, x, jnp.zeros_like(x)) for x in xs]


def _before_ordered_effects(xs):
    """``xs``, after an ordered host callback that reads one element of each, so every
    ordered effect after it waits for ``xs``."""
    import jax
    from jax.experimental import io_callback

    io_callback(_ordered_token, jax.ShapeDtypeStruct((), np.int32), *(x.reshape(-1)[:1] for x in xs),
                ordered=True)
    return xs


def _ordered_collective(original):
    def bind(*args, **params):
        out = original(*_after_ordered_effects(args), **params)
        return _before_ordered_effects(out) if isinstance(out, (list, tuple)) else _before_ordered_effects([out])[0]

    return bind


def _retraced(value):
    """A jaxpr parameter traced again through ``core.eval_jaxpr``, so that the collectives
    in it are bound (and ordered) again; other values as they are."""
    from jax._src import core
    from jax._src import linear_util as lu
    from jax._src.interpreters import partial_eval as pe

    if isinstance(value, tuple):
        return tuple(_retraced(v) for v in value)
    if not isinstance(value, core.Jaxpr):
        return value
    fun = lu.wrap_init(lambda *args: core.eval_jaxpr(value, value.consts, *args), debug_info=value.debug_info)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fun, value.in_avals)
    return core.Jaxpr(jaxpr, consts)


def _body_holder(original):
    def bind(*args, **params):
        return original(*args, **{name: _retraced(value) for name, value in params.items()})

    return bind


def _patched_primitives():
    from jax._src.lax import parallel

    yield from ((getattr(parallel, name), _ordered_collective) for name in COLLECTIVES)
    yield from ((getattr(importlib.import_module(module), name), _body_holder) for module, name in _BODY_HOLDERS)


@contextlib.contextmanager
def _collectives_bound_in_order() -> Iterator[None]:
    def install():
        saved = [(primitive, primitive.bind) for primitive, _ in _patched_primitives()]
        for primitive, wrap in _patched_primitives():
            primitive.bind = wrap(primitive.bind)

        def undo():
            for primitive, bind in saved:
                primitive.bind = bind
        return undo

    with _installed("collectives_bound_in_order", install):
        yield


_ordering = threading.local()


@contextlib.contextmanager
def ordered_collectives() -> Iterator[None]:
    """Within the block, functions wrapped by ``in_collective_order`` run every collective
    (``COLLECTIVES``) in program order with the interpreted kernels around it, on every
    simulated device.

    The interpreter makes all devices meet at a barrier when a kernel starts and ends, a
    barrier XLA does not know about. XLA's CPU runtime may run a kernel and a collective
    that do not depend on each other in either order, and per device: in a ring, the
    rotation of the next block and the attention over the current one. When one device
    enters the kernel while the others enter the collective, each waits for the other
    forever, until XLA's rendezvous timeout aborts the process. Tying each collective
    between two ordered host callbacks puts it in the same total order as the kernels'
    own ordered callbacks, the same on every device."""
    depth = getattr(_ordering, "depth", 0)
    _ordering.depth = depth + 1
    try:
        yield
    finally:
        _ordering.depth = depth


def in_collective_order(fn: Callable) -> Callable:
    """``fn``, which under ``ordered_collectives`` is traced to a jaxpr (any derivative in
    it already taken), and that jaxpr evaluated again with every collective between two
    ordered host callbacks. Values and gradients are unchanged (no-op callbacks and a
    select that always picks the value); outside the block ``fn`` runs as it is."""
    import jax
    from jax._src import core

    @functools.wraps(fn)
    def ordered(*args):
        if not getattr(_ordering, "depth", 0):
            return fn(*args)
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        with _collectives_bound_in_order():
            flat = core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), flat)

    return ordered
