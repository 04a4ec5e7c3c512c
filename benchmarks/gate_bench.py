"""Benchmark the PR gate: wall and CPU time, cases, throughput, memory, phase breakdown.

Runs the gate with the CI profile at -n 0 and at -n auto (each from a cold process, with
the report written to reports/bench/<mode>/) and prints, per mode: wall time, CPU time of
the pytest processes, cases verified, cases per minute, peak RSS per worker, and the
phases summed from the records (inputs, kernel = trace + compile + run, oracle, baseline,
compare, lowering), per kernel and backend; the harness overhead is everything that is not
kernel or lowering time. Writes reports/bench/bench.json.

    python benchmarks/gate_bench.py [--modes 0,auto] [pytest args...]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "reports" / "bench"
PHASES = ("inputs_s", "kernel_s", "lower_s", "oracle_s", "baseline_s", "compare_s")


def run_gate(mode: str, extra: list[str]) -> dict:
    report_dir = OUT / f"n{mode}"
    cmd = [sys.executable, "-m", "pytest", "tests/gate", "-q", "-n", mode, "--hypothesis-profile=ci",
           "--attncheck-report", str(report_dir), *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = json.loads((report_dir / "report.json").read_text())
    records = report["records"]
    per_worker_rss = collections.defaultdict(float)
    for r in records:
        per_worker_rss[r["worker"]] = max(per_worker_rss[r["worker"]], r.get("worker_peak_rss_mb", 0.0))
    phases = collections.defaultdict(lambda: collections.defaultdict(float))
    counted = set()
    for r in records:
        key = (r["case_id"], r["backend"], r["impl"])
        group = phases[f"{r['kernel']} / {r['backend']}"]
        timings = r.get("timings", {})
        group["compare_s"] += timings.get("compare_s", 0.0)
        group["lower_s"] += timings.get("lower_s", 0.0)
        if key not in counted:  # the other phases are per case, repeated in each direction's record
            counted.add(key)
            group["cases"] += 1
            for phase in ("inputs_s", "kernel_s", "oracle_s", "baseline_s"):
                group[phase] += timings.get(phase, 0.0)
    kernel_time = sum(g["kernel_s"] + g["lower_s"] for g in phases.values())
    workers = max(1, len(per_worker_rss))
    cases = report["totals"]["cases"]
    return {
        "mode": mode, "exit_code": proc.returncode, "wall_s": round(wall, 1),
        "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1),
        "cases": cases, "comparisons": report["totals"]["records"], "failures": report["totals"]["failures"],
        "cases_per_minute": round(cases / wall * 60, 1),
        "peak_rss_mb_per_worker": {w: round(v) for w, v in sorted(per_worker_rss.items())},
        # Worker-seconds not spent tracing, compiling or running kernels.
        "harness_overhead_share": round(1 - kernel_time / (wall * workers), 3),
        "phases": {k: {p: round(v, 2) for p, v in g.items()} for k, g in sorted(phases.items())},
        "tail": proc.stdout.strip().splitlines()[-1:] if proc.stdout else [],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="0,auto", help="comma-separated -n values")
    args, extra = parser.parse_known_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results = [run_gate(mode, extra) for mode in args.modes.split(",")]
    for r in results:
        print(f"-n {r['mode']}: wall {r['wall_s']} s, cpu {r['cpu_s']} s, {r['cases']} cases "
              f"({r['comparisons']} comparisons, {r['failures']} failing), {r['cases_per_minute']} cases/min, "
              f"harness overhead {r['harness_overhead_share']:.1%}, peak RSS/worker {r['peak_rss_mb_per_worker']} MB")
        for name, phase in r["phases"].items():
            print(f"    {name:<46} " + "  ".join(f"{p[:-2]} {phase.get(p, 0):7.1f}" for p in PHASES)
                  + f"  cases {phase.get('cases', 0):.0f}")
    if len(results) == 2:
        print(f"speed-up -n {results[1]['mode']} vs -n {results[0]['mode']}: "
              f"{results[0]['wall_s'] / results[1]['wall_s']:.2f}x")
    (OUT / "bench.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
