"""The ragged paged attention v3 family on tpu-inference's kernel, fetched from its pinned
wheel: the kernel passes the family's windowed example on the interpret backends, and each
planted bug of the classes its known issues belong to fails it (tpu-inference #1169: the
first kv block of a windowed sequence taken as 0; sglang-jax #1606: the new K/V not written
into the cache when a sliding window is set, while the output stays right). Skipped, with
the reason, where the registry cannot be reached."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types
import zipfile

import pytest

from attncheck import backends, check, third_party
from attncheck.specs.ragged_v3.params import FAMILY
from attncheck.specs.ragged_v3.spec import SPEC
from attncheck.third_party import tpu_inference

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL = "tpu_inference/kernels/ragged_paged_attention/v3/kernel.py"
IMPL = "attncheck.third_party.tpu_inference:ragged_paged_attention_v3"
# The deviations of the shipped kernel, declared (the nightly runs with them too).
EXPECTATIONS = ROOT / "tests" / "third_party" / "tpu_inference.toml"
# Planted bug -> (the line as the wheel ships it, the line with the bug).
PLANTED = {
    "first_kv_block_of_a_window_taken_as_0": (
        "cur_seq_start_bkv_idx = jnp.maximum(kv_q_gap - sliding_window,",
        "cur_seq_start_bkv_idx = 0 * jnp.maximum(kv_q_gap - sliding_window,"),
    "new_kv_not_written_with_a_window": (
        "                if update_kv_cache:\n\n                    @pl.when(",
        "                if update_kv_cache and sliding_window is None:\n\n                    @pl.when("),
}


@pytest.fixture(scope="module")
def wheel():
    try:
        return third_party.fetch_wheel(tpu_inference.PIN)
    except third_party.Unavailable as exc:
        pytest.skip(f"tpu-inference's wheel is not available here: {exc}")


def _kernel_with(wheel, planted: str | None):
    """The wheel's v3 kernel function, with one planted bug (None: as shipped)."""
    shipped = tpu_inference.module("kernel")
    if planted is None:
        return shipped.ragged_paged_attention
    source = zipfile.ZipFile(wheel).read(KERNEL).decode()
    line, bug = PLANTED[planted]
    assert source.count(line) == 1, f"the wheel's kernel no longer holds {line!r}"
    module = types.ModuleType(f"{shipped.__name__}_{planted}")
    exec(third_party.rewrite_imports(source.replace(line, bug), f"{KERNEL} ({planted})", "tpu_inference",
                                     tpu_inference.PACKAGE), module.__dict__)
    return module.ragged_paged_attention


def _records(impl, backend: str):
    case = SPEC.explicit_examples["window_starts_past_first_kv_block"]
    target = check.Target(SPEC, "user", impl, backends.BACKENDS[backend])
    return {r.direction: r for r in check.check_case(target, case).records}


@pytest.mark.parametrize("backend", ["interpret", "interpret-hazards"])
def test_the_shipped_kernel_passes_the_windowed_example(wheel, backend):
    records = _records(_kernel_with(wheel, None), backend)
    assert set(records) == {"out", "kv_cache"}
    assert all(r.passed for r in records.values()), {d: r.reason for d, r in records.items()}


def test_a_first_kv_block_taken_as_0_fails_the_output(wheel):
    records = _records(_kernel_with(wheel, "first_kv_block_of_a_window_taken_as_0"), "interpret")
    assert records["out"].failing, records["out"].reason


def test_new_kv_not_written_with_a_window_fails_the_cache_while_the_output_passes(wheel):
    records = _records(_kernel_with(wheel, "new_kv_not_written_with_a_window"), "interpret")
    # The slots the new tokens belong to still hold the NaN they held before the call.
    assert records["kv_cache"].failing and "NaN positions differ" in records["kv_cache"].reason
    assert records["out"].passed, records["out"].reason


