"""dot_product_attention's parameters: the shapes and layouts drawn, ``DPAParams``, and what
the convention lets each query see (``visibility``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from attncheck import strategies as S
from attncheck.cases import Params

FAMILY = "dot_product_attention"
# (batch, T, S, N, K, H): sizes off the usual tiles (the flash adapter pads them) and one on them.
SHAPES = (
    (2, 6, 8, 4, 2, 16),  # T < S, two query heads per kv head
    (1, 8, 5, 2, 2, 8),  # T > S: under top-left causal the rows past S see every key
    (2, 1, 7, 4, 1, 16),  # one query token (decode), one kv head
    (1, 136, 128, 2, 1, 64),  # the flash kernel's own tiles (no padding; its causal path), T > S
    (1, 16, 4 * S.LONG_REDUCTION, 2, 1, 64),  # a long reduction over the keys (32 blocks of 128)
)
BIAS_LAYOUTS = {"none": None, "full": "BNTS", "per_head": "1NTS", "per_key": "B11S"}
MASK_LAYOUTS = {"none": None, "per_head": "BNTS", "shared": "11TS"}
WINDOWS = (None, 3, (4, 0), (2, 1))  # local_window_size: an int is (w, w)
TO_HEADS_MAJOR = (0, 2, 1, 3)  # [B, T, N, H] <-> [B, N, T, H]
# An implementation may sum in blocks: the sink shows its running denominator (strategies.SINK).
VALUE_KINDS = (*S.VALUE_KINDS, S.SINK)


@dataclasses.dataclass(frozen=True)
class DPAParams(Params):
    dtype: str
    batch: int
    q_len: int  # T
    kv_len: int  # S
    q_heads: int  # N
    kv_heads: int  # K
    head_dim: int  # H
    scale: float | None  # None: jax.nn's default 1 / sqrt(H)
    bias: str  # a BIAS_LAYOUTS key
    mask: str  # a MASK_LAYOUTS key
    mask_empties_rows: bool  # the mask hides every key of some rows
    is_causal: bool
    window: int | tuple[int, int] | None
    q_lengths: tuple[int, ...] | None
    kv_lengths: tuple[int, ...] | None
    values: str  # a VALUE_KINDS distribution

    @property
    def sequence_length(self) -> int:
        return self.kv_len

    @property
    def window_sides(self) -> tuple[int, int] | None:
        return (self.window, self.window) if isinstance(self.window, int) else self.window


# jax.nn takes any finite scale: its default, below and above 1, one that is no power of
# two, and 0 and negative ones (logits = scale * q.k + bias: a kernel that folds its mask
# into a bias it scales hides nothing there).
SCALES = (None, 0.5, 1.0, 1.7, 0.0, -0.5)


def effective_scale(p: DPAParams) -> float:
    return 1.0 / math.sqrt(p.head_dim) if p.scale is None else p.scale


def visibility(p: DPAParams, mask) -> np.ndarray:
    """[B, N, T, S] bool: what the convention lets query i of head n see."""
    i, j = np.arange(p.q_len)[:, None], np.arange(p.kv_len)[None, :]
    visible = np.ones((p.batch, p.q_heads, p.q_len, p.kv_len), bool)
    if mask is not None:
        visible &= mask
    if p.is_causal:
        visible &= j <= i
    if p.window is not None:
        left, right = p.window_sides
        visible &= (i - left <= j) & (j <= i + right)
    if p.kv_lengths is not None:
        visible &= (j[None] < np.array(p.kv_lengths)[:, None, None])[:, None]
    return visible & _query_valid(p)


def _query_valid(p: DPAParams) -> np.ndarray:
    """[B, 1, T, 1]: rows before each query length."""
    lengths = np.full(p.batch, p.q_len) if p.q_lengths is None else np.array(p.q_lengths)
    return (np.arange(p.q_len)[None, :] < lengths[:, None])[:, None, :, None]
