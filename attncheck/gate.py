"""The check pipeline: run one case of one implementation on one backend, judge every
direction against the oracle, and produce one record per comparison.

Shared by the gate tests, ``attncheck repro`` and the mutation runner, so a reproducer
reruns exactly what the gate ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
from collections.abc import Callable

import numpy as np

from attncheck import numerics
from attncheck.backends import BACKENDS, Backend
from attncheck.specs.base import Case, KernelSpec

# A baseline this far from the oracle means the spec's mapping or the baseline is wrong,
# and would inflate the tolerance: fail loudly instead of passing anything.
MAX_BASELINE_ULPS = 4096.0

# The gate verifies each family x implementation x backend in two tests. The coverage part
# (the simplest case of every bug class, on the family's first backend) finds most bugs
# within seconds and runs before everything else; the drawn part holds hypothesis' cases.
COVERAGE = "coverage"
DRAWN = "drawn"
# A family's coverage examples are split into tests of at most this many, so that xdist
# spreads one family's coverage over every worker instead of queueing it behind another
# family's on one worker: under -x, a bug that only a family's last examples show was found
# 64-76 s into the run with the flash coverage as one test.
COVERAGE_EXAMPLES_PER_TEST = 4


def coverage_shares(examples: int) -> list[tuple[int, int]]:
    """(index, count) of each coverage test of a family with this many examples."""
    count = max(1, -(-examples // COVERAGE_EXAMPLES_PER_TEST))
    return [(index, count) for index in range(count)]


def coverage_share(examples: list, share: tuple[int, int]) -> list:
    """The examples of one coverage test: the index-th of count contiguous runs."""
    index, count = share
    return examples[index * len(examples) // count:(index + 1) * len(examples) // count]


@dataclasses.dataclass
class Outcome:
    records: list[dict]

    @property
    def failures(self) -> list[dict]:
        return [r for r in self.records if r["outcome"] != "pass"]

    def summary(self) -> str:
        lines = [f"{r['kernel']}/{r['impl']} on {r['backend']}: {r['direction']} "
                 f"{r['outcome'].upper()}: {r['reason']}\n  reproduce: {r['repro']}"
                 for r in self.failures]
        return "\n".join(lines)


# jax's own spans for tracing, lowering to MLIR and XLA compilation (or loading from the
# persistent cache): how much of a phase was compile rather than run.
COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                            "/jax/core/compile/jaxpr_to_mlir_module_duration",
                            "/jax/core/compile/backend_compile_duration"})


@contextlib.contextmanager
def compile_seconds(timings: dict, key: str):
    """Put into ``timings[key]`` the seconds the block spent tracing and compiling; nested
    spans (a jit traced inside another) count once."""
    import jax

    spans = []

    def listener(event, start, end, **_):
        if event in COMPILE_EVENTS:
            spans.append((start, end))

    jax.monitoring.register_event_time_span_listener(listener)
    try:
        yield
    finally:
        jax.monitoring.unregister_event_time_span_listener(listener)
        total, reach = 0.0, float("-inf")
        for start, end in sorted(spans):
            total += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        timings[key] = total


# Spec modules under this package are always known to ``attncheck repro``; any other one
# (``--attncheck-spec``) is named in the reproducer so that it stays one command.
BUILTIN_SPEC_PACKAGE = "attncheck.specs."


def repro_command(case: Case, impl_name: str, backend: str, spec_module: str | None = None) -> str:
    command = f"attncheck repro {case.id} --impl {impl_name} --backend {backend}"
    if spec_module and not spec_module.startswith(BUILTIN_SPEC_PACKAGE):
        command += f" --spec {spec_module}"
    return command


def _base_record(spec: KernelSpec, impl_name: str, impl: Callable, case: Case, backend: Backend) -> dict:
    settings = backend.settings(case.seed, spec.device_count(case))
    return {
        "case_id": case.id, "case": case.to_json(), "kernel": spec.name, "impl": impl_name,
        "impl_ref": f"{impl.__module__}:{impl.__qualname__}",
        "backend": backend.name, "backend_settings": {k: v for k, v in settings.items()},
        "dtype": str(case.get("dtype", "")), "config": spec.shape_summary(case),
        "seq_len": spec.seq_len(case), "device_count": spec.device_count(case),
        "classes": sorted(spec.classes(case)), "repro": repro_command(case, impl_name, backend.name, type(spec).__module__),
    }


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 2000 else text[:2000] + " ..."


def check_case(spec: KernelSpec, impl_name: str, impl: Callable, case: Case, backend: Backend) -> Outcome:
    base = _base_record(spec, impl_name, impl, case, backend)
    if not backend.compares_numerics:
        return _check_lowering(spec, impl, case, base)

    timings = {}
    start = time.perf_counter()
    # Inputs are NumPy, except where a convention makes the kernel's own function part
    # of them (the ring dropout mask): its trace and compile are kernel work.
    with compile_seconds(timings, "inputs_compile_s"):
        inputs = spec.inputs(case)
    timings["inputs_s"] = time.perf_counter() - start
    start = time.perf_counter()
    try:
        with backend.context(case.seed, spec.device_count(case)), compile_seconds(timings, "kernel_compile_s"):
            got = spec.run(impl, case, inputs)
    except Exception as exc:  # the kernel crashed: one error record, the test fails
        return Outcome([{**base, "direction": "all", "outcome": "error", "reason": _error_text(exc),
                         "traceback": traceback.format_exc(limit=8), "timings": timings}])
    timings["kernel_s"] = time.perf_counter() - start
    start = time.perf_counter()
    truth = spec.oracle(case, inputs)
    timings["oracle_s"] = time.perf_counter() - start
    start = time.perf_counter()
    with compile_seconds(timings, "baseline_compile_s"):
        reference = spec.baseline(case, inputs)
    timings["baseline_s"] = time.perf_counter() - start
    care = spec.care(case, inputs)
    dtypes = spec.output_dtypes(case)

    records = []
    for direction in truth:
        start = time.perf_counter()
        if direction not in got:
            records.append({**base, "direction": direction, "outcome": "error",
                            "reason": f"implementation returned no {direction!r}", "timings": timings})
            continue
        cmp = numerics.compare(got[direction], truth[direction], reference[direction],
                               dtype=dtypes[direction], direction=direction, care=care.get(direction))
        outcome, reason = ("pass" if cmp.passed else "fail"), cmp.reason
        delivered = np.asarray(got[direction]).dtype
        if delivered != np.dtype(dtypes[direction]):
            # A gradient in another dtype than its primal breaks the caller's optimizer
            # state and hides precision loss (or gain) from the comparison above.
            outcome, reason = "fail", (f"returned {direction} in {delivered}, expected {np.dtype(dtypes[direction])} "
                                       f"(the dtype of its input); {cmp.reason}")
        if cmp.passed and cmp.baseline_ulps > MAX_BASELINE_ULPS:
            outcome = "error"
            reason = (f"baseline is {cmp.baseline_ulps:.0f} ulps from the oracle (> {MAX_BASELINE_ULPS:g}): "
                      f"the spec's mapping or the baseline is wrong; refusing a tolerance built on it")
        per_direction = dict(timings, compare_s=time.perf_counter() - start)
        records.append({**base, "direction": direction, "dtype": str(np.dtype(dtypes[direction])),
                        "outcome": outcome, "reason": reason, "metrics": cmp.to_json(),
                        "budget": numerics._json_float(cmp.budget), "timings": per_direction})
    return Outcome(records)


def _check_lowering(spec: KernelSpec, impl: Callable, case: Case, base: dict) -> Outcome:
    records = []
    for direction, export in spec.lower(impl, case).items():
        start = time.perf_counter()
        try:
            export()
            outcome, reason = "pass", "lowered for platform tpu"
        except Exception as exc:
            outcome, reason = "fail", _error_text(exc)
        records.append({**base, "direction": direction, "outcome": outcome, "reason": reason,
                        "timings": {"lower_s": time.perf_counter() - start}})
    return Outcome(records)


def backend(name: str) -> Backend:
    return BACKENDS[name]
