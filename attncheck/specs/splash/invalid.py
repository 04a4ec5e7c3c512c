"""The invalid calls of jax's splash convention, and those every splash convention shares."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attncheck.compiled import impl_module
from attncheck.specs.base import InvalidCall


# The invalid calls' shapes: H heads of S tokens of D, a causal mask, and blocks of 128 in
# every pass.
INVALID_HEADS, INVALID_LEN, INVALID_DIM = 2, 256, 128
FULL_BLOCKS = dict(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
                   block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)


def invalid_splash_calls(impl) -> list[InvalidCall]:
    """jax's convention: a MultiHeadMask, BlockSizes, head shards, the dq kernel."""
    module = impl_module(impl)
    mask_lib = module.mask_lib
    h, s = INVALID_HEADS, INVALID_LEN
    causal = mask_lib.MultiHeadMask([mask_lib.CausalMask((s, s))] * h)

    def make(mask=causal, *, q_seq_shards=1, **changes):
        # Built inside the call: constructors that validate must raise under pytest.raises.
        return impl(mask, block_sizes=module.BlockSizes(**{**FULL_BLOCKS, **changes}), head_shards=1,
                    q_seq_shards=q_seq_shards)

    x = jnp.zeros((h, s, INVALID_DIM), jnp.float32)
    return invalid_calls_through(make, module, mask_shape=(h, s, s)) + [
        InvalidCall("fused_with_dq_blocks", lambda: module.BlockSizes(block_q=128, block_kv=128,
                                                                      use_fused_bwd_kernel=True, block_q_dq=128),
                    ValueError, r"dq"),
        InvalidCall("block_kv_dq_not_lane_multiple", lambda: _grad_of(make(block_kv_dq=64), x), ValueError,
                    r"bkv=64"),
        InvalidCall("no_backward_blocks", lambda: _grad_of(impl(causal, block_sizes=module.BlockSizes(128, 128),
                                                                head_shards=1, q_seq_shards=1), x),
                    ValueError, r"backward blocks"),
        InvalidCall("mask_2d", lambda: make(mask_lib.CausalMask((s, s))), ValueError, r"mask shape"),
        InvalidCall("head_mask_shapes_differ", lambda: mask_lib.MultiHeadMask(
            [mask_lib.CausalMask((s, s)), mask_lib.CausalMask((s, 2 * s))]), ValueError, r"mask shape"),
        InvalidCall("multi_head_mask_nested", lambda: mask_lib.MultiHeadMask([causal]), ValueError,
                    r"MultiHeadMask"),
        InvalidCall("head_shards_not_dividing", lambda: impl(causal, block_sizes=module.BlockSizes(**FULL_BLOCKS),
                                                             head_shards=3, q_seq_shards=1), ValueError,
                    r"head_shards"),
    ]


def _grad_of(kernel, x):
    return jax.grad(lambda q: kernel(q, x, x).sum())(x)


def invalid_calls_through(make, module, *, mask_shape: tuple[int, ...]) -> list[InvalidCall]:
    """The invalid calls every splash convention shares, through its ``make(mask=<causal>,
    *, q_seq_shards=1, **block_sizes)`` (the kernel it builds) and its module's mask_lib
    and SegmentIds; ``mask_shape``: the shape of the convention's mask."""
    mask_lib = module.mask_lib
    h, s, d = INVALID_HEADS, INVALID_LEN, INVALID_DIM
    x = jnp.zeros((h, s, d), jnp.float32)

    def call(*args, **changes):
        return make(**changes)(*args)

    return [
        InvalidCall("block_kv_not_multiple_of_compute", lambda: call(x, x, x, block_kv=256, block_kv_compute=192),
                    ValueError, r"bkv_compute"),
        InvalidCall("block_kv_compute_not_lane_multiple", lambda: call(x, x, x, block_kv_compute=64), ValueError,
                    r"bkv_compute=64"),
        InvalidCall("block_q_not_dividing", lambda: make(block_q=96), ValueError, r"q_block_size"),
        InvalidCall("block_kv_not_dividing", lambda: make(block_kv=96, block_kv_compute=96), ValueError,
                    r"kv_block_size"),
        InvalidCall("block_kv_dkv_compute_above_block", lambda: _grad_of(make(block_kv_dkv_compute=256), x),
                    ValueError, r"bkv_compute=256"),
        InvalidCall("mask_not_bool", lambda: make(np.ones(mask_shape, np.int32)), ValueError, r"(?i)mask.*bool"),
        InvalidCall("combined_mask_shapes_differ", lambda: mask_lib.CausalMask((s, s)) & mask_lib.FullMask((s, 2 * s)),
                    ValueError, r"shape"),
        InvalidCall("chunk_size_zero", lambda: mask_lib.ChunkedCausalMask((s, s), chunk_size=0), ValueError,
                    r"chunk_size"),
        InvalidCall("q_seq_shards_not_dividing", lambda: make(q_seq_shards=3), ValueError, r"q_seq_shards"),
        InvalidCall("k_head_dim", lambda: call(x, x[..., :64], x), ValueError, r"'key' head dimension"),
        InvalidCall("kv_heads_not_dividing", lambda: call(x, *(jnp.zeros((3, s, d), jnp.float32),) * 2), ValueError,
                    r"'key' heads"),
        InvalidCall("v_len_differs_from_k", lambda: call(x, x, x[:, :128]), ValueError, r"'value'"),
        InvalidCall("mha_with_2d_k", lambda: call(x, x[0], x[0]), ValueError, r"'key' tensor"),
        InvalidCall("segment_ids_with_batch_axis", lambda: call(
            x, x, x, module.SegmentIds(jnp.zeros((1, s), jnp.int32), jnp.zeros((1, s), jnp.int32))), ValueError,
                    r"q segment_ids"),
        InvalidCall("kv_segment_ids_shape", lambda: call(
            x, x, x, module.SegmentIds(jnp.zeros((s,), jnp.int32), jnp.zeros((s // 2,), jnp.int32))), ValueError,
                    r"kv segment_ids"),
        InvalidCall("kv_longer_than_mask", lambda: call(x, *(jnp.zeros((h, 2 * s, d), jnp.float32),) * 2),
                    ValueError, r"(?i)mask"),
    ]
