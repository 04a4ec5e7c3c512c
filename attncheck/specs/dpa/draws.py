"""dot_product_attention's cases, the data of a case's program and their inputs, drawn."""

from __future__ import annotations

import dataclasses

import hypothesis
import numpy as np
from hypothesis import strategies as st

from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.specs.dpa.params import (BIAS_LAYOUTS, FAMILY, MASK_LAYOUTS, SCALES, SHAPES, TO_HEADS_MAJOR,
                                        VALUE_KINDS, WINDOWS, DPAParams, visibility)

MASK_DENSITY = 0.6
EMPTIED_ROWS = 0.25  # the share of mask rows emptied where the mask empties rows
# Large logits or tied keys over a handful of keys saturate or balance every softmax: the
# gradients are then rounding noise around a tiny truth (the yardstick thousands of ulps
# from it), which proves nothing. They are drawn where rows see many keys.
LARGE_VALUES_MIN_KV_LEN = 128


@st.composite
def dpa_cases(draw) -> Case[DPAParams]:
    batch, t, s, n, k, h = draw(st.sampled_from(SHAPES))
    mask = draw(st.sampled_from(tuple(MASK_LAYOUTS)))

    case = Case(FAMILY, DPAParams(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), batch=batch, q_len=t, kv_len=s, q_heads=n, kv_heads=k,
        head_dim=h, scale=draw(st.sampled_from(SCALES)), bias=draw(st.sampled_from(tuple(BIAS_LAYOUTS))),
        mask=mask, mask_empties_rows=_empties_rows(draw, mask), is_causal=draw(st.booleans()),
        window=draw(st.sampled_from(WINDOWS)), q_lengths=draw(st.none() | _lengths(batch, t)),
        kv_lengths=draw(st.none() | _lengths(batch, s)), values=_values(draw, s)),
        draw(S.seeds))
    hypothesis.assume(proves_something(case))
    return case


# The draws of a case's data, shared by its first draw and its variants' (dpa_data).
def _empties_rows(draw, mask: str) -> bool:
    return mask != "none" and draw(st.booleans())


def _lengths(batch: int, full: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, full), min_size=batch, max_size=batch).map(tuple)


def _values(draw, kv_len: int) -> str:
    return draw(st.sampled_from(VALUE_KINDS if kv_len >= LARGE_VALUES_MIN_KV_LEN else ("normal",)))


@st.composite
def dpa_data(draw, p: DPAParams) -> DPAParams:
    """The params with another draw of what the function is given as data
    (``DPASpec.program``): the values, the mask's emptied rows, the lengths given."""
    return dataclasses.replace(
        p, mask_empties_rows=_empties_rows(draw, p.mask), values=_values(draw, p.kv_len),
        q_lengths=None if p.q_lengths is None else draw(_lengths(p.batch, p.q_len)),
        kv_lengths=None if p.kv_lengths is None else draw(_lengths(p.batch, p.kv_len)))


def proves_something(case: Case[DPAParams]) -> bool:
    """Whether some query row sees two keys. Where none does, every gradient but dv is 0
    by definition and rounding noise in any implementation (di = rowsum(dO * O) against
    dO . v): against an all-zero truth the tolerance floor is zero, and the case proves
    nothing. The top-left convention makes this common (a decode step under causal sees
    key 0 only)."""
    return bool((visibility(case.params, dpa_inputs(case).get("mask")).sum(axis=-1) >= 2).any())


def dpa_inputs(case: Case[DPAParams]) -> dict[str, np.ndarray]:
    p = case.params
    rng = np.random.default_rng(case.seed)
    dt = S.dtype_of(p.dtype)
    # Drawn heads-major (the helpers tie keys along the sequence axis), handed over [B, L, heads, H].
    q_shape, kv_shape = (p.batch, p.q_heads, p.q_len, p.head_dim), (p.batch, p.kv_heads, p.kv_len, p.head_dim)
    out = {name: S.round_to(S.attention_values(rng, p.values, shape, role=role), dt).transpose(TO_HEADS_MAJOR)
           for name, role, shape in (("query", "q", q_shape), ("key", "k", kv_shape), ("value", "v", kv_shape),
                                     ("d_out", "d_out", q_shape))}
    if BIAS_LAYOUTS[p.bias]:
        out["bias"] = S.round_to(rng.standard_normal(_layout_shape(BIAS_LAYOUTS[p.bias], p)), dt)
    if MASK_LAYOUTS[p.mask]:
        mask = rng.random(_layout_shape(MASK_LAYOUTS[p.mask], p)) < MASK_DENSITY
        if p.mask_empties_rows:
            mask &= rng.random(mask.shape[:-1] + (1,)) >= EMPTIED_ROWS
        out["mask"] = mask
    for name, lengths in (("query_seq_lengths", p.q_lengths), ("key_value_seq_lengths", p.kv_lengths)):
        if lengths is not None:
            out[name] = np.array(lengths, np.int32)
    return out


def _layout_shape(layout: str, p: DPAParams) -> tuple[int, ...]:
    sizes = {"B": p.batch, "N": p.q_heads, "T": p.q_len, "S": p.kv_len, "1": 1}
    return tuple(sizes[axis] for axis in layout)
