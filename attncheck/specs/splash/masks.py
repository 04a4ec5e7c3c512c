"""The splash family's mask language: a case describes each query head's mask as nested
tuples, which ``evaluate`` turns into the oracle's ``visible`` in NumPy (from the mask
classes' docstrings, never by the classes under test), ``build`` into the implementation's
own ``mask_lib`` objects, and ``mask_descriptions`` draws. Like jax's splash_attention_mask.
"""

from __future__ import annotations

import functools

import numpy as np
from hypothesis import strategies as st

# A negative causal/local offset empties the first rows: fully masked rows inside a q block
# that still visits kv blocks.
NEGATIVE_OFFSET = -16
LOCAL_LEFT = (32, 100, None)
LOCAL_RIGHT = (0, 16, None)
CHUNK_SIZES = (64, 96)
# NumpyMask patterns: tiles of NUMPY_TILE, empty (0), full (1) or one of two random partial
# tiles (2, 3), laid out by repeating a layout over the tile grid. On 2 x 3 tiles layout 0
# holds a skipped tile between visited ones, a q row whose first visited tile is not the
# first (a shrunk grid), full and partial tiles, and a partial tile used twice (the kernel
# deduplicates partial blocks: mask_next must pick the right one).
NUMPY_TILE = 128
NUMPY_LAYOUTS = (((2, 0, 3), (0, 1, 2)),
                 ((1, 2, 0), (3, 0, 2)))
NUMPY_SEEDS = tuple(range(len(NUMPY_LAYOUTS)))

# A mask is described by nested tuples (JSON lists come back as tuples, cases.freeze):
#   ("causal", offset) | ("local", left, right, offset) | ("chunked", chunk_size) | ("full",)
#   | ("numpy", seed) | ("and", a, b) | ("or", a, b)
@functools.lru_cache(maxsize=512)
def evaluate(desc: tuple, q_len: int, kv_len: int) -> np.ndarray:
    """[Q, K] bool: the mask's meaning, from the splash_attention_mask docstrings, in
    NumPy (the oracle's ``visible``; independent of the mask classes it judges)."""
    q = np.arange(q_len)[:, None]
    kv = np.arange(kv_len)[None, :]
    kind = desc[0]
    if kind == "causal":
        visible = q + desc[1] >= kv
    elif kind == "local":
        _, left, right, offset = desc
        visible = np.ones((q_len, kv_len), dtype=bool)
        if left is not None:
            visible = visible & (q + offset - left <= kv)
        if right is not None:
            visible = visible & (kv <= q + offset + right)
    elif kind == "chunked":
        visible = (q // desc[1] == kv // desc[1]) & (q >= kv)
    elif kind == "full":
        visible = np.ones((q_len, kv_len), dtype=bool)
    elif kind == "numpy":
        visible = _numpy_pattern(desc[1], q_len, kv_len)
    elif kind in ("and", "or"):
        a, b = evaluate(desc[1], q_len, kv_len), evaluate(desc[2], q_len, kv_len)
        visible = a & b if kind == "and" else a | b
    else:
        raise ValueError(f"mask description {desc!r}: unknown kind {kind!r}")
    return read_only(np.broadcast_to(visible, (q_len, kv_len)).copy())


def _numpy_pattern(seed: int, q_len: int, kv_len: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tiles = np.concatenate([np.zeros((1, NUMPY_TILE, NUMPY_TILE), bool), np.ones((1, NUMPY_TILE, NUMPY_TILE), bool),
                            rng.random((2, NUMPY_TILE, NUMPY_TILE)) < 0.5])
    layout = np.array(NUMPY_LAYOUTS[seed])
    rows, cols = np.arange(q_len // NUMPY_TILE), np.arange(kv_len // NUMPY_TILE)
    kinds = layout[rows[:, None] % layout.shape[0], cols[None, :] % layout.shape[1]]
    return tiles[kinds].transpose(0, 2, 1, 3).reshape(q_len, kv_len)


def build(mask_lib, desc: tuple, shape: tuple[int, int]):
    """The implementation's own mask object for a description."""
    kind = desc[0]
    if kind == "causal":
        return mask_lib.CausalMask(shape, offset=desc[1])
    if kind == "local":
        return mask_lib.LocalMask(shape, window_size=(desc[1], desc[2]), offset=desc[3])
    if kind == "chunked":
        return mask_lib.ChunkedCausalMask(shape, chunk_size=desc[1])
    if kind == "full":
        return mask_lib.FullMask(shape)
    if kind == "numpy":
        return mask_lib.NumpyMask(_numpy_pattern(desc[1], *shape))
    a, b = build(mask_lib, desc[1], shape), build(mask_lib, desc[2], shape)
    return a & b if kind == "and" else a | b


def leaves(desc: tuple) -> list[tuple]:
    return [leaf for d in desc[1:] for leaf in leaves(d)] if desc[0] in ("and", "or") else [desc]


# Masks splash evaluates inside the kernel (a mask_function) instead of loading blocks.
COMPUTABLE = ("causal", "local", "chunked")


@st.composite
def mask_descriptions(draw, q_len: int, kv_len: int, combine: bool = True) -> tuple:
    offsets = tuple(dict.fromkeys((kv_len - q_len, 0, NEGATIVE_OFFSET)))  # bottom-right first
    kind = draw(st.sampled_from(("causal", "local", "chunked", "full", "numpy") + (("and", "or") if combine else ())))
    if kind == "causal":
        return ("causal", draw(st.sampled_from(offsets)))
    if kind == "local":
        left = draw(st.sampled_from(LOCAL_LEFT))
        right = draw(st.sampled_from(LOCAL_RIGHT if left is not None else LOCAL_RIGHT[:-1]))
        return ("local", left, right, draw(st.sampled_from(offsets)))
    if kind == "chunked":
        return ("chunked", draw(st.sampled_from(CHUNK_SIZES)))
    if kind == "full":
        return ("full",)
    if kind == "numpy":
        return ("numpy", draw(st.sampled_from(NUMPY_SEEDS)))
    return (kind, draw(mask_descriptions(q_len, kv_len, False)), draw(mask_descriptions(q_len, kv_len, False)))

def read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
