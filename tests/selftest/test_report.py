"""Reports: the JSON schema against real records, and the merge/render functions on
hand-built records (summary, coverage, regressions, baseline, Markdown, HTML, step summary)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re

import jax.numpy as jnp
import jsonschema
import pytest

from attncheck import backends, gate, numerics, specs
from attncheck.report import records as rec
from attncheck.report import render
from attncheck.specs.base import Case, make_case
from tests.selftest import toy_spec

pytest_plugins = ("pytester",)

SCHEMA = toy_spec.load_schema()
REPORT_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
RECORD_VALIDATOR = jsonschema.Draft202012Validator(
    {"$schema": SCHEMA["$schema"], "$defs": SCHEMA["$defs"], "$ref": "#/$defs/record"})
RUN_ID = "20260101T0000001234"
XSS = "<script>alert(1)</script>"
SVG_NS = "http://www.w3.org/2000/svg"


def _strict_json(text: str):
    """json.loads that refuses Infinity/NaN, as JSON.parse does."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def only_toy_spec(monkeypatch):
    """Make the toy family the only registered one (write_reports asks for coverage classes)."""
    monkeypatch.setattr(specs, "SPEC_MODULES", [toy_spec.SPEC_MODULE])
    specs.all_specs.cache_clear()
    yield
    specs.all_specs.cache_clear()


def nan_attention(q, k, v, *, causal: bool, sm_scale: float):
    return toy_spec.toy_attention(q, k, v, causal=causal, sm_scale=sm_scale) * jnp.nan


# ---------------------------------------------------------------------- hand-built records
def metrics(budget: float = 0.5, max_abs: float = 1e-6) -> dict:
    allowed = max_abs / budget if budget else 1e-6
    return numerics.Comparison(
        passed=budget <= 1, reason="ok" if budget <= 1 else "max abs error too large", max_abs=max_abs,
        max_rel=1e-5, mean_abs=max_abs / 4, ulp_p50=1.0, ulp_p99=3.0, ulp_max=4.0, cosine=1.0,
        baseline_err=allowed / 3, baseline_ulps=2.0, r=2.0, a=allowed / 3, allowed=allowed, budget=budget,
        worst_index=(0, 1, 2, 3), worst_kernel=0.25, worst_oracle=0.2500001, compared=256).to_json()


def record(case: str = "c0", *, kernel: str = "toy_attention", impl: str = "builtin", backend: str = "xla",
           dtype: str = "float32", direction: str = "out", outcome: str = "pass", budget: float | None = 0.5,
           classes=(), reason: str | None = None, seq_len: int = 8, devices: int = 1, max_abs: float = 1e-6,
           nodeid: str = "tests/gate/test_gate.py::test_kernel_matches_oracle[x]") -> dict:
    case_id = f"{kernel}-{hashlib.sha256(case.encode()).hexdigest()[:12]}"
    out = {"schema_version": rec.SCHEMA_VERSION, "run_id": RUN_ID, "worker": "main", "nodeid": nodeid,
           "case_id": case_id, "case": {"family": kernel, "params": {"name": case}, "seed": 1},
           "kernel": kernel, "impl": impl, "impl_ref": "pkg.mod:fn", "backend": backend, "backend_settings": {},
           "dtype": dtype, "config": {}, "seq_len": seq_len, "device_count": devices, "classes": list(classes),
           "repro": f"attncheck repro {case_id} --impl {impl} --backend {backend}", "direction": direction,
           "outcome": outcome, "timings": {"kernel_s": 0.01},
           "reason": reason or ("ok" if outcome == "pass" else "max abs error 1 > allowed 1e-6")}
    if budget is not None:
        out["metrics"] = metrics(budget, max_abs)
        out["budget"] = numerics._json_float(float(budget))
    else:
        out["traceback"] = "Traceback (most recent call last): ..."
    return out


def report_of(records: list[dict], **overrides) -> dict:
    options = dict(run_id=RUN_ID, complete=True, problems=[], skipped_backends=[],
                   applicable={"toy_attention": ("causal", "bf16")}, wall_s=1.0)
    return render.build_report(records, **{**options, **overrides})


