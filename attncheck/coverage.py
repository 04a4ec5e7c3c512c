"""The coverage examples: for each bug class of a family (``attncheck.bugclasses``) the
simplest case that exercises it, found by a derandomized hypothesis search over the
family's case strategy alone (no kernel runs), kept on disk, and split into tests of a
few examples each; ``--attncheck-require-coverage`` fails a run in which an applicable
class has no case (``attncheck.report.coverage_table``).

The search result could be replayed from hypothesis' example database instead, but that
stores choice sequences per test function that must be replayed (and re-shrunk) in every
process, while the gate needs the cases themselves, identical in every xdist worker and
every mutant's copy, before its first test: a JSON file of cases keyed by a hash of what
the search reads is the smaller mechanism.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import pathlib
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING

from attncheck import cache_root
from attncheck.bugclasses import BugClass
from attncheck.cases import Case, Params

if TYPE_CHECKING:
    from attncheck.specs.base import KernelSpec


# ------------------------------------------------------------------ the examples
def examples(spec: KernelSpec) -> list[Case]:
    """For each bug class of the spec, the simplest case that exercises it.

    The same list on every run and in every process (derandomized search, then the
    on-disk cache), which is what guarantees every class a nonzero count in every report.
    """
    return _examples(spec)


# The search takes seconds per family, and every xdist worker and every mutant's gate
# would repeat it at collection, before its first test. Its result depends only on the
# spec's and attncheck's source and on hypothesis, so it is kept on disk (under the cache
# root, ``attncheck.cache_root``) under a hash of them.
_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent


def cache_dir() -> pathlib.Path | None:
    return cache_root.subdir("coverage")


@functools.cache
def _package_source_digest() -> str:
    return hashlib.sha256(b"".join(path.read_bytes() for path in sorted(_PACKAGE_ROOT.rglob("*.py")))).hexdigest()


def search_key(spec: KernelSpec) -> str:
    """A hash of everything the search reads: attncheck's source (strategies, built-in
    specs), the spec's own module, hypothesis' version and the classes asked for."""
    import hypothesis

    from attncheck import profiles

    names = tuple(c.name for c in spec.bug_classes)
    explicit = sorted((name, case.id) for name, case in spec.explicit_examples.items())
    # The strategies draw from wider shape sets under the nightly profile.
    digest = hashlib.sha256(f"{hypothesis.__version__}|{spec.name}|{names}|{explicit}|{profiles.wide()}|"
                            f"{_package_source_digest()}".encode())
    digest.update(pathlib.Path(inspect.getfile(type(spec))).read_bytes())
    return digest.hexdigest()[:20]


def _load_cached(path: pathlib.Path, spec: KernelSpec) -> list[Case] | None:
    """The cached examples, or None when absent, unreadable or no longer covering every
    class but those the search found none for (a spec helper outside the hashed files
    changed): the search then runs again."""
    try:
        data = json.loads(path.read_text())
        cases = [spec.case_from_json(c) for c in data["cases"]]
        if any(c.family != spec.name for c in cases):
            return None
        covered = {name for case in cases for name in spec.classes(case)} | set(data["without_example"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cases if covered >= set(spec.class_names) else None


def store(path: pathlib.Path, cases: list[Case], spec: KernelSpec) -> None:
    # Written whole then renamed: two workers searching at once never leave half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    covered = {name for case in cases for name in spec.classes(case)}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        json.dump({"cases": [c.to_json() for c in cases],
                   "without_example": [n for n in spec.class_names if n not in covered]}, tmp, indent=1)
    os.replace(tmp.name, path)


# The built-in families' examples under the CI profile's shapes, as the package ships them
# (``attncheck coverage update`` writes them): a clone or a wheel gates without searching.
# A file is found by its search key alone, so one that another source searched is never read.
SHIPPED = _PACKAGE_ROOT / "coverage_examples"


def shipped_path(spec: KernelSpec) -> pathlib.Path:
    return SHIPPED / f"{spec.name}-{search_key(spec)}.json"


@functools.cache
def _examples(spec: KernelSpec) -> list[Case]:
    shipped = _load_cached(shipped_path(spec), spec)
    if shipped is not None:
        return shipped
    directory = cache_dir()
    path = None if directory is None else directory / f"{spec.name}-{search_key(spec)}.json"
    cached = None if path is None else _load_cached(path, spec)
    if cached is not None:
        return cached
    found = search(spec)
    if path is not None:
        store(path, found, spec)
    return found


def update_shipped(specs: Iterable[KernelSpec]) -> list[pathlib.Path]:
    """Search the examples of these families afresh and ship them (``SHIPPED``), leaving no
    file of an earlier key behind."""
    written = []
    for spec in specs:
        for stale in SHIPPED.glob(f"{spec.name}-*.json"):
            stale.unlink()
        store(shipped_path(spec), search(spec), spec)
        written.append(shipped_path(spec))
    return written


def search(spec: KernelSpec) -> list[Case]:
    """Shrink toward the simplest case of each class not yet exercised by an earlier find;
    a case found on several simulated devices is searched again on fewer. Shrinking
    minimizes hypothesis' choices, not what a case costs, and may leave the example of a
    class that has nothing to do with devices (a ring flash case of large logits) on a ring
    of 8, many times slower than on one device.

    The example of a class is searched outside the classes whose deviation the family
    ships for its own implementations (``KernelSpec.expectations``), where there is one:
    such a case is judged only in part, and would leave the class it stands for unverified.
    A class without any example under the active profile is left out: the run's coverage
    table shows it as a hole (``--attncheck-require-coverage`` fails it by name)."""
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample

    budget = settings(database=None, derandomize=True, max_examples=3000, deadline=None,
                      phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))
    deviating = {e.name for e in spec.expectations}
    avoided = [c for c in spec.bug_classes if c.name in deviating]

    def exercises(cls: BugClass, params: Params, devices: int | None = None) -> bool:
        return cls.applies(params) and (devices is None or params.device_count < devices) and (
            cls in avoided or not any(a.applies(params) for a in avoided))

    def first(cls: BugClass, devices: int | None = None, examples: int | None = None) -> Case | None:
        for attempt in (lambda p: exercises(cls, p, devices),
                        lambda p: cls.applies(p) and (devices is None or p.device_count < devices)):
            try:
                return find(spec.cases(), lambda c, attempt=attempt: attempt(c.params),
                            settings=budget if examples is None else settings(budget, max_examples=examples))
            except NoSuchExample:
                continue
        return None

    unknown = sorted(set(spec.explicit_examples) - set(spec.class_names))
    if unknown:
        raise ValueError(f"{spec.name}: explicit_examples name no bug class of the family: {unknown}")
    found: dict[str, Case] = {}
    pairs = [c for c in spec.bug_classes if c.pair and c.name not in spec.explicit_examples]
    for cls in [c for c in spec.bug_classes if c not in pairs]:
        if any(exercises(cls, c.params) for c in found.values()):
            continue
        explicit = spec.explicit_examples.get(cls.name)
        if explicit is not None:
            if not cls.applies(explicit.params):
                raise ValueError(f"{spec.name}: explicit_examples[{cls.name!r}] does not exercise its class "
                                 f"(case {explicit.id})")
            found[cls.name] = explicit
            continue
        case = first(cls)
        if case is None:
            continue
        if case.params.device_count > 1:
            case = first(cls, devices=case.params.device_count, examples=FEWER_DEVICES_EXAMPLES) or case
        found[cls.name] = case
    missing = [c for c in pairs if not any(exercises(c, f.params) for f in found.values())]
    for case in _covering(spec, missing, exercises, list(found.values())):
        found[case.id] = case
    for cls in missing:
        if not any(exercises(cls, c.params) for c in found.values()) and (case := first(cls)) is not None:
            found[cls.name] = case
    # Cases of one program side by side: a test runs a contiguous share of the examples
    # (``Share``), and a program's cases in one test share one compile.
    cases = list({c.id: c for c in found.values()}.values())
    first_of = {}
    for case in cases:
        first_of.setdefault(spec.program(case.params), len(first_of))
    return sorted(cases, key=lambda c: first_of[spec.program(c.params)])


def _covering(spec: KernelSpec, classes: list[BugClass], exercises, found: list[Case]) -> list[Case]:
    """Cases that together exercise as many of ``classes`` as they can, from one
    derandomized draw of the family's strategy and of cases of the programs already
    chosen with other data (``KernelSpec.variants``: of the ``found`` examples, then of each
    case chosen here): each next the one with the most not yet exercised per what it costs.
    Pair classes are many (every pair of cells), and an example shrunk for each alone would
    be one case per pair; a drawn case holds one cell of every partition, so a handful cover
    them, and a pair with a cell of the data (a value distribution, a sequence layout) is
    mostly a program already compiled with other data.

    A case costs the tokens it runs (``Params.sequence_length``, times the devices squared:
    a ring of n runs n steps on each of its n devices), and ``COMPILE_SHARE`` times more
    where its program is not one already chosen: a gate's cold time is mostly compiles."""
    if not classes:
        return []
    from hypothesis import strategies as st

    reaches: list[tuple[Case, set[str]]] = []

    def reach(cases: Iterable[Case]) -> None:
        reaches.extend((case, {c.name for c in classes if exercises(c, case.params)}) for case in cases)

    def of_programs(cases: list[Case], draws: int) -> list[Case]:
        return [v for vs in _drawn(st.sampled_from(cases).flatmap(lambda c: spec.variants(c, 1)), draws) for v in vs]

    reach(_drawn(spec.cases(), COVERING_DRAWS))
    if found:
        reach(of_programs(found, COVERING_DRAWS))
    programs = {spec.program(c.params) for c in found}

    def cost(case: Case) -> float:
        runs = max(1, case.params.sequence_length * case.params.device_count ** 2)
        return runs * (1 if spec.program(case.params) in programs else COMPILE_SHARE)

    left, chosen = {c.name for c in classes}, []
    while left:
        case, covered = max(reaches, key=lambda r: len(r[1] & left) / cost(r[0]))
        if not covered & left:
            break
        chosen.append(case)
        left -= covered
        if spec.program(case.params) not in programs:
            programs.add(spec.program(case.params))
            reach(of_programs([case], VARIANT_DRAWS))
    return chosen


