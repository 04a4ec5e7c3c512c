"""Error maps: *where* in a kernel's output the error is.

For one comparison, the map holds ``|kernel - oracle| / allowed`` (the budget of each
element, > 1 fails) over the two natural axes of the direction (e.g. [query x key] for a
bias gradient, [query x head_dim] for an output), reduced over the other axes by max,
max-pooled to at most ``MAX_CELLS`` x ``MAX_CELLS`` cells, with the kernel's block
boundaries (from the case's block sizes, in index units) to draw over it. An off-by-one at
a block edge, a wrong tile, a head mix-up or a padding leak shows as a pattern that
follows (or breaks) those lines.

Cell values: >= 0 the worst budget in the cell; ``MISMATCH`` (+inf) where NaN/Inf
positions of kernel and oracle differ; ``DONT_CARE`` (-1) where every element of the cell
is don't-care (padding). The same sentinels make one max-reduction handle all three.

NumPy and the standard library only: every gate worker builds maps. Drawing them (SVG,
PNG, colours) is the report's business (``attncheck/report/plots.py``); this module also
prints them as text for ``attncheck repro``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import zlib
from typing import Protocol

import numpy as np

from attncheck.layouts import Bounds, ErrorMapLayout

MAX_CELLS = 64
DONT_CARE = -1.0
MISMATCH = math.inf
JSON_VERSION = 1

@dataclasses.dataclass(frozen=True, eq=False)
class Axis:
    """One shown axis: cell i covers indices [i * step, min((i + 1) * step, length))."""

    name: str
    length: int
    step: int
    bounds: Bounds = ()

    @property
    def cells(self) -> int:
        return -(-self.length // self.step)

    def cell_range(self, cell: int) -> tuple[int, int]:
        return cell * self.step, min((cell + 1) * self.step, self.length)

    def to_json(self) -> dict:
        return {"name": self.name, "length": self.length, "step": self.step,
                "bounds": [[name, list(positions)] for name, positions in self.bounds]}

    @classmethod
    def from_json(cls, data: dict) -> Axis:
        return cls(data["name"], int(data["length"]), int(data["step"]),
                   tuple((name, tuple(int(p) for p in positions)) for name, positions in data["bounds"]))


@dataclasses.dataclass(frozen=True, eq=False)
class ErrorMap:
    """The map of one comparison. ``values[r, c]`` is the worst element budget of cell
    (r, c) (see the module doc for the sentinels); ``reduced`` is, per axis not shown,
    the worst budget at each of its indices (max over everything else, pooled like the
    shown axes): a wrong head or batch entry shows there."""

    direction: str
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    rows: Axis
    cols: Axis | None
    values: np.ndarray
    allowed: float
    reduced: tuple[tuple[str, int, tuple[float, ...]], ...] = ()  # (axis name, step, values)

    @property
    def budget(self) -> float:
        return float(self.values.max(initial=DONT_CARE))

    @property
    def dont_care(self) -> np.ndarray:
        return self.values == DONT_CARE

    @property
    def mismatch(self) -> np.ndarray:
        return np.isposinf(self.values)

    @property
    def reduced_names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.reduced)

    def worst_cell(self) -> tuple[int, int] | None:
        if self.values.size == 0 or self.budget == DONT_CARE:
            return None
        r, c = np.unravel_index(int(np.argmax(self.values)), self.values.shape)
        return int(r), int(c)

    def describe_cell(self, r: int, c: int) -> str:
        lo, hi = self.rows.cell_range(r)
        text = f"{self.rows.name} {lo}" + (f"-{hi - 1}" if hi - lo > 1 else "")
        if self.cols is not None:
            lo, hi = self.cols.cell_range(c)
            text += f", {self.cols.name} {lo}" + (f"-{hi - 1}" if hi - lo > 1 else "")
        return text

    def coarsened(self, max_rows: int, max_cols: int) -> ErrorMap:
        """The same map max-pooled by powers of two until it fits (for a terminal)."""
        fr = pow2_step(self.values.shape[0], max_rows)
        fc = pow2_step(self.values.shape[1], max_cols) if self.cols is not None else 1
        if fr == 1 and fc == 1:
            return self
        cols = None if self.cols is None else dataclasses.replace(self.cols, step=self.cols.step * fc)
        return dataclasses.replace(self, rows=dataclasses.replace(self.rows, step=self.rows.step * fr), cols=cols,
                                   values=_pool(self.values, fr, fc))

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> dict:
        """Cells as IEEE half floats of log10(value), zlib-compressed, base64: -inf is an
        exact 0, +inf a NaN/Inf mismatch, NaN don't-care (0.1-2% precision, 2 bytes a cell)."""
        with np.errstate(divide="ignore"):
            logs = np.where(self.values == DONT_CARE, np.nan, np.log10(np.maximum(self.values, 0.0)))
        blob = zlib.compress(logs.astype("<f2").tobytes(), 6)
        return {"version": JSON_VERSION, "direction": self.direction, "shape": list(self.shape),
                "axis_names": list(self.axis_names), "rows": self.rows.to_json(),
                "cols": None if self.cols is None else self.cols.to_json(),
                "cells": [int(self.values.shape[0]), int(self.values.shape[1]),
                          base64.b64encode(blob).decode("ascii")],
                "allowed": _json_number(self.allowed),
                "reduced": [{"axis": name, "step": step, "values": [_json_number(_round(v)) for v in values]}
                            for name, step, values in self.reduced]}

    @classmethod
    def from_json(cls, data: dict) -> ErrorMap:
        """The map of a record; ValueError when its cells do not decode to their shape."""
        if data.get("version") != JSON_VERSION:
            raise ValueError(f"error map version {data.get('version')!r}, expected {JSON_VERSION}")
        n_rows, n_cols, text = data["cells"]
        try:
            logs = np.frombuffer(zlib.decompress(base64.b64decode(text, validate=True)), dtype="<f2")
            logs = logs.astype(np.float64).reshape(int(n_rows), int(n_cols))
        except (binascii.Error, zlib.error, ValueError) as exc:
            raise ValueError(f"error map cells do not decode to {n_rows} x {n_cols}: {exc}") from None
        values = np.where(np.isnan(logs), DONT_CARE, np.power(10.0, logs))
        return cls(direction=data["direction"], shape=tuple(data["shape"]), axis_names=tuple(data["axis_names"]),
                   rows=Axis.from_json(data["rows"]),
                   cols=None if data["cols"] is None else Axis.from_json(data["cols"]),
                   values=values, allowed=float(data["allowed"]),
                   reduced=tuple((r["axis"], int(r["step"]), tuple(float(v) for v in r["values"]))
                                 for r in data["reduced"]))

    def to_text(self, max_rows: int = 32, max_cols: int = 64) -> str:
        return render_text(self, max_rows, max_cols)


