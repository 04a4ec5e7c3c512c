"""Flash attention's bug classes: the predicates behind them, the pairs crossed, the contracts."""

from __future__ import annotations

import numpy as np

from attncheck import bugclasses, parameters
from attncheck import strategies as S
from attncheck.expectations import Contract
from attncheck.specs.base import FLOAT32_ACCUMULATION, values_by_dtype
from attncheck.specs.flash.params import ABSENT_SEGMENT, NEG_INF_KINDS, NUM_LANES, VALUE_KINDS, FlashParams


# The kernels' two-level tilings (axis -> length, major block, minor block). A
# causal position is major offset + minor offset; each such sum is exercised under causal
# masking only when there are several major blocks *and* several minor blocks in each, and
# the diagonal crosses a minor block after the first of a major block after the first
# (a minor block the diagonal never reaches is skipped whole, or wholly visible, whatever
# offset the mask adds).
NESTED_TILINGS = ("fwd_kv", "dkv_q", "dkv_kv", "dq_kv")


def nested_tilings(p: FlashParams) -> list[str]:
    blocks = p.blocks
    q_len, kv_len = p.q_len, p.kv_len
    levels = {"fwd_kv": (kv_len, blocks.block_k_major, blocks.block_k),
              "dkv_q": (q_len, blocks.block_q_major_dkv, blocks.block_q_dkv),
              "dkv_kv": (kv_len, blocks.block_k_major_dkv, blocks.block_k_dkv),
              "dq_kv": (kv_len, blocks.block_k_major_dq, blocks.block_k_dq)}
    return [axis for axis in NESTED_TILINGS
            if levels[axis][0] > levels[axis][1] > levels[axis][2]
            and min(q_len, kv_len) > levels[axis][1] + levels[axis][2]]


def pass_tiles(p: FlashParams) -> tuple[tuple[int, int], ...]:
    """Each pass's (q tile, kv block) as its grid fetches them: fwd, dkv, dq."""
    blocks = p.blocks
    return ((blocks.block_q, blocks.block_k_major), (blocks.block_q_major_dkv, blocks.block_k_major_dkv),
            (blocks.block_q_dq, blocks.block_k_major_dq))


# Each pass's (q tile, kv tile) sizes. Under causal masking a q tile wider than a kv tile
# holds rows that see nothing of a kv tile its later rows see: the block skip must test
# the tile's last query, and the online softmax must carry a row that is fully masked in a
# later tile. With square tiles no row is ever fully masked inside a visible tile. One
# class asks it of every pass at once: a bug in any one pass shows in that case, and one
# coverage example costs a third of three.
def logit_tiles(p: FlashParams) -> tuple[tuple[int, int], ...]:
    """Each pass's (q tile, kv tile) of the logits it computes: fwd, dkv, dq."""
    blocks = p.blocks
    return ((blocks.block_q, blocks.block_k), (blocks.block_q_dkv, blocks.block_k_dkv),
            (blocks.block_q_dq, blocks.block_k_dq))


def q_tiles_wider_than_kv_tiles(p: FlashParams) -> bool:
    return all(q_tile > kv_tile and p.kv_len > kv_tile for q_tile, kv_tile in logit_tiles(p))


def sees_every_key(p: FlashParams) -> bool:
    """Every row sees every key (no causal mask, segment or -inf bias hides one)."""
    return not p.causal and p.segments == "none" and not (p.bias and p.bias_values != "normal")


def sees_sink(p: FlashParams) -> bool:
    """Every row sees key 0 and every key after it, at the default scale, the one the
    sink's margins are drawn for."""
    return sees_every_key(p) and S.sink_scale(p.sm_scale, p.head_dim)


def causal_skips_in_every_pass(p: FlashParams) -> bool:
    """Some (q tile, kv block) step lies wholly above the diagonal in each pass: the
    kernel skips it, and every operand and output index map must agree with the skip
    (a bias or d_ab map that follows the clamped kv index reads or writes a real block)."""
    # Top-left causal: the likeliest skip is the first q tile (last query q_tile - 1)
    # against the last kv block (first key kv_len - kv_block).
    return p.causal and all(p.kv_len - kv_block > q_tile - 1 for q_tile, kv_block in pass_tiles(p))


def _varies_across_tiles(ids: np.ndarray, tile: int) -> bool:
    tiles = ids.reshape(-1, tile)
    return bool((tiles != tiles[0]).any())


def causal_absent_rows_skip_blocks(p: FlashParams) -> bool:
    """Some query of the absent segment (the last segment) has a whole kv block of some pass
    above its diagonal: the block skip must not change what the row falls back on."""
    if not (p.causal and p.segments == "absent"):
        return False
    first_absent = p.segment_starts[-1]
    return any(p.kv_len - kv_block > first_absent for _, kv_block in pass_tiles(p))