def test_the_gate_on_the_shipped_kernel_passes_with_its_deviations_declared_and_fails_without(wheel, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_STEP_SUMMARY"))}
    env["PYTHONPATH"] = str(ROOT)

    def gate(report, *args):
        proc = subprocess.run([sys.executable, "-m", "attncheck", "gate", "--attncheck-kernel", FAMILY,
                               "--attncheck-impl", f"{FAMILY}={IMPL}", "--attncheck-report", str(report),
                               "--attncheck-require-coverage", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=1200)
        return proc, json.loads((report / "report.json").read_text())

    proc, report = gate(tmp_path / "declared", "--attncheck-expectations", str(EXPECTATIONS))
    assert proc.returncode == 0 and report["verdict"] == "PASS", (proc.stdout + proc.stderr)[-3000:]
    verified = {r["case_id"] for r in report["records"] if r["outcome"] == "pass" and r["backend"] != "tpu-lower"}
    assert len(verified) >= 30 and {r["backend"] for r in report["records"]} >= {
        "interpret", "interpret-hazards", "tpu-lower"}
    assert not [r for r in report["records"] if "unsupported by interpret mode" in (r.get("reason") or "")]
    proc, report = gate(tmp_path / "undeclared", "-k", "invalid")
    assert proc.returncode != 0 and report["verdict"] == "FAIL", (proc.stdout + proc.stderr)[-3000:]


def test_the_hd64_kernel_is_verified_on_its_head_dim_with_its_deviations_declared(wheel, tmp_path):
    # kernel_hd64.py takes head_dim 64 alone (its Domain): the draws are set to it. Its
    # distribution_decreasing call does not return (the watchdog would end the worker).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_STEP_SUMMARY"))}
    env["PYTHONPATH"] = str(ROOT)
    report_dir = tmp_path / "hd64"
    proc = subprocess.run([sys.executable, "-m", "attncheck", "gate", "--attncheck-kernel", FAMILY,
                           "--attncheck-impl", f"{FAMILY}={IMPL}_hd64", "--attncheck-backend", "interpret",
                           "--attncheck-expectations", str(EXPECTATIONS), "--attncheck-report", str(report_dir),
                           "-k", "coverage or invalid and not distribution_decreasing"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    report = json.loads((report_dir / "report.json").read_text())
    assert proc.returncode == 0 and report["verdict"] == "PASS", (proc.stdout + proc.stderr)[-3000:]
    ran = [r for r in report["records"] if r["outcome"] == "pass"]
    assert len({r["case_id"] for r in ran}) >= 10
    assert {r["case"]["params"]["head_dim"] for r in ran} == {64}
    assert {r["case"]["params"]["out_dtype"] for r in ran} == {None}


# Two cases of hd64 back to back in one worker (the second one's last sequence shortened to
# one token): the pair on which the second call of the compiled kernel hung.
_BACK_TO_BACK = '''
import sys
from attncheck import env
env.configure()
from attncheck import check
from attncheck.specs.ragged_v3.spec import SPEC
params = dict(blocks="default", chunk_prefill_size=None, distribution=(1, 1, 4), dtype="bfloat16", head_dim=64,
              k_scale=0.3, kv_dtype="float8_e4m3fn", layout="wide", mask_value=-1e30, num_kv_heads=1, num_q_heads=4,
              out_dtype=None, page_size=16, q_scale=1.3, sliding_window=None, sm_scale=-0.5, soft_cap=0.7,
              v_scale=0.7, values="normal", vmem_limit_bytes=None)
target = check.Target.named(SPEC, "user", sys.argv[1], "interpret-hazards", ())
for last in ((18, 31), (1, 1)):
    case = SPEC.case(131, **params, seqs=((1, 29), (27, 131), (6, 27), last))
    records = check.check_case(target, case).records
    print(last, sorted((r.direction, r.passed) for r in records), [r.reason for r in records if not r.passed],
          flush=True)
'''


def test_the_hd64_adapter_returns_on_a_second_call_of_its_compiled_kernel(wheel):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | {"PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run([sys.executable, "-c", _BACK_TO_BACK, f"{IMPL}_hd64"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the second call did not return in 300 s; it printed: {exc.stdout}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [f"{last} [('kv_cache', True), ('out', True)] []"
                                        for last in ("(18, 31)", "(1, 1)")], proc.stdout
