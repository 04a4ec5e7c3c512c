"""Installing attncheck changes no pytest session that does not ask for it.

The plugin is loaded into every pytest session of the environment (``pytest11``); a
session that neither passes ``--attncheck``/an ``--attncheck-*`` option nor collects the
gate package must look exactly as it does with the plugin disabled: process environment,
hypothesis profile, junit path, test order, and no report files left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attncheck.session import guards

PROBE = '''
import atexit, gc, json, os, pathlib
import pytest
from hypothesis import settings

SEEN = {}
GC_BEFORE = gc.get_threshold()  # this conftest is loaded before any plugin configures
if not os.environ.get("PYTEST_XDIST_WORKER"):
    # After every hook of the session: what the process is left with.
    atexit.register(lambda: pathlib.Path(os.environ["PROBE_OUT"] + ".exit").write_text(
        json.dumps({"before": GC_BEFORE, "after": gc.get_threshold()})))


def pytest_collection_modifyitems(config, items):
    SEEN["order"] = [item.nodeid for item in items]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):
        return  # the controller speaks for the session (xdist workers collect the items)
    SEEN.setdefault("order", [])
    SEEN.update(
        env={k: os.environ.get(k) for k in ("JAX_PLATFORMS", "XLA_FLAGS")},
        profile=settings.get_current_profile_name(),
        xmlpath=getattr(session.config.option, "xmlpath", None),
        maxschedchunk=getattr(session.config.option, "maxschedchunk", None),
        timeout=getattr(session.config.option, "timeout", None),
        gc_threshold=gc.get_threshold(),
        plugin_registered=session.config.pluginmanager.has_plugin("attncheck-run"))
    pathlib.Path(os.environ["PROBE_OUT"]).write_text(json.dumps(SEEN))
'''
TESTS = '''
def test_b():
    pass


def test_a():
    pass


def test_c():
    pass
'''


def _run(directory, out_name: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "PYTEST_ADDOPTS", "CI") and not k.startswith("PYTEST_XDIST")}
    env["PROBE_OUT"] = str(directory / out_name)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=directory,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((directory / out_name).read_text())


@pytest.mark.parametrize("workers", [(), ("-n", "2")])
def test_a_session_that_does_not_ask_for_attncheck_sees_no_attncheck_effect(tmp_path, workers):
    (tmp_path / "conftest.py").write_text(PROBE)
    (tmp_path / "test_unrelated.py").write_text(TESTS)
    with_plugin = _run(tmp_path, "with.json", *workers)
    without = _run(tmp_path, "without.json", "-p", "no:attncheck", *workers)
    assert with_plugin == without
    assert with_plugin["env"] == {"JAX_PLATFORMS": None, "XLA_FLAGS": None}
    if not workers:
        assert with_plugin["order"] == ["test_unrelated.py::test_b", "test_unrelated.py::test_a",
                                        "test_unrelated.py::test_c"]
    assert not with_plugin["plugin_registered"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conftest.py", "test_unrelated.py", "with.json",
                                                          "with.json.exit", "without.json",
                                                          "without.json.exit"]  # no reports/, no cache


def test_asking_for_attncheck_is_what_activates_it(tmp_path):
    """The same probe with --attncheck: the run's environment and files appear, so the
    probe above would have seen them."""
    (tmp_path / "conftest.py").write_text(PROBE)
    (tmp_path / "test_unrelated.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "PYTEST_ADDOPTS", "CI")
           and not k.startswith("PYTEST_XDIST")}
    env["PROBE_OUT"] = str(tmp_path / "active.json")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--attncheck",
                           "--attncheck-report", "rep"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    seen = json.loads((tmp_path / "active.json").read_text())
    assert seen["plugin_registered"] and seen["env"]["JAX_PLATFORMS"] == "cpu"
    assert "--xla_force_host_platform_device_count=8" in seen["env"]["XLA_FLAGS"]
    assert seen["profile"] == "dev" and seen["xmlpath"].endswith("rep/junit.xml")
    # The run collects garbage less often while it runs, and gives the process its own back.
    assert seen["gc_threshold"] == list(guards.GC_THRESHOLDS)
    thresholds = json.loads((tmp_path / "active.json.exit").read_text())
    assert thresholds["after"] == thresholds["before"] != list(guards.GC_THRESHOLDS), thresholds
    # No gate test was collected: the run verified nothing, and says so.
    assert proc.returncode != 0 and "attncheck: NO CASES" in proc.stdout, proc.stdout
    assert (tmp_path / "rep" / "report.md").read_text().startswith("# attncheck: NO CASES")
    # Nor did it search any family's coverage examples (minutes with a cold cache).
    assert not (tmp_path / ".attncheck_cache" / "coverage").exists()
