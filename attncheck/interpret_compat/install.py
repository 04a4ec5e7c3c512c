"""How a patch changes jax: installed when the first block of its name opens, in any
thread, and undone when the last one exits. ``_lock`` also guards ``emulated_tpu``'s swap of
its reader modules' ``jax``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_lock = threading.RLock()
_open: dict[str, tuple[int, Callable[[], None]]] = {}  # name -> (open blocks, how to undo)


@contextlib.contextmanager
def _installed(name: str, install: Callable[[], Callable[[], None]]) -> Iterator[None]:
    """A change to jax made by ``install`` (which returns its undo) while any block of
    this name is open, in any thread: re-entrant, undone when the last block exits."""
    with _lock:
        depth, undo = _open.get(name, (0, None))
        _open[name] = (depth + 1, undo if depth else install())
    try:
        yield
    finally:
        with _lock:
            depth, undo = _open.pop(name)
            if depth > 1:
                _open[name] = (depth - 1, undo)
            else:
                undo()