def segments_vary_across_tiles(p: FlashParams) -> bool:
    """In every pass, some q tile holds other segment ids than the first q tile, and some
    kv block other ids than the first kv block: a segment-id index map that fetches the
    wrong tile changes the mask only then."""
    if p.segments != "packed":
        return False
    q_ids, kv_ids = segment_ids(p)
    return all(_varies_across_tiles(q_ids, q_tile) and _varies_across_tiles(kv_ids, kv_block)
               for q_tile, kv_block in pass_tiles(p))


def segment_ids(p: FlashParams) -> tuple[np.ndarray, np.ndarray] | None:
    """(q ids [Q], kv ids [K]) of the case's layout; None without segment ids."""
    if p.segments == "none":
        return None
    q_ids = S.segment_ids_from_layout(p.segment_starts, p.q_len)
    kv_ids = S.segment_ids_from_layout(p.segment_starts, p.kv_len)
    if p.segments == "absent":
        q_ids = np.where(q_ids == q_ids.max(), ABSENT_SEGMENT, q_ids)
    return q_ids, kv_ids


def emptied_row_keys(p: FlashParams) -> tuple[np.ndarray, np.ndarray] | None:
    """The emptied row's (causally visible, of its own segment) [K]: its ab is -inf at every
    key of its own segment; None when the case empties no row."""
    if not (p.bias and p.bias_values == "neg_inf_row"):
        return None
    causal = np.arange(p.kv_len) <= p.emptied_row if p.causal else np.ones(p.kv_len, bool)
    ids = segment_ids(p)
    return causal, np.ones(p.kv_len, bool) if ids is None else ids[1] == ids[0][p.emptied_row]


def emptied_row(p: FlashParams, *, falls_back: bool) -> bool:
    """The case's -inf ab hides every key of a row's own segment it sees, and the row falls
    back on other segments' keys (``falls_back``) or sees none at all (0, no gradient)."""
    keys = emptied_row_keys(p)
    if keys is None:
        return False
    causal, same = keys
    return bool((causal & same).any()) and bool((causal & ~same).any()) == falls_back


