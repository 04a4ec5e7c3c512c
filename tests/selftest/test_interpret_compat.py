"""interpret_compat: the emulated TPU generation, ref views in the TPU interpreter, the
masked-store workaround, and the one-line naming of interpreter limitations."""

from __future__ import annotations

import contextlib
import sys

import jax
import jax.experimental
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

from attncheck import backends, check, env
from attncheck import interpret_compat as ic

INTERPRET = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")


# ----------------------------------------------------------------- TPU generation

RPA_KEY = (jnp.float32, jnp.float32, 2, 1, 128, 16, 64, 8)  # dtypes, heads, head_dim, page, tokens, pages


def test_outside_a_tpu_jaxs_rpa_cannot_pick_its_default_block_sizes():
    assert tuned_block_sizes.get_tpu_version() == -1
    with pytest.raises(NotImplementedError, match="TPU version must be 4 or higher"):
        tuned_block_sizes.get_tuned_block_sizes(*RPA_KEY)


def test_emulated_tpu_answers_the_generation_and_is_undone_on_exit():
    with ic.emulated_tpu("TPU v5 lite"):
        # jax's own lookup code runs unchanged and sees the emulated chip.
        assert tuned_block_sizes.get_tpu_version() == 5
        assert tuned_block_sizes.get_device_name() == "TPU v5"
        # Untuned generation >= 5: (128, 32) capped by pages per sequence and tokens.
        assert tuned_block_sizes.get_tuned_block_sizes(*RPA_KEY) == (8, 32)
        # Nothing else sees it: jax.devices() itself still names the CPU.
        assert "TPU" not in jax.devices()[0].device_kind
    with ic.emulated_tpu("TPU v4"):
        assert tuned_block_sizes.get_tuned_block_sizes(*RPA_KEY) == (8, 32)  # v4: (32, 32) capped
        assert tuned_block_sizes.get_tpu_version() == 4
    assert tuned_block_sizes.jax is jax
    assert tuned_block_sizes.get_tpu_version() == -1


def test_a_copy_of_jaxs_block_size_tables_sees_the_emulated_tpu_too(monkeypatch):
    """A team's fork of ragged paged attention carries its own tuned_block_sizes module; its
    default block sizes must work in interpret mode as jax's do."""
    import types

    copy = types.ModuleType("forked_rpa.tuned_block_sizes")
    copy.jax = jax
    copy.get_tpu_version = lambda: int(copy.jax.devices()[0].device_kind.split("v")[-1].split()[0])
    monkeypatch.setitem(sys.modules, copy.__name__, copy)
    with ic.emulated_tpu("TPU v6 lite"):
        assert copy.get_tpu_version() == 6
    assert copy.jax is jax


def test_emulated_tpu_is_undone_when_the_block_raises_and_nests():
    with pytest.raises(RuntimeError), ic.emulated_tpu("TPU v5 lite"):
        with ic.emulated_tpu("TPU v6 lite"):
            assert tuned_block_sizes.get_tpu_version() == 6
        assert tuned_block_sizes.get_tpu_version() == 5
        raise RuntimeError("kernel crashed")
    assert tuned_block_sizes.jax is jax


def test_emulated_tpu_rejects_a_kind_that_is_not_a_tpu():
    with pytest.raises(ValueError, match="device_kind must name a TPU"), ic.emulated_tpu("cpu"):
        pass
    with ic.emulated_tpu(None):  # native backends: no change
        assert tuned_block_sizes.jax is jax


def test_backends_state_the_generation_they_emulate_and_enter_it():
    kinds = {name: b.tpu_device_kind for name, b in backends.BACKENDS.items()}
    assert kinds == {"interpret": "TPU v5 lite", "interpret-hazards": "TPU v5 lite", "tpu-lower": "TPU v5 lite",
                     "tpu": None, "xla": None}
    interpret = backends.BACKENDS["interpret"]
    platform = env.current_platform().describe()
    assert interpret.recorded_settings(0) == {**interpret.settings(0), "emulated_tpu": "TPU v5 lite",
                                              "platform": platform}
    assert backends.BACKENDS["xla"].recorded_settings(0) == {"platform": platform}
    with interpret.context():
        assert tuned_block_sizes.get_tpu_version() == 5
    assert tuned_block_sizes.get_tpu_version() == -1
    with backends.BACKENDS["xla"].context():
        assert tuned_block_sizes.get_tpu_version() == -1


