"""The one directory attncheck keeps its caches in, shared by every process of a run and
kept across runs: the coverage examples (``coverage/``) and jax's persistent compilation
cache (``xla/``).

``$ATTNCHECK_CACHE_DIR`` chooses it (default ``.attncheck_cache`` in the working
directory); ``none`` turns both caches off. CI restores and saves this one directory.
"""

from __future__ import annotations

import os
import pathlib
import shutil

CACHE_ENV = "ATTNCHECK_CACHE_DIR"
DEFAULT_CACHE_DIR = ".attncheck_cache"
DISABLED = "none"


def setting() -> str:
    """The cache root the environment asks for, as an absolute path (so that a copy of the
    project run elsewhere, a mutant's, shares it), or "none"."""
    chosen = os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    return chosen if chosen == DISABLED else str(pathlib.Path(chosen).resolve())


def subdir(name: str) -> pathlib.Path | None:
    """The directory of one cache under the root; None when caching is off."""
    root = setting()
    return None if root == DISABLED else pathlib.Path(root) / name


def private_copy(dest: pathlib.Path) -> str:
    """A copy of the cache root at ``dest``, for a run whose programs must not outlive it:
    a mutated copy of the project compiles a bug's programs, and a later mutant's run that
    loaded them would be timed as no new bug runs. Returns the setting that points a run at
    the copy ("none" when caching is off).

    Entries are hard links, where the filesystem allows: jax writes each new entry under a
    new name and never rewrites one, and the coverage examples are replaced whole by a
    rename, so nothing written in the copy reaches the root."""
    root = setting()
    if root == DISABLED:
        return DISABLED
    source = pathlib.Path(root)
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")) if source.is_dir() else ():
        target = dest / path.relative_to(source)
        if path.is_dir():
            target.mkdir(exist_ok=True)
        else:
            try:
                os.link(path, target)
            except OSError:  # another filesystem
                shutil.copy2(path, target)
    return str(dest.resolve())
