"""The strategies that draw a splash case: its block sizes, the case, and the data of its
program."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.specs.splash.masks import mask_descriptions
from attncheck.specs.splash.params import (FAMILY, LAYOUTS, MASK_VALUE, NUM_LANES, SHAPES, SHARDINGS, SOFT_CAPS,
                                           BlockSizes, SplashParams)


@st.composite
def block_sizes(draw, q_len: int, kv_len: int, fused: bool) -> BlockSizes:
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
    return BlockSizes(**sizes, **({} if fused else dq))


@st.composite
def splash_cases(draw, *, shardings: tuple[tuple[int, int], ...] = SHARDINGS, per_head_masks: bool = True,
                 fused_bwd: bool | st.SearchStrategy[bool] = st.booleans()) -> Case[SplashParams]:
    """Splash cases; a convention that takes less draws less: ``shardings`` it shards by,
    ``per_head_masks`` (one mask for every head when False), ``fused_bwd`` a value or a
    strategy."""
    api, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim = draw(st.sampled_from(SHAPES))
    head_shards, q_seq_shards = draw(st.sampled_from(shardings))
    if q_len // q_seq_shards < NUM_LANES:  # a q shard holds whole q blocks of a lane multiple
        q_seq_shards = 1
    if per_head_masks and draw(st.booleans()):  # a different mask per head
        masks = tuple(draw(mask_descriptions(q_len, kv_len)) for _ in range(heads))
    else:
        masks = (draw(mask_descriptions(q_len, kv_len)),) * heads
    segments = draw(st.sampled_from(("none", "packed")))
    fused = draw(fused_bwd) if isinstance(fused_bwd, st.SearchStrategy) else fused_bwd
    return Case(FAMILY, SplashParams(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), api=api, heads=heads, kv_heads=kv_heads, q_len=q_len,
        kv_len=kv_len, head_dim=head_dim, v_head_dim=v_head_dim, masks=masks, segments=segments,
        segment_starts=S.drawn_segment_layout(draw, segments, min(q_len, kv_len)),
        soft_cap=draw(st.sampled_from(SOFT_CAPS)),
        blocks=draw(block_sizes(q_len // q_seq_shards, kv_len, fused)), fused_bwd=fused,
        head_shards=head_shards, q_seq_shards=q_seq_shards, values=draw(st.sampled_from(S.VALUE_KINDS)),
        downcast_smem_data=draw(st.booleans()), mask_value=draw(st.sampled_from((None, MASK_VALUE))),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in "qkv"),
        segment_dtype=draw(st.sampled_from(("int32", "int16"))) if segments != "none" else "int32"),
        draw(S.seeds))


@st.composite
def splash_data(draw, p: SplashParams) -> SplashParams:
    """The params with another draw of what the kernel is given as data
    (``SplashSpec.program``): the values and the segment layout."""
    return dataclasses.replace(p, segment_starts=S.drawn_segment_layout(draw, p.segments, min(p.q_len, p.kv_len)),
                               values=draw(st.sampled_from(S.VALUE_KINDS)))
