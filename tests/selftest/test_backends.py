"""Backends: selection without a TPU, hazard variants, and proof the hazard modes are live."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attncheck import backends


def test_default_selects_every_backend_and_unknown_names_are_rejected():
    from attncheck.selection import Options, SelectionError

    assert Options().backend_names == list(backends.BACKENDS)
    assert Options(backends="interpret, xla").backend_names == ["interpret", "xla"]
    with pytest.raises(SelectionError, match=r"--attncheck-backend 'interpret,tpuu': unknown backend\(s\) \['tpuu'\]"):
        Options(backends="interpret,tpuu").validate()
    with pytest.raises(SelectionError, match=r"--attncheck-kernel 'flash': unknown families \['flash'\]"):
        Options(kernels="flash").validate()
    with pytest.raises(SelectionError, match=r"--attncheck-impl 'flash_attention=nowhere:fn': .*cannot import"):
        Options(impls=("flash_attention=nowhere:fn",)).validate()
    with pytest.raises(SelectionError, match=r"ragged_paged_attention_v3 ships no implementation of its own; give one "
                                             r"with --attncheck-impl ragged_paged_attention_v3="):
        Options(kernels="ragged_paged_attention_v3").validate()
    Options(kernels="ragged_paged_attention_v3",
            impls=("ragged_paged_attention_v3=attncheck.specs.ragged_v3.invalid:invalid_v3_calls",)).validate()


def test_tpu_backend_follows_the_devices(monkeypatch):
    reason = backends.BACKENDS["tpu"].unavailable_reason()
    assert reason is not None and "cpu" in reason
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(platform="tpu")])
    assert backends.BACKENDS["tpu"].unavailable_reason() is None


def test_gate_tests_on_unavailable_backends_are_skipped_with_the_reason():
    from attncheck import selection

    tests = selection.gate_tests(selection.Options())
    tpu = [t for t in tests if t.backend_name == "tpu"]
    assert tpu and all(t.unavailable and "no TPU" in t.unavailable for t in tpu)
    assert any(t.unavailable is None for t in tests if t.backend_name == "interpret")
    # Asked for by name, an unavailable backend is an error of the run, not a skip.
    assert selection.unavailable_requests(selection.Options(backends="tpu")) == [
        f"backend tpu requested but unavailable: {tpu[0].unavailable}"]
    assert selection.unavailable_requests(selection.Options()) == []


def test_hazard_variants_rotate_through_every_mode():
    hazards = backends.BACKENDS["interpret-hazards"]
    seen = [hazards.settings(seed) for seed in range(len(backends.HAZARD_VARIANTS))]
    assert all(s["detect_races"] and s["uninitialized_memory"] == "nan" for s in seen)
    assert {s["num_cores_or_threads"] for s in seen} == {1, 2}
    assert {s["dma_execution_mode"] for s in seen} == {"on_wait", "eager"}
    assert any(s.get("random_seed") is not None for s in seen)
    assert backends.BACKENDS["xla"].settings(3) == {}


def test_a_case_that_needs_two_cores_gets_them_on_every_interpret_backend():
    """A megacore kernel (paged attention's megacore modes) hangs on one simulated core:
    the case's own requirement wins over the backend's choice, and the hazard variants
    keep rotating their grid orders and DMA modes."""
    hazards = backends.BACKENDS["interpret-hazards"]
    assert backends.BACKENDS["interpret"].settings(5, cores=2)["num_cores_or_threads"] == 2
    assert "num_cores_or_threads" not in backends.BACKENDS["interpret"].settings(5)
    seen = [hazards.settings(seed, cores=2) for seed in range(len(backends.HAZARD_VARIANTS))]
    assert all(s["num_cores_or_threads"] == 2 and s["detect_races"] for s in seen)
    assert {s["dma_execution_mode"] for s in seen} == {"on_wait", "eager"}
    assert {hazards.settings(seed)["num_cores_or_threads"] for seed in range(len(seen))} == {1, 2}
    assert backends.BACKENDS["xla"].settings(5, cores=2) == {}


def test_interpreter_state_is_reset_after_an_exception(monkeypatch):
    calls = []
    monkeypatch.setattr(pltpu, "reset_tpu_interpret_mode_state", lambda: calls.append(1))
    with pytest.raises(RuntimeError):
        with backends.BACKENDS["interpret"].context():
            raise RuntimeError("kernel crashed")
    assert calls == [1]


def _sum_over_parallel_axis(x):
    """A planted bug: every grid step accumulates into one output block, but the axis is
    declared "parallel", so two cores race on it."""

    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += x_ref[...]

    return pl.pallas_call(
        kernel, grid=(x.shape[0] // 8,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(x)


def test_hazard_backend_reports_a_planted_race():
    x = jnp.ones((32, 128), jnp.float32)
    hazards = backends.BACKENDS["interpret-hazards"]
    two_core_seed = next(s for s in range(8) if hazards.settings(s)["num_cores_or_threads"] == 2)
    with pytest.raises(Exception, match="(?i)race"):
        with hazards.context(two_core_seed):
            jax.block_until_ready(jax.jit(_sum_over_parallel_axis)(x))
    # The plain interpret backend runs the same kernel serially and sees no problem: only
    # the hazard mode can tell.
    with backends.BACKENDS["interpret"].context():
        assert np.all(np.asarray(jax.jit(_sum_over_parallel_axis)(x)) == 4)


def _reads_scratch_before_writing(x):
    def kernel(x_ref, o_ref, scratch_ref):
        o_ref[...] = x_ref[...] + scratch_ref[...]  # the bug: scratch never initialised

    return pl.pallas_call(
        kernel, grid=(1,), in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)])(x)


def test_interpret_backend_poisons_uninitialised_scratch():
    with backends.BACKENDS["interpret"].context():
        out = np.asarray(jax.jit(_reads_scratch_before_writing)(jnp.ones((8, 128), jnp.float32)))
    assert np.isnan(out).all()


def test_hazard_checks_refuse_more_devices_than_their_limit_by_name():
    hazards = backends.BACKENDS["interpret-hazards"]
    limit = backends.MAX_HAZARD_DEVICES
    assert hazards.runs_devices(limit) and not hazards.runs_devices(limit + 1)
    assert hazards.settings(0, devices=limit)["detect_races"]
    with pytest.raises(ValueError, match=rf"interpret-hazards runs cases on at most {limit} devices; "
                                         rf"this case needs {2 * limit}"):
        hazards.settings(0, devices=2 * limit)
    assert backends.BACKENDS["interpret"].runs_devices(8)


def test_hazard_checks_leave_rows_of_a_long_reduction_to_the_plain_interpreter():
    """The race detector's cost grows with every kv block: the ragged family's rows of thousands
    of keys in 1-page blocks run on the plain interpret backend only, where their class
    still counts."""
    from attncheck import coverage
    from attncheck.specs import all_specs

    spec = all_specs()["ragged_paged_attention"]
    long_class = next(c for c in spec.bug_classes if c.name == "long_reduction_offset_values")
    examples = coverage.examples(spec)
    long = [c for c in examples if long_class.applies(c.params)]
    assert long, "the ragged family has no coverage example of a long reduction"
    hazards, plain = backends.BACKENDS["interpret-hazards"], backends.BACKENDS["interpret"]
    assert all(not hazards.runs(c.params) and plain.runs(c.params) for c in long)
    assert any(hazards.runs(c.params) for c in examples)
    assert all(hazards.runs(c.params) == (c.params.sequence_length <= backends.MAX_HAZARD_SEQUENCE)
               for c in examples)


def test_each_default_implementation_runs_on_its_own_backends_and_a_user_one_on_all(monkeypatch):
    """A convention with a pure-JAX and a Pallas implementation (jax.nn's and a kernel's):
    each default implementation gets its own backends, its coverage on the first of them."""
    from attncheck import selection, specs
    from tests.selftest import toy_spec

    class TwoKinds(toy_spec.ToySpec):
        backends = ("xla", "interpret")
        default_impls = {"jnp": "tests.selftest.toy_spec:toy_attention",
                         "kernel": "tests.selftest.toy_spec:toy_attention_lse"}
        impl_backends = {"jnp": ("xla",), "kernel": ("interpret",)}

    spec = TwoKinds()
    monkeypatch.setattr(specs, "all_specs", lambda: {spec.name: spec})
    run = {(t.impl_name, t.backend_name, t.part) for t in selection.gate_tests(selection.Options())}
    assert run == {("jnp", "xla", "coverage"), ("jnp", "xla", "drawn"),
                   ("kernel", "interpret", "coverage"), ("kernel", "interpret", "drawn")}
    user = selection.Options(impls=("toy_attention=tests.selftest.toy_spec:toy_attention",))
    assert {(t.impl_name, t.backend_name, t.part) for t in selection.gate_tests(user)} == {
        ("user", "xla", "coverage"), ("user", "xla", "drawn"), ("user", "interpret", "drawn")}
    with pytest.raises(TypeError, match="impl_backends"):
        type("Stray", (TwoKinds,), {"impl_backends": {"jnp": ("tpu",)}})()


def _doubled(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def test_an_interpreted_block_counts_the_kernels_that_ran_in_it_not_what_was_traced():
    x = jnp.ones((8, 128), jnp.float32)
    kernel, fallback = jax.jit(_doubled), jax.jit(lambda x: x * 2)
    for _ in range(2):  # the second time from jit's cache: nothing is traced, the kernel still runs
        with backends.BACKENDS["interpret"].context() as interpreted:
            jax.block_until_ready(kernel(x))
        assert interpreted.kernel_ran
    with backends.BACKENDS["interpret-hazards"].context(0) as interpreted:
        jax.block_until_ready(fallback(x))
    assert not interpreted.kernel_ran and interpreted.count == 0
    with backends.BACKENDS["xla"].context() as interpreted:
        assert interpreted is None  # a native backend runs what it is given: nothing to count


def test_a_backend_is_credited_only_with_a_pallas_kernel_that_ran_on_it():
    """A pure-JAX implementation (as one that falls back to XLA off a TPU) checked on the
    interpret backend verifies nothing of it: one error record, whatever its numbers."""
    from attncheck import check
    from tests.selftest import toy_spec

    case = toy_spec.SPEC.case(3, dtype="float32", batch=1, heads=1, seq_len=8, head_dim=4, causal=False,
                              sm_scale=toy_spec.SM_SCALE)
    record, = check.check_case(check.Target(toy_spec.SPEC, "user", toy_spec.toy_attention,
                                            backends.BACKENDS["interpret"]), case).records
    assert (record.direction, record.outcome, record.expected) == ("all", "error", None)
    assert record.reason.startswith("no Pallas kernel ran on interpret: the implementation made no call into the "
                                    "Pallas interpreter")
    assert {r.outcome for r in check.check_case(check.Target(toy_spec.SPEC, "user", toy_spec.toy_attention,
                                                             backends.BACKENDS["xla"]), case).records} == {"pass"}
