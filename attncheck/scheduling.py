"""Test order from measured durations: the tests of changed kernels first, fail-fast tests
first and shortest first, then the rest longest first; and the split of a run into shards
balanced by the same durations.

The gate's tests differ in cost by two orders of magnitude (one kernel family on one
backend takes a minute, an invalid-input check a millisecond). xdist hands tests out in
collection order, so a long test collected last leaves one worker running it while the
other idles. Sorting by the durations of an earlier run, longest first, and handing out
one test at a time (``--maxschedchunk 1``) makes the tail of the run short tests only.

A pull request that changes a kernel is most likely to break that kernel's family: the
families whose implementation sources differ from those the durations were recorded with
(``tests/kernel_sources.json``, written with them by ``attncheck durations update``) run
all their tests first, the family whose own module changed before those built on it, so
``pytest -x`` names a bug in the changed kernel before it spends a minute on the families
the change cannot reach.

Order changes only speed, never verdicts: the gate's tests are order-independent (the CI
profile draws every case from a fixed seed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import math
import pathlib
import re
import statistics
import sys
from collections.abc import Iterable, Mapping

DEFAULT_FILE = pathlib.Path("tests") / "durations.json"
REPORT_FILE = "durations.json"
SOURCES_FILE = "kernel_sources.json"  # beside the durations file
# The packaged gate's durations ship with it: a repository that adopts the gate has none of
# its own for those tests.
PACKAGED_FILE = pathlib.Path(__file__).parent / "gate" / "durations.json"
PACKAGED_TESTS = "attncheck/gate/"


def test_key(nodeid: str, path: str | pathlib.Path | None = None) -> str:
    """A test's key in a durations file: its node id, but the packaged gate's tests by
    their path inside the package wherever it is installed. Their node id does not say it
    (pytest names a test outside the rootdir from the package: `test_gate.py::...`); their
    ``path`` does (an item's path, or a report's ``location[0]``)."""
    where, _, name = nodeid.partition("::")
    where = str(path).replace("\\", "/") if path is not None else where
    at = where.rfind(PACKAGED_TESTS)
    return f"{where[at:]}::{name}" if at >= 0 else nodeid


def _key(item) -> str:
    return test_key(item.nodeid, getattr(item, "path", None))


def load(path: pathlib.Path) -> dict[str, float]:
    """test key -> seconds; empty when the file does not exist."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
        raise ValueError(f"{path}: expected a JSON object of test id -> seconds")
    return {test_key(k): v for k, v in data.items()}


def load_with_packaged(path: pathlib.Path) -> dict[str, float]:
    """The durations a run orders its tests by: the packaged gate's, then the repository's
    file (``path``) over them."""
    return {**load(PACKAGED_FILE), **load(path)}


FAIL_FAST_MARKER = "attncheck_fail_fast"
FAMILY_MARKER = "attncheck_family"


def _fail_fast(item):
    return item.get_closest_marker(FAIL_FAST_MARKER)


def _typical(items: list, durations: dict[str, float], *, fail_fast: bool) -> float:
    """The median recorded duration of the fail-fast tests (or of the others): what a test
    of that kind without a record counts as."""
    known = [durations[_key(i)] for i in items if bool(_fail_fast(i)) == fail_fast and _key(i) in durations]
    return statistics.median(known) if known else 0.0


def run_order(items: list, durations: dict[str, float], changed: Mapping[str, int] | None = None) -> list:
    """The families in ``changed`` (``changed_families``: family -> rank) first, all their
    tests, then the others; within each part, fail-fast tests (the families' coverage
    examples) first: under ``pytest -x`` the time to the first failure is what counts.
    Among the changed families' tests of one kind, those whose own kernel module changed
    (rank 0) come before those that only use a changed module (rank 1), and all their
    fail-fast tests before any of their others: a change to the flash kernel file may break
    only the ring kernel built on it, which must not wait behind the flash family's drawn
    cases. Each family's lead test (``lead=True``: its simplest classes, where most bugs
    show) runs first, then its other fail-fast tests, each kind shortest first: a bug shows
    when the test holding the example that exposes it ends, and with tests of a few
    examples each, shortest first ends the most examples soonest. Longest first would make a
    short ring coverage test wait behind the 8-device ring flash ones.

    A fail-fast test with no record yet counts as the median of those that have one: they
    are alike in size (a few examples each), and a renumbered coverage split must not
    send a family's coverage to either end. Then every other test by recorded duration,
    longest first, so that the tail of the run is short tests only; one with no record
    counts as longest (it may be long, and a long test must not be the one left at the
    end). Stable, so equal keys keep collection order."""
    changed = changed or {}
    typical_fail_fast = _typical(items, durations, fail_fast=True)

    def key(item):
        family = _family(item)
        part, rank = (0, changed[family]) if family in changed else (1, 0)
        marker = _fail_fast(item)
        if marker is None:
            return (part, 1, rank, 0, -durations.get(_key(item), math.inf))
        return (part, 0, rank, 0 if marker.kwargs.get("lead") else 1, durations.get(_key(item), typical_fail_fast))

    return sorted(items, key=key)


