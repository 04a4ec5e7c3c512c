"""Reports: the JSON schema against real records, and the merge/render functions on
hand-built records (summary, coverage, regressions, accepted budgets, Markdown, HTML, step
summary)."""

from __future__ import annotations

import dataclasses
import hashlib
import html.parser
import json
import math
import re
import types

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from attncheck import check, layouts, numerics
from attncheck.backends import BACKENDS
from attncheck.env import Platform
from attncheck.expectations import Expectation
from attncheck.report import accepted, coverage_table, errormap, history, merge, model, render
from attncheck.report import records as rec
from attncheck.report.policy import REGRESSION_FLOOR, Declared, Policy
from attncheck.report.records import Record
from tests.selftest import harness, toy_spec

SCHEMA = harness.load_schema()
REPORT_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
RECORD_VALIDATOR = jsonschema.Draft202012Validator(
    {"$schema": SCHEMA["$schema"], "$defs": SCHEMA["$defs"], "$ref": "#/$defs/record"})
RUN_ID = "20260101T0000001234"
XSS = "<script>alert(1)</script>"
SVG_NS = "http://www.w3.org/2000/svg"
APPLICABLE = {"toy_attention": ("causal", "bf16")}
POLICY = Policy(applicable=APPLICABLE)
PLATFORM = Platform("x86_64", "AVX2", 32, "0.12.0.1", "0.12.0.1", "2.5.5")


