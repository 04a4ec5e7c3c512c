"""Flash attention's KernelSpec (one module until it is split into roles)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from attncheck import backends, bugclasses, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.compiled import compiled, impl_key, impl_module, with_vjp
from attncheck.expectations import Contract
from attncheck.layouts import ErrorMapLayout, every
from attncheck.specs.base import (ATTENTION_AXES, BIAS_AXES, FLOAT32_ACCUMULATION, InvalidCall, KernelSpec,
                                  accepted_keywords, values_by_dtype)

FAMILY = "flash_attention"
# What the ab entries hold besides normal values: -inf at some keys, every row keeping a
# visible key ("neg_inf"); the same and one row whose own segment's keys are all -inf
# ("neg_inf_row", the row ``emptied_row``); or NaN and +inf where the mask hides the key. A
# kernel may handle scattered -inf entries and still fail a row they empty: the cells keep
# the two apart, so a class can name each.
BIAS_VALUE_KINDS = ("normal", "neg_inf", "neg_inf_row", "nonfinite_masked")
# The running sums of the forward hold a sink's weight across kv blocks (strategies.SINK).
VALUE_KINDS = (*S.VALUE_KINDS, S.SINK)
NEG_INF_KINDS = ("neg_inf", "neg_inf_row")
SEGMENT_DTYPES = ("int32", "int16")
# None: the kernel's default; interpret mode has no VMEM, tpu-lower passes it to Mosaic.
VMEM_LIMITS = (None, 64 * 1024 * 1024)
# Besides 1/sqrt(head_dim): the scale's every cell (a mask value multiplied by a negative or
# zero scale stops hiding keys), 1 (a multiply a kernel may skip) and one that rounds.
SM_SCALES = (1.0, 1.7, 0.0, -0.5)
SEQ_LENS = S.Shapes(ci=(128, 256, 384, 512), nightly=tuple(range(128, 1025, 128)))
# Key lengths of a long reduction (kv only: the reduction is over keys). Drawn in the nightly
# only: among the CI draws 2048 keys doubled the interpreted flash cases' time (26 s to 57
# s); the CI profile has its class's explicit example.
LONG_KV_LENS = S.Shapes(ci=(), nightly=(2 * S.LONG_REDUCTION, 4 * S.LONG_REDUCTION))
HEAD_DIMS = S.Shapes(ci=(64, 128), nightly=(64, 128, 256))
# batch * heads <= 2 keeps CI's interpret-mode grids small; both axes still vary.
BATCH_HEADS = S.Shapes(ci=((1, 1), (2, 1), (1, 2)), nightly=((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 3)))
NUM_LANES = 128  # kv-side blocks are lane-dimension tiles
# A query segment id that never occurs in kv: its rows are fully masked.
ABSENT_SEGMENT = 1000
BLOCK_FIELDS = ("block_q", "block_k_major", "block_k", "block_b", "block_q_major_dkv",
                "block_k_major_dkv", "block_k_dkv", "block_q_dkv", "block_k_major_dq",
                "block_k_dq", "block_q_dq")


@st.composite
def block_sizes(draw, q_len: int, kv_len: int, batch: int) -> tuple[tuple[str, int], ...]:
    """Valid block sizes for the shape; several per shape, k_major > k reachable, a
    forward tile over several batch elements reachable."""
    q_blocks = S.divisors(q_len, NUM_LANES)
    k_majors = S.divisors(kv_len, NUM_LANES)
    block_q = draw(st.sampled_from(q_blocks))
    k_major = draw(st.sampled_from(k_majors))
    block_k = draw(st.sampled_from(S.divisors(k_major, NUM_LANES)))
    q_major_dkv = draw(st.sampled_from(q_blocks))
    k_major_dkv = draw(st.sampled_from(k_majors))
    k_major_dq = draw(st.sampled_from(k_majors))
    return (("block_q", block_q), ("block_k_major", k_major), ("block_k", block_k),
            ("block_b", draw(st.sampled_from(S.divisors(batch, 1)))),
            ("block_q_major_dkv", q_major_dkv), ("block_k_major_dkv", k_major_dkv),
            ("block_k_dkv", draw(st.sampled_from(S.divisors(k_major_dkv, NUM_LANES)))),
            ("block_q_dkv", draw(st.sampled_from(S.divisors(q_major_dkv, NUM_LANES)))),
            ("block_k_major_dq", k_major_dq), ("block_k_dq", draw(st.sampled_from(S.divisors(k_major_dq, NUM_LANES)))),
            ("block_q_dq", draw(st.sampled_from(q_blocks))))


@dataclasses.dataclass(frozen=True)
class FlashParams(Params):
    dtype: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool
    sm_scale: float
    bias: bool
    segments: str  # "none", "packed", or "absent" (a query segment missing from kv)
    segment_starts: tuple[int, ...]
    values: str  # a VALUE_KINDS distribution
    blocks: tuple[tuple[str, int], ...]  # BlockSizes fields as (name, value) pairs
    bias_values: str = "normal"  # a BIAS_VALUE_KINDS pattern of the ab entries
    emptied_row: int | None = None  # the query row "neg_inf_row" empties (None for the other kinds)
    segment_dtype: str = "int32"
    vmem_limit_bytes: int | None = None

    @property
    def sequence_length(self) -> int:
        return self.kv_len

    @property
    def block_sizes(self) -> dict[str, int]:
        return dict(self.blocks)


# The kernels' two-level tilings (axis -> length, major block, minor block). A
# causal position is major offset + minor offset; each such sum is exercised under causal
# masking only when there are several major blocks *and* several minor blocks in each, and
# the diagonal crosses a minor block after the first of a major block after the first
# (a minor block the diagonal never reaches is skipped whole, or wholly visible, whatever
# offset the mask adds).
NESTED_TILINGS = ("fwd_kv", "dkv_q", "dkv_kv", "dq_kv")


def nested_tilings(p: FlashParams) -> list[str]:
    blocks = p.block_sizes
    q_len, kv_len = p.q_len, p.kv_len
    levels = {"fwd_kv": (kv_len, blocks["block_k_major"], blocks["block_k"]),
              "dkv_q": (q_len, blocks["block_q_major_dkv"], blocks["block_q_dkv"]),
              "dkv_kv": (kv_len, blocks["block_k_major_dkv"], blocks["block_k_dkv"]),
              "dq_kv": (kv_len, blocks["block_k_major_dq"], blocks["block_k_dq"])}
    return [axis for axis in NESTED_TILINGS
            if levels[axis][0] > levels[axis][1] > levels[axis][2]
            and min(q_len, kv_len) > levels[axis][1] + levels[axis][2]]


def pass_tiles(p: FlashParams) -> tuple[tuple[int, int], ...]:
    """Each pass's (q tile, kv block) as its grid fetches them: fwd, dkv, dq."""
    blocks = p.block_sizes
    return ((blocks["block_q"], blocks["block_k_major"]), (blocks["block_q_major_dkv"], blocks["block_k_major_dkv"]),
            (blocks["block_q_dq"], blocks["block_k_major_dq"]))


