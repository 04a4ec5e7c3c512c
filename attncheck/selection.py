"""What a gate run verifies: the families, implementations and backends asked for, and the
tests of the generic gate they make (``attncheck/gate/test_gate.py``).

Each family x implementation x backend is verified in two parts: the coverage examples
(the simplest case of every bug class, on the family's first backend, split into tests of
a few examples; they run before everything else) and the drawn cases.
"""

from __future__ import annotations

import dataclasses
import functools

from attncheck import coverage, domain, specs
from attncheck.backends import BACKENDS
from attncheck.check import Target
from attncheck.expectations import INVALID_CALL, Expectation, for_target
from attncheck.report.records import target_id
from attncheck.specs.base import InvalidCall, KernelSpec, resolve_impl

COVERAGE = "coverage"
DRAWN = "drawn"


class SelectionError(ValueError):
    """An option names something that does not exist; the message says which and what does."""


@dataclasses.dataclass(frozen=True)
class Options:
    """The gate's selection options as given (None: the default)."""

    backends: str | None = None
    kernels: str | None = None
    impls: tuple[str, ...] = ()

    @property
    def backend_names(self) -> list[str]:
        """The backends asked for: every one when the option is not given."""
        if not self.backends:
            return list(BACKENDS)
        names = [v.strip() for v in self.backends.split(",") if v.strip()]
        unknown = [n for n in names if n not in BACKENDS]
        if unknown or not names:
            raise SelectionError(f"--attncheck-backend {self.backends!r}: unknown backend(s) {unknown}; "
                                 f"known: {', '.join(BACKENDS)}")
        return names

    @property
    def explicit_backends(self) -> bool:
        return bool(self.backends)

    def selected_specs(self) -> list[KernelSpec]:
        known = specs.all_specs()
        if not self.kernels:
            return list(known.values())
        names = [n.strip() for n in self.kernels.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise SelectionError(f"--attncheck-kernel {self.kernels!r}: unknown families {unknown}; "
                                 f"known: {', '.join(sorted(known))}")
        return [known[n] for n in names]

    def impl_overrides(self) -> dict[str, str]:
        """``--attncheck-impl FAMILY=module:function`` -> {family: reference}, each importable."""
        overrides = {}
        known = specs.all_specs()
        for value in self.impls:
            family, sep, ref = value.partition("=")
            if not sep or family not in known:
                raise SelectionError(f"--attncheck-impl {value!r}: expected FAMILY=package.module:function "
                                     f"with FAMILY one of {', '.join(sorted(known))}")
            spec = known[family]
            try:
                declared = domain.of(resolve_impl(ref))  # fail at startup, not in the middle of the gate
                domain.check_takes(declared, spec.params_type)
            except (ValueError, TypeError) as exc:
                raise SelectionError(f"--attncheck-impl {value!r}: {exc}") from exc
            if declared.sequence_multiple > 1 and type(spec).fit_sequences is KernelSpec.fit_sequences:
                raise SelectionError(f"--attncheck-impl {value!r}: the implementation declares sequences of "
                                     f"multiples of {declared.sequence_multiple}, and family {family!r} cannot fit "
                                     "its draws to them (its spec defines no fit_sequences)")
            overrides[family] = ref
        return overrides

    def implementations(self, spec: KernelSpec) -> dict[str, str]:
        """The implementations of a family the run verifies, name -> "module:function": the
        user's (``user``) in place of the family's own when ``--attncheck-impl`` names one."""
        overrides = self.impl_overrides()
        return {"user": overrides[spec.name]} if spec.name in overrides else dict(spec.default_impls)

    def validate(self) -> None:
        self.backend_names, self.impl_overrides()
        if self.kernels:
            # A family asked for by name that ships no kernel (ragged_paged_attention_v3)
            # would verify nothing; an unnamed one (every family) is left out quietly.
            bare = [spec.name for spec in self.selected_specs() if not self.implementations(spec)]
            if bare:
                raise SelectionError(f"--attncheck-kernel {self.kernels!r}: {', '.join(bare)} ships no implementation "
                                     f"of its own; give one with --attncheck-impl {bare[0]}=package.module:function")


@dataclasses.dataclass(frozen=True)
class GateTest:
    """One parametrization of the generic gate test."""

    spec: KernelSpec
    impl_name: str
    impl_ref: str
    backend_name: str
    part: str  # COVERAGE or DRAWN
    share: coverage.Share | None = None
    # The backend runs the family's coverage examples: the first of the implementation's
    # backends the run selects (its drawn cases skip those examples).
    runs_coverage: bool = False

    @property
    def target_id(self) -> str:
        return target_id(self.spec.name, self.impl_name, self.backend_name)

    @property
    def id(self) -> str:
        return f"{self.target_id}-{self.part}{self.share.suffix if self.share else ''}"

    @property
    def unavailable(self) -> str | None:
        return BACKENDS[self.backend_name].unavailable_reason()

    def target(self, expectations: tuple[Expectation, ...] = ()) -> Target:
        """The target, with the deviations declared for its implementation among ``expectations``."""
        return Target.named(self.spec, self.impl_name, self.impl_ref, self.backend_name, expectations)


def gate_tests(options: Options) -> list[GateTest]:
    """Every test of the generic gate the options ask for (the coverage examples are
    searched here, once per process, or read from their cache)."""
    chosen = options.backend_names
    tests = []
    for spec in options.selected_specs():
        for impl_name, ref in options.implementations(spec).items():
            selected = [b for b in spec.backends_for(impl_name) if b in chosen]
            for name in selected:
                first = name == selected[0] and bool(spec.bug_classes)
                if first:
                    tests += [GateTest(spec, impl_name, ref, name, COVERAGE, share, runs_coverage=True)
                              for share in coverage.shares(len(coverage.examples(spec)))]
                tests.append(GateTest(spec, impl_name, ref, name, DRAWN, runs_coverage=first))
    return tests


@dataclasses.dataclass(frozen=True)
class InvalidInputTest:
    """One parametrization of the gate's invalid-input test: a call an implementation under
    test must reject with a clear error."""

    spec: KernelSpec
    impl_name: str
    impl_ref: str
    call: InvalidCall | None  # None: the family's calls could not be built (``unbuilt`` says why)
    unbuilt: str | None = None

    @property
    def id(self) -> str:
        return f"{self.spec.name}-{self.impl_name}-{self.call.description if self.call else 'invalid_calls'}"

    @property
    def shipped(self) -> bool:
        """One of the family's own implementations: its exception class is part of the
        contract too (another implementation may reject with its own class)."""
        return self.spec.default_impls.get(self.impl_name) == self.impl_ref

    def expected(self, expectations: tuple[Expectation, ...]) -> Expectation | None:
        """The declared deviation of this call for this implementation, if any."""
        if self.call is None:
            return None
        return next((e for e in for_target(expectations, self.spec.name, self.impl_ref)
                     if e.kind == INVALID_CALL and e.name == self.call.description), None)


def invalid_input_tests(options: Options) -> list[InvalidInputTest]:
    """Each invalid call of each family, made to every implementation the run verifies. A
    family whose calls cannot be built for an implementation (they use a helper of its
    module it lacks) gets one failing test that says so, not a collection error that would
    stop every other test."""
    tests = []
    for spec in options.selected_specs():
        for impl_name, ref in options.implementations(spec).items():
            try:
                calls = spec.invalid_calls(resolve_impl(ref))
            except Exception as exc:  # noqa: BLE001 - reported by the test it becomes
                tests.append(InvalidInputTest(spec, impl_name, ref, None, f"{type(exc).__name__}: {exc}"))
                continue
            tests += [InvalidInputTest(spec, impl_name, ref, call) for call in calls]
    return tests


def unavailable_requests(options: Options) -> list[str]:
    """Backends asked for by name that cannot run here: an error, not a skip (asking for
    every available backend, the default, is not asking for any one)."""
    if not options.explicit_backends:
        return []
    return [f"backend {name} requested but unavailable: {reason}" for name in options.backend_names
            if (reason := BACKENDS[name].unavailable_reason()) is not None]


@functools.cache
def _by_id(options: Options) -> dict[str, GateTest]:
    return {test.id: test for test in gate_tests(options)}


@functools.cache
def _invalid_by_id(options: Options) -> dict[str, InvalidInputTest]:
    return {test.id: test for test in invalid_input_tests(options)}


def _param_id(nodeid: str) -> str | None:
    if "[" not in nodeid or not nodeid.endswith("]"):
        return None
    return nodeid.rpartition("[")[2][:-1]


def test_of_nodeid(options: Options, nodeid: str) -> GateTest | None:
    """The gate test a node id names (None: not a gate test). Any other test's id returns
    at once: listing the gate tests searches every family's coverage examples."""
    return _by_id(options).get(_param_id(nodeid)) if "test_kernel_matches_oracle" in nodeid else None


def invalid_test_of_nodeid(options: Options, nodeid: str) -> InvalidInputTest | None:
    """The invalid-input test a node id names (None: not one)."""
    return _invalid_by_id(options).get(_param_id(nodeid)) if "test_invalid_input" in nodeid else None


def skipped_backends(options: Options) -> list[tuple[str, str]]:
    """(backend, why it did not run) for every backend that did not."""
    chosen = options.backend_names
    skipped = [(name, reason) for name, b in BACKENDS.items() if (reason := b.unavailable_reason()) is not None]
    return skipped + [(name, "not selected (--attncheck-backend)") for name, b in BACKENDS.items()
                      if name not in chosen and b.unavailable_reason() is None]
