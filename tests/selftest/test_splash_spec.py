"""The splash_attention spec's own pieces: the NumPy meaning of each mask (what the oracle is
told) against jax's mask library, the block conditions behind its coverage classes, the
per-head yardstick mask, and a kernel factory that is a functools.partial."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as kernel_module,
)

from attncheck import check, oracle, yardstick
from attncheck.backends import BACKENDS
from attncheck.cases import Case
from attncheck.compiled import impl_module, impl_origin
from attncheck.specs import all_specs, resolve_impl, splash_config
from attncheck.specs.splash import classes as splash_classes
from attncheck.specs.splash import masks as splash_masks
from attncheck.specs.splash import params as splash_params

SHAPES = sorted({(s[3], s[4]) for s in splash_params.SHAPES})  # (q_len, kv_len)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), shape=st.sampled_from(SHAPES))
def test_the_oracle_side_meaning_of_every_mask_is_the_mask_librarys(data, shape):
    """evaluate() is written from the mask classes' docstrings; the library's own
    evaluation (``mask[:, :]``) must agree everywhere, or the oracle judges another mask."""
    desc = data.draw(splash_masks.mask_descriptions(*shape))
    library = kernel_module.mask_lib.MultiHeadMask([splash_masks.build(kernel_module.mask_lib, desc, shape)])
    np.testing.assert_array_equal(splash_masks.evaluate(desc, *shape), np.asarray(library[:, :, :])[0],
                                  err_msg=str(desc))


def test_numpy_layout_0_on_three_kv_tiles_has_every_block_condition():
    p = params(api="mqa", heads=2, kv_heads=1, q_len=256, kv_len=384, head_dim=128, v_head_dim=64,
               masks=(("numpy", 0),) * 2)
    occupancy = splash_classes.occupancy(splash_classes.head_masks(p)[0], 128, 128)
    np.testing.assert_array_equal(occupancy, [[1, 0, 1], [0, 2, 1]])
    assert splash_classes.skipped_block_between_visited(p) and splash_classes.shrunk_grid(p)
    assert splash_classes.partial_blocks_loaded(p, with_full=True)


def params(**changes) -> splash_params.SplashParams:
    base = dict(dtype="float32", api="mha", heads=2, kv_heads=1, q_len=128, kv_len=256, head_dim=64, v_head_dim=64,
                masks=(("causal", 128),) * 2, segments="none", segment_starts=(), soft_cap=None,
                blocks=blocks(), fused_bwd=False, head_shards=1, q_seq_shards=1, values="normal")
    return splash_params.SplashParams(**(base | changes))


def blocks(**changes) -> splash_params.BlockSizes:
    """Blocks of 128 in every pass, dq's included, but for ``changes``."""
    return splash_params.BlockSizes(**dict.fromkeys(splash_params.BLOCK_FIELDS, 128) | changes)


def fields_of(p: splash_params.SplashParams) -> dict:
    """The params' fields as keywords (not dataclasses.asdict: it would turn the blocks into a dict)."""
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


@pytest.mark.parametrize("masks, q_len, kv_len, shrunk", [
    ((("causal", 128),) * 2, 128, 256, False),  # one q block visits kv blocks 0 and 1: no gap
    ((("causal", 0),) * 2, 128, 256, False),  # a narrower grid (kv block 0 only), its block in place
    ((("local", 32, 0, 128),) * 2, 128, 256, False),  # keys 96..255: kv blocks 0 and 1, each in place
    ((("local", 0, 0, 128),) * 2, 128, 256, True),  # the diagonal sits in kv block 1 only
    ((("full",), ("causal", 128)), 128, 256, False),  # a mask per head is never shrunk
])
def test_shrunk_grid_needs_a_visited_kv_block_off_its_grid_position(masks, q_len, kv_len, shrunk):
    assert splash_classes.shrunk_grid(params(masks=masks, q_len=q_len, kv_len=kv_len)) is shrunk


def test_fully_masked_rows_in_visited_q_blocks_or_in_q_blocks_without_keys():
    # Bottom-right causal with q longer than kv: the first 128 queries see nothing, a whole block.
    empty_block = params(heads=4, kv_heads=2, q_len=256, kv_len=128, masks=(("causal", -128),) * 4)
    assert splash_classes.q_block_without_keys(empty_block)
    assert not splash_classes.fully_masked_row_in_visited_block(empty_block)
    rows = splash_classes.fully_masked_rows(empty_block)
    assert rows[:, :128].all() and not rows[:, 128:].any()
    # A negative offset empties the first 16 rows of a q block that sees keys further down.
    some_rows = params(masks=(("causal", -16),) * 2)
    assert splash_classes.fully_masked_row_in_visited_block(some_rows)
    assert not splash_classes.q_block_without_keys(some_rows)
    # The same empty rows inside a q block of 256 rows, half of which see keys.
    wide_q_block = dataclasses.replace(empty_block, blocks=blocks(block_q=256))
    assert splash_classes.fully_masked_row_in_visited_block(wide_q_block)


