"""The merged report of a run: its records, what they add up to, and the verdict.

The verdict has four values. PASS: every family x implementation x backend the run asked
for verified at least one case, no comparison failed, nothing went wrong around them
(pytest's own status, lost or invalid records, coverage holes, regressions). FAIL: a
comparison failed or something went wrong. NO CASES: nothing failed, but something asked
for verified nothing (a backend that is not there, a selection that matched nothing, a
collect-only run): a gate that verified nothing must not read as green. INCOMPLETE: the
run is in progress, or died before it could merge (the report directory says so from the
moment a run starts).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping

from attncheck import interpret_compat
from attncheck.env import Platform
from attncheck.expectations import (INVALID_CALL, NOT_EXERCISED, NOT_UNDER_TEST, OCCURS, STALE, Expectation,
                                    own_evidence, refused, unsupported_lines)
from attncheck.report import coverage_table, parameter_coverage
from attncheck.report.policy import Declared, Policy
from attncheck.report.records import SCHEMA_VERSION, Record, target_id

PASS, FAIL, NO_CASES, INCOMPLETE = "PASS", "FAIL", "NO CASES", "INCOMPLETE"


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One kernel x impl x backend x dtype x direction."""

    kernel: str
    impl: str
    backend: str
    dtype: str
    direction: str
    cases: int
    comparisons: int
    failures: int
    worst_budget: float  # of the comparisons that are not expected deviations
    worst_case: str
    worst_repro: str
    deviations: int = 0  # comparisons that failed as a declared deviation expects


@dataclasses.dataclass(frozen=True)
class DeviceGrowth:
    """Worst error of a kernel x direction x dtype on one device count."""

    kernel: str
    direction: str
    dtype: str
    devices: int
    worst_max_abs: float


@dataclasses.dataclass(frozen=True)
class SkippedBackend:
    backend: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Totals:
    records: int
    cases: int
    failures: int
    deviations: int = 0  # failing comparisons a declared deviation expects


@dataclasses.dataclass(frozen=True)
class InvalidCallOutcome:
    """What one invalid call did to one implementation under test: "passed" (rejected with
    an error naming the argument), "failed", "expected" (a declared deviation: accepted,
    or rejected without naming the argument, as its entry says) or "stale" (its entry
    expects a deviation and the implementation now rejects the call)."""

    family: str
    impl: str
    impl_ref: str
    call: str
    outcome: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class DeviationStatus:
    """How one declared deviation stood in a run (``attncheck.expectations``): it occurs,
    it is stale (the cases or calls that exercise it all passed), or nothing exercised it;
    ``cases``: the cases (or calls) it applied to, ``shown``: those that showed it."""

    entry: Expectation
    status: str
    cases: int
    shown: int

    def to_json(self) -> dict:
        return {"entry": self.entry.to_json(), "status": self.status, "cases": self.cases, "shown": self.shown}

    @classmethod
    def from_json(cls, data: Mapping) -> DeviationStatus:
        return cls(Expectation.from_json(data["entry"]), data["status"], data["cases"], data["shown"])