def _strict_json(text: str):
    """json.loads that refuses Infinity/NaN, as JSON.parse does."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def nan_attention(q, k, v, *, causal: bool, sm_scale: float):
    return toy_spec.toy_attention(q, k, v, causal=causal, sm_scale=sm_scale) * jnp.nan


# ---------------------------------------------------------------------- hand-built records
def metrics(budget: float = 0.5, max_abs: float = 1e-6) -> numerics.Comparison:
    allowed = max_abs / budget if budget else 1e-6
    return numerics.Comparison(
        passed=budget <= 1, reason="ok" if budget <= 1 else "max abs error too large", max_abs=max_abs,
        max_rel=1e-5, mean_abs=max_abs / 4, ulp_p50=1.0, ulp_p99=3.0, ulp_max=4.0, cosine=1.0,
        yardstick_err=allowed / 3, yardstick_ulps=2.0, r=2.0, a=allowed / 3, allowed=allowed, budget=budget,
        worst_index=(0, 1, 2, 3), worst_kernel=0.25, worst_oracle=0.2500001, compared=256)


def record(case: str = "c0", *, kernel: str = "toy_attention", impl: str = "builtin", backend: str = "xla",
           dtype: str = "float32", direction: str = "out", outcome: str = "pass", budget: float | None = 0.5,
           classes=(), reason: str | None = None, seq_len: int = 8, devices: int = 1, max_abs: float = 1e-6,
           nodeid: str = "attncheck/gate/test_gate.py::test_kernel_matches_oracle[x]") -> Record:
    case_id = f"{kernel}-{hashlib.sha256(case.encode()).hexdigest()[:12]}"
    return Record(
        case_id=case_id, case={"family": kernel, "params": {"name": case}, "seed": 1}, kernel=kernel, impl=impl,
        impl_ref="pkg.mod:fn", backend=backend, backend_settings={}, dtype=dtype, seq_len=seq_len,
        device_count=devices, classes=tuple(classes),
        repro=f"attncheck repro {case_id} --impl {impl} --backend {backend}",
        nodeid=nodeid, direction=direction, outcome=outcome, timings={"kernel_s": 0.01},
        reason=reason or ("ok" if outcome == "pass" else "max abs error 1 > allowed 1e-6"),
        metrics=None if budget is None else metrics(budget, max_abs),
        traceback="Traceback (most recent call last): ..." if budget is None else None,
        run_id=RUN_ID, worker="main")


def report_of(records: list[Record], **overrides) -> model.Report:
    declared = overrides.pop("declared", {})
    options = dict(run_id=RUN_ID, complete=True, problems=[], unverified=[], skipped_backends=[],
                   policy=Policy(applicable=APPLICABLE, declared=declared), wall_s=1.0)
    return model.build(records, **{**options, **overrides})


def merged(directory, **outcome) -> model.Report:
    """Merge a hand-written run directory as the plugin does, and write its reports."""
    report = merge.merge(directory, RUN_ID, merge.RunOutcome(**{"complete": True, **outcome}), POLICY)
    render.write(directory, report)
    return report


# ---------------------------------------------------------------------- schema
def test_records_of_a_real_toy_run_match_the_schema(gate_dir, pytester):
    # Wrong on causal cases only: pass records, then fail records.
    result = harness.run_gate(pytester, "rep", harness.impl_option("toy_attention_mixed"))
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    text = (gate_dir / "rep" / "report.json").read_text()
    report = _strict_json(text)
    REPORT_VALIDATOR.validate(report)
    assert {r["outcome"] for r in report["records"]} == {"pass", "fail"}
    # The numbers' platform and the profile that drew them (named on the command line).
    assert report["profile"] == "ci" and report["platform"]["isa"] in ("AVX2", "host")
    assert {r["backend_settings"]["platform"] for r in report["records"]} == {
        Platform.from_json(report["platform"]).describe()}
    # The per-worker JSON lines are what was merged, and each line is a valid record.
    lines = [_strict_json(line) for f in (gate_dir / "rep" / rec.RECORDS_DIR).glob("*.jsonl")
             for line in f.read_text().splitlines()]
    for line in lines:
        RECORD_VALIDATOR.validate(line)
    key = lambda r: Record.from_json(r).key  # noqa: E731
    assert sorted(map(key, lines)) == sorted(map(key, report["records"]))
    assert report["verdict"] == "FAIL"
    for r in report["records"]:
        assert toy_spec.SPEC.case_from_json(r["case"]).id == r["case_id"]  # the case id is the recorded case
        assert (r["outcome"] == "pass") == r["metrics"]["passed"]
        # A user spec and a report directory other than the default are named in the reproducer.
        assert r["repro"].endswith(f"--spec {harness.SPEC_MODULE} --report rep")
        # toy_attention_mixed is wrong exactly on the causal cases.
        assert (r["outcome"] == "fail") == r["case"]["params"]["causal"]


def test_error_lowering_and_nonfinite_records_match_the_schema(tmp_path):
    spec = toy_spec.SPEC
    case = spec.case(7, dtype="float32", batch=2, heads=2, seq_len=8, head_dim=4, causal=True,
                     sm_scale=toy_spec.SM_SCALE)

    def run(impl, backend):
        return check.check_case(check.Target(spec, "user", impl, BACKENDS[backend]), case)

    produced = {"crash": run(toy_spec.toy_attention_crash, "xla"), "nan": run(nan_attention, "xla"),
                "lower": run(toy_spec.toy_attention, "tpu-lower")}
    crash, = produced["crash"].records
    assert (crash.direction, crash.outcome) == ("all", "error") and crash.traceback
    assert XSS in crash.reason
    assert {r.outcome for r in produced["nan"].records} == {"fail"}
    assert {r.budget for r in produced["nan"].records} == {math.inf}
    # The toy kernel is plain jax: it lowers for TPU, but no Pallas kernel is in it.
    assert [(r.direction, r.outcome, r.reason) for r in produced["lower"].records] == [
        ("lower-fwd", "error", check.NO_KERNEL_LOWERED), ("lower-grad", "error", check.NO_KERNEL_LOWERED)]
    writer = rec.RecordWriter(tmp_path, RUN_ID, "gw3")
    for outcome in produced.values():
        for r in outcome.records:
            writer.write(dataclasses.replace(
                r, nodeid="test_gate.py::test_kernel_matches_oracle[toy_attention-user-xla]"))
    lines = [_strict_json(line) for line in writer.path.read_text().splitlines()]
    for line in lines:
        RECORD_VALIDATOR.validate(line)
    assert {line["metrics"]["budget"] for line in lines if line["direction"] == "dq"} == {"inf"}  # as strings
    written, problems = rec.read_records(tmp_path, RUN_ID)
    assert problems == [] and len(written) == 1 + 4 + 2
    # The merged report stays strict JSON although a group's worst budget is infinite.
    merged(tmp_path)
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
    assert set(SCHEMA["$defs"]["record"]["properties"]) == {f.name for f in dataclasses.fields(Record)}
    built = report_of([record()]).to_json()
    assert set(SCHEMA["required"]) == set(built)
    assert set(SCHEMA["properties"]) == set(built) | {"regressions", "shard"}
    assert set(SCHEMA["$defs"]["platform"]["required"]) == {f.name for f in dataclasses.fields(Platform)}
    assert set(SCHEMA["$defs"]["policy"]["required"]) == {f.name for f in dataclasses.fields(Policy)}
    assert set(SCHEMA["$defs"]["summary_row"]["required"]) == set(built["summary"][0])
    REPORT_VALIDATOR.validate(json.loads(json.dumps(built)))
    policy = Policy(applicable=APPLICABLE, require_coverage=True, accepted_budgets=None,
                    # As a spec declares them: a read-only class-level mapping.
                    fixed_parameters={"toy_attention": types.MappingProxyType({"sm_scale": "fixed"})},
                    regression_floor=0.3, declared={"toy_attention": DECLARED})
    shard = model.ShardInfo(2, 4, tests=3, collection_size=9, collection_digest="0123456789abcdef",
                            asked={"toy_attention-builtin-xla": {"passed": 2}}, unavailable=(), policy=policy)
    sharded = report_of([record()], shard=shard, declared={"toy_attention": DECLARED}, platform=PLATFORM,
                        profile="ci").to_json()
    assert model.ShardInfo.from_json(sharded["shard"]) == shard
    assert set(SCHEMA["$defs"]["shard"]["required"]) == set(sharded["shard"]) == {
        f.name for f in dataclasses.fields(model.ShardInfo)}
    REPORT_VALIDATOR.validate(json.loads(json.dumps(sharded)))
    REPORT_VALIDATOR.validate(model.placeholder(RUN_ID).to_json())


def _map_json() -> dict:
    return errormap.build(np.ones((2, 2)), np.ones((2, 2)), allowed=1.0, direction="out").to_json()


MALFORMED = {
    "unknown outcome": lambda r: r.update(outcome="ok"),
    "no nodeid": lambda r: r.pop("nodeid"),
    "no run id": lambda r: r.pop("run_id"),
    "pass without metrics": lambda r: r.pop("metrics"),
    "metrics missing a field": lambda r: r["metrics"].pop("ulp_p99"),
    "metrics with an unknown field": lambda r: r["metrics"].update(surprise=1),
    "budget spelled Infinity": lambda r: r["metrics"].update(budget="Infinity"),
    "metric as a string number": lambda r: r["metrics"].update(max_abs="1e-3"),
    "empty direction": lambda r: r.update(direction=""),
    "case id without hash": lambda r: r.update(case_id="toy_attention"),
    "bad worker": lambda r: r.update(worker="gw"),
    "negative timing": lambda r: r["timings"].update(kernel_s=-1.0),
    "future schema version": lambda r: r.update(schema_version=rec.SCHEMA_VERSION + 1),
    "undeclared field": lambda r: r.update(undeclared=True),
    "error map of another version": lambda r: r.update(error_map={**_map_json(), "version": 2}),
    "error map cells not base64": lambda r: r.update(error_map={**_map_json(), "cells": [2, 2, "not base64!"]}),
}


@pytest.mark.parametrize("mutation", list(MALFORMED))
def test_schema_rejects_malformed_records(mutation):
    good = record().to_json()
    RECORD_VALIDATOR.validate(good)
    assert next(rec._validator().iter_errors(good), None) is None
    MALFORMED[mutation](good)
    with pytest.raises(jsonschema.ValidationError):
        RECORD_VALIDATOR.validate(good)
    # The merge's own validator (references inlined for speed) says the same.
    assert next(rec._validator().iter_errors(good), None) is not None


# ---------------------------------------------------------------------- merge functions
def test_summarize_groups_and_finds_the_worst():
    records = [record("c0", budget=0.2), record("c1", budget=0.7), record("c0", direction="dq", budget=0.1),
               record("c1", direction="dq", outcome="error", budget=None),
               record("c2", dtype="bfloat16", budget=1.5, outcome="fail")]
    rows = {(r.dtype, r.direction): r for r in model.summarize(records)}
    assert list(rows) == [("bfloat16", "out"), ("float32", "dq"), ("float32", "out")]  # sorted
    out = rows[("float32", "out")]
    assert (out.cases, out.comparisons, out.failures, out.worst_budget) == (2, 2, 0, 0.7)
    assert out.worst_case == records[1].case_id and out.worst_repro == records[1].repro
    dq = rows[("float32", "dq")]
    assert (dq.failures, dq.worst_budget, dq.worst_case) == (1, math.inf, records[3].case_id)
    assert rows[("bfloat16", "out")].failures == 1


def test_coverage_counts_cases_per_class_and_their_failures():
    records = [record("c0", classes=["causal"]), record("c0", direction="dq", classes=["causal"]),
               record("c1", classes=["causal", "bf16"]),
               record("c1", direction="dq", classes=["causal", "bf16"], outcome="fail", budget=2.0),
               record("c1", backend="tpu", classes=["causal", "bf16"]),  # another backend: another case run
               record("c3", classes=["surprise"])]
    table = coverage_table.table(records, {"toy_attention": ("causal", "bf16", "never"), "absent": ("x",)})
    C = coverage_table.ClassCount  # noqa: N806
    assert table == {"toy_attention": {"causal": C(3, 1), "bf16": C(2, 1), "never": C(0, 0), "surprise": C(1, 0)}}
    assert coverage_table.missing(table, {"toy_attention": ("causal", "bf16", "never")}) == {"toy_attention": ["never"]}


def _row(worst_budget: float, dtype: str = "float32", impl: str = "builtin", direction: str = "out",
         failures: int = 0) -> model.SummaryRow:
    return model.SummaryRow("toy_attention", impl, "xla", dtype, direction, cases=1, comparisons=1, failures=failures,
                            worst_budget=worst_budget, worst_case="toy_attention-000000000000",
                            worst_repro="attncheck repro x")


def _accepted(*budgets: tuple[float, str]) -> accepted.AcceptedBudgets:
    return accepted.AcceptedBudgets(tuple(accepted.AcceptedBudget("toy_attention", impl, "xla", "float32", "out", b)
                                          for b, impl in budgets), PLATFORM, "ci")


def _regressions(rows, budgets, platform=PLATFORM, profile="ci") -> list[str]:
    found, differences = accepted.judge(rows, budgets, REGRESSION_FLOOR, platform, profile)
    assert not differences
    return found


@pytest.mark.parametrize("accepted_budget", [0.5, 0.0])  # 0.0: the noise floor applies
def test_regression_factor_boundary(accepted_budget):
    budgets = _accepted((accepted_budget, "builtin"))
    limit = accepted.REGRESSION_FACTOR * max(accepted_budget, REGRESSION_FLOOR)
    assert _regressions([_row(limit)], budgets) == []  # at the limit: accepted
    assert _regressions([_row(limit / 2)], budgets) == []
    found = _regressions([_row(math.nextafter(limit, math.inf))], budgets)
    assert len(found) == 1
    assert found[0].startswith("numerics regression: toy_attention/builtin/xla/float32/out worst budget")
    assert "toy_attention-000000000000" in found[0]
    # A group the accepted budgets do not know is new, not a regression.
    assert _regressions([_row(100.0, dtype="bfloat16")], budgets) == []


def test_regressions_compare_each_implementation_with_its_own_budget():
    budgets = _accepted((0.4, "builtin"), (0.6, "lse"))
    # lse's own accepted budget is 0.6: 0.8 is no regression although builtin's is 0.4.
    assert _regressions([_row(0.8, impl="lse")], budgets) == []
    assert _regressions([_row(0.91, impl="lse")], budgets)[0].startswith(
        "numerics regression: toy_attention/lse/xla/")
    # A user's implementation is held to the built-in budgets; an unknown impl is new.
    assert _regressions([_row(0.61, impl="user")], budgets)[0].startswith(
        "numerics regression: toy_attention/user/xla/")
    assert _regressions([_row(5.0, impl="chunked")], budgets) == []


def test_accepted_budgets_are_the_passing_rows_of_the_familys_own_implementations(tmp_path):
    rows = [_row(0.4), _row(0.9, "bfloat16", failures=1), _row(0.3, impl="user", direction="dq"),
            _row(0.2, direction="dk"), _row(0.6, impl="lse")]
    budgets = accepted.from_summary(rows, PLATFORM, "ci")
    assert [(b.impl, b.direction, b.worst_budget) for b in budgets.budgets] == [
        ("builtin", "out", 0.4), ("builtin", "dk", 0.2), ("lse", "out", 0.6)]
    assert (budgets.platform, budgets.profile) == (PLATFORM, "ci")
    accepted.write(tmp_path / "accepted.json", budgets)
    assert accepted.read(tmp_path / "accepted.json") == budgets  # the file round-trips
    # Accepting a run's budgets and checking the same run against them flags nothing.
    assert _regressions(rows, budgets) == []


@pytest.mark.parametrize("content, message", [
    ("[]", "expected an object"), ('{"budgets": {}}', "expected an object"), ("{", "not JSON"),
    ('{"budgets": [{"kernel": "k", "impl": "i", "backend": "b", "direction": "d", "worst_budget": 1}]}', "lacks dtype"),
    ('{"budgets": [{"kernel": "k", "impl": "i", "backend": "b", "dtype": "f", "direction": "d", "worst_budget": "x"}]}',
     "non-negative number"),
    ('{"budgets": [3]}', "budgets\\[0\\] is int")])
def test_a_malformed_accepted_budgets_file_is_named_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "accepted.json"
    path.write_text(content)
    with pytest.raises(accepted.AcceptedBudgetsError, match=f"{re.escape(str(path))}: .*{message}"):
        accepted.read(path)
    with pytest.raises(accepted.AcceptedBudgetsError, match="cannot read"):
        accepted.read(tmp_path / "missing.json")


# ---------------------------------------------------------------------- rendering
def test_markdown_lists_failures_with_reproducers_and_stays_short():
    failing = [record(f"f{i}", outcome="fail", budget=2.0 + i, direction=("out", "dq")[i % 2],
                      reason="error | with a pipe\nand a newline") for i in range(100)]
    records = [record(f"p{i}") for i in range(200)] + failing
    markdown = render.render_markdown(report_of(records))
    lines = markdown.splitlines()
    assert lines[0] == "# attncheck: FAIL"
    assert len(lines) <= 60, len(lines)  # 300 records, 100 failures: still a step summary
    failure_rows = [line for line in lines if "<code>attncheck repro" in line]
    assert len(failure_rows) == 30
    assert f"<code>{failing[0].case_id}</code>" in markdown and f"<code>{failing[0].repro}</code>" in markdown
    assert "70 more in report.json" in markdown
    # The reason's pipe is escaped and its newline removed: each failure row keeps 7 cells.
    assert all(len(re.split(r"(?<!\\)\|", row)) == 9 for row in failure_rows)


DECLARED = Declared(contracts=("pages are computed with as bfloat16",))
NAN_ROWS = Expectation("toy_attention", "pkg.mod:fn", "bug_class", "causal", "a q block that visits no kv block "
                       "outputs NaN", "pyproject.toml")


def test_the_report_lists_the_contracts_and_each_declared_deviation_with_how_it_stood():
    deviation = model.DeviationStatus(NAN_ROWS, "stale", cases=3, shown=0)
    report = report_of([record()], declared={"toy_attention": DECLARED, "other": Declared()},
                       deviations=[deviation])
    assert report.declared == {"toy_attention": DECLARED}  # a family that declares nothing is left out
    markdown = render.render_markdown(report)
    assert "## Contracts" in markdown and "  - pages are computed with as bfloat16" in markdown
    assert "## Declared deviations" in markdown and (
        "| toy_attention | <code>pkg.mod:fn</code> | bug_class <code>causal</code> | a q block that visits no kv "
        "block outputs NaN | pyproject.toml | 3 (0) | **stale** |") in markdown, markdown
    html = render.render_html(report)
    assert "<td>a q block that visits no kv block outputs NaN</td>" in html and "<td>stale</td>" in html
    assert "Declared deviations" not in render.render_markdown(report_of([record()]))
    assert model.DeviationStatus.from_json(json.loads(json.dumps(deviation.to_json()))) == deviation


def test_markdown_of_a_clean_run_says_pass():
    markdown = render.render_markdown(report_of([record("c0"), record("c0", direction="dq")]))
    assert markdown.startswith("# attncheck: PASS") and "## Failures" not in markdown


@pytest.mark.parametrize("hostile", [
    "</td></tr></table><h1>PASS</h1>", "<img src=x onerror=alert(1)>", "a | b | c", "`code` **bold** [x](y)",
    "line one\n# heading\n| table |", "<lambda> in jax"])
def test_markdown_escapes_what_kernels_exceptions_and_users_wrote(hostile):
    """A kernel's error text goes into tables, lists and the CI step summary: it may neither
    add markup (HTML or Markdown) nor break a row, and it must stay readable."""
    failing = [record("f0", outcome="fail", budget=2.0, reason=hostile, nodeid=f"t.py::{hostile}")]
    markdown = render.render_markdown(report_of(failing, problems=[f"problem: {hostile}"]))
    rows = [line for line in markdown.splitlines() if line.startswith("| toy_attention")]
    failure_row = next(row for row in rows if "attncheck repro" in row)
    assert len(re.split(r"(?<!\\)\|", failure_row)) == 9  # still 7 cells
    for tag in ("<h1>", "<img", "</td>", "</table>", "<lambda>"):
        assert tag not in markdown
    assert "&lt;lambda&gt;" in markdown or "lambda" not in hostile  # jax's own text is kept, escaped
    assert not any(line.startswith("# heading") for line in markdown.splitlines())


def _html_records() -> list[Record]:
    return ([record(f"c{i}", seq_len=8 * (1 + i % 3), budget=0.1 * (1 + i % 9), max_abs=10.0 ** -(3 + i % 4))
             for i in range(12)]
            + [record(f"r{n}", kernel="ring_attention", devices=n, max_abs=1e-5 * n) for n in (1, 2, 4, 8)]
            + [record("bad", outcome="fail", budget=3.0, reason=f"kernel said {XSS}")])


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class StrictHTML(html.parser.HTMLParser):
    """Well-formedness beyond what browsers forgive: every non-void element closed in order
    (SVG elements self-closed or closed), ids unique, every in-page link has its target,
    nothing fetched but inline data images."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.ids, self.links, self.errors = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self._attrs(tag, attrs)
        if tag not in VOID:
            self.stack.append((tag, self.getpos()))

    def handle_startendtag(self, tag, attrs):
        self._attrs(tag, attrs)

    def _attrs(self, tag, attrs):
        names = [name for name, _ in attrs]
        if len(names) != len(set(names)):
            self.errors.append(f"duplicate attribute in <{tag}> at {self.getpos()}")
        for name, value in attrs:
            if name == "id":
                self.ids.append(value)
            if name in ("href", "src"):
                self.links.append((tag, name, value))

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1][0] != tag:
            self.errors.append(f"</{tag}> at {self.getpos()} closes {self.stack[-1] if self.stack else 'nothing'}")
            return
        self.stack.pop()

    def check(self, page: str) -> StrictHTML:
        self.feed(page)
        self.close()
        assert page.startswith("<!doctype html>")
        assert not self.errors, self.errors[:5]
        assert not self.stack, f"unclosed: {self.stack[:5]}"
        assert len(self.ids) == len(set(self.ids)), sorted(i for i in self.ids if self.ids.count(i) > 1)
        for tag, name, value in self.links:
            if value.startswith("#"):
                assert value[1:] in self.ids, f"<{tag} {name}={value}> has no target"
            else:  # only inline data: nothing is fetched, from the network or from the disk
                assert tag == "image" and value.startswith("data:image/png;base64,"), (tag, name, value[:60])
        return self


