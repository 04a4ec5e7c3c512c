"""dot_product_attention's bug classes, the predicates behind them, its pairwise partitions
and its contracts."""

from __future__ import annotations

import numpy as np

from attncheck import bugclasses, parameters
from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.expectations import Contract
from attncheck.specs.base import FLOAT32_ACCUMULATION, values_by_dtype
from attncheck.specs.dpa.params import VALUE_KINDS, DPAParams, _query_valid, effective_scale


def hides_keys(p) -> bool:
    """Some query has a key it must not see."""
    return p.mask != "none" or p.window is not None or p.kv_lengths is not None or p.is_causal


def _padded_rows(case: Case[DPAParams], inputs) -> dict[str, np.ndarray]:
    """Where padded query rows show: their output rows, and all of dv of a batch that has
    some (a padded row's cotangent reaches every key it would see)."""
    valid = _query_valid(case.params)[:, 0, :, 0]  # [B, T]
    return {"out": ~valid[:, :, None, None], "dv": ~valid.all(axis=1)[:, None, None, None]}


def _off_tiles(p: DPAParams) -> bool:
    return bool(p.q_len % 8 or p.kv_len % 128)


def some_row_sees_no_key(p: DPAParams) -> bool:
    """A row within its query length that sees no key (its mean of v is checked), from the
    parameters alone: an emptied mask row or a kv length of 0."""
    q_lengths = p.q_lengths or (p.q_len,) * p.batch
    return p.mask_empties_rows or any(kv == 0 and q > 0 for q, kv in zip(q_lengths, p.kv_lengths or ()))


SCALE = bugclasses.numbers("scale", lambda p: p.scale, parameters.NUMBER_CELLS)
# Crossed pairwise: the scale, what hides keys, and whether the shape fills the kernels'
# tiles. A hide value that goes through the scale, or padding that the kernel hides in its
# own way, shows only in some of these pairs (a mask under a negative scale).
PAIRS = bugclasses.pairwise(
    SCALE,
    bugclasses.partition("hiding", nothing=lambda p: not hides_keys(p), mask=lambda p: p.mask != "none",
                         kv_lengths=lambda p: p.kv_lengths is not None and min(p.kv_lengths) < p.kv_len,
                         window=lambda p: p.window is not None, causal=lambda p: p.is_causal),
    bugclasses.partition("tiles", on=lambda p: not _off_tiles(p), off=_off_tiles))


BUG_CLASSES = bugclasses.bug_classes(
    # Plain causal on the usual tiles (no padding, nothing else hides keys): where a tiled
    # kernel runs its own causal masking and block skipping.
    causal_on_tiles=lambda p: (p.is_causal and not _off_tiles(p) and p.mask == "none" and p.window is None
                               and p.kv_lengths is None),
    # Top-left alignment shows where T != S; a window would hide part of it.
    causal_q_len_ne_kv_len=lambda p: p.is_causal and p.q_len != p.kv_len and p.window is None,
    bias_full=lambda p: p.bias == "full",
    # dbias summed over the axes the bias broadcasts along.
    bias_broadcast=lambda p: p.bias in ("per_head", "per_key"),
    fully_masked_row=some_row_sees_no_key,
    # Query heads that share a kv head see different keys.
    mask_per_head=lambda p: p.mask == "per_head" and p.q_heads > p.kv_heads,
    mask_shared=lambda p: p.mask == "shared",
    q_padding=bugclasses.Touching(lambda p: p.q_lengths is not None and min(p.q_lengths) < p.q_len,
                                  _padded_rows),
    kv_padding=lambda p: p.kv_lengths is not None and 0 < min(p.kv_lengths) < p.kv_len,
    window_with_causal=lambda p: p.window is not None and p.is_causal,
    # Causal hides what the right side lets through.
    window_right_side=lambda p: p.window is not None and p.window_sides[1] > 0 and not p.is_causal,
    # What changes the logits shows where rows see several keys (every case has one).
    default_scale=lambda p: p.scale is None,
    # A hidden key must stay hidden whatever the scale's sign: a mask value scaled by a
    # negative scale is the largest logit, by 0 a visible one.
    negative_scale_hides_keys=lambda p: p.scale is not None and p.scale < 0 and hides_keys(p),
    zero_scale_hides_keys=lambda p: p.scale == 0 and hides_keys(p),
    # Key lengths alone hide keys where the keys fill the kernel's blocks exactly (no
    # padding, no mask): a kernel that only masks its padding forgets them.
    kv_lengths_alone=lambda p: (p.kv_lengths is not None and min(p.kv_lengths) < p.kv_len and p.kv_len % 128 == 0
                                and p.mask == "none" and p.window is None),
    bf16=lambda p: p.dtype == "bfloat16",
    large_logits=lambda p: p.values == "large",
    # P @ V over thousands of keys of v far from 0, in bfloat16: where an accumulator
    # narrower than float32 shows (the convention accumulates in float32).
    long_reduction_offset_values=lambda p: (p.kv_len >= S.LONG_REDUCTION and p.values == "offset"
                                            and p.dtype == "bfloat16" and not hides_keys(p)
                                            and S.spread_weights(effective_scale(p), p.head_dim)),
    # The same after a sink, at the scale its margins are drawn for: where a running softmax
    # denominator narrower than float32 shows.
    long_reduction_sink=lambda p: (p.kv_len >= 4 * S.LONG_REDUCTION and p.values == S.SINK
                                   and p.dtype == "bfloat16" and not hides_keys(p)
                                   and S.sink_scale(effective_scale(p), p.head_dim)),
    decode=lambda p: p.q_len == 1,
    gqa=lambda p: 1 < p.kv_heads < p.q_heads,
    mqa=lambda p: p.kv_heads == 1 < p.q_heads,
    # Off the usual tiles (sequences not multiples of 8 / 128): padding must stay hidden.
    shape_off_tiles=_off_tiles,
) + SCALE.classes + PAIRS + values_by_dtype(VALUE_KINDS) + bugclasses.presences(
    bias=lambda p: p.bias != "none", mask=lambda p: p.mask != "none",
    query_seq_lengths=lambda p: p.q_lengths is not None, key_value_seq_lengths=lambda p: p.kv_lengths is not None,
    local_window_size=lambda p: p.window is not None)
CONTRACTS = (FLOAT32_ACCUMULATION,
             Contract("unseeing_rows_and_padding", "jax.nn's convention: a row that sees no key outputs the mean "
                      "of v over all keys with that mean's gradient; rows past a query length output 0 and take no "
                      "gradient"),)
