"""The ``attncheck`` command line on toy gate runs: repro, report, budgets accept, and the
gate's --attncheck-accepted-budgets; every bad input is one clear line. The CLI runs as
``python -m attncheck`` with cwd = the run's dir."""

from __future__ import annotations

import json
import math
import re
import shlex

import pytest

from attncheck.report.records import Record
from tests.selftest import harness, toy_spec

WORST = re.compile(r"worst at batch=(\d+), head=(\d+), (query|key)=(\d+), dim=(\d+): "
                   r"kernel (\S+) vs oracle (\S+) \(")


def _keys(report: dict) -> list[tuple]:
    return sorted((Record.from_json(r).key, r["outcome"]) for r in report["records"])


def test_repro_reproduces_a_failure_and_report_remerges(gate_dir, pytester):
    result = harness.run_gate(pytester, "rep", harness.impl_option("toy_attention_wrong_scale"))
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    report = harness.load_report(gate_dir / "rep")
    failing = [r for r in report["records"] if r["outcome"] == "fail"]
    case_id = failing[0]["case_id"]
    recorded = {r["direction"]: r for r in failing if r["case_id"] == case_id}
    assert set(recorded) == set(toy_spec.SPEC.directions)

    # The reproducer exactly as the report prints it.
    argv = shlex.split(failing[0]["repro"])
    assert argv[:3] == ["attncheck", "repro", case_id] and argv[-2:] == ["--report", "rep"]
    proc = harness.cli(gate_dir, *argv[1:])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"case {case_id}: toy_attention / user ({harness.SPEC_MODULE}:toy_attention_wrong_scale) on xla" in out
    lines = out.splitlines()
    for direction, r in recorded.items():
        at = next(i for i, line in enumerate(lines) if re.match(rf"\s+{direction}: FAIL\s+max abs error", line))
        match = WORST.search(lines[at + 1])
        assert match, lines[at + 1]
        b, h, axis, i, d, kernel, oracle = match.groups()
        assert axis == ("query" if direction in ("out", "dq") else "key")
        # The same worst element and values as the gate recorded: the failure reproduced.
        assert [int(b), int(h), int(i), int(d)] == r["metrics"]["worst_index"]
        assert math.isclose(float(kernel), r["metrics"]["worst_kernel"], rel_tol=1e-6)
        assert math.isclose(float(oracle), r["metrics"]["worst_oracle"], rel_tol=1e-6)
        assert not math.isclose(float(kernel), float(oracle), rel_tol=1e-3)
        # Then the direction's error map as a text grid (a terminal has no SVG), on the
        # direction's own axes: the scale is wrong everywhere, so every cell fails, except
        # under causal masking the first query's: it sees one key, whatever the scale.
        assert lines[at + 2].strip().startswith(f"{direction}: |kernel - oracle| / allowed over [{axis} x dim], "
                                                "max over batch, head")
        end = next(i for i in range(at, len(lines)) if lines[i].strip().startswith("legend:"))
        grid = [line.split("|")[1] for line in lines[at + 3: end] if re.match(r"\s+\d+ \|", line)]
        causal_first = r["case"]["params"]["causal"] and direction in ("out", "dq")
        assert len(grid) == r["case"]["params"]["seq_len"], grid
        assert all(set(row) <= set("*#%@") for row in grid[causal_first:]), grid
        assert not causal_first or grid[0] == " " * 4, grid  # exactly the oracle's

    # --maps none: the same verdicts, no grid.
    proc = harness.cli(gate_dir, *argv[1:], "--maps", "none")
    assert proc.returncode == 1 and "allowed over [" not in proc.stdout, proc.stdout

    # Without the spec module the family is unknown: a clear message, not a KeyError.
    proc = harness.cli(gate_dir, "repro", case_id, "--report", "rep")
    assert proc.returncode != 0 and "unknown kernel family 'toy_attention'" in proc.stderr, proc.stderr
    assert "--spec" in proc.stderr

    # `attncheck report` re-merges the records into fresh reports (incomplete unless told).
    for name in ("report.json", "report.md", "report.html"):
        (gate_dir / "rep" / name).unlink()
    proc = harness.cli(gate_dir, "report", "--report", "rep")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("# attncheck: FAIL") and f"<code>{case_id}</code>" in proc.stdout
    merged = harness.load_report(gate_dir / "rep")
    assert _keys(merged) == _keys(report) and merged["run_id"] == report["run_id"]
    assert merged["complete"] is False and (gate_dir / "rep" / "report.html").exists()
    proc = harness.cli(gate_dir, "report", "--report", "rep", "--complete")
    assert proc.returncode == 1
    assert harness.load_report(gate_dir / "rep")["complete"] is True


