"""benchmarks/gate_bench.py renders its bench.json as the Markdown page the docs link to
(docs/measured.md): every figure from the file, none typed. On a tiny literal bench.json,
without running a gate."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("gate_bench", ROOT / "benchmarks" / "gate_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PHASES = {"inputs_s": 12.0, "inputs_compile_s": 2.0, "kernel_s": 300.0, "kernel_compile_s": 240.0, "lower_s": 20.0,
          "oracle_s": 30.0, "yardstick_s": 25.0, "yardstick_compile_s": 20.0, "compare_s": 3.0}
BENCH = {
    "meta": {"commit": "abc1234", "date": "2026-12-04", "cpus": 2, "args": ["--shards", "2", "--soak", "2"]},
    "runs": [
        {"run": "nauto-cold", "mode": "auto", "cache": "cold", "exit_code": 1, "hung": False, "wall_s": 951.0,
         "cpu_s": 1800.2, "log": "reports/bench/nauto-cold/bench.log", "tail": []},
        {"run": "nauto-warm", "mode": "auto", "cache": "warm", "exit_code": 0, "hung": False, "wall_s": 113.4,
         "cpu_s": 210.0, "cores_busy": 1.85, "verdict": "PASS", "cases": 541, "comparisons": 2133, "failures": 0,
         "cases_per_minute": 286.2, "harness_overhead_share": 0.131,
         "platform": {"machine": "x86_64", "cpu": "AMD EPYC", "isa": "AVX2", "l1d_kib": 48, "jax": "0.12.0.1",
                      "jaxlib": "0.12.0.1", "numpy": "2.5.5"},
         "profile": "ci", "peak_rss_mb_per_worker": {"gw0": 1500, "gw1": 1720},
         "case_seconds_per_worker": {"gw0": 100.0, "gw1": 98.0}, "phase_totals": PHASES,
         "kernel_s_outside_records": 1.0,
         "phases": {"flash_attention / interpret": {"cases": 30, "kernel_compile_s": 50.0, "yardstick_compile_s": 4.5},
                    "flash_attention / tpu-lower": {"cases": 4, "lower_s": 2.0},
                    "ring_attention / xla": {"cases": 20, "kernel_compile_s": 12.0, "inputs_compile_s": 1.5}}},
        {"run": "n0-cold", "mode": "0", "cache": "cold", "exit_code": 0, "hung": False, "wall_s": 300.0,
         "cpu_s": 290.0, "cores_busy": 0.97, "verdict": "PASS", "cases": 541, "comparisons": 2133, "failures": 0,
         "cases_per_minute": 108.2, "harness_overhead_share": 0.2, "profile": "ci",
         "peak_rss_mb_per_worker": {"main": 2000}, "case_seconds_per_worker": {"main": 280.0}, "phase_totals": PHASES,
         "kernel_s_outside_records": 1.0,
         "programs_compiled": {"total": 12, "by_name": {"jit_run": 9, "jit__forward_and_grads": 3}},
         "phases": {"ring_attention / xla": {"cases": 20, "kernel_compile_s": 40.0}}},
    ],
    "sharded": {"shards": 2, "shard_wall_s": [60.5, 58.0], "wall_s_in_parallel": 60.5, "merge_exit_code": 0,
                "runs": [], "merged_verdict": "PASS", "equals_unsharded": True},
    "soak": {"runs": 2, "hung": 0, "timeout_s": 1200, "wall_s": [97.0, 267.0], "verdicts": ["PASS", "PASS"],
             "details": []},
}


def test_the_page_holds_the_figures_of_its_bench_json():
    page = _bench().render_markdown(BENCH)
    assert page.startswith("# Measured: the gate on one machine\n")
    assert "`./dev bench --markdown docs/measured.md`" in page and "reports/bench/bench.json" in page
    assert "abc1234, 2026-12-04" in page and "2 CPUs; x86_64, AMD EPYC, code for AVX2, L1d 48 KiB" in page
    assert "hypothesis profile: ci" in page and "`--shards 2 --soak 2`" in page
    assert ("| nauto-warm | auto | warm | PASS | 113.4 s | 210 s | 1.85 | 541 | 2133 | 0 | 286.2 | 13.1% "
            "| 1720 MB |") in page
    assert "| nauto-cold | auto | cold | no report (exit 1) | 951 s |" in page
    # kernel = kernel + lower + inputs' compile = 322 of a total of 390; compiled 262 of it.
    assert "| nauto-warm | 390.0 s | 322.0 s | 83% | 262.0 s | 81% | 30.0 s | 25.0 s | 10.0 s | 3.0 s |" in page
    assert ("2 shards, warm, one after another: 60.5 s, 58 s (2 runners in parallel: 60.5 s); "
            "merged verdict PASS") in page
    assert "equals the unsharded run's" in page
    assert "2 warm gates in a row: 0 hung (stopped at 1200 s); wall 97-267 s; 2 PASS." in page


def test_the_page_says_what_each_family_compiled_and_how_many_programs_a_cold_run_made():
    page = _bench().render_markdown(BENCH)
    assert "| family | nauto-warm compiled | nauto-warm cases | n0-cold compiled | n0-cold cases |" in page
    # flash: 50 + 4.5 on interpret and the 2 s lowering, 34 cases over both backends.
    assert "| flash_attention | 56.5 s | 34 | - | - |" in page
    assert "| ring_attention | 13.5 s | 20 | 40.0 s | 20 |" in page
    assert "n0-cold compiled 12 distinct programs (jit_run 9, jit__forward_and_grads 3)" in page
    assert page.count("distinct programs") == 1  # only a cold run's cache holds what it compiled


def test_a_bench_without_shards_soak_or_meta_renders_what_it_has():
    page = _bench().render_markdown({"runs": BENCH["runs"][:1]})
    assert "commit: not recorded" in page and "platform not recorded" in page
    assert "## Shards" not in page and "## Soak" not in page and "## Where the time goes" not in page


def test_render_writes_the_page_of_a_bench_json_without_running_a_gate(tmp_path):
    source = tmp_path / "bench.json"
    source.write_text(json.dumps(BENCH))
    page = tmp_path / "docs" / "measured.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gate_bench.py"), "--render", str(source),
                           "--markdown", str(page)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert page.read_text() == _bench().render_markdown(BENCH, source=str(source))
    assert proc.stdout.strip() == f"wrote {page}"
