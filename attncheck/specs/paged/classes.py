"""paged_attention's bug classes, the predicates behind them, its pairwise partitions, its
contracts and the deviation shipped for jax's kernel."""

from __future__ import annotations

import numpy as np

from attncheck import bugclasses
from attncheck import strategies as S
from attncheck.expectations import BUG_CLASS, Contract, Shipped
from attncheck.specs.base import FLOAT32_ACCUMULATION, values_by_dtype
from attncheck.specs.paged.params import MEGACORE_CORES, PagedParams


def _with_several_keys(predicate):
    """What changes the logits (soft cap, dequantised k, rounding of q) shows only where a
    softmax spans several keys: over one key the output is that key's v whatever its logit."""
    return lambda p: any(n >= 2 for n in p.lengths) and predicate(p)


def _megacore_batch_steps(p: PagedParams) -> bool:
    """Megacore over the batch with a second step per core, every sequence of its own length."""
    return (p.megacore_mode == "batch" and p.batch > MEGACORE_CORES and all(p.lengths)
            and len(set(p.lengths)) == len(p.lengths))


def zero_lengths_between_others(p: PagedParams) -> bool:
    """Two or more empty sequences between ones with work: the prefetch of the next block
    must skip the first and then loop over the rest (a wrong skip loads the pages of a
    sequence nobody reads, and the next one computes with them)."""
    return any(n and not any(p.lengths[b + 1:b + 3]) and any(p.lengths[b + 3:]) for b, n in enumerate(p.lengths))


# Crossed pairwise: how many pages a compute block reads, where the lengths end in them, and
# how megacore splits the work: the page walk, the length mask and the core's share meet.
PAIRS = bugclasses.pairwise(
    bugclasses.partition("compute_block", one_page=lambda p: p.pages_per_compute_block == 1,
                         several_pages=lambda p: p.pages_per_compute_block > 1),
    bugclasses.partition("lengths_end", in_first_block=lambda p: any(0 < n < p.block_tokens for n in p.lengths),
                         in_a_later_block=lambda p: any(n > p.block_tokens and n % p.block_tokens for n in p.lengths),
                         on_a_block_edge=lambda p: any(n and n % p.block_tokens == 0 for n in p.lengths)),
    bugclasses.partition("megacore", off=lambda p: p.megacore_mode is None,
                         kv_head=lambda p: p.megacore_mode == "kv_head", batch=lambda p: p.megacore_mode == "batch"))


BUG_CLASSES = bugclasses.bug_classes(
    # Slots past the length inside a page it reads: masked by position, not by page.
    length_not_page_multiple=lambda p: any(n % p.page_size for n in p.lengths),
    # A whole page of garbage inside the last compute block a sequence reads.
    page_past_length_in_last_block=lambda p: any(p.read_tokens(n) - n >= p.page_size for n in p.lengths),
    # Page-table entries past the read blocks point at NaN pages: reading too far shows.
    unread_pages_in_table=lambda p: any(p.read_tokens(n) < p.capacity for n in p.lengths),
    full_page_table=lambda p: p.capacity in p.lengths,
    zero_length_checked=lambda p: p.inline_seq_dim and 0 in p.lengths,
    zero_length_not_inline=bugclasses.Touching(lambda p: not p.inline_seq_dim and 0 in p.lengths,
                                             lambda case, inputs: {"out": (np.asarray(case.params.lengths) == 0)
                                                                   [:, None, None]}),
    zero_lengths_between_others=zero_lengths_between_others,
    # The online softmax rescales across compute blocks only where a later block raises
    # the running max (one row per query head).
    softmax_spans_blocks=lambda p: bugclasses.expected_max_rises(
        [(0, n) for n in p.lengths], p.block_tokens) * p.q_heads >= 3,
    groups_below_8=lambda p: 1 < p.groups < 8,
    groups_multiple_of_8=lambda p: p.groups % 8 == 0,
    mqa=lambda p: p.kv_heads == 1,
    # Each core must take its own kv heads in every step, not only the first; the
    # prefetch after a core's last kv head of one sequence must go to the next sequence,
    # so two sequences with work.
    megacore_kv_head=lambda p: (p.megacore_mode == "kv_head" and p.kv_heads > MEGACORE_CORES
                                and sum(map(bool, p.lengths)) >= 2),
    # Each core must take its own sequences in every step (so a second step per core),
    # and a wrong one shows where they all differ. The inline kernel indexes lengths
    # with its own arithmetic.
    megacore_batch_inline=lambda p: _megacore_batch_steps(p) and p.inline_seq_dim,
    megacore_batch_grid=lambda p: _megacore_batch_steps(p) and not p.inline_seq_dim,
    seq_dim_not_inline=lambda p: not p.inline_seq_dim,
    # A length that ends inside a compute block after the first, several pages per block:
    # the mask and the page walk meet inside a later block.
    length_ends_in_later_compute_block=lambda p: p.pages_per_compute_block > 1 and any(
        n > p.block_tokens and n % p.block_tokens for n in p.lengths),
    # The mask value only matters where a read block holds slots past a length.
    explicit_mask_value=_with_several_keys(lambda p: p.mask_value is not None
                                           and any(p.read_tokens(n) > n for n in p.lengths)),
    int8_pages=_with_several_keys(lambda p: p.page_dtype == "int8"),
    mixed_dtypes=_with_several_keys(lambda p: p.page_dtype != p.dtype),
    soft_cap=_with_several_keys(lambda p: p.soft_cap is not None),
    large_logits=_with_several_keys(lambda p: p.values == "large"),
    # With a multiple of 8 query heads per kv head and a bf16 q the running output is kept in bf16
    # between compute blocks.
    bf16_running_output=lambda p: (p.dtype == "bfloat16" and p.groups % 8 == 0
                                   and any(n > p.block_tokens for n in p.lengths)),
) + (bugclasses.numbers("soft_cap", lambda p: p.soft_cap, ("in (0, 1)", "one", "above 1")).classes + PAIRS
     + values_by_dtype(S.NORMAL_AND_LARGE)
     + bugclasses.presences(attn_logits_soft_cap=lambda p: p.soft_cap is not None))
CONTRACTS = (FLOAT32_ACCUMULATION,
    Contract("bfloat16_pages", "float pages are computed with as bfloat16 (the kernel loads every page so): the "
             "oracle and the yardstick get the pages rounded to bfloat16, the tolerance is not widened"),
    Contract("additive_mask", "the mask is additive: slots past a length inside the last compute block read must "
             "hold finite values (NaN there poisons the row); pages no read block touches hold NaN"),
    Contract("megacore_cores", "megacore modes run on 2 simulated cores (on one the kernel hangs on kv_head)"))
EXPECTATIONS = (
    Shipped("jax", BUG_CLASS, "zero_length_not_inline", "with inline_seq_dim=False the output row of a length-0 "
            "sequence is never written (NaN, or the previous sequence's output): the 2024 fix that initialises "
            "the outputs covers only the inline path (attncheck finding paged_inline_false_empty_sequence)"),)
