"""The check pipeline: run one case of one implementation on one backend, judge every
direction against the oracle, and produce one record per comparison.

Shared by the gate tests, ``attncheck repro`` and the mutation runner, so a reproducer
reruns exactly what the gate ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import shlex
import time
import traceback
from collections.abc import Callable, Iterator

import numpy as np

from attncheck import interpret_compat, numerics, structure, yardstick
from attncheck.backends import BACKENDS, Backend
from attncheck.cases import Case
from attncheck.compiled import impl_origin, release_when_mappings_run_out
from attncheck.domain import DECLARED as DOMAIN_REFUSAL
from attncheck.domain import Domain, taken
from attncheck.domain import of as domain_of
from attncheck.expectations import (
    BUG_CLASS,
    CONTRACT,
    UNSUPPORTED_BY_IMPLEMENTATION,
    Expectation,
    for_target,
    refusal,
)
from attncheck.report import DEFAULT_DIR as DEFAULT_REPORT_DIR
from attncheck.report import errormap
from attncheck.report.records import CaseRun, Record, target_id
from attncheck.specs.base import KernelSpec, resolve_impl

# A yardstick this far from the oracle means the spec's mapping or the yardstick is wrong,
# and would inflate the tolerance: fail loudly instead of passing anything...
MAX_YARDSTICK_ULPS = 4096.0
# ...unless the same yardstick computed in float64 (``yardstick.exact``) is at most 1/this
# of that distance from the oracle: then the working precision explains it. A gradient that
# cancels to about 0 (dq of a saturated softmax: 3e-16 in float64) is all rounding in
# float32 (1.4e-5, 5e17 ulps at its magnitude), and a bfloat16 dk of large values cancels
# to 1/29 of what its rounding costs (7489 ulps, in a sum too short for its summation
# orders to differ), while a wrong mapping is as wrong in float64.
ROUNDING_FACTOR = 8.0
# A backend is credited only with what ran on it: an interpreted case whose kernel made no
# call into the Pallas interpreter, and a lowering with no Mosaic kernel in it, verified
# nothing of the backend (the implementation fell back to XLA).
NO_KERNEL_RAN = ("no Pallas kernel ran on {backend}: the implementation made no call into the Pallas interpreter "
                 "(it fell back to XLA?); this backend verifies Pallas kernels only")
MOSAIC_CALL = "tpu_custom_call"
NO_KERNEL_LOWERED = ("lowered for platform tpu without a Pallas kernel (no Mosaic tpu_custom_call in the module): "
                     "the implementation fell back to XLA, so no Pallas kernel was lowered")
# Spec modules under this package are always known to ``attncheck repro``; any other one
# (``--attncheck-spec``) is named in the reproducer so that it stays one command.
BUILTIN_SPEC_PACKAGE = "attncheck.specs."


@dataclasses.dataclass(frozen=True)
class Target:
    """One implementation of a family on one backend: what a gate test verifies, with the
    deviations declared for that implementation (``attncheck.expectations``)."""

    spec: KernelSpec
    impl_name: str
    impl: Callable
    backend: Backend
    expected: tuple[Expectation, ...] = ()
    ref: str | None = None  # "module:function" as the run names it (None: where impl comes from)

    @classmethod
    def named(cls, spec: KernelSpec, impl_name: str, impl_ref: str, backend_name: str,
              declared: tuple[Expectation, ...] = ()) -> Target:
        """The target a run names (a gate test, a record to reproduce): the implementation
        found by its reference, the backend by its name, and the deviations declared for
        that implementation among ``declared``."""
        return cls(spec, impl_name, resolve_impl(impl_ref), BACKENDS[backend_name],
                   for_target(declared, spec.name, impl_ref), impl_ref)

    @property
    def id(self) -> str:
        return target_id(self.spec.name, self.impl_name, self.backend.name)

    @property
    def impl_ref(self) -> str:
        """The reference that finds the implementation again: as the run named it, which is
        what a table of expectations names too."""
        return self.ref or ":".join(map(str, impl_origin(self.impl)))

    @property
    def domain(self) -> Domain:
        return domain_of(self.impl)

    def fit(self, case: Case) -> Case:
        """The case fitted to the implementation's declared domain: the parameters it takes
        one value of, and its sequence multiple."""
        declared = self.domain
        params = taken(declared, case.params)
        if declared.sequence_multiple > 1:
            params = self.spec.fit_sequences(params, declared.sequence_multiple)
        return case if params == case.params else Case(case.family, params, case.seed)

    def refusal(self, case: Case) -> str | None:
        """Why the implementation's declared domain leaves this case out (None: it takes it)."""
        return self.domain.refusal(case.params, self.spec.fit_sequences)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The records of one case; ``fatal`` says why the test must stop at once (a timeout
    caught inside the kernel: going on would re-arm the timer for the next case)."""

    records: list[Record]
    fatal: str | None = None

    @property
    def failures(self) -> list[Record]:
        return [r for r in self.records if r.failing]

    def summary(self) -> str:
        return "\n".join(f"{r.kernel}/{r.impl} on {r.backend}: {r.direction} {r.outcome.upper()}: {r.reason}\n"
                         f"  reproduce: {r.repro}" for r in self.failures)


def repro_command(target: Target, case: Case, report_dir: str | None = None) -> str:
    command = f"attncheck repro {case.id} --impl {target.impl_name} --backend {target.backend.name}"
    module = type(target.spec).__module__
    if not module.startswith(BUILTIN_SPEC_PACKAGE):
        command += f" --spec {module}"
    if report_dir is not None and report_dir != DEFAULT_REPORT_DIR:
        command += f" --report {shlex.quote(report_dir)}"
    return command


def case_run(target: Target, case: Case, report_dir: str | None = None, nodeid: str = "") -> CaseRun:
    """What a record of this case says before any verdict (also its started marker)."""
    spec, p = target.spec, case.params
    settings = target.backend.recorded_settings(case.seed, p.device_count, p.simulated_cores)
    return CaseRun(
        case_id=case.id, case=case.to_json(), kernel=spec.name, impl=target.impl_name, impl_ref=target.impl_ref,
        backend=target.backend.name, backend_settings=settings,
        dtype=p.dtype, seq_len=p.sequence_length, device_count=p.device_count, classes=tuple(spec.classes(case)),
        repro=repro_command(target, case, report_dir), nodeid=nodeid)


# ------------------------------------------------------------------ timing
# jax's own spans for tracing, lowering to MLIR and XLA compilation (or loading from the
# persistent cache): how much of a phase was compile rather than run.
COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                            "/jax/core/compile/jaxpr_to_mlir_module_duration",
                            "/jax/core/compile/backend_compile_duration"})


class Timings(dict):
    """Seconds per phase of a case (``<phase>_s``) and the part of it spent tracing and
    compiling (``<phase>_compile_s``); nested spans (a jit traced inside another) count once."""

    @contextlib.contextmanager
    def phase(self, name: str, *, compiles: bool = False) -> Iterator[None]:
        import jax

        spans: list[tuple[float, float]] = []

        def listener(event, start, end, **_):
            if event in COMPILE_EVENTS:
                spans.append((start, end))

        if compiles:
            jax.monitoring.register_event_time_span_listener(listener)
        start = time.perf_counter()
        try:
            yield
        finally:
            self[f"{name}_s"] = time.perf_counter() - start
            if compiles:
                jax.monitoring.unregister_event_time_span_listener(listener)
                total, reach = 0.0, float("-inf")
                for begin, end in sorted(spans):
                    total += max(0.0, end - max(begin, reach))
                    reach = max(reach, end)
                self[f"{name}_compile_s"] = total


# ------------------------------------------------------------------ errors
ERROR_HEAD = ERROR_TAIL = 1500
# pytest-timeout ends a hung test with pytest.fail("Timeout (>Ns) from pytest-timeout."); raised
# inside a jax host callback (an interpret-mode kernel), XLA wraps it into a runtime error
# that keeps the text.
_TIMEOUT = re.compile(r"Timeout \(?>[0-9.]+s\)?( from pytest-timeout)?")


def error_text(exc: BaseException, *, interpreted: bool = False) -> str:
    """The exception in one string. Raised in Pallas TPU interpret mode (``interpreted``): a
    known limitation of the interpreter as ``unsupported by interpret mode: <operation>``,
    an error raised inside an interpreter callback as its own last line, not the callback's
    traceback. Else (and always for a timeout, whose text must stay) its head and its tail
    (where the cause is)."""
    if interpreted and not timeout_in(exc):
        line = interpret_compat.interpreter_limitation(exc) or interpret_compat.callback_error_line(exc)
        if line:
            return line
    text = f"{type(exc).__name__}: {exc}"
    if len(text) <= ERROR_HEAD + ERROR_TAIL:
        return text
    return f"{text[:ERROR_HEAD]} ... [{len(text) - ERROR_HEAD - ERROR_TAIL} characters] ... {text[-ERROR_TAIL:]}"


def timeout_in(exc: BaseException) -> str | None:
    """pytest-timeout's message, if the exception is, wraps or was caused by its failure."""
    for error in interpret_compat.exception_chain(exc):
        found = _TIMEOUT.search(str(error))
        if found:
            return found.group(0)
    return None


