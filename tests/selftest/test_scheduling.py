"""Test order: changed kernels first, fail-fast tests first, then longest first; and stopping
at --maxfail."""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import sys
import textwrap
import types

import pytest

from attncheck import scheduling
from tests.selftest import harness, toy_spec


def _item(nodeid: str, fail_fast: bool = False, lead: bool = False, family: str | None = None):
    markers = {scheduling.FAIL_FAST_MARKER: types.SimpleNamespace(kwargs={"lead": lead}) if fail_fast else None,
               scheduling.FAMILY_MARKER: types.SimpleNamespace(args=(family,)) if family else None}
    return types.SimpleNamespace(nodeid=nodeid, get_closest_marker=markers.get)


def test_lead_fail_fast_then_other_fail_fast_each_shortest_first_then_the_rest_longest_first():
    items = [_item("short"), _item("long"), _item("new"), _item("slow-lead", fail_fast=True, lead=True),
             _item("medium"), _item("lead", fail_fast=True, lead=True), _item("same-as-medium"),
             _item("small-later", fail_fast=True), _item("big-later", fail_fast=True)]
    durations = {"short": 0.1, "long": 60.0, "medium": 5.0, "same-as-medium": 5.0, "lead": 2.0,
                 "slow-lead": 9.0, "small-later": 1.0, "big-later": 7.0}
    order = [i.nodeid for i in scheduling.run_order(items, durations)]
    assert order == ["lead", "slow-lead", "small-later", "big-later", "new", "long", "medium", "same-as-medium",
                     "short"]


def test_an_unrecorded_fail_fast_test_counts_as_the_median_fail_fast_test():
    items = [_item(name, fail_fast=True, lead=True) for name in ("renumbered", "slow", "fast", "middle", "slowest")]
    durations = {"fast": 1.0, "middle": 4.0, "slow": 9.0, "slowest": 20.0}  # median 6.5
    order = [i.nodeid for i in scheduling.run_order(items, durations)]
    assert order == ["fast", "middle", "renumbered", "slow", "slowest"]


def test_without_durations_the_collection_order_stays_apart_from_fail_fast(tmp_path):
    items = [_item("b"), _item("a", fail_fast=True), _item("c")]
    durations = scheduling.load(tmp_path / "missing.json")
    assert durations == {}
    assert [i.nodeid for i in scheduling.run_order(items, durations)] == ["a", "b", "c"]


def test_changed_families_run_first_coverage_before_drawn_own_module_before_a_module_it_uses():
    items = [_item("other-lead", fail_fast=True, lead=True, family="other"), _item("selftest"),
             _item("other-drawn", family="other"), _item("changed-drawn", family="changed"),
             _item("changed-later", fail_fast=True, family="changed"),
             _item("user-lead", fail_fast=True, lead=True, family="user"),
             _item("changed-lead", fail_fast=True, lead=True, family="changed")]
    durations = {"other-lead": 1.0, "selftest": 0.1, "other-drawn": 30.0, "changed-drawn": 90.0,
                 "changed-later": 9.0, "changed-lead": 20.0, "user-lead": 0.5}
    changed = {"changed": scheduling.OWN_MODULE_CHANGED, "user": scheduling.USED_MODULE_CHANGED}
    order = [i.nodeid for i in scheduling.run_order(items, durations, changed)]
    assert order == ["changed-lead", "changed-later", "user-lead", "changed-drawn", "other-lead", "other-drawn",
                     "selftest"]
    assert [i.nodeid for i in scheduling.run_order(items, durations)][:3] == ["user-lead", "other-lead", "changed-lead"]


@pytest.fixture
def kernel_package(tmp_path, monkeypatch):
    """kernels_under_test/{ring,flash,ffn}.py: ring uses the flash kernel beside it."""
    package = tmp_path / "kernels_under_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "flash.py").write_text("import numpy as np\n\ndef flash(q):\n    return np.exp(q)\n")
    (package / "ring.py").write_text("from kernels_under_test.flash import flash\n\ndef ring(q):\n"
                                     "    return flash(q)\n")
    (package / "ffn.py").write_text("def ffn(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    for name in [n for n in sys.modules if n.startswith("kernels_under_test")]:
        del sys.modules[name]


def _reload_all() -> None:
    importlib.invalidate_caches()
    for name in ("kernels_under_test.flash", "kernels_under_test.ring", "kernels_under_test.ffn"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])


