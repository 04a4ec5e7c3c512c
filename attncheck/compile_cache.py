"""JAX's persistent compilation cache, shared by every process of a run: opt-in.

xdist workers, later runs and the mutation runner's subprocesses compile the same
executables again; with a cache directory they load what another process compiled (the
key covers the lowered module, compile options, XLA flags and the jax version, so a
changed kernel never hits a stale entry). Measured on the full gate at -n 0: 257 s on a
warm cache, 388 s on an empty one (one process still reloads executables it compiled),
471 s without a cache.

It is off unless asked for (``--attncheck-compile-cache DIR`` or
``$JAX_COMPILATION_CACHE_DIR``): on a warm cache the 8-device ring flash case of the
interpret-hazards backend deadlocked in five of five full runs. The deadlock turned out
not to be the cache's (a fresh clone without one hung once too: two simulated cores on 8
devices starve XLA's CPU thread pool, now avoided in ``attncheck/backends.py``), but the
cache made it likely by changing the interpreter's timing, and it has not been re-measured
since that fix. The XLA-only self-test runs use one.
"""

from __future__ import annotations

import os
import pathlib

# Bounded so a long-lived checkout does not grow without limit; least recently used
# entries go first. A full gate writes about 60 MB.
MAX_BYTES = 2 << 30
DISABLED = "none"


def resolve(option: str | None) -> pathlib.Path | None:
    """The cache directory: the option, else $JAX_COMPILATION_CACHE_DIR; None (no cache)
    when neither is set or the option is "none"."""
    if option == DISABLED:
        return None
    chosen = option or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return pathlib.Path(chosen).resolve() if chosen else None


def enable(directory: pathlib.Path) -> None:
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # The default (1 s) would skip nearly every gate executable: each compiles in 0.1-1 s,
    # but there are hundreds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A size bound makes jax lock the directory, which is what keeps two workers from
    # reading an entry the other is half-way through writing.
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
