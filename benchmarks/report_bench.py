"""How long the report takes to write, and what an error map costs the gate.

    python benchmarks/report_bench.py [RECORDS]   # default reports/test/report.json

Reads the records of a finished full-gate run (never changes them): a report.json, or a
directory of a run's per-worker ``*.jsonl`` record files (in the order the workers wrote
them; records of an older schema are read as they are), and measures:
- ``map_cost``: building one error map (and its JSON) against ``numerics.compare`` of the
  same arrays, on the gate's largest shapes: what the maps add to a comparison;
- ``maps``: which records the gate's policy (``errormap.PastBudget``) gives a map, replayed
  over the records in the report's order per worker, and the size of those maps; a run
  recorded before maps existed gets them built here from each case's own oracle, with the
  spec's layout and the recorded budget (the page draws the same number of maps);
- ``write``: ``render.write`` of the whole report (report.json, report.md, report.html) into
  a temporary directory, CPU and wall seconds, and the HTML and JSON parts alone;
- ``merge``: what the gate's controller does at the end of a run, on the same records
  written as this version's per-worker files: ``merge.merge`` (every line validated
  against the schema) and ``render.write``; and the wall time of ``attncheck report
  --complete`` on them in a fresh process (imports included);
- ``matplotlib``: where it is importable, its import time in a fresh process and the time
  it takes to draw the same charts and maps as SVG (the alternative to plots.py).

Prints one JSON object. CPU seconds (``time.process_time``) are what a runner shared with
other jobs inflates least; wall seconds are given too.
"""

from __future__ import annotations

import io
import json
import math
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from attncheck import numerics, specs  # noqa: E402
from attncheck.report import errormap, model, plots, render  # noqa: E402
from attncheck.report.records import Record  # noqa: E402


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def map_cost() -> dict:
    """CPU milliseconds to build one map with its JSON, and to compare the same arrays."""
    rng = np.random.default_rng(0)
    out = {}
    for name, shape in (("flash out 2x1x512x128", (2, 1, 512, 128)), ("flash dab 2x1x512x512", (2, 1, 512, 512)),
                        ("ragged out 64x8x128", (64, 8, 128)), ("ring out 1x2x256x32", (1, 2, 256, 32))):
        oracle = rng.standard_normal(shape)
        kernel = oracle + 1e-7 * rng.standard_normal(shape)
        build = best_of(lambda: errormap.build(kernel, oracle, allowed=1e-6, direction="out").to_json(), 5)
        compare = best_of(lambda: numerics.compare(kernel, oracle, oracle, dtype=np.float32, direction="out"), 3)
        out[name] = {"map_ms": round(build * 1e3, 2), "compare_ms": round(compare * 1e3, 2)}
    return out


def with_maps(records: list[Record]) -> tuple[list[Record], int]:
    """The records with maps where the gate's policy puts them, built when the run recorded
    none; and how many were built."""
    import dataclasses

    policy = errormap.PastBudget()
    known = specs.all_specs()
    truths: dict[tuple, dict] = {}
    rng = np.random.default_rng(0)
    out, built = [], 0
    for r in records:
        keep = r.metrics is not None and policy.keep((r.kernel, r.impl, r.direction), r.budget, not r.passed)
        if not keep or r.error_map is not None or r.kernel not in known:
            out.append(r if keep else dataclasses.replace(r, error_map=None))
            continue
        spec = known[r.kernel]
        case = spec.case_from_json(r.case)
        if case.id not in truths:
            truths[case.id] = spec.oracle(case, spec.inputs(case))
        truth = np.asarray(truths[case.id][r.direction], dtype=np.float64)
        allowed, budget = r.metrics.allowed, r.budget if math.isfinite(r.budget) else 1e6
        kernel = truth + rng.uniform(-1.0, 1.0, truth.shape) * allowed * budget
        emap = errormap.build(kernel, truth, allowed=allowed, direction=r.direction,
                              layout=spec.error_map_layout(case, r.direction))
        out.append(dataclasses.replace(r, error_map=emap))
        built += 1
    return out, built


def merge_and_write(records: list[Record], run_id: str) -> dict:
    import dataclasses

    from attncheck.report import merge
    from attncheck.report import records as rec

    with tempfile.TemporaryDirectory() as tmp:
        directory = pathlib.Path(tmp)
        writers = {}
        for r in records:
            if r.worker not in writers:
                writers[r.worker] = rec.RecordWriter(directory, run_id, r.worker)
            writers[r.worker].write(dataclasses.replace(r, schema_version=rec.SCHEMA_VERSION))
        rec.RunInfo(run_id, time.time()).write(directory)
        start, wall = time.process_time(), time.perf_counter()
        report = merge.merge(directory, run_id, merge.RunOutcome(complete=True),
                             applicable={s.name: s.class_names for s in specs.all_specs().values()})
        merged = time.process_time() - start
        render.write(directory, report)
        out = {"verdict": report.verdict, "merge_cpu_s": round(merged, 3),
               "merge_and_write_cpu_s": round(time.process_time() - start, 3),
               "merge_and_write_wall_s": round(time.perf_counter() - wall, 3)}
        wall = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "attncheck", "report", "--report", tmp, "--run", run_id,
                               "--complete"], capture_output=True, text=True, check=False)
        out["attncheck_report_fresh_process_wall_s"] = round(time.perf_counter() - wall, 3)
        out["attncheck_report_exit"] = proc.returncode
    return out


