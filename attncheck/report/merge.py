"""Merge a run's records into its report: validated records, the cases that started and
never finished, what was asked for and verified nothing, coverage holes, regressions. And
merge the reports of a run's shards into the report of the whole run."""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
from collections.abc import Mapping

from attncheck.env import Platform
from attncheck.expectations import STALE
from attncheck.report import accepted, coverage_table, model, parameter_coverage
from attncheck.report import records as rec
from attncheck.report.model import (FAIL, INCOMPLETE, DeviationStatus, InvalidCallOutcome, Report, ShardInfo,
                                    SkippedBackend, build, describe_tests, deviation_statuses, parameter_table,
                                    summarize, unprobed, unverified_targets)
from attncheck.report.policy import Policy

MUTATION_FILE = "mutation.json"


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """What the test session knows about a run besides its records."""

    complete: bool  # the session ran to its end (not interrupted, not merged after a death)
    wall_s: float | None = None
    # Tests that failed or errored: node id -> pytest's one-line reason (a timeout, a
    # crashed worker, a failing self-test).
    failed_tests: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Targets asked for (target id -> what asked); None when not known (a run merged after
    # it died before collecting).
    asked: Mapping[str, str] | None = None
    unavailable: tuple[str, ...] = ()  # backends asked for by name that cannot run here
    session_problems: tuple[str, ...] = ()  # e.g. pytest's exit status


def merge(directory: pathlib.Path, run_id: str, outcome: RunOutcome, policy: Policy | None = None, *,
          shard: ShardInfo | None = None) -> Report:
    """The report of a run from the files it wrote, judged by ``policy`` (default: the
    policy the run wrote when it started, else the defaults): with ``require_coverage`` an
    applicable bug class without a case and a parameter that kept one value (not declared
    fixed) are problems. A shard's report (``shard``) leaves the coverage holes and
    regressions to the merge of the shards: they are properties of the whole run."""
    directory = pathlib.Path(directory)
    info = rec.RunInfo.read(directory, run_id)
    policy = policy or (info.policy if info is not None and info.policy is not None else Policy())
    platform, profile = (None, None) if info is None else (info.platform, info.profile)
    skipped_backends = [] if info is None else [SkippedBackend(*s) for s in info.skipped_backends]
    invalid_calls = [InvalidCallOutcome(**c) for c in rec.invalid_calls(directory, run_id)]
    records, problems = rec.read_records(directory, run_id)
    started, marker_problems = rec.read_started(directory, run_id)
    problems += marker_problems
    records = sorted(records + rec.unfinished(run_id, started, records, outcome.failed_tests,
                                             rec.fatal_errors(directory, run_id)), key=lambda r: r.key)
    if not outcome.complete:
        problems.append("run interrupted: the report holds the records written before the stop")
    problems += outcome.session_problems
    # A test can fail without a failing record (a failing non-gate test, a harness error):
    # the report must not say PASS then.
    failing_tests = {r.nodeid for r in records if not r.passed}
    problems += [f"{nodeid} failed without a failing record: {reason[:300]}"
                 for nodeid, reason in sorted(outcome.failed_tests.items()) if nodeid not in failing_tests]
    regressions, differences, deviations = None, [], []
    if shard is None:
        holes, regressions, differences, deviations = _judge_whole_run(records, invalid_calls, policy, platform,
                                                                       profile)
        problems += holes
    unverified = list(outcome.unavailable)
    if outcome.asked is not None:
        unverified += unverified_targets(records, outcome.asked)
    return build(records, run_id=run_id, complete=outcome.complete, wall_s=outcome.wall_s, problems=problems,
                 unverified=unverified, skipped_backends=skipped_backends, policy=policy,
                 regressions=regressions, budget_differences=differences,
                 mutation=_read_json(directory / MUTATION_FILE),
                 shard=shard, platform=platform, profile=profile, deviations=deviations, invalid_calls=invalid_calls)


def _judge_whole_run(records: list[rec.Record], invalid_calls: list[InvalidCallOutcome], policy: Policy,
                     platform: Platform | None, profile: str | None
                     ) -> tuple[list[str], list[str] | None, list[str], list[DeviationStatus]]:
    """(problems: coverage holes of bug classes and parameters, and stale declared
    deviations; numerics regressions or None when no accepted budgets were given;
    differences from accepted budgets of another platform or profile; how each declared
    deviation stood)."""
    holes = []
    if policy.require_coverage:
        counts = coverage_table.table(records, policy.applicable)
        holes = [f"coverage: {kernel} never exercised {', '.join(names)}"
                 for kernel, names in coverage_table.missing(counts, policy.applicable).items()]
        table = parameter_table(records)
        holes += [f"parameter coverage: {kernel} never varied {', '.join(names)}"
                  for kernel, names in parameter_coverage.unvaried(table, policy.fixed_parameters).items()]
        holes += [f"value coverage: {kernel} never drew {', '.join(names)}"
                  for kernel, names in parameter_coverage.unreached(table, policy.fixed_parameters).items()]
        holes += [f"parameter coverage: {kernel}: the call of {n} case(s) could not be probed "
                  "(attncheck.parameters), so their parameters are unknown"
                  for kernel, n in unprobed(records).items()]
    deviations = deviation_statuses(records, invalid_calls, policy.expectations)
    holes += [f"stale expectation: {d.entry.describe()} ({d.entry.source}) no longer deviates: none of the {d.cases} "
              f"{'calls' if d.entry.kind == 'invalid_call' else 'cases'} that exercised it deviated, beyond what "
              "entries shown alone elsewhere explain; the kernel was fixed, remove the entry"
              for d in deviations if d.status == STALE]
    regressions, differences = None, []
    if policy.accepted_budgets:
        budgets = accepted.read(pathlib.Path(policy.accepted_budgets))
        regressions, differences = accepted.judge(summarize(records), budgets, policy.regression_floor, platform,
                                                  profile)
    return holes, regressions, differences, deviations


# ------------------------------------------------------------------ the shards of a run
class _Unusable(Exception):
    """A directory given to the merge holds no usable shard report; ``shard`` is the one
    its run said it was, when it said."""

    def __init__(self, message: str, shard: str | None = None):
        super().__init__(message)
        self.shard = shard


@dataclasses.dataclass(frozen=True)
class _ShardReport:
    directory: pathlib.Path
    info: ShardInfo
    data: dict  # its report.json, validated
    records: list[rec.Record]


def _read_shard(directory: pathlib.Path) -> _ShardReport:
    path = directory / "report.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _Unusable(f"{directory}: no report.json (the shard never ran, or this is not its report "
                        "directory)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _Unusable(f"{path}: unreadable ({exc})") from None
    error = next(iter(rec.report_validator().iter_errors(data)), None)
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "report"
        raise _Unusable(f"{path}: not a valid attncheck report ({where}: {error.message[:200]})")
    if "shard" not in data:
        run = rec.RunInfo.read(directory, data["run_id"])
        if run is not None and run.shard:
            raise _Unusable(f"shard {run.shard} ({directory}) did not finish: its report is {data['verdict']} "
                            f"(`attncheck report --report {directory} --run {data['run_id']}` merges what it "
                            "recorded)", run.shard)
        raise _Unusable(f"{directory}: not the report of a shard (its run had no --attncheck-shard)")
    return _ShardReport(directory, ShardInfo.from_json(data["shard"]), data,
                        [rec.Record.from_json(r) for r in data["records"]])


def merge_shards(directories: list[pathlib.Path]) -> Report:
    """The report of a whole run from its shards' report directories: the records of every
    shard, and coverage, summary, regressions and verdict computed on them exactly as for
    one unsharded run. A shard that is missing, given twice, did not finish or failed, or
    shards of different collections, make the verdict FAIL with a problem naming them."""
    problems: list[str] = []
    shards: dict[int, _ShardReport] = {}
    unfinished: set[int] = set()  # shards named by a report that did not finish (a problem already)
    counts: set[int] = set()
    for directory in map(pathlib.Path, directories):
        try:
            shard = _read_shard(directory)
        except _Unusable as exc:
            problems.append(str(exc))
            if exc.shard is not None:
                index, count = map(int, exc.shard.split("/"))
                unfinished.add(index)
                counts.add(count)
            continue
        info = shard.info
        counts.add(info.count)
        if info.index in shards:
            problems.append(f"shard {info.name} given twice: {shards[info.index].directory} and {directory}")
            continue
        shards[info.index] = shard
    if not counts:
        problems.append("no shard report among " + ", ".join(map(str, directories)))
    if len(counts) > 1:
        problems.append(f"the shards disagree on how many there are: {', '.join(map(str, sorted(counts)))}")
    count = max(counts, default=0)
    problems += [f"shard {index}/{count} is missing: no report of it among the directories given"
                 for index in range(1, count + 1) if index not in shards and index not in unfinished]
    ordered = [shards[index] for index in sorted(shards)]
    infos = [s.info for s in ordered]
    if len({(i.collection_size, i.collection_digest) for i in infos}) > 1 or any(i.collection_digest is None
                                                                                 for i in infos):
        problems.append("the shards collected different tests (another commit or other options): "
                        + ", ".join(f"{i.name}: {i.collection_size} tests, {i.collection_digest}" for i in infos))
    elif infos and len(infos) == count and sum(i.tests for i in infos) != infos[0].collection_size:
        problems.append(f"the shards ran {sum(i.tests for i in infos)} tests of the {infos[0].collection_size} "
                        "their run collected")
    differing = sorted({f.name for i in infos for f in dataclasses.fields(Policy)
                        if getattr(i.policy, f.name) != getattr(infos[0].policy, f.name)})
    if differing:
        problems.append(f"the shards were judged differently: their policies differ in {', '.join(differing)} "
                        "(the families' declarations, --attncheck-require-coverage, --attncheck-accepted-budgets, "
                        "--attncheck-regression-floor)")
    for s in ordered:
        if s.data["verdict"] in (FAIL, INCOMPLETE):
            problems.append(f"shard {s.info.name} ({s.directory}): {s.data['verdict']}")
        problems += [f"shard {s.info.name}: {p}" for p in s.data["problems"]]

    records = sorted((r for s in ordered for r in s.records), key=lambda r: r.key)
    problems += [f"a record in more than one shard: {key}" for key in rec.duplicates(records)]
    # One platform and profile when every shard ran on the same; else the accepted budgets
    # cannot be judged (each record is still judged against the oracle where it ran).
    platforms = {None if s.data.get("platform") is None else Platform.from_json(s.data["platform"]) for s in ordered}
    profiles = {s.data.get("profile") for s in ordered}
    platform = next(iter(platforms)) if len(platforms) == 1 else None
    profile = next(iter(profiles)) if len(profiles) == 1 else None
    policy = infos[0].policy if infos else Policy()
    invalid_calls = [InvalidCallOutcome(**c) for s in ordered for c in s.data.get("invalid_calls", [])]
    regressions, differences, deviations = None, [], []
    if infos:
        try:
            holes, regressions, differences, deviations = _judge_whole_run(records, invalid_calls, policy, platform,
                                                                           profile)
            problems += holes
        except accepted.AcceptedBudgetsError as exc:
            problems.append(f"--attncheck-accepted-budgets of the shards: {exc}")
    asked: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for i in infos:
        for target, outcomes in i.asked.items():
            asked[target].update(outcomes)
    unverified = list(dict.fromkeys(line for i in infos for line in i.unavailable))
    if infos:  # else nothing was asked of the shards: the problems say there are none
        unverified += unverified_targets(records, {t: describe_tests(c) for t, c in asked.items()})
    # A nightly shard also ran its share of the mutant catalogue (``attncheck mutate --shard``).
    mutations = {s.info.name: _read_json(s.directory / MUTATION_FILE) for s in ordered}
    mutation = None
    if any(mutations.values()):
        mutation = model.mutation_summary([r for m in mutations.values() if m for r in m.get("results", [])])
        problems += [f"shard {name}: no {MUTATION_FILE}: its share of the mutants did not run"
                     for name, m in mutations.items() if not m]
    walls = [s.data["wall_s"] for s in ordered]
    skipped = dict.fromkeys(SkippedBackend(**b) for s in ordered for b in s.data["skipped_backends"])
    # The merge is final: a shard missing or unfinished is a problem above, never "in progress".
    return build(records, run_id="+".join(s.data["run_id"] for s in ordered) or "no-shards", complete=True,
                 wall_s=None if not walls or None in walls else max(walls), problems=problems,
                 unverified=unverified, skipped_backends=list(skipped), policy=policy, regressions=regressions,
                 budget_differences=differences, mutation=mutation, platform=platform, profile=profile,
                 deviations=deviations, invalid_calls=invalid_calls)


def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
