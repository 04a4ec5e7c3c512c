"""Ragged paged attention v2 family: ``ragged_paged_attention(queries, kv_pages, kv_lens,
page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap, k_scale, v_scale,
num_kv_pages_per_block, num_queries_per_block)`` (tpu-inference's convention, forward only).

Mapped onto the ragged oracle: K/V interleaved on the combined-heads axis (K of kv head h
at 2h, V at 2h+1), bottom-right causal alignment, window ``q_pos - kv_pos < window``,
soft cap after the scale. Everything the kernel must never read holds poison: NaN in
unused pages, in page tails past kv_len and in padding query tokens; garbage in unused
page-table slots and in the metadata of sequences past num_seqs. Output rows of tokens
that belong to no sequence (at or past ``cu_q_lens[num_seqs]``) are zeros, as the kernel's
docstring and the convention's reference promise.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from attncheck import backends, bugclasses, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.expectations import Contract
from attncheck.layouts import ErrorMapLayout, every
from attncheck.specs.base import (FLOAT32_ACCUMULATION, MASK_VALUE_UNDERFLOWS, SOFT_CAP_IS_POSITIVE, InvalidCall,
                                  KernelSpec, accepted_keywords, positional_invalid_calls, values_by_dtype)

FAMILY = "ragged_paged_attention"
# The convention's array arguments, passed positionally.
ARRAY_ARGS = ("queries", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
# Static buckets: every case of a bucket reuses one compiled kernel; the ragged structure
# (lengths, page tables, num_seqs) is data.
@dataclasses.dataclass(frozen=True)
class Layout:
    """The static buffer shapes of a case: every one of them sizes a grid or an index map."""

    max_tokens: int  # queries.shape[0]
    max_seqs: int  # kv_lens.shape[0], page_indices.shape[0], cu_q_lens.shape[0] - 1
    pages_per_seq: int  # page_indices.shape[1]
    total_pages: int  # kv_pages.shape[0]
    head_dim: int


# Three layouts in CI, so that each buffer dimension takes several values with few compiles
# ("compact" has a last query block that the default block size overhangs; "long" has rows
# of thousands of keys); the nightly profile adds a wide one.
LAYOUTS = {"standard": Layout(max_tokens=64, max_seqs=4, pages_per_seq=8, total_pages=40, head_dim=128),
           "compact": Layout(max_tokens=24, max_seqs=3, pages_per_seq=5, total_pages=48, head_dim=64),
           "wide": Layout(max_tokens=160, max_seqs=7, pages_per_seq=11, total_pages=96, head_dim=256),
           # Rows over thousands of keys in many kv blocks: where a running accumulator held
           # in the value dtype loses each block's low bits (values offset from 0).
           "long": Layout(max_tokens=16, max_seqs=2, pages_per_seq=S.MANY_KV_BLOCKS + 64,
                          total_pages=2 * S.MANY_KV_BLOCKS + 136, head_dim=128)}
LAYOUT_NAMES = S.Shapes(ci=("standard", "compact", "long"), nightly=tuple(LAYOUTS))
HEAD_DIM = LAYOUTS["standard"].head_dim  # of the invalid calls
PAGE_SIZES = S.Shapes(ci=(8, 16), nightly=(8, 16, 32))
# (num_q_heads, num_kv_heads): GQA ratios 1, 2, 4, 8; 8 kv heads of float32 are more than
# this family's kernel holds in one head block (its smallest tile-aligned block: 4).
HEAD_LAYOUTS = ((2, 2), (4, 2), (4, 1), (8, 1), (16, 8))
# (query dtype, kv dtype): packed kv dtypes only with scales (they are quantized caches).
DTYPE_PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"),
               ("bfloat16", "int8"), ("bfloat16", "float8_e4m3fn"))
# k_scale and v_scale, each drawn apart: powers of two, values no 8-bit float holds exactly,
# and each scale's cells (below 1, 1, above 1).
K_SCALES = (0.5, 0.3, 1.0, 2.0)
V_SCALES = (2.0, 1.7, 0.7, 1.0)
KV_SCALE_IS_POSITIVE = "a quantization scale maps stored values back to real ones: a positive factor"
SOFT_CAPS = (None, 5.0, 0.7, 1.0)
SM_SCALES = (1.0, 1.7, 0.0, -0.5)  # besides 1/sqrt(head_dim): the scale's every cell
SEQ_KINDS = ("decode", "chunked_prefill", "full_prefill", "empty")
PADDING_KINDS = ("repeat_last", "minus_one", "garbage")
# An explicit mask value that underflows like the default (the docstring: one that does
# not gives no defined result).
MASK_VALUE = -1e30
# The value kinds: "offset" moves v away from 0 (strategies.V_OFFSET), so that the rounding
# of a long P @ V accumulation is not hidden by the cancellation of centred values; "sink"
# makes each sequence's first key outweigh the rest (strategies.SINK), the query rows' margins
# spread over tokens and heads together.
VALUE_KINDS = (*S.NORMAL_AND_LARGE, "offset", S.SINK)
KV_DTYPES = {"int8": np.dtype(np.int8), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
             **S.DTYPES}


@dataclasses.dataclass(frozen=True)
class RaggedParams(Params):
    dtype: str  # queries (and output)
    kv_dtype: str
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) of each sequence
    sliding_window: int | None
    soft_cap: float | None
    k_scale: float | None
    v_scale: float | None
    sm_scale: float
    num_kv_pages_per_block: int | None
    num_queries_per_block: int | None
    padding: str  # a PADDING_KINDS way of filling metadata past num_seqs
    values: str  # a VALUE_KINDS distribution
    layout: str = "standard"  # a LAYOUTS name
    mask_value: float | None = None  # None: the kernel's default
    vmem_limit_bytes: int | None = None  # None: the kernel's default

    @property
    def sequence_length(self) -> int:
        return max(k for _, k in self.seqs)

    @property
    def shapes(self) -> Layout:
        return LAYOUTS[self.layout]

    @property
    def kv_block_pages(self) -> int:
        """Pages per kv block as the kernel picks them when the case leaves it to it."""
        return self.num_kv_pages_per_block or max(1, min(self.shapes.pages_per_seq, 128 // self.page_size))

    @property
    def q_block_tokens(self) -> int:
        """Query tokens per grid step as the kernel picks them when the case leaves it to
        it (at most 32, the token count rounded up to 8 sublanes)."""
        return self.num_queries_per_block or min(32, -(-self.shapes.max_tokens // 8) * 8)


@st.composite
def sequence(draw, capacity: int, token_budget: int) -> tuple[int, int]:
    """(q_len, kv_len) of one sequence; shrinks toward a one-token decode."""
    kind = draw(st.sampled_from(SEQ_KINDS))
    if kind == "empty" or token_budget == 0:
        return 0, draw(st.sampled_from((0, draw(st.integers(1, capacity)))))
    kv_len = draw(st.integers(1, capacity))
    if kind == "decode" or kv_len == 1:
        return 1, kv_len
    if kind == "full_prefill":
        return min(kv_len, token_budget), kv_len
    return min(draw(st.integers(1, kv_len - 1)), token_budget), kv_len


@st.composite
def ragged_cases(draw) -> Case:
    layout = draw(st.sampled_from(LAYOUT_NAMES()))
    shapes = LAYOUTS[layout]
    page_size = draw(st.sampled_from(PAGE_SIZES()))
    capacity = page_size * shapes.pages_per_seq
    num_seqs = draw(st.integers(1, shapes.max_seqs))
    seqs, budget = [], shapes.max_tokens
    for _ in range(num_seqs):
        q_len, kv_len = draw(sequence(capacity, budget))
        budget -= q_len
        seqs.append((q_len, kv_len))
    q_dtype, kv_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    packed = kv_dtype not in S.DTYPES
    # A packed cache is quantized: it comes with both scales.
    scales = [draw(st.sampled_from(values if packed else (None, *values))) for values in (K_SCALES, V_SCALES)]
    window = draw(st.one_of(st.none(), st.sampled_from((1, 5, page_size * 2 + 3, capacity + 7))))
    # The kernel tiles the combined-heads axis in 32-bit words: with 4 values per word
    # (int8, fp8) 2 * num_kv_heads must be a multiple of 4 (a documented rejection).
    packing = 4 // KV_DTYPES[kv_dtype].itemsize
    heads = draw(st.sampled_from([h for h in HEAD_LAYOUTS if (2 * h[1]) % packing == 0]))
    seed = draw(S.seeds)
    return Case(FAMILY, RaggedParams(
        dtype=q_dtype, kv_dtype=kv_dtype, page_size=page_size,
        num_q_heads=heads[0], num_kv_heads=heads[1], seqs=tuple(seqs),
        sliding_window=window, soft_cap=draw(st.sampled_from(SOFT_CAPS)),
        k_scale=scales[0], v_scale=scales[1], sm_scale=draw(st.sampled_from((shapes.head_dim**-0.5, *SM_SCALES))),
        num_kv_pages_per_block=draw(st.sampled_from((None, 1, 3))),
        num_queries_per_block=draw(st.sampled_from((None, 8, 16, 24))),
        padding=draw(st.sampled_from(PADDING_KINDS)), values=draw(st.sampled_from(VALUE_KINDS)),
        layout=layout, mask_value=draw(st.sampled_from((None, MASK_VALUE))),
        vmem_limit_bytes=draw(st.sampled_from((None, 64 * 1024 * 1024)))), seed)


def empty_seq_before_another(p: RaggedParams) -> bool:
    """A sequence with no query and no key comes before one with queries: the pipeline that
    fetches the next sequence's pages must skip it, not serve its (absent) pages."""
    empty = [i for i, (q, k) in enumerate(p.seqs) if q == 0 and k == 0]
    return bool(empty) and any(q for q, _ in p.seqs[empty[0] + 1:])


