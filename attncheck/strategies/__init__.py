"""Hypothesis strategies shared by the kernel specs, and the input builders they drive.

Strategies draw *parameters* (small, shrinkable, from small sets so compiled executables are
reused); arrays are made from a seed by the builders below, so a case replays exactly.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from attncheck import profiles

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# Value distributions. Uniform [0, 1) is deliberately absent: all-positive inputs hide sign
# bugs (a dropped minus, a max that starts at 0 instead of -inf).
VALUE_KINDS = ("normal", "large", "ties", "offset")
# The kinds of the families that draw only these two (paged, ragged, blockwise FFN).
NORMAL_AND_LARGE = VALUE_KINDS[:2]
# "large": logits of magnitude ~ LARGE_LOGIT_STD * scale * sqrt(d) ~ tens, where a float32
# softmax that does not subtract the running max overflows, and one that does stays exact.
LARGE_LOGIT_STD = 4.0
# "offset": v with this mean (std 1) on the first half of the keys and its negative on the
# second (``attention_values``): a long P @ V accumulation runs up to large sums, whose
# rounding zero-mean values would never reach, and a row that sees both halves ends near
# 0, where that rounding stands out. The cotangent stays centred: offset too, dP -
# rowsum(dO * O) cancels, and jax.nn's own bfloat16 backward is then past the tolerance (dk
# budgets 0.8-1.5 over 12 seeds of 2048 keys).
V_OFFSET = 4.0
# Keys a long reduction sums: a bfloat16 running sum of P @ V over this many terms of v
# offset by V_OFFSET loses each term's low bits once it is large (measured: 1.3 off where a
# float32 sum is 0.016 off, at 1024 keys; 0.16 against 0.017 at 128), where a few keys
# keep it exact to rounding.
LONG_REDUCTION = 1024
# Kv blocks a row's online softmax steps through where a blockwise kernel reduces: a
# running accumulator rounded to bfloat16 once per block errs by about sqrt(blocks) / 3
# ulps, under the tolerance's 4-ulp floor at tens of blocks (measured in the ragged kernel
# on v offset by V_OFFSET: budget 0.34 at 16 blocks, 0.79 at 83, 1.5 at 250; a float32
# accumulator 0.10 at each).
MANY_KV_BLOCKS = 256
# "sink": key 0 draws every query's attention by a margin that grows over the queries, from 0
# at the first to SINK_GAP logits at the last (at the default scale 1 / sqrt(head_dim)), as
# an LLM's first token does. Once a running sum holds the sink's weight, a block of keys
# whose weight is under half its ulp adds nothing to a bfloat16 sum, and some query's margin
# puts every later block there whatever the block size: the softmax denominator loses them
# all. Drawn by the families whose kernels keep such sums across kv blocks (flash).
SINK = "sink"
SINK_GAP = 20.0
# Kv blocks after the sink's for its rows to lose in a narrow running sum: a bfloat16
# denominator then errs by up to blocks * 2^-9, past the 4-ulp floor from about 20 blocks
# (simulated with 128-key blocks: budget 1.0-1.2 at 16 blocks, 2.1-2.3 at 32, 3.6-4.1 at
# 64; a float32 one 0.06-0.08 at each).
SINK_KV_BLOCKS = 64
# Kv blocks a row steps through where its v offset cancels ("offset" values, a row that sees
# both halves of the keys): the running sum peaks near V_OFFSET times half the weight and
# ends near 0, so a bfloat16 accumulator's rounding, relative to the peak, stands out from
# the output's (simulated with 128-key blocks: budget 0.8-1.1 at 8 blocks, 1.8-2.6 at 16,
# 3.3-4.5 at 32; a float32 accumulator 0.1 at each).
CANCELLING_KV_BLOCKS = 16


def spread_weights(scale: float, head_dim: int) -> bool:
    """Logits of normal q and k (std |scale| sqrt(head_dim)) of at most unit spread: a row's
    softmax weights spread over many keys, so that "offset" values of both signs cancel in
    its sum (a peaked softmax picks a few keys, and their offset). To rounding: the default
    scale, 1 / sqrt(head_dim), is one ulp either side of it."""
    return abs(scale) * head_dim ** 0.5 <= 1 + 1e-9


def sink_margins(rows: int) -> np.ndarray:
    """Each query row's component along the all-ones direction: its share of SINK_GAP,
    from 0 at the first row to 1 at the last."""
    return np.linspace(0.0, 1.0, rows)


def sink_key(head_dim: int) -> float:
    """What the sink key adds to each of its head dims: SINK_GAP logits, at the default
    scale, for a query whose share is 1."""
    return SINK_GAP / np.sqrt(head_dim)


def sink_scale(scale: float, head_dim: int) -> bool:
    """The scale a sink's margins are drawn for: the default, 1 / sqrt(head_dim)."""
    return abs(scale * head_dim ** 0.5 - 1) < 1e-9


