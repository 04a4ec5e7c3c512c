"""Benchmark the PR gate: wall and CPU time, cases, throughput, memory, phase breakdown.

Runs the gate with the CI profile at -n 0 and at -n auto, each from cold processes (no
persistent compilation cache: see attncheck/compile_cache.py), with the report written to
reports/bench/n<mode>/, and prints per run: wall time, CPU time of the pytest processes,
cases verified, cases per minute, peak RSS per worker, time each worker spent in cases, and
the phases summed from the records (inputs, kernel = trace + compile + run, oracle,
yardstick, compare, lowering), per kernel and backend; the harness overhead is everything
that is not kernel or lowering time (kernel time includes what the tests that make no
comparison record measured around their own kernel calls, and the compile of a kernel's
own function that building the inputs needs: the ring dropout mask). Writes
reports/bench/bench.json.

    python benchmarks/gate_bench.py [--modes 0,auto] [--output bench.json] [pytest args...]
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

from attncheck.report import records as rec

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "reports" / "bench"
# Per case (the same in each direction's record) and per comparison; the *_compile_s ones
# are the trace + lower + XLA compile (or cache load) part of the phase before them.
CASE_PHASES = ("inputs_s", "inputs_compile_s", "kernel_s", "kernel_compile_s", "oracle_s", "yardstick_s",
               "yardstick_compile_s")
PHASES = ("inputs_s", "inputs_compile_s", "kernel_s", "kernel_compile_s", "lower_s", "oracle_s", "yardstick_s",
          "yardstick_compile_s", "compare_s")


def run_gate(mode: str, extra: list[str]) -> dict:
    report_dir = OUT / f"n{mode}"
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "attncheck.gate", "tests/gate", "-q", "-n", mode,
           "--hypothesis-profile=ci", "--attncheck-report", str(report_dir), *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = json.loads((report_dir / "report.json").read_text())
    records = report["records"]
    per_worker_rss = collections.defaultdict(float)
    busy = collections.defaultdict(float)  # seconds each worker spent in the phases of cases
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
        busy[r["worker"]] += timings.get("compare_s", 0.0) + timings.get("lower_s", 0.0)
        if key not in counted:  # the other phases are per case, repeated in each direction's record
            counted.add(key)
            group["cases"] += 1
            for phase in CASE_PHASES:
                group[phase] += timings.get(phase, 0.0)
                if not phase.endswith("_compile_s"):  # part of the phase before it
                    busy[r["worker"]] += timings.get(phase, 0.0)
    # Tests that judge a kernel without a comparison record timed their kernel calls.
    outside_records = sum(rec.kernel_times_outside_records(report_dir, report["run_id"]))
    # Compiling inside inputs is compiling a kernel's own convention function (the ring
    # dropout mask): kernel work too.
    kernel_time = sum(g["kernel_s"] + g["lower_s"] + g["inputs_compile_s"] for g in phases.values()) + outside_records
    workers = max(1, len(per_worker_rss))
    cases = report["totals"]["cases"]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "mode": mode, "exit_code": proc.returncode, "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1), "cores_busy": round(cpu / wall, 2),
        "cases": cases, "comparisons": report["totals"]["records"], "failures": report["totals"]["failures"],
        "cases_per_minute": round(cases / wall * 60, 1),
        "peak_rss_mb_per_worker": {w: round(v) for w, v in sorted(per_worker_rss.items())},
        "case_seconds_per_worker": {w: round(v, 1) for w, v in sorted(busy.items())},
        # Worker-seconds not spent tracing, compiling or running kernels.
        "harness_overhead_share": round(1 - kernel_time / (wall * workers), 3),
        "phase_totals": {p: round(sum(g[p] for g in phases.values()), 1) for p in PHASES},
        "kernel_s_outside_records": round(outside_records, 1),
        "phases": {k: {p: round(v, 2) for p, v in g.items()} for k, g in sorted(phases.items())},
        "tail": proc.stdout.strip().splitlines()[-1:] if proc.stdout else [],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="0,auto", help="comma-separated -n values")
    parser.add_argument("--output", default="bench.json", help="file name under reports/bench/")
    args, extra = parser.parse_known_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results = [run_gate(mode, extra) for mode in args.modes.split(",")]
    for r in results:
        print(f"-n {r['mode']}: wall {r['wall_s']} s, cpu {r['cpu_s']} s "
              f"({r['cores_busy']} cores busy), {r['cases']} cases ({r['comparisons']} comparisons, "
              f"{r['failures']} failing), {r['cases_per_minute']} cases/min, harness overhead "
              f"{r['harness_overhead_share']:.1%}, peak RSS/worker {r['peak_rss_mb_per_worker']} MB, "
              f"seconds in cases per worker {r['case_seconds_per_worker']}")
        print("    all kernels    " + "  ".join(f"{p[:-2]} {r['phase_totals'][p]:6.1f}" for p in PHASES)
              + f"  kernel outside records {r['kernel_s_outside_records']:6.1f}")
        for name, phase in r["phases"].items():
            print(f"    {name:<40} " + "  ".join(f"{p[:-2]} {phase.get(p, 0):6.1f}" for p in PHASES)
                  + f"  cases {phase.get('cases', 0):.0f}")
    if len(results) == 2:
        print(f"speed-up -n {results[1]['mode']} vs -n {results[0]['mode']}: "
              f"{results[0]['wall_s'] / results[1]['wall_s']:.2f}x")
    (OUT / args.output).write_text(json.dumps(results, indent=1))
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
