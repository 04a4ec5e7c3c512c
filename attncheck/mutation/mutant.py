"""A mutant: one known kernel bug, as an exact source snippet and its replacement.

A mutant plants its bug either in a file of this project (``file``, under ``kernels/``)
or in an installed module the gate verifies (``module``, e.g. jax's bundled splash
attention): the runner then copies that module's source into the mutated copy of the
project, plants the bug in the copy, and runs the gate with the family's implementation
taken from the copy (``--attncheck-impl FAMILY=<copy>:<impl>``), so the installed
module is never touched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

PROJECT_ROOT = pathlib.Path(__file__).resolve().parents[2]
# Where the runner puts the copies of installed modules, inside the mutated project copy.
MODULE_COPIES = "mutated_modules"


class CatalogueError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    family: str  # the KernelSpec name whose gate must kill it
    file: str | None  # path under the project root, or None with ``module``
    find: str
    replace: str
    description: str
    bug_class: str
    equivalent: str | None = None  # why no observable difference is possible, if so
    sample: bool = False  # part of the small PR-gate sample (fast to kill)
    module: str | None = None  # an installed module to mutate instead of a project file
    impl: str | None = None  # with ``module``: the function of the family's convention there

    def __post_init__(self):
        if (self.file is None) == (self.module is None) or (self.module is None) != (self.impl is None):
            raise CatalogueError(f"mutant {self.id}: give either file, or module and impl")

    @property
    def copy_path(self) -> str:
        """Where the mutated source lives inside a copy of the project."""
        if self.module is None:
            return self.file
        return f"{MODULE_COPIES}/{self.module.rpartition('.')[2]}.py"

    @property
    def impl_override(self) -> tuple[str, ...]:
        """The gate option that makes the family run the mutated copy (none for project files)."""
        if self.module is None:
            return ()
        return (f"--attncheck-impl={self.family}={MODULE_COPIES}.{self.module.rpartition('.')[2]}:{self.impl}",)

    def original_source(self) -> str:
        if self.module is None:
            return (PROJECT_ROOT / self.file).read_text()
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise CatalogueError(f"mutant {self.id}: module {self.module} is not installed")
        return pathlib.Path(spec.origin).read_text()


def mutated_source(mutant: Mutant, source: str | None = None) -> str:
    """The mutated source (of ``source``, else the original); the snippet must occur
    exactly once, so the catalogue cannot rot silently when a kernel changes."""
    source = mutant.original_source() if source is None else source
    count = source.count(mutant.find)
    if count != 1:
        raise CatalogueError(f"mutant {mutant.id}: snippet occurs {count} times in {mutant.module or mutant.file} "
                             f"(must be exactly once):\n{mutant.find}")
    return source.replace(mutant.find, mutant.replace)


def apply(mutant: Mutant, root: pathlib.Path) -> None:
    """Plant the mutant in the project copy at ``root``."""
    target = root / mutant.copy_path
    if mutant.module is None:
        target.write_text(mutated_source(mutant, target.read_text()))
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    (target.parent / "__init__.py").touch()
    target.write_text(mutated_source(mutant))
