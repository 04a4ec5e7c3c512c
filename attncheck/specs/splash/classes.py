"""Splash's bug classes: where a case's masks fall on the kernel's blocks (each pass's block
occupancy: empty, partial, full), the rows that see no key, and the classes read from them
(like jax's splash_attention_mask_info, from the NumPy meaning of the masks); the pairs
crossed, the contracts and the shipped expectations."""

from __future__ import annotations

import functools

import numpy as np

from attncheck import bugclasses
from attncheck import strategies as S
from attncheck.expectations import BUG_CLASS, INVALID_CALL, Contract, Shipped
from attncheck.specs.base import FLOAT32_ACCUMULATION, values_by_dtype
from attncheck.specs.splash.masks import COMPUTABLE, evaluate, leaves, read_only
from attncheck.specs.splash.params import NUM_LANES, SplashParams


# Cached: every bug class of the coverage search asks for them, over and over.
@functools.lru_cache(maxsize=64)
def head_masks(p: SplashParams) -> np.ndarray:
    """[H, Q, K] bool: each query head's mask (segments not included)."""
    return read_only(np.stack([evaluate(d, p.q_len, p.kv_len) for d in p.masks]))


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
    return seen if ids is None else read_only(seen & (ids[0][:, None] == ids[1][None, :]))