# Each pass's (q tile, kv tile) sizes. Under causal masking a q tile wider than a kv tile
# holds rows that see nothing of a kv tile its later rows see: the block skip must test
# the tile's last query, and the online softmax must carry a row that is fully masked in a
# later tile. With square tiles no row is ever fully masked inside a visible tile. One
# class asks it of every pass at once: a bug in any one pass shows in that case, and one
# coverage example costs a third of three.
def logit_tiles(p: FlashParams) -> tuple[tuple[int, int], ...]:
    """Each pass's (q tile, kv tile) of the logits it computes: fwd, dkv, dq."""
    blocks = p.block_sizes
    return ((blocks["block_q"], blocks["block_k"]), (blocks["block_q_dkv"], blocks["block_k_dkv"]),
            (blocks["block_q_dq"], blocks["block_k_dq"]))


def q_tiles_wider_than_kv_tiles(p: FlashParams) -> bool:
    return all(q_tile > kv_tile and p.kv_len > kv_tile for q_tile, kv_tile in logit_tiles(p))


def sees_every_key(p: FlashParams) -> bool:
    """Every row sees every key (no causal mask, segment or -inf bias hides one)."""
    return not p.causal and p.segments == "none" and not (p.bias and p.bias_values != "normal")


def sees_sink(p: FlashParams) -> bool:
    """Every row sees key 0 and every key after it, at the default scale, the one the
    sink's margins are drawn for."""
    return sees_every_key(p) and S.sink_scale(p.sm_scale, p.head_dim)


