"""KernelSpec: everything the generic gate needs to know about one kernel family.

A spec maps a family's calling convention and semantics onto the float64 oracle. The gate
test is written once against this interface; adding a kernel family is adding a spec
(``docs/families.md``, "Adding a kernel family", walks through the toy spec).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import inspect
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from hypothesis import strategies as st

from attncheck import bugclasses, parameters
from attncheck import strategies as S
from attncheck.cases import Case, Params, check_params_type
from attncheck.bugclasses import BugClass
from attncheck.expectations import BUG_CLASS, CONTRACT, INVALID_CALL, KINDS, Contract, Expectation, Shipped
from attncheck.layouts import ErrorMapLayout

P = TypeVar("P", bound=Params)

# Axis names of attention outputs and gradients in [B, H, S, D] (for reproducer messages).
ATTENTION_AXES = {"out": ("batch", "head", "query", "dim"), "dq": ("batch", "head", "query", "dim"),
                  "dk": ("batch", "head", "key", "dim"), "dv": ("batch", "head", "key", "dim")}
BIAS_AXES = ("batch", "head", "query", "key")
# Cells of real parameters outside every attention convention here (``fixed_parameters``
# through ``parameters.outside_convention``).
SOFT_CAP_IS_POSITIVE = "a soft cap is a positive bound, cap * tanh(x / cap): 0 divides by zero"
# What every family's convention promises of its sums, as the yardstick computes them.
FLOAT32_ACCUMULATION = Contract(
    "float32_accumulation", "sums (P @ V, the softmax denominator, dP = dO.v, every gradient's reduction) accumulate "
    "in float32 for bfloat16 and float32 inputs; an implementation that knowingly accumulates lower declares its "
    "family's class of long or cancelling bfloat16 reductions of values offset from 0 a deviation "
    "(long_reduction_offset_values, long_reduction_sink, bf16_long_kv_offset_values, values_offset__dtype_bfloat16)")
MASK_VALUE_UNDERFLOWS = ("a mask value must underflow against every visible logit: a large negative number (one "
                         "of another cell would make hidden keys visible)")


def values_by_dtype(value_kinds: tuple[str, ...] = S.VALUE_KINDS) -> tuple[BugClass, ...]:
    """The value distributions a family draws (``strategies.VALUE_KINDS``: large logits, v
    far from 0, ...) crossed with the dtypes: a precision bug shows where both meet (v's
    offset in a bfloat16 accumulation)."""
    return bugclasses.pairwise(
        bugclasses.partition("values", **{kind: (lambda p, kind=kind: p.values == kind) for kind in value_kinds}),
        bugclasses.partition("dtype", **{name: (lambda p, name=name: p.dtype == name) for name in S.DTYPES}))


@dataclasses.dataclass(frozen=True)
class InvalidCall:
    """A call a kernel must reject with its own clear error."""

    description: str
    call: Callable[[], Any]
    error: type[BaseException] | tuple[type[BaseException], ...]  # raised by the family's own implementations
    match: str  # regex the message must contain (names the offending argument): any implementation


class KernelSpec(abc.ABC, Generic[P]):
    """One kernel family: its implementations, cases, oracle mapping and yardstick.

    Class attributes (checked when the spec is instantiated):
    - ``name``: the family's name (``--attncheck-kernel``, records, case ids);
    - ``params_type``: the frozen :class:`~attncheck.cases.Params` dataclass of its cases;
    - ``default_impls``: implementation name -> "module:function" of the convention;
    - ``backends``: the backends it runs on; the first also runs the coverage examples;
    - ``impl_backends``: optionally, a default implementation's own backends where they
      differ (a pure-JAX and a Pallas implementation of one convention); a user's
      implementation (``--attncheck-impl``) gets every backend of the family;
    - ``bug_classes``: :class:`~attncheck.bugclasses.BugClass` predicates, each exercised in
      every gate run (``bugclasses.bug_classes(name=predicate, ...)``);
    - ``examples``: drawn cases per backend in the CI profile (profiles scale them); a
      backend missing here draws ``DEFAULT_EXAMPLES``;
    - ``fixed_parameters``: parameter name (a ``*`` stands for anything) -> why the gate keeps it at
      one value (``attncheck.parameters``: every other parameter must vary in a run);
    - ``keyword_targets``: "module:function" of what an implementation's ``**kwargs`` are
      forwarded to, so that their keywords are part of its parameter surface;
    - ``contracts``: :class:`~attncheck.expectations.Contract` objects, properties of its kernels
      the gate holds every implementation to on purpose (the oracle is given what the
      kernel is declared to compute), one sentence each; one that fixes particular
      elements (``Contract.elements``) can be declared not promised by an implementation;
    - ``expectations``: :class:`~attncheck.expectations.Shipped` entries, the family's own
      findings: deviations of its default implementations (bug classes, invalid calls,
      contracts), each with its reason. They run like any user's declared deviation;
    - ``explicit_examples``: class name -> its coverage example written out, for a class
      the search's budget rarely draws (it would be a coverage hole);
    - ``directions``: each direction the family judges, in the order its kernel delivers
      them (the output, then the gradients) -> the names of its array's axes (None:
      unnamed); each is delivered in the case's ``dtype`` unless ``output_dtypes`` says
      otherwise;
    - ``exact_directions``: the directions that are copies, not computations (a KV cache
      the kernel writes new tokens into), compared with no tolerance
      (``numerics.compare(exact=True)``); ``yardstick`` leaves them out.
    """

    DEFAULT_EXAMPLES: ClassVar[int] = 4

    name: ClassVar[str]
    params_type: ClassVar[type[Params]]
    default_impls: ClassVar[Mapping[str, str]]
    backends: ClassVar[tuple[str, ...]]
    impl_backends: ClassVar[Mapping[str, tuple[str, ...]]] = types.MappingProxyType({})
    bug_classes: ClassVar[tuple[BugClass, ...]] = ()
    examples: ClassVar[Mapping[str, int]] = types.MappingProxyType({})
    fixed_parameters: ClassVar[Mapping[str, str]] = types.MappingProxyType({})
    keyword_targets: ClassVar[tuple[str, ...]] = ()
    contracts: ClassVar[tuple[Contract, ...]] = ()
    expectations: ClassVar[tuple[Shipped, ...]] = ()
    explicit_examples: ClassVar[Mapping[str, Case]] = types.MappingProxyType({})
    directions: ClassVar[Mapping[str, tuple[str, ...] | None]] = types.MappingProxyType({})
    exact_directions: ClassVar[frozenset[str]] = frozenset()

    def __init__(self) -> None:
        from attncheck.backends import BACKENDS

        for attribute in ("name", "params_type", "default_impls", "backends"):
            if not hasattr(self, attribute):
                raise TypeError(f"{type(self).__name__}: a KernelSpec must set the class attribute {attribute!r}")
        check_params_type(self.params_type)
        if not self.directions and type(self).output_dtypes is KernelSpec.output_dtypes:
            raise TypeError(f"{type(self).__name__}: a KernelSpec must declare its directions (or override "
                            "output_dtypes)")
        unknown = [b for b in (*self.backends, *self.examples) if b not in BACKENDS]
        if unknown or not self.backends:
            raise TypeError(f"{type(self).__name__}: backends {list(self.backends)} / examples "
                            f"{list(self.examples)} must name known backends ({', '.join(BACKENDS)})")
        stray = {name: b for name, b in self.impl_backends.items()
                 if name not in self.default_impls or not b or not set(b) <= set(self.backends)}
        if stray:
            raise TypeError(f"{type(self).__name__}: impl_backends {stray} must name default implementations and "
                            f"some of the family's backends {list(self.backends)}")
        names = [c.name for c in self.bug_classes]
        if len(names) != len(set(names)):
            raise TypeError(f"{type(self).__name__}: bug class names repeat: {names}")
        contracts = [c.name for c in self.contracts]
        if len(contracts) != len(set(contracts)) or not all(isinstance(c, Contract) for c in self.contracts):
            raise TypeError(f"{type(self).__name__}: contracts must be Contracts with distinct names: {contracts}")
        for e in self.expectations:
            known = {BUG_CLASS: names, CONTRACT: [c.name for c in self.contracts if c.elements is not None],
                     INVALID_CALL: None}.get(e.kind, ())
            if e.impl not in self.default_impls or e.kind not in KINDS or (known is not None and e.name not in known):
                raise TypeError(f"{type(self).__name__}: expectation {e} must name a default implementation "
                                f"({list(self.default_impls)}), a kind of {KINDS} and one of the family's own")

    # ------------------------------------------------------------------ cases
    @abc.abstractmethod
    def cases(self) -> st.SearchStrategy[Case[P]]: ...

    def program(self, params: P) -> Hashable:
        """What a case's compiled program depends on: its params without what the kernel
        is given as data (values, segment layouts, lengths). Cases of one program share a
        compile (``compiled.compiled`` is keyed by it); default: all of the params."""
        return params

    def other_data(self, params: P) -> st.SearchStrategy[P]:
        """The params with another draw of what ``program`` leaves out (default: the same
        params, for a family whose data is all in a case's seed)."""
        return st.just(params)

    def variants(self, case: Case[P], count: int) -> st.SearchStrategy[list[Case[P]]]:
        """``count`` cases of ``case``'s program with other data: what the gate's drawn
        part runs beside a drawn case instead of compiling another program
        (``profiles.cases_per_program``). Their seeds follow the case's, so that no variant
        is the case again or another variant (a derandomized draw starts from the
        simplest data, the case's own); a family may leave out a variant that would prove
        nothing."""
        return st.lists(self.other_data(case.params), min_size=count, max_size=count).map(
            lambda drawn: [Case(case.family, params, (case.seed + n) % 2**32) for n, params in enumerate(drawn, 1)])

    def case(self, seed: int, **params) -> Case[P]:
        """A case of this family from keyword parameters."""
        return Case(self.name, self.params_type(**params), seed)

    def case_from_json(self, data: Mapping) -> Case[P]:
        return Case.from_json(data, self.params_type)

    def fit_sequences(self, params: P, multiple: int) -> P:
        """The params with every sequence length rounded up to a multiple of ``multiple``,
        keeping what the bug classes read of the shape (``attncheck.domain``); a family
        whose draws cannot be fitted so says it."""
        raise NotImplementedError(f"family {self.name!r} cannot fit its draws to sequence lengths that are "
                                  f"multiples of {multiple} (an implementation's Domain.sequence_multiple); "
                                  "its spec defines no fit_sequences")

    def backends_for(self, impl_name: str) -> tuple[str, ...]:
        """The backends an implementation runs on; the first also runs its coverage examples."""
        return tuple(self.impl_backends.get(impl_name, self.backends))

    def parameters(self, impl: Callable, case: Case[P], inputs: dict[str, np.ndarray]) -> dict[str, str] | None:
        """The parameter surface of this case's call of ``impl`` (``attncheck.parameters``)."""
        return parameters.record(lambda probe: self.evaluate(probe, case, inputs), impl,
                                 [resolve_impl(ref) for ref in self.keyword_targets])

    def examples_for(self, backend: str) -> int:
        return self.examples.get(backend, self.DEFAULT_EXAMPLES)

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.bug_classes)

    def classes(self, case: Case[P]) -> list[str]:
        """Bug classes this case exercises, from its parameters."""
        return bugclasses.exercised(self.bug_classes, case.params)

    # ------------------------------------------------------------------ running
    @abc.abstractmethod
    def inputs(self, case: Case[P]) -> dict[str, np.ndarray]:
        """The rounded inputs (and cotangents) of a case, rebuilt from its seed."""

    @abc.abstractmethod
    def evaluate(self, impl: Callable, case: Case[P], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Forward output and gradients, keyed by direction."""

    def lower(self, impl: Callable, case: Case[P]) -> dict[str, Callable[[], Any]]:
        """Direction -> a thunk exporting that computation for platform tpu (families
        without a Pallas backend export nothing)."""
        return {}

    # ------------------------------------------------------------------ judging
    @abc.abstractmethod
    def oracle(self, case: Case[P], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Float64 truth for every direction, from the same rounded inputs."""

    @abc.abstractmethod
    def yardstick(self, case: Case[P], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The naive same-precision implementation's result for every direction but the
        ``exact_directions``: the tolerance is scaled by its distance to the oracle
        (``attncheck.numerics``)."""

    def output_dtypes(self, case: Case[P]) -> dict[str, Any]:
        """Direction -> dtype the kernel delivers it in (ulps are counted in it): every
        direction in the case's ``dtype``."""
        return dict.fromkeys(self.directions, S.dtype_of(case.params.dtype))

    def care(self, case: Case[P], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
        """Direction -> mask of elements that count (False: don't-care padding)."""
        return {}

    def deviation_elements(self, entry: Expectation, case: Case[P], inputs: dict[str, np.ndarray]
                           ) -> Mapping[str, np.ndarray] | None:
        """Direction -> mask of the elements a declared deviation touches in this case (the
        elements of a contract not promised, or of a bug class that says which), or None
        when the family cannot say: then the whole case may deviate."""
        if entry.kind == CONTRACT:
            contract = next(c for c in self.contracts if c.name == entry.name)
            return contract.elements(case, inputs)
        bug_class = next(c for c in self.bug_classes if c.name == entry.name)
        return None if bug_class.affects is None else bug_class.affects(case, inputs)

    def index_names(self, direction: str) -> tuple[str, ...] | None:
        """Names of the axes of a direction's array, for reproducer messages."""
        return self.directions.get(direction)

    def error_map_layout(self, case: Case[P], direction: str) -> ErrorMapLayout | None:
        """How a direction's error map is laid out (``attncheck.report.errormap``): the axes
        shown as rows and columns, and the kernel's block boundaries on them from the
        case's block sizes (``layouts.every``). Default: the last two axes named by
        ``index_names``, no boundaries; None (no names): the last two axes, unnamed."""
        names = self.index_names(direction)
        return None if names is None else ErrorMapLayout.last_axes(names)

    def invalid_calls(self, impl: Callable) -> list[InvalidCall]:
        """Calls ``impl`` (any implementation of the convention: the family's own or a
        user's) must reject with a clear error, one per validation branch, so each branch
        is exercised on every run. The message naming the argument (``match``) is the
        contract; ``error`` is the class the family's own implementations raise."""
        return []


def positional_invalid_calls(impl: Callable, array_args: tuple[str, ...], good: dict[str, Any],
                             arrays: Mapping[str, tuple[dict, str]], options: Mapping[str, tuple[dict, str]],
                             **keywords) -> list[InvalidCall]:
    """Invalid calls of a convention that passes its arrays positionally (implementations
    name the first one differently: queries, q): each of ``arrays`` changes some of the
    ``good`` arrays, each of ``options`` some keywords (besides ``keywords``); kind ->
    (change, the pattern its error message must match)."""
    def call(changed_arrays=None, changed_keywords=None):
        given = {**good, **(changed_arrays or {})}
        return lambda: impl(*(given[n] for n in array_args), **{**keywords, **(changed_keywords or {})})

    return [InvalidCall(kind, call(changed_arrays=change), (ValueError, TypeError), match)
            for kind, (change, match) in arrays.items()] + [
            InvalidCall(kind, call(changed_keywords=change), (ValueError, TypeError), match)
            for kind, (change, match) in options.items()]


def accepted_keywords(impl: Callable, **keywords) -> dict[str, Any]:
    """The keywords ``impl`` accepts, of options beyond a convention's required ones (an
    implementation's own knobs: a kernel exposing them has them varied, another is called
    without them). None values are left to the implementation's defaults."""
    try:
        parameters = inspect.signature(impl).parameters
    except (TypeError, ValueError):
        return {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return {name: value for name, value in keywords.items()
            if value is not None and (takes_any or name in parameters)}


def resolve_impl(ref: str) -> Callable:
    """Import "package.module:function"."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"implementation reference {ref!r}: expected 'package.module:function'")
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"implementation reference {ref!r}: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"implementation reference {ref!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"implementation reference {ref!r}: {type(target).__name__} is not callable")
    return target
