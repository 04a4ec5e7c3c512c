"""The registry of kernel families the gate verifies."""

from __future__ import annotations

import functools
import importlib

from attncheck.specs.base import Case, InvalidCall, KernelSpec, make_case, resolve_impl

# Module path of each family's spec; a module exposes SPEC (or SPECS, a list).
SPEC_MODULES = [
    "attncheck.specs.flash",
    "attncheck.specs.ffn",
    "attncheck.specs.ragged",
    "attncheck.specs.ring",
]


def add_spec_modules(names: list[str]) -> None:
    """Register more spec modules (``--attncheck-spec``): a user's own kernel family."""
    for name in names:
        if name not in SPEC_MODULES:
            SPEC_MODULES.append(name)
    all_specs.cache_clear()


@functools.cache
def all_specs() -> dict[str, KernelSpec]:
    found = {}
    for name in SPEC_MODULES:
        module = importlib.import_module(name)
        for spec in getattr(module, "SPECS", None) or [module.SPEC]:
            found[spec.name] = spec
    return found


def parse_impl_overrides(values: list[str]) -> dict[str, str]:
    """``--attncheck-impl FAMILY=module:function`` options -> {family: reference}."""
    overrides = {}
    for value in values:
        family, sep, ref = value.partition("=")
        if not sep or family not in all_specs():
            raise ValueError(f"--attncheck-impl {value!r}: expected FAMILY=package.module:function "
                             f"with FAMILY one of {sorted(all_specs())}")
        resolve_impl(ref)  # fail at startup, not in the middle of the gate
        overrides[family] = ref
    return overrides


__all__ = ["Case", "InvalidCall", "KernelSpec", "add_spec_modules", "all_specs", "make_case", "parse_impl_overrides",
           "resolve_impl"]
