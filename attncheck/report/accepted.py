"""Accepted budgets: the worst budgets of a passing run, committed, and the numerics
regressions judged against them (``--attncheck-accepted-budgets``).

Not to be confused with the *yardstick* (``attncheck.yardstick``): the naive
same-precision implementation the tolerance of every comparison is scaled by.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import TYPE_CHECKING

from attncheck.env import Platform
from attncheck.report.policy import REGRESSION_FLOOR

if TYPE_CHECKING:
    from attncheck.report.model import SummaryRow

DEFAULT_FILE = pathlib.Path("reports") / "accepted_budgets.json"
# 2: the file says which platform and hypothesis profile its budgets were accepted on.
SCHEMA_VERSION = 2
# A budget may grow this much past the accepted one before the gate calls it a numerics
# regression: budgets of passing cases wobble with the drawn inputs.
REGRESSION_FACTOR = 1.5
_KEYS = ("kernel", "impl", "backend", "dtype", "direction")


class AcceptedBudgetsError(ValueError):
    """The file is missing or not an accepted-budgets file; the message says what is wrong."""


@dataclasses.dataclass(frozen=True)
class AcceptedBudget:
    kernel: str
    impl: str
    backend: str
    dtype: str
    direction: str
    worst_budget: float

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(getattr(self, k) for k in _KEYS)


@dataclasses.dataclass(frozen=True)
class AcceptedBudgets:
    """The accepted worst budgets of a passing run, with what makes them comparable: the
    platform its numbers belong to and the hypothesis profile that drew its cases (None:
    a file that does not say)."""

    budgets: tuple[AcceptedBudget, ...]
    platform: Platform | None = None
    profile: str | None = None

    def not_comparable(self, platform: Platform | None, profile: str | None) -> str | None:
        """Why a run on this platform and profile is not judged against these budgets (its
        growth is a difference to show, not a regression), or None when it is."""
        if self.platform is None or self.profile is None:
            return "the accepted budgets do not say which platform and profile they were accepted on"
        if platform != self.platform:
            return (f"accepted on {self.platform.describe()}; this run's numbers belong to "
                    f"{'an unknown platform' if platform is None else platform.describe()}")
        if profile != self.profile:
            return f"accepted on the {self.profile} profile's draws; this run drew {profile}'s"
        return None


def read(path: pathlib.Path) -> AcceptedBudgets:
    """The accepted budgets of a file, validated: every problem names the file and the entry."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AcceptedBudgetsError(f"{path}: cannot read the accepted budgets ({exc.strerror})") from exc
    except ValueError as exc:
        raise AcceptedBudgetsError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("budgets"), list):
        raise AcceptedBudgetsError(f"{path}: expected an object with a \"budgets\" list "
                                   "(written by `attncheck budgets accept`)")
    budgets = []
    for n, entry in enumerate(data["budgets"]):
        if not isinstance(entry, dict):
            raise AcceptedBudgetsError(f"{path}: budgets[{n}] is {type(entry).__name__}, expected an object")
        missing = [k for k in (*_KEYS, "worst_budget") if k not in entry]
        if missing:
            raise AcceptedBudgetsError(f"{path}: budgets[{n}] lacks {', '.join(missing)}")
        if not all(isinstance(entry[k], str) for k in _KEYS) or not isinstance(entry["worst_budget"], (int, float)) \
                or isinstance(entry["worst_budget"], bool) or entry["worst_budget"] < 0:
            raise AcceptedBudgetsError(f"{path}: budgets[{n}] must hold strings for {', '.join(_KEYS)} and a "
                                       f"non-negative number for worst_budget, got {entry}")
        budgets.append(AcceptedBudget(*(entry[k] for k in _KEYS), float(entry["worst_budget"])))
    platform, profile = data.get("platform"), data.get("profile")
    try:
        platform = None if platform is None else Platform.from_json(platform)
    except (AttributeError, TypeError) as exc:
        raise AcceptedBudgetsError(f"{path}: platform must be an object as `attncheck budgets accept` writes "
                                   f"it, got {platform!r}") from exc
    if profile is not None and not isinstance(profile, str):
        raise AcceptedBudgetsError(f"{path}: profile must be a string, got {profile!r}")
    return AcceptedBudgets(tuple(budgets), platform, profile)


def write(path: pathlib.Path, accepted: AcceptedBudgets) -> None:
    data = {"schema_version": SCHEMA_VERSION, "budgets": [dataclasses.asdict(b) for b in accepted.budgets],
            "platform": None if accepted.platform is None else accepted.platform.to_json(),
            "profile": accepted.profile}
    pathlib.Path(path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _accepted_impl(impl: str) -> str:
    # A user's implementation (--attncheck-impl) is held to the built-in one's budgets.
    return "builtin" if impl == "user" else impl


@dataclasses.dataclass(frozen=True)
class Standing:
    """A summary row against its accepted budget: None where the group is new."""

    row: SummaryRow
    accepted: float | None
    limit: float | None  # the worst budget past which it is a numerics regression

    @property
    def regressed(self) -> bool:
        return self.limit is not None and self.row.worst_budget > self.limit


def standings(rows: list[SummaryRow], accepted: AcceptedBudgets | None,
              floor: float = REGRESSION_FLOOR) -> list[Standing]:
    """Each row with its accepted budget and regression limit. Keyed by implementation
    too: a family's implementations differ legitimately (e.g. blockwise vs one-shot
    reductions), so each is compared with its own accepted budget, never with another's."""
    by_key = {b.key: b.worst_budget for b in (accepted.budgets if accepted is not None else ())}
    out = []
    for row in rows:
        old = by_key.get((row.kernel, _accepted_impl(row.impl), row.backend, row.dtype, row.direction))
        out.append(Standing(row, old, None if old is None else REGRESSION_FACTOR * max(old, floor)))
    return out


def growth(rows: list[SummaryRow], accepted: AcceptedBudgets, floor: float = REGRESSION_FLOOR) -> list[str]:
    """A line for each budget that grew past its accepted one's limit (``standings``)."""
    return [f"{s.row.kernel}/{s.row.impl}/{s.row.backend}/{s.row.dtype}/{s.row.direction} "
            f"worst budget {s.row.worst_budget:.3g} > {REGRESSION_FACTOR} x accepted {s.accepted:.3g} "
            f"(case {s.row.worst_case})" for s in standings(rows, accepted, floor) if s.regressed]


def judge(rows: list[SummaryRow], accepted: AcceptedBudgets, floor: float, platform: Platform | None,
          profile: str | None) -> tuple[list[str], list[str]]:
    """(numerics regressions, differences): growth past the limit is a regression where the
    accepted budgets come from this platform and profile, else a difference to show with
    the reason, never failing (other codegen, or other draws, move worst budgets by more
    than the limit: docs/tolerance.md, "The regression rule")."""
    grown = growth(rows, accepted, floor)
    why = accepted.not_comparable(platform, profile)
    if why is None:
        return [f"numerics regression: {line}" for line in grown], []
    return [], [f"{line}: not judged, {why}" for line in grown]


def from_summary(rows: list[SummaryRow], platform: Platform | None, profile: str | None) -> AcceptedBudgets:
    """The budgets to accept from a run: every passing group of the families' own
    implementations, with the platform and profile they belong to."""
    return AcceptedBudgets(tuple(AcceptedBudget(row.kernel, row.impl, row.backend, row.dtype, row.direction,
                                                row.worst_budget)
                                 for row in rows if row.impl != "user" and row.failures == 0), platform, profile)
