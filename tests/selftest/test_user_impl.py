"""--attncheck-impl runs a family's whole gate against any implementation of its convention."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from attncheck import selection, specs

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUNDLED_FLASH = "jax.experimental.pallas.ops.tpu.flash_attention:flash_attention"


# The promises of this repository's flash kernel (its docstring) that jax's bundled kernel
# does not make, each a bug class of the family: NaN or +inf in ab where the mask hides the
# key poisons its rows, a row whose ab is all -inf is NaN, and a causal row of an absent
# segment averages the blocks it visits. Anything else it must pass.
BUNDLED_FLASH_FINDINGS = {"bias_nonfinite_where_masked", "bias_neg_inf", "causal_absent_rows_skip_blocks"}


def run_gate(tmp_path, *args, profile: str = "dev"):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "GITHUB_STEP_SUMMARY"))}
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "attncheck.gate", "-q", "-p", "no:cacheprovider",
           f"--hypothesis-profile={profile}", "--attncheck-report", str(tmp_path), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc, json.loads((tmp_path / "report.json").read_text())


def test_jax_bundled_flash_attention_fails_the_flash_gate_only_on_the_promises_it_does_not_make(tmp_path):
    proc, report = run_gate(tmp_path, "-k", "matches", "--attncheck-kernel", "flash_attention",
                            "--attncheck-backend", "interpret", "--attncheck-impl", f"flash_attention={BUNDLED_FLASH}",
                            profile="ci")
    assert proc.returncode != 0 and report["verdict"] == "FAIL", proc.stdout[-3000:]
    assert {(r["impl"], r["impl_ref"]) for r in report["records"]} == {("user", BUNDLED_FLASH)}
    failing = [r for r in report["records"] if r["outcome"] != "pass"]
    assert all(BUNDLED_FLASH_FINDINGS & set(r["classes"]) for r in failing), [
        (r["case_id"], r["classes"], r["reason"][:200]) for r in failing if not BUNDLED_FLASH_FINDINGS & set(r["classes"])]
    assert set().union(*(set(r["classes"]) for r in failing)) >= BUNDLED_FLASH_FINDINGS
    passing = [r for r in report["records"] if r["outcome"] == "pass"]
    assert len({r["case_id"] for r in passing}) >= 5 and {"out", "dq", "dk", "dv", "dab"} <= {r["direction"] for r in passing}


def test_unknown_family_or_bad_reference_is_a_clear_usage_error(tmp_path):
    for bad, message in (("nope=kernels.flash_attention:flash_attention", "FAMILY one of"),
                         ("flash_attention=no_colon", "package.module:function")):
        proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "attncheck.gate", "-q", "--co",
                               "--attncheck-report", str(tmp_path), "--attncheck-impl", bad],
                              cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode != 0 and message in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]


def test_the_invalid_calls_are_built_for_a_user_implementation():
    tests = selection.invalid_input_tests(selection.Options(kernels="flash_attention",
                                                            impls=(f"flash_attention={BUNDLED_FLASH}",)))
    assert tests and all(t.call is not None and t.impl_name == "user" for t in tests), [t.unbuilt for t in tests]


def test_invalid_calls_that_cannot_be_built_are_one_failing_test_not_a_collection_error(monkeypatch):
    spec = specs.all_specs()["flash_attention"]

    def lacks_a_helper(impl):
        raise AttributeError("module 'theirs' has no attribute 'BlockSizes'")

    monkeypatch.setattr(spec, "invalid_calls", lacks_a_helper)
    tests = selection.invalid_input_tests(selection.Options(kernels="flash_attention"))
    assert [(t.id, t.call, t.unbuilt) for t in tests] == [
        ("flash_attention-builtin-invalid_calls", None, "AttributeError: module 'theirs' has no attribute 'BlockSizes'")]
