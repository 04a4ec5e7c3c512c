"""The calls dot_product_attention's convention rules out."""

from __future__ import annotations

import jax.numpy as jnp

from attncheck import domain
from attncheck.specs.base import InvalidCall


def invalid_dpa_calls(impl, *, adapter: bool = False) -> list[InvalidCall]:
    """Calls the convention rules out; every implementation must reject them with an error
    naming the argument (the exception class is the implementation's). The flash adapter
    also rejects what jax.nn lets through: float16 (the kernel has no float16), a mask head
    axis neither 1 nor N (jax.nn: a bare AssertionError), a negative window (jax.nn: accepted).
    Sequence lengths are the implementation's declared multiple (attncheck.domain), so each
    call is refused for what it breaks, not for a sequence the implementation never takes."""
    multiple = domain.of(impl).sequence_multiple
    b, t, s, n, k, h = 2, domain.round_up(8, multiple), domain.round_up(128, multiple), 4, 2, 64
    f32 = jnp.float32
    query, key = jnp.zeros((b, t, n, h), f32), jnp.zeros((b, s, k, h), f32)
    bad = {
        "value_head_dim": (dict(value=jnp.zeros((b, s, k, 32), f32)), r"value"),
        "value_dtype": (dict(value=key.astype(jnp.bfloat16)), r"value"),
        "query_dtype": (dict(query=query.astype(jnp.bfloat16)), r"query"),
        "query_head_dim": (dict(query=jnp.zeros((b, t, n, 32), f32)), r"query"),
        "query_batch": (dict(query=jnp.zeros((1, t, n, h), f32)), r"query"),
        "heads_not_multiple": (dict(query=jnp.zeros((b, t, 3, h), f32)), r"(?i)query heads"),
        "mask_not_bool": (dict(mask=jnp.zeros((b, n, t, s), f32)), r"mask"),
        "mask_rank": (dict(mask=jnp.ones((1, b, n, t, s), bool)), r"mask"),
        "bias_rank": (dict(bias=jnp.zeros((1, b, n, t, s), f32)), r"bias"),
        "query_seq_lengths_shape": (dict(query_seq_lengths=jnp.array([1, 2, 3], jnp.int32)), r"query_seq_lengths"),
        "key_value_seq_lengths_dtype": (dict(key_value_seq_lengths=jnp.array([1.0, 2.0], f32)),
                                        r"key_value_seq_lengths"),
    }
    if adapter:
        bad.update({
            "float16": (dict(query=query.astype(jnp.float16), key=key.astype(jnp.float16),
                             value=key.astype(jnp.float16)), r"query dtype"),
            "mask_heads": (dict(mask=jnp.ones((b, 3, t, s), bool)), r"mask"),
            "negative_window": (dict(local_window_size=(-1, 0)), r"local_window_size"),
        })
    return [InvalidCall(kind, lambda change=change: impl(**{"query": query, "key": key, "value": key, **change}),
                        (ValueError, TypeError), match) for kind, (change, match) in bad.items()]
