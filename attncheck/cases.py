"""Cases: a family's typed parameters plus the seed its inputs are made from.

A case is small to record and exact to replay: inputs are rebuilt from (params, seed)
alone (``attncheck repro CASE_ID``). Each family declares its parameters as a frozen
dataclass deriving from :class:`Params`; the generic layer reads only what this base
class declares.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any, Generic, TypeVar


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
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Params:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = set(data) - names, names - set(data)
        if unknown or missing:
            raise ValueError(f"{cls.__name__}: parameters {sorted(unknown)} unknown, {sorted(missing)} missing")
        return cls(**{k: freeze(v) for k, v in data.items()})


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