# ---------------------------------------------------------------------- schema
def test_records_of_a_real_toy_run_match_the_schema(pytester, monkeypatch):
    gate_dir = toy_spec.setup_gate_dir(pytester, monkeypatch)
    # Wrong on causal cases only: pass records, then fail records.
    result = toy_spec.run_gate(pytester, "rep", toy_spec.impl_option("toy_attention_mixed"))
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    text = (gate_dir / "rep" / "report.json").read_text()
    report = _strict_json(text)
    REPORT_VALIDATOR.validate(report)
    assert {r["outcome"] for r in report["records"]} == {"pass", "fail"}
    # The per-worker JSON lines are what was merged, and each line is a valid record.
    lines = [_strict_json(line) for f in (gate_dir / "rep" / rec.RECORDS_DIR).glob("*.jsonl")
             for line in f.read_text().splitlines()]
    for line in lines:
        RECORD_VALIDATOR.validate(line)
    assert sorted(map(rec.record_key, lines)) == sorted(map(rec.record_key, report["records"]))
    for r in report["records"]:
        assert Case.from_json(r["case"]).id == r["case_id"]  # the case id is the recorded case
        assert r["budget"] == r["metrics"]["budget"]
        assert (r["outcome"] == "pass") == r["metrics"]["passed"]
        assert r["repro"].endswith(f"--spec {toy_spec.SPEC_MODULE}")
        # toy_attention_mixed is wrong exactly on the causal cases.
        assert (r["outcome"] == "fail") == r["case"]["params"]["causal"]


def test_error_lowering_and_nonfinite_records_match_the_schema(tmp_path, only_toy_spec):
    spec = toy_spec.SPEC
    case = make_case(toy_spec.FAMILY, 7, dtype="float32", batch=2, heads=2, seq_len=8, head_dim=4, causal=True,
                     sm_scale=toy_spec.SM_SCALE)
    produced = {
        "crash": gate.check_case(spec, "user", toy_spec.toy_attention_crash, case, backends.BACKENDS["xla"]),
        "nan": gate.check_case(spec, "user", nan_attention, case, backends.BACKENDS["xla"]),
        "lower": gate.check_case(spec, "builtin", toy_spec.toy_attention, case, backends.BACKENDS["tpu-lower"]),
    }
    crash, = produced["crash"].records
    assert (crash["direction"], crash["outcome"]) == ("all", "error") and "traceback" in crash
    assert XSS in crash["reason"]
    assert {r["outcome"] for r in produced["nan"].records} == {"fail"}
    assert {r["budget"] for r in produced["nan"].records} == {"inf"}  # non-finite floats as strings
    assert [(r["direction"], r["outcome"]) for r in produced["lower"].records] == [
        ("lower-fwd", "pass"), ("lower-grad", "pass")]
    writer = rec.RecordWriter(tmp_path, RUN_ID, "gw3")
    for outcome in produced.values():
        for r in outcome.records:
            writer.write({**r, "nodeid": "test_gate.py::test_kernel_matches_oracle[toy_attention-user-xla]"})
    written, problems = rec.read_records(tmp_path, RUN_ID)
    assert problems == [] and len(written) == 1 + 4 + 2
    for r in written:
        RECORD_VALIDATOR.validate(r)
    # The merged report stays strict JSON although a group's worst budget is infinite.
    render.write_reports(tmp_path, run_id=RUN_ID, complete=True)
    report = _strict_json((tmp_path / "report.json").read_text())
    REPORT_VALIDATOR.validate(report)
    assert "inf" in {row["worst_budget"] for row in report["summary"]}
    assert "&lt;script&gt;" in (tmp_path / "report.html").read_text()


def test_schema_follows_the_code():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    props = SCHEMA["$defs"]["metrics"]["properties"]
    fields = [f.name for f in dataclasses.fields(numerics.Comparison)]
    assert sorted(props) == sorted(fields) == sorted(SCHEMA["$defs"]["metrics"]["required"])
    assert SCHEMA["properties"]["schema_version"] == {"const": rec.SCHEMA_VERSION}
    assert SCHEMA["$defs"]["record"]["properties"]["schema_version"] == {"const": rec.SCHEMA_VERSION}
    built = report_of([record()])
    assert set(SCHEMA["required"]) == set(built)
    assert set(SCHEMA["properties"]) == set(built) | {"regressions"}
    assert set(SCHEMA["$defs"]["summary_row"]["required"]) == set(built["summary"][0])
    REPORT_VALIDATOR.validate(json.loads(json.dumps(render._json_safe(built))))