def deviation_statuses(records: list[Record], invalid_calls: list[InvalidCallOutcome],
                       entries: tuple[Expectation, ...]) -> list[DeviationStatus]:
    """Each declared deviation's status over a whole run's records and invalid calls, for the
    families the run verified. A case whose failure several declared deviations may explain
    (a crash touches the whole case) is evidence for one of them only if no other of them
    is confirmed, i.e. shown somewhere alone: an entry all of whose failing cases another,
    confirmed entry explains has shown nothing of its own, and is stale."""
    verified = {r.kernel for r in records} | {c.family for c in invalid_calls}
    exercised: dict[tuple, set[str]] = defaultdict(set)  # (kernel, impl, case, backend) -> entries
    shown_in: dict[tuple, set[str]] = defaultdict(set)
    for r in records:
        key = (r.kernel, r.impl_ref, r.case_id, r.backend)
        for entry_id, shown in (r.deviations or {}).items():
            exercised[key].add(entry_id)
            if shown:
                shown_in[key].add(entry_id)
    evidence = own_evidence(shown_in)
    tested = {(r.kernel, r.impl_ref) for r in records} | {(c.family, c.impl_ref) for c in invalid_calls}
    out = []
    for entry in (e for e in entries if e.family in verified):
        if (entry.family, entry.implementation) not in tested:
            out.append(DeviationStatus(entry, NOT_UNDER_TEST, 0, 0))
            continue
        if entry.kind == INVALID_CALL:
            calls = [c for c in invalid_calls if (c.family, c.impl_ref, c.call) ==
                     (entry.family, entry.implementation, entry.name)]
            cases, shown = len(calls), sum(c.outcome == "expected" for c in calls)
            stale = any(c.outcome == "stale" for c in calls)
        else:
            keys = [key for key, ids in exercised.items() if entry.id in ids and key[0] == entry.family]
            cases = len(keys)
            shown = evidence.get(entry.id, 0)
            stale = cases > 0 and shown == 0
        status = NOT_EXERCISED if cases == 0 else STALE if stale else OCCURS
        out.append(DeviationStatus(entry, status, cases, shown))
    return out


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """Which shard of a run (``--attncheck-shard K/N``) a report is, and what merging the
    shards needs besides their records (``attncheck report merge``): the whole collection,
    to find a missing shard; what each target's tests did, to say which target verified
    nothing in the run as a whole; and the run's policy, which judges what is judged on the
    whole run only, never on a shard (coverage holes and numerics regressions: a shard
    holds part of each family's cases)."""

    index: int  # from 1
    count: int
    tests: int  # the tests this shard ran
    collection_size: int | None  # the tests of the whole run (None: the shard collected nothing)
    collection_digest: str | None
    asked: Mapping[str, Mapping[str, int]]  # target id -> outcome of its tests -> how many
    unavailable: tuple[str, ...]  # backends asked for by name that cannot run
    policy: Policy

    @property
    def name(self) -> str:
        return f"{self.index}/{self.count}"

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "policy"}
        return _json_safe({**out, "policy": self.policy.to_json()})

    @classmethod
    def from_json(cls, data: Mapping) -> ShardInfo:
        return cls(**{**data, "unavailable": tuple(data["unavailable"]), "policy": Policy.from_json(data["policy"])})


@dataclasses.dataclass(frozen=True)
class Report:
    run_id: str
    verdict: str
    complete: bool
    wall_s: float | None  # None: not known (a run merged after it died without a start time)
    totals: Totals
    summary: list[SummaryRow]
    coverage: Mapping[str, Mapping[str, coverage_table.ClassCount]]
    device_growth: list[DeviceGrowth]
    skipped_backends: list[SkippedBackend]
    problems: list[str]  # why the verdict is FAIL besides failing records
    unverified: list[str]  # what was asked for and verified nothing (NO CASES)
    # What interpret mode could not run, one line per backend x implementation x operation,
    # then what implementations refused as declared unsupported (expectations.unsupported_lines).
    # Those cases are error records: this names them, it never changes the verdict.
    limitations: list[str]
    regressions: list[str] | None  # None: no accepted budgets were given
    records: list[Record]
    mutation: dict | None = None
    # family -> parameter -> values it took (attncheck.parameters), and the parameters a
    # family keeps at one value on purpose, with the reason.
    parameters: Mapping[str, Mapping[str, parameter_coverage.ParameterValues]] = dataclasses.field(default_factory=dict)
    fixed_parameters: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    declared: Mapping[str, Declared] = dataclasses.field(default_factory=dict)  # family -> its declarations
    shard: ShardInfo | None = None  # None: not a shard of a run
    # What the numbers belong to (None: not known, or shards of several platforms) and the
    # hypothesis profile that drew the cases: accepted budgets are judged only where both match.
    platform: Platform | None = None
    profile: str | None = None
    # Worst budgets past the accepted ones' regression limit where the accepted budgets come
    # from another platform or profile: shown, never failing (attncheck.report.accepted).
    budget_differences: list[str] = dataclasses.field(default_factory=list)
    # The declared deviations of the run's implementations and how each stood, and what
    # every invalid call did to every implementation under test.
    deviations: list[DeviationStatus] = dataclasses.field(default_factory=list)
    invalid_calls: list[InvalidCallOutcome] = dataclasses.field(default_factory=list)

    @property
    def failing(self) -> list[Record]:
        return [r for r in self.records if r.failing]

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["totals"] = dataclasses.asdict(self.totals)
        out["summary"] = [dataclasses.asdict(r) for r in self.summary]
        out["coverage"] = {k: {c: dataclasses.asdict(n) for c, n in v.items()} for k, v in self.coverage.items()}
        out["parameters"] = {k: {name: values.cases for name, values in v.items()} for k, v in self.parameters.items()}
        out["declared"] = {k: dataclasses.asdict(v) for k, v in self.declared.items()}
        out["device_growth"] = [dataclasses.asdict(g) for g in self.device_growth]
        out["skipped_backends"] = [dataclasses.asdict(s) for s in self.skipped_backends]
        out["records"] = [r.to_json() for r in self.records]
        out["platform"] = None if self.platform is None else self.platform.to_json()
        out["deviations"] = [d.to_json() for d in self.deviations]
        out["invalid_calls"] = [dataclasses.asdict(c) for c in self.invalid_calls]
        out["schema_version"] = SCHEMA_VERSION
        if self.regressions is None:
            del out["regressions"]
        if self.shard is None:
            del out["shard"]
        else:
            out["shard"] = self.shard.to_json()
        return _json_safe(out)


