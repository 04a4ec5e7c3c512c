"""Declared deviations (attncheck.expectations): a kernel that knowingly deviates adopts the
gate with one command and stays strict on everything else; a stale entry and an entry that
names nothing fail loudly."""

from __future__ import annotations

import numpy as np
import pytest

from attncheck import check, coverage, expectations, specs
from attncheck.backends import BACKENDS
from attncheck.expectations import BUG_CLASS, CONTRACT, INVALID_CALL, Expectation
from tests.selftest import chaos, harness

DEVIATES = "tests.selftest.chaos:deviates_on_causal"


def gate(pytester, *args):
    return harness.run_gate(pytester, "rep", f"--attncheck-impl=toy_attention={DEVIATES}", *args)


def test_a_deviating_kernel_adopts_the_gate_with_one_command_and_stays_strict(gate_dir, pytester, monkeypatch):
    # Red on day one: its causal cases and one invalid call.
    assert gate(pytester).ret == pytest.ExitCode.TESTS_FAILED
    assert harness.load_report(gate_dir / "rep")["verdict"] == "FAIL"
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

    from kernels.ragged_paged_attention import ragged_paged_attention

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
