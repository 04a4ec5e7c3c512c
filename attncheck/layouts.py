"""How a family lays out each direction's array as an error map: which axes a map shows
and where the kernel's block boundaries fall (``KernelSpec.error_map_layout``). A spec
declares it; the report's maps (``attncheck.report.errormap``) draw by it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

Bounds = tuple[tuple[str, tuple[int, ...]], ...]


@dataclasses.dataclass(frozen=True)
class ErrorMapLayout:
    """How a spec lays out one direction's array as a map (``KernelSpec.error_map_layout``).

    ``axis_names`` names every axis of the array; ``rows``/``cols`` are the axes shown
    (``cols`` None: a single column, for 1-D arrays); ``row_bounds``/``col_bounds`` are
    named sets of block boundaries in index units (e.g. ``("block_q", (128, 256))``).
    """

    axis_names: tuple[str, ...]
    rows: int
    cols: int | None = None
    row_bounds: Bounds = ()
    col_bounds: Bounds = ()

    @classmethod
    def last_axes(cls, names: Sequence[str]) -> ErrorMapLayout:
        """The last two axes (the only one of a 1-D array), no boundaries."""
        names = tuple(names)
        return cls(names, max(0, len(names) - 2), len(names) - 1 if len(names) >= 2 else None)


def every(name: str, block: int | None, length: int) -> tuple[str, tuple[int, ...]]:
    """A boundary set: every ``block`` indices strictly inside ``[0, length)``."""
    if not block or block <= 0:
        return (name, ())
    return (name, tuple(range(block, length, block)))
