"""Sharding a run (``--attncheck-shard K/N``) and merging the shards' reports into the
report of the whole run (``attncheck report merge``): the split of the tests, the merge of
hand-written shard reports, and a real 4-way sharded toy gate against the unsharded one."""

from __future__ import annotations

import configparser
import dataclasses
import itertools
import json
import pathlib
import random
import re
import statistics
import types

import jsonschema
import pytest

from attncheck import scheduling
from attncheck.env import Platform
from attncheck.mutation import campaign
from attncheck.report import accepted, merge, model, render
from attncheck.report.policy import Policy
from attncheck.report import records as rec
from tests.selftest import harness
from tests.selftest.test_report import APPLICABLE, record


# ---------------------------------------------------------------------- the split
NIGHTLY_DURATIONS = pathlib.Path("tests") / "nightly" / "durations.json"


def _item(nodeid: str, family: str | None = None, fail_fast: bool = False, lead: bool = False):
    markers = {}
    if family is not None:
        markers[scheduling.FAMILY_MARKER] = types.SimpleNamespace(args=(family,), kwargs={})
    if fail_fast:
        markers[scheduling.FAIL_FAST_MARKER] = types.SimpleNamespace(args=(), kwargs={"lead": lead})
    return types.SimpleNamespace(nodeid=nodeid, get_closest_marker=markers.get)


def _gate_like_items():
    """Coverage tests of three families (4, 3 and 2 of them), drawn tests, tests without a
    family, and tests without a recorded duration, with durations over two orders of
    magnitude."""
    rng = random.Random(5)
    items, durations = [], {}
    for family, coverage_tests in (("flash", 4), ("ragged", 3), ("ffn", 2)):
        for i in range(coverage_tests):
            item = _item(f"gate[{family}-coverage{i + 1}of{coverage_tests}]", family, fail_fast=True, lead=i == 0)
            items.append(item)
            durations[item.nodeid] = rng.uniform(1, 12)
        for backend in ("interpret", "hazards", "lower"):
            items.append(_item(f"gate[{family}-{backend}-drawn]", family))
            durations[items[-1].nodeid] = rng.uniform(5, 80)
        items.append(_item(f"gate[{family}-invalid]", family))
        durations[items[-1].nodeid] = 0.0  # recorded as free
    items += [_item(f"tests/gate/test_extra.py::test_{i}") for i in range(6)]
    durations.update({f"tests/gate/test_extra.py::test_{i}": rng.uniform(0.1, 9) for i in range(4)})  # 2 unknown
    items.append(_item("gate[newfamily-coverage]", "newfamily", fail_fast=True, lead=True))  # unknown
    return items, durations


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_shards_partition_the_tests_deterministically_balanced_and_coverage_first(count):
    items, durations = _gate_like_items()
    shard_of = scheduling.assign(items, durations, count)
    assert sorted(shard_of) == sorted(i.nodeid for i in items)
    assert set(shard_of.values()) == set(range(1, count + 1))
    # The same split whatever order the tests were collected in.
    for seed in range(3):
        shuffled = items[:]
        random.Random(seed).shuffle(shuffled)
        assert scheduling.assign(shuffled, durations, count) == shard_of
    # Balanced: no shard ends more than the longest test after another (a test without a
    # record counting as the median recorded one of its kind, none less than the minimum).
    def kind(item):
        return bool(item.get_closest_marker(scheduling.FAIL_FAST_MARKER))

    median = {k: statistics.median(durations[i.nodeid] for i in items if kind(i) == k and i.nodeid in durations)
              for k in (True, False)}
    seconds = {i.nodeid: max(scheduling.SHARD_MIN_TEST_S, durations.get(i.nodeid, median[kind(i)])) for i in items}
    loads = [sum(seconds[n] for n, s in shard_of.items() if s == k) for k in range(1, count + 1)]
    assert max(loads) - min(loads) <= max(seconds.values()), loads
    # Every family's coverage tests are spread as evenly as their number allows, and every
    # shard runs coverage tests first.
    coverage = [i for i in items if i.get_closest_marker(scheduling.FAIL_FAST_MARKER)]
    for family, tests in itertools.groupby(sorted(coverage, key=lambda i: i.nodeid.split("-")[0]),
                                           key=lambda i: i.nodeid.split("-")[0]):
        tests = list(tests)
        held = [sum(shard_of[t.nodeid] == k for t in tests) for k in range(1, count + 1)]
        assert max(held) - min(held) <= 1, (family, held)
    ordered = scheduling.run_order(items, durations)
    for k in range(1, count + 1):
        first = next(i for i in ordered if shard_of[i.nodeid] == k)
        assert first.get_closest_marker(scheduling.FAIL_FAST_MARKER), (k, first.nodeid)