def _long_reduction_example(values: str, kv_len: int, k_major: int) -> Case[FlashParams]:
    """One bfloat16 query block over kv_len keys in 128-key sub-blocks of k_major-key grid
    steps, every pass tiled alike, every row seeing every key at the default scale."""
    return Case(FAMILY, FlashParams(
        dtype="bfloat16", batch=1, heads=1, q_len=128, kv_len=kv_len, head_dim=128, causal=False,
        sm_scale=128 ** -0.5, bias=False, segments="none", segment_starts=(), values=values,
        blocks=(("block_q", 128), ("block_k_major", k_major), ("block_k", 128), ("block_b", 1),
                ("block_q_major_dkv", 128), ("block_k_major_dkv", k_major), ("block_k_dkv", 128),
                ("block_q_dkv", 128), ("block_k_major_dq", k_major), ("block_k_dq", 128), ("block_q_dq", 128))), 0)


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
    block_q, block_k = p.block_sizes["block_q"], p.block_sizes["block_k_major"]
    last_query = (p.emptied_row // block_q + 1) * block_q - 1
    fetched = np.arange(p.kv_len) < (last_query // block_k + 1) * block_k
    return bool((fetched & ~causal & ~same).any())


@st.composite
def flash_cases(draw) -> Case:
    q_len = draw(st.sampled_from(SEQ_LENS()))
    kv_len = draw(st.sampled_from((q_len,) + SEQ_LENS() + LONG_KV_LENS()))  # equal lengths are the common case
    causal = draw(st.booleans())
    segments = draw(st.sampled_from(("none", "packed", "absent")))
    head_dim = draw(st.sampled_from(HEAD_DIMS()))
    batch, heads = draw(st.sampled_from(BATCH_HEADS()))
    seed = draw(S.seeds)
    bias = draw(st.booleans())
    bias_values = draw(st.sampled_from(BIAS_VALUE_KINDS)) if bias else "normal"
    return Case(FAMILY, FlashParams(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), batch=batch, heads=heads,
        q_len=q_len, kv_len=kv_len, head_dim=head_dim, causal=causal,
        sm_scale=draw(st.sampled_from((1.0 / math.sqrt(head_dim), *SM_SCALES))),
        bias=bias, segments=segments,
        segment_starts=draw(S.segment_layout(min(q_len, kv_len))) if segments != "none" else (),
        values=draw(st.sampled_from(VALUE_KINDS)), blocks=draw(block_sizes(q_len, kv_len, batch)),
        bias_values=bias_values, emptied_row=draw(st.integers(0, q_len - 1)) if bias_values == "neg_inf_row" else None,
        segment_dtype=draw(st.sampled_from(SEGMENT_DTYPES)) if segments != "none" else "int32",
        vmem_limit_bytes=draw(st.sampled_from(VMEM_LIMITS))), seed)


def _backward_blocks(p: FlashParams) -> tuple[int, int]:
    """The backward passes' major blocks against the forward's, both axes: (how many are
    wider, how many narrower)."""
    b = p.block_sizes
    pairs = [(b[f], b["block_q"]) for f in ("block_q_major_dkv", "block_q_dq")] + [
        (b[f], b["block_k_major"]) for f in ("block_k_major_dkv", "block_k_major_dq")]
    return sum(bwd > fwd for bwd, fwd in pairs), sum(bwd < fwd for bwd, fwd in pairs)


# Crossed pairwise: causal masking and each axis's tiling, where block skipping, offsets and
# the backward's own tiles meet.
PAIRS = bugclasses.pairwise(
    bugclasses.partition("causal", on=lambda p: p.causal, off=lambda p: not p.causal),
    bugclasses.partition("q_blocks", one=lambda p: p.block_sizes["block_q"] == p.q_len,
                         several=lambda p: p.block_sizes["block_q"] < p.q_len),
    bugclasses.partition("kv_blocks", one=lambda p: p.block_sizes["block_k_major"] == p.kv_len,
                         several=lambda p: p.block_sizes["block_k_major"] < p.kv_len),
    bugclasses.partition("backward_blocks", as_forward=lambda p: _backward_blocks(p) == (0, 0),
                         wider=lambda p: _backward_blocks(p)[0] > 0, narrower=lambda p: _backward_blocks(p)[1] > 0))


class FlashSpec(KernelSpec[FlashParams]):
    name = FAMILY
    params_type = FlashParams
    directions = {**ATTENTION_AXES, "dab": BIAS_AXES}
    default_impls = {"builtin": "attncheck_kernels.flash_attention:flash_attention"}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    bug_classes = bugclasses.bug_classes(
        q_len_ne_kv_len=lambda p: p.q_len != p.kv_len,
        causal=lambda p: p.causal,
        fully_masked_row=lambda p: p.segments == "absent",
        block_boundary_straddle=lambda p: p.segments != "none" and any(s % NUM_LANES for s in p.segment_starts[1:]),
        multi_block_kv=lambda p: p.block_sizes["block_k_major"] != p.kv_len,
        single_step_kv=lambda p: p.block_sizes["block_k_major"] == p.kv_len,
        k_major_gt_k=lambda p: p.block_sizes["block_k_major"] > p.block_sizes["block_k"],
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
        # A -inf ab entry must hide its key whatever the scale's sign (the nightly found
        # it: times -0.5 the largest logit, times 0 a NaN).
        bias_neg_inf_nonpositive_scale=lambda p: p.bias and p.bias_values in NEG_INF_KINDS and p.sm_scale <= 0,
        # A row whose -inf ab hides every key it would see: 0 with zero gradient when no
        # other segment's key is visible to it, else the fallback of an absent segment's row.
        bias_neg_inf_row_empty=lambda p: emptied_row(p, falls_back=False),
        bias_neg_inf_row_falls_back=lambda p: emptied_row(p, falls_back=True),
        causal_neg_inf_row_falls_back=causal_fallback_fetches_hidden_keys,
        bias_nonfinite_where_masked=lambda p: p.bias and p.bias_values == "nonfinite_masked" and p.causal,
        block_b_gt_1=lambda p: p.block_sizes["block_b"] > 1,
        # A backward pass whose q or kv blocks are wider than the forward's, under causal
        # masking over several kv blocks: its skipping and offsets are its own.
        causal_bwd_blocks_wider=lambda p: p.causal and p.block_sizes["block_k_major"] < p.kv_len and (
            max(p.block_sizes["block_q_major_dkv"], p.block_sizes["block_q_dq"]) > p.block_sizes["block_q"]
            or max(p.block_sizes["block_k_major_dkv"], p.block_sizes["block_k_major_dq"])
            > p.block_sizes["block_k_major"]),
        # bfloat16 over many kv blocks of v whose offset cancels in every row: where a running
        # accumulator narrower than float32 shows (the convention accumulates in float32).
        long_reduction_offset_values=lambda p: (p.dtype == "bfloat16" and p.values == "offset" and sees_every_key(p)
                                                and S.spread_weights(p.sm_scale, p.head_dim)
                                                and p.kv_len // p.block_sizes["block_k"] >= S.CANCELLING_KV_BLOCKS),
        # bfloat16 over many kv blocks after a sink every row sees, at the scale its margins are
        # drawn for: where a running softmax denominator narrower than float32 shows.
        long_reduction_sink=lambda p: (p.dtype == "bfloat16" and p.values == S.SINK and sees_sink(p)
                                       and p.kv_len // p.block_sizes["block_k"] >= S.SINK_KV_BLOCKS),
        # float32 logits over a head dim of 256, recomputed by a backward in other tiles than
        # the forward's: XLA's CPU dot rounds them otherwise there (measured: not at 64 or
        # 128), so the backward's P is not normalised by its own logits. The nightly found the
        # yardstick missing it (dv 1.4x its tolerance on a correct kernel).
        f32_wide_head_retiled_backward=lambda p: (p.dtype == "float32" and p.head_dim == 256
                                                  and len(set(logit_tiles(p))) > 1),
    ) + (bugclasses.numbers("sm_scale", lambda p: p.sm_scale, parameters.NUMBER_CELLS).classes + PAIRS
         + values_by_dtype(VALUE_KINDS)
         + bugclasses.presences(ab=lambda p: p.bias, segment_ids=lambda p: p.segments != "none"))
    examples = {"interpret": 20, "interpret-hazards": 6, "tpu-lower": 4, "tpu": 24}
    # Every two-level tiling nested under causal masking at once is a rare draw: 3000 draws
    # of the CI profile's strategy found none once a value kind was added, the nightly's
    # none at all. Found by a search of 30000.
    explicit_examples = {"causal_nested_every_pass": Case(FAMILY, FlashParams(
        dtype="float32", batch=1, heads=1, q_len=512, kv_len=512, head_dim=64, causal=True, sm_scale=0.125,
        bias=False, segments="none", segment_starts=(), values="normal",
        blocks=(("block_q", 128), ("block_k_major", 256), ("block_k", 128), ("block_b", 1), ("block_q_major_dkv", 256),
                ("block_k_major_dkv", 256), ("block_k_dkv", 128), ("block_q_dkv", 128), ("block_k_major_dq", 256),
                ("block_k_dq", 128), ("block_q_dq", 128))), 0),
        # The CI profile draws head dims 64 and 128 only.
        "f32_wide_head_retiled_backward": Case(FAMILY, FlashParams(
            dtype="float32", batch=1, heads=1, q_len=256, kv_len=256, head_dim=256, causal=True, sm_scale=0.0625,
            bias=False, segments="none", segment_starts=(), values="large",
            blocks=(("block_q", 256), ("block_k_major", 128), ("block_k", 128), ("block_b", 1),
                    ("block_q_major_dkv", 128), ("block_k_major_dkv", 128), ("block_k_dkv", 128), ("block_q_dkv", 128),
                    ("block_k_major_dq", 128), ("block_k_dq", 128), ("block_q_dq", 128))), 0),
        # Every condition of the class at once is a rare draw (about 1 in 5000). 4096 keys (32 kv
        # blocks): a bfloat16 accumulator's out budget is 2.8-4.3 there against 1.4-2.0 at 2048
        # (5 seeds each; the float32 one 0.07-0.12 at both).
        "long_reduction_offset_values": _long_reduction_example("offset", 4 * S.LONG_REDUCTION, 512),
        # As rare. 8192 keys: 64 kv blocks.
        "long_reduction_sink": _long_reduction_example(S.SINK, 8 * S.LONG_REDUCTION, 1024)}
    contracts = (FLOAT32_ACCUMULATION,
        Contract("absent_segment_rows", "a row that sees no key of its own segment averages v uniformly over the "
                 "causally visible keys of the other segments, with the softmax gradient at those weights, causal "
                 "included (the kernel's docstring)"),
        Contract("nonfinite_bias", "a -inf ab entry takes no part; a row whose visible ab is all -inf is 0 with zero "
                 "gradient; NaN or +inf in ab where the mask hides the key changes nothing (the kernel's docstring)"))

    def cases(self):
        return flash_cases()

    def inputs(self, case: Case[FlashParams]) -> dict[str, np.ndarray]:
        p = case.params
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(p.dtype)
        b, h, q_len, kv_len, d = p.batch, p.heads, p.q_len, p.kv_len, p.head_dim
        out = {name: S.round_to(S.attention_values(rng, p.values, shape, role=name), dt)
               for name, shape in (("q", (b, h, q_len, d)), ("k", (b, h, kv_len, d)), ("v", (b, h, kv_len, d)),
                                   ("d_out", (b, h, q_len, d)))}
        if (ids := segment_ids(p)) is not None:
            q_ids, kv_ids = ids
            out["q_segment_ids"] = np.broadcast_to(q_ids, (b, q_len)).astype(p.segment_dtype)
            out["kv_segment_ids"] = np.broadcast_to(kv_ids, (b, kv_len)).astype(p.segment_dtype)
        if p.bias:
            out["ab"] = S.round_to(_bias(rng, p, out), dt)
        return out

    # ------------------------------------------------------------------ running
    def _call(self, impl, p: FlashParams):
        module = impl_module(impl)  # SegmentIds/BlockSizes of the implementation's convention

        def forward(q, k, v, ab, q_seg, kv_seg):
            segment_ids = module.SegmentIds(q=q_seg, kv=kv_seg) if q_seg is not None else None
            return impl(q, k, v, ab, segment_ids, causal=p.causal, sm_scale=p.sm_scale,
                        block_sizes=module.BlockSizes(**p.block_sizes),
                        **accepted_keywords(impl, vmem_limit_bytes=p.vmem_limit_bytes))

        return forward

    def evaluate(self, impl, case, inputs):
        p = case.params
        # What forces a new compile: everything but the values and the segment layout.
        static = dataclasses.replace(p, values="", segment_starts=(), bias_values="", emptied_row=None,
                                     segments="none" if p.segments == "none" else "given")
        primals, rest = _operands(inputs)
        fn = compiled(("flash", impl_key(impl), static), lambda: with_vjp(self._call(impl, p)))
        out, grads = fn(primals, inputs["d_out"], *rest)
        return {n: np.asarray(r) for n, r in zip(self.directions, (out, *grads))}

    def lower(self, impl, case):
        inputs = self.inputs(case)
        primals, rest = _operands(inputs)
        return backends.tpu_exports(self._call(impl, case.params), primals, inputs["d_out"], *rest)

    # ------------------------------------------------------------------ judging
    def oracle(self, case, inputs):
        p = case.params
        visible, fallback = _masks(p, inputs)
        # ab entries a -inf or the mask hides may be non-finite, and NaN times a scale of 0;
        # `visible` leaves them out as the kernel does.
        with np.errstate(invalid="ignore"):
            bias = None if "ab" not in inputs else np.asarray(inputs["ab"], np.float64) * p.sm_scale
        sem = dict(scale=p.sm_scale, bias=bias, visible=visible, fallback=fallback, masked_rows="zero")
        args = (inputs["q"], inputs["k"], inputs["v"])
        grads = oracle.attention_vjp(*args, inputs["d_out"], **sem)
        result = {"out": oracle.attention(*args, **sem).out, "dq": grads["dq"], "dk": grads["dk"], "dv": grads["dv"]}
        if bias is not None:
            result["dab"] = grads["dbias"] * p.sm_scale
        return result

    def yardstick(self, case, inputs):
        visible, fallback = _masks(case.params, inputs)
        return yardstick.attention_with_grads(inputs["q"], inputs["k"], inputs["v"], inputs["d_out"],
                                              scale=case.params.sm_scale, ab=inputs.get("ab"), visible=visible,
                                              fallback=fallback, masked_rows="zero")

    def error_map_layout(self, case, direction):
        # Each direction on the blocks of the pass that computes it: out (fwd), dk and dv
        # (dkv), dq and dab (dq). Under top-left causal masking the other side's blocks meet
        # the diagonal at the same positions (query i's last key is i, key j's first query
        # is j): where a causal block skip is off by one, the map breaks there.
        p = case.params
        b, q_len, kv_len = p.block_sizes, p.q_len, p.kv_len
        kv_dkv = (every("block_k_major_dkv", b["block_k_major_dkv"], kv_len),
                  every("block_k_dkv", b["block_k_dkv"], kv_len))
        rows = {"out": (every("block_q", b["block_q"], q_len),), "dq": (every("block_q_dq", b["block_q_dq"], q_len),),
                "dk": kv_dkv, "dv": kv_dkv, "dab": (every("block_q_dq", b["block_q_dq"], q_len),)}[direction]
        diagonal = {"out": ("block_k_major", q_len), "dq": ("block_k_major_dq", q_len),
                    "dk": ("block_q_major_dkv", kv_len), "dv": ("block_q_major_dkv", kv_len)}
        if p.causal and direction in diagonal:
            name, length = diagonal[direction]
            rows += (every(f"{name} on the causal diagonal", b[name], length),)
        cols = ((every("block_k_major_dq", b["block_k_major_dq"], kv_len), every("block_k_dq", b["block_k_dq"], kv_len))
                if direction == "dab" else ())
        return ErrorMapLayout(self.index_names(direction), 2, 3, rows, cols)

    def invalid_calls(self, impl):
        return invalid_flash_calls(impl)


def _bias(rng: np.random.Generator, p: FlashParams, inputs) -> np.ndarray:
    """ab in float64, with the non-finite entries its kind asks for. -inf goes only where
    the key is of the query's own segment (a fallback key's bias is replaced, not used): at
    some keys, each row keeping the last key it sees, and at every key of the emptied row,
    which then falls back on its other segments' keys or, without any, is 0."""
    ab = rng.standard_normal((p.batch, p.heads, p.q_len, p.kv_len))
    same, causal = _segment_equal(inputs), _causal(p)
    if p.bias_values in NEG_INF_KINDS:
        seen = np.broadcast_to(same & causal, ab.shape)
        last_seen = p.kv_len - 1 - np.argmax(seen[..., ::-1], axis=-1)
        kept = seen & (np.arange(p.kv_len) == last_seen[..., None])
        hidden = same & (rng.random(ab.shape) < 0.1) & ~kept
        if p.bias_values == "neg_inf_row":
            hidden = hidden | (same & (np.arange(p.q_len) == p.emptied_row)[:, None])
        ab = np.where(hidden, -np.inf, ab)
    elif p.bias_values == "nonfinite_masked":
        hidden = ~causal & (rng.random(ab.shape) < 0.5)
        ab = np.where(hidden, np.where(rng.random(ab.shape) < 0.5, np.nan, np.inf), ab)
    return ab


def _causal(p: FlashParams) -> np.ndarray:
    """[1, 1, Q, K] top-left causal visibility (all True when not causal)."""
    return (np.arange(p.kv_len)[None, :] <= np.arange(p.q_len)[:, None] if p.causal
            else np.ones((p.q_len, p.kv_len), bool))[None, None]


def _segment_equal(inputs) -> np.ndarray:
    """[B|1, 1, Q, K]: the key is of the query's segment (all True without segment ids)."""
    if "q_segment_ids" not in inputs:
        return np.ones((1, 1, 1, 1), bool)
    return (inputs["q_segment_ids"][:, :, None] == inputs["kv_segment_ids"][:, None, :])[:, None]


def _masks(p: FlashParams, inputs) -> tuple[np.ndarray, np.ndarray]:
    """(visible, fallback) [B, H, Q, K] as the kernel's docstring defines them: a key is
    visible when causally visible, of the query's segment and without a -inf bias; a row
    with no visible key falls back on its causally visible keys of other segments."""
    full = (p.batch, p.heads, p.q_len, p.kv_len)
    same, causal = _segment_equal(inputs), _causal(p)
    visible = causal & same
    if "ab" in inputs:
        visible = visible & (np.asarray(inputs["ab"], np.float64) != -np.inf)
    return np.broadcast_to(visible, full), np.broadcast_to(causal & ~same, full)


def _operands(inputs):
    """(primals, the rest of forward's arguments): the bias is a primal when given."""
    primals = [inputs[n] for n in ("q", "k", "v", "ab") if n in inputs]
    rest = ([] if "ab" in inputs else [None]) + [inputs.get("q_segment_ids"), inputs.get("kv_segment_ids")]
    return primals, rest


def invalid_flash_calls(impl) -> list[InvalidCall]:
    module = impl_module(impl)
    f32 = jnp.float32
    b, h, s, d = 1, 1, 256, 128
    q = jnp.zeros((b, h, s, d), f32)
    defaults = _fields(module.BlockSizes.get_default(b, h, s, s, d))

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



def _fields(blocks) -> dict:
    return {f: getattr(blocks, f) for f in BLOCK_FIELDS}


SPEC = FlashSpec()