def some_query_sees_several_keys(p: RaggedParams) -> bool:
    # A sequence's last query sees min(window, kv_len) keys (bottom-right causal).
    window = p.sliding_window or math.inf
    return any(q_len and min(window, kv_len) >= 2 for q_len, kv_len in p.seqs)


def seqs_share_a_q_block(p: RaggedParams) -> bool:
    """Some sequence's first query token lies in the q block of the previous sequence's
    last one (block size as asked for; the kernel's default depends on the shapes)."""
    block = p.num_queries_per_block
    starts = np.cumsum([0] + [q_len for q_len, _ in p.seqs])[:-1]
    boundaries = [start for start, (q_len, _) in zip(starts, p.seqs) if q_len][1:]
    return block is not None and any(b % block for b in boundaries)


def expected_max_rises(p: RaggedParams, block_tokens: int) -> float:
    """Expected rises of the running max over every query row (bottom-right causal, window)."""
    window = p.sliding_window or math.inf
    rows = [(int(max(0, pos + 1 - window)), pos + 1) for q_len, kv_len in p.seqs
            for pos in range(kv_len - q_len, kv_len)]
    return bugclasses.expected_max_rises(rows, block_tokens) * p.num_q_heads


def _poison(dtype) -> float:
    """What unread memory holds: NaN where the dtype has one, else its largest value."""
    dtype = np.dtype(dtype)
    if dtype == np.int8:
        return 127
    return np.nan


