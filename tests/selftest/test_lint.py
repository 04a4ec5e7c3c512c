"""The project's lint (pyproject.toml's ``[tool.ruff]``: ruff's default rules and a line
length of 120) holds over every Python file of the checkout, and would catch a file that
breaks it. ruff comes with the developers' environment (the ``dev`` extra that ./dev
installs)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATHS = ("attncheck", "kernels", "tests", "benchmarks")


def _ruff(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff", reason="ruff is the dev extra's (./dev installs it)")
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_the_checkout_passes_its_lint():
    proc = _ruff(*PATHS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("line, rule", [
    ("x = '" + "a" * 120 + "'\n", "E501"),
    ("import os\n", "F401"),
])
def test_a_file_that_breaks_the_lint_fails_it(tmp_path, line, rule):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (tmp_path / "planted.py").write_text(line)
    proc = _ruff("planted.py", cwd=tmp_path)
    assert proc.returncode == 1 and rule in proc.stdout, proc.stdout + proc.stderr
