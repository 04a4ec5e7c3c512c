"""Declared deviations (attncheck.expectations): a kernel that knowingly deviates adopts the
gate with one command and stays strict on everything else; a stale entry and an entry that
names nothing fail loudly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attncheck import check, coverage, expectations, specs
from attncheck.backends import BACKENDS
from attncheck.expectations import BUG_CLASS, CONTRACT, INVALID_CALL, CaseEvidence, Expectation
from tests.selftest import chaos, harness

DEVIATES = "tests.selftest.chaos:deviates_on_causal"


def gate(pytester, *args):
    return harness.run_gate(pytester, "rep", f"--attncheck-impl=toy_attention={DEVIATES}", *args)


def test_a_deviating_kernel_adopts_the_gate_with_one_command_and_stays_strict(gate_dir, pytester, monkeypatch):
    # Red on day one: its causal cases and one invalid call.
    assert gate(pytester).ret == pytest.ExitCode.TESTS_FAILED
    bare = harness.load_report(gate_dir / "rep")
    assert bare["verdict"] == "FAIL"
    init = harness.cli(gate_dir, "expectations", "init", "--report", "rep")
    assert init.returncode == 0, init.stdout + init.stderr
    table = expectations.read(gate_dir / "pyproject.toml")
    assert {(e.kind, e.name, e.implementation) for e in table} == {
        (BUG_CLASS, "causal", DEVIATES), (INVALID_CALL, "kv_head_dim", DEVIATES)}, init.stdout
    assert all(e.reason.startswith("TODO") for e in table) and "bug class causal" in init.stdout
    # Green with the table, which the gate reads from the root directory's pyproject.toml.
    result = gate(pytester)
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "PASS" and report["totals"]["deviations"] > 0
    # The cases init read are the adopted run's: no deviation it declares nothing for waits
    # in a case the red run never drew.
    assert sorted(r["case_id"] for r in report["records"]) == sorted(r["case_id"] for r in bare["records"])
    assert {(d["entry"]["name"], d["status"]) for d in report["deviations"]} == {("causal", "occurs"),
                                                                                ("kv_head_dim", "occurs")}
    expected = [r for r in report["records"] if "expected" in r]
    assert expected and all("causal" in r["classes"] and r["outcome"] == "fail" for r in expected)
    assert any(r["outcome"] == "pass" and "causal" not in r["classes"] for r in report["records"])
    assert "## Declared deviations" in (gate_dir / "rep" / "report.md").read_text()
    # Strict on the rest: a bug the table does not declare still fails, on the cases it breaks.
    monkeypatch.setenv(chaos.PLANT_ENV, "1")
    assert gate(pytester).ret == pytest.ExitCode.TESTS_FAILED
    records = harness.load_report(gate_dir / "rep")["records"]
    failing = [r for r in records if r["outcome"] != "pass" and "expected" not in r]
    assert failing and all(r["dtype"] == "bfloat16" and "causal" not in r["classes"] for r in failing)


def test_an_entry_whose_deviation_no_longer_occurs_fails_the_gate(gate_dir, pytester):
    """The table of a kernel that was since fixed (here: the family's correct one)."""
    fixed = "tests.selftest.toy_spec:toy_attention"
    table = gate_dir / "declared.toml"
    table.write_text(expectations.toml([Expectation("toy_attention", fixed, BUG_CLASS, "causal", "scale twice"),
                                        Expectation("toy_attention", fixed, INVALID_CALL, "rank", "accepted it")],
                                       pyproject=False))
    result = harness.run_gate(pytester, "rep", f"--attncheck-impl=toy_attention={fixed}",
                              f"--attncheck-expectations={table}")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    report = harness.load_report(gate_dir / "rep")
    stale = sorted(p for p in report["problems"] if p.startswith("stale expectation"))
    assert len(stale) == 2 and "bug class causal" in stale[0] and "invalid call rank" in stale[1], report["problems"]
    assert {d["entry"]["name"]: d["status"] for d in report["deviations"]} == {"causal": "stale", "rank": "stale"}


def test_attncheck_gate_reads_the_projects_table_with_option_values_given_apart(gate_dir, tmp_path_factory):
    """pytest picks its root directory from the command line's paths before it knows
    attncheck's options: ``--attncheck-report DIR`` (an existing directory outside the
    project) made DIR the project in every worker, and the pyproject.toml table went unread
    (the run failed on the deviations it declares)."""
    (gate_dir / "pyproject.toml").write_text(expectations.toml([
        Expectation("toy_attention", DEVIATES, BUG_CLASS, "causal", "scales causal rows twice"),
        Expectation("toy_attention", DEVIATES, INVALID_CALL, "kv_head_dim", "accepts it")], pyproject=True))
    reports = tmp_path_factory.mktemp("reports")  # an earlier run's
    proc = harness.cli(gate_dir, "gate", *harness.GATE_ARGS[2:], "--attncheck-impl", f"toy_attention={DEVIATES}",
                       "--attncheck-report", str(reports), "-n", "1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"rootdir: {gate_dir}" in proc.stdout
    assert harness.load_report(reports)["verdict"] == "PASS"


def _status(*cases):
    """Each declared deviation's status over records of these (case, {entry: shown}) pairs."""
    from attncheck.report import model
    from tests.selftest import test_report

    records = [dataclasses.replace(test_report.record(case, outcome="fail" if any(marks.values()) else "pass"),
                                   deviations=marks) for case, marks in cases]
    entries = tuple(Expectation("toy_attention", "pkg.mod:fn", BUG_CLASS, name, "r") for name in ("causal", "bf16"))
    ids = {e.name: e.id for e in entries}
    records = [dataclasses.replace(r, deviations={ids[n]: shown for n, shown in r.deviations.items()})
               for r in records]
    return {d.entry.name: (d.status, d.shown) for d in model.deviation_statuses(records, [], entries)}


def test_an_entry_whose_failing_cases_a_confirmed_entry_explains_is_stale():
    """A crash marks every whole-case entry of its case: an entry that never fails alone,
    where another shows alone elsewhere, has shown nothing of its own."""
    assert _status(("f32", {"causal": True}), ("bf16", {"causal": True, "bf16": True}),
                   ("bf16 plain", {"bf16": False})) == {"causal": ("occurs", 2), "bf16": ("stale", 0)}
    # Where no entry shows alone, a case cannot tell them apart: both stand.
    assert _status(("bf16", {"causal": True, "bf16": True})) == {"causal": ("occurs", 1), "bf16": ("occurs", 1)}


def _evidence(case: str, outcome: str, classes: list[str], *, family: str = "f", numerics: bool = True,
              contracts: tuple[str, ...] = ()) -> CaseEvidence:
    return CaseEvidence(family, "m:f", case, frozenset(classes), numerics=numerics, excused=False,
                        failing=(frozenset(contracts),) if outcome == "fail" else (), repro=f"attncheck repro {case}")


def test_init_declares_the_class_that_fails_wherever_it_occurs_and_ignores_lowering():
    # Every case fails: "broad" is in all of them and would explain them in one entry that
    # hides whatever else breaks them; "narrow" and "lowered" each in two (a lowering-only
    # pass of "lowered" proves nothing about its numerics).
    cases = [_evidence("c1", "fail", ["broad", "narrow", "lowered"]), _evidence("c2", "fail", ["broad", "narrow"]),
             _evidence("c4", "pass", ["lowered"], numerics=False), _evidence("c5", "fail", ["broad", "lowered"])]
    explained = expectations.explaining(cases, [], cells={})
    assert sorted(explained.entries) == [("f", "m:f", BUG_CLASS, "lowered"), ("f", "m:f", BUG_CLASS, "narrow")]
    assert explained.unexplained == ()
    # A specific class picked first whose every failing case a broader pick also explains
    # (and that one fails alone elsewhere): the gate would call it stale, so it is left out.
    cases = [_evidence("x", "fail", ["empty_seq"]), _evidence("y", "fail", ["partial", "compact"]),
             _evidence("z", "fail", ["partial", "compact"]), _evidence("w", "fail", ["compact"])]
    explained = expectations.explaining(cases, [], cells={})
    assert sorted(explained.entries) == [("f", "m:f", BUG_CLASS, "compact"), ("f", "m:f", BUG_CLASS, "empty_seq")]


def test_init_declares_a_class_stated_for_its_behaviour_before_a_cell_or_a_pair_of_cells():
    """A pair of cells and a scale's cell occur in fewer cases than the behaviour's class, by
    which coverage example happens to carry them; declaring them would name no behaviour."""
    flash = "flash_attention"
    cases = [_evidence("a", "fail", ["bias_neg_inf_row_empty", "causal_on__kv_blocks_several"], family=flash),
             _evidence("b", "fail", ["bias_neg_inf_row_empty", "sm_scale_zero"], family=flash),
             _evidence("d", "pass", ["causal"], family=flash)]
    cells = specs.cell_classes()
    assert {"causal_on__kv_blocks_several", "sm_scale_zero"} <= cells[flash]
    assert "bias_neg_inf_row_empty" not in cells[flash]
    explained = expectations.explaining(cases, [], cells=cells)
    assert explained.entries == ((flash, "m:f", BUG_CLASS, "bias_neg_inf_row_empty"),) and not explained.unexplained


def test_init_declares_a_contract_that_holds_a_failure_and_an_invalid_call_by_its_entry_and_names_the_rest():
    cases = [_evidence("p", "fail", ["padded"], contracts=("rows_of_no_sequence",)),
             _evidence("q", "fail", ["odd"]), _evidence("r", "pass", ["odd"])]
    explained = expectations.explaining(cases, [("f", "m:f", "q_len_gt_kv_len")], cells={})
    assert explained.entries == (("f", "m:f", CONTRACT, "rows_of_no_sequence"), ("f", "m:f", INVALID_CALL,
                                                                                  "q_len_gt_kv_len"))
    assert [c.case_id for c in explained.unexplained] == ["q"]


@pytest.mark.parametrize("entry, message", [
    ('family = "toy_attention"\nimplementation = "x:y"\nbug_class = "noncausal"\nreason = "r"',
     r"has no bug class 'noncausal' that can be declared \(known: causal, bf16\)"),
    ('family = "nope"\nimplementation = "x:y"\nbug_class = "causal"\nreason = "r"', r"no family 'nope'"),
    ('family = "toy_attention"\nimplementation = "x:y"\nbug_class = "causal"', r"reason missing or empty"),
    ('family = "toy_attention"\nimplementation = "x:y"\nbug_class = "causal"\ncontract = "c"\nreason = "r"',
     r"expected exactly one of bug_class, invalid_call, contract"),
    (f'family = "toy_attention"\nimplementation = "{DEVIATES}"\ninvalid_call = "shape"\nreason = "r"',
     r"no invalid call 'shape' that can be declared \(known: rank, kv_head_dim\)"),
])
def test_an_entry_that_names_nothing_the_family_has_is_a_usage_error(gate_dir, pytester, entry, message):
    (gate_dir / "pyproject.toml").write_text(f"[[tool.attncheck.expect]]\n{entry}\n")
    result = gate(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.re_match_lines([rf".*--attncheck-expectations: .*pyproject\.toml.*{message}.*"])


def padding_rows_nan(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
    """The family's own ragged kernel with NaN in the rows past the last sequence, which its
    padding_rows_are_zero contract asks to be zeros."""
    import jax.numpy as jnp

    from attncheck_kernels.ragged_paged_attention import ragged_paged_attention

    out = ragged_paged_attention(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)
    padding = jnp.arange(out.shape[0]) >= cu_q_lens[num_seqs[0]]
    return jnp.where(padding[:, None, None], jnp.nan, out)


def test_a_contract_declared_not_promised_drops_its_elements_and_nothing_else():
    spec = specs.all_specs()["ragged_paged_attention"]
    case = next(c for c in coverage.examples(spec) if "rows_past_the_last_sequence" in spec.classes(c))
    ref = f"{__name__}:padding_rows_nan"
    declared = (Expectation(spec.name, ref, CONTRACT, "padding_rows_are_zero", "NaN there, as jax's kernel"),)

    def records(expected):
        target = check.Target(spec, "user", padding_rows_nan, BACKENDS["interpret"], expected, ref)
        return check.check_case(target, case).records

    strict = records(())
    assert [r.outcome for r in strict] == ["fail"] and strict[0].contracts_broken == ("padding_rows_are_zero",)
    [judged] = records(declared)
    assert judged.passed and judged.deviations == {declared[0].id: True}, judged.reason
    assert np.isfinite(judged.metrics.max_abs)  # the rest of the output is judged, and right


def test_a_configuration_declared_unsupported_is_listed_never_passed_and_leaves_its_class_a_hole(gate_dir, pytester):
    refuses = "tests.selftest.chaos:refuses_causal"
    args = (f"--attncheck-impl=toy_attention={refuses}", "--attncheck-backend=xla")
    # Undeclared, a refusal is an error like any crash.
    assert harness.run_gate(pytester, "rep", *args).ret == pytest.ExitCode.TESTS_FAILED
    table = gate_dir / "declared.toml"
    table.write_text(expectations.toml([Expectation("toy_attention", refuses, expectations.UNSUPPORTED,
                                                    r"causal masking is not supported", "it tiles no causal mask")],
                                       pyproject=False))
    result = harness.run_gate(pytester, "rep", *args, f"--attncheck-expectations={table}")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    report = harness.load_report(gate_dir / "rep")
    refused = [r for r in report["records"] if r["outcome"] != "pass"]
    assert refused and all(r["case"]["params"]["causal"] and r["direction"] == "all" and r["outcome"] == "error"
                           and r["reason"] == f"unsupported by the implementation: NotImplementedError: "
                                              f"{chaos.REFUSAL} (got causal=True)" for r in refused)
    assert all(not r["case"]["params"]["causal"] for r in report["records"] if r["outcome"] == "pass")
    entry = f"{refuses}/unsupported:causal masking is not supported"
    line, = report["limitations"]
    assert line.startswith(f"xla: toy_attention/user: {len({r['case_id'] for r in refused})} case(s) not run, "
                           f"unsupported by the implementation as declared by {entry} (classes: ") and "causal " in line
    assert [d["status"] for d in report["deviations"]] == ["occurs"]
    assert report["coverage"]["toy_attention"]["causal"]["cases"] == 0  # a refused case exercised nothing
    # A class refused in every case is a coverage hole.
    result = harness.run_gate(pytester, "rep", *args, f"--attncheck-expectations={table}",
                              "--attncheck-require-coverage")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    problems = harness.load_report(gate_dir / "rep")["problems"]
    assert any(p.startswith("coverage: toy_attention never exercised") and "causal" in p for p in problems), problems


def test_an_unsupported_entry_is_a_regular_expression_and_only_a_refusal_matches_it():
    with pytest.raises(expectations.ExpectationError, match=r"unsupported must be a regular expression .* "
                                                            r"'\(unclosed' is not one"):
        expectations.validate([Expectation("toy_attention", "m:f", expectations.UNSUPPORTED, "(unclosed", "why")],
                              specs.all_specs() | {"toy_attention": object()}, lambda spec, ref: [])
    entry = Expectation("toy_attention", "m:f", expectations.UNSUPPORTED, "block .* should divide", "why")
    refusal = ValueError("block 128 should divide 6")
    assert expectations.refusal([entry], [refusal]) == (entry, "ValueError: block 128 should divide 6")
    assert expectations.refusal([entry], [RuntimeError("block 128 should divide 6")]) is None  # not a refusal
    assert expectations.refusal([entry], [ValueError("q must have rank 4")]) is None  # not the declared one


def test_a_run_whose_every_case_was_refused_verified_nothing(gate_dir, pytester):
    refuses = "tests.selftest.chaos:refuses_everything"
    table = gate_dir / "declared.toml"
    table.write_text(expectations.toml([Expectation("toy_attention", refuses, expectations.UNSUPPORTED,
                                                    r"not supported", "it runs nothing")], pyproject=False))
    result = harness.run_gate(pytester, "rep", f"--attncheck-impl=toy_attention={refuses}", "--attncheck-backend=xla",
                              f"--attncheck-expectations={table}")
    assert result.ret != pytest.ExitCode.OK
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] != "PASS" and report["records"]
    assert all(r["reason"].startswith("unsupported by the implementation: ") for r in report["records"])
    unverified, = report["unverified"]
    assert unverified.startswith("toy_attention-user-xla: no case verified"), unverified