def test_a_familys_coverage_tests_spread_even_where_another_familys_weigh_more():
    # By load alone both of b's 1 s tests would go to the shard without a's 10 s test, and
    # under -x the other shard would hold none of b's coverage.
    items = [_item("a-coverage", "a", fail_fast=True, lead=True),
             *(_item(f"b-coverage{i}of2", "b", fail_fast=True, lead=i == 1) for i in (1, 2))]
    shard_of = scheduling.assign(items, {"a-coverage": 10.0, "b-coverage1of2": 1.0, "b-coverage2of2": 1.0}, 2)
    assert shard_of["b-coverage1of2"] != shard_of["b-coverage2of2"]


def test_tests_without_any_recorded_duration_still_spread_over_the_shards():
    items = [_item(f"t{i}") for i in range(8)]
    shard_of = scheduling.assign(items, {}, 4)
    assert sorted(shard_of.values()) == [1, 1, 2, 2, 3, 3, 4, 4]


def test_the_nightly_shards_split_its_longest_tests_by_the_nightlys_own_durations():
    """The nightly draws 8x the CI's examples, so its drawn tests weigh what the CI's do not:
    split by the CI's durations, its two longest (the blockwise FFN's and flash's drawn
    tests) may share one of four shards, which with its mutants then nearly fills its time.
    tox's nightly env splits by the nightly's own record, and there its longest tests land in
    as many shards."""
    root = pathlib.Path(__file__).resolve().parents[2]
    tox = configparser.ConfigParser()
    tox.read(root / "tox.ini")
    given = re.search(r"--attncheck-durations (\S+)", tox["testenv:nightly"]["commands"])
    durations = scheduling.load(root / (given[1] if given else scheduling.DEFAULT_FILE))
    nightly = scheduling.load(root / NIGHTLY_DURATIONS)
    items = [_item(n, family[1] if (family := re.search(r"test_kernel_matches_oracle\[(\w+?)-", n)) else None,
                   fail_fast="-coverage" in n) for n in nightly]
    shard_of = scheduling.assign(items, durations, 4)
    longest = sorted(nightly, key=nightly.get, reverse=True)[:4]
    assert len({shard_of[n] for n in longest}) == 4, {n: (nightly[n], shard_of[n]) for n in longest}


@pytest.mark.parametrize("text", ["0/4", "5/4", "2", "a/b", "2/0", "-1/3"])
def test_a_malformed_shard_is_named(text):
    with pytest.raises(ValueError, match=rf"--attncheck-shard '{text}': expected K/N with 1 <= K <= N"):
        scheduling.Shard.parse(text)
    assert str(scheduling.Shard.parse(" 2 / 4 ")) == "2/4"


def test_the_shards_of_the_mutant_catalogue_partition_it():
    from attncheck.mutation.catalogue import CATALOGUE

    parts = [campaign.select(CATALOGUE, shard=scheduling.Shard(k, 3)) for k in (1, 2, 3)]
    assert sorted(m.id for part in parts for m in part) == sorted(m.id for m in CATALOGUE)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


# ---------------------------------------------------------------------- merging hand-written shards
TARGET = "toy_attention-builtin-xla"


def shard_info(index: int, count: int = 3, fixed_parameters=None, **overrides) -> model.ShardInfo:
    values = dict(tests=1, collection_size=count, collection_digest="0123456789abcdef",
                  asked={TARGET: {"passed": 1}}, unavailable=(),
                  policy=Policy(applicable=APPLICABLE, fixed_parameters=fixed_parameters or {}, require_coverage=True))
    return model.ShardInfo(index, count, **{**values, **overrides})