def test_the_pytest_header_names_the_emulated_generation():
    import types

    from attncheck.session import GateSession

    run = types.SimpleNamespace(report_dir="rep", why="--attncheck", platform=env.current_platform())
    header = GateSession.pytest_report_header(run, None)
    assert "  interpret: available (emulates TPU v5 lite)" in header
    assert "  tpu-lower: available (emulates TPU v5 lite)" in header
    assert "  xla: available" in header


def test_tpu_lower_exports_jaxs_rpa_with_default_block_sizes():
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    args = (np.zeros((16, 2, 128), np.float32), np.zeros((8, 16, 2, 128), np.float32), np.zeros(2, np.int32),
            np.zeros((2, 4), np.int32), np.zeros(3, np.int32), np.ones(1, np.int32))
    exported = backends.export_for_tpu(ragged_paged_attention, *args)
    assert exported.platforms == ("tpu",)
    assert tuned_block_sizes.jax is jax


# ----------------------------------------------------------------- ref views


def run_interpret(kernel, out_shape, *args, views=True):
    context = ic.ref_views() if views else contextlib.nullcontext()
    with context, pltpu.force_tpu_interpret_mode(INTERPRET):
        try:
            return np.asarray(pl.pallas_call(kernel, out_shape=out_shape)(*args))
        except BaseException:
            pltpu.reset_tpu_interpret_mode_state()
            raise


X = np.arange(2 * 8 * 128, dtype=np.float32).reshape(2, 8, 128)
OUT = jax.ShapeDtypeStruct((8, 128), jnp.float32)


def odd_rows_via_reshape(x_ref, o_ref):
    o_ref[...] = x_ref.reshape(16, 128)[1::2, :] * 2.0


def odd_rows_via_indexing(x_ref, o_ref):
    # The same rows without a ref reshape: row 2i+1 of (16, 128) is x[(2i+1) // 8, (2i+1) % 8].
    o_ref[0:4, :] = x_ref[0, 1::2, :] * 2.0
    o_ref[4:8, :] = x_ref[1, 1::2, :] * 2.0


def test_the_interpreter_alone_rejects_a_ref_reshape():
    with pytest.raises(Exception, match="'ReshapeTransform' object has no attribute 'indices'") as info:
        run_interpret(odd_rows_via_reshape, OUT, X, views=False)
    assert ic.interpreter_limitation(info.value) == (
        "unsupported by interpret mode: ref reshape (ReshapeTransform) where the interpreter takes only "
        "indexers (a semaphore)")


def test_a_reshaped_read_matches_numpy_and_the_kernel_without_reshape():
    got = run_interpret(odd_rows_via_reshape, OUT, X)
    np.testing.assert_array_equal(got, X.reshape(16, 128)[1::2] * 2.0)
    np.testing.assert_array_equal(got, run_interpret(odd_rows_via_indexing, OUT, X))


@pytest.mark.parametrize("backend", ["interpret", "interpret-hazards"])
def test_the_interpret_backends_run_a_reshaped_ref(backend):
    with backends.BACKENDS[backend].context(seed=1):
        got = np.asarray(pl.pallas_call(odd_rows_via_reshape, out_shape=OUT)(X))
    np.testing.assert_array_equal(got, X.reshape(16, 128)[1::2] * 2.0)


def test_a_read_whose_elements_are_no_box_reads_the_whole_view():
    def kernel(x_ref, o_ref):  # rows 3..10 of the flattened view cross the first axis
        o_ref[...] = x_ref.reshape(16, 128)[3:11, :]

    np.testing.assert_array_equal(run_interpret(kernel, OUT, X), X.reshape(16, 128)[3:11])


def test_a_transposed_read_after_a_reshape():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref.reshape(8, 256).T[0:128:16, :]

    got = run_interpret(kernel, jax.ShapeDtypeStruct((8, 8), jnp.float32), X)
    np.testing.assert_array_equal(got, X.reshape(8, 256).T[0:128:16])


