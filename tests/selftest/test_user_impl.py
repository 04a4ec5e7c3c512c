"""--attncheck-impl runs a family's whole gate against any implementation of its convention."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUNDLED_FLASH = "jax.experimental.pallas.ops.tpu.flash_attention:flash_attention"


def run_gate(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "GITHUB_STEP_SUMMARY"))}
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "attncheck.gate", "-q", "-p", "no:cacheprovider",
           "--hypothesis-profile=dev", "--attncheck-report", str(tmp_path), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc, json.loads((tmp_path / "report.json").read_text())


def test_jax_bundled_flash_attention_passes_the_flash_gate(tmp_path):
    proc, report = run_gate(tmp_path, "-k", "matches", "--attncheck-kernel", "flash_attention",
                            "--attncheck-backend", "interpret", "--attncheck-impl", f"flash_attention={BUNDLED_FLASH}")
    assert proc.returncode == 0, proc.stdout[-3000:]
    impls = {(r["impl"], r["impl_ref"]) for r in report["records"]}
    assert impls == {("user", BUNDLED_FLASH)}
    assert report["totals"]["cases"] >= 5 and report["totals"]["failures"] == 0
    directions = {r["direction"] for r in report["records"]}
    assert {"out", "dq", "dk", "dv"} <= directions


def test_unknown_family_or_bad_reference_is_a_clear_usage_error(tmp_path):
    for bad, message in (("nope=kernels.flash_attention:flash_attention", "FAMILY one of"),
                         ("flash_attention=no_colon", "package.module:function")):
        proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "attncheck.gate", "-q", "--co",
                               "--attncheck-report", str(tmp_path), "--attncheck-impl", bad],
                              cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode != 0 and message in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