def _refused(base: CaseRun, direction: str, target: Target, exc: BaseException, timings: dict) -> Record | None:
    """The record of a case the implementation refused as a configuration it declares
    unsupported (``expectations.refusal``); None when it declares no such refusal."""
    found = refusal(target.expected, interpret_compat.exception_chain(exc))
    if found is None:
        return None
    entry, line = found
    return Record(**dataclasses.asdict(base), direction=direction, outcome="error",
                  reason=f"{UNSUPPORTED_BY_IMPLEMENTATION}{line}", timings=dict(timings), expected=entry.id,
                  deviations={entry.id: True})


def _error(base: CaseRun, direction: str, exc: BaseException, timings: dict, *, interpreted: bool = False
           ) -> Record:
    return Record(**dataclasses.asdict(base), direction=direction, outcome="error",
                  reason=error_text(exc, interpreted=interpreted), traceback=traceback.format_exc(limit=8),
                  timings=dict(timings))


# ------------------------------------------------------------------ judging
def judge(base: CaseRun, direction: str, got, truth: np.ndarray, reference: np.ndarray, *, dtype, care,
          timings: dict, exact: Callable[[], np.ndarray] | None = None, copied: bool = False) -> Record:
    """One direction's record: the tolerance policy, the dtype rule, and the refusal of a
    tolerance built on a broken yardstick (``exact``: the yardstick computed in float64,
    asked for only then; ``copied``: the direction is compared exactly). Whatever the kernel
    returned (another shape, a list, no array at all) ends in a record: another tree or shape
    than the oracle's is an error in chex's words (``attncheck.structure``), before anything
    is compared."""
    start = time.perf_counter()
    wrong = structure.mismatch(direction, got, np.shape(truth))
    if wrong is not None:
        return Record(**dataclasses.asdict(base), direction=direction, outcome="error", reason=wrong,
                      timings=dict(timings, compare_s=time.perf_counter() - start))
    try:
        cmp = numerics.compare(got, truth, reference, dtype=dtype, direction=direction, care=care, exact=copied)
        delivered = np.asarray(got).dtype
    except Exception as exc:  # noqa: BLE001 - what the kernel returned cannot be compared
        return _error(base, direction, exc, timings)
    outcome, reason = ("pass" if cmp.passed else "fail"), cmp.reason
    if delivered != np.dtype(dtype):
        # A gradient in another dtype than its primal breaks the caller's optimizer state
        # and hides precision loss (or gain) from the comparison above. The rule is this
        # comparison; chex only words it.
        worded = structure.dtype_mismatch(got, dtype)
        outcome, reason = "fail", (f"returned {direction} in {delivered}, expected {np.dtype(dtype)} "
                                   f"(the dtype of its input{'; ' + worded if worded else ''}); {cmp.reason}")
    if cmp.passed and cmp.yardstick_ulps > MAX_YARDSTICK_ULPS:
        left, why = _left_in_float64(exact, truth, care)
        if not left * ROUNDING_FACTOR <= cmp.yardstick_err:
            outcome = "error"
            reason = (f"yardstick is {cmp.yardstick_ulps:.0f} ulps from the oracle (> {MAX_YARDSTICK_ULPS:g}), and "
                      f"{why} (rounding explains the distance {cmp.yardstick_err:.3g} only if float64 leaves at most "
                      f"1/{ROUNDING_FACTOR:g} of it): the spec's mapping or the yardstick is wrong; refusing a "
                      "tolerance built on it")
    return Record(**dataclasses.asdict(base), direction=direction, outcome=outcome, reason=reason, metrics=cmp,
                  timings=dict(timings, compare_s=time.perf_counter() - start))