def write_shard(directory, records, info: model.ShardInfo | None, **overrides):
    report = model.build(records, **{**dict(run_id=f"run{info.index if info else 0}", complete=True, wall_s=2.0,
                                            problems=[], unverified=[], skipped_backends=[],
                                            policy=info.policy if info else Policy(applicable=APPLICABLE),
                                            shard=info), **overrides})
    render.write(directory, report)
    return directory


def probed(r: rec.Record) -> rec.Record:
    """The record with the parameters the probe would have found (its dtype varies)."""
    return dataclasses.replace(r, parameters={"q.dtype": r.dtype})


@pytest.fixture
def shards(tmp_path, monkeypatch):
    """Three shards of one passing run: shard 1 holds the causal case, shard 2 the bf16
    one, shard 3 a test whose cases all went to other tests."""
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    causal = [probed(record("causal", classes=("causal",), direction=d)) for d in ("out", "dq")]
    bf16 = [probed(record("bf16", classes=("bf16",), dtype="bfloat16", direction=d)) for d in ("out", "dq")]
    return {1: write_shard(tmp_path / "s1", causal, shard_info(1)),
            2: write_shard(tmp_path / "s2", bf16, shard_info(2)),
            3: write_shard(tmp_path / "s3", [], shard_info(3, asked={TARGET: {"skipped": 1}}),
                           unverified=[f"{TARGET}: no case verified (its tests: 1 skipped)"])}


def test_the_merge_judges_coverage_and_what_was_verified_on_the_whole_run(shards):
    report = merge.merge_shards(list(shards.values()))
    # Each class is exercised by one shard only, and shard 3 verified nothing alone: the run
    # as a whole did both, as one unsharded run would say.
    whole = model.build(sorted(report.records, key=lambda r: r.key), run_id="whole", complete=True, wall_s=2.0,
                        problems=[], unverified=[], skipped_backends=[], policy=Policy(applicable=APPLICABLE))
    assert (report.verdict, report.problems, report.unverified) == ("PASS", [], [])
    assert report.coverage == whole.coverage and report.summary == whole.summary and report.totals == whole.totals
    assert {c: n.cases for c, n in report.coverage["toy_attention"].items()} == {"causal": 1, "bf16": 1}
    assert report.run_id == "run1+run2+run3" and report.shard is None and report.complete
    # A class no shard exercised is a hole of the whole run.
    write_shard(shards[2], [], shard_info(2))
    holes = merge.merge_shards(list(shards.values()))
    assert holes.verdict == "FAIL" and holes.problems == [
        "coverage: toy_attention never exercised bf16",
        "parameter coverage: toy_attention never varied q.dtype (always float32)"]


def test_the_merge_judges_parameter_coverage_on_the_whole_run(tmp_path):
    def shard(index: int, causal: str, **info):
        records = [dataclasses.replace(record(f"c{index}", classes=("causal", "bf16")),
                                       parameters={"causal": causal, "block_q": "128"})]
        return write_shard(tmp_path / f"p{index}-{causal}", records, shard_info(index, 2, **info))

    # causal varies only across the shards; block_q never does.
    fixed = {"toy_attention": {"block_q": "the toy has one block size"}}
    report = merge.merge_shards([shard(1, "True", fixed_parameters=fixed), shard(2, "False", fixed_parameters=fixed)])
    assert (report.verdict, report.problems) == ("PASS", [])
    assert report.fixed_parameters == fixed
    same = merge.merge_shards([shard(1, "True", fixed_parameters=fixed), shard(2, "True", fixed_parameters=fixed)])
    assert same.problems == ["parameter coverage: toy_attention never varied causal (always True)"]
    undeclared = merge.merge_shards([shard(1, "True"), shard(2, "False")])
    assert undeclared.problems == ["parameter coverage: toy_attention never varied block_q (always 128)"]