@pytest.mark.parametrize("bad", [
    "<!doctype html><div><p>x</div></p>", "<!doctype html><div id=a></div><span id=a></span>",
    "<!doctype html><a href='#nowhere'>x</a>", "<!doctype html><img src='http://x/y.png'>",
    "<!doctype html><svg><g></svg>", "<!doctype html><table><tr><td>x</tr></table>"])
def test_the_strict_html_checker_rejects_what_it_should(bad):
    with pytest.raises(AssertionError):
        StrictHTML().check(bad)
    StrictHTML().check("<!doctype html><div id=a><a href='#a'>x</a><svg><line/></svg><br></div>")


def _with_maps(records: list[Record]) -> list[Record]:
    """Real error maps on hand-built records: a block-edge error on the failing ones."""
    rng = np.random.default_rng(0)
    out = []
    for r in records:
        oracle = rng.standard_normal((1, 2, 64, 8))
        kernel = oracle + 1e-8 * rng.standard_normal(oracle.shape)
        if not r.passed:
            kernel[0, 1, 32] += 1.0
        layout = layouts.ErrorMapLayout(("batch", "head", "query", "dim"), 2, 3,
                                         (layouts.every(f"block {XSS}", 16, 64),))
        emap = errormap.build(kernel, oracle, allowed=1e-6, direction=r.direction, layout=layout)
        out.append(dataclasses.replace(r, error_map=emap))
    return out