MALFORMED = {
    "unknown outcome": lambda r: r.update(outcome="ok"),
    "no nodeid": lambda r: r.pop("nodeid"),
    "no run id": lambda r: r.pop("run_id"),
    "pass without metrics": lambda r: (r.pop("metrics"), r.pop("budget")),
    "metrics missing a field": lambda r: r["metrics"].pop("ulp_p99"),
    "metrics with an unknown field": lambda r: r["metrics"].update(surprise=1),
    "budget spelled Infinity": lambda r: r.update(budget="Infinity"),
    "metric as a string number": lambda r: r["metrics"].update(max_abs="1e-3"),
    "empty direction": lambda r: r.update(direction=""),
    "case id without hash": lambda r: r.update(case_id="toy_attention"),
    "bad worker": lambda r: r.update(worker="gw"),
    "negative timing": lambda r: r["timings"].update(kernel_s=-1.0),
    "future schema version": lambda r: r.update(schema_version=rec.SCHEMA_VERSION + 1),
    "undeclared field": lambda r: r.update(undeclared=True),
}


@pytest.mark.parametrize("mutation", list(MALFORMED))
def test_schema_rejects_malformed_records(mutation):
    good = record()
    RECORD_VALIDATOR.validate(good)
    MALFORMED[mutation](good)
    with pytest.raises(jsonschema.ValidationError):
        RECORD_VALIDATOR.validate(good)


# ---------------------------------------------------------------------- merge functions
def test_summarize_groups_and_finds_the_worst():
    records = [record("c0", budget=0.2), record("c1", budget=0.7), record("c0", direction="dq", budget=0.1),
               record("c1", direction="dq", outcome="error", budget=None),
               record("c2", dtype="bfloat16", budget=1.5, outcome="fail")]
    rows = {(r["dtype"], r["direction"]): r for r in render.summarize(records)}
    assert list(rows) == [("bfloat16", "out"), ("float32", "dq"), ("float32", "out")]  # sorted
    out = rows[("float32", "out")]
    assert (out["cases"], out["comparisons"], out["failures"], out["worst_budget"]) == (2, 2, 0, 0.7)
    assert out["worst_case"] == records[1]["case_id"] and out["worst_repro"] == records[1]["repro"]
    dq = rows[("float32", "dq")]
    assert (dq["failures"], dq["worst_budget"], dq["worst_case"]) == (1, math.inf, records[3]["case_id"])
    assert rows[("bfloat16", "out")]["failures"] == 1


def test_coverage_counts_cases_per_class_and_their_failures():
    records = [record("c0", classes=["causal"]), record("c0", direction="dq", classes=["causal"]),
               record("c1", classes=["causal", "bf16"]),
               record("c1", direction="dq", classes=["causal", "bf16"], outcome="fail", budget=2.0),
               record("c1", backend="tpu", classes=["causal", "bf16"]),  # another backend: another case run
               record("c3", classes=["surprise"])]
    table = render.coverage(records, {"toy_attention": ("causal", "bf16", "never"), "absent": ("x",)})
    assert table == {"toy_attention": {"causal": {"cases": 3, "failures": 1}, "bf16": {"cases": 2, "failures": 1},
                                       "never": {"cases": 0, "failures": 0},
                                       "surprise": {"cases": 1, "failures": 0}}}


def _row(worst_budget: float, dtype: str = "float32", impl: str = "builtin") -> dict:
    return {"kernel": "toy_attention", "impl": impl, "backend": "xla", "dtype": dtype, "direction": "out",
            "worst_budget": worst_budget, "worst_case": "toy_attention-000000000000", "failures": 0}


def _accepted(budget: float, impl: str | None = "builtin") -> dict:
    entry = {"kernel": "toy_attention", "backend": "xla", "dtype": "float32", "direction": "out",
             "worst_budget": budget}
    return {"budgets": [entry if impl is None else {**entry, "impl": impl}]}