def occupancy(mask: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """[..., Q / block_q, K / block_kv]: 0 for an empty block (skipped), 1 partial, 2 full."""
    *lead, q_len, kv_len = mask.shape
    blocks = mask.reshape(*lead, q_len // block_q, block_q, kv_len // block_kv, block_kv)
    return np.where(blocks.all(axis=(-3, -1)), 2, np.where(blocks.any(axis=(-3, -1)), 1, 0))


def pass_blocks(p: SplashParams) -> dict[str, tuple[int, int]]:
    """Each pass's (q block, kv block): the tiles its mask info describes."""
    b = p.blocks
    passes = {"fwd": (b.block_q, b.block_kv), "dkv": (b.block_q_dkv, b.block_kv_dkv)}
    if not p.fused_bwd:
        passes["dq"] = (b.block_q_dq, b.block_kv_dq)
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

    def varies(x, tile):
        return bool((x.reshape(-1, tile) != x.reshape(-1, tile)[0]).any())

    return all(varies(ids[0], bq) and varies(ids[1], bkv) for bq, bkv in pass_blocks(p).values())


def offset_inside_kv(p: SplashParams) -> bool:
    """A causal or local mask with a nonzero offset on q != kv: an offset applied with the
    wrong sign or at the wrong end moves the diagonal."""
    return p.q_len != p.kv_len and any(leaf[0] in ("causal", "local") and leaf[-1] != 0
                                       for d in p.masks for leaf in leaves(d))


def window_right_side_cuts(p: SplashParams) -> bool:
    """A local window whose right side hides keys some query would otherwise see."""
    return any(leaf[0] == "local" and leaf[2] is not None and leaf[3] + leaf[2] < p.kv_len - 1
               and leaf[2] > 0 for d in p.masks for leaf in leaves(d))


def chunk_boundary_inside(p: SplashParams) -> bool:
    """A chunked causal mask whose chunk boundary falls inside a kv block."""
    bkv = pass_blocks(p)["fwd"][1]
    return any(leaf[0] == "chunked" and leaf[1] % bkv for d in p.masks for leaf in leaves(d))


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
    expectations): out is judged, dq of those rows and dk, dv are not (``nan_backward``)."""
    nan_rows = _forward_nan_rows(p)
    return any((nan_rows & np.repeat((occupancy(head_masks(p), q_block, kv_block) > 0).any(axis=-1), q_block,
                                     axis=-1)).any()
               for name, (q_block, kv_block) in pass_blocks(p).items() if name != "fwd")


def _forward_nan_rows(p: SplashParams) -> np.ndarray:
    """[H, Q]: the rows of the forward q blocks that visit no kv block."""
    bq, bkv = pass_blocks(p)["fwd"]
    return np.repeat((occupancy(head_masks(p), bq, bkv) == 0).all(axis=-1), bq, axis=-1)


def nan_backward(case, inputs) -> dict[str, np.ndarray]:
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


# The partitions crossed pairwise: the forward's kv blocks, the backward's kernels, the
# heads against the kv heads, and how the call is sharded: a head or q-sequence shard's
# offsets meet each.
KV_BLOCKS = bugclasses.partition("kv_blocks", one=lambda p: p.blocks.block_kv >= p.kv_len,
                                 several=lambda p: p.blocks.block_kv < p.kv_len)
HEADS = bugclasses.partition("heads", mha=lambda p: p.api == "mha" and p.kv_heads == p.heads,
                             gqa=lambda p: p.api == "mha" and p.kv_heads < p.heads, mqa=lambda p: p.api == "mqa")
SHARDS = bugclasses.partition("shards", none=lambda p: p.device_count == 1, heads=lambda p: p.head_shards > 1,
                              q_seq=lambda p: p.q_seq_shards > 1)
PAIRS = bugclasses.pairwise(
    KV_BLOCKS,
    bugclasses.partition("backward", fused=lambda p: p.fused_bwd, dq_kernel=lambda p: not p.fused_bwd),
    HEADS, SHARDS)

# Searched in this order, each class only if no earlier example exercises it: classes whose
# examples carry many conditions at once come first (fewer, richer examples).
CLASSES = dict(
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
    kv_compute_inner_loops=lambda p: (p.blocks.block_kv_compute < p.blocks.block_kv
                                      and p.blocks.block_kv_dkv_compute < p.blocks.block_kv_dkv),
    bwd_blocks_differ=bwd_blocks_differ,
    fused_dq_over_kv_blocks=lambda p: p.fused_bwd and keys_in_several_blocks(p, pass_blocks(p)["dkv"]),
    dq_kernel_over_kv_blocks=lambda p: not p.fused_bwd and keys_in_several_blocks(p, pass_blocks(p)["dq"]),
    soft_cap=lambda p: p.soft_cap is not None,
    # Blocks of several lane tiles in every pass, and q, k, v read transposed.
    wide_blocks=lambda p: all(getattr(p.blocks, f) > NUM_LANES for f in (
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
    forward_nan_rows_reach_backward=bugclasses.Touching(forward_nan_rows_reach_backward, nan_backward),
    q_seq_shards_without_partial_blocks=q_seq_shards_without_partial_blocks,
    q_seq_shard_without_keys=q_seq_shard_without_keys,
)
BUG_CLASSES = (bugclasses.bug_classes(**CLASSES) + bugclasses.numbers("soft_cap", lambda p: p.soft_cap, (
    "in (0, 1)", "one", "above 1")).classes + PAIRS + values_by_dtype() + bugclasses.presences(
    segment_ids=lambda p: p.segments != "none", attn_logits_soft_cap=lambda p: p.soft_cap is not None))
CONTRACTS = (FLOAT32_ACCUMULATION,
             Contract("unseeing_rows_undefined", "a query that sees no key is undefined (the mean of v over the "
                      "kv blocks its q block visits, or NaN): its output is don't-care, its cotangent zero, and "
                      "nothing may leak into other rows"),)
EXPECTATIONS = (
    Shipped("builtin", BUG_CLASS, "forward_nan_rows_reach_backward", "a forward q block that visits no kv block "
            "outputs NaN; a larger backward q block holding those rows makes their dq and the dk, dv of every key "
            "it visits NaN (attncheck finding splash_backward_block_nan)"),
    Shipped("builtin", BUG_CLASS, "q_seq_shards_without_partial_blocks", "one mask for every head with no "
            "partial block and q_seq_shards > 1: make_splash_mha fails in its mask processing (\"need at least "
            "one array to concatenate\"; attncheck finding splash_q_seq_shards_full_mask)"),
    Shipped("builtin", BUG_CLASS, "q_seq_shard_without_keys", "one mask for every head and a q shard that "
            "sees no key (q_seq_shards > 1, or a mask hiding every key): make_splash_mha stops at a bare "
            "assertion in its mask processing (attncheck finding splash_q_seq_shard_without_keys)"),
    Shipped("builtin", INVALID_CALL, "kv_longer_than_mask", "a kernel built for a [H, 256, 256] mask, called with "
            "kv_len 512, returns attention over the first 256 keys (no error, on TPU or in interpret mode; "
            "attncheck finding splash_kv_longer_than_mask)"))
