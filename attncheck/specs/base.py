"""KernelSpec: everything the generic gate needs to know about one kernel family.

A spec maps a family's calling convention and semantics onto the float64 oracle. The gate
test is written once against this interface; adding a kernel family is adding a spec.
"""

from __future__ import annotations

import abc
import functools
import dataclasses
import hashlib
import importlib
import inspect
import json
import os
import pathlib
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from hypothesis import strategies as st

# Directions: the forward output and each gradient get their own comparison and record.
FORWARD = "out"


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn configuration: parameters plus the seed the inputs are made from.

    Inputs are rebuilt from (params, seed) alone, so a case is small to record and exact
    to replay (``attncheck repro CASE_ID``).
    """

    family: str
    params: Mapping[str, Any]
    seed: int

    def __getitem__(self, key: str) -> Any:
        return self.params[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)

    def to_json(self) -> dict:
        return {"family": self.family, "params": dict(self.params), "seed": self.seed}

    @classmethod
    def from_json(cls, data: Mapping) -> Case:
        return cls(data["family"], _freeze(data["params"]), int(data["seed"]))

    @property
    def id(self) -> str:
        blob = json.dumps(self.to_json(), sort_keys=True, default=str)
        return self.family + "-" + hashlib.sha256(blob.encode()).hexdigest()[:12]

    def __hash__(self) -> int:
        return hash(self.id)


def _freeze(value):
    """JSON turns tuples into lists; params hold tuples so they stay hashable."""
    if isinstance(value, dict):
        return {k: _freeze(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def make_case(family: str, seed: int, **params) -> Case:
    return Case(family, _freeze(params), seed)


# Axis names of attention outputs and gradients in [B, H, S, D] (for reproducer messages).
ATTENTION_AXES = {"out": ("batch", "head", "query", "dim"), "dq": ("batch", "head", "query", "dim"),
                  "dk": ("batch", "head", "key", "dim"), "dv": ("batch", "head", "key", "dim")}
BIAS_AXES = ("batch", "head", "query", "key")


@dataclasses.dataclass(frozen=True)
class InvalidCall:
    """A call a kernel must reject with its own clear error."""

    description: str
    call: Callable[[], Any]
    error: type[BaseException]
    match: str  # regex the message must contain (names the offending argument)


class KernelSpec(abc.ABC):
    """One kernel family: its implementations, cases, oracle mapping and baseline."""

    name: str
    # Implementation name -> "module:function" of the family's calling convention.
    default_impls: Mapping[str, str]
    backends: tuple[str, ...]
    # Bug classes that apply to this family; each must be exercised in every gate run.
    coverage_classes: tuple[str, ...] = ()
    # Examples drawn per backend in the CI profile (the profile's max_examples scales these).
    examples: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @abc.abstractmethod
    def cases(self) -> st.SearchStrategy[Case]: ...

    @abc.abstractmethod
    def inputs(self, case: Case) -> dict[str, np.ndarray]:
        """The rounded inputs (and cotangents) of a case, rebuilt from its seed."""

    @abc.abstractmethod
    def run(self, impl: Callable, case: Case, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Forward output and gradients, keyed by direction."""

    @abc.abstractmethod
    def lower(self, impl: Callable, case: Case) -> dict[str, Callable[[], Any]]:
        """Direction -> a thunk exporting that computation for platform tpu."""

    @abc.abstractmethod
    def oracle(self, case: Case, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def baseline(self, case: Case, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def output_dtypes(self, case: Case) -> dict[str, Any]:
        """Direction -> dtype the kernel delivers it in (ulps are counted in it)."""

    def care(self, case: Case, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
        """Direction -> mask of elements that count (False: don't-care padding)."""
        return {}

    @abc.abstractmethod
    def classes(self, case: Case) -> list[str]:
        """Bug classes this case exercises, computed from the case itself."""

    def device_count(self, case: Case) -> int:
        return int(case.get("devices", 1))

    def shape_summary(self, case: Case) -> dict[str, Any]:
        return dict(case.params)

    def seq_len(self, case: Case) -> int:
        """The sequence length plotted on the report's error-vs-length chart."""
        return int(case.get("kv_len", case.get("seq_len", 0)))

    def index_names(self, direction: str) -> tuple[str, ...] | None:
        """Names of the axes of a direction's array, for reproducer messages."""
        return None

    def invalid_calls(self) -> list[InvalidCall]:
        """Calls the implementation must reject with its own clear error (one per
        validation branch, so each branch is exercised on every run)."""
        return []


def resolve_impl(ref: str) -> Callable:
    """Import "package.module:function"."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"implementation reference {ref!r}: expected 'package.module:function'")
    target = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def coverage_examples(spec: KernelSpec) -> list[Case]:
    """For each bug class of the spec, the simplest case that exercises it.

    Found by hypothesis (search and shrink over the strategy alone, no kernel runs) and
    derandomized, so the list is the same on every run; the gate runs these as explicit
    examples, which is what guarantees every class a nonzero count in every report.
    """
    return _coverage_examples(spec.name)


# The search takes 6-7 s over the built-in families, and every xdist worker and every
# mutant's gate repeated it at collection, before its first test. Its result depends only
# on the spec's and attncheck's source and on hypothesis, so it is kept on disk under a
# hash of them. "none" turns the cache off.
COVERAGE_CACHE_ENV = "ATTNCHECK_CACHE_DIR"
DEFAULT_CACHE_DIR = ".attncheck_cache"
CACHE_DISABLED = "none"
_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parent.parent


def cache_root_setting() -> str:
    """The cache root the environment asks for, as an absolute path (so that a copy of the
    project run elsewhere shares it), or "none"."""
    chosen = os.environ.get(COVERAGE_CACHE_ENV) or DEFAULT_CACHE_DIR
    return chosen if chosen == CACHE_DISABLED else str(pathlib.Path(chosen).resolve())


def coverage_cache_dir() -> pathlib.Path | None:
    root = cache_root_setting()
    return None if root == CACHE_DISABLED else pathlib.Path(root) / "coverage"


@functools.cache
def _package_source_digest() -> str:
    return hashlib.sha256(b"".join(path.read_bytes() for path in sorted(_PACKAGE_ROOT.rglob("*.py")))).hexdigest()


def coverage_search_key(spec: KernelSpec) -> str:
    """A hash of everything the search reads: attncheck's source (strategies, built-in
    specs), the spec's own module, hypothesis' version and the classes asked for."""
    import hypothesis

    digest = hashlib.sha256(f"{hypothesis.__version__}|{spec.name}|{spec.coverage_classes}|"
                            f"{_package_source_digest()}".encode())
    digest.update(pathlib.Path(inspect.getfile(type(spec))).read_bytes())
    return digest.hexdigest()[:20]


def _load_cached(path: pathlib.Path, spec: KernelSpec) -> list[Case] | None:
    """The cached examples, or None when absent, unreadable or no longer covering every
    class (a spec helper outside the hashed files changed): the search then runs again."""
    try:
        cases = [Case.from_json(c) for c in json.loads(path.read_text())]
        if any(c.family != spec.name for c in cases):
            return None
        exercised = {cls for case in cases for cls in spec.classes(case)}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cases if exercised >= set(spec.coverage_classes) else None


def _store(path: pathlib.Path, cases: list[Case]) -> None:
    # Written whole then renamed: two workers searching at once never leave half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        json.dump([c.to_json() for c in cases], tmp)
    os.replace(tmp.name, path)


@functools.cache
def _coverage_examples(family: str) -> list[Case]:
    from attncheck.specs import all_specs

    spec = all_specs()[family]
    directory = coverage_cache_dir()
    path = None if directory is None else directory / f"{family}-{coverage_search_key(spec)}.json"
    cached = None if path is None else _load_cached(path, spec)
    if cached is not None:
        return cached
    found = search_coverage_examples(spec)
    if path is not None:
        _store(path, found)
    return found


def search_coverage_examples(spec: KernelSpec) -> list[Case]:
    from hypothesis import HealthCheck, Phase, find, settings

    search = settings(database=None, derandomize=True, max_examples=3000, deadline=None,
                      phases=(Phase.generate, Phase.shrink),
                      suppress_health_check=list(HealthCheck))
    found: dict[str, Case] = {}
    for cls in spec.coverage_classes:
        if any(cls in spec.classes(c) for c in found.values()):
            continue
        found[cls] = find(spec.cases(), lambda c, cls=cls: cls in spec.classes(c), settings=search)
    return list({c.id: c for c in found.values()}.values())