def test_per_head_masks_within_a_kv_group_and_grouped_kv_heads():
    assert splash_classes.per_head_masks_within_kv_group(params(masks=(("full",), ("causal", 128))))
    assert not splash_classes.per_head_masks_within_kv_group(params())
    # MHA: no two query heads share a kv head, whatever their masks.
    assert not splash_classes.per_head_masks_within_kv_group(params(kv_heads=2, masks=(("full",), ("causal", 128))))


def test_segments_vary_across_tiles_in_every_pass():
    square = dict(q_len=256, kv_len=256, masks=(("causal", 0),) * 2, segments="packed")
    assert splash_classes.segments_vary_across_tiles(params(**square, segment_starts=(0, 1)))
    assert not splash_classes.segments_vary_across_tiles(params(**square, segment_starts=(0,)))
    # One q block in the forward pass: its q segment map is not tested.
    assert not splash_classes.segments_vary_across_tiles(params(**square, segment_starts=(0, 1),
                                                               blocks=blocks(block_q=256)))


def test_the_yardstick_applies_a_mask_per_query_head():
    """visibility(mask=[1, H, Q, K]) ANDs a different mask into each head; the yardstick then
    matches the oracle given the same per-head mask, and differs from a shared one."""
    rng = np.random.default_rng(0)
    q, k, v, d_out = (rng.standard_normal((1, 2, 8, 4)).astype(np.float32) for _ in range(4))
    masks = np.stack([np.tril(np.ones((8, 8), bool)), np.ones((8, 8), bool)])[None]
    ids = np.array([[0] * 5 + [1] * 3], np.int32)
    seen = yardstick.visibility(np.arange(8), np.arange(8), causal=False, q_segment_ids=ids, kv_segment_ids=ids,
                                mask=masks)
    assert seen.shape == (1, 2, 8, 8)
    got = yardstick.attention_with_grads(q, k, v, d_out, scale=0.5, visible=seen, masked_rows="zero")
    sem = dict(scale=0.5, visible=masks, q_segment_ids=ids, kv_segment_ids=ids, masked_rows="zero")
    truth = {"out": oracle.attention(q, k, v, **sem).out, **oracle.attention_vjp(q, k, v, d_out, **sem)}
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], truth[name], atol=2e-5, rtol=1e-4, err_msg=name)
    assert not np.allclose(got["out"][0, 0], got["out"][0, 1])


def test_a_kernel_factory_that_is_a_partial_is_named_after_its_module_attribute():
    """jax's make_splash_mha is a functools.partial: no __module__ of its own (it says
    "functools") and no __qualname__. Its records must name a reference that resolves."""
    spec = all_specs()["splash_attention"]
    impl = resolve_impl(spec.default_impls["builtin"])
    assert impl_origin(impl) == (kernel_module.__name__, "make_splash_mha")
    assert impl_module(impl) is kernel_module
    target = check.Target(spec, "builtin", impl, BACKENDS["interpret"])
    assert target.impl_ref == spec.default_impls["builtin"] and resolve_impl(target.impl_ref) is impl
    # Its sibling factory (same function, other keywords) is another implementation.
    assert impl_origin(kernel_module.make_splash_mqa) != impl_origin(impl)


@pytest.mark.parametrize("changes, fused, leaks", [
    ({}, False, False),  # backward q blocks of 128: the NaN block is never visited
    ({"block_q_dq": 256}, False, True),  # the dq pass's q block of 256 holds the NaN rows and visits kv
    ({"block_q_dkv": 256}, False, True),
    ({"block_q_dkv": 256}, True, True),  # fused: dq comes from the dkv pass
    ({"block_q": 256, "block_q_dkv": 256, "block_q_dq": 256}, False, False),  # no forward q block without keys
])
def test_the_declared_finding_is_a_forward_nan_block_inside_a_visited_backward_block(changes, fused, leaks):
    """Measured on jax 0.12.0.1 (bottom-right causal, q_len 256 > kv_len 128): NaN in dq,
    or in dk and dv, exactly for the configurations marked leaks (the class whose deviation
    jax's kernel declares; findings/repro_splash_backward_block_nan.py)."""
    sizes = blocks(**changes)
    if fused:
        sizes = dataclasses.replace(sizes, block_q_dq=None, block_kv_dq=None)
    p = params(q_len=256, kv_len=128, masks=(("causal", -128),) * 2, blocks=sizes, fused_bwd=fused)
    assert splash_classes.forward_nan_rows_reach_backward(p) is leaks


