"""paged_attention's cases, drawn."""

from __future__ import annotations

from hypothesis import strategies as st

from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.specs.paged.params import DTYPE_PAIRS, FAMILY, MASK_VALUE, SHAPES, SOFT_CAPS, PagedParams


@st.composite
def paged_cases(draw) -> Case[PagedParams]:
    batch, q_heads, kv_heads, head_dim, page_size, pages = draw(st.sampled_from(SHAPES))
    capacity = page_size * pages
    length = st.one_of(st.integers(0, capacity), st.sampled_from((1, capacity)))
    megacore = [None] + ["kv_head"] * (kv_heads % 2 == 0) + ["batch"] * (batch % 2 == 0)
    dtype, page_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    inline = draw(st.booleans())
    lengths = st.lists(length, min_size=batch, max_size=batch)
    # Not inline, an empty sequence's row is judged apart (its deviation): some sequence must have work.
    lengths = lengths if inline else lengths.filter(any)
    return Case(FAMILY, PagedParams(
        dtype=dtype, page_dtype=page_dtype, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, page_size=page_size, pages_per_sequence=pages,
        pages_per_compute_block=draw(st.sampled_from(S.divisors(pages, 1))),
        lengths=tuple(draw(lengths)), megacore_mode=draw(st.sampled_from(megacore)), inline_seq_dim=inline,
        soft_cap=draw(st.sampled_from(SOFT_CAPS)), values=draw(st.sampled_from(S.NORMAL_AND_LARGE)),
        mask_value=draw(st.sampled_from((None, MASK_VALUE)))),
        draw(S.seeds))
