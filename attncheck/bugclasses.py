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


def value_cells(name: str, value: Callable[[Params], float | None], cells: Iterable[str]) -> tuple[BugClass, ...]:
    """One class per cell of a real parameter (``parameters.NUMBER_CELLS``) its value
    (None: the kernel's default) must reach, named ``<name>_<cell>``:
    ``value_cells("sm_scale", lambda p: p.sm_scale, ("negative", "zero"))``. The coverage
    search then draws each cell every run; the report's value coverage checks that the
    kernel's call received it."""
    unknown = sorted(set(cells) - set(parameters.NUMBER_CELLS))
    if unknown:
        raise ValueError(f"value_cells({name!r}): cells {unknown} are not among {parameters.NUMBER_CELLS}")

    def reaches(cell: str) -> Callable[[Params], bool]:
        return lambda p: (v := value(p)) is not None and cell in parameters.number_cells(repr(float(v)))

    return tuple(BugClass(f"{name}_{cell.replace('(', '').replace(')', '').replace(',', '').replace(' ', '_')}",
                          reaches(cell)) for cell in cells)


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