def test_a_shard_leaves_coverage_holes_and_regressions_to_the_merge(tmp_path):
    rec.RecordWriter(tmp_path, "run1", "main").write(record("causal", classes=("causal",), budget=0.9))
    budgets = tmp_path / "accepted.json"
    platform = Platform("x86_64", "AVX2", 32, "0.12.0.1", "0.12.0.1", "2.5.5")
    accepted.write(budgets, accepted.from_summary(model.summarize([record("causal", budget=0.1)]), platform, "ci"))
    rec.RunInfo("run1", 0.0, platform=platform, profile="ci").write(tmp_path)

    def merged(shard):
        return merge.merge(tmp_path, "run1", merge.RunOutcome(complete=True),
                           Policy(applicable=APPLICABLE, require_coverage=True, accepted_budgets=str(budgets)),
                           shard=shard)

    # Alone, the run never exercised bf16 and its worst budget grew 9x ...
    whole = merged(None)
    assert whole.verdict == "FAIL" and whole.regressions
    assert "coverage: toy_attention never exercised bf16" in whole.problems
    # ... but as a shard, another shard may hold the bf16 case and the worse budgets.
    part = merged(shard_info(1))
    assert (part.verdict, part.problems, part.regressions, part.shard) == ("PASS", [], None, shard_info(1))


def _died(directory, index: int, count: int):
    """A shard whose run never merged: the placeholder report, and its run info."""
    render.write(directory, model.placeholder("dead"))
    rec.RunInfo("dead", 0.0, (), f"{index}/{count}").write(directory)
    return directory


