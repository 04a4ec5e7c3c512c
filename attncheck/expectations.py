"""Declared deviations: what an implementation of a family knowingly does not do, each
with its reason, so that a team whose kernel deviates runs the gate green and strict on
everything else, and the families' own findings live in the same table.

An entry names a family, an implementation ("module:function", as ``--attncheck-impl``
names it) and one thing the implementation does not promise:

- ``bug_class``: the cases of one of the family's bug classes may deviate. Where the class
  says which elements its deviation touches (``bugclasses.BugClass.affects``), the rest of
  each case is judged as usual; else a failing comparison of such a case is an expected
  deviation.
- ``invalid_call``: one of the family's invalid calls may be accepted, or rejected without
  naming the argument (the test becomes a strict xfail).
- ``contract``: one of the family's contracts that fixes elements (``Contract.elements``)
  is not promised: those elements do not count.
- ``unsupported``: a configuration the implementation refuses, by the message of the
  ``NotImplementedError`` or ``ValueError`` it raises (a regular expression searched in
  it). A case it refuses so is *unsupported by the implementation*: never a pass, listed
  with its classes in the report (``unsupported_lines``), and counted as exercising none of
  them, so that a class it refuses in every case is a coverage hole.

An expected deviation still runs and is reported as one; it never fails the gate. An entry
whose deviation no longer occurs in a run that exercised it fails the gate (a stale entry:
the kernel was fixed), and an entry that names nothing the family has is a usage error.
Tables live in the user's repository: ``[[tool.attncheck.expect]]`` in the pyproject.toml of
the run's root directory, or ``[[expect]]`` in a file given by ``--attncheck-expectations``;
``attncheck expectations init`` writes one from a failing run. The families ship their own
findings as entries for their default implementations (``KernelSpec.expectations``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

BUG_CLASS, INVALID_CALL, CONTRACT, UNSUPPORTED = "bug_class", "invalid_call", "contract", "unsupported"
KINDS = (BUG_CLASS, INVALID_CALL, CONTRACT, UNSUPPORTED)
# The errors by which an implementation refuses a configuration it does not support.
REFUSALS = (NotImplementedError, ValueError)
# How the record of a case an implementation refused begins.
UNSUPPORTED_BY_IMPLEMENTATION = "unsupported by the implementation: "
# How a deviation stood in a run.
OCCURS, STALE, NOT_EXERCISED = "occurs", "stale", "not exercised"
# An entry for an implementation the run did not verify (a table naming a kernel by the
# module it was copied from, or another implementation of the family).
NOT_UNDER_TEST = "not under test"
SHIPPED = "shipped with the family"
DEFAULT_TABLE = "pyproject.toml"


class ExpectationError(ValueError):
    """A table or an entry that cannot be used; the message names the file and the entry."""


@dataclasses.dataclass(frozen=True)
class Contract:
    """A property the family holds its implementations to, in one sentence. One that fixes
    particular elements (``elements(case, inputs) -> direction -> mask``) can be declared
    not promised by an implementation: those elements then do not count for it."""

    name: str
    text: str
    elements: Callable[[Any, Mapping], Mapping] | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Expectation:
    """One declared deviation of one implementation of a family."""

    family: str
    implementation: str  # "module:function"
    kind: str  # one of KINDS
    name: str  # the bug class, the invalid call's description or the contract
    reason: str
    source: str = ""  # where it was declared

    @property
    def id(self) -> str:
        """Unique in a run: the implementation, the kind and the name."""
        return f"{self.implementation}/{self.kind}:{self.name}"

    def describe(self) -> str:
        return f"{self.family} / {self.implementation}: {self.kind.replace('_', ' ')} {self.name}"

    def to_json(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> Expectation:
        return cls(**{f.name: str(data[f.name]) for f in dataclasses.fields(cls) if f.name in data})


@dataclasses.dataclass(frozen=True)
class Shipped:
    """An entry a family ships for one of its default implementations (named as in
    ``KernelSpec.default_impls``): one of its own findings."""

    impl: str
    kind: str
    name: str
    reason: str


def shipped(spec) -> list[Expectation]:
    """A family's own entries, for the references of its default implementations."""
    return [Expectation(spec.name, spec.default_impls[e.impl], e.kind, e.name, e.reason, SHIPPED)
            for e in spec.expectations]