def test_a_bitcast_read_packs_rows_as_jax_defines_it():
    """RPA's strided K/V load: bf16 rows bitcast to uint32 pairs, then a strided row read."""
    kv = (np.arange(16 * 128) % 251).astype(ml_dtypes.bfloat16).reshape(2, 8, 128)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref.reshape(16, 128).bitcast(jnp.uint32)[1::2, :]

    got = run_interpret(kernel, jax.ShapeDtypeStruct((4, 128), jnp.uint32), kv)
    from jax._src.state import utils as state_utils

    want = np.asarray(state_utils.bitcast(jnp.asarray(kv.reshape(16, 128)), jnp.uint32))[1::2]
    np.testing.assert_array_equal(got, want)
    # Row 2a in the low half of word a: K (even row) = word << 16.
    low = (got << 16).view(np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(low, kv.reshape(16, 128)[2::4])


BITCASTS = pytest.mark.parametrize("src, dst, shape", [
    (ml_dtypes.bfloat16, np.uint32, (2, 8, 128)), (np.uint32, ml_dtypes.bfloat16, (4, 128)),
    (np.int8, np.uint32, (8, 128)), (np.uint32, np.int8, (2, 128)), (ml_dtypes.float8_e4m3fn, np.int8, (4, 128)),
    (np.float32, np.int32, (8, 128))])


def _bitcast(x, dtype) -> np.ndarray:
    from jax._src.state import utils as state_utils

    return np.array(state_utils.bitcast(jnp.asarray(x), dtype))


def _bits_of(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


@BITCASTS
def test_a_read_through_a_bitcast_ref_equals_jaxs_bitcast(src, dst, shape):
    x = np.random.default_rng(0).integers(0, 120, size=shape).astype(src)
    want = _bitcast(x, dst)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref.bitcast(dst)[...]

    got = run_interpret(kernel, jax.ShapeDtypeStruct(want.shape, dst), x)
    np.testing.assert_array_equal(_bits_of(got), _bits_of(want))


@BITCASTS
def test_a_store_through_a_bitcast_ref_writes_jaxs_bitcast(src, dst, shape):
    """RPA v3 stores its output block through ``bo_ref.bitcast(jnp.int32)``: the bytes
    written are those of jax's bitcast of the stored value."""
    x = np.random.default_rng(1).integers(0, 120, size=shape).astype(src)
    want = _bitcast(x, dst)

    def kernel(x_ref, o_ref):
        o_ref.bitcast(src)[...] = x_ref[...]

    got = run_interpret(kernel, jax.ShapeDtypeStruct(want.shape, dst), x)
    np.testing.assert_array_equal(_bits_of(got), _bits_of(want))


def test_a_masked_store_through_a_bitcast_ref_writes_only_the_masked_words():
    x = (np.arange(8 * 128) % 97).astype(ml_dtypes.bfloat16).reshape(8, 128)

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.uint32)
        rows = jax.lax.broadcasted_iota(jnp.int32, (4, 128), 0)
        pltpu.store(o_ref.bitcast(ml_dtypes.bfloat16).bitcast(jnp.uint32), x_ref.bitcast(jnp.uint32)[...],
                    mask=rows % 2 == 1)

    got = run_interpret(kernel, jax.ShapeDtypeStruct((4, 128), jnp.uint32), x)
    want = _bitcast(x, np.uint32)
    want[0::2] = 0
    np.testing.assert_array_equal(got, want)


def _copy_a_page_through_reshaped_refs(x_hbm, o_hbm, buf, sem):
    """RPA v3's kv-cache DMAs: HBM (pages, page, ...) reshaped to (pages * page, ...), one
    page's tokens copied to VMEM and back to another page."""
    tokens = x_hbm.shape[0] * x_hbm.shape[1]
    src = x_hbm.reshape(tokens, *x_hbm.shape[2:]).at[pl.ds(0, 16)]
    dst = o_hbm.reshape(tokens, *o_hbm.shape[2:]).at[pl.ds(16, 16)]
    for copy in (pltpu.make_async_copy(src, buf, sem), pltpu.make_async_copy(buf, dst, sem)):
        copy.start()
        copy.wait()


def _paged_copy(x):
    return pl.pallas_call(_copy_a_page_through_reshaped_refs, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
                          out_specs=pl.BlockSpec(memory_space=pltpu.HBM),
                          scratch_shapes=[pltpu.VMEM((16,) + x.shape[2:], x.dtype), pltpu.SemaphoreType.DMA(())],
                          input_output_aliases={0: 0})(x)


PAGES = np.arange(8 * 16 * 2 * 128, dtype=np.float32).reshape(8, 16, 2, 128)


@pytest.mark.parametrize("backend", ["interpret", "interpret-hazards"])
def test_a_dma_from_and_to_reshaped_refs_copies_exactly_its_elements(backend):
    with backends.BACKENDS[backend].context(seed=0):
        got = np.asarray(_paged_copy(PAGES))
    want = PAGES.copy()
    want[1] = PAGES[0]
    np.testing.assert_array_equal(got, want)


def test_tpu_lower_exports_a_kernel_that_reshapes_its_refs():
    """Under an Explicit mesh axis jax checks each reshaped ref's sharding against its rank
    ("Length of sharding.spec (4) must be equal to aval's ndim (3)"); the abstract mesh of
    tpu-lower has an Auto axis."""
    exported = backends.export_for_tpu(_paged_copy, PAGES)
    assert "tpu_custom_call" in exported.mlir_module()
    explicit = jax.sharding.AbstractMesh((1,), ("export",), (jax.sharding.AxisType.Explicit,),
                                         abstract_device=backends.tpu_mesh().abstract_device)
    with pytest.raises(Exception, match="sharding.spec"):
        backends.export_for_tpu(_paged_copy, PAGES, mesh=explicit)


def test_emulated_tpu_answers_pltpu_get_tpu_info_and_is_undone_on_exit():
    """RPA v3 asks ``pltpu.get_tpu_info()`` for its default VMEM limit."""
    with pytest.raises(ValueError, match="Unsupported TPU device kind: cpu"):
        pltpu.get_tpu_info()
    with ic.emulated_tpu("TPU v5 lite"):
        info = pltpu.get_tpu_info()
        assert (info.generation, info.num_cores, info.vmem_capacity_bytes) == (5, 1, 128 * 1024 * 1024)
        with jax.sharding.use_abstract_mesh(backends.tpu_mesh(device_kind="TPU v6 lite")):
            assert pltpu.get_tpu_info().generation == 6  # an abstract mesh still answers first
    with pytest.raises(ValueError, match="Unsupported TPU device kind: cpu"):
        pltpu.get_tpu_info()


def test_a_store_through_a_reshaped_ref_writes_exactly_its_elements():
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.full(o_ref.shape, -1.0, jnp.float32)
        o_ref.reshape(16, 128)[1::2, :] = x_ref[...]

    x = np.arange(8 * 128, dtype=np.float32).reshape(8, 128)
    got = run_interpret(kernel, jax.ShapeDtypeStruct((2, 8, 128), jnp.float32), x)
    want = np.full((16, 128), -1.0, np.float32)
    want[1::2] = x
    np.testing.assert_array_equal(got, want.reshape(2, 8, 128))


def test_a_store_that_is_no_box_is_named_as_unsupported():
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
        o_ref.reshape(16, 128)[3:11, :] = x_ref[...]

    with pytest.raises(Exception) as info:
        run_interpret(kernel, jax.ShapeDtypeStruct((2, 8, 128), jnp.float32), np.ones((8, 128), np.float32))
    assert ic.interpreter_limitation(info.value) == (
        "unsupported by interpret mode: store through a ref view that is not one strided box of whole elements")


def test_an_out_of_bounds_index_after_a_reshape_raises():
    def kernel(s_ref, x_ref, o_ref):
        o_ref[...] = x_ref.reshape(16, 128)[pl.ds(s_ref[0], 8), :]

    context = ic.ref_views()
    with context, pltpu.force_tpu_interpret_mode(INTERPRET):
        call = pl.pallas_call(kernel, out_shape=OUT,
                              in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM)])
        np.testing.assert_array_equal(np.asarray(call(np.array([8], np.int32), X)), X[1])
        with pytest.raises(Exception, match="Out-of-bounds access through a ref view"):
            call(np.array([12], np.int32), X)
        pltpu.reset_tpu_interpret_mode_state()