def test_html_is_self_contained_escaped_valid_and_draws_every_plot():
    records = _with_maps(_html_records())
    budgets = _accepted((0.2, "builtin"))
    report = report_of(records, problems=[f"problem with <b>markup</b> {XSS}"],
                       skipped_backends=[model.SkippedBackend("tpu", "no TPU <none>")])
    page = render.render_html(report, budgets)
    checked = StrictHTML().check(page)
    # The plots: colour scale, overview heatmap, trend, one error-vs-length plot per dtype,
    # the histogram, error vs devices, the failure's map and the worst passing maps.
    kinds = re.findall(r'<svg xmlns="http://www.w3.org/2000/svg" class="plot (\w+)"', page)
    assert page.count("<svg") == page.count("</svg>") == len(kinds)
    assert sorted(set(kinds)) == ["colorbar", "errormap", "heatmap", "histogram", "scatter", "trend"]
    assert kinds.count("errormap") == 1 + 2  # the failure, the worst passing of toy_attention and ring_attention
    assert "no data" not in page
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {SVG_NS}
    # One inline script (the copy buttons), nothing fetched.
    assert page.lower().count("<script") == 1 and "<script>" in page and not re.search(r"<script[^>]*src", page)
    assert not re.search(r"<(link|img|iframe|object|embed)\b", page) and "@import" not in page
    assert {tag for tag, _, _ in checked.links} <= {"a", "image"}
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;markup&lt;/b&gt;" in page and "no TPU &lt;none&gt;" in page
    assert "<b>" not in page and XSS not in page
    # Failures first: the failing record's card, with its reproducer and copy button and
    # the worst element named by the map's axes, comes before the overview.
    bad = next(r for r in records if not r.passed)
    assert page.index("id='failures'") < page.index('id="overview"')
    assert f"data-copy='{bad.repro}'" in page
    assert "worst element at batch=0, head=1, query=2, dim=3: kernel 0.25 vs oracle 0.2500001" in page
    # Every overview heatmap cell links to its summary row.
    rows = [render.row_id(row) for row in report.summary]
    assert sorted(set(re.findall(r'<a href="#(s-[^"]+)">', page))) == sorted(rows)
    # The trend: this run's worst budget (the failure's) against the accepted one and its
    # regression limit (1.5 x the floor 1/3); a group without an accepted budget is new.
    trend = re.search(r'<svg[^>]*class="plot trend".*?</svg>', page).group(0)
    assert "toy_attention/builtin xla float32 out: this run 3, accepted 0.2, limit 0.5</title>" in trend
    assert "ring_attention/builtin xla float32 out: this run 0.5, new</title>" in trend


