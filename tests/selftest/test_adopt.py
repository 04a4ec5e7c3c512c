"""README's "Use attncheck in your kernel repo", run exactly as written from a temporary
directory outside this checkout: the packaged gate against an implementation defined there."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTION = "## Use attncheck in your kernel repo"


def readme_example() -> tuple[dict[str, str], str]:
    """The files (name -> text) and the command of the README section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    blocks = re.findall(r"<!-- adopt:(file (\S+)|command) -->\n```\w*\n(.*?)```", section, re.S)
    files = {name: body for kind, name, body in blocks if kind.startswith("file")}
    [command] = [body for kind, _, body in blocks if kind == "command"]
    return files, command


def test_the_readme_example_has_a_kernel_file_and_a_command():
    files, command = readme_example()
    assert list(files) == ["my_kernels.py"] and command.startswith("attncheck gate ")


def test_the_gate_runs_from_another_repository_against_its_own_kernel(tmp_path):
    files, command = readme_example()
    repo = tmp_path / "their_repo"
    repo.mkdir()
    for name, body in files.items():
        (repo / name).write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_STEP_SUMMARY"))}
    # Their repository on the path (as its own package would be); attncheck as installed.
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(repo)
    proc = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((repo / "reports" / "latest" / "report.json").read_text())
    assert report["verdict"] == "PASS" and report["totals"]["cases"] >= 10
    assert {(r["kernel"], r["impl"], r["impl_ref"]) for r in report["records"]} == {
        ("flash_attention", "user", "my_kernels:flash_attention")}
    assert not (ROOT / "my_kernels.py").exists() and str(ROOT) not in str(repo)
