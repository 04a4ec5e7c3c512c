"""tokamax through the families it fits. Its dot_product_attention: the Pallas path
(mosaic_tpu) verified in interpret mode with the configurations it refuses declared and
counted, its XLA path with its padded-rows finding declared, and its default (which falls
back to XLA off a TPU) never credited to an interpret backend. Its splash rewrite through
splash_attention_config on every backend, each of its findings a declared deviation that
occurs. Skipped, with the reason, where tokamax
is not installed (``pip install 'attncheck[third-party]'``)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from attncheck import third_party
from attncheck.check import UNSUPPORTED_BY_IMPLEMENTATION

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPECTATIONS = ROOT / "tests" / "third_party" / "tokamax.toml"
FAMILY = "dot_product_attention"
MOSAIC = "attncheck.third_party.tokamax:dot_product_attention_mosaic"
XLA = "attncheck.third_party.tokamax:dot_product_attention_xla"
SPLASH = "attncheck.third_party.tokamax:make_splash_mha"


@pytest.fixture(scope="module", autouse=True)
def tokamax():
    from attncheck.third_party import tokamax
    try:
        return tokamax.load()
    except third_party.Unavailable as exc:
        pytest.skip(f"tokamax is not available here: {exc}")


def _gate(report: pathlib.Path, impl: str, backend: str | None, *args: str, family: str = FAMILY):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_STEP_SUMMARY"))}
    env["PYTHONPATH"] = str(ROOT)
    backends = ("--attncheck-backend", backend) if backend else ()
    proc = subprocess.run([sys.executable, "-m", "attncheck", "gate", "--attncheck-kernel", family,
                           "--attncheck-impl", f"{family}={impl}", *backends, "--attncheck-report", str(report),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    return proc, json.loads((report / "report.json").read_text())


def test_the_pallas_path_passes_on_interpret_with_its_refusals_declared_and_counted(tmp_path):
    proc, report = _gate(tmp_path / "declared", MOSAIC, "interpret", "--attncheck-expectations", str(EXPECTATIONS))
    assert proc.returncode == 0 and report["verdict"] == "PASS", (proc.stdout + proc.stderr)[-3000:]
    records = report["records"]
    verified = {r["case_id"] for r in records if r["outcome"] == "pass"}
    refused = {r["case_id"] for r in records if (r.get("reason") or "").startswith(UNSUPPORTED_BY_IMPLEMENTATION)}
    assert len(verified) >= 10 and refused and not verified & refused
    # Every case it ran was fitted to its tiles of 128.
    assert all(r["case"]["params"]["q_len"] % 128 == 0 == r["case"]["params"]["kv_len"] % 128 for r in records)

    proc, report = _gate(tmp_path / "undeclared", MOSAIC, "interpret")
    assert proc.returncode != 0 and report["verdict"] == "FAIL", (proc.stdout + proc.stderr)[-3000:]


def test_the_xla_path_shows_its_padded_rows_finding(tmp_path):
    proc, report = _gate(tmp_path / "declared", XLA, "xla", "--attncheck-expectations", str(EXPECTATIONS))
    assert proc.returncode == 0 and report["verdict"] == "PASS", (proc.stdout + proc.stderr)[-3000:]
    q_padding = [d for d in report["deviations"] if d["entry"]["implementation"] == XLA
                 and d["entry"]["name"] == "q_padding"]
    assert [d["status"] for d in q_padding] == ["occurs"] and q_padding[0]["shown"] > 0, q_padding

    proc, report = _gate(tmp_path / "undeclared", XLA, "xla", "-k", "matches_oracle")
    failing = [r for r in report["records"] if r["outcome"] == "fail"]
    assert report["verdict"] == "FAIL" and failing and all("q_padding" in r["classes"] for r in failing)


def test_tokamax_default_falls_back_to_xla_and_is_not_credited_to_interpret(tmp_path):
    proc, report = _gate(tmp_path / "default", "tokamax:dot_product_attention", "interpret", "-k", "matches_oracle")
    assert proc.returncode != 0 and report["verdict"] != "PASS", (proc.stdout + proc.stderr)[-3000:]
    assert not [r for r in report["records"] if r["outcome"] == "pass"]
    assert any("no Pallas kernel ran on interpret" in (r.get("reason") or "") for r in report["records"])


def test_splash_passes_on_every_backend_with_its_findings_declared(tmp_path):
    proc, report = _gate(tmp_path / "declared", SPLASH, None, "--attncheck-expectations", str(EXPECTATIONS),
                         "--attncheck-require-coverage", family="splash_attention_config")
    assert proc.returncode == 0 and report["verdict"] == "PASS", (proc.stdout + proc.stderr)[-3000:]
    ran = {r["backend"] for r in report["records"] if r["outcome"] == "pass"}
    assert {"interpret", "interpret-hazards", "tpu-lower"} <= ran, ran
    declared = {d["entry"]["name"]: d["status"] for d in report["deviations"] if d["entry"]["implementation"] == SPLASH}
    assert declared == dict.fromkeys(("diag_skip_over_visible_keys", "forward_nan_rows_reach_backward",
                                      "every_key_hidden", "kv_longer_than_mask", "base2_exp_large_bf16_logits"),
                                     "occurs"), declared

    proc, report = _gate(tmp_path / "undeclared", SPLASH, "interpret", "-k", "matches_oracle",
                         family="splash_attention_config")
    failing = {c for r in report["records"] if r["outcome"] in ("fail", "error") for c in r["classes"]}
    assert report["verdict"] == "FAIL" and {"diag_skip_over_visible_keys", "forward_nan_rows_reach_backward",
                                            "every_key_hidden", "base2_exp_large_bf16_logits"} <= failing, (
        sorted(failing))
