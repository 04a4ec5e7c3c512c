"""The conditions behind coverage classes that exist because a simpler example could not
show a bug class (each was found by a planted bug that only a drawn case caught)."""

from __future__ import annotations

import pytest

from attncheck import coverage
from attncheck.specs import all_specs
from attncheck.specs.dpa.classes import some_row_sees_no_key
from attncheck.specs.dpa.params import DPAParams
from attncheck.specs.dpa.spec import SPEC as DPA
from attncheck.specs.flash import classes as flash_classes
from attncheck.specs.flash import spec as flash_spec
from attncheck.specs.flash.params import BLOCK_FIELDS, BlockSizes, FlashParams
from attncheck.specs.paged.params import SHAPES as PAGED_SHAPES
from attncheck.specs.paged.spec import SPEC as PAGED
from attncheck.specs.ragged import classes as ragged_classes
from attncheck.cases import Case
from attncheck.specs.ragged.params import RaggedParams
from attncheck.specs.ragged.spec import SPEC as RAGGED


def ragged_case(seqs, *, window=None, heads=1, queries_per_block=None, kv_pages_per_block=None) -> RaggedParams:
    return RaggedParams(dtype="float32", kv_dtype="float32", page_size=8, num_q_heads=heads, num_kv_heads=1,
                        seqs=seqs, sliding_window=window, soft_cap=None, k_scale=None, v_scale=None,
                        sm_scale=1.0, num_kv_pages_per_block=kv_pages_per_block,
                        num_queries_per_block=queries_per_block,
                        padding="repeat_last", values="normal")


@pytest.mark.parametrize("seqs, window, heads, rises", [
    (((1, 8),), None, 1, 0.0),  # one block: nothing to rescale
    (((1, 16),), None, 1, 8 / 16),  # the last query's second block adds 8 keys to 8
    (((9, 9),), None, 2, 2 * 1 / 9),  # only query 8 reaches the second block: 1 key after 8
    (((1, 16),), 8, 1, 0.0),  # the window leaves the last query one block
    (((1, 12),), 8, 1, 4 / 8),  # window keys 4..11: 4 in the first block, 4 more in the second
])
def test_expected_max_rises_counts_the_blocks_after_the_first_a_row_sees(seqs, window, heads, rises):
    assert ragged_classes.expected_max_rises(ragged_case(seqs, window=window, heads=heads), 8) == pytest.approx(rises)


@pytest.mark.parametrize("seqs, block, shared", [
    (((1, 1), (1, 1)), 8, True),
    (((8, 8), (1, 1)), 8, False),  # the second sequence starts a block of its own
    (((1, 1), (0, 0), (1, 1)), 8, True),  # an empty sequence between does not separate them
    (((1, 1), (1, 1)), None, False),  # the kernel's default block is not known here
    (((3, 3),), 8, False),
])
def test_seqs_share_a_q_block(seqs, block, shared):
    assert ragged_classes.seqs_share_a_q_block(ragged_case(seqs, queries_per_block=block)) is shared


@pytest.mark.parametrize("seqs, queries_per_block, different", [
    (((2, 9),), 8, True),  # rows see keys 0..7 and 0..8: the second row's block 1 is all masked for the first
    (((2, 10),), 8, False),  # keys 0..8 and 0..9: both rows end in block 1
    (((1, 16),), 8, False),  # one row
    (((2, 9),), 1, False),  # each row has a grid step of its own
    (((1, 1), (2, 9)), 2, False),  # tokens 1 and 2 are in different steps of 2
    (((1, 1), (2, 9)), 8, True),
])
def test_rows_end_in_different_kv_blocks_within_one_grid_step(seqs, queries_per_block, different):
    case = ragged_case(seqs, queries_per_block=queries_per_block, kv_pages_per_block=1)  # 8-token kv blocks
    assert ragged_classes.rows_end_in_different_kv_blocks(case) is different