def test_html_log_axes_show_exact_zeros_apart():
    records = [record("z0", max_abs=0.0, budget=0.0), record("z1", max_abs=1e-6), record("z2", max_abs=1e-5)]
    page = render.render_html(report_of(records))
    scatter = re.search(r'<svg[^>]*class="plot scatter".*?</svg>', page).group(0)
    # Decades 1e-6 .. 1e-5 on the axis (not 1e-24 because of the zero), zeros in their band.
    labels = re.findall(r'text-anchor="end">([^<]+)</text>', scatter)
    assert "exact 0" in labels and "1e-6" in labels and "1e-5" in labels
    assert not any(re.fullmatch(r"1e-(\d+)", t) and int(t[3:]) > 6 for t in labels), labels
    # A tiny nonzero error does not stretch the axis either: at most MAX_DECADES below the
    # top, the rest marked on the bottom edge.
    page = render.render_html(report_of(records + [record("z3", max_abs=1e-24)]))
    scatter = re.search(r'<svg[^>]*class="plot scatter".*?</svg>', page).group(0)
    labels = re.findall(r'text-anchor="end">([^<]+)</text>', scatter)
    assert "1e-15" in labels and not any(re.fullmatch(r"1e-(\d+)", t) and int(t[3:]) > 15 for t in labels)
    assert "below 1e-15" in scatter and scatter.count('<path class="pt"') == 1