def _seq_kind(q_len: int, kv_len: int) -> str:
    if q_len == 0:
        return "zero_length_seq"
    if q_len == 1:
        return "decode"
    return "chunked_prefill" if q_len < kv_len else "full_prefill"


def _has_seq(kind: str):
    return lambda p: any(_seq_kind(q, k) == kind for q, k in p.seqs)


def _with_several_keys(predicate):
    """What changes the logits (soft cap, k scale and dequantization, bf16 rounding of
    scores) shows only where a softmax spans several keys: over one key it is 1 whatever
    the logit, so a decode step on a 1-token sequence cannot tell them apart."""
    return lambda p: some_query_sees_several_keys(p) and predicate(p)


def long_reduction_offset_values(p: RaggedParams) -> bool:
    """A bfloat16 row over thousands of keys of v offset from 0, in many kv blocks: where
    an accumulator held in the value dtype between blocks loses each block's low bits."""
    block = p.kv_block_pages * p.page_size
    return p.dtype == "bfloat16" and p.values == "offset" and any(
        q and k >= S.LONG_REDUCTION and k >= S.MANY_KV_BLOCKS * block for q, k in p.seqs)


def long_reduction_sink(p: RaggedParams) -> bool:
    """A bfloat16 sequence whose query rows see its sink and many kv blocks after it, at the
    scale the sink's margins are drawn for, with nothing that caps or hides the sink's
    logit: where a softmax denominator held in the value dtype loses those blocks."""
    block = p.kv_block_pages * p.page_size
    return (p.dtype == "bfloat16" and p.values == S.SINK and S.sink_scale(p.sm_scale, p.shapes.head_dim)
            and p.sliding_window is None and p.soft_cap is None and p.k_scale in (None, 1.0)
            and any(q > 1 and k >= S.SINK_KV_BLOCKS * block for q, k in p.seqs))