def _drawn(strategy, draws: int) -> list:
    """What one derandomized draw of ``draws`` examples of ``strategy`` saw."""
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample

    seen: list = []
    try:  # a search for nothing, that keeps what it saw
        find(strategy, lambda drawn: seen.append(drawn) and False,
             settings=settings(database=None, derandomize=True, max_examples=draws, deadline=None,
                               phases=(Phase.generate,), suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        pass
    return seen


# Draws of the strategy, and of the found examples' programs with other data, that the pair
# classes' examples are chosen from (``_covering``); and of each program chosen there.
COVERING_DRAWS = 500
VARIANT_DRAWS = 100
# What a case of a program not yet compiled costs beside one of a program compiled already
# (``_covering``): on the gate's backends a case's compile takes about ten times its run
# (docs/DESIGN.md, "Where a cold gate's time goes").
COMPILE_SHARE = 10


# Draws in the search on fewer devices: the strategies draw hundreds a second, and a class
# that needs the devices (a ring of 8) costs this many draws at every change of the package.
FEWER_DEVICES_EXAMPLES = 300


# ------------------------------------------------------------------ the splits
# A family's coverage examples are split into tests of at most this many, so that xdist
# spreads one family's coverage over every worker instead of queueing it behind another
# family's on one worker: under -x, a bug that only a family's last examples show is found
# early in the run, not after the whole of that family's coverage.
EXAMPLES_PER_TEST = 4


@dataclasses.dataclass(frozen=True)
class Share:
    """The index-th of count coverage tests of a family."""

    index: int
    count: int

    @property
    def suffix(self) -> str:
        return "" if self.count == 1 else f"{self.index + 1}of{self.count}"

    def of(self, cases: list[Case]) -> list[Case]:
        """This test's examples: the index-th of count contiguous runs."""
        n = len(cases)
        return cases[self.index * n // self.count:(self.index + 1) * n // self.count]


def shares(example_count: int) -> list[Share]:
    count = max(1, -(-example_count // EXAMPLES_PER_TEST))
    return [Share(index, count) for index in range(count)]
