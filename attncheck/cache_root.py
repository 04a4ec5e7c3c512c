"""The one directory attncheck keeps its caches in, shared by every process of a run and
kept across runs: the coverage examples (``coverage/``) and jax's persistent compilation
cache (``xla/``).

``$ATTNCHECK_CACHE_DIR`` chooses it (default ``.attncheck_cache`` in the working
directory); ``none`` turns both caches off. CI restores and saves this one directory.
"""

from __future__ import annotations

import os
import pathlib

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
