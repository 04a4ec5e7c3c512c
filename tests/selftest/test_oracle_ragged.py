"""Self-tests of the ragged paged attention oracle.

The reference here never sees a page: it attends from contiguous per-sequence K/V,
with the mask written as the v2 seed writes it (masked iff q_pos < kv_pos or
q_pos - sliding_window >= kv_pos). The paged problem is laid out from the same
K/V with K at even and V at odd combined heads, and every byte the kernel must not
read (page tails, spare pages and slots, rows and sequences past num_seqs) holds
garbage: NaN, out-of-range page numbers, impossible lengths.
"""

import dataclasses

import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from attncheck import oracle

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOAT64_TOL = dict(rtol=1e-12, atol=1e-12)
MAX_LEN = 9
# Lengths past what any page table here could hold, and page numbers past any cache.
GARBAGE_LEN = 2**31 - 1
GARBAGE_PAGE = 10**6


@dataclasses.dataclass(frozen=True)
class Spec:
    q_lens: tuple  # one per live sequence (num_seqs of them)
    kv_lens: tuple
    max_num_seqs: int
    page_size: int
    kv_heads: int
    q_heads: int
    head_dim: int
    spare_tokens: int  # query rows past cu_q_lens[num_seqs]
    spare_slots: int  # page-table columns past the longest sequence's need
    spare_pages: int  # pages no live sequence owns
    options: dict  # sm_scale, sliding_window, soft_cap, k_scale, v_scale
    seed: int


@dataclasses.dataclass(frozen=True)
class Problem:
    args: tuple  # queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs
    keys: list  # contiguous [kv_len, Hkv, D] per live sequence
    values: list


def _sequence_lengths(draw, kind):
    if kind == "empty":
        return 0, draw(st.integers(0, MAX_LEN))
    kv_len = draw(st.integers(1, MAX_LEN))
    return {"decode": 1, "chunked_prefill": draw(st.integers(1, kv_len)), "prefill": kv_len}[kind], kv_len


