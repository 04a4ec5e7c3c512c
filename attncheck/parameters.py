"""Parameter coverage: every parameter a kernel accepts, and the values it took in a run.

The parameter surface is read off the call itself, not listed by hand: before a case runs,
the spec's ``run`` is called with a *probe* in place of the implementation. The probe
binds the arguments to the implementation's signature and records one value per
parameter: a keyword's value (or that it was left to its default), the fields of a config
object (a dataclass or NamedTuple such as ``BlockSizes``, field by field), the dtype and
every axis of an array (``q.shape[2]``). Then it stops the call: no kernel runs.

A call without any array argument is a factory (``make_splash_mha(mask, ...)`` builds the
kernel it returns): the probe lets it run and probes the returned callable's call too
(``call.q.shape[0]``). An implementation whose ``**kwargs`` are forwarded to another
function is given that function by the spec (``KernelSpec.keyword_targets``), so the
keywords it accepts are part of the surface as well.

A parameter that kept one value across a run is a blind spot: a bug that only shows when
it varies (an index map, a grid size rounded the wrong way, a tile covering more than one
of something) cannot be observed. ``--attncheck-require-coverage`` fails the run for each,
unless the spec declares it fixed, with the reason (``KernelSpec.fixed_parameters``).

A parameter of real numbers (a scale, a soft cap, a quantization scale, a dropout rate, a
mask value) is partitioned into the cells a kernel may treat differently (``NUMBER_CELLS``):
a hide value multiplied by a negative or zero scale stops hiding, 1 skips a multiply, a
value that is not a power of two rounds its products. Every cell must be reached too,
unless the spec declares it outside the convention: ``fixed_parameters["name=cell"]``
(``"name=*"``: every cell the run did not reach), with the reason.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from attncheck.compiled import impl_origin

DEFAULT = "<default>"
TRACED = "<traced>"
ARRAY = "<array>"
CALL = "call"


class Probed(Exception):  # noqa: N818 - not an error: the probe's way out of the spec's run
    """Raised by the probe once the computation's arguments are recorded."""

    def __init__(self, surface: dict[str, str]):
        super().__init__("parameters recorded")
        self.surface = surface


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type)


def _scalar(value) -> str:
    if isinstance(value, enum.Enum):  # its repr would read as a presence marker, <...>
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return repr(value)


def is_presence(value: str) -> bool:
    """A value that says only that an array or config object was given (its axes and
    fields carry its variety) or that a scalar was traced (data, not a parameter)."""
    return value.startswith("<") and value != DEFAULT