# Seeds are 32-bit: enough variety, and short in reproducer commands.
seeds = st.integers(min_value=0, max_value=2**32 - 1)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Static choices of a family (lengths, head dims, layouts): a few buckets in the CI
    profile, so that one compile serves many cases, and a wide set of valid values in the
    nightly profile, which has the time for a compile per case."""

    ci: tuple
    nightly: tuple

    def __call__(self) -> tuple:
        return self.nightly if profiles.wide() else self.ci


def dtype_of(name: str) -> np.dtype:
    return DTYPES[name]


def round_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round float64 values to `dtype` (the kernel's input dtype)."""
    return np.asarray(x, dtype=np.float32).astype(dtype)


def attention_values(rng: np.random.Generator, kind: str, shape: tuple[int, ...], *, role: str) -> np.ndarray:
    """float64 values of one attention operand ('q', 'k', 'v' or 'd_out', the output's cotangent)."""
    x = rng.standard_normal(shape)
    if kind == "large" and role in ("q", "k"):
        return x * LARGE_LOGIT_STD
    if kind == "offset" and role == "v":
        # +V_OFFSET on the first half of the keys, -V_OFFSET on the second: a row that sees
        # both sums terms of magnitude V_OFFSET to a result near 0, an ill-conditioned sum in
        # which a narrow accumulator's rounding (relative to the running sum, which peaks
        # halfway) stands out against the output's own; a row that sees one half has an
        # output far from 0.
        keys = shape[-2]
        return x + np.where(np.arange(keys) < (keys + 1) // 2, V_OFFSET, -V_OFFSET)[:, None]
    if kind == SINK and role == "q":
        return x + sink_margins(shape[-2])[:, None]
    if kind == SINK and role == "k":
        x[..., 0, :] += sink_key(shape[-1])
        return x
    if kind == "ties" and role == "k":
        # Keys equal in pairs (2j, 2j+1): exact logit ties everywhere, across block edges too
        # when a pair straddles one. Not all keys equal: that makes dq exactly zero by
        # cancellation, which tests nothing but rounding noise.
        return np.repeat(x[..., ::2, :], 2, axis=-2)[..., : shape[-2], :]
    return x


@st.composite
def segment_layout(draw, length: int, *, max_segments: int = 4) -> tuple[int, ...]:
    """Segment boundaries over `length` tokens: sorted start offsets, the first being 0.

    Shrinks toward one segment; single-token segments and segments straddling any block
    boundary are reachable because boundaries are free positions.
    """
    count = draw(st.integers(min_value=1, max_value=max_segments))
    starts = draw(st.lists(st.integers(min_value=1, max_value=length - 1), min_size=count - 1,
                           max_size=count - 1, unique=True))
    return tuple([0] + sorted(starts))


def drawn_segment_layout(draw, segments: str, length: int) -> tuple[int, ...]:
    """A case's segment layout over ``length`` tokens, drawn where it has segments (its
    ``segments`` kind is not "none"); ``draw`` is a composite strategy's."""
    return draw(segment_layout(length)) if segments != "none" else ()


def segment_ids_from_layout(starts: tuple[int, ...], length: int) -> np.ndarray:
    ids = np.zeros(length, dtype=np.int32)
    for n, s in enumerate(starts):
        ids[s:] = n + 1
    return ids


def divisors(n: int, multiple_of: int) -> list[int]:
    return [d for d in range(multiple_of, n + 1, multiple_of) if n % d == 0]