def test_a_family_changes_with_its_kernel_or_a_kernel_it_uses_or_a_new_implementation(kernel_package, tmp_path):
    refs = {"flash": ["kernels_under_test.flash:flash"], "ring": ["kernels_under_test.ring:ring"],
            "ffn": ["kernels_under_test.ffn:ffn"]}
    recorded_path = tmp_path / "kernel_sources.json"
    assert scheduling.write_sources(recorded_path, [ref for refs_of in refs.values() for ref in refs_of]) == 3
    recorded = scheduling.load_sources(recorded_path)
    assert set(recorded.modules) == {"kernels_under_test.flash", "kernels_under_test.ring", "kernels_under_test.ffn"}
    assert scheduling.changed_families(refs, recorded) == {}
    without_ring = scheduling.Sources(recorded.implementations - {"kernels_under_test.ring:ring"}, recorded.modules)
    # New (never recorded), though its module and the module it uses are unchanged.
    assert scheduling.changed_families(refs, without_ring) == {"ring": scheduling.OWN_MODULE_CHANGED}
    (kernel_package / "flash.py").write_text(textwrap.dedent("""\
        import numpy as np

        def flash(q):
            return np.exp(q - 1)
        """))
    _reload_all()
    assert scheduling.changed_families(refs, recorded) == {"flash": scheduling.OWN_MODULE_CHANGED,
                                                           "ring": scheduling.USED_MODULE_CHANGED}
    assert scheduling.changed_families(refs, scheduling.Sources(frozenset(), {})) == {}


def test_a_malformed_sources_file_is_named(tmp_path):
    bad = tmp_path / "kernel_sources.json"
    bad.write_text('{"kernels.flash:flash": "0123"}')  # the layout before modules were recorded one by one
    with pytest.raises(ValueError, match=r"kernel_sources.json: expected a JSON object with \"implementations\""):
        scheduling.load_sources(bad)


def test_merge_keeps_tests_the_run_did_not_include(tmp_path):
    committed, measured = tmp_path / "durations.json", tmp_path / "run" / "durations.json"
    scheduling.write(committed, {"kept": 3.0, "updated": 1.0})
    scheduling.write(measured, {"updated": 7.123, "added": 0.5})
    assert scheduling.merge_into(committed, measured) == 3
    assert json.loads(committed.read_text()) == {"added": 0.5, "kept": 3.0, "updated": 7.12}


def test_the_packaged_gate_is_keyed_by_its_path_in_the_package_wherever_installed(tmp_path, monkeypatch):
    gate = "attncheck/gate/test_gate.py::test_kernel_matches_oracle[ffn-builtin-interpret]"
    installed = types.SimpleNamespace(nodeid="test_gate.py::test_kernel_matches_oracle[ffn-builtin-interpret]",
                                      path=pathlib.Path("/venv/lib/python3.12/site-packages/attncheck/gate/test_gate.py"),
                                      get_closest_marker=lambda name: None)
    packaged, own = tmp_path / "packaged.json", tmp_path / "durations.json"
    packaged.write_text(json.dumps({gate: 0.5, "attncheck/gate/test_gate.py::renamed": 1.0}))
    own.write_text(json.dumps({"attncheck/gate/test_gate.py::renamed": 3.0, "tests/test_mine.py::t": 2.0}))
    monkeypatch.setattr(scheduling, "PACKAGED_FILE", packaged)
    durations = scheduling.load_with_packaged(own)
    assert durations == {gate: 0.5, "attncheck/gate/test_gate.py::renamed": 3.0, "tests/test_mine.py::t": 2.0}
    order = scheduling.run_order([_item("tests/test_mine.py::t"), installed], durations)
    assert [i.nodeid for i in order] == ["tests/test_mine.py::t", installed.nodeid]  # an unrecorded test would lead
    assert scheduling.test_key(installed.nodeid, "../venv/lib/site-packages/attncheck/gate/test_gate.py") == gate


def test_update_writes_the_packaged_gate_to_the_file_the_package_ships(tmp_path):
    target, packaged, measured = tmp_path / "durations.json", tmp_path / "gate.json", tmp_path / "run.json"
    target.write_text(json.dumps({"tests/a.py::old": 1.0, "attncheck/gate/test_gate.py::moved": 5.0}))
    measured.write_text(json.dumps({"x/attncheck/gate/test_gate.py::new": 2.0, "tests/a.py::b": 3.0}))
    assert scheduling.merge_into(target, measured, packaged) == 4
    assert json.loads(target.read_text()) == {"tests/a.py::old": 1.0, "tests/a.py::b": 3.0}
    assert json.loads(packaged.read_text()) == {"attncheck/gate/test_gate.py::moved": 5.0,
                                                "attncheck/gate/test_gate.py::new": 2.0}


