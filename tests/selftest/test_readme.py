"""README.md is a newcomer's page: it leads with the Quick start, stays short, logs no runs,
and every command it shows is run by a test. The commands of its fenced blocks are each run
for real somewhere (``RUN_BY``); every command it shows, inline ones too, is checked here
against the command line it goes to, which must take it (in seconds, and no run starts).
Its links, and those of the docs pages it points to, resolve."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 150
# Each command of the README's fenced blocks -> what runs it as written.
RUN_BY = {
    "./dev gate": "the CI workflow (.github/workflows/attncheck.yml, `./dev gate --attncheck-shard`); here at --help",
    "./dev test": ".ci/run (test_the_quick_start_is_what_ci_runs)",
    "pip install attncheck==": "tests/selftest/test_adopt.py (this version), tests/selftest/test_wheel.py (the wheel)",
    "attncheck gate --attncheck-kernel flash_attention": "tests/selftest/test_adopt.py",
    "attncheck expectations init": "tests/selftest/test_adopt.py",
}
# Pages of docs/ this test owns the links of (DESIGN.md is checked where it is written).
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "DESIGN.md")


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each ``## `` section, in order."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def _block_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks: continuations joined, comments dropped."""
    out = []
    for body in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(" ".join(line.split()))
    return out


def _inline_commands(text: str) -> list[str]:
    """The commands shown inline, as `./dev ...` or `attncheck ...` code spans."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [span for span in re.findall(r"`([^`\n]+)`", prose) if re.match(r"(\./dev|attncheck) ", span)]


def _fresh_venv() -> bool:
    """./dev would install first (pyproject.toml changed since .venv was made): a test never does."""
    stamp = ROOT / ".venv" / ".attncheck-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    return stamp.is_file() and stamp.read_text().strip() == want


def _goes_to_pytest(words: list[str]) -> bool:
    return words[:2] in (["./dev", "gate"], ["./dev", "test"], ["attncheck", "gate"])


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _check(command: str) -> None:
    """The command line a README command goes to takes it. One that goes to pytest is given
    ``--version --version``: pytest parses the whole command line (an unknown option is a
    usage error) and stops before configuring anything, so no run starts and no report
    directory is touched (``--help`` configures the plugin, which starts a run). Any other
    is asked for its ``--help``, which must name each of the command's options."""
    words = shlex.split(command)
    if words[0] == "./dev":
        if not _fresh_venv():
            pytest.skip(".venv is older than pyproject.toml: ./dev would reinstall it (run ./dev env)")
        base = [str(ROOT / "dev")]
    else:
        base = [sys.executable, "-m", "attncheck"]
    if _goes_to_pytest(words):
        proc = _run([*base, *words[1:], "--version", "--version"])
        assert proc.returncode == 0, f"{command}: {(proc.stdout + proc.stderr)[-3000:]}"
        return
    subcommands = [w for w in words[1:3] if re.fullmatch(r"[a-z][a-z-]*", w)]
    proc = _run([*base, *subcommands, "--help"])
    assert proc.returncode == 0, f"{command}: {(proc.stdout + proc.stderr)[-3000:]}"
    for option in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", command):
        assert re.search(re.escape(option) + r"(?![\w-])", proc.stdout), f"{command}: {option} is not an option of it"


def test_the_readme_is_short_and_leads_with_the_quick_start():
    text = _text()
    assert len(text.splitlines()) <= MAX_LINES, "README.md is a newcomer's page: move details into docs/"
    (first, body), *_ = _sections(text)
    assert first == "Quick start"
    assert _block_commands(body) == ["./dev gate", "./dev test"]


def test_the_quick_start_is_what_ci_runs():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert [line for line in lines if line and not line.startswith("#")][-1] == "./dev test"


def test_no_paragraph_is_a_log_of_runs():
    """Measured figures live in docs/measured.md (written by ./dev bench), history in git."""
    prose = re.sub(r"```.*?```", "", _text(), flags=re.S)
    logs = {
        "a commit": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",
        "a date": r"\b20\d\d-\d\d-\d\d\b",
        "a round": r"\b[Rr]ounds? \d",
        "a duration": r"\b\d+(\.\d+)? ?(s|min|ms)\b",
    }
    for what, pattern in logs.items():
        found = [m.group(0) for m in re.finditer(pattern, prose)]
        assert not found, f"README.md quotes {what}: {found}"


