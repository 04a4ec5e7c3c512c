"""Benchmark the PR gate: wall and CPU time, cases, throughput, memory, phase breakdown;
with the compilation cache off, cold and warm; sharded; and N warm gates in a row that
catch a hang with a stack dump of every process.

Each run is the gate with the CI profile (``pytest --pyargs attncheck.gate tests/gate``),
its report in reports/bench/<run>/, and attncheck's caches (``$ATTNCHECK_CACHE_DIR``: the
compilation cache and the coverage examples) in reports/bench/cache/:

- ``--cache none,cold,warm`` (default): the gate with no cache (``none``), on an emptied
  cache (``cold``: what a CI job without a restored cache sees) and on the cache the cold
  run filled (``warm``), at each ``-n`` of ``--modes`` (default ``auto``);
- ``--shards N``: then the N shards of the gate (``--attncheck-shard K/N``, warm), one after
  another, each timed, their reports merged (``attncheck report merge``) and compared with
  the warm unsharded run: case ids, outcomes and verdict must be the same;
- ``--soak N``: then N consecutive warm gates, each stopped after ``--soak-timeout``
  seconds; a test running past ``--dump-after`` seconds dumps the stacks of its process
  (pytest's faulthandler_timeout), and a run stopped at the timeout gets a faulthandler
  dump of every one of its processes (SIGABRT), plus gdb's native stacks where gdb is
  installed, in reports/bench/soak-<i>/stacks.log.

Printed per run: wall time, CPU time of the pytest processes, cases verified, cases per
minute, peak RSS per worker, time each worker spent in cases, and the phases summed from
the records (inputs, kernel = trace + compile + run, oracle, yardstick, compare, lowering),
per kernel and backend; the harness overhead is everything that is not kernel or lowering
time (kernel time includes what the tests that make no comparison record measured around
their own kernel calls, and the compile of a kernel's own function that building the
inputs needs: the ring dropout mask). Everything lands in reports/bench/bench.json, with
the commit, the date and the platform the numbers belong to.

``--markdown PATH`` also renders that bench.json as a Markdown page (``render_markdown``):
docs/measured.md is such a page, the measured figures the docs link to, written by the
bench and never by hand. ``--render BENCH_JSON --markdown PATH`` renders a bench.json
written before, without running anything.

    python benchmarks/gate_bench.py [--modes 0,auto] [--cache none,cold,warm] [--shards 4]
                                    [--soak 10] [--output bench.json] [--markdown docs/measured.md]
                                    [pytest args...]
    python benchmarks/gate_bench.py --render reports/bench/bench.json --markdown docs/measured.md
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import time

from attncheck import cache_root, compile_cache
from attncheck.report import records as rec

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "reports" / "bench"
CACHE = OUT / "cache"
CACHE_MODES = ("none", "cold", "warm")
# Per case (the same in each direction's record) and per comparison; the *_compile_s ones
# are the trace + lower + XLA compile (or cache load) part of the phase before them.
CASE_PHASES = ("inputs_s", "inputs_compile_s", "kernel_s", "kernel_compile_s", "oracle_s", "yardstick_s",
               "yardstick_compile_s")
PHASES = ("inputs_s", "inputs_compile_s", "kernel_s", "kernel_compile_s", "lower_s", "oracle_s", "yardstick_s",
          "yardstick_compile_s", "compare_s")


def run_gate(name: str, mode: str, cache: str, extra: list[str], *, timeout_s: float | None = None,
             dump_after_s: float | None = None) -> dict:
    """One gate run into reports/bench/<name>, measured; a run past ``timeout_s`` is
    stopped with a stack dump of each of its processes."""
    report_dir = OUT / name
    if cache == "cold":
        shutil.rmtree(CACHE, ignore_errors=True)
    env = dict(os.environ, **{cache_root.CACHE_ENV: cache_root.DISABLED if cache == "none" else str(CACHE)})
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "attncheck.gate", "tests/gate", "-q", "-n", mode,
           "--hypothesis-profile=ci", "--attncheck-report", str(report_dir), *extra]
    if dump_after_s is not None:
        cmd += ["-o", f"faulthandler_timeout={dump_after_s:.0f}"]
    report_dir.mkdir(parents=True, exist_ok=True)
    log = report_dir / "bench.log"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        # Its own process group: a hung run's workers are found, dumped and stopped with it.
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            _dump_and_stop(proc.pid, report_dir / "stacks.log")
            proc.wait()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = {"run": name, "mode": mode, "cache": cache, "exit_code": proc.returncode, "hung": hung,
              "wall_s": round(wall, 1), "cpu_s": round((after.ru_utime - before.ru_utime)
                                                       + (after.ru_stime - before.ru_stime), 1),
              "log": str(log.relative_to(ROOT)),
              "tail": log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]}
    result["cores_busy"] = round(result["cpu_s"] / wall, 2)
    if cache == "cold":
        # What the emptied cache holds now is every distinct program the run compiled.
        programs = compile_cache.programs(CACHE / compile_cache.SUBDIR)
        result["programs_compiled"] = {"total": sum(programs.values()), "by_name": dict(programs.most_common())}
    try:
        report = json.loads((report_dir / "report.json").read_text())
    except (OSError, ValueError):
        return result
    return {**result, **_measure(report, report_dir, wall)}


def _group(pgid: int) -> list[int]:
    """The processes of a process group (the pytest controller and its xdist workers)."""
    ps = subprocess.run(["ps", "-o", "pid=,pgid=", "-e"], capture_output=True, text=True).stdout
    return [int(pid) for pid, group in (line.split() for line in ps.splitlines()) if int(group) == pgid]


def _dump_and_stop(pgid: int, stacks: pathlib.Path) -> None:
    """Native stacks of every process of the group (gdb, when installed), then SIGABRT:
    pytest's faulthandler prints every Python thread's stack of each process into the run's
    log as it dies; then the group is killed."""
    with open(stacks, "w", encoding="utf-8") as out:
        for pid in _group(pgid):
            out.write(f"==== pid {pid}: {_cmdline(pid)}\n")
            out.flush()
            if shutil.which("gdb"):
                try:
                    subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"], stdout=out,
                                   stderr=subprocess.STDOUT, timeout=120)
                except subprocess.TimeoutExpired:
                    out.write("gdb timed out\n")
        out.write("==== Python stacks: the faulthandler dumps at the end of the run's bench.log\n")
    for pid in _group(pgid):
        os.kill(pid, signal.SIGABRT)
    time.sleep(5)  # faulthandler writes its dump before the process dies
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _measure(report: dict, report_dir: pathlib.Path, wall: float) -> dict:
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
    return {
        "verdict": report["verdict"], "platform": report.get("platform"), "profile": report.get("profile"),
        "cases": cases, "comparisons": report["totals"]["records"],
        "failures": report["totals"]["failures"], "cases_per_minute": round(cases / wall * 60, 1),
        "peak_rss_mb_per_worker": {w: round(v) for w, v in sorted(per_worker_rss.items())},
        "case_seconds_per_worker": {w: round(v, 1) for w, v in sorted(busy.items())},
        # Worker-seconds not spent tracing, compiling or running kernels.
        "harness_overhead_share": round(1 - kernel_time / (wall * workers), 3),
        "phase_totals": {p: round(sum(g[p] for g in phases.values()), 1) for p in PHASES},
        "kernel_s_outside_records": round(outside_records, 1),
        "phases": {k: {p: round(v, 2) for p, v in g.items()} for k, g in sorted(phases.items())},
    }


def _print_run(r: dict) -> None:
    if "cases" not in r:
        print(f"{r['run']}: no report (exit {r['exit_code']}{', HUNG' if r['hung'] else ''}); see {r['log']}")
        return
    print(f"{r['run']} (-n {r['mode']}, cache {r['cache']}): {r['verdict']}, wall {r['wall_s']} s, cpu {r['cpu_s']} s "
          f"({r['cores_busy']} cores busy), {r['cases']} cases ({r['comparisons']} comparisons, "
          f"{r['failures']} failing), {r['cases_per_minute']} cases/min, harness overhead "
          f"{r['harness_overhead_share']:.1%}, peak RSS/worker {r['peak_rss_mb_per_worker']} MB, "
          f"seconds in cases per worker {r['case_seconds_per_worker']}")
    if "programs_compiled" in r:
        print(f"    programs compiled: {_programs_line(r['programs_compiled'])}")
    print("    all kernels    " + "  ".join(f"{p[:-2]} {r['phase_totals'][p]:6.1f}" for p in PHASES)
          + f"  kernel outside records {r['kernel_s_outside_records']:6.1f}")
    for name, phase in r["phases"].items():
        print(f"    {name:<40} " + "  ".join(f"{p[:-2]} {phase.get(p, 0):6.1f}" for p in PHASES)
              + f"  cases {phase.get('cases', 0):.0f}")


def _outcomes(report_dir: pathlib.Path) -> tuple[str, list[tuple]]:
    report = json.loads((report_dir / "report.json").read_text())
    return report["verdict"], sorted((r["kernel"], r["impl"], r["backend"], r["case_id"], r["direction"],
                                      r["outcome"]) for r in report["records"])


def sharded(count: int, mode: str, extra: list[str], unsharded: pathlib.Path | None) -> dict:
    """The count shards one after another (warm), merged, against the unsharded run."""
    shards = [run_gate(f"shard-{k}-of-{count}", mode, "warm", [*extra, f"--attncheck-shard={k}/{count}"])
              for k in range(1, count + 1)]
    merged_dir = OUT / f"merged-{count}"
    merge = subprocess.run([sys.executable, "-m", "attncheck", "report", "merge",
                            *(str(OUT / s["run"]) for s in shards), "--report", str(merged_dir)],
                           cwd=ROOT, capture_output=True, text=True)
    result = {"shards": count, "shard_wall_s": [s["wall_s"] for s in shards],
              "wall_s_in_parallel": max(s["wall_s"] for s in shards), "merge_exit_code": merge.returncode,
              "runs": shards}
    if (merged_dir / "report.json").is_file():
        verdict, outcomes = _outcomes(merged_dir)
        result["merged_verdict"] = verdict
        if unsharded is not None:
            whole_verdict, whole_outcomes = _outcomes(unsharded)
            result["equals_unsharded"] = (verdict, outcomes) == (whole_verdict, whole_outcomes)
    return result


def soak(count: int, mode: str, extra: list[str], timeout_s: float, dump_after_s: float) -> dict:
    runs = [run_gate(f"soak-{i}", mode, "warm", extra, timeout_s=timeout_s, dump_after_s=dump_after_s)
            for i in range(1, count + 1)]
    for r in runs:
        ended = f"HUNG (stacks in {r['log']} and stacks.log)" if r['hung'] else r.get('verdict')
        print(f"soak {r['run']}: {ended}"
              f", wall {r['wall_s']} s, exit {r['exit_code']}", flush=True)
    return {"runs": count, "hung": sum(r["hung"] for r in runs), "timeout_s": timeout_s,
            "wall_s": [r["wall_s"] for r in runs], "verdicts": [r.get("verdict") for r in runs], "details": runs}


# ------------------------------------------------------------------ the Markdown page
MARKDOWN_COMMAND = "./dev bench --markdown docs/measured.md"
# The phases that add up to a run's total on the page (seconds summed over workers); the
# *_compile_s ones are parts of the phase before them (PHASES).
_TOTAL_PHASES = ("inputs_s", "kernel_s", "lower_s", "oracle_s", "yardstick_s", "compare_s")
_COMPILE_PHASES = ("kernel_compile_s", "lower_s", "inputs_compile_s", "yardstick_compile_s")


def _compiled_by_family(run: dict) -> dict[str, tuple[int, float]]:
    """Family -> (cases, seconds of tracing and compiling: its kernel's, its lowering, its
    inputs' and its yardstick's), summed over its backends."""
    out: dict[str, tuple[int, float]] = {}
    for name, phase in run.get("phases", {}).items():
        family = name.split(" / ")[0]
        cases, seconds = out.get(family, (0, 0.0))
        out[family] = (cases + int(phase.get("cases", 0)),
                       seconds + sum(phase.get(k, 0.0) for k in _COMPILE_PHASES))
    return out


def _programs_line(programs: dict) -> str:
    """"N distinct programs (name count, ...)"."""
    named = ", ".join(f"{name} {count}" for name, count in programs["by_name"].items())
    return f"{programs['total']} distinct programs" + (f" ({named})" if named else "")


def _cell(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        value = f"{value:g}"
    return f"{value}{unit}"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def _platform_line(platform: dict | None) -> str:
    if not platform:
        return "platform not recorded"
    parts = [platform.get("machine"), platform.get("cpu"), f"code for {platform['isa']}" if "isa" in platform else None,
             f"L1d {platform['l1d_kib']} KiB" if "l1d_kib" in platform else None,
             f"jax {platform['jax']}" if "jax" in platform else None,
             f"numpy {platform['numpy']}" if "numpy" in platform else None]
    return ", ".join(str(p) for p in parts if p)


def render_markdown(results: dict, *, source: str = "reports/bench/bench.json") -> str:
    """The Markdown page of one bench.json (what ``main`` writes): its runs, where their
    time went, its shards and its soak. Every figure is read from ``results``."""
    meta = results.get("meta", {})
    runs = results.get("runs", [])
    measured = [r for r in runs if "cases" in r]
    platform = next((r["platform"] for r in measured if r.get("platform")), None)
    profile = next((r["profile"] for r in measured if r.get("profile")), None)
    lines = [
        "# Measured: the gate on one machine",
        "",
        (f"Written by `{MARKDOWN_COMMAND}` from `{source}` (benchmarks/gate_bench.py): do not edit, run the "
         "bench again. The budgets these figures are held to are in [profiles.md](profiles.md)."),
        "",
        f"- commit: {meta.get('commit') or 'not recorded'}" + (f", {meta['date']}" if meta.get("date") else ""),
        "- machine: " + (f"{meta['cpus']} CPUs; " if meta.get("cpus") else "") + _platform_line(platform),
        f"- hypothesis profile: {profile or 'not recorded'}",
    ]
    if meta.get("args"):
        lines.append(f"- bench arguments: `{' '.join(meta['args'])}`")
    lines += ["", "## Runs", "",
              ("| run | -n | cache | verdict | wall | CPU | cores busy | cases | comparisons | failing | cases/min "
               "| harness overhead | peak RSS per worker, max |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "cases" not in r:
            lines.append(f"| {r['run']} | {r['mode']} | {r['cache']} | no report (exit {r['exit_code']}"
                         f"{', hung' if r.get('hung') else ''}) | {_cell(r.get('wall_s'), ' s')} | "
                         f"{_cell(r.get('cpu_s'), ' s')} | - | - | - | - | - | - | - |")
            continue
        rss = max(r.get("peak_rss_mb_per_worker", {}).values(), default=None)
        lines.append(f"| {r['run']} | {r['mode']} | {r['cache']} | {r['verdict']} | {_cell(r['wall_s'], ' s')} | "
                     f"{_cell(r['cpu_s'], ' s')} | {_cell(r['cores_busy'])} | {r['cases']} | {r['comparisons']} | "
                     f"{r['failures']} | {_cell(r['cases_per_minute'])} | {r['harness_overhead_share']:.1%} | "
                     f"{_cell(rss, ' MB')} |")
    if measured:
        lines += ["", "## Where the time goes", "",
                  ("Seconds summed over the workers, from the records. *kernel* is each kernel's trace, compile "
                   "and run, with its lowering for TPU and the compile of the convention functions its inputs need; "
                   "*compiled* is the tracing and compiling part of it."), "",
                  ("| run | total | kernel | of the total | compiled | of the kernel | oracle | yardstick | inputs "
                   "| compare |"),
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in measured:
            p = r["phase_totals"]
            total = sum(p.get(k, 0.0) for k in _TOTAL_PHASES)
            kernel = p.get("kernel_s", 0.0) + p.get("lower_s", 0.0) + p.get("inputs_compile_s", 0.0)
            compiled = p.get("kernel_compile_s", 0.0) + p.get("lower_s", 0.0) + p.get("inputs_compile_s", 0.0)
            inputs = p.get("inputs_s", 0.0) - p.get("inputs_compile_s", 0.0)
            lines.append(f"| {r['run']} | {total:.1f} s | {kernel:.1f} s | {_share(kernel, total)} | {compiled:.1f} s "
                         f"| {_share(compiled, kernel)} | {p.get('oracle_s', 0.0):.1f} s | "
                         f"{p.get('yardstick_s', 0.0):.1f} s | {inputs:.1f} s | {p.get('compare_s', 0.0):.1f} s |")
        by_run = {r["run"]: _compiled_by_family(r) for r in measured}
        families = sorted({f for compiled in by_run.values() for f in compiled})
        lines += ["", "## Compiling, per family", "",
                  ("Seconds summed over the workers that each family's cases spent tracing and compiling (its "
                   "kernel's forward and VJP, its lowering, its inputs' and its yardstick's programs), over all "
                   "its backends, and its cases."), "",
                  "| family | " + " | ".join(f"{run} compiled | {run} cases" for run in by_run) + " |",
                  "|---|" + "---|---|" * len(by_run)]
        for family in families:
            cells = [f"{by_run[run][family][1]:.1f} s | {by_run[run][family][0]}" if family in by_run[run] else "- | -"
                     for run in by_run]
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
        for r in measured:
            if "programs_compiled" in r:
                lines += ["", (f"{r['run']} compiled {_programs_line(r['programs_compiled'])}: the entries its "
                               "emptied cache holds after it, by the name jax gives a program.")]
    sharded = results.get("sharded")
    if sharded:
        lines += ["", "## Shards", "",
                  f"{sharded['shards']} shards, warm, one after another: "
                  + ", ".join(_cell(w, " s") for w in sharded["shard_wall_s"])
                  + f" ({sharded['shards']} runners in parallel: {_cell(sharded['wall_s_in_parallel'], ' s')}); "
                  + "merged verdict "
                  + f"{sharded.get('merged_verdict', 'none (the merge failed)')}"
                  + ("" if "equals_unsharded" not in sharded else
                     "; the merged report " + ("equals" if sharded["equals_unsharded"] else "differs from")
                     + " the unsharded run's (case ids, outcomes, verdict)") + "."]
    soaked = results.get("soak")
    if soaked:
        walls = soaked.get("wall_s", [])
        verdicts = collections.Counter(v or "no report" for v in soaked.get("verdicts", []))
        lines += ["", "## Soak", "",
                  f"{soaked['runs']} warm gates in a row: {soaked['hung']} hung "
                  f"(stopped at {soaked['timeout_s']:g} s); "
                  + (f"wall {min(walls):g}-{max(walls):g} s; " if walls else "")
                  + ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items())) + "."]
    return "\n".join(lines) + "\n"


def _meta() -> dict:
    """What the numbers of a bench belong to, besides each run's platform: the commit (with
    "+changes" when the work tree differs from it), the date and the machine's CPUs."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return {"commit": commit or None, "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
            "args": sys.argv[1:]}


