"""Each static configuration traces its kernel once: the values of a case (inputs, seeds,
the value distribution) are traced data, so every case of a configuration reuses one
executable (``attncheck.compiled``), which the gate's speed rests on. chex's
``assert_max_traces`` holds the kernel to it on the gate's own path (``check.check_case``).

Kept out of the gate itself: chex counts the traces of a function by where it was wrapped
and its source, not by configuration, and a configuration is traced again on purpose
(jit's key holds the backend's interpret settings; programs are let go when the process
runs out of memory mappings), so a guard there would fail correct runs.
"""

from __future__ import annotations

import functools

import chex
import pytest

from attncheck import check, compiled, specs
from attncheck.backends import BACKENDS
from attncheck.specs.base import resolve_impl

FAMILY = "blockwise_ffn"
# Two cases of one static configuration: seeds and value distributions are data (the
# family's key leaves ``values`` out), several chunks, dropout from the traced seed.
STATIC = dict(dtype="float32", lead=(), seq_len=64, chunk_size=16, features=16, features_out=16, hidden=64,
              b_in=True, b_out=True, stochastic=True, remat=True, policy="none", prevent_cse=True)
CASES = ((1, "normal"), (2, "large"))


@pytest.fixture
def fresh(monkeypatch):
    """No compiled callable and no trace counted yet: the guarded kernel has the builtin's
    cache key, so a callable compiled earlier in this process would serve it untraced."""
    monkeypatch.setattr(compiled, "_COMPILED", {})
    chex.clear_trace_counter()
    yield
    chex.clear_trace_counter()


def _run(between=lambda: None):
    """The family's builtin kernel, guarded to trace at most once, run on each case as the
    gate runs it; the records of each case and the number of traces."""
    spec = specs.all_specs()[FAMILY]
    impl = resolve_impl(spec.default_impls["builtin"])
    traces = []

    @functools.wraps(impl)
    def kernel(*args, **kwargs):
        traces.append(1)
        return impl(*args, **kwargs)

    target = check.Target(spec, "builtin", chex.assert_max_traces(kernel, n=1), BACKENDS["xla"])
    outcomes = []
    for seed, values in CASES:
        outcomes.append(check.check_case(target, spec.case(seed, values=values, **STATIC)).records)
        between()
    return outcomes, len(traces)


@pytest.mark.usefixtures("fresh")
def test_the_cases_of_a_static_configuration_trace_the_kernel_once():
    outcomes, traces = _run()
    for records in outcomes:
        assert records and all(r.outcome == "pass" for r in records), [(r.direction, r.reason) for r in records]
    assert traces == 1  # traced, and only once: not a guard that never saw a trace


@pytest.mark.usefixtures("fresh")
def test_a_case_that_compiles_again_is_caught():
    """The guard fails a second trace: with the compiled callables let go after the first
    case, the second traces its kernel again, and chex's error is its record."""
    (first, second), traces = _run(between=compiled._COMPILED.clear)
    assert all(r.outcome == "pass" for r in first)
    assert [r.direction for r in second] == ["all"] and second[0].outcome == "error"
    assert "[Chex] Function 'blockwise_ffn' is traced > 1 times!" in second[0].reason, second[0].reason
    assert traces == 1  # chex stops the second trace before the kernel runs