def _round(value: float) -> float:
    return float(f"{value:.3g}") if math.isfinite(value) else value


def _json_number(value: float):
    value = float(value)
    return value if math.isfinite(value) else str(value)


def pow2_step(length: int, max_cells: int) -> int:
    """The smallest power of two step that fits ``length`` in ``max_cells`` cells: block
    sizes are powers of two (or multiples of 8), so cell edges fall on block edges."""
    step = 1
    while -(-length // step) > max_cells:
        step *= 2
    return step


def _pool(values: np.ndarray, fr: int, fc: int) -> np.ndarray:
    """Max-pool a 2-D array by (fr, fc), padding with DONT_CARE (which loses to any value)."""
    r, c = values.shape
    nr, nc = -(-r // fr), -(-c // fc)
    if (nr * fr, nc * fc) != (r, c):
        padded = np.full((nr * fr, nc * fc), DONT_CARE)
        padded[:r, :c] = values
        values = padded
    return values.reshape(nr, fr, nc, fc).max(axis=(1, 3))


def element_budgets(kernel, oracle, allowed: float, care=None) -> np.ndarray:
    """|kernel - oracle| / allowed per element, with the sentinels: MISMATCH where NaN/Inf
    positions (or signs) differ, 0 where both hold the same non-finite value, DONT_CARE
    where ``care`` is False."""
    k = np.asarray(kernel, dtype=np.float64)
    o = np.asarray(oracle, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        err = np.abs(k - o) / allowed
    bad = ~np.isfinite(err)
    if bad.any():
        finite_k, finite_o = np.isfinite(k), np.isfinite(o)
        # Equal elements are 0 whatever the allowance (an exact direction allows 0).
        same = (np.isnan(k) & np.isnan(o)) | (k == o)
        # Both finite but the quotient overflowed (allowed underflowed): as bad as it gets
        # short of a mismatch.
        err[bad] = np.where(same[bad], 0.0, np.where((finite_k & finite_o)[bad], np.finfo(np.float64).max, MISMATCH))
    if care is not None:
        err = np.where(np.broadcast_to(np.asarray(care, dtype=bool), err.shape), err, DONT_CARE)
    return err


def build(kernel, oracle, *, allowed: float, direction: str, layout: ErrorMapLayout | None = None,
          care=None, max_cells: int = MAX_CELLS) -> ErrorMap:
    """The error map of one comparison (``allowed`` from ``numerics.compare``); without a
    layout, the last two axes."""
    err = element_budgets(kernel, oracle, allowed, care)
    if err.ndim == 0:
        err = err.reshape(1)
    if layout is None:
        layout = ErrorMapLayout.last_axes([f"axis{i}" for i in range(err.ndim)])
    if len(layout.axis_names) != err.ndim:
        raise ValueError(f"{direction}: the error map layout names {len(layout.axis_names)} axes "
                         f"{layout.axis_names}, the array has shape {err.shape}")
    shown = (layout.rows,) if layout.cols is None else (layout.rows, layout.cols)
    others = tuple(a for a in range(err.ndim) if a not in shown)
    # Rows, cols, then the reduced axes: one transposed view, one max-reduction.
    view = np.transpose(err, shown + others)
    grid = view.reshape(view.shape[: len(shown)] + (-1,)).max(axis=-1) if others else view
    if layout.cols is None:
        grid = grid.reshape(-1, 1)
    rows = _axis(layout.axis_names[layout.rows], err.shape[layout.rows], layout.row_bounds, max_cells)
    cols = None if layout.cols is None else _axis(layout.axis_names[layout.cols], err.shape[layout.cols],
                                                   layout.col_bounds, max_cells)
    values = _pool(grid, rows.step, 1 if cols is None else cols.step)
    reduced = []
    for i, axis in enumerate(others):
        # The profile along one reduced axis: max over all other axes of the same view.
        profile = view.max(axis=tuple(a for a in range(view.ndim) if a != len(shown) + i))
        step = pow2_step(profile.size, max_cells)
        reduced.append((layout.axis_names[axis], step, tuple(float(v) for v in _pool(profile[:, None], step, 1)[:, 0])))
    return ErrorMap(direction=direction, shape=tuple(int(n) for n in np.shape(kernel)),
                    axis_names=tuple(layout.axis_names), rows=rows, cols=cols, values=values,
                    allowed=float(allowed), reduced=tuple(reduced))


def _axis(name: str, length: int, bounds: Bounds, max_cells: int) -> Axis:
    kept = tuple((label, tuple(sorted({int(p) for p in positions if 0 < p < length}))) for label, positions in bounds)
    return Axis(name, int(length), pow2_step(length, max_cells), tuple((label, p) for label, p in kept if p))


# ------------------------------------------------------------------ which comparisons get a map
class MapPolicy(Protocol):
    def keep(self, key: tuple, budget: float, failing: bool) -> bool:
        """Whether the record of ``key`` (kernel, impl, direction) with this budget gets a map."""


# A passing record carries its map when its budget is at least this. A property of the
# record alone, so that every runner, worker count and test order keeps the same maps (a
# worker's worst so far would make them depend on which worker ran what). At 0.3 a full
# gate keeps a map of the worst passing record of most kernel x impl x direction groups,
# and of a small share of its comparisons (docs/DESIGN.md, "Reports").
MAP_BUDGET = 0.3


class PastBudget:
    """The gate's choice of which records carry a map: every failing one, and each passing
    one whose budget is at least ``threshold``: the report shows the worst passing map of
    each kernel x impl x direction that has one."""

    def __init__(self, threshold: float = MAP_BUDGET) -> None:
        self.threshold = threshold

    def keep(self, key: tuple, budget: float, failing: bool) -> bool:
        return failing or budget >= self.threshold


class EveryMap:
    """Every comparison gets its map (``attncheck repro`` prints each direction's)."""

    def keep(self, key: tuple, budget: float, failing: bool) -> bool:
        return True


# ------------------------------------------------------------------ text
# One character per budget decade; a terminal has no SVG.
TEXT_LEGEND = (("' '", "exact 0"), (".", "< 1e-3"), (":", "< 1e-2"), ("=", "< 0.1"), ("+", "<= 1 (pass)"),
               ("*", "<= 10 (fail)"), ("#", "<= 100"), ("%", "<= 1e3"), ("@", "> 1e3"),
               ("!", "NaN/Inf mismatch"), ("~", "don't care"))
_TEXT_EDGES = np.array([0.0, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3])
_TEXT_RAMP = np.array(list(" .:=+*#%@"))


def cell_chars(values: np.ndarray) -> np.ndarray:
    index = np.searchsorted(_TEXT_EDGES, values, side="left")  # 0 only for exact 0
    chars = _TEXT_RAMP[np.clip(index, 0, len(_TEXT_RAMP) - 1)]
    chars = np.where(values == DONT_CARE, "~", chars)
    return np.where(np.isposinf(values), "!", chars)


def boundary_cells(axis: Axis | None) -> set[int]:
    """Cell indices before which a boundary line is drawn (rounded to the nearest cell edge)."""
    if axis is None:
        return set()
    return {round(p / axis.step) for _, positions in axis.bounds for p in positions} - {0, axis.cells}


def spacing(positions: tuple[int, ...]) -> int | None:
    """The common step of evenly spaced boundaries (``every``), else None."""
    if positions and all(p == positions[0] * (i + 1) for i, p in enumerate(positions)):
        return positions[0]
    return None


def describe_bounds(name: str, positions: tuple[int, ...], limit: int = 8) -> str:
    step = spacing(positions)
    if step:
        return f"{name} every {step}"
    shown = ", ".join(map(str, positions[:limit])) + (", ..." if len(positions) > limit else "")
    return f"{name} at {shown}"


def fmt_budget(value: float) -> str:
    if value == DONT_CARE:
        return "don't care"
    if math.isinf(value):
        return "NaN/Inf mismatch"
    return f"{value:.3g}"


def render_text(emap: ErrorMap, max_rows: int = 32, max_cols: int = 64) -> str:
    m = emap.coarsened(max_rows, max_cols)
    chars = cell_chars(m.values)
    row_lines, col_lines = boundary_cells(m.rows), boundary_cells(m.cols)
    label_w = len(str(m.rows.length))
    shown = f"[{m.rows.name} x {m.cols.name}]" if m.cols is not None else f"[{m.rows.name}]"
    cell = f"cell = {m.rows.step} {m.rows.name}" + (f" x {m.cols.step} {m.cols.name}" if m.cols is not None else "")
    over = f", max over {', '.join(m.reduced_names)}" if m.reduced else ""
    lines = [f"{m.direction}: |kernel - oracle| / allowed over {shown}{over}; {cell}; worst {fmt_budget(m.budget)}"]
    bounds = [describe_bounds(name, p) for axis in (m.rows, m.cols) if axis is not None for name, p in axis.bounds]
    if bounds:
        lines.append("  boundaries ('|' '-'): " + "; ".join(bounds))

    def hline() -> str:
        cells = "".join(("+" if c in col_lines else "") + "-" for c in range(chars.shape[1]))
        return " " * label_w + " +" + cells + "+"

    lines.append(hline())
    for r in range(chars.shape[0]):
        if r in row_lines:
            lines.append(hline())
        body = "".join(("|" if c in col_lines else "") + chars[r, c] for c in range(chars.shape[1]))
        lines.append(f"{m.rows.cell_range(r)[0]:>{label_w}} |{body}|")
    lines.append(hline())
    for name, step, values in m.reduced:
        if len(values) <= 16:
            per_index = ", ".join(f"{i * step}: {fmt_budget(v)}" for i, v in enumerate(values))
            lines.append(f"  worst per {name}: {per_index}")
        else:
            worst = int(np.argmax(values))
            lines.append(f"  worst per {name}: {''.join(cell_chars(np.array(values)))} "
                         f"(max {fmt_budget(values[worst])} at {name} {worst * step})")
    lines.append("  legend: " + " ".join(f"{c} {meaning}" for c, meaning in TEXT_LEGEND))
    return "\n".join(lines)
