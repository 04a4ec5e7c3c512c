"""The built wheel, installed into a fresh venv, as a kernel repository adopts it: the
names it installs are attncheck's own, it carries every file the gate reads, it installs
beside the ``kernels`` distribution, and the reusable workflow's steps run the gate from a
repository with its own ``kernels/`` package, verifying attncheck's builtin kernel with the
records this checkout gives, and the user's kernel only when asked."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from attncheck import cache_root
from attncheck.report.records import Record, numbers_differ

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "attncheck-gate.yml"
# The distribution that owns the import name `kernels` on the package index.
KERNELS_DISTRIBUTION = "kernels==0.17.2"
# One family on the backend that verifies its numbers fastest and on the lowering: a test
# for each of two shards.
GATE_ARGS = "--attncheck-kernel flash_attention --attncheck-backend interpret-hazards,tpu-lower"
MARKER = "user-kernel-imported"
SOURCES = ("pyproject.toml", "README.md", "attncheck", "kernels")


def _pip(python: pathlib.Path, *args: str, cwd: pathlib.Path | None = None) -> None:
    proc = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=600)
    assert proc.returncode == 0, f"pip {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel built from a copy of what it is made of: setuptools builds in the source
    tree, where a build/ left by an earlier build would lend it files the tree no longer has."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    _pip(pathlib.Path(sys.executable), "wheel", "--no-deps", str(source), "-w", str(out))
    (built,) = out.glob("attncheck-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> pathlib.Path:
    """A fresh venv with the wheel (and its dependencies) and the `kernels` distribution."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    _pip(root / "bin" / "python", "install", str(wheel))
    _pip(root / "bin" / "python", "install", "--no-deps", KERNELS_DISTRIBUTION)
    return root


def _workflow_steps() -> dict[str, str]:
    """name -> shell of each `run:` step of the reusable workflow (a step's shell is the
    same wherever it appears)."""
    steps: dict[str, str] = {}
    for match in re.finditer(r"^( +)- name: (.+)\n\1  run: \|\n((?:\1    .*\n|\n)+)", WORKFLOW.read_text(), re.M):
        shell = textwrap.dedent(match.group(3))
        assert steps.setdefault(match.group(2), shell) == shell, match.group(2)
    return steps


def _user_repository(path: pathlib.Path) -> pathlib.Path:
    """A kernel repository whose own `kernels.flash_attention` says when it is imported and
    delegates to attncheck's kernel (so that verifying it through --attncheck-impl passes)."""
    (path / "kernels").mkdir(parents=True)
    (path / "kernels" / "__init__.py").write_text("")
    (path / "kernels" / "flash_attention.py").write_text(textwrap.dedent(f"""\
        import pathlib
        pathlib.Path(__file__).parents[1].joinpath({MARKER!r}).touch()
        from attncheck_kernels.flash_attention import flash_attention
        """))
    return path


def _report(directory: pathlib.Path) -> tuple[dict, list[Record]]:
    """The report and its records, each test named without its file (pytest names the
    installed package's tests from the package, the checkout's from the rootdir)."""
    data = json.loads((directory / "report.json").read_text())
    return data, [dataclasses.replace(r, nodeid=r.nodeid.partition("::")[2])
                  for r in map(Record.from_json, data["records"])]


def test_the_wheel_installs_only_names_attncheck_owns_and_every_file_the_gate_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n.split("/")[0] for n in names} == {"attncheck", "attncheck_kernels", "attncheck-0.1.0.dist-info"}
    needed = {"attncheck/gate/test_gate.py", "attncheck/gate/durations.json",
              "attncheck/report/schema.json", "attncheck/findings/README.md"}
    needed |= {str(p.relative_to(ROOT)) for p in (ROOT / "attncheck").rglob("__init__.py")}
    needed |= {str(p.relative_to(ROOT)) for p in (ROOT / "attncheck" / "findings").glob("*.py")}
    needed |= {str(p.relative_to(ROOT)) for p in (ROOT / "attncheck" / "coverage_examples").glob("*.json")}
    needed |= {f"attncheck_kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")}
    assert not needed - names, f"missing from the wheel: {sorted(needed - names)}"


def test_it_installs_beside_the_kernels_distribution_without_a_clash(venv):
    probe = textwrap.dedent("""\
        import importlib.metadata as m, importlib.util as u, json
        files = {d: sorted(str(f) for f in m.distribution(d).files) for d in ("attncheck", "kernels")}
        # Where each name resolves (`kernels` itself needs dependencies installed --no-deps left out).
        print(json.dumps({"files": files, "kernels": u.find_spec("kernels").origin,
                          "ours": u.find_spec("attncheck_kernels").origin}))
        """)
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, cwd=venv)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert not set(out["files"]["attncheck"]) & set(out["files"]["kernels"])
    assert "kernels/__init__.py" in out["files"]["kernels"] and out["kernels"].startswith(str(venv))
    assert out["ours"].startswith(str(venv)) and out["ours"].endswith("attncheck_kernels/__init__.py")


def test_the_workflow_gates_a_user_repository_with_the_records_of_this_checkout(venv, wheel, tmp_path):
    steps = _workflow_steps()
    assert set(steps) == {"Install attncheck", "Gate shard", "Merge the shards"}, steps
    repo = _user_repository(tmp_path / "repo")
    # Its own package first on sys.path, as in a repository whose root conftest or
    # PYTHONPATH puts it there; the checkout's caches serve both runs alike.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "PYTEST_", "ATTNCHECK_"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", PYTHONPATH=str(repo),
               ATTNCHECK_INSTALL=str(wheel), ATTNCHECK_ARGS=GATE_ARGS, ATTNCHECK_REPORT="reports/merged",
               **{cache_root.CACHE_ENV: cache_root.setting()})

    def step(name: str, **more: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", steps[name]], cwd=repo, env=dict(env, **more),
                              capture_output=True, text=True, timeout=900)

    assert step("Install attncheck").returncode == 0
    for k in (1, 2):
        run = step("Gate shard", ATTNCHECK_SHARD=f"{k}/2", ATTNCHECK_SHARD_REPORT=f"shards/attncheck-shard-{k}-1")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    merged = step("Merge the shards")
    assert merged.returncode == 0, merged.stdout[-3000:] + merged.stderr[-3000:]
    assert not (repo / MARKER).exists(), "the gate imported the repository's own kernels.flash_attention"

    here = tmp_path / "checkout"
    subprocess.run([sys.executable, "-m", "attncheck", "gate", *GATE_ARGS.split(), "--attncheck-report", str(here)],
                   cwd=ROOT, env={k: v for k, v in env.items() if k != "PYTHONPATH"}, capture_output=True, check=True,
                   timeout=900)
    (data, installed), (_, ours) = _report(repo / "reports" / "merged"), _report(here)
    assert data["verdict"] == "PASS" and installed and {r.impl for r in installed} == {"builtin"}
    assert numbers_differ(installed, ours) == []

    asked = subprocess.run(["attncheck", "gate", "--attncheck-kernel", "flash_attention", "--attncheck-backend",
                            "tpu-lower", "--attncheck-impl", "flash_attention=kernels.flash_attention:flash_attention",
                            "--attncheck-report", "reports/user"], cwd=repo, env=env, capture_output=True, text=True,
                           timeout=900)
    assert asked.returncode == 0, asked.stdout[-3000:] + asked.stderr[-3000:]
    assert (repo / MARKER).exists()
    assert {r.impl_ref for r in _report(repo / "reports" / "user")[1]} == {"kernels.flash_attention:flash_attention"}
