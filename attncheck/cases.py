"""Cases: a family's typed parameters plus the seed its inputs are made from.

A case is small to record and exact to replay: inputs are rebuilt from (params, seed)
alone (``attncheck repro CASE_ID``). Each family declares its parameters as a frozen
dataclass deriving from :class:`Params`; the generic layer reads only what this base
class declares. A group of sizes inside them (a kernel's block sizes) is a frozen
dataclass deriving from :class:`Sizes`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Base of a group of sizes a case holds (a kernel's block sizes), a frozen dataclass of
    ints; a field that may be None is a size the case leaves to the kernel.

    Its JSON form is the list of (name, size) pairs of the sizes given, in field order (a
    None field left out): the form these sizes were written in before they were typed, which
    the case ids hash. A :class:`Params` field declared as a Sizes subclass is written and
    read in that form.
    """

    def given(self) -> dict[str, int]:
        """The sizes given, by name in field order (None fields left out): the keywords of
        the kernel's own block sizes."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def to_json(self) -> tuple[tuple[str, int], ...]:
        return tuple(self.given().items())

    @classmethod
    def from_json(cls, pairs: Iterable[Iterable]) -> Sizes:
        return cls(**dict(pairs))


@functools.cache
def _sizes_fields(params_type: type) -> dict[str, type[Sizes]]:
    """The fields of a params type declared as a Sizes subclass, and that class."""
    hints = typing.get_type_hints(params_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(params_type)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], Sizes)}


@dataclasses.dataclass(frozen=True)
class Params:
    """Base of every family's case parameters (a frozen dataclass of plain values).

    Subclasses declare their fields, a ``dtype: str`` field among them (the working
    precision the report groups by; :func:`check_params_type` enforces it), and override
    the properties where the default does not fit.
    """

    @property
    def device_count(self) -> int:
        """Simulated devices the case runs on."""
        return 1

    @property
    def simulated_cores(self) -> int | None:
        """Simulated TPU cores per device the case needs on the interpret backends (None:
        whatever the backend simulates)."""
        return None

    @property
    def sequence_length(self) -> int:
        """The length plotted on the report's error-against-length chart."""
        raise NotImplementedError(f"{type(self).__name__} must define sequence_length")

    def to_json(self) -> dict[str, Any]:
        """Each field's value; a :class:`Sizes` one by its own JSON form."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: v.to_json() if isinstance(v, Sizes) else v for name, v in values.items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Params:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = set(data) - names, names - set(data)
        if unknown or missing:
            raise ValueError(f"{cls.__name__}: parameters {sorted(unknown)} unknown, {sorted(missing)} missing")
        sizes = _sizes_fields(cls)
        return cls(**{k: sizes[k].from_json(v) if k in sizes else freeze(v) for k, v in data.items()})


def check_params_type(params_type: type) -> None:
    """A family's params type must be a frozen Params dataclass with a ``dtype`` field."""
    if not (isinstance(params_type, type) and issubclass(params_type, Params)
            and dataclasses.is_dataclass(params_type) and params_type.__dataclass_params__.frozen):
        raise TypeError(f"{params_type!r}: a family's params must be a frozen dataclass deriving from "
                        "attncheck.cases.Params")
    if "dtype" not in {f.name for f in dataclasses.fields(params_type)}:
        raise TypeError(f"{params_type.__name__}: a family's params need a 'dtype' field (the working precision)")


def freeze(value):
    """JSON turns tuples into lists; params hold tuples so they stay hashable."""
    if isinstance(value, dict):
        return {k: freeze(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    return value


P = TypeVar("P", bound=Params)


@dataclasses.dataclass(frozen=True)
class Case(Generic[P]):
    """One drawn configuration of a family."""

    family: str
    params: P
    seed: int

    def to_json(self) -> dict:
        return {"family": self.family, "params": self.params.to_json(), "seed": self.seed}

    @classmethod
    def from_json(cls, data: Mapping, params_type: type[P]) -> Case[P]:
        return cls(data["family"], params_type.from_json(data["params"]), int(data["seed"]))

    @property
    def id(self) -> str:
        blob = json.dumps(self.to_json(), sort_keys=True, default=str)
        return self.family + "-" + hashlib.sha256(blob.encode()).hexdigest()[:12]

    def __hash__(self) -> int:
        return hash(self.id)