BROKEN = {
    "missing": (lambda s, tmp: [s[1], s[3]], r"^shard 2/3 is missing: no report of it among the directories given$"),
    "failed": (lambda s, tmp: [s[1], write_shard(s[2], [record("bad", outcome="fail", budget=2.0)], shard_info(2)),
                               s[3]], r"^shard 2/3 \(.*s2\): FAIL$"),
    "died": (lambda s, tmp: [s[1], s[2], _died(tmp / "dead", 3, 3)],
             r"^shard 3/3 \(.*dead\) did not finish: its report is INCOMPLETE"),
    "twice": (lambda s, tmp: [s[1], s[2], s[2], s[3]], r"^shard 2/3 given twice: .*s2 and .*s2$"),
    "another collection": (lambda s, tmp: [s[1], s[2], write_shard(s[3], [], shard_info(
        3, collection_digest="fedcba9876543210"))], r"^the shards collected different tests"),
    "another count": (lambda s, tmp: [s[1], s[2], s[3], write_shard(tmp / "s4", [], shard_info(4, count=4))],
                      r"^the shards disagree on how many there are: 3, 4$"),
    "not a shard": (lambda s, tmp: [s[1], s[2], s[3], write_shard(tmp / "whole", [], None)],
                    r"whole: not the report of a shard \(its run had no --attncheck-shard\)$"),
    "no report": (lambda s, tmp: [s[1], s[2], s[3], tmp / "nothing"], r"nothing: no report\.json"),
    "no shard at all": (lambda s, tmp: [tmp / "nothing"], r"^no shard report among .*nothing$"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_missing_failed_or_foreign_shard_fails_the_merge_and_is_named(shards, tmp_path, case):
    given, problem = BROKEN[case]
    report = merge.merge_shards(given(shards, tmp_path))
    assert report.verdict == "FAIL"
    assert any(re.search(problem, p) for p in report.problems), report.problems
    assert report.unverified == []  # every target given was verified; the problems say what is wrong


def test_the_shares_of_the_mutant_catalogue_are_summarized_together(shards):
    def result(mutant: str, status: str) -> dict:
        return {"id": mutant, "family": "toy_attention", "status": status, "seconds": 1.0}

    for index, results in ((1, [result("m1", "killed"), result("m4", "killed")]), (2, [result("m2", "survived")])):
        (shards[index] / merge.MUTATION_FILE).write_text(json.dumps(model.mutation_summary(results)))
    report = merge.merge_shards(list(shards.values()))
    assert report.mutation["per_kernel"]["toy_attention"] == {
        "total": 3, "killed": 2, "survived": 1, "equivalent": 0, "timed out": 0, "invalid": 0, "kill_rate": 2 / 3}
    assert report.problems == ["shard 3/3: no mutation.json: its share of the mutants did not run"]


def test_a_shard_that_died_and_its_finished_rerun_are_merged_as_the_rerun_plus_the_death(shards, tmp_path):
    report = merge.merge_shards([_died(tmp_path / "dead", 2, 3), *shards.values()])
    assert [p.split(" (")[0] for p in report.problems] == ["shard 2/3"]
    assert "did not finish" in report.problems[0] and report.verdict == "FAIL"
    assert report.totals.cases == 2  # the rerun's records are in


# ---------------------------------------------------------------------- a real sharded toy gate
COMPARED = ("verdict", "totals", "summary", "coverage", "device_growth", "skipped_backends", "problems", "unverified")


def _comparisons(report: dict) -> list[tuple]:
    return sorted((r["kernel"], r["impl"], r["backend"], r["case_id"], r["direction"], r["outcome"], r["nodeid"])
                  for r in report["records"])


def test_four_shards_of_the_toy_gate_merge_into_the_report_of_the_unsharded_run(gate_dir):
    # As in CI: every run writes the default report directory of its own checkout (so the
    # reproducers are the same), one shard with xdist workers inside.
    report = "reports/latest"
    runs = {name: gate_dir / name for name in ("whole", "s1", "s2", "s3", "s4")}
    for directory in runs.values():
        directory.mkdir()
    # Asked to require coverage, as ./dev gate is: the shards leave it to the merge.
    procs = {"whole": harness.start_gate(runs["whole"], report, "--attncheck-require-coverage", "-n", "0")}
    for k in range(1, 5):
        procs[f"s{k}"] = harness.start_gate(runs[f"s{k}"], report, "--attncheck-require-coverage",
                                            f"--attncheck-shard={k}/4", "-n", "2" if k == 2 else "0")
    outputs = {name: p.communicate(timeout=harness.RUN_TIMEOUT_S)[0] for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, outputs[name]
    shard_dirs = [str(runs[f"s{k}"] / report) for k in range(1, 5)]
    merged = harness.cli(gate_dir, "report", "merge", *shard_dirs, "--report", "merged")
    assert merged.returncode == 0, merged.stdout + merged.stderr
    whole, joined = harness.load_report(runs["whole"] / report), harness.load_report(gate_dir / "merged")
    jsonschema.Draft202012Validator(harness.load_schema()).validate(joined)
    # The shards ran every test of the run once, each shard a part.
    ran = [set(scheduling.load(runs[f"s{k}"] / report / scheduling.REPORT_FILE)) for k in range(1, 5)]
    assert all(ran) and sum(map(len, ran)) == len(set().union(*ran))
    assert set().union(*ran) == set(scheduling.load(runs["whole"] / report / scheduling.REPORT_FILE))
    assert set(scheduling.load(gate_dir / "merged" / scheduling.REPORT_FILE)) == set().union(*ran)
    assert [harness.load_report(runs[f"s{k}"] / report)["shard"]["index"] for k in range(1, 5)] == [1, 2, 3, 4]
    # ... and their merge is the unsharded run's report.
    assert whole["verdict"] == "PASS" and whole["records"]
    assert _comparisons(joined) == _comparisons(whole)
    assert {k: joined[k] for k in COMPARED} == {k: whole[k] for k in COMPARED}
    assert "shard" not in joined

    # Without shard 2 the merge fails and names it.
    partial = harness.cli(gate_dir, "report", "merge", *shard_dirs[:1], *shard_dirs[2:], "--report", "partial")
    assert partial.returncode == 1
    assert "shard 2/4 is missing" in harness.load_report(gate_dir / "partial")["problems"][0]
    assert partial.stdout.startswith("# attncheck: FAIL")


def test_the_merge_command_refuses_to_overwrite_a_shard(pytester):
    result = harness.cli(pytester.path, "report", "merge", "a", "b", "--report", "b")
    assert result.returncode == 2
    assert "--report b: also given as a shard" in result.stderr


def test_shard_info_survives_its_json():
    info = shard_info(2, unavailable=("backend tpu requested but unavailable: no TPU",))
    assert model.ShardInfo.from_json(json.loads(json.dumps(info.to_json()))) == info
    assert dataclasses.replace(info, index=3).name == "3/3"