def test_report_json_keeps_the_whole_report_with_one_record_per_line(tmp_path):
    report = report_of(_with_maps(_html_records()))
    text = render.dump_json(report)
    assert _strict_json(text) == json.loads(json.dumps(report.to_json()))
    lines = text.splitlines()
    assert sum(line.startswith('{"backend": ') for line in lines) == report.totals.records
    REPORT_VALIDATOR.validate(_strict_json(text))
    empty = report_of([])
    assert _strict_json(render.dump_json(empty)) == json.loads(json.dumps(empty.to_json()))


def test_a_record_whose_error_map_does_not_decode_is_a_gate_problem(tmp_path):
    _write(tmp_path, _with_maps([record("c0"), record("c1")]))
    path = tmp_path / rec.RECORDS_DIR / f"{RUN_ID}-gw0.jsonl"
    first, second = path.read_text().splitlines()
    broken = json.loads(second)
    broken["error_map"]["cells"][2] = "AAAA"  # base64 of three zero bytes: no zlib stream
    path.write_text(first + "\n" + json.dumps(broken) + "\n")
    report = merged(tmp_path)
    assert report.totals.records == 1 and report.verdict == model.FAIL
    assert any(":2: invalid record (error map cells do not decode" in p for p in report.problems), report.problems


def _write(directory, records: list[Record]) -> None:
    writer = rec.RecordWriter(directory, RUN_ID, "gw0")
    for r in records:
        writer.write(r)