def test_budgets_accept_then_a_grown_budget_is_a_numerics_regression(gate_dir, pytester):
    result = harness.run_gate(pytester, "rep")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    report = harness.load_report(gate_dir / "rep")

    proc = harness.cli(gate_dir, "budgets", "accept", "--report", "rep", "--output", "baseline.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    baseline = json.loads((gate_dir / "baseline.json").read_text())
    # One accepted budget per implementation x dtype x direction.
    assert len(report["summary"]) == len(toy_spec.SPEC.default_impls) * 2 * len(toy_spec.SPEC.directions)
    assert f"wrote {len(report['summary'])} accepted budgets" in proc.stdout
    fields = ("kernel", "impl", "backend", "dtype", "direction", "worst_budget")
    assert baseline["budgets"] == [{k: row[k] for k in fields} for row in report["summary"]]
    assert all(0 < b["worst_budget"] < 1 for b in baseline["budgets"])

    # Pretend the accepted budgets were 10x smaller: the same draws now grew past them.
    shrunk = {**baseline, "budgets": [{**b, "worst_budget": b["worst_budget"] / 10} for b in baseline["budgets"]]}
    (gate_dir / "shrunk.json").write_text(json.dumps(shrunk))
    # The toy's budgets sit below the default noise floor: judge growth from 0 here.
    result = harness.run_gate(pytester, "rep2", "--attncheck-accepted-budgets=shrunk.json",
                              "--attncheck-regression-floor=0")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(["GATE FAILURE: numerics regression: toy_attention/builtin/xla/*"])
    regressed = harness.load_report(gate_dir / "rep2")
    assert regressed["totals"]["failures"] == 0  # every comparison passed: only the accepted budgets fail it
    assert len(regressed["regressions"]) == len(baseline["budgets"])
    assert set(regressed["regressions"]) <= set(regressed["problems"])
    markdown = (gate_dir / "rep2" / "report.md").read_text()
    assert markdown.startswith("# attncheck: FAIL") and "numerics regression: toy_attention/lse/xla/" in markdown

    # Against the accepted budgets themselves the same records are no regression.
    proc = harness.cli(gate_dir, "report", "--report", "rep2", "--complete", "--accepted-budgets", "baseline.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert harness.load_report(gate_dir / "rep2")["regressions"] == []


def test_the_old_option_and_command_names_still_work_with_a_deprecation_message(gate_dir, pytester):
    result = harness.run_gate(pytester, "rep")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    proc = harness.cli(gate_dir, "baseline", "update", "--report", "rep", "--output", "accepted.json")
    assert proc.returncode == 0 and "deprecated, use `budgets accept`" in proc.stderr, proc.stderr
    result = harness.run_gate(pytester, "rep2", "--attncheck-baseline=accepted.json")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.stdout.fnmatch_lines(["*--attncheck-baseline is deprecated*"])


@pytest.mark.parametrize("args, message", [
    (("repro", "toy_attention-000000000000", "--report", "missing"), "missing/report.json does not exist"),
    (("repro", "toy_attention-000000000000", "--report", "truncated"), "is not a readable report"),
    (("repro", "toy_attention-000000000000", "--report", "older"), "older/report.json has schema_version 4; "
                                                                    "this attncheck reads"),
    (("report", "--report", "missing"), "no run recorded under missing/records"),
    (("budgets", "accept", "--report", "missing"), "missing/report.json does not exist"),
    (("durations", "update", "--report", "missing"), "missing/durations.json does not exist"),
    (("mutate", "--mutant", "no-such-mutant"), "unknown mutant id"),
])
def test_every_bad_input_of_the_cli_is_one_clear_line(gate_dir, args, message):
    (gate_dir / "truncated").mkdir()
    (gate_dir / "truncated" / "report.json").write_text('{"records": [')
    (gate_dir / "older").mkdir()  # a report an earlier attncheck wrote: its records have other fields
    (gate_dir / "older" / "report.json").write_text('{"schema_version": 4, "records": []}')
    proc = harness.cli(gate_dir, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_repro_of_an_unimportable_implementation_or_a_non_utf8_record_is_one_clear_line(gate_dir, pytester):
    result = harness.run_gate(pytester, "rep")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    report = harness.load_report(gate_dir / "rep")
    case_id = report["records"][0]["case_id"]
    for r in report["records"]:
        r["impl_ref"] = "no_such_module:fn"
    (gate_dir / "rep" / "report.json").write_text(json.dumps(report))
    proc = harness.cli(gate_dir, "repro", case_id, "--report", "rep", "--spec", harness.SPEC_MODULE)
    assert proc.returncode == 2 and "cannot import 'no_such_module'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    # A records file with a byte that is not UTF-8: the merge names it, it does not crash.
    records = sorted((gate_dir / "rep" / "records").glob("*.jsonl"))[0]
    records.write_bytes(records.read_bytes() + b"\xff\n")
    proc = harness.cli(gate_dir, "report", "--report", "rep")
    assert proc.returncode == 1 and "not UTF-8" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