def _json_safe(value):
    """JSON has no inf/nan (JSON.parse rejects Python's Infinity): write them as "inf"/"nan",
    as records do (e.g. the worst budget of a group holding a crashed case)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _json_safe(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json_safe(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def summarize(records: list[Record]) -> list[SummaryRow]:
    groups: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        groups[(r.kernel, r.impl, r.backend, r.dtype, r.direction)].append(r)
    rows = []
    for key, rs in sorted(groups.items()):
        # An expected deviation is not judged: its budget ranks nothing.
        judged = [r for r in rs if r.expected is None] or rs
        worst = max(judged, key=lambda r: r.budget if r.expected is None else -1.0)
        rows.append(SummaryRow(*key, cases=len({r.case_id for r in rs}), comparisons=len(rs),
                               failures=sum(r.failing for r in rs),
                               worst_budget=worst.budget if worst.expected is None else 0.0,
                               worst_case=worst.case_id, worst_repro=worst.repro,
                               deviations=sum(r.expected is not None for r in rs)))
    return rows


def device_growth(records: list[Record]) -> list[DeviceGrowth]:
    """Worst error per kernel x direction x device count: error growth with ring size."""
    worst: dict[tuple, float] = {}
    for r in records:
        if r.device_count > 1 or r.kernel.startswith("ring"):
            key = (r.kernel, r.direction, r.dtype, r.device_count)
            error = r.metrics.max_abs if r.metrics is not None else 0.0
            worst[key] = max(worst.get(key, 0.0), error)
    return [DeviceGrowth(*key, worst_max_abs=value) for key, value in sorted(worst.items())]


def verdict(*, failures: int, problems: list[str], unverified: list[str], complete: bool = True) -> str:
    if failures or problems:
        return FAIL
    if unverified:
        return NO_CASES
    return PASS if complete else INCOMPLETE


def describe_tests(outcomes: Mapping[str, int]) -> str:
    """What a target's tests did (outcome -> how many), for the line that says it verified
    nothing."""
    return "its tests: " + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))


def unverified_targets(records: list[Record], asked: Mapping[str, str]) -> list[str]:
    """For every target asked for (target id -> what asked for it) with no case, a line
    saying so (a case its implementation refused as unsupported verified nothing); and
    one when nothing at all was asked for."""
    if not asked:
        return ["no gate test was selected: nothing was verified (check -k, --attncheck-kernel and "
                "--attncheck-backend, and that the run was not --collect-only)"]
    verified = {target_id(r.kernel, r.impl, r.backend) for r in records if not refused(r)}
    return [f"{target}: no case verified ({why})" for target, why in sorted(asked.items()) if target not in verified]


def parameter_table(records: list[Record]) -> dict[str, dict[str, parameter_coverage.ParameterValues]]:
    """family -> parameter -> the values it took, counting each case once."""
    seen = {}
    for r in records:
        if r.parameters is not None:
            seen.setdefault((r.kernel, r.case_id), r.parameters)
    return parameter_coverage.table((kernel, found) for (kernel, _), found in seen.items())


def unprobed(records: list[Record]) -> dict[str, int]:
    """family -> cases that ran but whose call could not be probed: their parameters are
    unknown, so the parameter table cannot vouch for them."""
    ran, probed = set(), set()
    for r in records:
        if r.passed:
            ran.add((r.kernel, r.case_id))
        if r.parameters is not None:
            probed.add((r.kernel, r.case_id))
    counts: dict[str, int] = defaultdict(int)
    for kernel, _ in ran - probed:
        counts[kernel] += 1
    return dict(sorted(counts.items()))


def build(records: list[Record], *, run_id: str, complete: bool, wall_s: float | None, problems: list[str],
          unverified: list[str], skipped_backends: list[SkippedBackend], policy: Policy,
          regressions: list[str] | None = None, budget_differences: list[str] | None = None,
          mutation: dict | None = None, shard: ShardInfo | None = None, platform: Platform | None = None,
          profile: str | None = None, deviations: list[DeviationStatus] | None = None,
          invalid_calls: list[InvalidCallOutcome] | None = None) -> Report:
    """The report of a run from its records, judged by its policy."""
    counts = coverage_table.table(records, policy.applicable)
    problems = list(problems) + list(regressions or ())
    failures = sum(r.failing for r in records)
    return Report(
        run_id=run_id, complete=complete, wall_s=wall_s,
        verdict=verdict(failures=failures, problems=problems, unverified=unverified, complete=complete),
        totals=Totals(records=len(records), cases=len({(r.kernel, r.case_id) for r in records}), failures=failures,
                      deviations=sum(r.expected is not None for r in records)),
        summary=summarize(records), coverage=counts, device_growth=device_growth(records),
        skipped_backends=skipped_backends, problems=problems, unverified=list(unverified),
        limitations=interpret_compat.limitation_lines(records) + unsupported_lines(records), regressions=regressions,
        records=records,
        mutation=mutation, parameters=parameter_table(records),
        fixed_parameters={k: dict(v) for k, v in policy.fixed_parameters.items()},
        declared={k: v for k, v in policy.declared.items() if v.contracts}, shard=shard,
        platform=platform, profile=profile, budget_differences=list(budget_differences or ()),
        deviations=list(deviations or ()), invalid_calls=list(invalid_calls or ()))


def placeholder(run_id: str) -> Report:
    """What the report directory says while a run is in progress (and if it dies)."""
    return Report(run_id=run_id, verdict=INCOMPLETE, complete=False, wall_s=None, totals=Totals(0, 0, 0),
                  summary=[], coverage={}, device_growth=[], skipped_backends=[],
                  problems=[f"run {run_id} is in progress, or died before its report was merged: "
                            f"`attncheck report --run {run_id}` merges what it recorded"],
                  unverified=[], limitations=[], regressions=None, records=[])


def mutation_summary(results: list[dict]) -> dict:
    """The report's mutation section from the campaign's results (``mutation.json`` of
    ``attncheck mutate``, one per shard): per family, and the kill rate of the judged ones."""
    per_kernel: dict[str, dict] = {}
    for r in results:
        row = per_kernel.setdefault(r["family"], {"total": 0, "killed": 0, "survived": 0, "equivalent": 0,
                                                   "timed out": 0, "invalid": 0})
        row["total"] += 1
        row[r["status"]] += 1
    for row in per_kernel.values():
        judged = row["total"] - row["equivalent"] - row["invalid"]
        row["kill_rate"] = row["killed"] / judged if judged else 1.0
    judged = [r for r in results if r["status"] not in ("equivalent", "invalid")]
    return {"per_kernel": per_kernel, "results": results,
            "kill_rate": sum(r["status"] == "killed" for r in judged) / len(judged) if judged else 1.0}