@st.composite
def specs(draw):
    kinds = draw(st.lists(st.sampled_from(["decode", "chunked_prefill", "prefill", "empty"]), max_size=4))
    q_lens, kv_lens = zip(*[_sequence_lengths(draw, kind) for kind in kinds]) if kinds else ((), ())
    kv_heads = draw(st.integers(1, 2))
    return Spec(
        q_lens=q_lens,
        kv_lens=kv_lens,
        max_num_seqs=max(1, len(kinds)) + draw(st.integers(0, 2)),
        page_size=draw(st.integers(1, 4)),
        kv_heads=kv_heads,
        q_heads=kv_heads * draw(st.integers(1, 4 // kv_heads)),
        head_dim=draw(st.integers(1, 8)),
        spare_tokens=draw(st.integers(0, 3)),
        spare_slots=draw(st.integers(0, 2)),
        spare_pages=draw(st.integers(0, 3)),
        options=dict(
            sm_scale=draw(st.floats(0.1, 1.5)),
            sliding_window=draw(st.none() | st.integers(1, MAX_LEN)),
            soft_cap=draw(st.none() | st.floats(0.5, 5.0)),
            k_scale=draw(st.none() | st.floats(0.25, 2.0)),
            v_scale=draw(st.none() | st.floats(0.25, 2.0)),
        ),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def build(spec, *, shuffle_pages, filler):
    """The paged problem; `filler` goes everywhere the kernel must not read."""
    rng = np.random.default_rng(spec.seed)
    keys = [rng.normal(size=(n, spec.kv_heads, spec.head_dim)) for n in spec.kv_lens]
    values = [rng.normal(size=(n, spec.kv_heads, spec.head_dim)) for n in spec.kv_lens]
    live_tokens = sum(spec.q_lens)
    queries = np.full((live_tokens + spec.spare_tokens, spec.q_heads, spec.head_dim), filler)
    queries[:live_tokens] = rng.normal(size=(live_tokens, spec.q_heads, spec.head_dim))

    pages_needed = [-(-n // spec.page_size) for n in spec.kv_lens]
    total_pages = sum(pages_needed) + spec.spare_pages
    order = rng.permutation(total_pages) if shuffle_pages else np.arange(total_pages)
    spare = order[sum(pages_needed):]
    # Slots no live sequence needs point at spare (filler) pages or past the cache.
    garbage = np.concatenate([spare, [-1, total_pages + GARBAGE_PAGE]])
    page_indices = rng.choice(garbage, size=(spec.max_num_seqs, max(pages_needed, default=0) + spec.spare_slots + 1))
    kv_pages = np.full((total_pages, spec.page_size, 2 * spec.kv_heads, spec.head_dim), filler)
    first = 0
    for s, (k, v) in enumerate(zip(keys, values)):
        pages = order[first:first + pages_needed[s]]
        first += pages_needed[s]
        page_indices[s, :len(pages)] = pages
        for t in range(len(k)):
            page, slot = pages[t // spec.page_size], t % spec.page_size
            kv_pages[page, slot, 0::2] = k[t]
            kv_pages[page, slot, 1::2] = v[t]

    num_seqs = len(spec.q_lens)
    kv_lens = np.full(spec.max_num_seqs, GARBAGE_LEN)
    kv_lens[:num_seqs] = spec.kv_lens
    cu_q_lens = np.zeros(spec.max_num_seqs + 1)  # zeros past num_seqs: not non-decreasing, never read
    cu_q_lens[1:num_seqs + 1] = np.cumsum(spec.q_lens)
    args = (queries, kv_pages, *(np.asarray(x, dtype=np.int32) for x in (kv_lens, page_indices, cu_q_lens, [num_seqs])))
    return Problem(args, keys, values)


def per_sequence_reference(spec, problem):
    """Attention from the contiguous K/V, one query row and head at a time."""
    o = spec.options
    k_scale = 1.0 if o["k_scale"] is None else o["k_scale"]
    v_scale = 1.0 if o["v_scale"] is None else o["v_scale"]
    queries = problem.args[0]
    out = np.zeros(queries.shape)
    start = 0
    for q_len, kv_len, keys, values in zip(spec.q_lens, spec.kv_lens, problem.keys, problem.values):
        q_span = kv_len - q_len + np.arange(q_len)[:, None]
        kv_span = np.arange(kv_len)[None, :]
        masked = q_span < kv_span
        if o["sliding_window"] is not None:
            masked |= q_span - o["sliding_window"] >= kv_span
        for i, h in np.ndindex(q_len, spec.q_heads):
            kv_head, keep = h // (spec.q_heads // spec.kv_heads), ~masked[i]
            logits = o["sm_scale"] * (keys[keep, kv_head] * k_scale) @ queries[start + i, h]
            if o["soft_cap"] is not None:
                logits = o["soft_cap"] * np.tanh(logits / o["soft_cap"])
            weights = np.exp(logits - logits.max())
            out[start + i, h] = weights @ (values[keep, kv_head] * v_scale) / weights.sum()
        start += q_len
    return out


def check_against_reference(spec):
    problem = build(spec, shuffle_pages=True, filler=np.nan)
    result = oracle.ragged_paged_attention(*problem.args, **spec.options)
    np.testing.assert_allclose(result.out, per_sequence_reference(spec, problem), **FLOAT64_TOL)
    np.testing.assert_array_equal(result.valid_rows, np.arange(len(result.out)) < sum(spec.q_lens))
    np.testing.assert_array_equal(result.out[~result.valid_rows], 0.0)


@EXAMPLES
@given(specs())
def test_matches_per_sequence_reference_on_contiguous_kv(spec):
    check_against_reference(spec)


@EXAMPLES
@given(specs())
def test_page_order_and_unread_contents_do_not_matter(spec):
    scattered = build(spec, shuffle_pages=True, filler=np.nan)
    contiguous = build(spec, shuffle_pages=False, filler=0.0)
    np.testing.assert_array_equal(oracle.ragged_paged_attention(*scattered.args, **spec.options).out,
                                  oracle.ragged_paged_attention(*contiguous.args, **spec.options).out)


def _spec(q_lens, kv_lens, *, max_num_seqs=None, sliding_window=None, soft_cap=None):
    return Spec(q_lens=q_lens, kv_lens=kv_lens, max_num_seqs=max_num_seqs or len(q_lens), page_size=3, kv_heads=2,
                q_heads=4, head_dim=5, spare_tokens=2, spare_slots=1, spare_pages=2,
                options=dict(sm_scale=0.4, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=0.5, v_scale=2.0),
                seed=7)


@pytest.mark.parametrize("spec", [
    pytest.param(_spec((1, 1, 1), (5, 1, 9)), id="decode"),
    pytest.param(_spec((3, 4), (8, 4), sliding_window=3), id="chunked_prefill"),
    pytest.param(_spec((6, 2), (6, 2), soft_cap=2.0), id="full_prefill"),
    pytest.param(_spec((0, 2, 0), (0, 5, 4)), id="zero_length_sequences"),
    pytest.param(_spec((2, 1), (4, 7), max_num_seqs=5), id="num_seqs_below_max_num_seqs"),
    pytest.param(_spec((), (), max_num_seqs=2), id="no_sequences"),
])
def test_serving_scenarios(spec):
    check_against_reference(spec)


def test_low_precision_pages_are_upcast_exactly():
    spec = _spec((2, 1), (4, 7))
    problem = build(spec, shuffle_pages=True, filler=np.nan)
    queries, kv_pages, *tables = problem.args
    low = (queries.astype(ml_dtypes.bfloat16), kv_pages.astype(ml_dtypes.bfloat16))
    exact = [np.asarray(x, dtype=np.float64) for x in low]
    np.testing.assert_array_equal(oracle.ragged_paged_attention(*low, *tables, **spec.options).out,
                                  oracle.ragged_paged_attention(*exact, *tables, **spec.options).out)


def _valid_problem():
    """Two live sequences (q_len, kv_len) = (2, 3) and (1, 4), page_size 2, max_num_seqs 3."""
    def i32(x):
        return np.array(x, dtype=np.int32)

    return dict(queries=np.zeros((4, 2, 4)), kv_pages=np.zeros((5, 2, 2, 4)), kv_lens=i32([3, 4, 0]),
                page_indices=i32([[0, 1], [2, 3], [4, 4]]), cu_q_lens=i32([0, 2, 3, 3]), num_seqs=i32([2]),
                sm_scale=0.5)


@pytest.mark.parametrize("override, match", [
    (dict(queries=np.zeros((4, 8))), r"^queries: expected 3-D"),
    (dict(queries=np.zeros((4, 2, 4), np.int8)), r"^queries: expected a floating-point array"),
    (dict(kv_pages=np.zeros((5, 2, 3, 4))), r"^kv_pages: expected 4-D \[total_pages, page_size, 2 \* Hkv, D\]"),
    (dict(kv_pages=np.zeros((5, 2, 2, 3))), r"^kv_pages: .*D=4 matching queries"),
    (dict(kv_pages=np.zeros((5, 2, 6, 4))), r"^kv_pages: .*Hkv dividing Hq=2"),
    (dict(kv_pages=np.zeros((5, 2, 2, 4), np.int32)), r"^kv_pages: expected a floating-point array"),
    (dict(page_indices=np.zeros(6, np.int32)), r"^page_indices: expected 2-D"),
    (dict(kv_lens=np.zeros(2, np.int32)), r"^kv_lens: expected shape \[max_num_seqs\] = \(3,\)"),
    (dict(cu_q_lens=np.zeros(3, np.int32)), r"^cu_q_lens: expected shape \[max_num_seqs \+ 1\] = \(4,\)"),
    (dict(cu_q_lens=np.zeros(4)), r"^cu_q_lens: expected an integer array"),
    (dict(num_seqs=np.array([4], np.int32)), r"^num_seqs: expected 0 <= num_seqs <= max_num_seqs = 3"),
    (dict(num_seqs=np.array([1, 1], np.int32)), r"^num_seqs: expected an int or a shape \(1,\)"),
    (dict(cu_q_lens=np.array([0, 2, 1, 3], np.int32)), r"^cu_q_lens: expected .*non-decreasing"),
    (dict(cu_q_lens=np.array([1, 2, 3, 3], np.int32)), r"^cu_q_lens: expected .*from 0"),
    (dict(cu_q_lens=np.array([0, 2, 5, 5], np.int32)), r"^cu_q_lens: expected .*at most max_num_batched_tokens = 4"),
    (dict(kv_lens=np.array([1, 4, 0], np.int32)), r"^kv_lens: expected kv_lens\[0\] >= q_len = 2"),
    (dict(kv_lens=np.array([3, 5, 0], np.int32)), r"^page_indices: expected at least 3 page slots .*kv_lens\[1\] = 5"),
    (dict(page_indices=np.array([[0, 5], [2, 3], [4, 4]], np.int32)),
     r"^page_indices: expected page_indices\[0, :2\] in \[0, 5\)"),
    (dict(page_indices=np.array([[0, 1], [-1, 3], [4, 4]], np.int32)),
     r"^page_indices: expected page_indices\[1, :2\] in"),
    (dict(sliding_window=0), r"^sliding_window: "),
    (dict(soft_cap=-1.0), r"^soft_cap: .*positive"),
    (dict(sm_scale=float("inf")), r"^sm_scale: "),
    (dict(k_scale=[1.0]), r"^k_scale: "),
])
def test_invalid_input_raises_naming_the_argument(override, match):
    with pytest.raises(ValueError, match=match):
        oracle.ragged_paged_attention(**_valid_problem() | override)