def test_every_block_command_is_run_by_a_test():
    commands = _block_commands(_text())
    assert commands
    for command in commands:
        assert [k for k in RUN_BY if command.startswith(k)], f"README command no test runs: {command}"


@pytest.mark.parametrize("command", sorted({c for c in _block_commands(_text()) + _inline_commands(_text())
                                            if not c.startswith("pip ")}), ids=str)
def test_every_command_is_one_the_cli_takes(command):
    _check(command)


def _workflow_inputs(workflow: str) -> set[str]:
    """The input names under ``on: workflow_call: inputs:`` (by indentation, no YAML parser)."""
    lines = workflow.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "inputs:")
    indent = len(lines[start]) - len(lines[start].lstrip())
    names = set()
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        if re.fullmatch(r"\s*[A-Za-z][\w-]*:\s*", line) and len(line) - len(line.lstrip()) == indent + 2:
            names.add(line.strip()[:-1])
    return names


def test_the_ci_snippet_calls_the_reusable_workflow():
    [snippet] = re.findall(r"```yaml\n(.*?)```", _text(), re.S)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    [(path, tag)] = re.findall(r"uses: \S+?/attncheck/(\S+)@(\S+)", snippet)
    workflow = (ROOT / path).read_text()
    assert "workflow_call:" in workflow and tag == f"v{version}"
    given = dict(re.findall(r"^ {6}([\w-]+): (.*)$", snippet, re.M))
    assert set(given) <= _workflow_inputs(workflow) and {"install", "args", "shards"} <= set(given)
    assert given["install"] == f"attncheck=={version}"
    shards = json.loads(json.loads(given["shards"]))
    assert shards == list(range(1, len(shards) + 1))
    _check(f"attncheck gate {given['args']}")


def test_the_families_table_names_every_family_and_its_default():
    from attncheck import specs

    [(_, body)] = [s for s in _sections(_text()) if s[0] == "Kernel families"]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in body.splitlines()
            if line.startswith("| `")]
    families = specs.all_specs()
    named = [name for row in rows for name in re.findall(r"`(\w+)`", row[0])]
    assert sorted(named) == sorted(families)
    for row in rows:
        for name in re.findall(r"`(\w+)`", row[0]):
            ours = [ref.startswith("attncheck_kernels.") for ref in families[name].default_impls.values()]
            default = row[2]
            assert ("this repository's" in default) == any(ours), (name, default)
            assert ("jax" in default) == (not all(ours)), (name, default)


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "deviations.md"], ids=lambda p: p.name)
def test_the_declared_deviation_example_is_a_valid_entry(page, tmp_path):
    from attncheck import expectations, specs

    [example] = re.findall(r"```toml\n(.*?)```", page.read_text(), re.S)
    (tmp_path / "pyproject.toml").write_text(example)
    entries = expectations.read(tmp_path / "pyproject.toml")
    assert len(entries) == 1
    expectations.validate(entries, specs.all_specs(), lambda spec, ref: [])


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    heading = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(encoding="utf-8"), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.name}: {target}: no such heading"


def test_the_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", _text()))
    assert {p.name for p in DOCS} | {"DESIGN.md"} <= linked


def test_adding_a_family_is_written_once_where_the_spec_interface_points():
    """``specs/base.py`` points to one page and section; that section holds the steps, in
    order, with the toy spec as the worked example, and no other page repeats them."""
    import ast

    from attncheck.specs import base

    pointer = re.search(r'``(docs/[\w./-]+\.md)``, "([^"]+)"', ast.get_docstring(ast.parse(
        pathlib.Path(base.__file__).read_text())))
    assert pointer, "specs/base.py names no page and section for adding a family"
    page, heading = ROOT / pointer[1], pointer[2]
    sections = re.split(r"^## ", page.read_text(), flags=re.M)
    section = next((s for s in sections if s.startswith(heading + "\n")), None)
    assert section is not None, f"{page} has no section {heading!r}"
    steps = [int(n) for n in re.findall(r"^(\d+)\. ", section, flags=re.M)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5, steps
    assert "toy_spec.py" in section and (ROOT / "tests/selftest/toy_spec.py").is_file()
    others = [p for p in (ROOT / "docs").glob("*.md") if p != page] + [ROOT / "README.md"]
    assert not [p.name for p in others if re.search(r"^#+ Adding a (kernel )?family", p.read_text(), flags=re.M)]
