"""JAX's persistent compilation cache, shared by every process of a gate run.

Interpret-mode kernels spend about half their gate time in XLA compilation, and xdist
workers (and later runs, and the mutation runner's subprocesses) compile the same
executables again. The cache is keyed by the lowered module, compile options, XLA flags and
the jax version, so a changed kernel never hits a stale entry; host callbacks (the
interpreter's) are bound again at load time, so an entry is safe to share between
processes.

One exception, measured: an interpret-mode executable spanning 8 devices (ring flash
attention) deadlocks when loaded from the cache (7 of 8 devices reach the first
collective-permute, the eighth never does), while the same executable compiled fresh
passes, and so do loaded 1-, 2- and 4-device ones. Executables with host callbacks over
more than one device are therefore always compiled fresh and never written.
"""

from __future__ import annotations

import os
import pathlib

DEFAULT_DIR = pathlib.Path(".jax_cache") / "compile"
# Bounded so a long-lived checkout does not grow without limit; least recently used
# entries go first. A full gate writes about 60 MB.
MAX_BYTES = 2 << 30
DISABLED = "none"


def resolve(option: str | None, rootdir: pathlib.Path) -> pathlib.Path | None:
    """The cache directory: the option, else $JAX_COMPILATION_CACHE_DIR, else under the
    project root; None when the option is "none"."""
    if option == DISABLED:
        return None
    chosen = option or os.environ.get("JAX_COMPILATION_CACHE_DIR") or rootdir / DEFAULT_DIR
    return pathlib.Path(chosen).resolve()


def enable(directory: pathlib.Path) -> None:
    import jax

    _bypass_for_multi_device_callbacks()
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # The default (1 s) would skip nearly every gate executable: each compiles in 0.1-1 s,
    # but there are hundreds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A size bound makes jax lock the directory, which is what keeps two workers from
    # reading an entry the other is half-way through writing.
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)


def _bypass_for_multi_device_callbacks() -> None:
    """Compile executables with host callbacks over several devices without the cache.

    jax has no per-executable switch, so this wraps its one entry point (jax is pinned;
    a missing entry point fails loudly rather than silently caching them).
    """
    from jax._src import compiler

    original = compiler.compile_or_get_cached
    if getattr(original, "_attncheck_bypass", False):
        return

    def compile_or_get_cached(backend, computation, devices, compile_options, host_callbacks,
                              executable_devices, *args, **kwargs):
        if host_callbacks and devices.size > 1:
            return compiler.backend_compile_and_load(backend, computation, executable_devices,
                                                     compile_options, host_callbacks)
        return original(backend, computation, devices, compile_options, host_callbacks,
                        executable_devices, *args, **kwargs)

    compile_or_get_cached._attncheck_bypass = True
    compiler.compile_or_get_cached = compile_or_get_cached
