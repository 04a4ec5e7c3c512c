"""``host_callbacks()`` (entered by ``Backend.context``): the interpreter's host callbacks
take XLA's NumPy operands as they come, without jax's move of each onto a device and back
(most of an interpreted kernel's run time); see ``host_callbacks``. It also counts them
(``InterpretedCalls``): a Pallas kernel ran in the block only if the interpreter called
back, whatever was traced or cached before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator

import numpy as np

from attncheck.interpret_compat.install import _installed

# The interpreter's own io_callbacks: every interpreted kernel makes them (its buffers, loads,
# stores, DMAs), and nothing else does.
_INTERPRETER_MODULE = "jax._src.pallas.mosaic.interpret."
# Modules whose io_callbacks take XLA's operands as they come: the interpreter's, and this
# package's (the ref views' wrappers of the interpreter's loads and stores, the collective
# order's no-op tokens).
_INTERPRETER_CALLBACK_MODULES = (_INTERPRETER_MODULE, f"{__package__}.")


@dataclasses.dataclass
class InterpretedCalls:
    """How many host callbacks of the Pallas interpreter ran while a ``host_callbacks()``
    block was open (from any thread: the interpreter calls back on XLA's)."""

    count: int = 0

    @property
    def kernel_ran(self) -> bool:
        return self.count > 0


_counting: list[InterpretedCalls] = []
_counting_lock = threading.Lock()


def _count_interpreter_call() -> None:
    with _counting_lock:
        for calls in _counting:
            calls.count += 1


def _callback_module(callback) -> str:
    func = callback.callback_func
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__module__", None) or ""


@contextlib.contextmanager
def host_callbacks() -> Iterator[InterpretedCalls]:
    """Within the block, the interpreter's io_callbacks take their operands as the NumPy
    arrays XLA hands to a host callback; any other io_callback runs as jax runs it.

    jax's ``io_callback_impl`` first moves every operand onto a CPU device as a jax array
    (``device_put``), and the interpreter's callbacks turn each back into an int or a NumPy
    array (``int()``, ``np.asarray``): for an interpreted kernel, made of a callback per
    load, store, DMA and barrier, these two conversions are most of its run time.
    The interpreter copies whatever it keeps of an operand (``np.array`` in
    ``_allocate_buffer``, slice assignment in the stores), so an operand that is only valid
    during the call is never kept. jax's own function also enters the CPU device and empty
    meshes around the call; these callbacks compute in NumPy (``thread_map`` runs its jax
    in threads of its own), so that is left out too (it only adds time to every call)."""
    from jax._src import callback as jax_callback
    from jax._src import tree_util

    def install():
        original = jax_callback.io_callback_impl

        def io_callback_impl(*args, result_avals, callback, sharding, ordered):
            module = _callback_module(callback)
            if not module.startswith(_INTERPRETER_CALLBACK_MODULES):
                return original(*args, result_avals=result_avals, callback=callback, sharding=sharding,
                                ordered=ordered)
            if module.startswith(_INTERPRETER_MODULE):
                _count_interpreter_call()
            return tree_util.tree_map(np.asarray, callback(*args))

        jax_callback.io_callback_impl = io_callback_impl

        def undo():
            jax_callback.io_callback_impl = original
        return undo

    calls = InterpretedCalls()
    with _installed("host_callbacks", install):
        with _counting_lock:
            _counting.append(calls)
        try:
            yield calls
        finally:
            with _counting_lock:
                _counting.remove(calls)
