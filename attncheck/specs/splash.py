"""Splash attention family: jax's ``splash_attention`` API. The implementation is a kernel
factory ``fn(mask, *, block_sizes, attn_logits_soft_cap, head_shards, q_seq_shards)``
(``make_splash_mha``) returning ``kernel(q, k, v, segment_ids=None)``; its module supplies
``make_splash_mqa``, ``SegmentIds``, ``BlockSizes`` and the mask classes (``mask_lib``:
``CausalMask``, ``LocalMask``, ``ChunkedCausalMask``, ``FullMask``, ``NumpyMask``,
``MultiHeadMask``, ``&``/``|``), so a copy of the kernel module is verified with its own
types. q [H, Q, D], k/v [Hkv, K, D|Dv] ([K, D|Dv] for MQA); no batch axis, no scale.

Mapped onto the oracle:
- logits = q.k (the scale is folded into q, as a caller of splash does);
- soft cap ``cap * tanh(logits / cap)`` before masking;
- key j visible to query i of head h iff the head's mask holds at (i, j) and the segment
  ids are equal; the mask is given to the oracle as data (``visible``), evaluated here in
  NumPy from the case's description (never by the mask classes under test);
- GQA: query head h reads kv head h // (H / Hkv); MQA: one kv head without a head axis;
- fully masked rows (no visible key, from the mask or the segments) are undefined in
  splash: the mean of v over the kv blocks the row's q block visits, or NaN when it visits
  none, so the result depends on the block structure. Their outputs are don't-care and
  their cotangent is zero (a caller masks such rows out of the loss); dq of such a row
  must then be 0, and nothing may leak into other rows or into dk/dv.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from attncheck import backends, bugclasses, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.compiled import compiled, impl_key, impl_module, with_vjp
from attncheck.expectations import BUG_CLASS, INVALID_CALL, Contract, Shipped
from attncheck.specs.base import InvalidCall, KernelSpec

FAMILY = "splash_attention"
NUM_LANES = 128  # every block size here is a multiple of it (backward q blocks must be, to lower)
# Static shape buckets (api, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim): every case
# of a bucket with the same mask and blocks reuses one compiled kernel. The first is the
# cheapest and the richest (GQA, q shorter than kv: offsets matter, two kv blocks): the
# coverage search shrinks toward it. Square; three kv blocks (a skipped block between
# visited ones); q longer than kv (bottom-right causal empties whole q blocks) with GQA over
# two kv heads (grouped, not interleaved, query heads per kv head).
SHAPES = (
    ("mha", 2, 1, 128, 256, 64, 64),
    ("mha", 2, 2, 256, 256, 128, 128),
    ("mqa", 2, 1, 256, 384, 128, 64),
    ("mha", 4, 2, 256, 128, 64, 64),
)
# A soft cap the logits (q pre-scaled by 1/sqrt(D): standard deviation 1, or 16 for "large"
# values) reach, so that a wrong cap changes the result.
SOFT_CAP = 3.0
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
LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")
# An explicit mask value: masked logits still underflow (a fully masked row is don't-care).
MASK_VALUE = -1e30
NUMPY_LAYOUTS = (((2, 0, 3), (0, 1, 2)),
                 ((1, 2, 0), (3, 0, 2)))
NUMPY_SEEDS = tuple(range(len(NUMPY_LAYOUTS)))
BLOCK_FIELDS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")


# ---------------------------------------------------------------------- masks
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
    return _read_only(np.broadcast_to(visible, (q_len, kv_len)).copy())


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


def _leaves(desc: tuple) -> list[tuple]:
    return [leaf for d in desc[1:] for leaf in _leaves(d)] if desc[0] in ("and", "or") else [desc]


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


# ---------------------------------------------------------------------- params
@dataclasses.dataclass(frozen=True)
class SplashParams(Params):
    dtype: str
    api: str  # "mha" (make_splash_mha; GQA when kv_heads < heads) or "mqa" (make_splash_mqa)
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    masks: tuple  # one mask description per query head
    segments: str  # "none" or "packed"
    segment_starts: tuple[int, ...]
    soft_cap: float | None
    blocks: tuple[tuple[str, int], ...]  # BlockSizes fields as (name, value) pairs
    fused_bwd: bool  # use_fused_bwd_kernel: dq from the dkv kernel
    head_shards: int
    q_seq_shards: int
    values: str  # an S.VALUE_KINDS distribution
    downcast_smem_data: bool = True  # the mask metadata kept in SMEM as narrow ints
    # QKVLayout names of q, k and v inside the kernel (the arrays given are [.., S, D] either way)
    layouts: tuple[str, str, str] = ("HEAD_DIM_MINOR",) * 3
    segment_dtype: str = "int32"
    mask_value: float | None = None  # None: the kernel's default

    @property
    def sequence_length(self) -> int:
        return self.kv_len

    @property
    def device_count(self) -> int:
        return self.head_shards * self.q_seq_shards

    @property
    def block_sizes(self) -> dict[str, int]:
        return dict(self.blocks)


@st.composite
def block_sizes(draw, q_len: int, kv_len: int, fused: bool) -> tuple[tuple[str, int], ...]:
    """Valid block sizes (lane multiples, dividing their axis; q blocks divide a q shard)."""
    q_blocks, kv_blocks = S.divisors(q_len, NUM_LANES), S.divisors(kv_len, NUM_LANES)
    sizes = {"block_q": draw(st.sampled_from(q_blocks)), "block_kv": draw(st.sampled_from(kv_blocks))}
    sizes["block_kv_compute"] = draw(st.sampled_from(S.divisors(sizes["block_kv"], NUM_LANES)))
    sizes["block_q_dkv"] = draw(st.sampled_from(q_blocks))
    sizes["block_kv_dkv"] = draw(st.sampled_from(kv_blocks))
    sizes["block_kv_dkv_compute"] = draw(st.sampled_from(S.divisors(sizes["block_kv_dkv"], NUM_LANES)))
    # Drawn either way (the same number of choices keeps the shrinker from preferring the
    # fused backward), dropped when fused: it computes dq in the dkv kernel.
    dq = {"block_q_dq": draw(st.sampled_from(q_blocks)), "block_kv_dq": draw(st.sampled_from(kv_blocks))}
    return tuple(sizes.items()) + (() if fused else tuple(dq.items()))


@st.composite
def splash_cases(draw) -> Case[SplashParams]:
    api, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim = draw(st.sampled_from(SHAPES))
    head_shards, q_seq_shards = draw(st.sampled_from(((1, 1), (2, 1), (1, 2))))
    if q_len // q_seq_shards < NUM_LANES:  # a q shard holds whole q blocks of a lane multiple
        q_seq_shards = 1
    if draw(st.booleans()):  # a different mask per head
        masks = tuple(draw(mask_descriptions(q_len, kv_len)) for _ in range(heads))
    else:
        masks = (draw(mask_descriptions(q_len, kv_len)),) * heads
    segments = draw(st.sampled_from(("none", "packed")))
    fused = draw(st.booleans())
    return Case(FAMILY, SplashParams(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), api=api, heads=heads, kv_heads=kv_heads, q_len=q_len,
        kv_len=kv_len, head_dim=head_dim, v_head_dim=v_head_dim, masks=masks, segments=segments,
        segment_starts=draw(S.segment_layout(min(q_len, kv_len))) if segments != "none" else (),
        soft_cap=draw(st.sampled_from((None, SOFT_CAP))),
        blocks=draw(block_sizes(q_len // q_seq_shards, kv_len, fused)), fused_bwd=fused,
        head_shards=head_shards, q_seq_shards=q_seq_shards, values=draw(st.sampled_from(S.VALUE_KINDS)),
        downcast_smem_data=draw(st.booleans()), mask_value=draw(st.sampled_from((None, MASK_VALUE))),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in "qkv"),
        segment_dtype=draw(st.sampled_from(("int32", "int16"))) if segments != "none" else "int32"),
        draw(S.seeds))


# ---------------------------------------------------------------------- bug classes
# Cached: every bug class of the coverage search asks for them, thousands of times.
@functools.lru_cache(maxsize=64)
def head_masks(p: SplashParams) -> np.ndarray:
    """[H, Q, K] bool: each query head's mask (segments not included)."""
    return _read_only(np.stack([evaluate(d, p.q_len, p.kv_len) for d in p.masks]))