def test_ref_views_restores_the_interpreter_on_exit_even_after_an_error():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    get, swap = ipc.get, ipc.swap
    with ic.ref_views():
        with ic.ref_views():
            assert ipc.get is not get and ipc.swap is not swap
        assert ipc.get is not get  # the outer block still holds it
    assert (ipc.get, ipc.swap) == (get, swap)
    with pytest.raises(RuntimeError), ic.ref_views():
        raise RuntimeError("kernel crashed")
    assert (ipc.get, ipc.swap) == (get, swap)


# ----------------------------------------------------------------- host callbacks


def test_the_interpreters_callbacks_skip_device_put_and_compute_the_same(monkeypatch):
    from jax._src import api

    puts = []
    device_put = api.device_put

    def counted(*args, **kwargs):
        puts.append(sys._getframe(1).f_code.co_name)
        return device_put(*args, **kwargs)

    # jax's io_callback_impl moves every operand onto a device with this.
    monkeypatch.setattr(api, "device_put", counted)
    plain = run_interpret(odd_rows_via_indexing, OUT, X, views=False)
    assert "io_callback_impl" in puts
    puts.clear()
    with ic.host_callbacks():
        fast = run_interpret(odd_rows_via_indexing, OUT, X, views=False)
    assert "io_callback_impl" not in puts
    np.testing.assert_array_equal(fast, plain)
    np.testing.assert_array_equal(fast, X.reshape(16, 128)[1::2] * 2.0)


