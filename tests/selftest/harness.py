"""The self-tests' harness: the packaged gate (attncheck.gate) run on the toy family
(``toy_spec``) in a pytester directory (the ``gate_dir`` fixture of ``conftest.py``), in a
subprocess (xdist needs one), and the CLI and the report files of such runs."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from attncheck import cache_root
from tests.selftest import toy_spec

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC_MODULE = toy_spec.__name__
GATE_ARGS = ("--pyargs", "attncheck.gate", "-p", "no:randomly", "--hypothesis-profile=ci",
             f"--attncheck-spec={SPEC_MODULE}", "--attncheck-only-spec")
# The cache root of every toy run (attncheck.cache_root): the second run of a shape skips
# XLA's compile, and the toy's coverage examples are searched once.
CACHE_ROOT = REPO_ROOT / ".attncheck_cache" / "selftest-toy"
RUN_TIMEOUT_S = 240
INI = """[pytest]
timeout_method = signal
"""


def impl_option(name: str) -> str:
    return f"--attncheck-impl=toy_attention={SPEC_MODULE}:{name}"


def setup_gate_dir(pytester, monkeypatch) -> pathlib.Path:
    """Point the environment of the runs at the repository and the toy spec."""
    pytester.makeini(INI)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(cache_root.CACHE_ENV, str(CACHE_ROOT))
    # The runs must not write to this job's step summary, nor think they are xdist workers.
    for name in ("GITHUB_STEP_SUMMARY", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                 "PYTEST_XDIST_TESTRUNUID", toy_spec.CALL_LOG_ENV):
        monkeypatch.delenv(name, raising=False)
    return pytester.path


def run_gate(pytester, report: str, *args: str):
    """The gate on the toy family, in a subprocess; -n 0 unless args say otherwise."""
    extra = () if any(a.startswith("-n") for a in args) else ("-n", "0")
    return pytester.runpytest_subprocess(*GATE_ARGS, f"--attncheck-report={report}", *extra, *args,
                                         timeout=RUN_TIMEOUT_S)


def start_gate(directory: pathlib.Path, report: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Like run_gate but started in the background (for concurrent runs); cwd = directory."""
    return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *GATE_ARGS,
                             f"--attncheck-report={report}", *args],
                            cwd=directory, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def cli(directory: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m attncheck ARGS`` with cwd = directory."""
    return subprocess.run([sys.executable, "-m", "attncheck", *args], cwd=directory, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


def load_report(directory: pathlib.Path) -> dict:
    return json.loads((directory / "report.json").read_text())


def load_schema() -> dict:
    return json.loads((REPO_ROOT / "attncheck" / "report" / "schema.json").read_text())
