"""Records: one per comparison, written per worker, validated and merged per run.

Each pytest process (the xdist controller or a worker) appends JSON lines to its own file
``<report>/records/<run_id>-<worker>.jsonl``, so parallel workers never share a file and
never clobber each other; before each case it also appends a *started* marker to
``<run_id>-<worker>.started``. Only the controller merges, at session end, and only its own
run's files: every line is validated against ``schema.json``, and every started case
without a record (the worker crashed, the process was killed, the case hung) becomes an
error record naming the case and its reproducer. A run that died leaves its files behind;
``attncheck report --run RUN_ID`` merges them.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import json
import math
import pathlib
import resource
import time
from collections.abc import Iterable, Mapping
from typing import Any

from attncheck.env import Platform
from attncheck.expectations import CaseEvidence
from attncheck.numerics import Comparison
from attncheck.report.errormap import ErrorMap
from attncheck.report.policy import Policy

# 6: a comparison's metrics no longer carry the spread between the yardstick's summation
# orders (the yardstick check computes the yardstick in float64 instead).
SCHEMA_VERSION = 6
RECORDS_DIR = "records"
RECORDS_SUFFIX = ".jsonl"
STARTED_SUFFIX = ".started"
# Kernel time a test measured itself because it makes no comparison record (the
# ``attncheck_kernel_time`` fixture), one number per line in a per-worker file next to the
# records; the bench counts it as kernel time. Not a junit.xml property: properties of a
# test case are invalid in the xunit2 format CI systems read.
KERNEL_TIME_SUFFIX = ".kernel_s"
# faulthandler's dump of a process that died of a fatal signal (a segfault or an abort in
# XLA, the OOM killer's SIGKILL leaves none), and the stacks of one the watchdog ended: the
# merge quotes it for the cases the process left unfinished, so a crash in CI names its
# cause in the report, not only in a log.
FAULTS_SUFFIX = ".faults"
# What the process wrote to its file descriptor 2 during its current test (pytest's capture
# of it, kept in a named file: ``attncheck.session``): XLA's own message before an abort.
STDERR_SUFFIX = ".stderr"
# The first line of the watchdog's dump in a faults file.
TIMED_OUT = "Timed out"
# The run's own description, written when it starts (``RunInfo``).
RUN_SUFFIX = ".run.json"
INVALID_CALLS_SUFFIX = ".invalid_calls"  # JSON lines, like a worker's records
# A shard's whole collection (``Collection``).
COLLECTION_SUFFIX = ".collection.json"
OUTCOMES = ("pass", "fail", "error")


def target_id(family: str, impl: str, backend: str) -> str:
    """The id of one implementation of a family on one backend, as gate tests, records and
    reports name it."""
    return f"{family}-{impl}-{backend}"


@dataclasses.dataclass(frozen=True)
class CaseRun:
    """What identifies one case of one implementation on one backend, and how to rerun it:
    the part of a record known before the case runs (the started marker)."""

    case_id: str
    case: Mapping[str, Any]  # Case.to_json()
    kernel: str
    impl: str
    impl_ref: str
    backend: str
    backend_settings: Mapping[str, Any]
    dtype: str
    seq_len: int
    device_count: int
    classes: tuple[str, ...]
    repro: str
    nodeid: str = ""
    parameters: Mapping[str, str] | None = None  # the call's parameter surface (attncheck.parameters)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(CaseRun)}
        out["classes"] = list(self.classes)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CaseRun:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if k == "classes" else v) for k, v in data.items() if k in fields})


@dataclasses.dataclass(frozen=True)
class Record(CaseRun):
    """The verdict of one direction (output, gradient, lowering) of a case, or ``all``
    when the case failed before any comparison."""

    direction: str = "all"
    outcome: str = "error"  # one of OUTCOMES
    reason: str = ""
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    metrics: Comparison | None = None
    traceback: str | None = None
    # Where the error is (attncheck.report.errormap): on failing records and on passing ones
    # whose budget reaches errormap.MAP_BUDGET.
    error_map: ErrorMap | None = None
    # The declared deviations (attncheck.expectations) that apply to this case: entry id ->
    # whether this comparison shows the deviation. None: none applies.
    deviations: Mapping[str, bool] | None = None
    # The entries that excuse this record's failure (a whole-case deviation): it is an
    # expected deviation, not a failure of the gate.
    expected: str | None = None
    # The family's contracts with elements whose elements alone hold this record's failure
    # (it passes without them): what `attncheck expectations init` may declare not promised.
    contracts_broken: tuple[str, ...] | None = None
    # Stamped by the writer.
    run_id: str = ""
    worker: str = ""
    worker_peak_rss_mb: float = 0.0
    schema_version: int = SCHEMA_VERSION

    @property
    def passed(self) -> bool:
        return self.outcome == "pass"

    @property
    def failing(self) -> bool:
        """Failed or errored, and no declared deviation excuses it: fails the gate."""
        return not self.passed and self.expected is None

    @property
    def budget(self) -> float:
        """err / allowed of the comparison (> 1 fails); a record without numbers ranks as
        0 when it passed (a lowering) and as infinitely bad when it did not."""
        if self.metrics is not None:
            return self.metrics.budget
        return 0.0 if self.passed else math.inf

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        for f in dataclasses.fields(Record):
            if f.name not in out:
                out[f.name] = getattr(self, f.name)
        out["timings"] = dict(self.timings)
        out["metrics"] = None if self.metrics is None else self.metrics.to_json()
        out["error_map"] = None if self.error_map is None else self.error_map.to_json()
        out["deviations"] = None if self.deviations is None else dict(self.deviations)
        out["contracts_broken"] = None if self.contracts_broken is None else list(self.contracts_broken)
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["classes"] = tuple(values.get("classes", ()))
        if values.get("contracts_broken") is not None:
            values["contracts_broken"] = tuple(values["contracts_broken"])
        if values.get("metrics") is not None:
            values["metrics"] = Comparison.from_json(values["metrics"])
        if values.get("error_map") is not None:
            values["error_map"] = ErrorMap.from_json(values["error_map"])
        return cls(**values)

    @property
    def key(self) -> tuple:
        return (self.kernel, self.impl, self.backend, self.case_id, self.direction, self.nodeid)

    # What a record says about the kernel; the rest (timings, the process that wrote it, its
    # memory, the run) differs from run to run by nature.
    _CIRCUMSTANCES = frozenset({"timings", "run_id", "worker", "worker_peak_rss_mb", "traceback", "repro"})

    def numbers(self) -> dict[str, Any]:
        """The record without its circumstances: equal platforms give equal numbers, bit
        for bit (errors, worst indices, budgets, error maps, verdicts)."""
        return {k: v for k, v in self.to_json().items() if k not in self._CIRCUMSTANCES}


def numbers_differ(a: list[Record], b: list[Record]) -> list[str]:
    """Where two runs' records differ in their numbers: a line per record key found in one
    run only or with other numbers (the first differing fields named)."""
    left, right = {r.key: r.numbers() for r in a}, {r.key: r.numbers() for r in b}
    out = [f"{key}: only in the {'first' if key in left else 'second'} run"
           for key in sorted(left.keys() ^ right.keys())]
    for key in sorted(left.keys() & right.keys()):
        if left[key] != right[key]:
            fields = sorted(f for f in left[key].keys() | right[key].keys() if left[key].get(f) != right[key].get(f))
            out.append(f"{key}: {', '.join(fields)} differ" + (
                f" (budget {left[key]['metrics']['budget']!r} vs {right[key]['metrics']['budget']!r})"
                if "metrics" in fields and "metrics" in left[key] and "metrics" in right[key] else ""))
    return out


# ------------------------------------------------------------------ writing
def _append(path: pathlib.Path, line: str) -> None:
    # One write per complete line, flushed: an interrupted run loses at most the line
    # being written, never corrupts earlier ones.
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()


def case_evidence(records: Iterable[Record]) -> list[CaseEvidence]:
    """Each case of these records, one per (family, implementation, case id), as the
    deviations that may explain it weigh it (``expectations.explaining``)."""
    cases: dict[tuple[str, str, str], list[Record]] = {}
    for r in records:
        cases.setdefault((r.kernel, r.impl_ref, r.case_id), []).append(r)
    evidence = []
    for (family, ref, case_id), runs in cases.items():
        failing = [r for r in runs if r.failing]
        evidence.append(CaseEvidence(
            family, ref, case_id, frozenset(runs[0].classes), numerics=any(r.metrics is not None for r in runs),
            excused=any(r.expected is not None for r in runs),
            failing=tuple(frozenset(r.contracts_broken or ()) for r in failing),
            repro=failing[0].repro if failing else runs[0].repro))
    return evidence


class RecordWriter:
    """One process's record, marker and kernel-time files of a run."""

    def __init__(self, report_dir: pathlib.Path, run_id: str, worker: str):
        self.path = pathlib.Path(report_dir) / RECORDS_DIR / f"{run_id}-{worker}{RECORDS_SUFFIX}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.worker = worker
        self.in_flight: CaseRun | None = None  # the case started and not yet recorded

    @property
    def faults_path(self) -> pathlib.Path:
        return self.path.with_suffix(FAULTS_SUFFIX)

    @property
    def stderr_path(self) -> pathlib.Path:
        return self.path.with_suffix(STDERR_SUFFIX)

    def log_faults(self) -> None:
        """Send this process' fatal-error dump (every thread's stack) to its faults file."""
        self._faults = open(self.faults_path, "w", encoding="utf-8")  # noqa: SIM115 - for the process' life
        faulthandler.enable(self._faults, all_threads=True)

    def dump_stacks(self, headline: str) -> None:
        """Write a headline and every thread's stack to the faults file (a hung process)."""
        self._faults.write(f"{headline}\n")
        self._faults.flush()
        faulthandler.dump_traceback(self._faults, all_threads=True)
        self._faults.flush()

    def started(self, case_run: CaseRun) -> None:
        """Say a case is about to run: if no record of it follows, the merge reports it."""
        _append(self.path.with_suffix(STARTED_SUFFIX), json.dumps(case_run.to_json(), sort_keys=True))
        self.in_flight = case_run

    def write(self, record: Record) -> None:
        # ru_maxrss is in KiB on Linux: the worker's peak so far, for the benchmark.
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        record = dataclasses.replace(record, run_id=self.run_id, worker=self.worker,
                                     worker_peak_rss_mb=round(peak_mb, 1))
        _append(self.path, json.dumps(record.to_json(), sort_keys=True, allow_nan=False))
        if self.in_flight is not None and _case_key(self.in_flight) == _case_key(record):
            self.in_flight = None

    def write_kernel_time(self, seconds: float) -> None:
        _append(self.path.with_suffix(KERNEL_TIME_SUFFIX), f"{seconds:.4f}")