def matplotlib_charts(report: model.Report) -> dict:
    """The page's charts and maps with matplotlib (Agg, SVG into memory)."""
    start = time.process_time()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    imported = time.process_time() - start

    def svg(fig) -> int:
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg")
        plt.close(fig)
        return len(buffer.getvalue())

    numeric = [r for r in report.records if r.metrics is not None]
    start = time.process_time()
    size = 0
    for dtype in sorted({r.dtype for r in numeric}):
        fig, ax = plt.subplots(figsize=(6, 3))
        for kernel in sorted({r.kernel for r in numeric}):
            pts = [(r.seq_len, r.metrics.max_abs) for r in numeric if r.dtype == dtype and r.kernel == kernel]
            if pts:
                ax.scatter(*zip(*pts), s=8, label=kernel)
        ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.grid(True)
        ax.legend(fontsize=6)
        size += svg(fig)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist([min(r.budget, 1.5) for r in numeric], bins=24)
    size += svg(fig)
    fig, ax = plt.subplots(figsize=(8, max(3, len(report.summary) / 12)))
    budgets = np.array([[min(row.worst_budget, 1e6) for row in report.summary]])
    ax.imshow(np.log10(np.maximum(budgets, 1e-6)), aspect="auto")
    for j, value in enumerate(budgets[0]):
        ax.text(j, 0, f"{value:.2g}", fontsize=5, ha="center")
    size += svg(fig)
    maps = [r.error_map for r, _ in render.worst_passing_maps(report.records)]
    maps += [r.error_map for r in report.failing[:render.MAX_FAILURE_CARDS] if r.error_map is not None]
    for emap in maps:
        fig, ax = plt.subplots(figsize=(3.2, 3.2))
        ax.imshow(plots.budget_rgb(emap.values), interpolation="nearest", aspect="auto")
        for _, positions in emap.rows.bounds:
            for p in positions:
                ax.axhline(p / emap.rows.step - 0.5, color="k", lw=1)
        size += svg(fig)
    return {"import_s": round(imported, 3), "render_s": round(time.process_time() - start, 3), "svg_bytes": size,
            "maps": len(maps), "version": matplotlib.__version__}


def read(path: pathlib.Path) -> tuple[list[Record], str, list[model.SkippedBackend]]:
    """(records, run id, skipped backends) of a report.json or a directory of record files."""
    if path.is_dir():
        lines = [json.loads(line) for f in sorted(path.glob("*.jsonl")) for line in f.read_text().splitlines()]
        return [Record.from_json(r) for r in lines], lines[0]["run_id"], []
    data = json.loads(path.read_text())
    return ([Record.from_json(r) for r in data["records"]], data["run_id"],
            [model.SkippedBackend(**s) for s in data["skipped_backends"]])


def main(argv: list[str]) -> int:
    path = pathlib.Path(argv[1] if len(argv) > 1 else "reports/test/report.json")
    recorded, run_id, skipped = read(path)
    records, built = with_maps(recorded)
    report = model.build(records, run_id=run_id, complete=True, wall_s=None, problems=[], unverified=[],
                         skipped_backends=skipped,
                         applicable={s.name: s.class_names for s in specs.all_specs().values()})
    sizes = [len(json.dumps(r.error_map.to_json())) for r in records if r.error_map is not None]
    result = {"report": str(path), "records": len(records), "verdict": report.verdict,
              "maps": {"records_with_map": len(sizes), "built_here": built,
                       "json_bytes_median": statistics.median(sizes) if sizes else 0,
                       "failing": len(report.failing)}}
    with tempfile.TemporaryDirectory() as tmp:
        start, wall = time.process_time(), time.perf_counter()
        render.write(pathlib.Path(tmp), report)
        result["write"] = {"cpu_s": round(time.process_time() - start, 3),
                           "wall_s": round(time.perf_counter() - wall, 3),
                           **{name.replace(".", "_") + "_bytes": (pathlib.Path(tmp) / name).stat().st_size
                              for name in render.REPORT_FILES}}
    result["merge"] = merge_and_write(records, run_id)
    result["write"]["html_cpu_s"] = round(best_of(lambda: render.render_html(report)), 3)
    result["write"]["json_cpu_s"] = round(best_of(lambda: render.dump_json(report)), 3)
    result["map_cost"] = map_cost()
    probe = subprocess.run([sys.executable, "-c", "import time; t = time.process_time(); "
                            "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot; "
                            "print(time.process_time() - t)"], capture_output=True, text=True, check=False)
    if probe.returncode == 0:
        result["matplotlib"] = {"import_s_fresh_process": round(float(probe.stdout.strip()), 3),
                                **matplotlib_charts(report)}
    else:
        result["matplotlib"] = "not installed"
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