def test_a_malformed_durations_file_is_named(tmp_path):
    bad = tmp_path / "durations.json"
    bad.write_text('{"a": "slow"}')
    with pytest.raises(ValueError, match=r"durations.json: expected a JSON object of test id -> seconds"):
        scheduling.load(bad)


def _config(tmp_path, maxfail: int, run_id: str = "run-1"):
    from attncheck import pytest_plugin

    run = types.SimpleNamespace(stop_file=tmp_path / "rep" / f".stop-{run_id}")
    return types.SimpleNamespace(getoption={"maxfail": maxfail}.__getitem__, stash={pytest_plugin.RUN: run})


def test_the_workers_are_told_to_stop_once_pytest_says_the_session_should_fail(tmp_path):
    from attncheck.session.directory import MaxfailStop

    session = types.SimpleNamespace(shouldfail=False)
    stop_file = tmp_path / "rep" / ".stop-run-1"
    stop = MaxfailStop(session, stop_file)
    stop.pytest_runtest_logreport(types.SimpleNamespace(failed=False))
    assert not stop_file.exists()
    session.shouldfail = "stopping after 1 failures"  # what pytest's own hook sets first
    stop.pytest_runtest_logreport(types.SimpleNamespace(failed=True))
    assert stop_file.exists()


def test_a_gate_test_skips_its_remaining_cases_once_the_run_stopped(tmp_path):
    from attncheck import pytest_plugin

    config = _config(tmp_path, 1)
    check = pytest_plugin.attncheck_stop_point.__wrapped__(types.SimpleNamespace(config=config))
    check()  # not stopped: returns
    stop_file = config.stash[pytest_plugin.RUN].stop_file
    stop_file.parent.mkdir(parents=True)
    stop_file.touch()
    with pytest.raises(pytest.skip.Exception, match=r"the run stopped at --maxfail=1"):
        check()
    # Another run (another run id) in the same report directory is not stopped by it.
    pytest_plugin.attncheck_stop_point.__wrapped__(types.SimpleNamespace(config=_config(tmp_path, 1, "run-2")))()


@pytest.mark.parametrize("examples", [0, 1, 4, 5, 15, 17])
def test_coverage_shares_split_the_examples_into_small_contiguous_tests_without_loss(examples):
    from attncheck import coverage

    cases = list(range(examples))
    shares = [share.of(cases) for share in coverage.shares(examples)]
    assert [c for share in shares for c in share] == cases  # each example once, in order
    assert all(len(share) <= coverage.EXAMPLES_PER_TEST for share in shares)
    assert len(shares) == max(1, -(-examples // coverage.EXAMPLES_PER_TEST))


def test_a_gate_run_collects_the_changed_family_first(gate_dir, pytester):
    """Two toy families of one implementation; the forward one verifies a user's
    implementation, which kernel_sources.json has no record of: it is new code, and all its
    tests come first. With every implementation recorded as it is, nothing moves."""
    user = "tests.selftest.chaos:accepts_invalid_inputs"
    args = ("--collect-only", "-q", "--attncheck-spec=tests.selftest.toy_forward_spec",
            f"--attncheck-impl=toy_forward={user}", "--attncheck-durations=durations.json")
    scheduling.write(gate_dir / "durations.json", {})

    def families(recorded: list[str]) -> list[str]:
        scheduling.write_sources(gate_dir / scheduling.SOURCES_FILE, recorded)
        result = harness.run_gate(pytester, "rep", *args)
        ids = [line for line in result.outlines if "test_kernel_matches_oracle[" in line]
        assert ids, result.stdout.str()
        return [re.search(r"\[(toy_\w+?)-", line)[1] for line in ids]

    defaults = list(toy_spec.SPEC.default_impls.values())
    first = families(defaults)
    assert first == sorted(first, key=lambda family: family != "toy_forward") and first[0] == "toy_forward", first
    order = families([*defaults, user])
    assert order != sorted(order, key=lambda family: family != "toy_forward"), order
