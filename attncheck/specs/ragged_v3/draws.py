"""The ragged paged attention v3 family's case strategies."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.specs.ragged_v3.params import (BLOCKS, CHUNK_PREFILL_SIZES, DTYPE_PAIRS, FAMILY, HEAD_DIMS,
                                              HEAD_LAYOUTS, K_SCALES, KINDS, LAYOUT_NAMES, LAYOUTS, MASK_VALUE,
                                              OUT_DTYPES, PAGE_SIZES, Q_SCALES, SM_SCALES, SOFT_CAPS, V_SCALES,
                                              RaggedV3Params)


def fits_pages(blocks: str, page_size: int) -> bool:
    """Every kv block and compute chunk of the set holds whole pages (the kernel's rule)."""
    chosen = BLOCKS[blocks]
    return chosen is None or all(size % page_size == 0 for sizes in chosen.values() for size in sizes[1::2])


@st.composite
def ragged_v3_cases(draw) -> Case:
    layout = draw(st.sampled_from(LAYOUT_NAMES()))
    shapes = LAYOUTS[layout]
    page_size = draw(st.sampled_from(PAGE_SIZES()))
    capacity = page_size * shapes.pages_per_seq
    chunk = draw(st.sampled_from(CHUNK_PREFILL_SIZES))
    budget = shapes.max_tokens
    groups = {}
    for kind in KINDS:
        count = 0 if kind == "chunked_prefill" and chunk is None else draw(st.integers(0, shapes.max_seqs))
        seqs = []
        for _ in range(count):
            if sum(len(g) for g in groups.values()) + len(seqs) == shapes.max_seqs:
                break
            if kind == "decode" and budget >= 1:
                seqs.append((1, draw(st.integers(1, capacity))))
            elif kind == "chunked_prefill" and budget >= chunk:
                seqs.append((chunk, draw(st.integers(chunk, capacity))))
            elif kind == "mixed" and budget >= 1:
                kv_len = draw(st.integers(1, capacity))
                seqs.append((draw(st.integers(1, min(kv_len, budget))), kv_len))
            budget -= seqs[-1][0] if seqs else 0
        groups[kind] = seqs
    if not any(groups.values()):
        groups["decode"] = [(1, draw(st.integers(1, capacity)))]
    ends = np.cumsum([len(groups[k]) for k in KINDS])
    q_dtype, kv_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    quantized = kv_dtype not in S.DTYPES
    scales = [draw(st.sampled_from(values if quantized else (None, *values))) for values in (K_SCALES, V_SCALES)]
    heads = draw(st.sampled_from(HEAD_LAYOUTS))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    return Case(FAMILY, RaggedV3Params(
        dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, page_size=page_size, num_q_heads=heads[0],
        num_kv_heads=heads[1], seqs=tuple(s for k in KINDS for s in groups[k]),
        distribution=tuple(int(e) for e in ends), chunk_prefill_size=chunk,
        sliding_window=draw(st.one_of(st.none(), st.sampled_from((1, 5, page_size * 2 + 3, capacity + 7)))),
        soft_cap=draw(st.sampled_from(SOFT_CAPS)), sm_scale=draw(st.sampled_from((head_dim ** -0.5, *SM_SCALES))),
        q_scale=draw(st.sampled_from((None, *Q_SCALES))) if quantized else None, k_scale=scales[0], v_scale=scales[1],
        blocks=draw(st.sampled_from(tuple(b for b in BLOCKS if fits_pages(b, page_size)))),
        values=draw(st.sampled_from(S.NORMAL_AND_LARGE)), layout=layout, out_dtype=draw(st.sampled_from(OUT_DTYPES)),
        mask_value=draw(st.sampled_from((None, MASK_VALUE))),
        vmem_limit_bytes=draw(st.sampled_from((None, 64 * 1024 * 1024)))), draw(S.seeds))
