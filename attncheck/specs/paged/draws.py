"""paged_attention's cases and the data of a case's program, drawn."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.specs.paged.params import DTYPE_PAIRS, FAMILY, MASK_VALUE, SHAPES, SOFT_CAPS, PagedParams


@st.composite
def paged_cases(draw) -> Case[PagedParams]:
    batch, q_heads, kv_heads, head_dim, page_size, pages = draw(st.sampled_from(SHAPES))
    megacore = [None] + ["kv_head"] * (kv_heads % 2 == 0) + ["batch"] * (batch % 2 == 0)
    dtype, page_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    inline = draw(st.booleans())
    return Case(FAMILY, PagedParams(
        dtype=dtype, page_dtype=page_dtype, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, page_size=page_size, pages_per_sequence=pages,
        pages_per_compute_block=draw(st.sampled_from(S.divisors(pages, 1))),
        lengths=draw(_lengths(batch, page_size * pages, inline)), megacore_mode=draw(st.sampled_from(megacore)),
        inline_seq_dim=inline,
        soft_cap=draw(st.sampled_from(SOFT_CAPS)), values=draw(st.sampled_from(S.NORMAL_AND_LARGE)),
        mask_value=draw(st.sampled_from((None, MASK_VALUE)))),
        draw(S.seeds))


def _lengths(batch: int, capacity: int, inline: bool) -> st.SearchStrategy[tuple[int, ...]]:
    length = st.one_of(st.integers(0, capacity), st.sampled_from((1, capacity)))
    lengths = st.lists(length, min_size=batch, max_size=batch)
    # Not inline, an empty sequence's row is judged apart (its deviation): some sequence must have work.
    return (lengths if inline else lengths.filter(any)).map(tuple)


@st.composite
def paged_data(draw, p: PagedParams) -> PagedParams:
    """The params with another draw of what the kernel is given as data
    (``PagedSpec.program``): the lengths and the values."""
    lengths = _lengths(p.batch, p.page_size * p.pages_per_sequence, p.inline_seq_dim)
    return dataclasses.replace(p, lengths=draw(lengths), values=draw(st.sampled_from(S.NORMAL_AND_LARGE)))
