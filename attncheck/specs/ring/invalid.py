"""The ring families' invalid calls: what each variant's convention rejects, and with which error."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from attncheck.specs.base import InvalidCall


def ring_invalid_calls(impl, *, flash: bool) -> list[InvalidCall]:
    """The bias-taking rings' (``flash``: the ring flash kernel's, else the blockwise ring's)."""
    x = jnp.zeros((1, 64, 2, 32), jnp.float32)
    call = functools.partial(impl, x, x, x, num_devices=2)
    calls = [
        InvalidCall("bias_key_axis_not_global", lambda: call(jnp.zeros((1, 1, 64, 32), jnp.float32)),
                    ValueError, r"attn_bias|attn_mask"),
        InvalidCall("devices_not_dividing", lambda: impl(x[:, :60], x[:, :60], x[:, :60], num_devices=8),
                    ValueError, r"(?i)(devices|seq|divid|shard)"),
        InvalidCall("kv_head_dim", lambda: impl(x, x[..., :16], x[..., :16], num_devices=2), ValueError,
                    r"(?i)\bk\b|head_dim|shape"),
        InvalidCall("qkv_not_float", lambda: impl(*(x.astype(jnp.int32),) * 3, num_devices=2), ValueError,
                    r"\bq\b"),
        InvalidCall("k_v_shape_mismatch", lambda: impl(x, x, x[..., :16], num_devices=2), ValueError,
                    r"\bk\b.*\bv\b"),
        InvalidCall("bias_rank", lambda: call(jnp.zeros((1, 1, 64, 64, 1), jnp.float32)), ValueError,
                    r"attn_bias"),
        InvalidCall("bias_not_float", lambda: call(jnp.zeros((1, 1, 64, 64), jnp.int32)), ValueError,
                    r"attn_bias"),
        InvalidCall("segment_ids_shape", lambda: call(None, jnp.zeros((1, 32), jnp.int32)), ValueError,
                    r"segment_ids"),
        InvalidCall("segment_ids_not_int", lambda: call(None, jnp.zeros((1, 64), jnp.float32)), ValueError,
                    r"segment_ids"),
        InvalidCall("mesh_axis_name", lambda: impl(x, x, x, mesh=Mesh(np.array(jax.devices()[:2]), ("x",))),
                    ValueError, r"mesh"),
        InvalidCall("mesh_size_mismatch", lambda: impl(x, x, x, num_devices=4, axis_name="x", mesh=Mesh(
            np.array(jax.devices()[:2]), ("x",))), ValueError, r"num_devices"),
        InvalidCall("num_devices_out_of_range", lambda: impl(x, x, x, num_devices=0), ValueError,
                    r"num_devices"),
    ]
    if flash:
        calls.append(InvalidCall("sm_scale_zero_with_bias",
                                 lambda: call(jnp.zeros((1, 1, 64, 64), jnp.float32), sm_scale=0.0),
                                 ValueError, r"sm_scale"))
    else:  # chunking and dropout are options of the blockwise ring only
        calls += [
            InvalidCall("query_chunk_not_positive", lambda: call(query_chunk_size=0), ValueError,
                        r"query_chunk_size"),
            InvalidCall("key_chunk_not_dividing", lambda: call(key_chunk_size=24), ValueError,
                        r"key_chunk_size"),
            InvalidCall("attn_pdrop_out_of_range", lambda: call(attn_pdrop=1.5, deterministic=False,
                                                                dropout_rng=jax.random.PRNGKey(0)),
                        ValueError, r"attn_pdrop"),
            InvalidCall("dropout_without_rng", lambda: call(attn_pdrop=0.1, deterministic=False), ValueError,
                        r"dropout_rng"),
        ]
    return calls


def standard_invalid_calls(impl) -> list[InvalidCall]:
    """The standard ring's."""
    # The rest of the builtin's validation is shared with ring_attention and tested there.
    x = jnp.zeros((1, 64, 2, 32), jnp.float32)
    return [InvalidCall("attn_mask_not_boolean", lambda: impl(x, x, x, jnp.ones((1, 1, 32, 64), jnp.float32),
                                                               num_devices=2), ValueError, r"attn_mask")]
