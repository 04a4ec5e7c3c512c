"""The records of a gate run survive xdist, reruns, interruptions and hangs (pytester, subprocess).

Each run is the project's own tests/gate module on the toy family (tests/selftest/toy_spec.py);
every toy case makes 4 comparisons (out, dq, dk, dv) and so 4 records.
"""

from __future__ import annotations

import collections
import pathlib
import re

import jsonschema
import pytest

from attncheck import scheduling
from attncheck.report import records as rec
from tests.selftest import harness, toy_spec
from tests.selftest.harness import REPO_ROOT

DIRECTIONS = set(toy_spec.SPEC.directions)
# The gate verifies each implementation in two tests: the coverage examples, then the drawn cases.
USER_TESTS = {part: f"test_gate.py::test_kernel_matches_oracle[toy_attention-user-xla-{part}]"
              for part in ("coverage", "drawn")}
USER_TEST = USER_TESTS["drawn"]
# Runs that plant an interruption or a hang in one test leave the coverage test out, so
# that exactly one test meets it.
DRAWN_ONLY = ("-k", "not coverage")
# The gate module also checks that each implementation under test rejects each invalid call
# of the family: INVALID_TESTS per implementation.
INVALID_TESTS = len(toy_spec.SPEC.invalid_calls(toy_spec.toy_attention))
DEFAULT_TESTS = len(toy_spec.SPEC.default_impls) * (2 + INVALID_TESTS)  # coverage, drawn, invalid calls


@pytest.fixture(scope="module")
def validator():
    return jsonschema.Draft202012Validator(harness.load_schema())


def check_report(report_dir: pathlib.Path, validator) -> dict:
    """report.json is valid, holds no duplicate record and only records of its own run."""
    report = harness.load_report(report_dir)
    validator.validate(report)
    records = report["records"]
    typed = [rec.Record.from_json(r) for r in records]
    assert not rec.duplicates(typed), rec.duplicates(typed)
    assert {r["run_id"] for r in records} <= {report["run_id"]}
    # Earlier runs' files may remain (only stale ones are removed: a live run must never
    # lose records to another), but this run's files must all be there.
    files = sorted(p.name for p in (report_dir / rec.RECORDS_DIR).glob("*-*.*"))
    assert any(name.startswith(report["run_id"] + "-") for name in files) or not records, files
    assert report["totals"]["records"] == len(records)
    assert report["totals"]["failures"] == sum(r["outcome"] != "pass" for r in records)
    return report


def comparisons(report: dict) -> set[tuple]:
    return {(r["impl"], r["case_id"], r["direction"], r["outcome"]) for r in report["records"]}


def executed(path: pathlib.Path) -> set[tuple[str, str]]:
    """(impl_ref, case_id) of every case the toy spec really ran (its call log; the
    parameter probe's calls, which stop before the kernel, do not count)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return {(impl, case_id) for _, impl, case_id in map(str.split, lines) if not impl.endswith("<probe>")}


def test_xdist_runs_merge_the_same_records_without_loss_or_mixing(gate_dir, validator):
    # Three runs at once, each into its own report directory: -n 0, -n 2 and -n auto.
    runs = {"0": "rep-n0", "2": "rep-n2", "auto": "rep-nauto"}
    procs = {n: harness.start_gate(gate_dir, report, "-n", n,
                                   env={toy_spec.CALL_LOG_ENV: str(gate_dir / f"calls-{n}.log")})
             for n, report in runs.items()}
    outputs = {n: p.communicate(timeout=harness.RUN_TIMEOUT_S)[0] for n, p in procs.items()}
    reports = {}
    for n, report_name in runs.items():
        assert procs[n].returncode == 0, outputs[n]
        assert f"{DEFAULT_TESTS} passed" in outputs[n], outputs[n]
        report = reports[n] = check_report(gate_dir / report_name, validator)
        assert report["complete"] is True and report["problems"] == [], report["problems"]
        records = report["records"]
        # Every comparison executed has exactly one record: 4 per case the spec ran.
        ran = executed(gate_dir / f"calls-{n}.log")
        assert len(ran) >= len(toy_spec.SPEC.default_impls) * toy_spec.SPEC.examples["xla"]
        assert len(records) == 4 * len(ran)
        per_case = collections.Counter((r["impl_ref"], r["case_id"]) for r in records)
        assert set(per_case) == ran
        assert set(per_case.values()) == {4}
        assert {r["direction"] for r in records} == DIRECTIONS
        assert {r["impl"] for r in records} == set(toy_spec.SPEC.default_impls)
        assert {r["outcome"] for r in records} == {"pass"}
        assert all(r["nodeid"].startswith("test_gate.py::test_kernel_matches_oracle[") for r in records)
        # The controller saw every test's duration, whichever worker ran it (the packaged
        # gate's tests keyed by their path in the package).
        durations = scheduling.load(gate_dir / report_name / scheduling.REPORT_FILE)
        gate_file = REPO_ROOT / "attncheck" / "gate" / "test_gate.py"
        assert all(durations[scheduling.test_key(r["nodeid"], gate_file)] > 0 for r in records)
        assert len(durations) == DEFAULT_TESTS
        # Each invalid-input test timed its kernel call itself, whichever worker ran it.
        kernel_times = rec.kernel_times_outside_records(gate_dir / report_name, report["run_id"])
        assert len(kernel_times) == len(toy_spec.SPEC.default_impls) * INVALID_TESTS
        assert all(t >= 0 for t in kernel_times)
    assert comparisons(reports["0"]) == comparisons(reports["2"]) == comparisons(reports["auto"])
    # The runs did not mix: three run ids, each report holding only its own.
    assert len({r["run_id"] for r in reports.values()}) == 3
    assert {r["worker"] for r in reports["0"]["records"]} == {"main"}
    for n in ("2", "auto"):
        workers = {r["worker"] for r in reports[n]["records"]}
        assert workers and all(w.startswith("gw") for w in workers), workers
        files = list((gate_dir / runs[n] / rec.RECORDS_DIR).glob("*.jsonl"))
        assert len(files) == len(workers)
    # Gate tests ran on both workers: both worker files contributed to the -n 2 merge.
    assert {r["worker"] for r in reports["2"]["records"]} == {"gw0", "gw1"}


# In every process of a run: which ran the exit handlers registered at its start (as jax's
# are), and how many objects it had frozen before the session finished and after.
EXIT_PROBE = """
import atexit, gc, os, pathlib
import pytest