def causal_fallback_fetches_hidden_keys(p: FlashParams) -> bool:
    """The emptied row falls back under causal masking, and its forward q tile fetches a kv
    block holding keys of other segments that are causally hidden from it (its own ones
    carry -inf): a fallback that averages the masked keys a block holds, instead of those
    the row may see, shows only then."""
    if not (p.causal and emptied_row(p, falls_back=True)):
        return False
    causal, same = emptied_row_keys(p)
    block_q, block_k = p.blocks.block_q, p.blocks.block_k_major
    last_query = (p.emptied_row // block_q + 1) * block_q - 1
    fetched = np.arange(p.kv_len) < (last_query // block_k + 1) * block_k
    return bool((fetched & ~causal & ~same).any())


def _backward_blocks(p: FlashParams) -> tuple[int, int]:
    """The backward passes' major blocks against the forward's, both axes: (how many are
    wider, how many narrower)."""
    b = p.blocks
    pairs = [(b.block_q_major_dkv, b.block_q), (b.block_q_dq, b.block_q),
             (b.block_k_major_dkv, b.block_k_major), (b.block_k_major_dq, b.block_k_major)]
    return sum(bwd > fwd for bwd, fwd in pairs), sum(bwd < fwd for bwd, fwd in pairs)


# Crossed pairwise: causal masking and each axis's tiling, where block skipping, offsets and
# the backward's own tiles meet.
PAIRS = bugclasses.pairwise(
    bugclasses.partition("causal", on=lambda p: p.causal, off=lambda p: not p.causal),
    bugclasses.partition("q_blocks", one=lambda p: p.blocks.block_q == p.q_len,
                         several=lambda p: p.blocks.block_q < p.q_len),
    bugclasses.partition("kv_blocks", one=lambda p: p.blocks.block_k_major == p.kv_len,
                         several=lambda p: p.blocks.block_k_major < p.kv_len),
    bugclasses.partition("backward_blocks", as_forward=lambda p: _backward_blocks(p) == (0, 0),
                         wider=lambda p: _backward_blocks(p)[0] > 0, narrower=lambda p: _backward_blocks(p)[1] > 0))

BUG_CLASSES = bugclasses.bug_classes(
    q_len_ne_kv_len=lambda p: p.q_len != p.kv_len,
    causal=lambda p: p.causal,
    fully_masked_row=lambda p: p.segments == "absent",
    block_boundary_straddle=lambda p: p.segments != "none" and any(s % NUM_LANES for s in p.segment_starts[1:]),
    multi_block_kv=lambda p: p.blocks.block_k_major != p.kv_len,
    single_step_kv=lambda p: p.blocks.block_k_major == p.kv_len,
    k_major_gt_k=lambda p: p.blocks.block_k_major > p.blocks.block_k,
    bias=lambda p: p.bias,
    large_logits=lambda p: p.values == "large",
    exact_ties=lambda p: p.values == "ties",
    bf16=lambda p: p.dtype == "bfloat16",
    segments_vary_across_tiles=segments_vary_across_tiles,
    causal_wide_q=lambda p: p.causal and q_tiles_wider_than_kv_tiles(p),
    causal_bias_skipped_blocks=lambda p: p.bias and causal_skips_in_every_pass(p),
    # Declared before the per-pass classes, so that the coverage search's one example of
    # every tiling nested at once also covers each of them: one 512-long case, not four.
    causal_nested_every_pass=lambda p: p.causal and len(nested_tilings(p)) == len(NESTED_TILINGS),
    **{f"causal_nested_{a}": (lambda p, a=a: p.causal and a in nested_tilings(p)) for a in NESTED_TILINGS},
    # The contracts of the kernel's docstring, each where it can be observed.
    causal_absent_rows_skip_blocks=causal_absent_rows_skip_blocks,
    bias_neg_inf=lambda p: p.bias and p.bias_values in NEG_INF_KINDS,
    # A -inf ab entry must hide its key whatever the scale's sign (times -0.5 it is the
    # largest logit, times 0 a NaN).
    bias_neg_inf_nonpositive_scale=lambda p: p.bias and p.bias_values in NEG_INF_KINDS and p.sm_scale <= 0,
    # A row whose -inf ab hides every key it would see: 0 with zero gradient when no
    # other segment's key is visible to it, else the fallback of an absent segment's row.
    bias_neg_inf_row_empty=lambda p: emptied_row(p, falls_back=False),
    bias_neg_inf_row_falls_back=lambda p: emptied_row(p, falls_back=True),
    causal_neg_inf_row_falls_back=causal_fallback_fetches_hidden_keys,
    bias_nonfinite_where_masked=lambda p: p.bias and p.bias_values == "nonfinite_masked" and p.causal,
    block_b_gt_1=lambda p: p.blocks.block_b > 1,
    # A backward pass whose q or kv blocks are wider than the forward's, under causal
    # masking over several kv blocks: its skipping and offsets are its own.
    causal_bwd_blocks_wider=lambda p: p.causal and p.blocks.block_k_major < p.kv_len and (
        max(p.blocks.block_q_major_dkv, p.blocks.block_q_dq) > p.blocks.block_q
        or max(p.blocks.block_k_major_dkv, p.blocks.block_k_major_dq)
        > p.blocks.block_k_major),
    # bfloat16 over many kv blocks of v whose offset cancels in every row: where a running
    # accumulator narrower than float32 shows (the convention accumulates in float32).
    long_reduction_offset_values=lambda p: (p.dtype == "bfloat16" and p.values == "offset" and sees_every_key(p)
                                            and S.spread_weights(p.sm_scale, p.head_dim)
                                            and p.kv_len // p.blocks.block_k >= S.CANCELLING_KV_BLOCKS),
    # bfloat16 over many kv blocks after a sink every row sees, at the scale its margins are
    # drawn for: where a running softmax denominator narrower than float32 shows.
    long_reduction_sink=lambda p: (p.dtype == "bfloat16" and p.values == S.SINK and sees_sink(p)
                                   and p.kv_len // p.blocks.block_k >= S.SINK_KV_BLOCKS),
    # float32 logits over a head dim of 256, recomputed by a backward in other tiles than
    # the forward's: XLA's CPU dot rounds them otherwise there (not at 64 or 128), so the
    # backward's P is not normalised by its own logits, and a yardstick that misses it fails
    # a correct kernel.
    f32_wide_head_retiled_backward=lambda p: (p.dtype == "float32" and p.head_dim == 256
                                              and len(set(logit_tiles(p))) > 1),
) + (bugclasses.numbers("sm_scale", lambda p: p.sm_scale, parameters.NUMBER_CELLS).classes + PAIRS
     + values_by_dtype(VALUE_KINDS)
     + bugclasses.presences(ab=lambda p: p.bias, segment_ids=lambda p: p.segments != "none"))


CONTRACTS = (FLOAT32_ACCUMULATION,
    Contract("absent_segment_rows", "a row that sees no key of its own segment averages v uniformly over the "
             "causally visible keys of the other segments, with the softmax gradient at those weights, causal "
             "included (the kernel's docstring)"),
    Contract("nonfinite_bias", "a -inf ab entry takes no part; a row whose visible ab is all -inf is 0 with zero "
             "gradient; NaN or +inf in ab where the mask hides the key changes nothing (the kernel's docstring)"))
