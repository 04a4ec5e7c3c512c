"""Compiled forward + VJP callables, one per static configuration, shared by the specs.

Tracing and compiling an interpret-mode kernel costs seconds; the values of a case
(inputs, seeds, ragged metadata) are traced data, so every case of one static
configuration reuses one executable. A spec names what forces a new program in its key
(never a traced parameter: that would compile per case for nothing).
"""

from __future__ import annotations

import functools
import gc
import pathlib
import sys
import types
from collections.abc import Callable, Hashable
from typing import Any

import jax

from attncheck import interpret_compat, structure

_COMPILED: dict[Hashable, Callable] = {}


def impl_origin(impl: Callable) -> tuple[str | None, str | None]:
    """(module, name) of an implementation: where its convention's helper types live, and
    the "module:name" that finds it again. A ``functools.partial`` (jax's
    ``make_splash_mha`` is one) has neither attribute: its module is its function's, its
    name the attribute of that module bound to it."""
    if not isinstance(impl, functools.partial):
        return getattr(impl, "__module__", None), getattr(impl, "__qualname__", None)
    func = impl
    while isinstance(func, functools.partial):
        func = func.func
    module = func.__module__
    name = next((n for n, v in vars(sys.modules[module]).items() if v is impl), repr(impl))
    return module, name


def impl_module(impl: Callable) -> types.ModuleType:
    """The module an implementation comes from (its convention's SegmentIds, BlockSizes, ...)."""
    return sys.modules[impl_origin(impl)[0]]


def impl_key(impl: Callable) -> tuple[str | None, str | None]:
    """What identifies an implementation in a cache key."""
    return impl_origin(impl)


def compiled(key: Hashable, build: Callable[[], Callable]) -> Callable:
    """``jax.jit(build())``, built once per key (the interpret-mode settings of the
    backend a case runs under are part of jit's own cache key)."""
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = jax.jit(interpret_compat.in_collective_order(build()))
    return fn


# Each compiled XLA CPU program maps its code into the process (about 6 mappings each, kept
# while jax or this module holds the program). A long-running worker (a nightly shard's)
# compiles enough of them to reach the kernel's limit on mappings (vm.max_map_count, 65530
# by default), and then XLA's LLVM fails to map a new program ("Cannot allocate memory") and
# aborts the worker: lost cases. Past half the limit, every program is let go (and
# compiled again, mostly from the persistent cache, when a case needs it).
_MAPS = pathlib.Path("/proc/self/maps")
_MAP_LIMIT = pathlib.Path("/proc/sys/vm/max_map_count")


def mapping_count() -> int | None:
    """Memory mappings of this process (None where the platform does not say)."""
    try:
        with _MAPS.open("rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


@functools.cache
def mapping_budget() -> int | None:
    """How many mappings a process may hold before its programs are let go: half the limit."""
    try:
        return int(_MAP_LIMIT.read_text()) // 2
    except (OSError, ValueError):
        return None


def release_when_mappings_run_out(budget: int | None = None) -> bool:
    """Let every compiled program go when the process holds more mappings than ``budget``
    (default: ``mapping_budget()``); True when it did."""
    budget = mapping_budget() if budget is None else budget
    count = mapping_count()
    if budget is None or count is None or count <= budget:
        return False
    _COMPILED.clear()
    jax.clear_caches()
    gc.collect()
    return True


def with_vjp(forward: Callable[..., Any]) -> Callable:
    """``run(primals, cotangent, *rest) -> (out, grads)``: ``forward(*primals, *rest)`` and
    the gradients of its primals for the cotangent (cast to the output's dtype, so that an
    output in the wrong dtype is judged by the gate instead of failing in the pullback). An
    output that is not one array of the cotangent's shape is refused first, in chex's words
    (``attncheck.structure``)."""

    def run(primals, cotangent, *rest):
        out, vjp = jax.vjp(lambda *p: forward(*p, *rest), *primals)
        wrong = structure.mismatch("the output", out, cotangent.shape)  # chex's words, at trace time
        if wrong is not None:
            raise ValueError(wrong)
        return out, vjp(cotangent.astype(out.dtype))

    return run