def describe(name: str, value: Any, out: dict[str, str], depth: int = 0) -> None:
    """Record ``value`` of parameter ``name`` (recursing into arrays, configs, sequences).
    An array or a config object records its presence too: an optional one is given or None."""
    if value is inspect.Parameter.empty:
        out[name] = DEFAULT
    elif value is None or isinstance(value, (bool, str, numbers.Number)):
        out[name] = _scalar(value)
    elif _is_array(value):
        out[name] = TRACED if value.shape == () else ARRAY  # a traced scalar's value is data
        out[f"{name}.dtype"] = str(value.dtype)
        for axis, size in enumerate(value.shape):
            out[f"{name}.shape[{axis}]"] = str(size)
    elif depth < 3 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        out[name] = f"<{type(value).__name__}>"
        for f in dataclasses.fields(value):
            describe(f"{name}.{f.name}", getattr(value, f.name), out, depth + 1)
    elif depth < 3 and isinstance(value, tuple) and hasattr(value, "_fields"):
        out[name] = f"<{type(value).__name__}>"
        for field in value._fields:
            describe(f"{name}.{field}", getattr(value, field), out, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)) and len(value) <= 16:
        out[name] = f"<{type(value).__name__}>"  # given, where it may be None
        out[f"{name}.len"] = str(len(value))
        for i, item in enumerate(value):
            describe(f"{name}[{i}]", item, out, depth + 1)
    elif callable(value):
        out[name] = getattr(value, "__qualname__", type(value).__name__)
    else:
        out[name] = type(value).__name__
        shape = getattr(value, "shape", None)  # a mask object with a shape
        if isinstance(shape, tuple):
            for axis, size in enumerate(shape):
                out[f"{name}.shape[{axis}]"] = str(size)


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def surface(fn: Callable, args: tuple, kwargs: dict, keyword_targets: Iterable[Callable] = (),
            prefix: str = "") -> dict[str, str]:
    """One value per parameter of ``fn`` for this call (``DEFAULT`` where it was left out)."""
    out: dict[str, str] = {}
    signature = _signature(fn)
    if signature is None:
        for i, value in enumerate(args):
            describe(f"{prefix}args[{i}]", value, out)
        for name, value in kwargs.items():
            describe(f"{prefix}{name}", value, out)
        return out
    bound = signature.bind_partial(*args, **kwargs).arguments
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            forwarded = dict(bound.get(name, {}))
            targets = [p for target in keyword_targets if (s := _signature(target)) is not None
                       for p in s.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
            for target in targets:
                if target.name not in signature.parameters:
                    describe(f"{prefix}{target.name}", forwarded.pop(target.name, target.default), out)
            for key, value in forwarded.items():
                describe(f"{prefix}{key}", value, out)
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            for i, value in enumerate(bound.get(name, ())):
                describe(f"{prefix}{name}[{i}]", value, out)
        else:  # a parameter left out takes its default: that is the value it had
            describe(f"{prefix}{name}", bound.get(name, parameter.default), out)
    return out


def _has_array(args: tuple, kwargs: dict) -> bool:
    values = [*args, *kwargs.values()]
    return any(_is_array(v) or (isinstance(v, (list, tuple)) and any(_is_array(x) for x in v)) for v in values)


def probe(impl: Callable, keyword_targets: Iterable[Callable] = ()) -> Callable:
    """A stand-in for ``impl`` that records its call's parameters and raises ``Probed``."""
    keyword_targets = tuple(keyword_targets)

    @functools.wraps(impl)
    def probed(*args, **kwargs):
        recorded = surface(impl, args, kwargs, keyword_targets)
        if _has_array(args, kwargs):
            raise Probed(recorded)
        built = impl(*args, **kwargs)  # a factory: its product is what computes
        probed.factory_surface = recorded

        def call(*call_args, **call_kwargs):
            raise Probed({**recorded, **surface(built, call_args, call_kwargs, prefix=f"{CALL}.")})

        # A spec may use the product other than by calling it (splash's kernel handed to
        # shard_map with its sharding spec) and fail there: record() still has the factory's.
        return call

    # The implementation's module (where its convention's helper types live), under a
    # distinct name: the spec's compiled-callable cache must never serve the probe for the
    # implementation, nor the implementation for the probe.
    module, name = impl_origin(impl)
    probed.__module__, probed.__qualname__ = module, f"{name or 'impl'}<probe>"
    return probed


def record(run: Callable[[Callable], Any], impl: Callable, keyword_targets: Iterable[Callable] = ()
           ) -> dict[str, str] | None:
    """The parameters ``run(impl)`` passes to ``impl`` (a factory's alone, when its product
    is not called through the probe); None when the run never reaches it (its error, if
    any, shows when the case really runs)."""
    stand_in = probe(impl, keyword_targets)
    try:
        run(stand_in)
    except Probed as found:
        return found.surface
    except Exception:  # noqa: BLE001 - the case itself will say what is wrong
        pass
    return getattr(stand_in, "factory_surface", None)


# ------------------------------------------------------------------ value cells
NUMBER_CELLS = ("negative", "zero", "in (0, 1)", "one", "above 1", "not a power of two")


def number_cells(value: str) -> tuple[str, ...]:
    """The cells of ``NUMBER_CELLS`` a recorded value falls in (none for a value that is
    not a finite number: None, a default, a dtype)."""
    try:
        x = float(value)
    except ValueError:
        return ()
    if not math.isfinite(x):
        return ()
    size = "negative" if x < 0 else "zero" if x == 0 else "in (0, 1)" if x < 1 else "one" if x == 1 else "above 1"
    return (size, "not a power of two") if x != 0 and math.frexp(abs(x))[0] != 0.5 else (size,)


def outside_convention(name: str, cells: Iterable[str], reason: str) -> dict[str, str]:
    """``fixed_parameters`` entries declaring cells of a real parameter outside a family's
    convention, with the reason (``"*"``: every cell the run did not reach)."""
    unknown = sorted(set(cells) - {*NUMBER_CELLS, "*"})
    if unknown:
        raise ValueError(f"outside_convention({name!r}): cells {unknown} are not among {NUMBER_CELLS} or '*'")
    return {f"{name}={cell}": reason for cell in cells}
