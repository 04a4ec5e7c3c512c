"""A mutant: one known kernel bug, as an exact source snippet and its replacement."""

from __future__ import annotations

import dataclasses
import pathlib

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    family: str  # the KernelSpec name whose gate must kill it
    file: str  # path under the project root
    find: str
    replace: str
    description: str
    bug_class: str
    equivalent: str | None = None  # why no observable difference is possible, if so
    sample: bool = False  # part of the small PR-gate sample (fast to kill)


class CatalogueError(RuntimeError):
    pass


def mutated_source(mutant: Mutant, root: pathlib.Path = PROJECT_ROOT) -> str:
    """The mutated file; the snippet must occur exactly once, so the catalogue cannot rot
    silently when a kernel changes."""
    source = (root / mutant.file).read_text()
    count = source.count(mutant.find)
    if count != 1:
        raise CatalogueError(f"mutant {mutant.id}: snippet occurs {count} times in {mutant.file} "
                             f"(must be exactly once):\n{mutant.find}")
    return source.replace(mutant.find, mutant.replace)


def apply(mutant: Mutant, root: pathlib.Path) -> None:
    (root / mutant.file).write_text(mutated_source(mutant, root))