def _left_in_float64(exact: Callable[[], np.ndarray] | None, truth: np.ndarray, care) -> tuple[float, str]:
    """How far the yardstick computed in float64 still is from the oracle, and in words."""
    if exact is None:
        return math.inf, "it was not computed in float64"
    try:
        left = numerics.distance(exact(), truth, care)
    except Exception as exc:  # noqa: BLE001 - a spec's yardstick that cannot run in float64
        return math.inf, f"computing it in float64 failed: {error_text(exc)}"
    return left, f"computed in float64 it is still {left:.3g} from it"


def with_error_map(record: Record, spec: KernelSpec, case: Case, got, truth: np.ndarray, care,
                   maps: errormap.MapPolicy) -> Record:
    """The record with its error map when ``maps`` keeps one for it. The map's time is
    part of the comparison's (``compare_s``) and also on its own (``error_map_s``)."""
    if record.metrics is None or not maps.keep((record.kernel, record.impl, record.direction), record.budget,
                                               not record.passed):
        return record
    start = time.perf_counter()
    try:
        emap = errormap.build(got, truth, allowed=record.metrics.allowed, direction=record.direction,
                              layout=spec.error_map_layout(case, record.direction), care=care)
    except Exception as exc:  # noqa: BLE001 - a spec whose layout does not fit its arrays: say so
        reason = (f"error map of {record.direction}: {error_text(exc)} (the spec's error_map_layout does not fit); "
                  f"{record.reason}")
        return dataclasses.replace(record, outcome="error", reason=reason, traceback=traceback.format_exc(limit=8))
    seconds = time.perf_counter() - start
    timings = dict(record.timings, compare_s=record.timings.get("compare_s", 0.0) + seconds, error_map_s=seconds)
    return dataclasses.replace(record, error_map=emap, timings=timings)