def run_files(report_dir: pathlib.Path, run_id: str, suffix: str) -> list[pathlib.Path]:
    return sorted((pathlib.Path(report_dir) / RECORDS_DIR).glob(f"{run_id}-*{suffix}"))


def kernel_times_outside_records(report_dir: pathlib.Path, run_id: str) -> list[float]:
    return [float(line) for f in run_files(report_dir, run_id, KERNEL_TIME_SUFFIX)
            for line in f.read_text(encoding="utf-8").split()]


# ------------------------------------------------------------------ the run
@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a run was asked to verify and how it is judged, written when it starts: a merge
    done later (of a run that died, or of the shards of a run) knows its start, its
    arguments, which shard it was, its policy, its platform and its hypothesis profile."""

    run_id: str
    started: float  # time.time()
    args: tuple[str, ...] = ()
    shard: str | None = None  # "K/N" of --attncheck-shard
    policy: Policy | None = None  # None: a run that did not say (its merge judges with the defaults)
    platform: Platform | None = None
    profile: str | None = None
    skipped_backends: tuple[tuple[str, str], ...] = ()  # (backend, why it does not run)

    def write(self, report_dir: pathlib.Path) -> None:
        path = pathlib.Path(report_dir) / RECORDS_DIR / f"{self.run_id}{RUN_SUFFIX}"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"run_id": self.run_id, "started": self.started, "args": list(self.args), "shard": self.shard,
                "policy": None if self.policy is None else self.policy.to_json(),
                "platform": None if self.platform is None else self.platform.to_json(), "profile": self.profile,
                "skipped_backends": [list(s) for s in self.skipped_backends]}
        path.write_text(json.dumps(data))

    @classmethod
    def read(cls, report_dir: pathlib.Path, run_id: str) -> RunInfo | None:
        try:
            data = json.loads((pathlib.Path(report_dir) / RECORDS_DIR / f"{run_id}{RUN_SUFFIX}").read_text())
            return cls(data["run_id"], float(data["started"]), tuple(data.get("args", ())), data.get("shard"),
                       None if data.get("policy") is None else Policy.from_json(data["policy"]),
                       None if data.get("platform") is None else Platform.from_json(data["platform"]),
                       data.get("profile"), tuple((str(b), str(r)) for b, r in data.get("skipped_backends", ())))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def record_invalid_call(report_dir: pathlib.Path, run_id: str, nodeid: str, outcome: Mapping[str, Any]) -> None:
    """Append what one invalid-input test did, as the run goes: a run merged after it died
    still knows (``invalid_calls``)."""
    path = pathlib.Path(report_dir) / RECORDS_DIR / f"{run_id}{INVALID_CALLS_SUFFIX}"
    with path.open("a") as f:
        f.write(json.dumps({"nodeid": nodeid, **outcome}) + "\n")


def invalid_calls(report_dir: pathlib.Path, run_id: str) -> list[dict[str, Any]]:
    """What each invalid-input test of the run did (its last report), by node id."""
    path = pathlib.Path(report_dir) / RECORDS_DIR / f"{run_id}{INVALID_CALLS_SUFFIX}"
    last: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            data = json.loads(line)
        except ValueError:
            continue  # a line cut short by a run that died while writing it
        last[data.pop("nodeid")] = data
    return [last[nodeid] for nodeid in sorted(last)]


def run_ids(report_dir: pathlib.Path) -> list[str]:
    """The runs that left files in a report directory, oldest first."""
    directory = pathlib.Path(report_dir) / RECORDS_DIR
    started = {p.name[:-len(RUN_SUFFIX)]: p.stat().st_mtime for p in directory.glob(f"*{RUN_SUFFIX}")}
    return sorted(started, key=started.get)


def last_activity(report_dir: pathlib.Path, run_id: str) -> float | None:
    """When the run last wrote anything (for the wall time of a run merged after it died)."""
    times = [p.stat().st_mtime for p in (pathlib.Path(report_dir) / RECORDS_DIR).glob(f"{run_id}*")]
    return max(times, default=None)


# Another run's files untouched this long belong to a finished or dead run. A live run
# writes at least once per case, and a test times out after 900 s (pyproject.toml).
STALE_AFTER_S = 3600


def clear_stale_records(report_dir: pathlib.Path, run_id: str) -> None:
    """Remove other runs' files that nothing has written for STALE_AFTER_S.

    Never at the start of a run and never a recent file: a run that died and is to be
    merged later (``attncheck report --run``) keeps its files for an hour.
    """
    directory = pathlib.Path(report_dir) / RECORDS_DIR
    if directory.is_dir():
        horizon = time.time() - STALE_AFTER_S
        for f in directory.iterdir():
            if not f.name.startswith(run_id) and f.stat().st_mtime < horizon:
                f.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class Collection:
    """Every test a run collected before it was cut into shards: written by each process
    that collects (each xdist worker: they collect the same tests), read by the controller,
    which sees only its own shard's tests."""

    size: int
    digest: str

    @staticmethod
    def _path(report_dir: pathlib.Path, run_id: str) -> pathlib.Path:
        return pathlib.Path(report_dir) / RECORDS_DIR / f"{run_id}{COLLECTION_SUFFIX}"

    def write(self, report_dir: pathlib.Path, run_id: str) -> None:
        path = self._path(report_dir, run_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Every worker writes the same bytes, so writes that interleave still leave them.
        path.write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, report_dir: pathlib.Path, run_id: str) -> Collection | None:
        try:
            data = json.loads(cls._path(report_dir, run_id).read_text())
            return cls(int(data["size"]), str(data["digest"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


# ------------------------------------------------------------------ reading
def _inline_refs(node, defs: Mapping[str, Any]):
    """The schema with every local ``$ref`` replaced by its definition (the record schema
    has no recursion). Same verdicts; resolving references is a large share of validating
    a record."""
    if isinstance(node, dict):
        if set(node) == {"$ref"} and node["$ref"].startswith("#/$defs/"):
            return _inline_refs(defs[node["$ref"].removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


@functools.cache
def _schema() -> dict:
    return json.loads((pathlib.Path(__file__).parent / "schema.json").read_text())


@functools.cache
def _validator():
    import jsonschema

    schema = _schema()
    return jsonschema.Draft202012Validator({"$schema": schema["$schema"],
                                            **_inline_refs(schema["$defs"]["record"], schema["$defs"])})


@functools.cache
def report_validator():
    """The validator of a whole report.json."""
    import jsonschema

    return jsonschema.Draft202012Validator(_schema())


def _lines(path: pathlib.Path, problems: list[str]):
    """(line number, parsed JSON) of a file's lines; truncated or undecodable lines are problems."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        problems.append(f"{path.name}: not UTF-8 ({exc}); its records are ignored")
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError:
            problems.append(f"{path.name}:{lineno}: truncated line (interrupted write)")


def read_records(report_dir: pathlib.Path, run_id: str) -> tuple[list[Record], list[str]]:
    """A run's records, each validated against the schema, and the problems found (lines
    that are truncated, invalid, or of another schema version)."""
    records, problems = [], []
    for path in run_files(report_dir, run_id, RECORDS_SUFFIX):
        for lineno, data in _lines(path, problems):
            error = next(iter(_validator().iter_errors(data)), None)
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "record"
                problems.append(f"{path.name}:{lineno}: invalid record ({where}: {error.message[:200]})")
                continue
            try:
                records.append(Record.from_json(data))
            except ValueError as exc:  # valid JSON of the schema whose error map does not decode
                problems.append(f"{path.name}:{lineno}: invalid record ({exc})")
    records.sort(key=lambda r: r.key)
    return records, problems


def read_started(report_dir: pathlib.Path, run_id: str) -> tuple[list[tuple[str, CaseRun]], list[str]]:
    """The started markers of a run, each with the worker that wrote it."""
    started, problems = [], []
    for path in run_files(report_dir, run_id, STARTED_SUFFIX):
        worker = path.name[len(run_id) + 1:-len(STARTED_SUFFIX)]
        for lineno, data in _lines(path, problems):
            try:
                started.append((worker, CaseRun.from_json(data)))
            except TypeError as exc:
                problems.append(f"{path.name}:{lineno}: invalid started marker ({exc})")
    return started, problems


# The reason of the error record of a case that started and never produced a record.
UNFINISHED = "case started but never finished"


# How much of a dead process' native stderr its lost cases quote.
STDERR_QUOTED_LINES = 3


def fatal_errors(report_dir: pathlib.Path, run_id: str) -> dict[str, str]:
    """worker -> what ended it, for every process of the run that died of a fatal error or
    was ended by the watchdog: the fatal error and where the crashing thread was ("Fatal
    Python error: Aborted at File "k.py", line 3 in f"), and the last lines the process wrote
    to its native stderr before it died (XLA's message), from its faults and stderr files."""
    died = {}
    for path in run_files(report_dir, run_id, FAULTS_SUFFIX):
        lines = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
        error = next((line for line in lines if line.startswith(("Fatal Python error", TIMED_OUT))), None)
        if error is None:
            continue
        current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
        frame = lines[current + 1] if current is not None and current + 1 < len(lines) else ""
        cause = f"{error} at {frame}" if frame.startswith("File") else error
        native = path.with_suffix(STDERR_SUFFIX)
        tail = [line.strip() for line in (native.read_text(encoding="utf-8", errors="replace").splitlines()
                                          if native.is_file() else ()) if line.strip()][-STDERR_QUOTED_LINES:]
        if tail:
            cause += f"; its native stderr ended: {' | '.join(tail)[-600:]}"
        died[path.name[len(run_id) + 1:-len(FAULTS_SUFFIX)]] = cause
    return died


def _case_key(run: CaseRun) -> tuple:
    return (run.nodeid, run.case_id, run.impl, run.backend)


def unfinished(run_id: str, started: list[tuple[str, CaseRun]], records: list[Record],
               fates: Mapping[str, str], fatal: Mapping[str, str] | None = None) -> list[Record]:
    """An error record for every case that started and never produced a record; ``fates``
    says what happened to each test that failed (nodeid -> pytest's reason), ``fatal`` what
    killed a worker that died of a fatal error (``fatal_errors``)."""
    finished = {_case_key(r) for r in records}
    lost: dict[tuple, Record] = {}
    for worker, marker in started:
        key = _case_key(marker)
        if key in finished or key in lost:
            continue
        fate = fates.get(marker.nodeid) or "the run ended (killed or crashed) before the case finished"
        if fatal and worker in fatal:
            fate = f"{fate}; the process died: {fatal[worker]} (its faults and stderr files in the report's records)"
        lost[key] = Record(**{f.name: getattr(marker, f.name) for f in dataclasses.fields(CaseRun)},
                           direction="all", outcome="error", reason=f"{UNFINISHED}: {fate}",
                           run_id=run_id, worker=worker)
    return list(lost.values())


def duplicates(records: list[Record]) -> list[tuple]:
    """Keys that occur more than once: a merge must produce none."""
    seen, dup = set(), []
    for r in records:
        if r.key in seen:
            dup.append(r.key)
        seen.add(r.key)
    return dup
