"""The ring families' bug classes: those of every variant (devices, causal masking,
segments, bias, values), each variant's own with its pairs and presences, and the
contracts the variants share."""

from __future__ import annotations

from attncheck import bugclasses, parameters
from attncheck import strategies as S
from attncheck.expectations import Contract
from attncheck.specs.base import FLOAT32_ACCUMULATION, values_by_dtype
from attncheck.specs.ring.params import NUM_LANES, SEGMENT_KINDS, VALUE_KINDS, FlashRingParams, RingParams

SCALE = bugclasses.numbers("sm_scale", lambda p: p.sm_scale, parameters.NUMBER_CELLS)
DEVICES = bugclasses.partition("devices", one=lambda p: p.devices == 1, two=lambda p: p.devices == 2,
                               several=lambda p: p.devices > 2)
CAUSAL = bugclasses.partition("causal", on=lambda p: p.causal, off=lambda p: not p.causal)
SEGMENTS = bugclasses.partition("segments", **{kind: (lambda p, kind=kind: p.segments == kind)
                                               for kind in SEGMENT_KINDS})


def ring_pairs(*chunking: bugclasses.Partition) -> tuple[bugclasses.BugClass, ...]:
    """A variant's pairs: the ring's devices, causal masking and segments, with how the
    variant cuts a device's chunk (its ``chunking``), pairwise; the scale with causal masking
    (a hidden key must stay hidden whatever its sign)."""
    return bugclasses.pairwise(DEVICES, CAUSAL, SEGMENTS, *chunking) + bugclasses.pairwise(SCALE, CAUSAL)


# Classes of every ring variant, in search order.
RING_CLASSES = bugclasses.bug_classes(
    multi_device=lambda p: p.devices > 1,
    single_device=lambda p: p.devices == 1,
    ring_of_8=lambda p: p.devices == 8,
    causal=lambda p: p.causal,
    # Non-causal attention does not care in which order kv blocks arrive, and a ring of 2
    # cannot rotate the wrong way: only global causal positions on a ring of 3+ tell
    # whether the block a device holds at step s is the one the loop assumes.
    causal_ring=lambda p: p.causal and p.devices > 2,
    segments_cross_devices=lambda p: p.segments != "none" and any(s % p.per_device for s in p.segment_starts[1:]),
    fully_masked_row=lambda p: p.segments == "absent",
    # One segment-id array for queries and keys instead of a (q, kv) pair.
    single_segment_ids=lambda p: p.single_segment_ids and p.segments != "none",
    # Segment ids narrower than int32 (the draws' other dtype), as a pair and as one array:
    # classes, not a draw's luck, hold the parameter coverage that asks each form varied.
    int16_segment_ids=lambda p: p.segments != "none" and not p.single_segment_ids and p.segment_dtype == "int16",
    int16_single_segment_ids=lambda p: p.single_segment_ids and p.segments != "none" and p.segment_dtype == "int16",
    bias=lambda p: p.bias != "none",
    bf16=lambda p: p.dtype == "bfloat16",
    large_logits=lambda p: p.values == "large",
    # bfloat16 rounds the output by ~2^-9 of its size; a backward that takes its
    # di = rowsum(dO * O) from the rounded O turns that into dq and dk errors wherever large
    # logits split a row's weight between keys of distant values.
    bf16_large_logits=lambda p: p.dtype == "bfloat16" and p.values == "large",
    exact_ties=lambda p: p.values == "ties",
    # The documented contract: a row whose keys all have a -inf bias sees nothing (0, no
    # gradient), on whichever device its keys live.
    bias_neg_inf_rows=lambda p: p.bias == "neg_inf_rows",
    batch_gt_1=lambda p: p.batch > 1 and p.devices > 1,
    bias_per_batch_element=lambda p: p.bias == "batch_keys" and p.batch > 1,
    devices_from_a_mesh=lambda p: p.placement == "mesh" and p.devices > 1,
) + SCALE.classes + values_by_dtype(VALUE_KINDS)
# The optional inputs of the bias-taking rings, each given or not apart from the other.
RING_PRESENCES = dict(attn_bias=lambda p: p.bias != "none", segment_ids=lambda p: p.segments != "none")


def _minor_kv_blocks(p: FlashRingParams) -> tuple[str, str] | None:
    """How the forward and the dq pass walk a kv major block: in "several" minor blocks, in
    "one wide" (wider than a lane tile), or in "one" lane tile; None: the kernel's defaults."""
    if not p.flash_blocks.given():
        return None
    blocks = p.flash_blocks

    def walk(minor: int) -> str:
        return "several" if minor < blocks.block_k_major else "one wide" if minor > NUM_LANES else "one"
    return walk(blocks.block_k), walk(blocks.block_k_dq)


def sees_every_key(p: RingParams) -> bool:
    """Every row sees every key, with weights of its own (no causal mask, segment or key
    padding hides one)."""
    return not p.causal and p.segments == "none" and p.bias in ("none", "full")