@pytest.mark.parametrize("seqs, window, several", [
    (((1, 1),), None, False),  # a 1-token decode: softmax over one key is 1
    (((1, 2),), None, True),
    (((1, 2),), 1, False),
    (((0, 5), (1, 1)), None, False),  # the long sequence has no query
])
def test_logit_classes_need_a_softmax_over_several_keys(seqs, window, several):
    assert ragged_classes.some_query_sees_several_keys(ragged_case(seqs, window=window)) is several


@pytest.mark.parametrize("seqs, before_another", [
    (((0, 0), (1, 1)), True),
    (((0, 0), (0, 5)), True),  # no query after it: the next sequence's first wait still takes its page
    (((1, 1), (0, 0), (0, 0), (2, 9)), True),
    (((3, 3), (0, 0)), False),  # last: its prefetched page is never waited for
    (((0, 5), (1, 1)), False),  # keys, no query: not empty
])
def test_an_empty_sequence_shows_before_a_sequence_with_keys(seqs, before_another):
    assert ragged_classes.empty_seq_before_another(ragged_case(seqs)) is before_another


@pytest.mark.parametrize("seed", range(5))
def test_an_unused_page_table_slot_names_a_page_past_the_buffer_on_every_draw(seed):
    # So that a kernel reading one is stopped by the interpreter whatever the draw.
    params = ragged_case(((0, 0), (3, 9), (1, 20)))
    inputs = RAGGED.inputs(Case("ragged_paged_attention", params, seed))
    total_pages = inputs["kv_pages"].shape[0]
    for row, used in zip(inputs["page_indices"], (0, 2, 3, 0), strict=True):  # pages of 8 tokens
        assert (row[:used] < total_pages).all() and (row[used:] >= total_pages).all(), row


def flash_case(q_len, kv_len, *, causal=True, segment_starts=(), **blocks) -> FlashParams:
    sizes = {name: 1 if name == "block_b" else 128 for name in BLOCK_FIELDS} | blocks
    return FlashParams(dtype="float32", batch=1, heads=1, q_len=q_len, kv_len=kv_len, head_dim=128,
                       causal=causal, sm_scale=1.0, bias=True, segments="packed" if segment_starts else "none",
                       segment_starts=segment_starts, values="normal", blocks=BlockSizes(**sizes))


def test_causal_skips_in_every_pass_needs_a_kv_block_past_the_first_q_tile_in_each():
    assert flash_classes.causal_skips_in_every_pass(flash_case(128, 256))
    assert not flash_classes.causal_skips_in_every_pass(flash_case(128, 256, causal=False))
    assert not flash_classes.causal_skips_in_every_pass(flash_case(128, 128))
    # The dq pass fetches all of kv at once: nothing to skip there.
    assert not flash_classes.causal_skips_in_every_pass(flash_case(128, 256, block_k_major_dq=256))
    # A first q tile of 256 rows sees the last kv block starting at 128.
    assert not flash_classes.causal_skips_in_every_pass(flash_case(256, 256, block_q_major_dkv=256))


def test_a_nested_tiling_needs_the_diagonal_past_the_first_minor_block_of_a_later_major_block():
    blocks = {"block_k_major_dq": 256, "block_k_dq": 128}
    assert "dq_kv" in flash_classes.nested_tilings(flash_case(512, 512, **blocks))
    # Rows 0..383 reach no further than the first minor block of the second major block.
    assert "dq_kv" not in flash_classes.nested_tilings(flash_case(384, 512, **blocks))
    assert "dq_kv" not in flash_classes.nested_tilings(flash_case(512, 512, block_k_major_dq=512, block_k_dq=128))
    assert "dq_kv" not in flash_classes.nested_tilings(flash_case(512, 512, block_k_major_dq=256, block_k_dq=256))
    every_pass = next(c.applies for c in flash_spec.SPEC.bug_classes if c.name == "causal_nested_every_pass")
    assert not every_pass(flash_case(512, 512, **blocks))
    assert every_pass(flash_case(512, 512, block_k_major=256, block_q_major_dkv=256, block_k_major_dkv=256, **blocks))