def test_any_other_io_callback_runs_as_jax_runs_it_and_the_block_restores_jax():
    from jax._src import callback as jax_callback

    seen = []

    def host(x):
        seen.append(type(x))
        return np.asarray(x) + 1

    f = jax.jit(lambda x: jax.experimental.io_callback(host, jax.ShapeDtypeStruct((3,), jnp.float32), x))
    original = jax_callback.io_callback_impl
    with ic.host_callbacks():
        with ic.host_callbacks():
            assert jax_callback.io_callback_impl is not original
        np.testing.assert_array_equal(f(np.zeros(3, np.float32)), np.ones(3))
        assert jax_callback.io_callback_impl is not original  # the outer block still holds it
    assert seen and all(issubclass(t, jax.Array) for t in seen)
    assert jax_callback.io_callback_impl is original
    with pytest.raises(RuntimeError), ic.host_callbacks():
        raise RuntimeError("kernel crashed")
    assert jax_callback.io_callback_impl is original


# ----------------------------------------------------------------- masked stores


def masked_store_to_a_narrow_column(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    rows = jax.lax.broadcasted_iota(jnp.int32, (8, 1, 128), 0)
    pltpu.store(o_ref.at[:, 1:2, :], x_ref[...], mask=rows >= 2)


COLUMN_X = np.arange(8 * 128, dtype=np.float32).reshape(8, 1, 128) + 1
COLUMN_OUT = jax.ShapeDtypeStruct((8, 2, 128), jnp.float32)


def test_the_interpreter_alone_calls_an_in_bounds_masked_store_out_of_bounds():
    """jax 0.12.0.1 shared_memory.py:751-753 (in_bounds_mask[in_bounds_shape[i]:] on axis 0
    for every i). If this starts passing, jax fixed it and the workaround can go."""
    with pytest.raises(Exception, match="Out-of-bounds masked swap"):
        run_interpret(masked_store_to_a_narrow_column, COLUMN_OUT, COLUMN_X, views=False)


def test_a_masked_store_to_a_narrow_range_writes_the_masked_rows():
    got = run_interpret(masked_store_to_a_narrow_column, COLUMN_OUT, COLUMN_X)
    want = np.zeros((8, 2, 128), np.float32)
    want[2:, 1:2] = COLUMN_X[2:]
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------- limitations


class JaxRuntimeError(Exception):
    pass


CALLBACK = "INTERNAL: CpuCallback error calling callback: Traceback (most recent call last):\n  File \"x.py\"\n"


@pytest.mark.parametrize("exc, expected", [
    (JaxRuntimeError(CALLBACK + "AttributeError: 'BitcastTransform' object has no attribute 'indices'"),
     "ref bitcast (BitcastTransform) where the interpreter takes only indexers (a semaphore)"),
    (NotImplementedError("TPU version must be 4 or higher."), "TPU generation query outside a TPU"),
    (ValueError("Unsupported TPU device kind: cpu. If you are not running"), "TPU generation query outside a TPU"),
    (JaxRuntimeError(CALLBACK + "NotImplementedError: masked load_p"), "masked load (load_p with mask)"),
    (NotImplementedError("run_scoped_p with collective axes is not supported"), "run_scoped with collective axes"),
    (NotImplementedError("Non-decrementing wait is not supported."), "non-decrementing semaphore wait"),
    (NotImplementedError("Unsupported memory space: MemorySpace.X"), "a memory space the interpreter does not model"),
    (JaxRuntimeError(CALLBACK + "NotImplementedError: store through a reshaped or bitcast ref that writes part of "
                                "an element of the ref, or one element twice"),
     "store through a ref view that is not one strided box of whole elements"),
])
def test_known_limitations_are_named_in_one_line(exc, expected):
    assert ic.interpreter_limitation(exc) == ic.UNSUPPORTED_PREFIX + expected


def test_a_kernel_error_is_not_a_limitation_and_keeps_its_own_line():
    # The callback's own traceback may hold earlier exceptions; the error is the last one.
    bug = JaxRuntimeError(CALLBACK + "KeyError: 3\n\nDuring handling of the above exception, another exception "
                          "occurred:\n\nTraceback (most recent call last):\n  File \"y.py\"\n"
                          "IndexError: Out-of-bounds read of (0 0 hbm 101): reading [(45,)] but buffer has shape "
                          "(40,).")
    assert ic.interpreter_limitation(bug) is None
    assert ic.interpreter_limitation(ValueError("num_seqs must be <= 4")) is None
    assert ic.callback_error_line(bug) == ("IndexError: Out-of-bounds read of (0 0 hbm 101): reading [(45,)] but "
                                           "buffer has shape (40,). (raised in an interpret-mode callback)")
    assert ic.callback_error_line(ValueError("plain")) is None
    # The cause chain is searched: a limitation re-raised as another error is still one.
    try:
        try:
            raise AttributeError("'ReshapeTransform' object has no attribute 'indices'")
        except AttributeError as inner:
            raise RuntimeError("kernel failed") from inner
    except RuntimeError as outer:
        assert ic.interpreter_limitation(outer).endswith("ref reshape (ReshapeTransform) where the interpreter "
                                                         "takes only indexers (a semaphore)")


def report_record(case, backend, reason, outcome="error"):
    from tests.selftest.test_report import record

    return record(case, backend=backend, direction="all", outcome=outcome, budget=None, reason=reason)


def test_limitation_lines_give_one_line_per_backend_and_kernel():
    reason = ic.UNSUPPORTED_PREFIX + "masked load (load_p with mask)"
    records = [report_record("c1", "interpret", reason), report_record("c2", "interpret", reason),
               report_record("c2", "interpret", reason), report_record("c1", "interpret-hazards", reason),
               report_record("c3", "interpret", "ValueError: boom"),
               report_record("c4", "interpret", reason, outcome="fail")]
    assert ic.limitation_lines(records) == [
        "interpret: toy_attention/builtin: 2 case(s) not run, " + reason,
        "interpret-hazards: toy_attention/builtin: 1 case(s) not run, " + reason]


RAGGED_CASE = dict(dtype="float32", kv_dtype="float32", page_size=16, num_q_heads=2, num_kv_heads=2,
                   seqs=((3, 20),), sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, sm_scale=1.0,
                   num_kv_pages_per_block=None, num_queries_per_block=None, padding="repeat_last", values="normal")


def check_raising(exc: BaseException, backend: str) -> check.Outcome:
    """The check of a ragged case whose implementation raises ``exc`` on ``backend``."""
    from attncheck.specs.ragged.spec import SPEC

    def raising(*args, **kwargs):
        raise exc

    target = check.Target(SPEC, "user", raising, backends.BACKENDS[backend])
    outcome = check.check_case(target, SPEC.case(1, **RAGGED_CASE))
    assert [(r.outcome, r.direction) for r in outcome.records] == [("error", "all")]
    return outcome


def test_the_check_records_a_limitation_and_a_callback_error_as_one_line():
    reshape = JaxRuntimeError(CALLBACK + "AttributeError: 'ReshapeTransform' object has no attribute 'indices'")
    record, = check_raising(reshape, "interpret").records
    assert record.reason == ic.UNSUPPORTED_PREFIX + (
        "ref reshape (ReshapeTransform) where the interpreter takes only indexers (a semaphore)")
    assert "CpuCallback" in record.traceback  # the trace is kept, out of the reason
    assert record.backend_settings["emulated_tpu"] == "TPU v5 lite"
    out_of_bounds = JaxRuntimeError(CALLBACK + "IndexError: Out-of-bounds read of (0 0 hbm 101)")
    assert check_raising(out_of_bounds, "interpret").records[0].reason == (
        "IndexError: Out-of-bounds read of (0 0 hbm 101) (raised in an interpret-mode callback)")
    # Off the interpreter the same text is no limitation of it: the error itself is kept.
    assert check_raising(reshape, "xla").records[0].reason.startswith("JaxRuntimeError: INTERNAL: CpuCallback")


def test_a_timeout_raised_in_a_callback_keeps_its_text_and_stops_the_test():
    timeout = "Failed: Timeout (>5.0s) from pytest-timeout"
    outcome = check_raising(JaxRuntimeError(CALLBACK + "KeyError: 3\n" + "x" * 4000 + "\n" + timeout), "interpret")
    assert outcome.fatal == "Timeout (>5.0s) from pytest-timeout"
    assert outcome.records[0].reason.endswith(timeout) and " characters] ... " in outcome.records[0].reason


def test_the_report_names_each_limitation_once_per_backend_and_stays_a_fail():
    from attncheck.report import render
    from tests.selftest.test_report import record, report_of

    reason = ic.UNSUPPORTED_PREFIX + "masked load (load_p with mask)"
    records = [report_record("c0", "interpret", reason), report_record("c1", "interpret", reason),
               report_record("c0", "interpret-hazards", reason), record("c2", backend="interpret")]
    report = report_of(records)
    lines = [f"interpret: toy_attention/builtin: 2 case(s) not run, {reason}",
             f"interpret-hazards: toy_attention/builtin: 1 case(s) not run, {reason}"]
    assert report.limitations == lines
    assert report.verdict == "FAIL" and report.problems == []  # the error records fail it, not the lines
    assert report.to_json()["limitations"] == lines
    markdown = render.render_markdown(report)
    heading = "## Not run: unsupported by interpret mode or by the implementation"
    assert f"{heading}\n\n- {lines[0]}\n- {lines[1]}\n" in markdown
    assert f"<li>{lines[1]}</li>" in render.render_html(report)
    assert report_of([record("c2", backend="interpret")]).limitations == []


# ----------------------------------------------------------------- vmapped grids

def _doubled_rows(x):
    """A kernel with a parallel grid over row blocks, vmapped over a leading batch axis."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape[1:], x.dtype), grid=(2,),
                          in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))
    return jax.vmap(call)(x)


def test_a_vmapped_kernel_interprets_only_with_its_vmapped_dims_parallel():
    x = jnp.arange(3 * 16 * 128, dtype=jnp.float32).reshape(3, 16, 128)
    with pltpu.force_tpu_interpret_mode(INTERPRET), pytest.raises(ValueError, match="safe_zip"):
        jax.block_until_ready(_doubled_rows(x))
    with ic.vmapped_grids(), pltpu.force_tpu_interpret_mode(INTERPRET):
        np.testing.assert_array_equal(np.asarray(_doubled_rows(x)), 2 * np.asarray(x))
    with backends.BACKENDS["interpret"].context():
        np.testing.assert_array_equal(np.asarray(_doubled_rows(x)), 2 * np.asarray(x))


# ----------------------------------------------------------------- zero-length accesses


def _race_between(first_range, second_range) -> bool:
    """Whether jax's race detector reports two writes of one buffer by two DMAs whose
    clocks are unordered (neither happened before the other)."""
    from jax._src.pallas.mosaic.interpret import race_detection_state as races
    from jax._src.pallas.mosaic.interpret import vector_clock

    state = races.RaceDetectionState()
    first, second = vector_clock.NpVectorClock(2), vector_clock.NpVectorClock(2)
    first.inc(0)
    second.inc(1)
    state.check_write((106, 0), first, ("vmem", 110, 0, 0), first_range)
    try:
        state.check_write((109, 0), second, ("vmem", 110, 0, 0), second_range)
    except RuntimeError as exc:
        assert "RACE DETECTED" in str(exc)
        return True
    return False


# v3's: a zero-length copy at token 160 of a kv buffer, another copy of tokens 157-165.
EMPTY, SPANNING = (0, slice(160, 160), slice(0, 2)), (0, slice(157, 166), slice(0, 2))


def test_jaxs_race_detector_takes_a_zero_length_access_for_one():
    assert _race_between(EMPTY, SPANNING)
    assert _race_between(SPANNING, EMPTY)


def test_within_empty_accesses_a_zero_length_access_races_with_nothing_and_is_undone_on_exit():
    with ic.empty_accesses():
        assert not _race_between(EMPTY, SPANNING) and not _race_between(SPANNING, EMPTY)
        # One element is an access: overlapping writes still race, disjoint ones do not.
        assert _race_between((0, slice(160, 161), slice(0, 2)), SPANNING)
        assert _race_between((0, 160, slice(None)), SPANNING)
        assert not _race_between((0, slice(166, 170), slice(0, 2)), SPANNING)
        assert not _race_between((1, slice(160, 161), slice(0, 2)), SPANNING)
    assert _race_between(EMPTY, SPANNING)


def test_the_hazard_backend_judges_zero_length_accesses_as_empty():
    with backends.BACKENDS["interpret-hazards"].context():
        assert not _race_between(EMPTY, SPANNING)
    assert _race_between(EMPTY, SPANNING)


def _write_page_0_while_reading_n_tokens_of_it(n_ref, x_hbm, o_hbm, buf, sem):
    """Two cores: one writes page 0 of the (reshaped) HBM output while the other copies
    ``n`` tokens of page 0 out of it, as v3 copies a kv block's pages (zero tokens for a
    page past a sequence's end)."""
    del x_hbm
    flat = o_hbm.reshape(o_hbm.shape[0] * o_hbm.shape[1], *o_hbm.shape[2:])

    @pl.when(pl.program_id(0) == 0)
    def _():
        buf[...] = jnp.ones_like(buf)
        copy = pltpu.make_async_copy(buf, flat.at[pl.ds(0, 16)], sem)
        copy.start()
        copy.wait()

    @pl.when(pl.program_id(0) == 1)
    def _():
        # Page 2 (which the other core leaves alone) first: a wait of zero bytes on a
        # semaphore never signaled stops jax's interpreter ("assert clock is not None").
        for copy in (pltpu.make_async_copy(flat.at[pl.ds(32, 16)], buf, sem),
                     pltpu.make_async_copy(flat.at[pl.ds(0, n_ref[0])], buf.at[pl.ds(0, n_ref[0])], sem)):
            copy.start()
            copy.wait()


def _two_cores_on_page_0(tokens: int):
    return pl.pallas_call(
        _write_page_0_while_reading_n_tokens_of_it, out_shape=jax.ShapeDtypeStruct(PAGES.shape, PAGES.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2,), in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.HBM),
            scratch_shapes=[pltpu.VMEM((16, 2, 128), jnp.float32), pltpu.SemaphoreType.DMA(())]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        input_output_aliases={1: 0})(jnp.array([tokens], jnp.int32), PAGES)


@pytest.mark.parametrize("seed", range(len(backends.HAZARD_VARIANTS)))
def test_a_zero_length_dma_from_a_reshaped_ref_reads_nothing_on_every_hazard_variant(seed):
    """The zero-token copy touches no element of page 0: no race with the other core's
    write (a copy of the whole view would be one); a copy of its 16 tokens is one."""
    hazards = backends.BACKENDS["interpret-hazards"]
    with hazards.context(seed=seed, cores=2):
        got = np.asarray(_two_cores_on_page_0(0))
    want = PAGES.copy()
    want[0] = 1.0
    np.testing.assert_array_equal(got, want)
    with pytest.raises(Exception, match="RACE DETECTED"):
        with hazards.context(seed=seed, cores=2):
            np.asarray(_two_cores_on_page_0(16))