NAME = os.environ.get("PYTEST_XDIST_WORKER", "main")
atexit.register(lambda: pathlib.Path(f"exit-handlers-ran-{NAME}").touch())
FROZEN = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    FROZEN.append(gc.get_freeze_count())


def pytest_unconfigure(config):
    pathlib.Path(f"frozen-{NAME}").write_text(" ".join(map(str, [*FROZEN, gc.get_freeze_count()])))
"""


def test_a_worker_ends_without_tearing_down_jax_once_its_records_are_written(gate_dir, validator):
    """The controller waits for its workers to end before it writes the report; a gate
    worker's teardown (pytest's collections, jax's exit handlers) takes seconds."""
    (gate_dir / "exit_probe.py").write_text(EXIT_PROBE)
    proc = harness.start_gate(gate_dir, "rep", "-n", "2", "-p", "exit_probe")
    output = proc.communicate(timeout=harness.RUN_TIMEOUT_S)[0]
    assert proc.returncode == 0 and f"{DEFAULT_TESTS} passed" in output, output
    report = check_report(gate_dir / "rep", validator)
    assert report["complete"] is True and {r["worker"] for r in report["records"]} == {"gw0", "gw1"}
    assert sorted(p.name for p in gate_dir.glob("exit-handlers-ran-*")) == ["exit-handlers-ran-main"]
    for worker in ("gw0", "gw1"):
        before, after = map(int, (gate_dir / f"frozen-{worker}").read_text().split())
        assert after > before, (worker, before, after)


def test_wrong_scale_fails_the_gate_and_last_failed_rerun_reflects_the_fix(gate_dir, pytester, validator):
    result = harness.run_gate(pytester, "rep", harness.impl_option("toy_attention_wrong_scale"))
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.assert_outcomes(failed=2, passed=INVALID_TESTS)  # the coverage and the drawn test
    failed = check_report(gate_dir / "rep", validator)
    failing = [r for r in failed["records"] if r["outcome"] == "fail"]
    assert failing and {r["outcome"] for r in failed["records"]} == {"fail"}  # the scale matters in every case
    assert set(collections.Counter(r["case_id"] for r in failing).values()) == {4}  # every direction fails
    case_id = failing[0]["case_id"]
    repro = f"attncheck repro {case_id} --impl user --backend xla --spec {harness.SPEC_MODULE}"
    assert f"{repro} --report rep" in {r["repro"] for r in failing}
    markdown = (gate_dir / "rep" / "report.md").read_text()
    assert markdown.startswith("# attncheck: FAIL")
    assert "## Failures" in markdown and f"<code>{case_id}</code>" in markdown
    assert f"<code>{repro} --report rep</code>" in markdown
    result.stdout.fnmatch_lines([f"*reproduce: {repro}*"])

    # --lf with the fixed implementation: only the failed tests run (same node ids: the
    # override is "user" either way), and the report is the rerun's, now passing.
    rerun = harness.run_gate(pytester, "rep", harness.impl_option("toy_attention"), "--lf")
    assert rerun.ret == pytest.ExitCode.OK, rerun.stdout.str()
    rerun.assert_outcomes(passed=2)
    rerun.stdout.re_match_lines([r"collected (2 items|\d+ items / \d+ deselected / 2 selected)",
                                 "run-last-failure: rerun previous 2 failures.*"])
    fixed = check_report(gate_dir / "rep", validator)
    assert fixed["run_id"] != failed["run_id"]
    assert fixed["complete"] is True and fixed["problems"] == []
    assert {r["nodeid"] for r in fixed["records"]} == set(USER_TESTS.values())
    assert {r["outcome"] for r in fixed["records"]} == {"pass"}
    assert {r["impl_ref"] for r in fixed["records"]} == {f"{harness.SPEC_MODULE}:toy_attention"}
    assert case_id in {r["case_id"] for r in fixed["records"]}  # the same draws, now passing
    assert len(fixed["records"]) >= 4 * toy_spec.SPEC.examples["xla"]
    assert (gate_dir / "rep" / "report.md").read_text().startswith("# attncheck: PASS")