# ------------------------------------------------------------------ the case
def check_case(target: Target, case: Case, *, report_dir: str | None = None, nodeid: str = "",
               started: Callable[[CaseRun], None] | None = None,
               maps: errormap.MapPolicy | None = None) -> Outcome:
    """Run a case and judge every direction; ``started`` is told the case is about to run;
    ``maps`` chooses the records that carry an error map (None: none)."""
    base = case_run(target, case, report_dir, nodeid)
    release_when_mappings_run_out()
    if started is not None:
        started(base)
    outside = target.refusal(case)
    if outside is not None:
        return Outcome([Record(**dataclasses.asdict(base), direction="all", outcome="error",
                               reason=f"{UNSUPPORTED_BY_IMPLEMENTATION}{outside}", expected=DOMAIN_REFUSAL)])
    if not target.backend.compares_numerics:
        return _check_lowering(target, case, base)

    spec, p = target.spec, case.params
    timings = Timings()
    # Inputs are NumPy, except where a convention makes the kernel's own function part
    # of them (the ring dropout mask): its trace and compile are kernel work.
    with timings.phase("inputs", compiles=True):
        inputs = spec.inputs(case)
    with timings.phase("parameters"):
        base = dataclasses.replace(base, parameters=spec.parameters(target.impl, case, inputs))
    try:
        with (target.backend.context(case.seed, p.device_count, p.simulated_cores) as interpreted,
              timings.phase("kernel", compiles=True)):
            got = spec.evaluate(target.impl, case, inputs)
        if not isinstance(got, dict):
            raise TypeError(f"the spec's evaluate() returned {type(got).__name__}, expected a dict of directions")
    except Exception as exc:  # noqa: BLE001 - the kernel crashed: one error record, the test fails
        refused = _refused(base, "all", target, exc, timings)
        if refused is not None:
            return Outcome([refused])
        record = _error(base, "all", exc, timings, interpreted=target.backend.interprets)
        return Outcome([_expected_if_whole(record, target, case, inputs)], fatal=timeout_in(exc))
    if interpreted is not None and not interpreted.kernel_ran:
        # What ran was not a Pallas kernel (an implementation that falls back to XLA off
        # a TPU): its numbers say nothing of this backend, and no declaration excuses it.
        return Outcome([Record(**dataclasses.asdict(base), direction="all", outcome="error",
                               reason=NO_KERNEL_RAN.format(backend=target.backend.name), timings=dict(timings))])
    with timings.phase("oracle"):
        truth = spec.oracle(case, inputs)
    with timings.phase("yardstick", compiles=True):
        # A copied direction is compared exactly: it has no yardstick but the oracle.
        reference = {**_yardsticks(spec, case, inputs), **{d: (truth[d],) for d in spec.exact_directions}}
    exact = functools.cache(lambda: _exact_yardstick(spec, case, inputs))
    care, dtypes = spec.care(case, inputs), spec.output_dtypes(case)
    deviating = Deviating.of(target, case, inputs, base)
    strict = deviating.strict(care)
    records = []
    for direction in truth:
        if direction not in got:
            records.append(Record(**dataclasses.asdict(base), direction=direction, outcome="error",
                                  reason=f"implementation returned no {direction!r}", timings=dict(timings)))
            continue
        record = judge(base, direction, got[direction], truth[direction], reference[direction],
                       dtype=dtypes[direction], care=strict.get(direction), timings=timings,
                       exact=lambda d=direction: exact()[d], copied=direction in spec.exact_directions)
        record = deviating.mark(record, got[direction], truth[direction], reference[direction], dtypes[direction],
                                care.get(direction), copied=direction in spec.exact_directions)
        if record.failing and record.metrics is not None:
            record = _contracts_broken(record, spec, case, inputs, got[direction], truth[direction],
                                       reference[direction], dtypes[direction], strict.get(direction))
        if maps is not None:
            record = with_error_map(record, spec, case, got[direction], truth[direction], strict.get(direction), maps)
        records.append(record)
    return Outcome(records)