def rows_end_in_different_kv_blocks(p: RaggedParams) -> bool:
    """One grid step holds two consecutive query rows of a sequence whose last visible keys
    lie in different kv blocks: the step processes the later row's last block, which is
    wholly masked for the earlier row. The online softmax must carry that row's running
    max through it; one that takes the block's max instead sinks to the mask value, and
    rescales by exp(max - mask value)."""
    block = p.kv_block_pages * p.page_size
    token = 0
    for q_len, kv_len in p.seqs:
        for row in range(q_len - 1):
            last_key = kv_len - q_len + row  # causal: row r sees keys 0..kv_len - q_len + r
            same_step = (token + row) // p.q_block_tokens == (token + row + 1) // p.q_block_tokens
            if same_step and last_key // block != (last_key + 1) // block:
                return True
        token += q_len
    return False


def _padding_rows(case, inputs) -> dict[str, np.ndarray]:
    """The output rows of tokens past cu_q_lens[num_seqs]."""
    tokens = np.arange(case.params.shapes.max_tokens)
    return {"out": (tokens >= inputs["cu_q_lens"][inputs["num_seqs"][0]])[:, None, None]}


K_SCALE = bugclasses.numbers("k_scale", lambda p: p.k_scale, ("in (0, 1)", "one", "above 1"))
KV_DTYPE = bugclasses.partition("kv_dtype", as_q=lambda p: p.kv_dtype == p.dtype,
                                other_float=lambda p: p.kv_dtype != p.dtype and p.kv_dtype in S.DTYPES,
                                quantized=lambda p: p.kv_dtype not in S.DTYPES)


def _kv_span(p: RaggedParams) -> set[str]:
    """Where the sequences' keys end against the kv blocks: within the first, on a block's
    edge after it, inside a later one."""
    block = p.kv_block_pages * p.page_size
    return {"first_block" if k <= block else "later_block_edge" if k % block == 0 else "inside_later_block"
            for _, k in p.seqs if k}


# Crossed pairwise: the kv block, where the keys end in it, the kv dtype and the query
# heads against the kv heads; and the quantized kv dtypes with their scales.
PAIRS = bugclasses.pairwise(
    bugclasses.partition("kv_block", one_page=lambda p: p.kv_block_pages == 1,
                         several_pages=lambda p: p.kv_block_pages > 1),
    bugclasses.partition("kv_span", **{span: (lambda p, span=span: span in _kv_span(p))
                                       for span in ("first_block", "later_block_edge", "inside_later_block")}),
    KV_DTYPE,
    bugclasses.partition("heads", mha=lambda p: p.num_q_heads == p.num_kv_heads,
                         gqa=lambda p: p.num_q_heads > p.num_kv_heads),
) + bugclasses.pairwise(KV_DTYPE, K_SCALE)