# The contracts of every ring variant.
RING_CONTRACTS = (
    FLOAT32_ACCUMULATION,
    Contract("unseeing_rows", "a query that sees no key (its segment absent from kv, a -inf bias row, an "
             "all-False mask row) outputs 0 with no gradient, on whichever device its keys live"),)

# The blockwise ring's: chunking and dropout.
BLOCKWISE_CLASSES = RING_CLASSES + bugclasses.bug_classes(
    dropout=lambda p: p.dropout_rate > 0,
    # A query whose segment starts past its device's first key chunk sees nothing of
    # that chunk, the first one computed for it: its running max is still -inf there,
    # and only a guarded online softmax survives to the keys it does see.
    segment_after_first_key_chunk=lambda p: p.segments == "packed" and any(
        s % p.per_device >= p.key_chunk_size for s in p.segment_starts[1:]),
    # Queries past an absent layout's first segment see no key: a one-token first segment
    # leaves one query seeing one key, and every gradient of the case is a rounding of 0
    # (dP - rowsum(dO * O) cancels), judged at the floor unless the yardstick rounds it too.
    only_one_key_rows=lambda p: p.segments == "absent" and p.segment_starts == (0, 1),
    # bfloat16 compute over many key chunks (all the ring's) of v whose offset cancels in
    # every row: where a running accumulator narrower than float32 shows.
    # The same after a sink every row sees, at the scale its margins are drawn for: where a
    # running softmax denominator narrower than float32 shows.
    long_reduction_sink=lambda p: (
        p.dtype == "bfloat16" and not p.float32_logits and p.values == S.SINK and sees_every_key(p)
        and S.sink_scale(p.scale, p.head_dim) and p.dropout_rate == 0
        and p.seq_len // p.key_chunk_size >= S.SINK_KV_BLOCKS),
    long_reduction_offset_values=lambda p: (
        p.dtype == "bfloat16" and not p.float32_logits and p.values == "offset" and sees_every_key(p)
        and S.spread_weights(p.scale, p.head_dim) and p.dropout_rate == 0
        and p.seq_len // p.key_chunk_size >= S.CANCELLING_KV_BLOCKS),
) + bugclasses.numbers("dropout_rate", lambda p: p.dropout_rate,
                       ("zero", "in (0, 1)", "not a power of two")).classes + ring_pairs(
    bugclasses.partition("key_chunks", one=lambda p: p.key_chunk_size == p.per_device,
                         several=lambda p: p.key_chunk_size < p.per_device),
    bugclasses.partition("query_chunks", one=lambda p: p.query_chunk_size == p.per_device,
                         several=lambda p: p.query_chunk_size < p.per_device)) + bugclasses.presences(
    **RING_PRESENCES, dropout_rng=lambda p: p.dropout_rate > 0)

# The standard ring's. The bias is not part of this convention; a random mask with empty rows is.
STANDARD_CLASSES = tuple(c for c in RING_CLASSES if not c.name.startswith("bias")) + bugclasses.bug_classes(
    mask_with_empty_rows=lambda p: p.random_mask) + ring_pairs()

# The ring flash kernel's: its blocks per ring step.
FLASH_CLASSES = RING_CLASSES + bugclasses.bug_classes(
    several_flash_blocks_per_step=lambda p: bool(p.flash_blocks.given()) and p.flash_blocks.block_q < p.per_device,
    # Inner kv blocks, forward and dq: a kv major block walked in several minor ones, and
    # a major block wider than a lane tile computed in one.
    several_kv_minor_blocks=lambda p: _minor_kv_blocks(p) == ("several", "several"),
    one_wide_kv_minor_block=lambda p: _minor_kv_blocks(p) == ("one wide", "one wide"),
    # Causal over several devices with kv major blocks narrower than a device's chunk:
    # the block skipping adds a block offset to the ring step's chunk offset.
    causal_ring_kv_blocks_in_chunk=lambda p: (p.causal and p.device_count > 1 and bool(p.flash_blocks.given())
                                              and p.flash_blocks.block_k_major < p.per_device),
    bf16_long_kv_offset_values=lambda p: p.dtype == "bfloat16" and p.seq_len >= 512 and p.values == "offset",
    # A forward tile over several batch elements, and a dkv pass whose kv blocks are
    # wider than a lane tile: block fields the draws otherwise leave at one value.
    flash_block_over_batch=lambda p: bool(p.flash_blocks.given()) and p.flash_blocks.block_b > 1,
    wide_dkv_kv_blocks=lambda p: bool(p.flash_blocks.given()) and p.flash_blocks.block_k_dkv > NUM_LANES,
) + ring_pairs(bugclasses.partition(
    "kv_blocks", default=lambda p: not p.flash_blocks.given(),
    one=lambda p: bool(p.flash_blocks.given()) and p.flash_blocks.block_k_major == p.per_device,
    several=lambda p: bool(p.flash_blocks.given()) and p.flash_blocks.block_k_major < p.per_device)
) + bugclasses.presences(**RING_PRESENCES)
