"""Each static configuration traces its kernel once: the values of a case (inputs, seeds,
the value distribution) are traced data, so every case of a configuration reuses one
executable (``attncheck.compiled``), which the gate's speed rests on. chex's
``assert_max_traces`` holds the kernel to it on the gate's own path (``check.check_case``),
for literal cases and for a drawn case's variants (``KernelSpec.variants``: the gate's
drawn part runs several cases of each program it draws).

Kept out of the gate itself: chex counts the traces of a function by where it was wrapped
and its source, not by configuration, and a configuration is traced again on purpose
(jit's key holds the backend's interpret settings; programs are let go when the process
runs out of memory mappings), so a guard there would fail correct runs.
"""

from __future__ import annotations

import functools

import chex
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

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
    cache key, so a callable compiled earlier in this process would serve it untraced. Nor
    are the programs let go for the process's memory mappings (a worker late in a run holds
    many): that traces again on purpose, and is tested in test_reliability."""
    monkeypatch.setattr(compiled, "_COMPILED", {})
    monkeypatch.setattr(check, "release_when_mappings_run_out", lambda: False)
    chex.clear_trace_counter()
    yield
    chex.clear_trace_counter()


def _run(between=lambda: None, family=FAMILY, cases=None):
    """The family's first default kernel, guarded to trace at most once, run on each case
    (default: ``CASES`` of ``STATIC``) as the gate runs it on its first backend; the
    records of each case and the number of traces."""
    spec = specs.all_specs()[family]
    name, ref = next(iter(spec.default_impls.items()))
    impl = resolve_impl(ref)
    traces = []

    # Named as the kernel (the cache key and helper types go by it), not marked as wrapping
    # it: chex refuses to guard what looks like a jitted function (paged attention is one).
    @functools.wraps(impl, updated=())
    def kernel(*args, **kwargs):
        traces.append(1)
        return impl(*args, **kwargs)

    del kernel.__wrapped__

    target = check.Target(spec, name, chex.assert_max_traces(kernel, n=1), BACKENDS[spec.backends_for(name)[0]])
    outcomes = []
    for case in cases or [spec.case(seed, values=values, **STATIC) for seed, values in CASES]:
        outcomes.append(check.check_case(target, case).records)
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


@pytest.mark.parametrize("family", sorted(specs.all_specs()))
def test_a_variant_is_a_case_of_its_program(family):
    spec = specs.all_specs()[family]
    redrawn = []

    @settings(settings.get_profile("ci"), max_examples=30)
    @given(data=st.data())
    def check_variant(data):
        case = data.draw(spec.cases(), label="case")
        variants = data.draw(spec.variants(case, 3), label="variants")
        assert len({c.id for c in (case, *variants)}) == 1 + len(variants)  # none is a case again
        for variant in variants:
            assert type(variant.params) is type(case.params) and variant.family == case.family
            assert spec.program(variant.params) == spec.program(case.params), (case, variant)
            redrawn.append(variant.params != case.params)

    check_variant()
    # A family whose params hold data redraws it, not only the seed.
    assert any(redrawn) or type(spec).other_data is specs.KernelSpec.other_data, f"{family}: no variant drew other data"


@pytest.mark.usefixtures("fresh")
@pytest.mark.parametrize("family", ["flash_attention", "paged_attention", "blockwise_ffn"])
def test_a_drawn_case_s_variant_traces_its_kernel_no_more(family):
    """The smallest case of the family and a variant of it with other data (not only
    another seed), run as the gate's drawn part runs them."""
    spec = specs.all_specs()[family]
    ci = settings(settings.get_profile("ci"), database=None)
    case = find(spec.cases(), lambda c: True, settings=ci)
    (variant,) = find(spec.variants(case, 1), lambda v: v[0].params != case.params, settings=ci)
    outcomes, traces = _run(family=family, cases=[case, variant])
    for records in outcomes:
        assert records and all(r.outcome == "pass" for r in records), [(r.direction, r.reason) for r in records]
    assert traces == 1
