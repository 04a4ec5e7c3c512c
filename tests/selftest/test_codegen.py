"""One commit, one verdict: a run fixes the code its numbers come from (``attncheck.env``),
so that the same case gives the same errors and budgets on every runner of a platform,
whatever the caller's XLA_FLAGS. Each probe runs in a fresh process: XLA and NumPy choose
their code when they start."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from attncheck import env
from tests.selftest.harness import REPO_ROOT

X86 = platform.machine() in ("x86_64", "AMD64")

# Prints a digest of each computation whose rounding depends on the code it runs as (each
# differs between two settings on an AVX-512 host).
PROBE = r"""
import hashlib, json, os, re, sys
from attncheck import env
for warning in env.configure():
    print(warning, file=sys.stderr)
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
rng = np.random.default_rng(0)
digest = lambda x: hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:16]
a, b = rng.standard_normal((1, 2048)).astype(np.float32), rng.standard_normal((2048, 4)).astype(np.float32)
x = rng.standard_normal((64, 512)).astype(np.float32)
p = rng.standard_normal((8, 64)).astype(ml_dtypes.bfloat16)
r = rng.standard_normal((64, 16)).astype(ml_dtypes.bfloat16)
bf16_dot = jax.jit(lambda p, r: jnp.dot(p, r, preferred_element_type=jnp.float32))
long_a = rng.standard_normal((4, 400000)).astype(np.float32)
long_b = rng.standard_normal((400000, 4)).astype(np.float32)
print(json.dumps({
    "xla dot": digest(jax.jit(jnp.dot)(a, b)),
    "xla exp": digest(jax.jit(lambda x: jnp.exp(x) + jnp.tanh(x))(x)),
    "xla long dot": digest(jax.jit(jnp.dot)(long_a, long_b)),
    "bfloat16 dot": digest(bf16_dot(p, r)),
    "library fusions": sorted(set(re.findall(r'"kind":"(__[a-z]+_fusion)"', bf16_dot.lower(p, r).compile().as_text()))),
    "numpy exp": digest(np.exp(x.astype(np.float64)) + np.log1p(np.abs(x.astype(np.float64)))),
}))
"""


def _probe(**environ: str) -> dict:
    run_env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", env.ISA_ENV, "PJRT_NPROC",
                                                                env.NUMPY_DISABLE_ENV, "JAX_PLATFORMS")}
    run_env.update(PYTHONPATH=str(REPO_ROOT), **environ)
    proc = subprocess.run([sys.executable, "-c", PROBE], env=run_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not X86, reason="the instruction sets fixed and compared are x86-64's")
def test_the_callers_xla_flags_do_not_change_a_runs_numbers():
    fixed = _probe()
    for flags in ("--xla_cpu_max_isa=SSE4_2", "--xla_cpu_max_isa=AVX512", "--xla_cpu_experimental_ynn_fusion_type=dot"):
        assert _probe(XLA_FLAGS=flags) == fixed, flags
    # The probe can tell: with the code left to the host, SSE4.2 code computes otherwise.
    assert _probe(XLA_FLAGS="--xla_cpu_max_isa=SSE4_2", **{env.ISA_ENV: env.HOST})["xla dot"] != fixed["xla dot"]


def test_no_dot_goes_to_a_library_that_picks_its_kernel_by_the_cpu():
    """XLA hands dots to YNNPACK, which picks its kernel by the CPU it finds, whatever
    --xla_cpu_max_isa says (on a host with AVX512-BF16 a bfloat16 dot summed each pair of
    products odd element first). A run's dots are XLA's own."""
    assert _probe()["library fusions"] == []
    if X86:  # the probe can tell: left to the host, the dot is YNNPACK's
        assert _probe(**{env.ISA_ENV: env.HOST})["library fusions"] == ["__ynn_fusion"]


def test_a_long_dot_is_the_same_on_a_host_of_many_cpus():
    """Eigen splits a long contraction across XLA's threads, as many as there are CPUs or
    simulated devices (8), whichever is more: a [4, 400000] x [400000, 4] dot differs
    between 8 and 16 threads. A run holds XLA at 8 whatever the host has (a host
    of 16 CPUs is simulated with PJRT_NPROC, which the run replaces)."""
    assert _probe(PJRT_NPROC="16")["xla long dot"] == _probe()["xla long dot"]


def test_the_levels_and_what_a_host_without_them_gets():
    avx2 = env.X86_LEVELS["AVX2"][0]
    assert env.effective_isa("AVX2", "x86_64", avx2 | {"avx512f"}) == "AVX2"
    assert env.effective_isa("AVX2", "x86_64", frozenset({"sse4_2", "avx"})) == "AVX"  # an older CPU: its own
    assert env.effective_isa("AVX512", "x86_64", avx2) == "AVX2"
    assert env.effective_isa("AVX2", "aarch64", frozenset()) == env.HOST
    assert env.effective_isa(env.HOST, "x86_64", avx2) == env.HOST
    flags, variables = env.codegen_settings("AVX2", "x86_64")
    assert "--xla_cpu_max_isa=AVX2" in flags and "--xla_cpu_experimental_ynn_fusion_type=" in flags
    assert variables == {"PJRT_NPROC": "1", env.NUMPY_DISABLE_ENV: "X86_V4 AVX512_ICL AVX512_SPR"}
    assert env.codegen_settings(env.HOST, "x86_64") == ([], {})


def test_an_unknown_instruction_set_is_named(monkeypatch):
    monkeypatch.setenv(env.ISA_ENV, "AVX3")
    with pytest.raises(ValueError, match=r"\$ATTNCHECK_CPU_ISA='AVX3': expected one of SSE4_2, AVX, AVX2, AVX512"):
        env.requested_isa()


@pytest.mark.skipif(not X86, reason="NumPy's kernels are capped on x86-64 only")
def test_the_gate_fixes_numpy_before_a_plugin_that_imports_it_first(tmp_path):
    # A pytest plugin of the environment that imports NumPy when it is loaded, before
    # attncheck's plugin is configured (jaxtyping's does): it sees what NumPy was started with.
    (tmp_path / "early_numpy.py").write_text(
        "import os, pathlib, numpy\n"
        f"pathlib.Path({str(tmp_path / 'seen')!r}).write_text(os.environ.get({env.NUMPY_DISABLE_ENV!r}, ''))\n")
    clean = {k: v for k, v in os.environ.items() if k not in (env.NUMPY_DISABLE_ENV, env.ISA_ENV)
             and not k.startswith("PYTEST_")}
    clean["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO_ROOT)])
    # --markers: pytest loads its plugins, lists its markers and stops.
    subprocess.run([sys.executable, "-m", "attncheck", "gate", "-p", "early_numpy", "--markers"], cwd=tmp_path,
                   env=clean, capture_output=True, text=True, timeout=600)
    assert (tmp_path / "seen").read_text() == " ".join(env.X86_LEVELS[env.FIXED_ISA][1])
