"""README's "Adopt it in your kernel repository", run exactly as written from a temporary
directory outside this checkout: the packaged gate against an implementation defined there,
then the declaration step on that run's report. The install step names the version that is
installed here (tests/selftest/test_wheel.py installs the built wheel itself)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTION = "## Adopt it in your kernel repository"


def readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION):]
    return section[:section.index("\n## ", len(SECTION))]


def readme_example() -> tuple[dict[str, str], list[str]]:
    """The files (name -> text) and the commands, in order, of the README section."""
    blocks = re.findall(r"<!-- adopt:(file (\S+)|command) -->\n```\w*\n(.*?)```", readme_section(), re.S)
    files = {name: body for kind, name, body in blocks if kind.startswith("file")}
    commands = [body for kind, _, body in blocks if kind == "command"]
    return files, commands


def readme_install() -> str:
    [install] = re.findall(r"<!-- adopt:install -->\n```\w*\n(.*?)```", readme_section(), re.S)
    return install.strip()


def test_the_readme_example_has_a_kernel_file_a_gate_and_a_declaration():
    files, commands = readme_example()
    assert list(files) == ["my_kernels.py"]
    assert [c.split()[:3] for c in commands] == [["attncheck", "gate", "--attncheck-kernel"],
                                                 ["attncheck", "expectations", "init"]]


def test_the_readme_installs_this_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert readme_install() == f"pip install {project['name']}=={project['version']}"
    assert importlib.metadata.version(project["name"]) == project["version"]


def test_the_gate_runs_from_another_repository_against_its_own_kernel(tmp_path):
    files, (gate, declare) = readme_example()
    repo = tmp_path / "their_repo"
    repo.mkdir()
    for name, body in files.items():
        (repo / name).write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_STEP_SUMMARY"))}
    # Their repository on the path (as its own package would be); attncheck as installed.
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(repo)
    proc = subprocess.run(["bash", "-c", gate], cwd=repo, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((repo / "reports" / "latest" / "report.json").read_text())
    assert report["verdict"] == "PASS" and report["totals"]["cases"] >= 10
    assert {(r["kernel"], r["impl"], r["impl_ref"]) for r in report["records"]} == {
        ("flash_attention", "user", "my_kernels:flash_attention")}
    assert not (ROOT / "my_kernels.py").exists() and str(ROOT) not in str(repo)
    # Step 3 on that run: a kernel that deviates from nothing has nothing to declare.
    proc = subprocess.run(["bash", "-c", declare], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "nothing to declare" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
    assert not (repo / "pyproject.toml").exists()