def test_a_backward_pass_with_wider_blocks_than_the_forward_needs_causal_over_several_kv_blocks():
    wider = next(c.applies for c in flash_spec.SPEC.bug_classes if c.name == "causal_bwd_blocks_wider")
    assert wider(flash_case(256, 256, block_q_major_dkv=256))
    assert wider(flash_case(256, 512, block_k_major_dq=256))
    assert not wider(flash_case(256, 256))  # every pass tiles like the forward
    assert not wider(flash_case(256, 256, causal=False, block_q_major_dkv=256))
    # One forward kv block: the forward skips nothing a wider backward block could disagree on.
    assert not wider(flash_case(256, 256, block_k_major=256, block_q_major_dkv=256))


def test_segments_vary_across_tiles_in_every_pass():
    assert flash_classes.segments_vary_across_tiles(flash_case(256, 256, segment_starts=(0, 1)))
    assert not flash_classes.segments_vary_across_tiles(flash_case(256, 256, segment_starts=(0,)))
    # A boundary on a tile edge: the second tile holds other ids than the first.
    assert flash_classes.segments_vary_across_tiles(flash_case(256, 256, segment_starts=(0, 128)))
    # One kv block in the forward pass: the forward's kv segment map is not tested.
    assert not flash_classes.segments_vary_across_tiles(flash_case(256, 256, segment_starts=(0, 1), block_k_major=256))


def test_ring_segment_after_first_key_chunk():
    spec = all_specs()["ring_attention"]
    base = dict(dtype="float32", devices=1, seq_len=16, per_device=16, heads=1, head_dim=32, causal=False,
                bias="none", segments="packed", float32_logits=False, values="normal", query_chunk_size=8,
                key_chunk_size=8, dropout_rate=0.0)
    assert "segment_after_first_key_chunk" in spec.classes(spec.case(0, **base, segment_starts=(0, 8)))
    assert "segment_after_first_key_chunk" not in spec.classes(spec.case(0, **base, segment_starts=(0, 7)))


def paged_classes(lengths, *, megacore=None, inline=True, shape=PAGED_SHAPES[1]) -> list[str]:
    batch, q_heads, kv_heads, head_dim, page_size, pages = shape
    return PAGED.classes(PAGED.case(
        0, dtype="float32", page_dtype="float32", batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        page_size=page_size, pages_per_sequence=pages, pages_per_compute_block=1, lengths=lengths,
        megacore_mode=megacore, inline_seq_dim=inline, soft_cap=None, values="normal"))


@pytest.mark.parametrize("lengths, skipped", [
    ((1, 0, 0, 1), True),
    ((1, 0, 1, 1), False),  # one empty sequence: the first skip alone, not the loop over more
    ((0, 0, 0, 1), False),  # nothing before: no prefetch has to skip
    ((1, 0, 0, 0), False),  # nothing after
])
def test_paged_prefetch_loops_over_empty_sequences_only_between_two_with_work(lengths, skipped):
    assert ("zero_lengths_between_others" in paged_classes(lengths)) is skipped


def test_paged_megacore_classes_need_a_second_step_per_core_with_work():
    two_kv_steps = PAGED_SHAPES[0]  # 4 kv heads: 2 per core
    assert "megacore_kv_head" in paged_classes((3, 5), megacore="kv_head", shape=two_kv_steps)
    # One sequence with work: the prefetch after a core's last kv head goes nowhere.
    assert "megacore_kv_head" not in paged_classes((0, 5), megacore="kv_head", shape=two_kv_steps)
    assert "megacore_kv_head" not in paged_classes((3, 5), megacore="kv_head", shape=PAGED_SHAPES[1])
    assert "megacore_batch_inline" in paged_classes((1, 2, 3, 4), megacore="batch")
    assert "megacore_batch_grid" in paged_classes((1, 2, 3, 4), megacore="batch", inline=False)
    # Equal lengths hide a core reading another core's length; with 2 sequences each core
    # has one step only.
    assert "megacore_batch_inline" not in paged_classes((1, 2, 2, 4), megacore="batch")
    assert "megacore_batch_inline" not in paged_classes((1, 2), megacore="batch", shape=two_kv_steps)