def segment_ids(p: SplashParams) -> tuple[np.ndarray, np.ndarray] | None:
    if p.segments == "none":
        return None
    return (S.segment_ids_from_layout(p.segment_starts, p.q_len),
            S.segment_ids_from_layout(p.segment_starts, p.kv_len))


@functools.lru_cache(maxsize=64)
def visible(p: SplashParams) -> np.ndarray:
    """[H, Q, K] bool: what each query sees (mask and segments)."""
    seen = head_masks(p)
    ids = segment_ids(p)
    return seen if ids is None else _read_only(seen & (ids[0][:, None] == ids[1][None, :]))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def occupancy(mask: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """[..., Q / block_q, K / block_kv]: 0 for an empty block (skipped), 1 partial, 2 full."""
    *lead, q_len, kv_len = mask.shape
    blocks = mask.reshape(*lead, q_len // block_q, block_q, kv_len // block_kv, block_kv)
    return np.where(blocks.all(axis=(-3, -1)), 2, np.where(blocks.any(axis=(-3, -1)), 1, 0))


def pass_blocks(p: SplashParams) -> dict[str, tuple[int, int]]:
    """Each pass's (q block, kv block): the tiles its mask info describes."""
    b = p.block_sizes
    passes = {"fwd": (b["block_q"], b["block_kv"]), "dkv": (b["block_q_dkv"], b["block_kv_dkv"])}
    if not p.fused_bwd:
        passes["dq"] = (b["block_q_dq"], b["block_kv_dq"])
    return passes


def mask_is_computed(p: SplashParams) -> bool:
    """One mask for every head, evaluated in the kernel by its mask_function."""
    return len(set(p.masks)) == 1 and p.masks[0][0] in COMPUTABLE


def computed_mask_past_first_kv_block(p: SplashParams) -> bool:
    """The in-kernel mask is partial in a kv block past the first: its key positions need
    the block's offset (from data_next, as the grid may be shrunk)."""
    mask = head_masks(p)[0]
    return mask_is_computed(p) and all((occupancy(mask, *blocks)[:, 1:] == 1).any()
                                       for blocks in pass_blocks(p).values())


def shrunk_grid(p: SplashParams) -> bool:
    """One mask for all heads whose forward visits, in some q block, a kv block at
    another grid position than its own (the kv grid is shrunk to the visited blocks)."""
    if len(set(p.masks)) != 1:
        return False
    nonempty = occupancy(head_masks(p)[0], *pass_blocks(p)["fwd"]) > 0
    return any(list(np.flatnonzero(row)) != list(range(row.sum())) for row in nonempty)


def skipped_block_between_visited(p: SplashParams) -> bool:
    """Some head's q block visits kv blocks on both sides of an empty one (the
    next-nonzero prefetch must jump over it)."""
    nonempty = occupancy(head_masks(p), *pass_blocks(p)["fwd"]) > 0
    rows = nonempty.reshape(-1, nonempty.shape[-1])
    return any(np.diff(np.flatnonzero(row)).max(initial=1) > 1 for row in rows)


def partial_blocks_loaded(p: SplashParams, *, with_full: bool = False) -> bool:
    """The mask comes from memory (no mask_function) with at least two distinct partial
    forward blocks, one of them repeated (deduplicated: mask_next must pick the right one);
    ``with_full``: and full blocks too, which must ignore whatever partial block is loaded."""
    if mask_is_computed(p):
        return False
    bq, bkv = pass_blocks(p)["fwd"]
    mask = head_masks(p)
    occ = occupancy(mask, bq, bkv)
    h, i, j = np.nonzero(occ == 1)
    tiles = [mask[a, b * bq:(b + 1) * bq, c * bkv:(c + 1) * bkv].tobytes() for a, b, c in zip(h, i, j)]
    distinct = len(set(tiles))
    return distinct >= 2 and distinct < len(tiles) and (not with_full or bool((occ == 2).any()))


def keys_in_several_blocks(p: SplashParams, blocks: tuple[int, int]) -> bool:
    """Some query sees keys in at least two kv blocks of this size (an accumulation
    across blocks: the online softmax's running max, or dq summed over kv blocks)."""
    seen = visible(p)
    per_block = seen.reshape(*seen.shape[:-1], p.kv_len // blocks[1], blocks[1]).any(axis=-1)
    return bool((per_block.sum(axis=-1) >= 2).any())


def fully_masked_rows(p: SplashParams) -> np.ndarray:
    """[H, Q] bool: queries that see no key."""
    return ~visible(p).any(axis=-1)


def fully_masked_row_in_visited_block(p: SplashParams) -> bool:
    """A query that sees no key, in a q block that still visits kv blocks: its garbage row
    is computed next to rows that count."""
    bq, bkv = pass_blocks(p)["fwd"]
    visits = (occupancy(head_masks(p), bq, bkv) > 0).any(axis=-1)  # [H, Q / bq]
    return bool((fully_masked_rows(p) & np.repeat(visits, bq, axis=-1)).any())


def q_block_without_keys(p: SplashParams) -> bool:
    """A whole forward q block visits no kv block (its rows are NaN in splash): nothing of
    it may reach dk or dv."""
    return bool((occupancy(head_masks(p), *pass_blocks(p)["fwd"]) == 0).all(axis=-1).any())


def per_head_masks_within_kv_group(p: SplashParams) -> bool:
    """Query heads that share a kv head see different keys: dk/dv sum heads with
    different block skips."""
    group = p.heads // p.kv_heads
    masks = head_masks(p).reshape(p.kv_heads, group, p.q_len, p.kv_len)
    return bool((masks != masks[:, :1]).any())


def segments_vary_across_tiles(p: SplashParams) -> bool:
    """In every pass some q block holds other segment ids than the first, and some kv block
    other ids than the first: a segment index map that fetches the wrong tile shows."""
    ids = segment_ids(p)
    if ids is None:
        return False
    varies = lambda x, tile: bool((x.reshape(-1, tile) != x.reshape(-1, tile)[0]).any())
    return all(varies(ids[0], bq) and varies(ids[1], bkv) for bq, bkv in pass_blocks(p).values())


def offset_inside_kv(p: SplashParams) -> bool:
    """A causal or local mask with a nonzero offset on q != kv: an offset applied with the
    wrong sign or at the wrong end moves the diagonal."""
    return p.q_len != p.kv_len and any(leaf[0] in ("causal", "local") and leaf[-1] != 0
                                       for d in p.masks for leaf in _leaves(d))


def window_right_side_cuts(p: SplashParams) -> bool:
    """A local window whose right side hides keys some query would otherwise see."""
    return any(leaf[0] == "local" and leaf[2] is not None and leaf[3] + leaf[2] < p.kv_len - 1
               and leaf[2] > 0 for d in p.masks for leaf in _leaves(d))


def chunk_boundary_inside(p: SplashParams) -> bool:
    """A chunked causal mask whose chunk boundary falls inside a kv block."""
    bkv = pass_blocks(p)["fwd"][1]
    return any(leaf[0] == "chunked" and leaf[1] % bkv for d in p.masks for leaf in _leaves(d))


def combined_masks(p: SplashParams) -> bool:
    """An And/Or of two masks that differ (a combination that equals one of its parts
    tests nothing of the combination)."""
    return any(d[0] in ("and", "or") and not np.array_equal(evaluate(d, p.q_len, p.kv_len),
                                                            evaluate(d[1], p.q_len, p.kv_len))
               and not np.array_equal(evaluate(d, p.q_len, p.kv_len), evaluate(d[2], p.q_len, p.kv_len))
               for d in p.masks)


def forward_nan_rows_reach_backward(p: SplashParams) -> bool:
    """Kernel finding (jax 0.12.0.1): a forward q block that visits no kv block outputs NaN
    (0 / 0) with lse = -inf. A larger backward q block that holds those rows and visits kv
    blocks computes exp(qk - lse) = inf and rowsum(dO * O) = NaN for them: dq of those rows
    and, in the dkv pass, dk and dv of every key it visits come out NaN, though the rows'
    cotangent is zero (bottom-right causal with q_len > kv_len, forward q blocks of 128,
    backward ones of 256). A bug class whose deviation jax's kernel declares (the family's
    expectations): out is judged, dq of those rows and dk, dv are not (``_nan_backward``)."""
    nan_rows = _forward_nan_rows(p)
    return any((nan_rows & np.repeat((occupancy(head_masks(p), q_block, kv_block) > 0).any(axis=-1), q_block,
                                     axis=-1)).any()
               for name, (q_block, kv_block) in pass_blocks(p).items() if name != "fwd")


def _forward_nan_rows(p: SplashParams) -> np.ndarray:
    """[H, Q]: the rows of the forward q blocks that visit no kv block."""
    bq, bkv = pass_blocks(p)["fwd"]
    return np.repeat((occupancy(head_masks(p), bq, bkv) == 0).all(axis=-1), bq, axis=-1)


def _nan_backward(case, inputs) -> dict[str, np.ndarray]:
    """Where forward_nan_rows_reach_backward shows: dq of the rows without keys, dk and dv."""
    return {"dq": _forward_nan_rows(case.params)[..., None], "dk": np.bool_(True), "dv": np.bool_(True)}


def _shrunk_grid_occupancies(p: SplashParams) -> list[np.ndarray]:
    """The block occupancy of each pass whose grid make_splash_mha shrinks per q sequence
    shard (the whole q range is one): with one mask for every head, the forward and dq
    passes and the unfused dkv pass; none otherwise."""
    if len(set(p.masks)) != 1:
        return []
    mask = head_masks(p)[0]
    return [occupancy(mask, *blocks) for name, blocks in pass_blocks(p).items() if name != "dkv" or not p.fused_bwd]


def q_seq_shards_without_partial_blocks(p: SplashParams) -> bool:
    """Kernel finding (jax 0.12.0.1): one mask for every head with no partial block at a
    pass's block size (a FullMask), and q_seq_shards > 1: make_splash_mha fails in its mask
    processing (``np.concatenate`` of no mask_next shards: "need at least one array to
    concatenate") when it joins the shards of its shrunk grid (``_shrunk_grid_occupancies``).
    A bug class whose deviation jax's kernel declares (the family's expectations)."""
    return p.q_seq_shards > 1 and any(not (blocks == 1).any() for blocks in _shrunk_grid_occupancies(p))


def q_seq_shard_without_keys(p: SplashParams) -> bool:
    """Kernel finding (jax 0.12.0.1): one mask for every head and a q shard none of whose
    queries sees a key at a pass's block size (bottom-right causal with q_len > kv_len and
    q_seq_shards > 1; with one shard, a mask that hides every key, as the nightly drew:
    causal(-128) & local(32, 16) on 256 x 128): make_splash_mha's mask processing shrinks
    that shard's block mask to nothing and stops at a bare ``assert current_block_mask.size
    > 0``. A bug class whose deviation jax's kernel declares (the family's expectations)."""
    return any((blocks.reshape(p.q_seq_shards, -1) == 0).all(axis=-1).any()
               for blocks in _shrunk_grid_occupancies(p))


def bwd_blocks_differ(p: SplashParams) -> bool:
    """Backward tiles other than the forward's: the backward mask infos are their own."""
    blocks = pass_blocks(p)
    return any(b != blocks["fwd"] for name, b in blocks.items() if name != "fwd")


# ---------------------------------------------------------------------- the spec
class SplashSpec(KernelSpec[SplashParams]):
    name = FAMILY
    params_type = SplashParams
    directions = {"out": ("head", "query", "dim"), "dq": ("head", "query", "dim"), "dk": ("kv_head", "key", "dim"),
                  "dv": ("kv_head", "key", "dim")}
    default_impls = {"builtin": "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel:"
                                "make_splash_mha"}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    # Searched in this order, each class only if no earlier example exercises it: classes
    # whose examples carry many conditions at once come first (fewer, richer examples).
    bug_classes = bugclasses.bug_classes(
        gqa=lambda p: p.api == "mha" and p.heads > p.kv_heads,
        q_len_ne_kv_len=lambda p: p.q_len != p.kv_len,
        offset_inside_kv=offset_inside_kv,
        running_max_across_kv_blocks=lambda p: keys_in_several_blocks(p, pass_blocks(p)["fwd"]),
        computed_mask_past_first_kv_block=computed_mask_past_first_kv_block,
        # k_offset must come from data_next, not from the grid index.
        computed_mask_on_shrunk_grid=lambda p: mask_is_computed(p) and shrunk_grid(p),
        skipped_block_between_visited=skipped_block_between_visited,
        full_and_partial_blocks_loaded=functools.partial(partial_blocks_loaded, with_full=True),
        partial_blocks_loaded=partial_blocks_loaded,
        shrunk_grid=shrunk_grid,
        mqa=lambda p: p.api == "mqa",
        v_head_dim_ne_head_dim=lambda p: p.v_head_dim != p.head_dim,
        # Grouped (h // group), not interleaved (h % kv_heads), query heads per kv head:
        # the two agree while there is one kv head.
        gqa_several_kv_heads=lambda p: p.api == "mha" and 1 < p.kv_heads < p.heads,
        q_block_without_keys=q_block_without_keys,
        combined_masks=combined_masks,
        window_right_side_cuts=window_right_side_cuts,
        per_head_masks_within_kv_group=per_head_masks_within_kv_group,
        chunk_boundary_inside_kv_block=chunk_boundary_inside,
        fully_masked_row_in_visited_block=fully_masked_row_in_visited_block,
        segments_vary_across_tiles=segments_vary_across_tiles,
        q_seq_shards=lambda p: p.q_seq_shards > 1,
        head_shards=lambda p: p.head_shards > 1,
        kv_compute_inner_loops=lambda p: (p.block_sizes["block_kv_compute"] < p.block_sizes["block_kv"]
                                          and p.block_sizes["block_kv_dkv_compute"] < p.block_sizes["block_kv_dkv"]),
        bwd_blocks_differ=bwd_blocks_differ,
        fused_dq_over_kv_blocks=lambda p: p.fused_bwd and keys_in_several_blocks(p, pass_blocks(p)["dkv"]),
        dq_kernel_over_kv_blocks=lambda p: not p.fused_bwd and keys_in_several_blocks(p, pass_blocks(p)["dq"]),
        soft_cap=lambda p: p.soft_cap is not None,
        # Blocks of several lane tiles in every pass, and q, k, v read transposed.
        wide_blocks=lambda p: all(p.block_sizes[f] > NUM_LANES for f in (
            "block_q", "block_kv_compute", "block_q_dkv", "block_kv_dkv_compute")),
        seq_minor_layouts=lambda p: set(p.layouts) == {"SEQ_MINOR"},
        # q and kv segment ids of different lengths, either way round, and narrow ones; on
        # one device, where the probe sees the kernel's call (a sharded one is handed to
        # shard_map), so that their parameters vary in the report too.
        segments_q_longer=lambda p: p.segments != "none" and p.q_len > p.kv_len and p.device_count == 1,
        segments_kv_longer=lambda p: p.segments != "none" and p.kv_len > p.q_len and p.device_count == 1,
        int16_segment_ids=lambda p: p.segment_dtype == "int16" and p.device_count == 1,
        bf16=lambda p: p.dtype == "bfloat16",
        large_logits=lambda p: p.values == "large",
        exact_ties=lambda p: p.values == "ties",
        # bfloat16 over many keys of v far from 0: the P @ V accumulation's precision shows.
        bf16_long_kv_offset_values=lambda p: p.dtype == "bfloat16" and p.kv_len >= 256 and p.values == "offset",
        # jax's kernel's findings (declared below): their cases run like any other.
        forward_nan_rows_reach_backward=bugclasses.Touching(forward_nan_rows_reach_backward, _nan_backward),
        q_seq_shards_without_partial_blocks=q_seq_shards_without_partial_blocks,
        q_seq_shard_without_keys=q_seq_shard_without_keys)
    examples = {"interpret": 4, "interpret-hazards": 2, "tpu-lower": 4, "tpu": 16}
    fixed_parameters = {
        "mask.*": "the mask zoo is the case's data, drawn by the spec's own strategy with a bug class per "
                  "kind; its structure is not a parameter",
        "interpret": "interpret mode comes from the backend (force_tpu_interpret_mode with its hazard "
                     "settings); interpret=True would bypass them",
        "save_residuals": "returns the forward's logsumexp residuals besides the output: not part of the "
                          "convention's output, not judged",
        "residual_checkpoint_name": "a name for jax.checkpoint policies: changes no value"}
    contracts = (Contract("unseeing_rows_undefined", "a query that sees no key is undefined (the mean of v over the "
                          "kv blocks its q block visits, or NaN): its output is don't-care, its cotangent zero, and "
                          "nothing may leak into other rows"),)
    expectations = (
        Shipped("builtin", BUG_CLASS, "forward_nan_rows_reach_backward", "a forward q block that visits no kv block "
                "outputs NaN; a larger backward q block holding those rows makes their dq and the dk, dv of every key "
                "it visits NaN (attncheck finding splash_backward_block_nan)"),
        Shipped("builtin", BUG_CLASS, "q_seq_shards_without_partial_blocks", "one mask for every head with no "
                "partial block and q_seq_shards > 1: make_splash_mha fails in its mask processing (\"need at least "
                "one array to concatenate\"; attncheck finding splash_q_seq_shards_full_mask)"),
        Shipped("builtin", BUG_CLASS, "q_seq_shard_without_keys", "one mask for every head and a q shard that "
                "sees no key (q_seq_shards > 1, or a mask hiding every key): make_splash_mha stops at a bare assertion in its mask processing "
                "(attncheck finding splash_q_seq_shard_without_keys)"),
        Shipped("builtin", INVALID_CALL, "kv_longer_than_mask", "a kernel built for a [H, 256, 256] mask, called with "
                "kv_len 512, returns attention over the first 256 keys (no error, on TPU or in interpret mode; "
                "attncheck finding splash_kv_longer_than_mask)"))

    def cases(self):
        return splash_cases()

    def inputs(self, case: Case[SplashParams]) -> dict[str, np.ndarray]:
        p = case.params
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(p.dtype)
        kv_lead = () if p.api == "mqa" else (p.kv_heads,)
        values = lambda role, shape: S.attention_values(rng, p.values, shape, role=role)
        # Splash has no scale argument: its callers fold 1/sqrt(D) into q.
        out = {"q": S.round_to(values("q", (p.heads, p.q_len, p.head_dim)) * p.head_dim ** -0.5, dt),
               "k": S.round_to(values("k", kv_lead + (p.kv_len, p.head_dim)), dt),
               "v": S.round_to(values("v", kv_lead + (p.kv_len, p.v_head_dim)), dt)}
        # Fully masked rows are don't-care: a caller keeps them out of its loss.
        d_out = values("d_out", (p.heads, p.q_len, p.v_head_dim))
        out["d_out"] = S.round_to(np.where(fully_masked_rows(p)[..., None], 0.0, d_out), dt)
        ids = segment_ids(p)
        if ids is not None:
            out["q_segment_ids"], out["kv_segment_ids"] = (x.astype(p.segment_dtype) for x in ids)
        return out

    # ------------------------------------------------------------------ running
    def _forward(self, impl, p: SplashParams, factory=None, mesh=None):
        """forward(q, k, v, q_segment_ids, kv_segment_ids) with the implementation's kernel
        for the case's masks and blocks, under shard_map when the case is sharded (over
        ``mesh``, default the case's CPU devices). MQA cases build it with
        ``make_splash_mqa`` of the implementation's module (``factory``: a stand-in for that)."""
        module = impl_module(impl)
        factory = factory or (impl if p.api == "mha" else module.make_splash_mqa)
        shape = (p.q_len, p.kv_len)
        mask = module.mask_lib.MultiHeadMask([build(module.mask_lib, d, shape) for d in p.masks])
        layouts = {f"{x}_layout": module.QKVLayout[name] for x, name in zip("qkv", p.layouts)}
        blocks = module.BlockSizes(**p.block_sizes, use_fused_bwd_kernel=p.fused_bwd, **layouts)
        optional = {"mask_value": p.mask_value} if p.mask_value is not None else {}
        kernel = factory(mask, block_sizes=blocks, attn_logits_soft_cap=p.soft_cap, head_shards=p.head_shards,
                         q_seq_shards=p.q_seq_shards, downcast_smem_data=p.downcast_smem_data, **optional)

        def forward(q, k, v, q_seg, kv_seg, kernel=kernel):
            return kernel(q, k, v, None if q_seg is None else module.SegmentIds(q=q_seg, kv=kv_seg))

        if p.device_count == 1:
            return forward
        # Heads or q sequence split over devices, as splash's callers shard it: a device
        # holds its query heads (and their kv heads, unless every head shares one) or its
        # q rows; the kernel's mask info is sharded to match.
        mesh = mesh or Mesh(np.array(jax.devices()[:p.device_count]), ("shards",))
        by_heads = p.head_shards > 1
        rows = P("shards", None, None) if by_heads else P(None, "shards", None)
        kv_sharded = by_heads and p.api == "mha" and p.kv_heads % p.head_shards == 0
        kv = P("shards", None, None) if kv_sharded else P()
        q_ids = P(None) if by_heads else P("shards")
        kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P("shards", None) if by_heads
                                                                 else P(None, "shards")))
        # check_vma=False: the kernel's pallas_call does not declare how its outputs vary.
        sharded = jax.shard_map(forward, mesh=mesh, in_specs=(rows, kv, kv, q_ids, P(None), kernel_spec),
                                out_specs=rows, check_vma=False)
        return lambda q, k, v, q_seg, kv_seg: sharded(q, k, v, q_seg, kv_seg, kernel)

    def parameters(self, impl, case, inputs):
        p = case.params
        if p.api == "mha":
            return super().parameters(impl, case, inputs)
        return parameters.record(lambda probe: self._forward(impl, p, factory=probe)(
            inputs["q"], inputs["k"], inputs["v"], inputs.get("q_segment_ids"), inputs.get("kv_segment_ids")),
            impl_module(impl).make_splash_mqa)

    def evaluate(self, impl, case, inputs):
        p = case.params
        # What forces a new compile: not the values, the seed or the segment layout.
        static = dataclasses.replace(p, values="", segment_starts=())
        fn = compiled((FAMILY, impl_key(impl), static), lambda: with_vjp(self._forward(impl, p)))
        out, (dq, dk, dv) = fn((inputs["q"], inputs["k"], inputs["v"]), inputs["d_out"],
                               inputs.get("q_segment_ids"), inputs.get("kv_segment_ids"))
        return {"out": np.asarray(out), "dq": np.asarray(dq), "dk": _with_head_axis(p, dk),
                "dv": _with_head_axis(p, dv)}

    def lower(self, impl, case):
        p = case.params
        inputs = self.inputs(case)
        # A sharded kernel's shard_map runs over TPUs of the emulated generation, which its
        # Mosaic lowering asks (over the CPU devices it failed: "Unsupported TPU device kind").
        mesh = backends.tpu_mesh(p.device_count, "shards") if p.device_count > 1 else None
        return backends.tpu_exports(self._forward(impl, p, mesh=mesh), (inputs["q"], inputs["k"], inputs["v"]),
                                    inputs["d_out"], inputs.get("q_segment_ids"), inputs.get("kv_segment_ids"),
                                    mesh=mesh)

    # ------------------------------------------------------------------ judging
    @staticmethod
    def _batched(p: SplashParams, inputs):
        """q, k, v, d_out as [1, H, S, D] (MQA: one kv head)."""
        kv = (lambda x: x[None, None]) if p.api == "mqa" else (lambda x: x[None])
        return inputs["q"][None], kv(inputs["k"]), kv(inputs["v"]), inputs["d_out"][None]

    def oracle(self, case, inputs):
        p = case.params
        q, k, v, d_out = self._batched(p, inputs)
        sem = dict(scale=1.0, soft_cap=p.soft_cap, visible=head_masks(p)[None], masked_rows="zero",
                   q_segment_ids=inputs.get("q_segment_ids"), kv_segment_ids=inputs.get("kv_segment_ids"))
        grads = oracle.attention_vjp(q, k, v, d_out, **sem)
        return {"out": oracle.attention(q, k, v, **sem).out[0], "dq": grads["dq"][0], "dk": grads["dk"][0],
                "dv": grads["dv"][0]}

    def yardstick(self, case, inputs):
        p = case.params
        ids = [None if n not in inputs else inputs[n][None] for n in ("q_segment_ids", "kv_segment_ids")]
        seen = yardstick.visibility(np.arange(p.q_len), np.arange(p.kv_len), causal=False, q_segment_ids=ids[0],
                                    kv_segment_ids=ids[1], mask=head_masks(p)[None])
        result = yardstick.attention_with_grads(*self._batched(p, inputs), scale=1.0, visible=seen,
                                                soft_cap=p.soft_cap, masked_rows="zero")
        return {d: result[d][0] for d in ("out", "dq", "dk", "dv")}

    def care(self, case, inputs):
        # Fully masked rows are undefined in splash (block-structure dependent, NaN in a q
        # block without keys); their gradients are not (zero cotangent): dq is judged.
        return {"out": ~fully_masked_rows(case.params)[..., None]}

    def invalid_calls(self, impl):
        return invalid_splash_calls(impl)


def _with_head_axis(p: SplashParams, grad) -> np.ndarray:
    """MQA's dk/dv [K, D] as [1, K, D], the layout of every other case."""
    grad = np.asarray(grad)
    return grad[None] if p.api == "mqa" else grad


def invalid_splash_calls(impl) -> list[InvalidCall]:
    module = impl_module(impl)
    mask_lib = module.mask_lib
    h, s, d = 2, 256, 128
    x = jnp.zeros((h, s, d), jnp.float32)
    causal = mask_lib.MultiHeadMask([mask_lib.CausalMask((s, s))] * h)
    full = dict(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
                block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)

    def make(mask=causal, **changes):
        # Built inside the call: constructors that validate must raise under pytest.raises.
        return impl(mask, block_sizes=module.BlockSizes(**{**full, **changes}), head_shards=1, q_seq_shards=1)

    def call(*args, mask=causal, **changes):
        return make(mask, **changes)(*args)

    def grad(**changes):
        kernel = make(**changes)
        return jax.grad(lambda q: kernel(q, x, x).sum())(x)

    return [
        InvalidCall("fused_with_dq_blocks", lambda: module.BlockSizes(block_q=128, block_kv=128,
                                                                      use_fused_bwd_kernel=True, block_q_dq=128),
                    ValueError, r"dq"),
        InvalidCall("block_kv_not_multiple_of_compute", lambda: call(x, x, x, block_kv=256, block_kv_compute=192),
                    ValueError, r"bkv_compute"),
        InvalidCall("block_kv_compute_not_lane_multiple", lambda: call(x, x, x, block_kv_compute=64), ValueError,
                    r"bkv_compute=64"),
        InvalidCall("block_q_not_dividing", lambda: make(block_q=96), ValueError, r"q_block_size"),
        InvalidCall("block_kv_not_dividing", lambda: make(block_kv=96, block_kv_compute=96), ValueError,
                    r"kv_block_size"),
        InvalidCall("block_kv_dq_not_lane_multiple", lambda: grad(block_kv_dq=64), ValueError, r"bkv=64"),
        InvalidCall("block_kv_dkv_compute_above_block", lambda: grad(block_kv_dkv_compute=256), ValueError,
                    r"bkv_compute=256"),
        InvalidCall("no_backward_blocks", lambda: jax.grad(lambda q: impl(
            causal, block_sizes=module.BlockSizes(128, 128), head_shards=1, q_seq_shards=1)(q, x, x).sum())(x),
                    ValueError, r"backward blocks"),
        InvalidCall("mask_2d", lambda: make(mask_lib.CausalMask((s, s))), ValueError, r"mask shape"),
        InvalidCall("mask_not_bool", lambda: make(np.ones((h, s, s), np.int32)), ValueError, r"(?i)mask.*bool"),
        InvalidCall("head_mask_shapes_differ", lambda: mask_lib.MultiHeadMask(
            [mask_lib.CausalMask((s, s)), mask_lib.CausalMask((s, 2 * s))]), ValueError, r"mask shape"),
        InvalidCall("multi_head_mask_nested", lambda: mask_lib.MultiHeadMask([causal]), ValueError,
                    r"MultiHeadMask"),
        InvalidCall("combined_mask_shapes_differ", lambda: mask_lib.CausalMask((s, s)) & mask_lib.FullMask((s, 2 * s)),
                    ValueError, r"shape"),
        InvalidCall("chunk_size_zero", lambda: mask_lib.ChunkedCausalMask((s, s), chunk_size=0), ValueError,
                    r"chunk_size"),
        InvalidCall("head_shards_not_dividing", lambda: impl(causal, block_sizes=module.BlockSizes(**full),
                                                             head_shards=3, q_seq_shards=1), ValueError,
                    r"head_shards"),
        InvalidCall("q_seq_shards_not_dividing", lambda: impl(causal, block_sizes=module.BlockSizes(**full),
                                                              head_shards=1, q_seq_shards=3), ValueError,
                    r"q_seq_shards"),
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


SPEC = SplashSpec()