@pytest.mark.parametrize("accepted", [0.5, 0.0])  # 0.0: the noise floor applies
def test_regression_factor_boundary(accepted):
    baseline = _accepted(accepted)
    limit = render.REGRESSION_FACTOR * max(accepted, render.REGRESSION_FLOOR)
    assert render.regressions([_row(limit)], baseline) == []  # at the limit: accepted
    assert render.regressions([_row(limit / 2)], baseline) == []
    found = render.regressions([_row(math.nextafter(limit, math.inf))], baseline)
    assert len(found) == 1
    assert found[0].startswith("numerics regression: toy_attention/builtin/xla/float32/out worst budget")
    assert "toy_attention-000000000000" in found[0]
    # A group the baseline does not know is new, not a regression.
    assert render.regressions([_row(100.0, dtype="bfloat16")], baseline) == []


def test_regressions_compare_each_implementation_with_its_own_budget():
    baseline = {"budgets": _accepted(0.4)["budgets"] + _accepted(0.6, impl="lse")["budgets"]}
    # lse's own accepted budget is 0.6: 0.8 is no regression although builtin's is 0.4.
    assert render.regressions([_row(0.8, impl="lse")], baseline) == []
    assert render.regressions([_row(0.91, impl="lse")], baseline)[0].startswith(
        "numerics regression: toy_attention/lse/xla/")
    # A user's implementation is held to the built-in budgets; an unknown impl is new.
    assert render.regressions([_row(0.61, impl="user")], baseline)[0].startswith(
        "numerics regression: toy_attention/user/xla/")
    assert render.regressions([_row(5.0, impl="chunked")], baseline) == []
    # A baseline written before budgets were keyed by implementation means the built-in.
    assert len(render.regressions([_row(0.61)], _accepted(0.4, impl=None))) == 1


def test_baseline_takes_the_passing_rows_of_the_familys_own_implementations():
    rows = [_row(0.4), {**_row(0.9, "bfloat16"), "failures": 1}, {**_row(0.3, impl="user"), "direction": "dq"},
            {**_row(0.2), "direction": "dk"}, _row(0.6, impl="lse")]
    baseline = render.baseline_from({"summary": rows})
    assert baseline["schema_version"] == rec.SCHEMA_VERSION
    common = {"kernel": "toy_attention", "backend": "xla", "dtype": "float32"}
    assert baseline["budgets"] == [{**common, "impl": "builtin", "direction": "out", "worst_budget": 0.4},
                                   {**common, "impl": "builtin", "direction": "dk", "worst_budget": 0.2},
                                   {**common, "impl": "lse", "direction": "out", "worst_budget": 0.6}]
    # Accepting a run's budgets and checking the same run against them flags nothing.
    assert render.regressions(rows, baseline) == []


# ---------------------------------------------------------------------- rendering
def test_markdown_lists_failures_with_reproducers_and_stays_short():
    failing = [record(f"f{i}", outcome="fail", budget=2.0 + i, direction=("out", "dq")[i % 2],
                      reason="error | with a pipe\nand a newline") for i in range(100)]
    records = [record(f"p{i}") for i in range(200)] + failing
    report = report_of(records)
    markdown = render.render_markdown(report, failing)
    lines = markdown.splitlines()
    assert lines[0] == "# attncheck: FAIL"
    assert len(lines) <= 60, len(lines)  # 300 records, 100 failures: still a step summary
    rows = [line for line in lines if line.startswith("| toy_attention | builtin | xla | out") or
            line.startswith("| toy_attention | builtin | xla | dq")]
    failure_rows = [line for line in rows if "`attncheck repro" in line]
    assert len(failure_rows) == 30
    assert f"`{failing[0]['case_id']}`" in markdown and f"`{failing[0]['repro']}`" in markdown
    assert "70 more in report.json" in markdown
    # The reason's pipe is escaped and its newline removed: each failure row keeps 7 cells.
    assert all(len(re.split(r"(?<!\\)\|", row)) == 9 for row in failure_rows)


def test_markdown_of_a_clean_run_says_pass():
    report = report_of([record("c0"), record("c0", direction="dq")])
    markdown = render.render_markdown(report, [])
    assert markdown.startswith("# attncheck: PASS") and "## Failures" not in markdown