def _yardsticks(spec: KernelSpec, case: Case, inputs) -> dict[str, tuple[np.ndarray, ...]]:
    """Direction -> the spec's yardstick in each of ``yardstick.ORDERS`` summation orders:
    the tolerance is scaled by the largest error of them (an order equal to another changes
    nothing). A yardstick
    whose reverse order equals its given one sums in one order only and is computed once
    more, not ORDERS times."""
    samples = []
    for index in range(yardstick.ORDERS):
        with yardstick.summation_order(index):
            samples.append(spec.yardstick(case, inputs))
        if index == 1 and all(np.array_equal(samples[0][d], y, equal_nan=True) for d, y in samples[1].items()):
            break
    return {d: tuple(sample[d] for sample in samples) for d in samples[0]}


def _exact_yardstick(spec: KernelSpec, case: Case, inputs) -> dict[str, np.ndarray]:
    with yardstick.exact():
        return spec.yardstick(case, inputs)


def _applies(entry: Expectation, base: CaseRun) -> bool:
    """A declared deviation may show in this case: its bug class is the case's, or it is a
    contract (whose elements the case may have)."""
    return (entry.kind == BUG_CLASS and entry.name in base.classes) or entry.kind == CONTRACT


@dataclasses.dataclass(frozen=True)
class Deviating:
    """The declared deviations that apply to one case: those that name the elements they
    touch (``parts``, entry id -> direction -> mask), judged apart from the rest of the
    case, and those that may touch all of it (``whole``)."""

    parts: dict[str, dict[str, np.ndarray]]
    whole: tuple[str, ...]

    @classmethod
    def of(cls, target: Target, case: Case, inputs, base: CaseRun) -> Deviating:
        parts, whole = {}, []
        for entry in target.expected:
            if not _applies(entry, base):
                continue
            elements = target.spec.deviation_elements(entry, case, inputs)
            if elements is None:
                whole.append(entry.id)
            elif any(np.any(mask) for mask in elements.values()):
                parts[entry.id] = dict(elements)
        return cls(parts, tuple(whole))

    def strict(self, care: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
        """The care masks less every element a declared deviation touches."""
        dropped: dict[str, np.ndarray] = {}
        for elements in self.parts.values():
            for direction, mask in elements.items():
                dropped[direction] = mask if direction not in dropped else np.logical_or(dropped[direction], mask)
        return _without(care, dropped)

    def mark(self, record: Record, got, truth, reference, dtype, care, *, copied: bool = False) -> Record:
        """The record with, for each deviation, whether it shows in this comparison; a
        failure of a case that a whole-case deviation may touch is expected."""
        if not self.parts and not self.whole:
            return record
        shows = {}
        for entry, elements in self.parts.items():
            mask = elements.get(record.direction)
            if mask is not None and np.any(mask):
                scope = mask if care is None else np.logical_and(care, mask)
                try:
                    shows[entry] = not numerics.compare(got, truth, reference, dtype=dtype, direction=record.direction,
                                                        care=scope, exact=copied).passed
                except Exception:  # noqa: BLE001 - what the kernel returned cannot be compared: it shows
                    shows[entry] = True
        shows.update(dict.fromkeys(self.whole, not record.passed))
        expected = " ".join(self.whole) if self.whole and not record.passed else None
        return dataclasses.replace(record, deviations=shows, expected=expected)


def _contracts_broken(record: Record, spec: KernelSpec, case: Case, inputs, got, truth, reference, dtype,
                      care) -> Record:
    """The failing record with the family's contracts whose elements alone hold its failure:
    without them, the comparison passes."""
    broken = []
    for contract in spec.contracts:
        elements = None if contract.elements is None else contract.elements(case, inputs).get(record.direction)
        if elements is None or not np.any(elements):
            continue
        scope = _without({"d": care}, {"d": elements})["d"]
        try:
            if numerics.compare(got, truth, reference, dtype=dtype, direction=record.direction, care=scope,
                                exact=record.direction in spec.exact_directions).passed:
                broken.append(contract.name)
        except Exception:  # noqa: BLE001 - not comparable without them either: nothing to say
            continue
    return dataclasses.replace(record, contracts_broken=tuple(broken)) if broken else record


def _without(care: dict[str, np.ndarray | None], dropped: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
    """The care masks less the dropped elements (both broadcast to the direction's shape)."""
    return {**care, **{d: ~mask if care.get(d) is None else care[d] & ~mask for d, mask in dropped.items()}}


def _expected_if_whole(record: Record, target: Target, case: Case, inputs) -> Record:
    """A crash, or a kernel that does not lower, is expected only where a declared
    deviation may touch the whole case (a bug class without elements of its own)."""
    whole = [e.id for e in target.expected if _applies(e, record) and e.kind == BUG_CLASS
             and target.spec.deviation_elements(e, case, inputs) is None]
    if not whole or record.passed:
        return record
    return dataclasses.replace(record, deviations=dict.fromkeys(whole, True), expected=" ".join(whole))


def _check_lowering(target: Target, case: Case, base: CaseRun) -> Outcome:
    records = []
    inputs = target.spec.inputs(case)
    try:
        base = dataclasses.replace(base, parameters=target.spec.parameters(target.impl, case, inputs))
        exports = target.spec.lower(target.impl, case)
    except Exception as exc:  # noqa: BLE001
        refused = _refused(base, "all", target, exc, {})
        if refused is not None:
            return Outcome([refused])
        record = _error(base, "all", exc, {})
        return Outcome([_expected_if_whole(record, target, case, inputs)], fatal=timeout_in(exc))
    for direction, export in exports.items():
        start = time.perf_counter()
        try:
            lowered = export()
            if MOSAIC_CALL in lowered.mlir_module():
                outcome, reason, trace = "pass", "lowered for platform tpu", None
            else:
                outcome, reason, trace = "error", NO_KERNEL_LOWERED, None
        except Exception as exc:  # noqa: BLE001 - the kernel does not lower: a failing record
            refused = _refused(base, direction, target, exc, {"lower_s": time.perf_counter() - start})
            if refused is not None:
                records.append(refused)
                continue
            outcome, reason, trace = "fail", error_text(exc), traceback.format_exc(limit=8)
        record = Record(**dataclasses.asdict(base), direction=direction, outcome=outcome, reason=reason,
                        traceback=trace, timings={"lower_s": time.perf_counter() - start})
        records.append(_expected_if_whole(record, target, case, inputs))
    return Outcome(records)
