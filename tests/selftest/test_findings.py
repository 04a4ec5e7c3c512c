"""The findings upstream can act on (attncheck/findings): each reproducer is standalone and
still reproduces on the pinned jax; each is held by the gate as the family declares it."""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

from attncheck import expectations, findings, specs, third_party

ROOT = pathlib.Path(__file__).resolve().parents[2]

FILED = [f for f in findings.FINDINGS if f.reproducer is not None]


def test_every_finding_not_by_design_has_a_reproducer_and_an_issue_draft():
    assert {f.id for f in findings.FINDINGS if not f.by_design} == {f.id for f in FILED}
    assert all(f.issue is not None for f in FILED)


@pytest.mark.parametrize("finding", FILED, ids=lambda f: f.id)
def test_the_reproducer_needs_only_jax_and_numpy_and_still_reproduces(finding, tmp_path):
    # A clean environment: no PYTHONPATH, nothing of attncheck's setup, another directory.
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    allowed = {"jax", "jaxlib", "numpy", finding.package}
    if finding.fetched_by is not None:
        pin = importlib.import_module(finding.fetched_by).PIN
        try:
            clean[pin.wheel_env] = str(third_party.fetch_wheel(pin))
        except third_party.Unavailable as exc:
            pytest.skip(f"{pin.requirement}'s wheel is not available here: {exc}")
        allowed.add("attncheck")
    elif finding.package is not None:
        pytest.importorskip(finding.package, reason=f"{finding.package} is not installed "
                                                    "(pip install 'attncheck[third-party]')")
    tree = ast.parse(finding.reproducer.read_text())
    # Every name imported, dotted: a module, or what a ``from`` import takes from one.
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 for alias in node.names}
    assert {name.split(".")[0] for name in imported} - set(sys.stdlib_module_names) <= allowed, imported
    # attncheck only for what the interpreter lacks and for the wheel's files: no oracle, nothing of the gate.
    assert {name for name in imported if name.startswith("attncheck")} <= {"attncheck.interpret_compat",
                                                                           finding.fetched_by}, imported
    proc = subprocess.run([sys.executable, str(finding.reproducer)], cwd=tmp_path, env=clean, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0, (f"finding {finding.id} no longer reproduces on {findings.SINCE}: fixed upstream? "
                                  f"Drop its reproducer and the expectation the family declares for it "
                                  f"({finding.held_as}).\n{proc.stdout[-2000:]}")
    assert proc.returncode == 1 and "AssertionError" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("finding", [f for f in findings.FINDINGS if f.held_as.split(":")[0] in
                                     ("bug_class", "invalid_call", "contract")], ids=lambda f: f.id)
def test_the_gate_holds_each_finding_as_its_family_declares(finding):
    spec = specs.all_specs()[finding.family]
    kind, name = finding.held_as.split(" ")[0].split(":")
    if finding.declared_in is not None:
        table = expectations.read(ROOT / finding.declared_in)
        assert (kind, name) in {(e.kind, e.name) for e in table}, finding.declared_in
    elif kind == "contract":
        assert name in {c.name for c in spec.contracts}
    else:
        assert (kind, name) in {(e.kind, e.name) for e in spec.expectations}


def test_export_writes_each_reproducer_and_its_draft(tmp_path):
    written = findings.export(tmp_path)
    assert sorted(p.name for p in written) == sorted(
        name for f in FILED for name in (f"repro_{f.id}.py", f"issue_{f.id}.md"))
    assert all((tmp_path / p.name).read_bytes() == p.read_bytes() for p in written)