# ------------------------------------------------------------------ tables
def _entries(data: Mapping, path: pathlib.Path) -> list:
    """The list of entries of a parsed table: [[expect]], or [[tool.attncheck.expect]]."""
    table = data.get("tool", {}).get("attncheck", {}) if path.name == DEFAULT_TABLE else data
    entries = table.get("expect", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        where = "[[tool.attncheck.expect]]" if path.name == DEFAULT_TABLE else "[[expect]]"
        raise ExpectationError(f"{path}: {where} must be an array of tables")
    return entries


def read(path: pathlib.Path, *, required: bool = True) -> list[Expectation]:
    """The entries of a table file, each checked for its form (not yet against the
    families: ``validate``). A pyproject.toml without the table holds none."""
    path = pathlib.Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise ExpectationError(f"{path}: no such file") from None
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise ExpectationError(f"{path}: cannot read it ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ExpectationError(f"{path}: not TOML ({exc})") from None
    out = []
    for n, entry in enumerate(_entries(data, path)):
        where = f"{path}: entry {n + 1}"
        kinds = [k for k in KINDS if k in entry]
        unknown = sorted(set(entry) - {"family", "implementation", "reason", *KINDS})
        if unknown:
            raise ExpectationError(f"{where}: unknown key(s) {unknown}; an entry has family, implementation, "
                                   f"reason and one of {', '.join(KINDS)}")
        if len(kinds) != 1:
            raise ExpectationError(f"{where}: expected exactly one of {', '.join(KINDS)}, got {kinds or 'none'}")
        missing = [k for k in ("family", "implementation", "reason") if not str(entry.get(k, "")).strip()]
        if missing:
            raise ExpectationError(f"{where}: {', '.join(missing)} missing or empty (every entry says why)")
        if not all(isinstance(entry[k], str) for k in ("family", "implementation", "reason", kinds[0])):
            raise ExpectationError(f"{where}: family, implementation, reason and {kinds[0]} must be strings")
        out.append(Expectation(entry["family"], entry["implementation"], kinds[0], entry[kinds[0]],
                               entry["reason"].strip(), str(path)))
    return out


def validate(entries: Iterable[Expectation], families: Mapping[str, Any],
             invalid_calls: Callable[[Any, str], list[str]]) -> list[Expectation]:
    """The entries, each naming something its family has (``invalid_calls(spec, ref)``:
    the descriptions of the family's invalid calls for that implementation), none twice."""
    seen: dict[str, Expectation] = {}
    for e in entries:
        where = f"{e.source}: {e.describe()}"
        spec = families.get(e.family)
        if spec is None:
            raise ExpectationError(f"{where}: no family {e.family!r} (known: {', '.join(sorted(families))})")
        if e.kind == UNSUPPORTED:
            try:
                re.compile(e.name)
            except re.error as exc:
                raise ExpectationError(f"{where}: unsupported must be a regular expression searched in the message "
                                       f"of the error the implementation refuses with; {e.name!r} is not one "
                                       f"({exc})") from None
            known = [e.name]
        elif e.kind == BUG_CLASS:
            known = list(spec.class_names)
        elif e.kind == CONTRACT:
            known = [c.name for c in spec.contracts if c.elements is not None]
        else:
            known = invalid_calls(spec, e.implementation)
        if e.name not in known:
            raise ExpectationError(f"{where}: the family has no {e.kind.replace('_', ' ')} {e.name!r} that can be "
                                   f"declared (known: {', '.join(known) or 'none'})")
        if e.id in seen and seen[e.id].family == e.family:
            raise ExpectationError(f"{where}: declared twice ({seen[e.id].source} and {e.source})")
        seen[e.id] = e
    return list(seen.values())


def for_target(entries: Iterable[Expectation], family: str, implementation: str) -> tuple[Expectation, ...]:
    """The entries of one family x implementation."""
    return tuple(e for e in entries if e.family == family and e.implementation == implementation)


def refusal(entries: Iterable[Expectation], errors: Iterable[BaseException]) -> tuple[Expectation, str] | None:
    """The ``unsupported`` entry that declares one of ``errors`` (an exception's chain) a
    refusal, with that error's line; None when none does."""
    declared = [e for e in entries if e.kind == UNSUPPORTED]
    for error in errors:
        if isinstance(error, REFUSALS):
            line = f"{type(error).__name__}: {error}"
            for entry in declared:
                if re.search(entry.name, str(error)):
                    return entry, line
    return None


def refused(record) -> bool:
    """The record is of a case its implementation refused as unsupported."""
    return record.outcome == "error" and record.reason.startswith(UNSUPPORTED_BY_IMPLEMENTATION)


def unsupported_lines(records) -> list[str]:
    """One line per backend x kernel/impl x declared refusal: how many cases it refused,
    and of which classes."""
    cases: dict[tuple, dict[str, tuple[str, ...]]] = {}
    for r in records:
        if refused(r):
            cases.setdefault((r.backend, f"{r.kernel}/{r.impl}", r.expected), {})[r.case_id] = tuple(r.classes)
    lines = []
    for (backend, kernel, entry), classes in sorted(cases.items()):
        counts: dict[str, int] = {}
        for names in classes.values():
            for name in names:
                counts[name] = counts.get(name, 0) + 1
        by_class = ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))
        lines.append(f"{backend}: {kernel}: {len(classes)} case(s) not run, unsupported by the implementation as "
                     f"declared by {entry} (classes: {by_class or 'none'})")
    return lines