def _html_records() -> list[dict]:
    return ([record(f"c{i}", seq_len=8 * (1 + i % 3), budget=0.1 * (1 + i % 9), max_abs=10.0 ** -(3 + i % 4))
             for i in range(12)]
            + [record(f"r{n}", kernel="ring_attention", devices=n, max_abs=1e-5 * n) for n in (1, 2, 4, 8)]
            + [record("bad", outcome="fail", budget=3.0, reason=f"kernel said {XSS}")])


def test_html_is_self_contained_escaped_and_has_three_plots():
    report = report_of(_html_records(), problems=[f"problem with <b>markup</b> {XSS}"],
                       skipped_backends=[{"backend": "tpu", "reason": "no TPU <none>"}])
    page = render.render_html(report)
    assert page.count("<svg") == 3 and page.count("</svg>") == 3
    assert "no data" not in page
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {SVG_NS}
    assert "<script" not in page.lower()  # neither inline nor <script src=...>
    assert not re.search(r"<(link|img|iframe|object|embed|image)\b", page) and "@import" not in page
    assert not re.search(r"\b(src|href)\s*=", page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;markup&lt;/b&gt;" in page and "no TPU &lt;none&gt;" in page
    assert "<b>" not in page


def test_reports_are_written_and_appended_to_the_step_summary(tmp_path, monkeypatch, only_toy_spec):
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    report_dir = tmp_path / "rep"
    writer = rec.RecordWriter(report_dir, RUN_ID, "gw0")
    for r in _html_records():
        writer.write({k: v for k, v in r.items() if k not in ("schema_version", "run_id", "worker")})
    result = render.write_reports(report_dir, run_id=RUN_ID, complete=True)
    markdown = (report_dir / "report.md").read_text()
    assert summary.read_text() == "earlier step\n" + markdown  # appended once, not overwritten
    assert markdown.startswith("# attncheck: FAIL") and result.report["totals"]["records"] == 17
    REPORT_VALIDATOR.validate(_strict_json((report_dir / "report.json").read_text()))
    assert (report_dir / "report.html").read_text().count("<svg") == 3
    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    render.write_reports(report_dir, run_id=RUN_ID, complete=True)
    assert summary.read_text() == "earlier step\n" + markdown  # unset: nothing appended


def test_a_test_failing_without_a_record_is_a_gate_problem(tmp_path, only_toy_spec):
    writer = rec.RecordWriter(tmp_path, RUN_ID, "main")
    writer.write({k: v for k, v in record("c0", nodeid="t.py::passing").items() if k != "schema_version"})
    writer.write({k: v for k, v in record("c1", nodeid="t.py::failing", outcome="fail", budget=2.0).items()
                  if k != "schema_version"})
    failed = {"t.py::hung": "Failed: Timeout (>5.0s) from pytest-timeout.", "t.py::failing": "AssertionError"}
    result = render.write_reports(tmp_path, run_id=RUN_ID, complete=True, failed_tests=failed)
    assert result.problems == ["t.py::hung failed without a failing record: Failed: Timeout (>5.0s) from "
                               "pytest-timeout."]
    assert "Timeout (>5.0s)" in (tmp_path / "report.md").read_text()


def test_cleanup_never_removes_a_live_runs_records(tmp_path):
    """Only other runs' files untouched for STALE_AFTER_S go; a run writing in bursts keeps
    its records (a short run ending mid-gate once deleted a live gate's files)."""
    import os
    import time

    records = tmp_path / rec.RECORDS_DIR
    records.mkdir()
    own, live, dead = (records / f"{name}-gw0.jsonl" for name in ("mine", "live", "dead"))
    for f in (own, live, dead):
        f.write_text("{}\n")
    long_ago = time.time() - rec.STALE_AFTER_S - 60
    os.utime(dead, (long_ago, long_ago))
    os.utime(live, (time.time() - 600,) * 2)  # a burst ten minutes ago
    rec.clear_stale_records(tmp_path, "mine")
    assert sorted(p.name for p in records.iterdir()) == ["live-gw0.jsonl", "mine-gw0.jsonl"]
