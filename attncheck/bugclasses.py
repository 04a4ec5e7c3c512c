"""Bug classes: the vocabulary a family's spec declares its conditions in.

A bug class names the condition under which a kind of kernel bug becomes observable (a
softmax over several keys, segment ids that differ between tiles, a running max that
rises in a later block), declared once per family as a named predicate over the case's
parameters. It sits below the specs: ``attncheck.coverage`` searches an example of each
class, ``attncheck.report.coverage_table`` counts the cases that exercised each, and
``attncheck.expectations`` lets an implementation declare one a deviation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from attncheck import parameters
from attncheck.cases import Params


@dataclasses.dataclass(frozen=True)
class BugClass:
    """A kind of bug and the case condition that makes it observable; ``affects``, where
    the family can say, the elements its bug shows in: (case, inputs) -> direction -> mask.
    An implementation that declares the class a deviation (``attncheck.expectations``) is
    judged on the other elements of its cases; without ``affects``, on none of them."""

    name: str
    applies: Callable[[Params], bool]
    affects: Callable | None = dataclasses.field(default=None, compare=False)
    pair: bool = False  # two partitions' cells at once (``pairwise``)
    cell: bool = False  # one cell of a partition (``partition``, ``numbers``)

    @property
    def named(self) -> bool:
        """A class stated for its behaviour, not a coordinate of the covering array (a cell
        or a pair of cells): ``expectations init`` declares one before a cell or a pair."""
        return not (self.pair or self.cell)


@dataclasses.dataclass(frozen=True)
class Touching:
    """A bug class's condition and the elements its bug shows in (``bug_classes``)."""

    applies: Callable[[Params], bool]
    affects: Callable


def bug_classes(**predicates: Callable[[Params], bool] | Touching) -> tuple[BugClass, ...]:
    """``bug_classes(causal=lambda p: p.causal, nan_rows=Touching(lambda p: ..., rows), ...)``:
    classes in declaration order."""
    return tuple(BugClass(name, p.applies, p.affects) if isinstance(p, Touching) else BugClass(name, p)
                 for name, p in predicates.items())


@dataclasses.dataclass(frozen=True)
class Partition:
    """One parameter's domain cut into the cells a kernel treats differently (a block count:
    one, several; a scale: negative, zero, ...): one class per cell, named ``<name>_<cell>``.
    ``pairwise`` crosses partitions."""

    name: str
    classes: tuple[BugClass, ...]


def _cell_name(cell: str) -> str:
    return cell.replace("(", "").replace(")", "").replace(",", "").replace(" ", "_")


def partition(name: str, **cells: Callable[[Params], bool]) -> Partition:
    """``partition("kv_blocks", one=lambda p: ..., several=lambda p: ...)``: cells in
    declaration order."""
    if len(cells) < 2:
        raise ValueError(f"partition({name!r}): a partition needs two cells or more, got {sorted(cells)}")
    return Partition(name, tuple(BugClass(f"{name}_{cell}", applies, cell=True) for cell, applies in cells.items()))


def numbers(name: str, value: Callable[[Params], float | None], cells: Iterable[str]) -> Partition:
    """The cells of a real parameter (``parameters.NUMBER_CELLS``) its value (None: the
    kernel's default) must reach: ``numbers("sm_scale", lambda p: p.sm_scale, ("negative",
    "zero"))``. The coverage search then draws each cell every run; the report's value
    coverage checks that the kernel's call received it."""
    unknown = sorted(set(cells) - set(parameters.NUMBER_CELLS))
    if unknown:
        raise ValueError(f"numbers({name!r}): cells {unknown} are not among {parameters.NUMBER_CELLS}")

    def reaches(cell: str) -> Callable[[Params], bool]:
        return lambda p: (v := value(p)) is not None and cell in parameters.number_cells(repr(float(v)))

    return partition(name, **{_cell_name(cell): reaches(cell) for cell in cells})


def pairwise(*partitions: Partition) -> tuple[BugClass, ...]:
    """A class for every pair of cells of two different partitions, named
    ``<cell>__<cell>``: with each reached, the coverage examples and draws form a pairwise
    covering array of the partitions, where a bug that needs two parameters' values at once
    (a backward block wider than the forward's under causal masking) shows."""
    names = [p.name for p in partitions]
    if len(set(names)) != len(names) or len(names) < 2:
        raise ValueError(f"pairwise: needs two distinct partitions or more, got {names}")
    return tuple(BugClass(f"{a.name}__{b.name}", lambda p, a=a, b=b: a.applies(p) and b.applies(p), pair=True)
                 for i, first in enumerate(partitions) for second in partitions[i + 1:]
                 for a in first.classes for b in second.classes)


def presences(**given: Callable[[Params], bool]) -> tuple[BugClass, ...]:
    """The optional inputs of a call, each's presence a partition of its own (``<name>_given``,
    ``<name>_absent``), crossed pairwise where there are two or more: drawn apart, so that a
    kernel that tests one input's presence where it means another's shows (``pairwise``)."""
    parts = [partition(name, given=is_given, absent=lambda p, is_given=is_given: not is_given(p))
             for name, is_given in given.items()]
    return pairwise(*parts) if len(parts) > 1 else tuple(c for part in parts for c in part.classes)


def exercised(classes: Iterable[BugClass], params: Params) -> list[str]:
    """Names of the classes a case's parameters exercise, sorted."""
    return sorted(c.name for c in classes if c.applies(params))


def expected_max_rises(rows: Iterable[tuple[int, int]], block_tokens: int) -> float:
    """How many (query row, kv block after its first) steps of an online softmax raise the
    running max, on average over exchangeable logits, for rows that see the keys
    [first, end) in blocks of ``block_tokens``: a block adding n keys to m seen before
    raises it with probability n / (n + m). Few expected rises and a fixed seed may well
    draw none, and a rescaling bug then shows nowhere."""
    rises = 0.0
    for first, end in rows:
        seen = 0
        for block_start in range(first - first % block_tokens, end, block_tokens):
            new = min(end, block_start + block_tokens) - max(first, block_start)
            if seen:
                rises += new / (seen + new)
            seen += new
    return rises