def test_reports_are_written_and_appended_to_the_step_summary(tmp_path, monkeypatch):
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    report_dir = tmp_path / "rep"
    _write(report_dir, _html_records())
    report = merged(report_dir)
    markdown = (report_dir / "report.md").read_text()
    assert summary.read_text() == "earlier step\n" + markdown  # appended once, not overwritten
    assert markdown.startswith("# attncheck: FAIL") and report.totals.records == 17
    REPORT_VALIDATOR.validate(_strict_json((report_dir / "report.json").read_text()))
    StrictHTML().check((report_dir / "report.html").read_text())
    monkeypatch.delenv("GITHUB_STEP_SUMMARY")
    merged(report_dir)
    assert summary.read_text() == "earlier step\n" + markdown  # unset: nothing appended


def test_a_test_failing_without_a_record_is_a_gate_problem(tmp_path):
    _write(tmp_path, [record("c0", nodeid="t.py::passing"), record("c1", nodeid="t.py::failing", outcome="fail",
                                                                   budget=2.0)])
    failed = {"t.py::hung": "Failed: Timeout (>5.0s) from pytest-timeout.", "t.py::failing": "AssertionError"}
    report = merged(tmp_path, failed_tests=failed)
    assert report.problems == ["t.py::hung failed without a failing record: Failed: Timeout (>5.0s) from "
                               "pytest-timeout."]
    assert "Timeout (&gt;5.0s)" in (tmp_path / "report.md").read_text()