def dpa_params(**changes) -> DPAParams:
    base = dict(dtype="float32", batch=2, q_len=6, kv_len=8, q_heads=4, kv_heads=2, head_dim=16, scale=None,
                bias="none", mask="none", mask_empties_rows=False, is_causal=False, window=None, q_lengths=None,
                kv_lengths=None, values="normal")
    return DPAParams(**base | changes)


def test_dpa_window_right_side_needs_no_causal_mask():
    classes = dict((c.name, c.applies) for c in DPA.bug_classes)
    assert classes["window_right_side"](dpa_params(window=(2, 1)))
    assert not classes["window_right_side"](dpa_params(window=(2, 1), is_causal=True))
    assert not classes["window_right_side"](dpa_params(window=(4, 0)))


def test_dpa_fully_masked_row_counts_only_rows_within_their_query_length():
    assert some_row_sees_no_key(dpa_params(kv_lengths=(0, 3)))
    assert not some_row_sees_no_key(dpa_params(kv_lengths=(0, 3), q_lengths=(0, 6)))
    assert some_row_sees_no_key(dpa_params(mask="shared", mask_empties_rows=True))


@pytest.mark.parametrize("family", ["ring_attention", "ring_attention_standard", "ring_flash_attention"])
def test_a_ring_family_takes_one_coverage_example_on_a_ring_of_8(family):
    """The search looks again on fewer devices: hypothesis' shrinker alone may leave ring
    flash's large-logits example on a ring of 8 beside the ring_of_8 class's own, many times
    slower than on one device."""
    spec = all_specs()[family]
    on_8 = [case for case in coverage.examples(spec) if case.params.device_count == 8]
    assert len(on_8) == 1 and "ring_of_8" in spec.classes(on_8[0]), [spec.classes(c) for c in on_8]


def test_pairwise_names_a_class_for_each_pair_of_cells_of_two_partitions():
    from attncheck import bugclasses

    causal = bugclasses.partition("causal", on=lambda p: p[0], off=lambda p: not p[0])
    blocks = bugclasses.partition("kv_blocks", one=lambda p: p[1] == 1, several=lambda p: p[1] > 1)
    scale = bugclasses.numbers("scale", lambda p: p[2], ("negative", "zero"))
    pairs = bugclasses.pairwise(causal, blocks, scale)
    assert [c.name for c in pairs] == [
        "causal_on__kv_blocks_one", "causal_on__kv_blocks_several", "causal_off__kv_blocks_one",
        "causal_off__kv_blocks_several", "causal_on__scale_negative", "causal_on__scale_zero",
        "causal_off__scale_negative", "causal_off__scale_zero", "kv_blocks_one__scale_negative",
        "kv_blocks_one__scale_zero", "kv_blocks_several__scale_negative", "kv_blocks_several__scale_zero"]
    # (causal, kv blocks, scale): a case reaches exactly the pairs of its cells.
    assert bugclasses.exercised(pairs, (True, 3, 0.0)) == sorted(
        ["causal_on__kv_blocks_several", "causal_on__scale_zero", "kv_blocks_several__scale_zero"])
    with pytest.raises(ValueError, match="partition\\('causal'\\)"):
        bugclasses.partition("causal", on=lambda p: True)
    with pytest.raises(ValueError, match="distinct partitions"):
        bugclasses.pairwise(causal, causal)

