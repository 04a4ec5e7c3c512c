"""Per-worker record files and their merge.

Each pytest process (the xdist controller or a worker) appends JSON lines to its own file
``<report>/records/<run_id>-<worker>.jsonl``, so parallel workers never share a file and
never clobber each other. Only the controller merges, at session end; a run that died
leaves its files behind and ``attncheck report`` can still merge them (marked incomplete).
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import time

SCHEMA_VERSION = 1
RECORDS_DIR = "records"
# Kernel time a test measured itself because it makes no comparison record (the
# ``attncheck_kernel_time`` fixture), one number per line in a per-worker file next to the
# records; the bench counts it as kernel time. Not a junit.xml property: properties of a
# test case are invalid in the xunit2 format CI systems read.
KERNEL_TIME_SUFFIX = ".kernel_s"


def kernel_times_outside_records(report_dir: pathlib.Path, run_id: str) -> list[float]:
    files = sorted((pathlib.Path(report_dir) / RECORDS_DIR).glob(f"{run_id}-*{KERNEL_TIME_SUFFIX}"))
    return [float(line) for f in files for line in f.read_text(encoding="utf-8").split()]


class RecordWriter:
    def __init__(self, report_dir: pathlib.Path, run_id: str, worker: str):
        self.path = pathlib.Path(report_dir) / RECORDS_DIR / f"{run_id}-{worker}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.worker = worker

    def write(self, record: dict) -> None:
        # ru_maxrss is in KiB on Linux: the worker's peak so far, for the benchmark.
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        record = {"schema_version": SCHEMA_VERSION, "run_id": self.run_id, "worker": self.worker,
                  "worker_peak_rss_mb": round(peak_mb, 1), **record}
        line = json.dumps(record, sort_keys=True, allow_nan=False)
        # One write per complete line, flushed: an interrupted run loses at most the line
        # being written, never corrupts earlier ones.
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()

    def write_kernel_time(self, seconds: float) -> None:
        with open(self.path.with_suffix(KERNEL_TIME_SUFFIX), "a", encoding="utf-8") as fh:
            fh.write(f"{seconds:.4f}\n")


# Another run's record file untouched this long belongs to a finished or dead run. A live
# run writes at least once per test, and a test times out after 900 s (pyproject.toml).
STALE_AFTER_S = 3600


def clear_stale_records(report_dir: pathlib.Path, run_id: str) -> None:
    """Remove other runs' record files that nothing has written for STALE_AFTER_S.

    Never at the start of a run and never a recent file: a second run sharing the
    directory writes in bursts, minutes apart, and must not lose records to this one
    (measured: a short run ending mid-gate deleted the gate's files when the rule was
    'older than this run's start').
    """
    records = pathlib.Path(report_dir) / RECORDS_DIR
    if records.is_dir():
        horizon = time.time() - STALE_AFTER_S
        for f in [*records.glob("*.jsonl"), *records.glob(f"*{KERNEL_TIME_SUFFIX}")]:
            if not f.name.startswith(run_id + "-") and f.stat().st_mtime < horizon:
                f.unlink(missing_ok=True)


def read_records(report_dir: pathlib.Path, run_id: str | None = None) -> tuple[list[dict], list[str]]:
    """All records of a run (the newest run if ``run_id`` is None), and problems found."""
    files = sorted((pathlib.Path(report_dir) / RECORDS_DIR).glob("*.jsonl"))
    if run_id is None and files:
        run_id = max(files, key=os.path.getmtime).name.split("-")[0]
    records, problems = [], []
    for f in files:
        if run_id is not None and not f.name.startswith(run_id + "-"):
            continue
        for lineno, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                problems.append(f"{f.name}:{lineno}: truncated record (interrupted write)")
    records.sort(key=record_key)
    return records, problems


def record_key(record: dict) -> tuple:
    return (record.get("kernel", ""), record.get("impl", ""), record.get("backend", ""),
            record.get("case_id", ""), record.get("direction", ""), record.get("nodeid", ""))



def duplicates(records) -> list[tuple]:
    """Keys that occur more than once: a merge must produce none."""
    seen, dup = set(), []
    for r in records:
        key = record_key(r)
        if key in seen:
            dup.append(key)
        seen.add(key)
    return dup