def _family(item) -> str:
    marker = item.get_closest_marker(FAMILY_MARKER)
    return marker.args[0] if marker is not None else ""


# ------------------------------------------------------------------ changed kernels
def modules_used(impl_ref: str) -> dict[str, pathlib.Path]:
    """The source an implementation ("module:function") runs: module name -> file, for its
    module and the modules it uses from its own directory and below (a ring kernel built on
    the flash kernel beside it changes when that one does). Modules elsewhere (jax, numpy)
    are the environment's, pinned by the lock file."""
    module = importlib.import_module(impl_ref.partition(":")[0])
    root = pathlib.Path(inspect.getfile(module)).resolve().parent
    seen: dict[str, pathlib.Path] = {}
    pending = [module]
    while pending:
        current = pending.pop()
        try:
            path = pathlib.Path(inspect.getfile(current)).resolve()
        except TypeError:  # built in
            continue
        if current.__name__ in seen or not path.is_relative_to(root):
            continue
        seen[current.__name__] = path
        for value in vars(current).values():
            used = value if inspect.ismodule(value) else sys.modules.get(getattr(value, "__module__", None) or "")
            if used is not None and used.__name__ not in seen:
                pending.append(used)
    return seen


def _file_digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:20]


@dataclasses.dataclass(frozen=True)
class Sources:
    """What the durations were recorded with (``kernel_sources.json``): the implementations
    and a digest of every module they run."""

    implementations: frozenset[str]
    modules: Mapping[str, str]  # module name -> digest of its file


def sources_path(durations_path: pathlib.Path) -> pathlib.Path:
    return durations_path.with_name(SOURCES_FILE)


def load_sources(path: pathlib.Path) -> Sources:
    """The recorded sources; none when the file is absent."""
    if not path.is_file():
        return Sources(frozenset(), {})
    data = json.loads(path.read_text())
    if not (isinstance(data, dict) and set(data) == {"implementations", "modules"}
            and isinstance(data["implementations"], list) and all(isinstance(r, str) for r in data["implementations"])
            and isinstance(data["modules"], dict) and all(isinstance(v, str) for v in data["modules"].values())):
        raise ValueError(f"{path}: expected a JSON object with \"implementations\" (a list of implementation "
                         "references) and \"modules\" (module name -> source digest); rewrite it with "
                         "`attncheck durations update`")
    return Sources(frozenset(data["implementations"]), data["modules"])


def write_sources(path: pathlib.Path, impl_refs: Iterable[str]) -> int:
    """Record the implementations and the current digest of every module they run.
    Returns how many implementations."""
    refs = sorted(set(impl_refs))
    modules = {name: _file_digest(file) for ref in refs for name, file in modules_used(ref).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"implementations": refs, "modules": dict(sorted(modules.items()))}, indent=0) + "\n")
    return len(refs)


# How close a family is to a change: its own kernel module changed, or only a module it uses.
OWN_MODULE_CHANGED, USED_MODULE_CHANGED = 0, 1


