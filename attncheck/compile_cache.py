"""JAX's persistent compilation cache: on by default, shared by every process of a run and
kept across runs, under the cache root (``attncheck.cache_root``: ``$ATTNCHECK_CACHE_DIR``,
default ``.attncheck_cache``, in ``xla/``; ``none`` turns it off with the coverage cache).
``--attncheck-compile-cache DIR`` (or ``none``) overrides it for one run. jax's own
``$JAX_COMPILATION_CACHE_DIR`` is not read: one setting governs attncheck's caches.

Most of the gate's kernel time is tracing and compiling interpret-mode and XLA programs,
and xdist workers, later runs and the mutation runner's copies compile the same ones
again; with the cache they load what another process compiled (tracing is still done
every time), and even an empty one helps within a run: a process reloads executables it
compiled itself. docs/measured.md has the gate's time on a cold and on a warm cache.

What makes an entry safe to reuse (jax 0.12, ``jax/_src/cache_key.py``): the key hashes
the lowered module, the jaxlib version, the platform, ``$XLA_FLAGS`` (the simulated device
count among them), the compile options and the devices, so a changed kernel lowers to
another key and never meets a stale entry. Interpret mode's host callbacks are not in an
entry: the module names each by its index into the executable's callback list (the
``xla_ffi_python_cpu_callback`` custom call), and jax binds the loading process's own
callbacks when it deserializes an entry (``compilation_cache.get_executable_and_time``),
so an entry carries no Python state of the process that wrote it
(``tests/selftest/test_compile_cache.py`` checks both).

A warm cache changes the timing of a run, which can make a latent deadlock likely: an
8-device ring where XLA runs a collective and an interpreted kernel in different orders on
different devices, which ``interpret_compat.ordered_collectives`` prevents; the deadlock is
not the cache's.
``benchmarks/gate_bench.py --soak N`` re-measures the whole gate: N consecutive warm full
gates, each with a stack dump of every process if it hangs.
"""

from __future__ import annotations

import collections
import pathlib

from attncheck import cache_root

# Bounded so a long-lived checkout does not grow without limit, once per run (``trim``):
# jax's own bound reads every entry's access time and locks the directory on each write,
# 0.3-0.5 s a program beside a few thousand entries, more than most take to compile (two
# oracle tests that compile 332 small programs: 18 s beside an empty directory, 169 s
# beside 2500 entries). The bound holds the entries of many full gates.
MAX_BYTES = 2 << 30
DISABLED = cache_root.DISABLED
SUBDIR = "xla"
# jax 0.12 (``jax/_src/lru_cache.py``, ``cache_key.get``) stores a program as
# ``<module name>-<hash>-cache``; with its own bound, beside an access time (``-atime``)
# and a lock (``.lockfile``), which a cache written by an earlier attncheck still holds.
_ENTRY_SUFFIX = "-cache"
_BOUND_FILES = ("-atime", ".lockfile")


def resolve(option: str | None) -> pathlib.Path | None:
    """The cache directory: the option (``none``: no cache), else ``xla/`` under the cache
    root (None when the root is ``none``)."""
    if option == DISABLED:
        return None
    if option:
        return pathlib.Path(option).resolve()
    return cache_root.subdir(SUBDIR)


def configure(directory: pathlib.Path | None) -> None:
    """Use the cache in ``directory``, or no cache at all (None) in this process, before
    it compiles anything."""
    import jax

    if directory is None:
        # Explicitly: jax would otherwise still honour $JAX_COMPILATION_CACHE_DIR.
        jax.config.update("jax_enable_compilation_cache", False)
        return
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # The default (1 s) would skip nearly every gate executable: each compiles in under a
    # second, but there are hundreds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # No bound of jax's (MAX_BYTES). Without one jax takes no lock: a process that meets an
    # entry another is half-way through writing fails to decompress it, warns and compiles
    # the program itself (a truncated zlib stream is an error, never a shorter program).
    jax.config.update("jax_compilation_cache_max_size", -1)


def trim(directory: pathlib.Path, max_bytes: int = MAX_BYTES) -> None:
    """Hold ``directory`` to ``max_bytes``, the entries read or written longest ago going
    first, and remove what jax's own bound left there. Called by a run's first process,
    before its workers start."""
    entries = []
    for path in directory.iterdir() if directory.is_dir() else ():
        try:
            if path.name.endswith(_ENTRY_SUFFIX):
                stat = path.stat()
                entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, path))
            elif path.name.endswith(_BOUND_FILES):
                path.unlink()
        except FileNotFoundError:  # another run trimmed it first
            continue
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size


def programs(directory: pathlib.Path) -> collections.Counter[str]:
    """The programs a cache directory holds, counted by the name jax gives a program (the
    jitted function's: ``jit_run`` for a kernel's forward and VJP, ``jit__forward_and_grads``
    for the yardstick's): after a run on an emptied cache, the distinct programs it compiled."""
    names = collections.Counter()
    for entry in directory.glob(f"*{_ENTRY_SUFFIX}") if directory.is_dir() else ():
        names[entry.name[:-len(_ENTRY_SUFFIX)].rsplit("-", 1)[0]] += 1
    return names
