"""jax's persistent compilation cache: on by default under attncheck's cache root, shared by
runs, off with ``none``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from attncheck import cache_root, compile_cache, coverage
from tests.selftest import harness


def test_the_cache_is_under_the_cache_root_unless_the_option_says_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cache_root.CACHE_ENV, raising=False)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-own"))  # not attncheck's setting
    default = (tmp_path / cache_root.DEFAULT_CACHE_DIR).resolve()
    assert compile_cache.resolve(None) == default / "xla"
    assert coverage.cache_dir() == default / "coverage"
    monkeypatch.setenv(cache_root.CACHE_ENV, str(tmp_path / "root"))
    assert compile_cache.resolve(None) == (tmp_path / "root" / "xla").resolve()
    assert compile_cache.resolve(str(tmp_path / "opt")) == (tmp_path / "opt").resolve()
    assert compile_cache.resolve(compile_cache.DISABLED) is None
    # "none" turns both caches off; the option still chooses one for its run.
    monkeypatch.setenv(cache_root.CACHE_ENV, cache_root.DISABLED)
    assert compile_cache.resolve(None) is None and coverage.cache_dir() is None
    assert compile_cache.resolve(str(tmp_path / "opt")) == (tmp_path / "opt").resolve()


HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
MISS = re.compile(r"PERSISTENT COMPILATION CACHE MISS for '([^']+)'")


def _toy_run(pytester, report: str):
    """The toy gate's builtin implementation with -s, so that jax's debug log of the
    compiler (every persistent cache hit and miss) reaches the output."""
    result = harness.run_gate(pytester, report, "-s", "-k", "builtin")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    log = result.stdout.str() + result.stderr.str()
    return HIT.findall(log), MISS.findall(log)


@pytest.mark.usefixtures("gate_dir")
def test_a_run_fills_the_cache_the_next_run_loads_it_and_none_uses_none(pytester, monkeypatch, tmp_path):
    # jax's compiler logs every persistent cache hit and miss at debug level; its debug
    # handler prints only while the jax logger has a level above debug.
    monkeypatch.setenv("JAX_DEBUG_LOG_MODULES", "jax._src.compiler")
    monkeypatch.setenv("JAX_LOGGING_LEVEL", "WARNING")
    root = tmp_path / "root"
    monkeypatch.setenv(cache_root.CACHE_ENV, str(root))
    _, cold_misses = _toy_run(pytester, "cold")
    entries = sorted(p.name for p in (root / compile_cache.SUBDIR).glob("*-cache"))
    assert cold_misses and len(entries) >= len(set(cold_misses))
    # The bench's count of the distinct programs a cold run compiled: its entries, by the
    # names jax's compiler logged them under.
    programs = compile_cache.programs(root / compile_cache.SUBDIR)
    assert sum(programs.values()) == len(entries) and set(programs) == set(cold_misses)
    # Unbounded by jax, which then neither locks nor keeps access times; what its bound left
    # in a cache of an earlier attncheck goes when the next run starts.
    assert [p.name for p in (root / compile_cache.SUBDIR).iterdir() if not p.name.endswith("-cache")] == []
    for leftover in (".lockfile", f"{entries[0][:-len('-cache')]}-atime"):
        (root / compile_cache.SUBDIR / leftover).write_bytes(b"")
    warm_hits, warm_misses = _toy_run(pytester, "warm")
    # Everything the second run compiled came from the first run's entries; it wrote none.
    assert warm_hits and not warm_misses
    assert sorted(p.name for p in (root / compile_cache.SUBDIR).iterdir()) == entries
    monkeypatch.setenv(cache_root.CACHE_ENV, cache_root.DISABLED)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-own"))  # jax's own: must stay unused
    assert _toy_run(pytester, "none") == ([], [])
    assert not (tmp_path / "jax-own").exists()


def test_trim_holds_the_bound_the_entries_used_longest_ago_going_first(tmp_path):
    cache = tmp_path / "xla"
    cache.mkdir()
    for age, name in enumerate(("new", "old", "used")):
        entry = cache / f"jit_{name}-0-cache"
        entry.write_bytes(b"x" * 100)
        os.utime(entry, (1e9 - 1000 * age, 1e9 - 1000 * age))
    os.utime(cache / "jit_used-0-cache", (2e9, 1e9 - 2000))  # written first, read since
    compile_cache.trim(cache, max_bytes=250)
    assert sorted(p.name for p in cache.iterdir()) == ["jit_new-0-cache", "jit_used-0-cache"]
    compile_cache.trim(cache, max_bytes=200)  # within the bound: nothing more goes
    assert len(list(cache.iterdir())) == 2
    compile_cache.trim(tmp_path / "not-yet-made")


# A jitted function with a host callback, as interpret mode's are; the callback adds this
# process's own offset.
CALLBACK_PROGRAM = """
import pathlib, sys
import jax, jax.numpy as jnp, numpy as np
from attncheck import compile_cache
compile_cache.configure(pathlib.Path(sys.argv[1]))
offset = float(sys.argv[2])
host = lambda x: (np.asarray(x) + offset).astype(np.float32)
f = jax.jit(lambda x: jax.pure_callback(host, jax.ShapeDtypeStruct((3,), jnp.float32), x) * 2)
print("result", float(f(jnp.ones(3, jnp.float32))[0]))
"""


def test_an_entry_with_a_host_callback_runs_the_callback_of_the_process_that_loads_it(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEBUG_LOG_MODULES="jax._src.compiler", JAX_LOGGING_LEVEL="WARNING")

    def run(offset: float) -> tuple[str, list[str]]:
        done = subprocess.run([sys.executable, "-c", CALLBACK_PROGRAM, str(tmp_path), str(offset)], env=env,
                              capture_output=True, text=True, timeout=120, check=True)
        return done.stdout.strip(), HIT.findall(done.stderr)

    assert run(1.0) == ("result 4.0", [])
    output, hits = run(100.0)
    # Loaded from the first process's entry, yet running this process's callback.
    assert output == "result 202.0" and "jit__lambda" in hits


# A program whose constant is part of its lowered module: each factor is another entry.
SCALE_PROGRAM = """
import pathlib, sys
import jax, jax.numpy as jnp
from attncheck import compile_cache
compile_cache.configure(pathlib.Path(sys.argv[1]))
print(float(jax.jit(lambda x: x * float(sys.argv[2]))(jnp.ones(()))))
"""


def test_a_private_copy_loads_the_roots_entries_and_keeps_its_own(tmp_path, monkeypatch):
    """What the mutation runner gives each mutated run: the checkout's programs load, and
    what the run compiles or touches stays in the copy."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DEBUG_LOG_MODULES="jax._src.compiler", JAX_LOGGING_LEVEL="WARNING")

    def run(cache, factor: float) -> list[str]:
        done = subprocess.run([sys.executable, "-c", SCALE_PROGRAM, str(cache / compile_cache.SUBDIR), str(factor)],
                              env=env, capture_output=True, text=True, timeout=120, check=True)
        assert float(done.stdout) == factor
        return HIT.findall(done.stderr)

    def files(directory):
        return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}

    root = tmp_path / "root"
    monkeypatch.setenv(cache_root.CACHE_ENV, str(root))
    assert "jit__lambda" not in run(root, 2.0)
    (root / "coverage").mkdir()
    (root / "coverage" / "family-key.json").write_text("[]")
    before = files(root)
    copy = tmp_path / "copy"
    assert cache_root.private_copy(copy) == str(copy.resolve())
    assert "jit__lambda" in run(copy, 2.0), "the copy should load the root's entry"
    assert "jit__lambda" not in run(copy, 3.0)
    # The copy holds the root's files and one more entry; the root is as it was.
    assert files(root) == before
    assert set(files(copy)) - set(before) and set(before) <= set(files(copy))
    monkeypatch.setenv(cache_root.CACHE_ENV, cache_root.DISABLED)
    assert cache_root.private_copy(tmp_path / "off") == cache_root.DISABLED