@pytest.mark.parametrize("workers", ["0", "2"])
def test_interrupted_run_still_merges_and_is_marked_incomplete(gate_dir, pytester, validator, workers):
    result = harness.run_gate(pytester, "rep", harness.impl_option("toy_attention_interrupt"), "-n", workers,
                              *DRAWN_ONLY)
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.stdout.str()
    # pytest: "KeyboardInterrupt"; xdist: "node down: keyboard-interrupt"
    result.stdout.re_match_lines([r"(?i).*keyboard.?interrupt"])
    report = check_report(gate_dir / "rep", validator)
    assert report["complete"] is False
    assert any(p.startswith("run interrupted") for p in report["problems"]), report["problems"]
    # The cases before the interrupting call were recorded, completely; the interrupted one
    # is named by an error record.
    records = [r for r in report["records"] if r["outcome"] == "pass"]
    assert len(records) == 4 * (toy_spec.INTERRUPT_AT - 1)
    assert set(collections.Counter(r["case_id"] for r in records).values()) == {4}
    [lost] = [r for r in report["records"] if r["outcome"] != "pass"]
    assert lost["case_id"] not in {r["case_id"] for r in records}
    assert (lost["outcome"], lost["direction"]) == ("error", "all") and "never finished" in lost["reason"]
    markdown = (gate_dir / "rep" / "report.md").read_text()
    assert markdown.startswith("# attncheck: FAIL") and "(**incomplete**)" in markdown


def test_hanging_kernel_times_out_and_the_run_continues(gate_dir, pytester, validator):
    result = harness.run_gate(pytester, "rep", harness.impl_option("toy_attention_hang"), "--timeout=5",
                              *DRAWN_ONLY)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    # The hanging test fails with the timeout; the other tests still ran and passed.
    result.assert_outcomes(failed=1, passed=INVALID_TESTS)
    # The failure's own line names the timeout and the case; the summary names the test (its
    # " - message" tail depends on the terminal's width and on $CI).
    result.stdout.re_match_lines([r"Timeout \(>5\.0s\) from pytest-timeout in case toy_attention-",
                                  rf"FAILED {re.escape(USER_TEST)}"])
    report = check_report(gate_dir / "rep", validator)
    assert report["complete"] is True and report["verdict"] == "FAIL"
    # The hung case never produced a comparison: its started marker names it.
    [hung] = report["records"]
    assert (hung["nodeid"], hung["direction"], hung["outcome"]) == (USER_TEST, "all", "error")
    assert hung["reason"].startswith("case started but never finished: Failed: Timeout (>5.0s)"), hung["reason"]
    assert hung["repro"].startswith(f"attncheck repro {hung['case_id']} --impl user --backend xla")
    markdown = (gate_dir / "rep" / "report.md").read_text()
    assert markdown.startswith("# attncheck: FAIL") and "Timeout (&gt;5.0s)" in markdown


@pytest.mark.parametrize("stop_early", [False, True])
def test_coverage_test_reports_every_failing_case_unless_the_run_stops_at_the_first(gate_dir, pytester, validator,
                                                                                    stop_early):
    result = harness.run_gate(pytester, "rep", harness.impl_option("toy_attention_wrong_scale"), "-k", "coverage",
                              *(["-x"] if stop_early else []))
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    records = check_report(gate_dir / "rep", validator)["records"]
    assert {r["outcome"] for r in records} == {"fail"}
    failing_cases = {r["case_id"] for r in records}
    # The toy's two coverage classes (causal, bf16) are two examples, both failing.
    assert len(failing_cases) == (1 if stop_early else 2), failing_cases
