"""Flash attention's invalid calls: arguments the kernel must refuse, each with a message that
names the argument."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attncheck.compiled import impl_module
from attncheck.specs.base import InvalidCall
from attncheck.specs.flash.params import BlockSizes


def invalid_flash_calls(impl) -> list[InvalidCall]:
    module = impl_module(impl)
    f32 = jnp.float32
    b, h, s, d = 1, 1, 256, 128
    q = jnp.zeros((b, h, s, d), f32)
    # A dict, as block_sizes_not_BlockSizes passes it where a BlockSizes is wanted.
    defaults = dataclasses.asdict(BlockSizes.of(module.BlockSizes.get_default(b, h, s, s, d)))

    def with_blocks(**changes):
        # Built inside the call: a constructor that validates must raise under pytest.raises.
        return lambda: impl(q, q, q, causal=False, sm_scale=1.0,
                            block_sizes=module.BlockSizes(**{**defaults, **changes}))

    seg = module.SegmentIds(q=jnp.zeros((b, s // 2), jnp.int32), kv=jnp.zeros((b, s), jnp.int32))
    # Each message must name the offending argument (either order of words).
    return [
        InvalidCall("kv_head_dim", lambda: impl(q, jnp.zeros((b, h, s, 64), f32), jnp.zeros((b, h, s, 64), f32),
                                                causal=False, sm_scale=1.0), ValueError,
                    r"(?is)(?=.*\bk\b)(?=.*(head|dim|shape))"),
        InvalidCall("rank", lambda: impl(q[0], q[0], q[0], causal=False, sm_scale=1.0), ValueError,
                    r"(?is)(?=.*\bq\b)(?=.*(rank|4-?d|dim|shape))"),
        InvalidCall("dtype_mix", lambda: impl(q, q.astype(jnp.bfloat16), q, causal=False, sm_scale=1.0),
                    (TypeError, ValueError), r"(?i)dtype"),
        InvalidCall("ab_shape", lambda: impl(q, q, q, jnp.zeros((b, h, s, s // 2), f32), causal=False, sm_scale=1.0),
                    ValueError, r"(?i)\bab\b"),
        InvalidCall("segment_ids_shape", lambda: impl(q, q, q, None, seg, causal=False, sm_scale=1.0), ValueError,
                    r"(?i)segment"),
        InvalidCall("block_q_not_dividing", with_blocks(block_q=96, block_q_dkv=96, block_q_dq=96,
                                                        block_q_major_dkv=96), ValueError, r"block_q"),
        InvalidCall("block_k_not_lane_multiple", with_blocks(block_k_major=64, block_k=64), ValueError, r"block_k"),
        InvalidCall("block_k_major_not_multiple_of_block_k", with_blocks(block_k_major=256, block_k=192),
                    ValueError, r"block_k"),
        InvalidCall("block_size_not_int", with_blocks(block_q=128.0), ValueError, r"block_q"),
        InvalidCall("block_size_not_positive", with_blocks(block_b=0), ValueError, r"block_b"),
        InvalidCall("block_q_not_sublane_multiple", with_blocks(block_q=12), ValueError, r"block_q"),
        InvalidCall("block_k_not_dividing_block_k_major", with_blocks(block_k_major=384, block_k=256),
                    ValueError, r"block_k"),
        InvalidCall("head_dim_unsupported", lambda: impl(*(jnp.zeros((b, h, s, 96), f32),) * 3, causal=False,
                                                         sm_scale=1.0), ValueError, r"head_dim"),
        InvalidCall("batch_mismatch", lambda: impl(q, jnp.zeros((2, h, s, d), f32), jnp.zeros((2, h, s, d), f32),
                                                   causal=False, sm_scale=1.0), ValueError, r"(?i)batch"),
        InvalidCall("heads_mismatch", lambda: impl(q, jnp.zeros((b, 2, s, d), f32), jnp.zeros((b, 2, s, d), f32),
                                                   causal=False, sm_scale=1.0), ValueError, r"(?i)heads"),
        InvalidCall("kv_len_mismatch", lambda: impl(q, q, jnp.zeros((b, h, s // 2, d), f32), causal=False,
                                                    sm_scale=1.0), ValueError, r"kv_len"),
        InvalidCall("unsupported_dtype", lambda: impl(*(q.astype(jnp.float16),) * 3, causal=False, sm_scale=1.0),
                    ValueError, r"(?i)dtype"),
        InvalidCall("ab_not_float", lambda: impl(q, q, q, jnp.zeros((b, h, s, s), jnp.int32), causal=False,
                                                 sm_scale=1.0), ValueError, r"\bab\b"),
        InvalidCall("segment_ids_not_SegmentIds", lambda: impl(q, q, q, None, (seg.kv, seg.kv), causal=False,
                                                               sm_scale=1.0), ValueError, r"segment_ids"),
        InvalidCall("segment_ids_not_int", lambda: impl(q, q, q, None, module.SegmentIds(
            q=jnp.zeros((b, s), f32), kv=jnp.zeros((b, s), f32)), causal=False, sm_scale=1.0),
                    ValueError, r"segment_ids"),
        InvalidCall("block_sizes_not_BlockSizes", lambda: impl(q, q, q, causal=False, sm_scale=1.0,
                                                               block_sizes=defaults), ValueError, r"block_sizes"),
        InvalidCall("q_len_not_sublane_multiple", lambda: impl(jnp.zeros((b, h, 100, d), f32), q, q, causal=False,
                                                               sm_scale=1.0), ValueError, r"q_len"),
        InvalidCall("kv_len_not_lane_multiple", lambda: impl(q, *(jnp.zeros((b, h, 200, d), f32),) * 2,
                                                             causal=False, sm_scale=1.0), ValueError, r"kv_len"),
        InvalidCall("sm_scale_traced", lambda: jax.jit(lambda sc: impl(q, q, q, causal=False, sm_scale=sc))(1.0),
                    TypeError, r"sm_scale"),
        InvalidCall("sm_scale_not_a_number", lambda: impl(q, q, q, causal=False, sm_scale="abc"),
                    (TypeError, ValueError), r"sm_scale"),
    ]