def own_evidence(shown_in: Mapping[Any, set]) -> dict[Any, int]:
    """Entry -> how many places (cases) show it that no other *confirmed* entry explains;
    an entry is confirmed where it shows alone. A crash shows in every whole-case entry of
    its case, so an entry all of whose places a confirmed one also shows has shown nothing
    of its own: it is stale (the gate) and not worth proposing (``expectations init``)."""
    confirmed = {next(iter(ids)) for ids in shown_in.values() if len(ids) == 1}
    counts: dict[Any, int] = {}
    for ids in shown_in.values():
        for entry in ids:
            counts[entry] = counts.get(entry, 0) + (not (ids - {entry}) & confirmed)
    return counts


@dataclasses.dataclass(frozen=True)
class CaseEvidence:
    """One case of one implementation in a run, as ``explaining`` weighs it."""

    family: str
    implementation: str
    case_id: str
    classes: frozenset[str]
    numerics: bool  # some direction compared numbers: a lowering-only pass says nothing of its classes
    excused: bool  # a declared deviation explains one of its records already
    # Per failing record that no declared deviation excuses: the contracts whose elements
    # alone hold its failures (empty: none does).
    failing: tuple[frozenset[str], ...] = ()
    repro: str = ""  # the command that reruns it


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The deviations that explain a run's failures (``(family, implementation, kind,
    name)``, each once), and the failing cases none explains."""

    entries: tuple[tuple[str, str, str, str], ...]
    unexplained: tuple[CaseEvidence, ...]


def explaining(cases: Iterable[CaseEvidence], failed_calls: Iterable[tuple[str, str, str]], *,
               cells: Mapping[str, frozenset[str]]) -> Explanation:
    """The deviations a run calls for (``attncheck expectations init``). A failing case is
    explained by a contract whose elements alone hold each of its failing comparisons, else
    by a bug class of it that no case passing the numerics has (a case whose failures a
    contract explains passes once it is declared): a class stated for its behaviour before
    a cell or pair of cells (``cells``: family -> those names, coordinates of the covering
    array that one coverage example happens to carry), and of those the most specific first,
    the class in the fewest cases, so that one broad entry does not excuse every case it
    touches; and less each class the gate would call stale on these cases (``own_evidence``).
    A failing invalid call (``failed_calls``: family, implementation, call) by its own entry."""
    cases = list(cases)
    found: list[tuple[str, str, str, str]] = []
    unexplained: dict[tuple, CaseEvidence] = {}
    for case in cases:
        if not case.failing:
            continue
        contracts = frozenset.intersection(*case.failing)
        if contracts:
            found.append((case.family, case.implementation, CONTRACT, sorted(contracts)[0]))
        else:
            unexplained[(case.family, case.implementation, case.case_id)] = case
    passing: dict[tuple[str, str], set[str]] = {}
    occurrences: dict[tuple[str, str, str], int] = {}
    for case in cases:
        key = (case.family, case.implementation, case.case_id)
        if key not in unexplained and not case.excused and case.numerics:
            passing.setdefault(key[:2], set()).update(case.classes)
        if case.failing or case.numerics:
            for name in case.classes:
                occurrences[(*key[:2], name)] = occurrences.get((*key[:2], name), 0) + 1
    declarable = dict(unexplained)
    picked: list[tuple[str, str, str]] = []
    while unexplained:
        candidates: dict[tuple[str, str, str], set] = {}
        for key, case in unexplained.items():
            for name in case.classes - passing.get(key[:2], set()):
                candidates.setdefault((*key[:2], name), set()).add(key)
        if not candidates:
            break
        best = min(sorted(candidates), key=lambda c: (c[2] in cells.get(c[0], frozenset()), occurrences[c],
                                                      -len(candidates[c])))
        picked.append(best)
        for key in candidates[best]:
            del unexplained[key]
    found += [(family, ref, BUG_CLASS, name) for family, ref, name in _without_stale(picked, declarable)]
    found += [(family, ref, INVALID_CALL, call) for family, ref, call in failed_calls]
    return Explanation(tuple(dict.fromkeys(found)), tuple(unexplained.values()))


def _without_stale(picked: list[tuple[str, str, str]], failing: Mapping[tuple, CaseEvidence]) -> list[tuple]:
    """The picked classes less each one the gate would call stale on these cases
    (``own_evidence``), one at a time: the broadest first, as picks run most specific first."""
    picked = list(picked)
    while True:
        shown_in = {key: {c for c in picked if key[:2] == c[:2] and c[2] in case.classes}
                    for key, case in failing.items()}
        evidence = own_evidence(shown_in)
        stale = [c for c in picked if evidence.get(c, 0) == 0]
        if not stale:
            return picked
        picked.remove(stale[-1])


def toml(entries: Iterable[Expectation], *, pyproject: bool) -> str:
    """The entries as a TOML table: ``[[tool.attncheck.expect]]`` for a pyproject.toml, else
    ``[[expect]]``."""
    header = "[[tool.attncheck.expect]]" if pyproject else "[[expect]]"

    def quoted(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return "".join(f"\n{header}\nfamily = {quoted(e.family)}\nimplementation = {quoted(e.implementation)}\n"
                   f"{e.kind} = {quoted(e.name)}\nreason = {quoted(e.reason)}\n" for e in entries)