def changed_families(impl_refs: Mapping[str, Iterable[str]], recorded: Sources) -> dict[str, int]:
    """family -> ``OWN_MODULE_CHANGED`` or ``USED_MODULE_CHANGED``, for the families (name
    -> the impl refs this run tests) whose code differs from the recorded: the family of a
    changed flash kernel runs before the ring kernels built on it. A new implementation (a
    user's ``--attncheck-impl``) is changed code too. With nothing recorded at all, nothing
    is known to have changed and nothing moves."""
    if not recorded.implementations:
        return {}

    def rank(ref: str) -> int | None:
        own = ref.partition(":")[0]
        used = modules_used(ref)
        changed = {name for name, file in used.items() if recorded.modules.get(name) != _file_digest(file)}
        if ref not in recorded.implementations or own in changed:
            return OWN_MODULE_CHANGED
        return USED_MODULE_CHANGED if changed else None

    ranks = {family: [r for r in map(rank, refs) if r is not None] for family, refs in impl_refs.items()}
    return {family: min(found) for family, found in ranks.items() if found}


def write(path: pathlib.Path, durations: dict[str, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: round(v, 2) for k, v in sorted(durations.items())}, indent=0) + "\n")


def merge_into(target: pathlib.Path, measured: pathlib.Path, packaged: pathlib.Path | None = None) -> int:
    """Update ``target`` with the durations of a run (``measured``); tests that run did
    not include keep their old entry. With ``packaged``, the packaged gate's tests go
    there instead (the file the package ships). Returns the number of entries written."""
    merged = {**load(target), **(load(packaged) if packaged else {}), **load(measured)}
    if packaged is not None:
        write(packaged, {k: v for k, v in merged.items() if k.startswith(PACKAGED_TESTS)})
        merged = {k: v for k, v in merged.items() if not k.startswith(PACKAGED_TESTS)}
    write(target, merged)
    return len(merged) + (len(load(packaged)) if packaged else 0)


# ------------------------------------------------------------------ shards
@dataclasses.dataclass(frozen=True)
class Shard:
    """The index-th (from 1) of count shards of a run (``--attncheck-shard K/N``)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match or not 1 <= int(match[1]) <= int(match[2]):
            raise ValueError(f"--attncheck-shard {text!r}: expected K/N with 1 <= K <= N (e.g. 2/4: the second "
                             "of four shards)")
        return cls(int(match[1]), int(match[2]))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


# What a test costs at least, wherever it runs (pytest's own work around it).
SHARD_MIN_TEST_S = 0.05


def assign(items: list, durations: dict[str, float], count: int) -> dict[str, int]:
    """nodeid -> shard index (from 1) of every item: a deterministic partition, the same
    in every shard's process whatever the collection order, since it depends only on the
    node ids, their markers and the durations.

    First the fail-fast (coverage) tests, family by family, each to the shard holding the
    fewest of that family's so far, the least loaded among those: every shard gets a share
    of every family's coverage tests (as even as their number allows), so ``-x`` fails fast
    in every shard. Then the other tests, longest first, each to the least loaded shard.
    A test without a record counts as the median recorded test of its kind (one second when
    none of its kind has a record), and none counts less than SHARD_MIN_TEST_S: tests
    recorded as free still spread over the shards instead of all joining the least loaded."""
    typical = {kind: _typical(items, durations, fail_fast=kind) or 1.0 for kind in (True, False)}

    def seconds(item) -> float:
        return max(SHARD_MIN_TEST_S, durations.get(_key(item), typical[bool(_fail_fast(item))]))

    def longest_first(group: list) -> list:
        return sorted(group, key=lambda i: (-seconds(i), i.nodeid))

    load = [0.0] * count
    shard_of: dict[str, int] = {}

    def place(item, shard: int) -> None:
        shard_of[item.nodeid] = shard + 1
        load[shard] += seconds(item)

    coverage_by_family: dict[str, list] = {}
    for item in items:
        if _fail_fast(item):
            coverage_by_family.setdefault(_family(item), []).append(item)
    for name in sorted(coverage_by_family):
        held = [0] * count
        for item in longest_first(coverage_by_family[name]):
            shard = min(range(count), key=lambda s: (held[s], load[s], s))
            held[shard] += 1
            place(item, shard)
    for item in longest_first([i for i in items if not _fail_fast(i)]):
        place(item, min(range(count), key=lambda s: (load[s], s)))
    return shard_of


def collection_digest(nodeids) -> str:
    """What identifies a run's whole collection: equal in every shard of one run, different
    when shards ran another commit or other options."""
    return hashlib.sha256("\n".join(sorted(nodeids)).encode()).hexdigest()[:16]
