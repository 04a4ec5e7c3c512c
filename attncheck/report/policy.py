"""How a run is judged besides its records: one frozen object, built once by the process
that starts the run, written with the run (``records.RunInfo``) and with each shard's
report (``model.ShardInfo``), so that every merge of the run judges alike: at its end,
after it died (``attncheck report --run``), and of its shards (``attncheck report merge``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Mapping

from attncheck.expectations import Expectation

# Budgets below this are within the run-to-run spread of worst cases (the same code gives
# a group's worst budget far apart in two runs whose draws differ: docs/tolerance.md, "The
# regression rule"); growth is judged from this level up.
REGRESSION_FLOOR = 1 / 3

@dataclasses.dataclass(frozen=True)
class Declared:
    """The contracts a family declares of its kernels besides the oracle's semantics:
    properties a kernel has on purpose that the gate holds it to (paged attention computes
    with bfloat16 pages), one sentence each. Its known deviations are expectations."""

    contracts: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping) -> Declared:
        return cls(tuple(data["contracts"]))


def _frozen(mapping: Mapping) -> Mapping:
    return types.MappingProxyType(dict(mapping))


@dataclasses.dataclass(frozen=True)
class Policy:
    """The families' declarations and the options that judge a run: its bug classes, the
    parameters kept at one value on purpose, the contracts; the declared deviations of its
    implementations (the families' own and the user's, ``attncheck.expectations``); whether
    coverage holes fail it; the accepted budgets its numerics regressions are judged
    against, and the floor below which none counts."""

    applicable: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # family -> bug classes
    fixed_parameters: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)  # -> param -> why
    declared: Mapping[str, Declared] = dataclasses.field(default_factory=dict)
    expectations: tuple[Expectation, ...] = ()
    require_coverage: bool = False
    accepted_budgets: str | None = None  # the file's path
    regression_floor: float = REGRESSION_FLOOR

    def __post_init__(self) -> None:
        # Read-only all the way down: the same object serves every merge of the run.
        object.__setattr__(self, "applicable", _frozen({k: tuple(v) for k, v in self.applicable.items()}))
        object.__setattr__(self, "fixed_parameters",
                           _frozen({k: _frozen(v) for k, v in self.fixed_parameters.items()}))
        object.__setattr__(self, "declared", _frozen(self.declared))
        object.__setattr__(self, "expectations", tuple(self.expectations))

    @classmethod
    def of_specs(cls, specs: Iterable, **options) -> Policy:
        """The policy of a run over these KernelSpecs, with the run's options."""
        specs = list(specs)
        return cls(applicable={s.name: s.class_names for s in specs},
                   fixed_parameters={s.name: s.fixed_parameters for s in specs},
                   declared={s.name: Declared(tuple(c.text for c in s.contracts)) for s in specs}, **options)

    def to_json(self) -> dict:
        return {"applicable": {k: list(v) for k, v in self.applicable.items()},
                "fixed_parameters": {k: dict(v) for k, v in self.fixed_parameters.items()},
                "declared": {k: dataclasses.asdict(v) for k, v in self.declared.items()},
                "expectations": [e.to_json() for e in self.expectations],
                "require_coverage": self.require_coverage, "accepted_budgets": self.accepted_budgets,
                "regression_floor": self.regression_floor}

    @classmethod
    def from_json(cls, data: Mapping) -> Policy:
        return cls(applicable=data["applicable"], fixed_parameters=data["fixed_parameters"],
                   declared={k: Declared.from_json(v) for k, v in data["declared"].items()},
                   expectations=tuple(Expectation.from_json(e) for e in data.get("expectations", ())),
                   require_coverage=bool(data["require_coverage"]), accepted_budgets=data["accepted_budgets"],
                   regression_floor=float(data["regression_floor"]))
