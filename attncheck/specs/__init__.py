"""The registry of kernel families the gate verifies."""

from __future__ import annotations

import functools
import importlib

from attncheck.specs.base import InvalidCall, KernelSpec, resolve_impl

# Module path of each built-in family's spec; a module exposes SPEC (or SPECS, a list).
BUILTIN_SPEC_MODULES = (
    "attncheck.specs.flash.spec",
    "attncheck.specs.ffn",
    "attncheck.specs.ragged.spec",
    "attncheck.specs.ragged_v3.spec",
    "attncheck.specs.ring.spec",
    "attncheck.specs.splash.spec",
    "attncheck.specs.splash_config",
    "attncheck.specs.paged.spec",
    "attncheck.specs.dpa.spec",
)
SPEC_MODULES = list(BUILTIN_SPEC_MODULES)


def use_spec_modules(names: list[str], *, only: bool = False) -> None:
    """Register more spec modules (``--attncheck-spec``): a user's own kernel families;
    with ``only``, those alone."""
    if only:
        SPEC_MODULES.clear()
    for name in names:
        if name not in SPEC_MODULES:
            SPEC_MODULES.append(name)
    all_specs.cache_clear()


@functools.cache
def all_specs() -> dict[str, KernelSpec]:
    found = {}
    for name in SPEC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ValueError(f"spec module {name!r} cannot be imported: {exc}") from exc
        declared = getattr(module, "SPECS", None) or [getattr(module, "SPEC", None)]
        if not all(isinstance(spec, KernelSpec) for spec in declared):
            raise ValueError(f"spec module {name!r} must expose SPEC (a KernelSpec instance) or SPECS (a list of them)")
        for spec in declared:
            found[spec.name] = spec
    return found


__all__ = ["InvalidCall", "KernelSpec", "all_specs", "resolve_impl", "use_spec_modules"]


def cell_classes() -> dict[str, frozenset[str]]:
    """Family -> its bug classes that are a cell or a pair of cells (coordinates of its
    covering array), not a condition stated for a behaviour (``expectations.explaining``)."""
    return {name: frozenset(c.name for c in spec.bug_classes if not c.named) for name, spec in all_specs().items()}
