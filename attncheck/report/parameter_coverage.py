"""The parameter table of a run: the values each parameter of each family's call took (as
``attncheck.parameters`` recorded them), and its holes: a parameter that kept one value, a
cell of a real parameter no case reached, each unless the family declares why
(``KernelSpec.fixed_parameters``)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping

from attncheck.parameters import NUMBER_CELLS, is_presence, number_cells

# Values are recorded as short strings; the report lists at most this many per parameter.
MAX_LISTED_VALUES = 12


@dataclasses.dataclass
class ParameterValues:
    """The values one parameter of a family took, and in how many cases each."""

    cases: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def varied(self) -> bool:
        return len(self.cases) > 1


def table(surfaces: Iterable[tuple[str, Mapping[str, str]]]) -> dict[str, dict[str, ParameterValues]]:
    """family -> parameter -> values, from (family, surface) of every case run once."""
    result: dict[str, dict[str, ParameterValues]] = {}
    for family, found in surfaces:
        params = result.setdefault(family, {})
        for name, value in found.items():
            counts = params.setdefault(name, ParameterValues()).cases
            counts[value] = counts.get(value, 0) + 1
    return {family: dict(sorted(params.items())) for family, params in sorted(result.items())}


def fixed_reason(name: str, fixed: Mapping[str, str]) -> str | None:
    """Why the spec keeps a parameter at one value (in a pattern, ``*`` stands for anything)."""
    return next((reason for pattern, reason in fixed.items()
                 if re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), name)), None)


def unvaried(counts: Mapping[str, Mapping[str, ParameterValues]],
             fixed: Mapping[str, Mapping[str, str]]) -> dict[str, list[str]]:
    """family -> parameters that kept one value and are not declared fixed (an array or
    config that was always given is not one: its axes and fields are)."""
    holes = {family: [f"{name} (always {value})" for name, values in params.items()
                      if not values.varied and not is_presence(value := next(iter(values.cases)))
                      and fixed_reason(name, fixed.get(family, {})) is None]
             for family, params in counts.items()}
    return {family: names for family, names in holes.items() if names}


def real_valued(values: ParameterValues) -> bool:
    """A parameter of real numbers: some value it took is written with a fraction or an
    exponent (a size or a count is written as an integer)."""
    return any(number_cells(v) and re.search(r"[.eE]", v) for v in values.cases)


def cells(values: ParameterValues) -> dict[str, int]:
    """Cases per cell of a real parameter, in ``NUMBER_CELLS`` order."""
    reached = {cell: 0 for cell in NUMBER_CELLS}
    for value, n in values.cases.items():
        for cell in number_cells(value):
            reached[cell] += n
    return reached


def unreached(counts: Mapping[str, Mapping[str, ParameterValues]],
              fixed: Mapping[str, Mapping[str, str]]) -> dict[str, list[str]]:
    """family -> every cell of a real parameter no case reached that the family does not
    declare outside its convention (``name=cell`` in its fixed parameters; a parameter
    declared fixed as a whole keeps one value on purpose)."""
    def declared(family: str, name: str) -> bool:
        return fixed_reason(name, fixed.get(family, {})) is not None

    holes = {family: [f"{name} {cell}" for name, values in params.items()
                      if real_valued(values) and not declared(family, name)
                      for cell, n in cells(values).items() if n == 0 and not declared(family, f"{name}={cell}")]
             for family, params in counts.items()}
    return {family: names for family, names in holes.items() if names}