class RaggedSpec(KernelSpec[RaggedParams]):
    name = FAMILY
    fixed_parameters = {
        **{f"{name}.dtype": "the kernel requires int32 metadata (an invalid call pins the rejection)"
           for name in ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")},
        "num_seqs.shape[0]": "num_seqs is one int32 by the convention",
        **parameters.outside_convention("soft_cap", ("negative", "zero"), SOFT_CAP_IS_POSITIVE),
        **parameters.outside_convention("k_scale", ("negative", "zero"), KV_SCALE_IS_POSITIVE),
        **parameters.outside_convention("v_scale", ("negative", "zero"), KV_SCALE_IS_POSITIVE),
        **parameters.outside_convention("mask_value", ("*",), MASK_VALUE_UNDERFLOWS),
    }
    params_type = RaggedParams
    directions = {"out": ("token", "q_head", "dim")}
    default_impls = {"builtin": "attncheck_kernels.ragged_paged_attention:ragged_paged_attention"}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    bug_classes = bugclasses.bug_classes(
        decode=_has_seq("decode"),
        chunked_prefill=_has_seq("chunked_prefill"),
        full_prefill=_has_seq("full_prefill"),
        zero_length_seq=_has_seq("zero_length_seq"),
        num_seqs_lt_max=lambda p: len(p.seqs) < p.shapes.max_seqs,
        kv_len_not_page_multiple=lambda p: any(k % p.page_size for _, k in p.seqs),
        pages_per_seq_not_block_multiple=lambda p: p.shapes.pages_per_seq % p.kv_block_pages != 0,
        # Every case poisons padding with NaN and shuffles its page table.
        nan_padding=lambda p: True,
        shuffled_pages=lambda p: True,
        gqa=lambda p: p.num_q_heads > p.num_kv_heads,
        window_lt_block=lambda p: p.sliding_window is not None and p.sliding_window < p.kv_block_pages * p.page_size,
        window_gt_kv_len=lambda p: p.sliding_window is not None and p.sliding_window > max(k for _, k in p.seqs),
        # Some query has a key exactly `window` positions back, which the window must hide:
        # without it the window's boundary (< vs <=) is never tested.
        window_clips_keys=lambda p: p.sliding_window is not None and any(k > p.sliding_window for q, k in p.seqs if q),
        soft_cap=_with_several_keys(lambda p: p.soft_cap is not None),
        kv_scales=_with_several_keys(lambda p: p.k_scale is not None),
        # One kv scale without the other, the cache's dtype not the queries': the scaled
        # operand is computed in the query dtype, and so must the other be.
        one_kv_scale_cache_unlike_queries=lambda p: ((p.k_scale is None) != (p.v_scale is None)
                                                     and p.kv_dtype != p.dtype),
        several_kv_head_blocks=lambda p: p.num_kv_heads >= 8 and p.kv_dtype == "float32" == p.dtype,
        kv_scales_not_powers_of_two=_with_several_keys(lambda p: p.k_scale is not None
                                                       and math.frexp(p.k_scale)[0] != 0.5),
        bf16=_with_several_keys(lambda p: p.dtype == "bfloat16"),
        packed_kv=_with_several_keys(lambda p: p.kv_dtype not in S.DTYPES),
        q_len_ne_kv_len=lambda p: any(0 < q != k for q, k in p.seqs),
        # The online softmax rescales its normaliser and accumulator only where the running
        # max rises in a later kv block; several queries also put early ones fully masked
        # in a block their later ones see.
        softmax_spans_kv_blocks=lambda p: (any(q >= 2 for q, _ in p.seqs)
                                           and expected_max_rises(p, p.kv_block_pages * p.page_size) >= 3),
        # A grid step owns a block of consecutive query tokens: where two sequences share
        # one, the softmax state must restart at the sequence boundary, not the step's.
        seqs_share_q_block=seqs_share_a_q_block,
        rows_end_in_different_kv_blocks=rows_end_in_different_kv_blocks,
        # The kernel's documented contracts, each where it can be observed.
        rows_past_the_last_sequence=lambda p: sum(q for q, _ in p.seqs) < p.shapes.max_tokens,
        empty_seq_before_another=empty_seq_before_another,
        partial_last_q_block=lambda p: p.num_queries_per_block is not None
        and p.shapes.max_tokens % p.num_queries_per_block != 0,
        compact_layout=lambda p: p.layout == "compact",
        long_reduction_offset_values=long_reduction_offset_values,
        long_reduction_sink=long_reduction_sink,
        explicit_mask_value=lambda p: p.mask_value is not None and some_query_sees_several_keys(p),
    ) + (bugclasses.numbers("sm_scale", lambda p: p.sm_scale, parameters.NUMBER_CELLS).classes
         + bugclasses.numbers("soft_cap", lambda p: p.soft_cap, ("in (0, 1)", "one", "above 1")).classes
         + K_SCALE.classes + bugclasses.numbers("v_scale", lambda p: p.v_scale, ("in (0, 1)", "one", "above 1")).classes
         + PAIRS + values_by_dtype(VALUE_KINDS)
         + bugclasses.presences(k_scale=lambda p: p.k_scale is not None, v_scale=lambda p: p.v_scale is not None,
                                sliding_window=lambda p: p.sliding_window is not None,
                                soft_cap=lambda p: p.soft_cap is not None))
    examples = {"interpret": 26, "interpret-hazards": 6, "tpu-lower": 4, "tpu": 36}
    # Every condition of the class at once is a rare draw. 16 query rows of 2 heads: 32
    # margins, a step of 0.65 logits across the sink's window.
    explicit_examples = {"long_reduction_sink": Case(FAMILY, RaggedParams(
        dtype="bfloat16", kv_dtype="bfloat16", page_size=16, num_q_heads=2, num_kv_heads=2,
        seqs=((16, S.MANY_KV_BLOCKS * 16),), sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
        sm_scale=128 ** -0.5, num_kv_pages_per_block=1, num_queries_per_block=None, padding="repeat_last",
        values=S.SINK, layout="long"), 0)}
    contracts = (FLOAT32_ACCUMULATION,
        Contract("padding_rows_are_zero", "output rows of tokens that belong to no sequence (past "
                 "cu_q_lens[num_seqs]) are zeros (this family's kernel promises it; an implementation that leaves them "
                 "undefined declares it not promised)", elements=_padding_rows),
        Contract("mask_value_and_padding", "an explicit mask_value must underflow like the default (the docstring: "
                 "a larger one is block-size dependent); unused pages, page tails and padding tokens hold NaN and must "
                 "not leak"))

    def cases(self):
        return ragged_cases()

    def inputs(self, case):
        p = case.params
        rng = np.random.default_rng(case.seed)
        q_dt, kv_dt = S.dtype_of(p.dtype), KV_DTYPES[p.kv_dtype]
        seqs, page_size = p.seqs, p.page_size
        hq, hkv = p.num_q_heads, p.num_kv_heads
        num_seqs = len(seqs)
        shapes = p.shapes
        q_lens = np.array([q for q, _ in seqs] + [0] * (shapes.max_seqs - num_seqs))
        kv_lens = np.array([k for _, k in seqs] + [0] * (shapes.max_seqs - num_seqs), dtype=np.int32)
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        spread = S.LARGE_LOGIT_STD if p.values == "large" else 1.0
        queries = rng.standard_normal((shapes.max_tokens, hq, shapes.head_dim)) * spread
        if p.values == S.SINK:
            queries += S.sink_margins(shapes.max_tokens * hq).reshape(shapes.max_tokens, hq, 1)
        queries[cu[num_seqs]:] = np.nan  # padding tokens
        # Pages: a shuffled, non-contiguous allocation; everything unallocated is poison.
        order = rng.permutation(shapes.total_pages)
        page_indices = rng.integers(-3, 3 * shapes.total_pages,
                                    size=(shapes.max_seqs, shapes.pages_per_seq)).astype(np.int32)
        kv = np.full((shapes.total_pages, page_size, 2 * hkv, shapes.head_dim), _poison(kv_dt), dtype=np.float64)
        used = 0
        for s, (_, kv_len) in enumerate(seqs):
            pages = -(-kv_len // page_size)
            page_indices[s, :pages] = order[used:used + pages]
            used += pages
            for page in range(pages):
                rows = min(page_size, kv_len - page * page_size)
                kv[order[used - pages + page], :rows] = rng.standard_normal((rows, 2 * hkv, shapes.head_dim))
        kv[:, :, 0::2] *= spread  # K only: large logits
        if p.values == S.SINK:
            for s, (_, kv_len) in enumerate(seqs):
                if kv_len:
                    kv[page_indices[s, 0], 0, 0::2] += S.sink_key(shapes.head_dim)
        if p.values == "offset":
            kv[:, :, 1::2] += S.V_OFFSET  # V only (poison stays poison)
        if kv_dt == np.int8:
            kv = np.where(np.isnan(kv), 127, np.clip(np.round(kv * 30), -127, 127))
        _pad_metadata(p.padding, rng, kv_lens, cu, num_seqs)
        return {"queries": S.round_to(queries, q_dt), "kv_pages": kv.astype(np.float32).astype(kv_dt),
                "kv_lens": kv_lens, "page_indices": page_indices, "cu_q_lens": cu,
                "num_seqs": np.array([num_seqs], dtype=np.int32)}

    @staticmethod
    def _options(p: RaggedParams):
        return dict(sm_scale=p.sm_scale, sliding_window=p.sliding_window, soft_cap=p.soft_cap,
                    k_scale=p.k_scale, v_scale=p.v_scale)

    def _call(self, impl, p: RaggedParams):
        knobs = accepted_keywords(impl, mask_value=p.mask_value, vmem_limit_bytes=p.vmem_limit_bytes)
        return lambda *args: impl(*args, **self._options(p), num_kv_pages_per_block=p.num_kv_pages_per_block,
                                  num_queries_per_block=p.num_queries_per_block, **knobs)

    def _args(self, inputs):
        return tuple(inputs[n] for n in ARRAY_ARGS)

    def evaluate(self, impl, case, inputs):
        # Called eagerly: the kernel validates concrete metadata, then runs its own jit.
        return {"out": np.asarray(self._call(impl, case.params)(*self._args(inputs)))}

    def lower(self, impl, case):
        args = self._args(self.inputs(case))
        return {"lower-fwd": lambda: backends.export_for_tpu(self._call(impl, case.params), *args)}

    def oracle(self, case, inputs):
        return {"out": oracle.ragged_paged_attention(*self._args(inputs), **self._options(case.params)).out}

    def yardstick(self, case, inputs):
        """Dense XLA attention over every sequence's gathered keys, in working precision."""
        p = case.params
        seqs, page_size, shapes = p.seqs, p.page_size, p.shapes
        capacity = page_size * shapes.pages_per_seq
        q_dt = S.dtype_of(p.dtype)
        kv = np.zeros((shapes.max_seqs * capacity,) + inputs["kv_pages"].shape[2:], dtype=np.float32)
        q_pos = np.full(shapes.max_tokens, -1)
        kv_pos = np.full(shapes.max_seqs * capacity, 1 << 30)
        seq_of_token = np.full(shapes.max_tokens, -1)
        seq_of_key = np.repeat(np.arange(shapes.max_seqs), capacity)
        cu = inputs["cu_q_lens"]
        for s, (q_len, kv_len) in enumerate(seqs):
            pages = inputs["page_indices"][s, : -(-kv_len // page_size)]
            gathered = inputs["kv_pages"][pages].reshape((-1,) + kv.shape[1:])[:kv_len]
            kv[s * capacity: s * capacity + kv_len] = gathered.astype(np.float32)
            kv_pos[s * capacity: s * capacity + kv_len] = np.arange(kv_len)
            q_pos[cu[s]: cu[s] + q_len] = kv_len - q_len + np.arange(q_len)
            seq_of_token[cu[s]: cu[s] + q_len] = s
        k, v = kv[:, 0::2], kv[:, 1::2]
        k_dt = _kv_compute_dtype(q_dt, inputs["kv_pages"].dtype, p.k_scale)
        v_dt = _kv_compute_dtype(q_dt, inputs["kv_pages"].dtype, p.v_scale)
        k = (k * (1.0 if p.k_scale is None else p.k_scale)).astype(k_dt)
        v = (v * (1.0 if p.v_scale is None else p.v_scale)).astype(v_dt)
        visible = yardstick.visibility(q_pos, kv_pos, causal=True, window=p.sliding_window,
                                      q_segment_ids=seq_of_token[None], kv_segment_ids=seq_of_key[None])
        queries = np.nan_to_num(inputs["queries"]).transpose(1, 0, 2)[None]
        out = yardstick.attention(queries, k.transpose(1, 0, 2)[None].astype(q_dt),
                                 v.transpose(1, 0, 2)[None], scale=p.sm_scale, visible=visible,
                                 soft_cap=p.soft_cap, masked_rows="zero")
        return {"out": np.asarray(out)[0].transpose(1, 0, 2).astype(q_dt)}

    def error_map_layout(self, case, direction):
        # Tokens x query heads: the q blocks of the grid, where each sequence's tokens end
        # (a softmax state carried over a sequence boundary shows below it), and which q
        # heads share a kv head (a GQA mix-up shows as a wrong group).
        p = case.params
        ends = tuple(int(e) for e in np.cumsum([q_len for q_len, _ in p.seqs]))
        return ErrorMapLayout(self.index_names(direction), 0, 1,
                              (every("q block", p.q_block_tokens, p.shapes.max_tokens), ("sequence end", ends)),
                              (every("kv head", p.num_q_heads // p.num_kv_heads, p.num_q_heads),))

    def invalid_calls(self, impl):
        return invalid_ragged_calls(impl)


def _pad_metadata(padding: str, rng, kv_lens, cu, num_seqs) -> None:
    """Metadata past num_seqs is padding the kernel must not trust."""
    if padding == "minus_one":
        kv_lens[num_seqs:] = -1
        cu[num_seqs + 1:] = -1
    elif padding == "garbage":
        kv_lens[num_seqs:] = rng.integers(0, 10**6, size=len(kv_lens) - num_seqs)
        cu[num_seqs + 1:] = rng.integers(0, 10**6, size=len(kv_lens) - num_seqs)


def _kv_compute_dtype(q_dtype, kv_dtype, scale):
    """The dtype the kernel computes K or V in: the query dtype for scaled or packed caches,
    else the promotion of the two (the convention of the seed's reference)."""
    if scale is not None or np.dtype(kv_dtype) not in S.DTYPES.values():
        return np.dtype(q_dtype)
    return np.promote_types(q_dtype, kv_dtype)


def invalid_ragged_calls(impl) -> list[InvalidCall]:
    page_size, pages, seqs, tokens, hq, hkv = 16, 8, 2, 16, 4, 2
    good = dict(queries=np.zeros((tokens, hq, HEAD_DIM), np.float32),
                kv_pages=np.zeros((pages * seqs, page_size, 2 * hkv, HEAD_DIM), np.float32),
                kv_lens=np.array([8, 8], np.int32),
                page_indices=np.arange(pages * seqs, dtype=np.int32).reshape(seqs, pages),
                cu_q_lens=np.array([0, 4, 8], np.int32), num_seqs=np.array([2], np.int32))
    bad = {
        "q_len_gt_kv_len": (dict(kv_lens=np.array([2, 8], np.int32)), r"q_len|kv_len"),
        "num_seqs_gt_max": (dict(num_seqs=np.array([3], np.int32)), r"num_seqs"),
        "kv_len_past_page_table": (dict(kv_lens=np.array([8, pages * page_size + 1], np.int32)), r"kv_len|pages"),
        "page_index_out_of_range": (dict(page_indices=np.full((seqs, pages), pages * seqs + 5, np.int32)),
                                    r"page_ind"),
        "metadata_not_int32": (dict(kv_lens=np.array([8, 8], np.int64)), r"kv_lens"),
        "cu_q_lens_decreasing": (dict(cu_q_lens=np.array([0, 6, 4], np.int32)), r"cu_q_lens"),
        "cu_q_lens_past_tokens": (dict(cu_q_lens=np.array([0, 4, tokens + 8], np.int32),
                                       kv_lens=np.array([8, 32], np.int32)), r"cu_q_lens"),
        "odd_combined_heads": (dict(kv_pages=np.zeros((pages * seqs, page_size, 3, HEAD_DIM), np.float32)),
                               r"kv_pages|heads"),
        "head_dim_mismatch": (dict(queries=np.zeros((tokens, hq, 64), np.float32)), r"head_dim|queries"),
        "q_heads_not_multiple": (dict(queries=np.zeros((tokens, 3, HEAD_DIM), np.float32)), r"heads"),
        "unsupported_kv_dtype": (dict(kv_pages=np.zeros((pages * seqs, page_size, 2 * hkv, HEAD_DIM), np.float16)),
                                 r"kv_pages"),
        "metadata_not_array": (dict(kv_lens=[8, 8]), r"kv_lens"),
        "queries_rank": (dict(queries=np.zeros((tokens, hq * HEAD_DIM), np.float32)), r"queries"),
        "unsupported_q_dtype": (dict(queries=np.zeros((tokens, hq, HEAD_DIM), np.float16)), r"queries"),
        "num_seqs_shape": (dict(num_seqs=np.array([2, 2], np.int32)), r"num_seqs"),
        "no_query_tokens": (dict(queries=np.zeros((0, hq, HEAD_DIM), np.float32)), r"queries"),
        "empty_page_table": (dict(page_indices=np.zeros((seqs, 0), np.int32)), r"page_indices"),
        "no_kv_pages": (dict(kv_pages=np.zeros((0, page_size, 2 * hkv, HEAD_DIM), np.float32)), r"kv_pages"),
        "kv_heads_not_tileable": (dict(queries=np.zeros((tokens, 6, HEAD_DIM), np.float32),
                                       kv_pages=np.zeros((pages * seqs, page_size, 6, HEAD_DIM), np.float32)),
                                  r"kv_pages"),
        "kv_lens_shape": (dict(kv_lens=np.array([8, 8, 8], np.int32)), r"kv_lens"),
        "cu_q_lens_shape": (dict(cu_q_lens=np.array([0, 4], np.int32)), r"cu_q_lens"),
        "cu_q_lens_negative_start": (dict(cu_q_lens=np.array([-1, 4, 8], np.int32)), r"cu_q_lens"),
        "kv_lens_negative": (dict(kv_lens=np.array([-1, 8], np.int32), cu_q_lens=np.array([0, 0, 4], np.int32)),
                             r"kv_lens"),
    }
    options = {
        "window_zero": (dict(sliding_window=0), r"sliding_window"),
        "soft_cap_zero": (dict(soft_cap=0.0), r"soft_cap"),
        "kv_block_zero": (dict(num_kv_pages_per_block=0), r"num_kv_pages_per_block"),
        "query_block_not_int": (dict(num_queries_per_block=2.5), r"num_queries_per_block"),
        "soft_cap_not_number": (dict(soft_cap="1.0"), r"soft_cap"),
        "sm_scale_not_finite": (dict(sm_scale=float("inf")), r"sm_scale"),
        "mask_value_not_negative": (dict(mask_value=0.0), r"mask_value"),
    }

    return positional_invalid_calls(impl, ARRAY_ARGS, good, bad, options, sm_scale=0.1)


SPEC = RaggedSpec()