@pytest.mark.parametrize("masks, q_seq_shards, fused, crashes", [
    ((("full",),) * 2, 2, False, True),
    ((("full",),) * 2, 1, False, False),  # no q sequence shards: no concatenation of shards
    ((("causal", 0),) * 2, 2, False, False),  # diagonal blocks are partial
    ((("full",), ("causal", 0)), 2, False, False),  # a mask per head: the grid is not shrunk
])
def test_the_declared_crash_is_one_mask_without_partial_blocks_over_q_shards(masks, q_seq_shards, fused, crashes):
    p = params(q_len=256, kv_len=256, masks=masks, q_seq_shards=q_seq_shards, fused_bwd=fused)
    assert splash_classes.q_seq_shards_without_partial_blocks(p) is crashes


@pytest.mark.parametrize("q_len, offset, skip, stacked, drops", [
    (256, -16, "qk", 1, True),  # q block 1 x kv block 0 is partial, below the diagonal
    (256, -16, "sv", 1, True),
    (256, 16, "qk", 1, True),  # the diagonal blocks hold visible keys above their own diagonal
    (256, 16, "sv", 1, True),
    (128, -16, "qk", 1, False),  # one q block: its only partial block is the diagonal one
    (256, 0, "qk", 1, False),
    (256, -128, "sv", 1, False),  # whole blocks: the diagonal runs through the corners
    (256, -16, "sv", 2, False),  # stacked q heads: the forward does not skip, the backward skips qk only
    (256, -16, "qk", 2, True),
])
def test_the_declared_diag_skip_finding_is_a_visible_key_in_a_left_out_sub_tile(q_len, offset, skip, stacked, drops):
    """Measured with tokamax 0.0.17 (kv_len 256, blocks of 128, sub-grid 2; the cases with one
    stacked head by findings/repro_tokamax_splash_diag_skip_offset.py's kernel): the output
    deviates by 0.4 to 0.6 exactly where drops is True, and agrees with float64 to 1e-6 elsewhere."""
    p = splash_config.SplashConfigParams(**fields_of(params(q_len=q_len, masks=(("causal", offset),) * 2)),
                                         diag_skip=(skip,), num_stacked_q_heads=stacked)
    exercised = splash_config.SplashConfigSpec().classes(Case(splash_config.FAMILY, p, seed=0))
    assert ("diag_skip_over_visible_keys" in exercised) is drops


HIDES_EVERY_KEY = ("and", ("causal", -128), ("local", 32, 16, 0))  # drawn by the nightly profile


@pytest.mark.parametrize("masks, q_seq_shards, crashes", [
    ((("causal", -128),) * 2, 2, True),  # q shard 0 (queries 0..127) sees no key
    ((("causal", -128),) * 2, 1, False),  # the one shard sees keys
    ((HIDES_EVERY_KEY,) * 2, 1, True),  # the one shard sees none
    ((HIDES_EVERY_KEY, ("full",)), 1, False),  # a mask per head: the grid is not shrunk
])
def test_the_declared_keyless_shard_crash_is_make_splash_mhas(masks, q_seq_shards, crashes):
    """The class predicts exactly when jax's mask processing stops at its bare assertion
    (the kernel is built only: make_splash_mha's host code, no run)."""
    p = params(q_len=256, kv_len=128, masks=masks, q_seq_shards=q_seq_shards)
    assert splash_classes.q_seq_shard_without_keys(p) is crashes
    library = kernel_module.mask_lib
    mask = library.MultiHeadMask([splash_masks.build(library, d, (256, 128)) for d in masks])
    build = functools.partial(kernel_module.make_splash_mha, mask, head_shards=1, q_seq_shards=q_seq_shards,
                              block_sizes=kernel_module.BlockSizes(**p.blocks.given()))
    if crashes:
        with pytest.raises(AssertionError):
            build()
    else:
        build()


def test_a_sharded_kernel_lowers_for_tpu():
    """The shard_map of a sharded case runs over an abstract mesh of emulated TPUs for
    tpu-lower: over the CPU devices, Mosaic's lowering asked their kind and failed
    ("Unsupported TPU device kind: cpu"; the case the nightly's random draws found)."""
    spec = all_specs()[splash_params.FAMILY]
    fused = splash_params.BlockSizes(block_q=128, block_kv=384, block_kv_compute=128, block_q_dkv=128,
                                     block_kv_dkv=384, block_kv_dkv_compute=384)
    case = spec.case(10933, **fields_of(params(
        api="mqa", heads=2, kv_heads=1, q_len=256, kv_len=384, head_dim=128, v_head_dim=64, dtype="bfloat16",
        masks=(("chunked", 64),) * 2, blocks=fused, fused_bwd=True, head_shards=2, soft_cap=3.0, values="large",
        layouts=("HEAD_DIM_MINOR", "SEQ_MINOR", "HEAD_DIM_MINOR"), downcast_smem_data=True, mask_value=-1e30)))
    target = check.Target(spec, "builtin", resolve_impl(spec.default_impls["builtin"]), BACKENDS["tpu-lower"])
    records = check.check_case(target, case).records
    assert [r.outcome for r in records] == ["pass", "pass"], [r.reason for r in records]