def test_a_case_that_started_and_never_finished_is_an_error_record_with_its_reproducer(tmp_path):
    """A worker that died (os._exit, a signal) or a case that hung leaves its started
    marker without a record: the merge names the case, the test and what happened."""
    done, lost = record("c0", nodeid="t.py::a"), record("c1", nodeid="t.py::b")
    writer = rec.RecordWriter(tmp_path, RUN_ID, "gw1")
    for r in (done, lost):
        writer.started(rec.CaseRun(**{f.name: getattr(r, f.name) for f in dataclasses.fields(rec.CaseRun)}))
    writer.write(done)
    report = merged(tmp_path, failed_tests={"t.py::b": "worker 'gw1' crashed while running 't.py::b'"})
    errors = [r for r in report.records if r.outcome == "error"]
    assert [(r.case_id, r.nodeid, r.repro) for r in errors] == [(lost.case_id, "t.py::b", lost.repro)]
    assert "never finished: worker 'gw1' crashed" in errors[0].reason
    assert report.verdict == model.FAIL and report.problems == []  # named by its record, not as a loose test


def test_records_that_fail_validation_are_gate_problems_not_silently_dropped(tmp_path):
    _write(tmp_path, [record("c0")])
    path = tmp_path / rec.RECORDS_DIR / f"{RUN_ID}-gw0.jsonl"
    good = json.loads(path.read_text())
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({**good, "outcome": "maybe"}) + "\n")
        fh.write('{"truncated": \n')
    (tmp_path / rec.RECORDS_DIR / f"{RUN_ID}-gw1.jsonl").write_bytes(b"\xff\xfe not utf-8\n")
    report = merged(tmp_path)
    assert report.verdict == model.FAIL and report.totals.records == 1
    assert any(":2: invalid record (outcome" in p for p in report.problems), report.problems
    assert any(":3: truncated line" in p for p in report.problems), report.problems
    assert any("gw1.jsonl: not UTF-8" in p for p in report.problems), report.problems


@pytest.mark.parametrize("unverified, failures, problems, verdict", [
    ([], 0, [], model.PASS), (["x: no case verified"], 0, [], model.NO_CASES),
    (["x: no case verified"], 1, [], model.FAIL), ([], 0, ["pytest ended with exit status 3"], model.FAIL)])
def test_the_verdict_is_pass_only_with_every_target_verified_and_nothing_wrong(unverified, failures, problems, verdict):
    assert model.verdict(failures=failures, problems=problems, unverified=unverified) == verdict


def test_targets_asked_for_without_a_case_are_named():
    records = [record("c0")]
    asked = {"toy_attention-builtin-xla": "its tests: 1 passed", "toy_attention-lse-xla": "its tests: 2 skipped"}
    assert model.unverified_targets(records, asked) == [
        "toy_attention-lse-xla: no case verified (its tests: 2 skipped)"]
    assert model.unverified_targets(records, {})[0].startswith("no gate test was selected")


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


def test_the_budget_history_of_a_report_directory_feeds_the_trend(tmp_path, monkeypatch):
    """Each complete run written to a directory adds its worst budgets to the history (a
    re-merge of the same run replaces its line, an interrupted run adds none, the file keeps
    the last MAX_RUNS); the trend draws the earlier runs, never this one."""
    runs = [(f"2026010{i}T0000001234", budget) for i, budget in enumerate((0.1, 0.2, 0.3, 0.4))]
    for run_id, budget in runs[:3]:
        render.write(tmp_path, report_of([record("c0", budget=budget)], run_id=run_id))
    render.write(tmp_path, report_of([record("c0", budget=0.3)], run_id=runs[2][0]))  # merged again
    render.write(tmp_path, report_of([record("c0", budget=0.9)], run_id="interrupted", complete=False))
    entries = history.read(tmp_path)
    assert [(e.run_id, e.budgets["toy_attention/builtin/xla/float32/out"]) for e in entries] == runs[:3]
    with open(tmp_path / history.HISTORY_FILE, "a", encoding="utf-8") as fh:
        fh.write('{"run_id": "torn line"\n')  # never a verdict's business: left out of the chart
    run_id, budget = runs[3]
    for _ in range(2):  # written by its run, then merged again (attncheck report): never its own past
        render.write(tmp_path, report_of([record("c0", budget=budget)], run_id=run_id))
        trend = re.search(r'<svg[^>]*class="plot trend".*?</svg>', (tmp_path / "report.html").read_text()).group(0)
        drawn = re.findall(r'<circle class="past"[^>]*><title>[^<]*: run (\S+) ([\d.]+)</title>', trend)
        assert drawn == [(r, f"{b:.3g}") for r, b in runs[:3]]  # earlier runs only, oldest first
        assert "against the last 3 runs" in trend and "this run 0.4, new" in trend
    assert [e.run_id for e in history.read(tmp_path)] == [r for r, _ in runs]
    monkeypatch.setattr(history, "MAX_RUNS", 2)
    render.write(tmp_path, report_of([record("c0")], run_id="20260109T0000001234"))
    assert [e.run_id for e in history.read(tmp_path)] == [runs[3][0], "20260109T0000001234"]