def write_markdown(results: dict, path: pathlib.Path, source: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown(results, source=source), encoding="utf-8")
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="auto", help="comma-separated -n values (default: %(default)s)")
    parser.add_argument("--cache", default=",".join(CACHE_MODES),
                        help="comma-separated cache modes, in this order: none, cold, warm (default: %(default)s)")
    parser.add_argument("--shards", type=int, default=0, help="then run the gate in this many shards, one by one")
    parser.add_argument("--soak", type=int, default=0, help="then this many warm gates in a row, watching for hangs")
    parser.add_argument("--soak-timeout", type=float, default=1200, help="seconds before a soak run counts as hung")
    parser.add_argument("--dump-after", type=float, default=300,
                        help="seconds one test may run in a soak before its process dumps its stacks")
    parser.add_argument("--output", default="bench.json", help="file name under reports/bench/")
    parser.add_argument("--markdown", metavar="PATH",
                        help="also render the bench.json as a Markdown page here (docs/measured.md)")
    parser.add_argument("--render", metavar="BENCH_JSON",
                        help="run nothing: render this bench.json (with --markdown PATH, else to stdout)")
    args, extra = parser.parse_known_args()
    if args.render:
        if extra:
            parser.error(f"--render runs nothing: unexpected arguments {extra}")
        source = pathlib.Path(args.render)
        try:
            results = json.loads(source.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            parser.error(f"--render {source}: not a readable bench.json ({exc})")
        shown = _shown(source)
        if args.markdown:
            write_markdown(results, pathlib.Path(args.markdown), shown)
        else:
            print(render_markdown(results, source=shown), end="")
        return 0
    caches = [c for c in args.cache.split(",") if c]
    if not set(caches) <= set(CACHE_MODES):
        parser.error(f"--cache {args.cache!r}: expected some of {', '.join(CACHE_MODES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    results = {"meta": _meta(),
               "runs": [run_gate(f"n{mode}-{cache}", mode, cache, extra) for mode in modes for cache in caches]}
    for r in results["runs"]:
        _print_run(r)
    by_cache = {(r["mode"], r["cache"]): r["wall_s"] for r in results["runs"]}
    for mode in modes:
        print(f"-n {mode}: " + ", ".join(f"{c} {by_cache[(mode, c)]} s" for c in caches if (mode, c) in by_cache))
    if args.shards:
        warm = OUT / f"n{modes[0]}-warm"
        results["sharded"] = sharded(args.shards, modes[0], extra, warm if "warm" in caches else None)
        s = results["sharded"]
        print(f"{args.shards} shards at -n {modes[0]}, warm, one after another: {s['shard_wall_s']} s "
              f"(in parallel: {s['wall_s_in_parallel']} s); merged verdict {s.get('merged_verdict')}"
              + (f", equals the unsharded run: {s['equals_unsharded']}" if "equals_unsharded" in s else ""))
    if args.soak:
        results["soak"] = soak(args.soak, modes[0], extra, args.soak_timeout, args.dump_after)
        print(f"soak: {results['soak']['hung']} of {args.soak} warm gates hung")
    (OUT / args.output).write_text(json.dumps(results, indent=1))
    if args.markdown:
        write_markdown(results, pathlib.Path(args.markdown), _shown(OUT / args.output))
    runs = results["runs"] + results.get("sharded", {}).get("runs", []) + results.get("soak", {}).get("details", [])
    ok = all(r["exit_code"] == 0 for r in runs) and results.get("sharded", {}).get("equals_unsharded", True)
    return 0 if ok else 1


def _shown(path: pathlib.Path) -> str:
    """A path as the page names it: relative to the repository where it is inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    sys.exit(main())
