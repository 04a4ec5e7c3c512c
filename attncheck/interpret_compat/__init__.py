"""What Pallas TPU interpret mode (jax 0.12.0.1) cannot do by itself, made explicit.

Each patch is scoped to a ``with`` block that leaves jax exactly as it found it on exit
(``install``), one module each:

- ``generation``: ``emulated_tpu(device_kind)``, the TPU generation a backend emulates, for
  jax's kernels that ask ``jax.devices()`` which TPU they run on;
- ``views``: ``ref_views()``, loads, stores and DMAs through reshaped, bitcast and
  transposed refs, and masked stores the interpreter misjudges as out of bounds;
- ``grids``: ``vmapped_grids()``, a vmapped kernel's grid read with its vmapped dimensions
  parallel, as Mosaic lowers it;
- ``callbacks``: ``host_callbacks()``, the interpreter's host callbacks without jax's move
  of every operand onto a device and back, counted (``InterpretedCalls``: did a kernel run);
- ``collectives``: ``ordered_collectives()`` with ``in_collective_order(fn)``, every
  collective in program order with the interpreted kernels;
- ``races``: ``empty_accesses()``, the race detector's judgement of a zero-length access
  (it touches nothing).

``limitations`` names what interpret mode cannot run, and errors raised inside its
callbacks, in one line each. It imports nothing of jax, and the patches are imported on
first use of their names here, so the report classifies errors without loading them.
"""

from __future__ import annotations

import importlib

# Each name this package exports -> the module that defines it.
_EXPORTS = {
    "emulated_tpu": "generation",
    "ref_views": "views",
    "vmapped_grids": "grids",
    "host_callbacks": "callbacks",
    "InterpretedCalls": "callbacks",
    "in_collective_order": "collectives",
    "ordered_collectives": "collectives",
    "empty_accesses": "races",
    "UNSUPPORTED_PREFIX": "limitations",
    "callback_error_line": "limitations",
    "exception_chain": "limitations",
    "interpreter_limitation": "limitations",
    "limitation_lines": "limitations",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
