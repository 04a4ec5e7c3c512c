"""Ragged paged attention v3 family: tpu-inference's ``ragged_paged_attention(queries, keys,
values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *, sm_scale,
sliding_window, soft_cap, q_scale, k_scale, v_scale, chunk_prefill_size, d_block_sizes,
p_block_sizes, m_block_sizes) -> (out, kv_cache)`` (``v3/kernel.py``), forward only.

Its own convention, not v2's: the new tokens' K/V come as arrays and are written into the
cache by the kernel, the cache has the packed layout of ``get_kv_cache_shape`` (combined
K/V heads grouped in 32-bit words, head_dim padded to 128), the page table is flat, and
``distribution`` splits the sequences into decode, chunked prefill and mixed, each run as
its own kernel. Both results are judged: ``out`` against the float64 oracle, the updated
``kv_cache`` exactly (``exact_directions``): the new tokens' slots hold their K/V, nothing
else changes. Everything the kernel must not read holds NaN: unused pages, page tails past
kv_len, the slots the new tokens are written to (read before written: NaN), and the
padding tokens' queries, keys and values (written into the cache: NaN where none belongs).

The repository ships no v3 kernel: the family runs with ``--attncheck-impl
ragged_paged_attention_v3=<module:function>``, e.g. the wheel's kernel through
``attncheck.third_party.tpu_inference:ragged_paged_attention_v3`` (docs/DESIGN.md says why).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from attncheck import backends, bugclasses, domain, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.expectations import Contract
from attncheck.oracle.ragged_v3 import merged, packing
from attncheck.layouts import ErrorMapLayout, every
from attncheck.specs.base import (MASK_VALUE_UNDERFLOWS, SOFT_CAP_IS_POSITIVE, InvalidCall, KernelSpec,
                                  accepted_keywords, positional_invalid_calls)

FAMILY = "ragged_paged_attention_v3"
ARRAY_ARGS = ("queries", "keys", "values", "kv_cache", "kv_lens", "page_indices", "cu_q_lens", "distribution")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static buffer shapes of a case."""

    max_tokens: int
    max_seqs: int
    pages_per_seq: int
    total_pages: int


LAYOUTS = {"standard": Layout(max_tokens=32, max_seqs=4, pages_per_seq=8, total_pages=40),
           "compact": Layout(max_tokens=24, max_seqs=3, pages_per_seq=6, total_pages=24),
           "wide": Layout(max_tokens=64, max_seqs=6, pages_per_seq=12, total_pages=80)}
LAYOUT_NAMES = S.Shapes(ci=("standard", "compact"), nightly=tuple(LAYOUTS))
PAGE_SIZES = S.Shapes(ci=(8, 16), nightly=(8, 16, 32))
# 64 (padded to 128 lanes in the cache), 128, and 256 (two lane tiles).
HEAD_DIMS = (64, 128, 256)
# (num_q_heads, num_kv_heads): GQA ratios 1, 2, 4 and an odd kv head count, whose combined
# K/V heads (2 * Hkv) leave a partly filled 32-bit word in a packed cache.
HEAD_LAYOUTS = ((2, 2), (4, 2), (4, 1), (3, 3))
# (query dtype, cache dtype); an fp8 cache comes with its k and v scales.
DTYPE_PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float8_e4m3fn"))
KV_DTYPES = {"float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), **S.DTYPES}
CHUNK_PREFILL_SIZES = (None, 4, 8)
K_SCALES = (0.5, 0.3, 2.0)
V_SCALES = (2.0, 1.7, 0.7)
# q_scale quantizes the queries to the cache dtype: drawn with a quantized cache only.
Q_SCALES = (0.5, 1.3)
SOFT_CAPS = (None, 5.0, 0.7, 1.0)
SM_SCALES = (1.0, 1.7, 0.0, -0.5)  # besides 1/sqrt(head_dim): the scale's every cell
MASK_VALUE = -1e30  # an explicit mask value that underflows like the default
# The accumulator's dtype: the kernel's default (the queries' dtype: bfloat16 for
# bfloat16 queries), or float32.
OUT_DTYPES = (None, "float32")
# Block sizes (bq_sz, bkv_sz, bq_csz, bkv_csz) of the decode, prefill and mixed kernels:
# None leaves them to the kernel (its per-generation defaults, which cover these layouts'
# sequences in one kv block); "small" puts a sequence over several kv blocks, of several
# compute chunks, and a prefill over several q blocks.
BLOCKS = {"default": None,
          "small": {"d_block_sizes": (1, 32, 1, 16), "p_block_sizes": (4, 32, 2, 16),
                    "m_block_sizes": (8, 32, 4, 16)},
          # Compute chunks of 8 keys: for pages of 8 only.
          "tiny": {"d_block_sizes": (1, 16, 1, 8), "p_block_sizes": (2, 16, 1, 8),
                   "m_block_sizes": (4, 16, 2, 8)}}


def fits_pages(blocks: str, page_size: int) -> bool:
    """Every kv block and compute chunk of the set holds whole pages (the kernel's rule)."""
    chosen = BLOCKS[blocks]
    return chosen is None or all(size % page_size == 0 for sizes in chosen.values() for size in sizes[1::2])


KINDS = ("decode", "chunked_prefill", "mixed")


@dataclasses.dataclass(frozen=True)
class RaggedV3Params(Params):
    dtype: str  # queries and output
    kv_dtype: str  # keys, values and the cache
    head_dim: int
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len), decode then chunked prefill then mixed
    distribution: tuple[int, int, int]
    chunk_prefill_size: int | None
    sliding_window: int | None
    soft_cap: float | None
    sm_scale: float
    q_scale: float | None
    k_scale: float | None
    v_scale: float | None
    blocks: str  # a BLOCKS name
    values: str  # a S.NORMAL_AND_LARGE distribution
    layout: str = "standard"
    out_dtype: str | None = None  # an OUT_DTYPES entry
    mask_value: float | None = None
    vmem_limit_bytes: int | None = None

    @property
    def sequence_length(self) -> int:
        return max(k for _, k in self.seqs)

    @property
    def shapes(self) -> Layout:
        return LAYOUTS[self.layout]

    @property
    def cache_shape(self) -> tuple[int, ...]:
        per_word = packing(KV_DTYPES[self.kv_dtype])
        words = -(-2 * self.num_kv_heads // per_word)
        return (self.shapes.total_pages, self.page_size, words, per_word, -(-self.head_dim // 128) * 128)

    def kind_of(self, s: int) -> str:
        return KINDS[int(np.searchsorted(self.distribution, s, side="right"))]

    @property
    def kv_block(self) -> int | None:
        """Keys per kv block of the mixed kernel when the case sets it."""
        chosen = BLOCKS[self.blocks]
        return None if chosen is None else chosen["m_block_sizes"][1]


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


def _has_kind(kind: str):
    return lambda p: any(p.kind_of(s) == kind for s in range(len(p.seqs)))


def window_starts_past_first_kv_block(p: RaggedV3Params) -> bool:
    """A windowed sequence whose first visible key lies past its first kv block: the kernel
    starts its kv loop at that block, not at 0 (tpu-inference #1169: a start hard-coded
    to 0)."""
    block = p.kv_block
    return p.sliding_window is not None and block is not None and any(
        k - q - p.sliding_window >= block for q, k in p.seqs)


def windowed_new_tokens_over_several_q_blocks(p: RaggedV3Params) -> bool:
    """A windowed mixed sequence whose new tokens span several q blocks of the mixed kernel:
    each q block's kv loop starts where its own window does, and the new K/V of every block
    must still reach the cache (sglang-jax #1606: v3 skipped writing them with a window,
    while its output stayed right)."""
    chosen = BLOCKS[p.blocks]
    return p.sliding_window is not None and chosen is not None and any(
        p.kind_of(s) == "mixed" and q > chosen["m_block_sizes"][0] for s, (q, _) in enumerate(p.seqs))


_BLOCK_SIZES_OF_KIND = {"decode": "d_block_sizes", "chunked_prefill": "p_block_sizes", "mixed": "m_block_sizes"}


def inexact_mask_value_over_a_hidden_chunk(p: RaggedV3Params) -> bool:
    """A caller's mask value that the working precision (the output dtype's) rounds away from
    zero, and a windowed query whose kv loop starts a whole compute chunk before its first
    visible key: that chunk's logits are all the mask value, and a running max kept in the
    working precision lies below them (exp overflows). Block sizes the kernel picks itself
    are not known here: a chunk holds whole pages, so it may be one page, in the one kv
    block these layouts' defaults give a sequence."""
    working = p.out_dtype or ("float32" if p.dtype == "float32" else "bfloat16")
    if p.mask_value is None or p.sliding_window is None or working == "float32":
        return False
    if float(np.float32(p.mask_value).astype(S.DTYPES[working])) >= float(np.float32(p.mask_value)):
        return False
    for s, (q, k) in enumerate(p.seqs):
        chosen = BLOCKS[p.blocks]
        bq, bkv, _, bkv_csz = ((q, k, q, p.page_size) if chosen is None
                               else chosen[_BLOCK_SIZES_OF_KIND[p.kind_of(s)]])
        for first_row in range(k - q, k, bq):  # each q block's first query, the one that sees the least
            loop_start = max(first_row - p.sliding_window, 0) // bkv * bkv
            if max(first_row - p.sliding_window + 1, 0) - loop_start >= bkv_csz:
                return True
    return False


def new_tokens_cross_a_page(p: RaggedV3Params) -> bool:
    """A sequence's new tokens are written into two pages or more."""
    return any((k - q) // p.page_size != (k - 1) // p.page_size for q, k in p.seqs)


def _several_keys(predicate):
    """What changes the logits shows only where a softmax spans several keys."""
    return lambda p: any(min(p.sliding_window or np.inf, k) >= 2 for _, k in p.seqs) and predicate(p)


def _valid_rows(case, inputs) -> dict[str, np.ndarray]:
    tokens = np.arange(case.params.shapes.max_tokens)
    return {"out": (tokens < inputs["cu_q_lens"][case.params.distribution[2]])[:, None, None]}


class RaggedV3Spec(KernelSpec[RaggedV3Params]):
    name = FAMILY
    params_type = RaggedV3Params
    directions = {"out": ("token", "q_head", "dim"), "kv_cache": ("page", "slot", "word", "lane_group", "lane")}
    exact_directions = frozenset({"kv_cache"})
    default_impls = {}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    fixed_parameters = {
        **{f"{name}.dtype": "the kernel requires int32 metadata" for name in
           ("kv_lens", "page_indices", "cu_q_lens", "distribution")},
        "distribution.shape[0]": "distribution is (decode end, chunked prefill end, mixed end) by the convention",
        **parameters.outside_convention("soft_cap", ("negative", "zero"), SOFT_CAP_IS_POSITIVE),
        **parameters.outside_convention("mask_value", ("*",), MASK_VALUE_UNDERFLOWS),
        **{f"{name}": "a quantization scale is positive; its cells are drawn by the family"
           for name in ("q_scale", "k_scale", "v_scale")},
        **{f"d_block_sizes[{i}]": "a decode kernel's q block is one token" for i in (0, 2)},
        **{f"{kind}_block_sizes.len": "(bq_sz, bkv_sz, bq_csz, bkv_csz) by the convention" for kind in "dpm"},
        "debug_mode": "prints instead of computing (the kernel's docstring): not a mode to verify",
        "disable_bounds_checks": "Mosaic's own checks on a TPU; interpret mode checks every access itself",
        "disable_semaphore_checks": "Mosaic's own checks on a TPU; interpret mode checks semaphores itself",
        "skip_kv_mask": "the convention is causal attention within each sequence (the oracle's)",
        "use_causal_mask": "the convention is causal attention within each sequence (the oracle's)",
        "update_kv_cache": "KV sharing (False) reads a cache another layer wrote: outside this convention",
    }
    bug_classes = bugclasses.bug_classes(
        decode=_has_kind("decode"),
        chunked_prefill=_has_kind("chunked_prefill"),
        mixed=_has_kind("mixed"),
        decode_only=lambda p: p.distribution[0] == p.distribution[2],
        mixed_only=lambda p: p.distribution[1] == 0,
        all_three_kinds=lambda p: 0 < p.distribution[0] < p.distribution[1] < p.distribution[2],
        full_prefill=lambda p: any(q == k and q > 1 for q, k in p.seqs),
        seqs_lt_max=lambda p: len(p.seqs) < p.shapes.max_seqs,
        kv_len_on_page_edge=lambda p: any(k % p.page_size == 0 for _, k in p.seqs),
        kv_len_inside_page=lambda p: any(k % p.page_size for _, k in p.seqs),
        kv_len_on_block_edge=lambda p: p.kv_block is not None and any(k % p.kv_block == 0 for _, k in p.seqs),
        several_kv_blocks=lambda p: p.kv_block is not None and any(k > p.kv_block for _, k in p.seqs),
        new_tokens_cross_a_page=new_tokens_cross_a_page,
        window_clips_keys=lambda p: p.sliding_window is not None and any(k > p.sliding_window for _, k in p.seqs),
        window_starts_past_first_kv_block=window_starts_past_first_kv_block,
        windowed_new_tokens_over_several_q_blocks=windowed_new_tokens_over_several_q_blocks,
        inexact_mask_value_over_a_hidden_chunk=inexact_mask_value_over_a_hidden_chunk,
        soft_cap=_several_keys(lambda p: p.soft_cap is not None),
        q_scale=_several_keys(lambda p: p.q_scale is not None),
        kv_scales=_several_keys(lambda p: p.k_scale is not None),
        fp8_cache=_several_keys(lambda p: p.kv_dtype == "float8_e4m3fn"),
        bf16_cache=_several_keys(lambda p: p.kv_dtype == "bfloat16"),
        # A combined-heads word holds K and V of several kv heads, and the last one is
        # partly padding.
        partly_filled_word=lambda p: (2 * p.num_kv_heads) % packing(KV_DTYPES[p.kv_dtype]) != 0,
        # The kernel's out_dtype (its accumulator's) wider than the queries' dtype.
        accumulator_wider_than_queries=lambda p: p.out_dtype == "float32" and p.dtype == "bfloat16",
        head_dim_64=lambda p: p.head_dim == 64,
        head_dim_128=lambda p: p.head_dim == 128,
        gqa=lambda p: p.num_q_heads > p.num_kv_heads,
        large_logits=_several_keys(lambda p: p.values == "large"),
    ) + (bugclasses.partition("blocks", default=lambda p: p.blocks == "default",
                              small=lambda p: p.blocks == "small").classes
         + bugclasses.presences(sliding_window=lambda p: p.sliding_window is not None,
                                chunk_prefill_size=lambda p: p.chunk_prefill_size is not None))
    examples = {"interpret": 24, "interpret-hazards": 6, "tpu-lower": 3, "tpu": 36}
    # A decode and a mixed sequence whose windows start two and three kv blocks in, a
    # mixed one whose new tokens cross a page: where the kv loop's first block and the
    # cache update of a windowed sequence are exercised together.
    explicit_examples = {"window_starts_past_first_kv_block": Case(FAMILY, RaggedV3Params(
        dtype="float32", kv_dtype="float32", head_dim=128, page_size=16, num_q_heads=4, num_kv_heads=2,
        seqs=((1, 90), (6, 120), (3, 40)), distribution=(1, 1, 3), chunk_prefill_size=None, sliding_window=5,
        soft_cap=None, sm_scale=128 ** -0.5, q_scale=None, k_scale=None, v_scale=None, blocks="small",
        values="normal"), 7),
        # 20 new tokens of a mixed sequence in three q blocks of 8, under a window of 5.
        "windowed_new_tokens_over_several_q_blocks": Case(FAMILY, RaggedV3Params(
            dtype="float32", kv_dtype="float32", head_dim=128, page_size=8, num_q_heads=2, num_kv_heads=2,
            seqs=((1, 30), (20, 50)), distribution=(1, 1, 2), chunk_prefill_size=None, sliding_window=5,
            soft_cap=None, sm_scale=128 ** -0.5, q_scale=None, k_scale=None, v_scale=None, blocks="small",
            values="normal"), 3),
        # A decode query at position 32 under a window of 1: its kv loop starts at key 0, and
        # the first compute chunk (keys 0-15) hides every key from it; -1e30 rounds to
        # -1.00026e30 in bfloat16.
        "inexact_mask_value_over_a_hidden_chunk": Case(FAMILY, RaggedV3Params(
            dtype="bfloat16", kv_dtype="bfloat16", head_dim=128, page_size=8, num_q_heads=2, num_kv_heads=2,
            seqs=((1, 33), (1, 5)), distribution=(2, 2, 2), chunk_prefill_size=None, sliding_window=1,
            soft_cap=None, sm_scale=128 ** -0.5, q_scale=None, k_scale=None, v_scale=None, blocks="small",
            values="normal", mask_value=MASK_VALUE), 5)}
    contracts = (Contract("cache_update_is_exact", "the updated kv_cache holds each new token's K/V (zero pads "
                          "included) in its slot, bit for bit, and every other element as it was"),
                 Contract("rows_of_no_sequence_are_not_judged", "output rows of tokens past cu_q_lens[distribution[2]] "
                          "belong to no sequence; the kernel leaves them as the queries' buffer held them",
                          elements=_valid_rows))

    def cases(self):
        return ragged_v3_cases()

    def inputs(self, case):
        p = case.params
        rng = np.random.default_rng(case.seed)
        shapes, page_size = p.shapes, p.page_size
        q_dt, kv_dt = S.dtype_of(p.dtype), KV_DTYPES[p.kv_dtype]
        n = len(p.seqs)
        q_lens = np.array([q for q, _ in p.seqs] + [0] * (shapes.max_seqs - n))
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        spread = S.LARGE_LOGIT_STD if p.values == "large" else 1.0
        queries = rng.standard_normal((shapes.max_tokens, p.num_q_heads, p.head_dim))
        new = rng.standard_normal((2, shapes.max_tokens, p.num_kv_heads, p.head_dim))
        new[0] *= spread
        queries[cu[n]:] = new[:, cu[n]:] = np.nan  # padding tokens
        keys, values = (x.astype(np.float32).astype(kv_dt) for x in new)
        # The cache: history of every sequence in shuffled pages, NaN everywhere else (the
        # new tokens' slots included); zero pads, as merge_kv writes them.
        order = rng.permutation(shapes.total_pages)
        page_indices = rng.integers(0, shapes.total_pages, size=shapes.max_seqs * shapes.pages_per_seq)
        cache = np.full(p.cache_shape, np.nan, dtype=np.float32)
        tokens = cache.reshape(-1, *cache.shape[2:])
        used = 0
        for s, (q_len, kv_len) in enumerate(p.seqs):
            pages = -(-kv_len // page_size)
            page_indices[s * shapes.pages_per_seq: s * shapes.pages_per_seq + pages] = order[used:used + pages]
            used += pages
            old = kv_len - q_len
            rows = order[used - pages:used].repeat(page_size) * page_size + np.tile(np.arange(page_size), pages)
            history = rng.standard_normal((2, old, p.num_kv_heads, p.head_dim))
            tokens[rows[:old]] = merged(history[0] * spread, history[1], cache.shape)
        kv_lens = np.zeros(shapes.max_seqs, np.int32)
        kv_lens[:n] = [k for _, k in p.seqs]
        # Metadata past the last sequence is padding the kernel must not trust.
        kv_lens[n:] = rng.integers(0, page_size * shapes.pages_per_seq + 1, size=shapes.max_seqs - n)
        return {"queries": S.round_to(queries, q_dt), "keys": keys, "values": values,
                "kv_cache": cache.astype(kv_dt), "kv_lens": kv_lens, "page_indices": page_indices.astype(np.int32),
                "cu_q_lens": cu, "distribution": np.array(p.distribution, np.int32)}

    @staticmethod
    def _options(p: RaggedV3Params) -> dict:
        return dict(sm_scale=p.sm_scale, sliding_window=p.sliding_window, soft_cap=p.soft_cap, q_scale=p.q_scale,
                    k_scale=p.k_scale, v_scale=p.v_scale, chunk_prefill_size=p.chunk_prefill_size)

    def _call(self, impl, p: RaggedV3Params):
        knobs = accepted_keywords(impl, out_dtype=p.out_dtype and np.dtype(p.out_dtype), mask_value=p.mask_value,
                                  vmem_limit_bytes=p.vmem_limit_bytes)
        return lambda *args: impl(*args, **self._options(p), **(BLOCKS[p.blocks] or {}), **knobs)

    def evaluate(self, impl, case, inputs):
        # The kernel donates its array arguments: each call gets buffers of its own.
        args = [jax.device_put(np.array(inputs[n], copy=True)) for n in ARRAY_ARGS]
        out, cache = self._call(impl, case.params)(*args)
        return {"out": np.asarray(out), "kv_cache": np.asarray(cache)}

    def lower(self, impl, case):
        args = [self.inputs(case)[n] for n in ARRAY_ARGS]
        return {"lower-fwd": lambda: backends.export_for_tpu(self._call(impl, case.params), *args)}

    def oracle(self, case, inputs):
        truth = oracle.ragged_paged_attention_v3(*(inputs[n] for n in ARRAY_ARGS), **self._options(case.params))
        return {"out": truth.out, "kv_cache": truth.kv_cache.astype(np.float64)}

    def output_dtypes(self, case):
        return {"out": S.dtype_of(case.params.dtype), "kv_cache": KV_DTYPES[case.params.kv_dtype]}

    def care(self, case, inputs):
        return _valid_rows(case, inputs)

    def yardstick(self, case, inputs):
        """Dense XLA attention over every sequence's keys (the cache's history and the new
        tokens) in working precision."""
        p = case.params
        shapes = p.shapes
        q_dt, kv_dt = S.dtype_of(p.dtype), KV_DTYPES[p.kv_dtype]
        tokens = inputs["kv_cache"].reshape(-1, p.cache_shape[2] * p.cache_shape[3], p.cache_shape[-1])
        capacity = p.page_size * shapes.pages_per_seq
        k = np.zeros((shapes.max_seqs * capacity, p.num_kv_heads, p.head_dim), np.float32)
        v = np.zeros_like(k)
        q_pos, kv_pos = np.full(shapes.max_tokens, -1), np.full(shapes.max_seqs * capacity, 1 << 30)
        seq_of_token, seq_of_key = np.full(shapes.max_tokens, -1), np.repeat(np.arange(shapes.max_seqs), capacity)
        cu, table = inputs["cu_q_lens"], inputs["page_indices"].reshape(shapes.max_seqs, -1)
        for s, (q_len, kv_len) in enumerate(p.seqs):
            old = kv_len - q_len
            positions = np.arange(old)
            history = tokens[table[s, positions // p.page_size] * p.page_size + positions % p.page_size]
            keys = slice(s * capacity, s * capacity + kv_len)
            k[keys] = np.concatenate([history[:, 0:2 * p.num_kv_heads:2, :p.head_dim],
                                      inputs["keys"][cu[s]:cu[s] + q_len]]).astype(np.float32)
            v[keys] = np.concatenate([history[:, 1:2 * p.num_kv_heads:2, :p.head_dim],
                                      inputs["values"][cu[s]:cu[s] + q_len]]).astype(np.float32)
            kv_pos[keys] = np.arange(kv_len)
            q_pos[cu[s]: cu[s] + q_len] = old + np.arange(q_len)
            seq_of_token[cu[s]: cu[s] + q_len] = s
        queries = np.nan_to_num(inputs["queries"].astype(np.float32))
        if p.q_scale is not None:
            # Divided in the queries' dtype, as naive code does: the scale too is rounded to it.
            info = ml_dtypes.finfo(kv_dt)
            divided = (queries / np.float32(np.asarray(p.q_scale, q_dt))).astype(q_dt).astype(np.float32)
            queries = np.clip(divided, float(info.min), float(info.max)).astype(kv_dt).astype(np.float32) * p.q_scale
        k = (k * (p.k_scale or 1.0)).astype(q_dt)
        v = (v * (p.v_scale or 1.0)).astype(q_dt)
        visible = yardstick.visibility(q_pos, kv_pos, causal=True, window=p.sliding_window,
                                       q_segment_ids=seq_of_token[None], kv_segment_ids=seq_of_key[None])
        out = yardstick.attention(queries.astype(q_dt).transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                  v.transpose(1, 0, 2)[None], scale=p.sm_scale, visible=visible, soft_cap=p.soft_cap,
                                  masked_rows="zero")
        return {"out": np.asarray(out)[0].transpose(1, 0, 2).astype(q_dt)}

    def error_map_layout(self, case, direction):
        if direction == "kv_cache":
            return ErrorMapLayout(self.index_names(direction), 0, 1, (), ())
        p = case.params
        ends = tuple(int(e) for e in np.cumsum([q for q, _ in p.seqs]))
        return ErrorMapLayout(self.index_names(direction), 0, 1, (("sequence end", ends),),
                              (every("kv head", p.num_q_heads // p.num_kv_heads, p.num_q_heads),))

    def invalid_calls(self, impl):
        return invalid_v3_calls(impl)


def invalid_v3_calls(impl) -> list[InvalidCall]:
    """The calls the convention rejects, each naming its argument, of the head_dim the
    implementation takes (its Domain)."""
    tokens, hq, hkv, page_size, pages_per_seq = 8, 4, 2, 16, 4
    head_dim = domain.of(impl).takes.get("head_dim", 128)
    cache_shape = (8, page_size, 2 * hkv // 2, 2, -(-head_dim // 128) * 128)
    bf16 = ml_dtypes.bfloat16
    good = dict(queries=np.zeros((tokens, hq, head_dim), bf16), keys=np.zeros((tokens, hkv, head_dim), bf16),
                values=np.zeros((tokens, hkv, head_dim), bf16), kv_cache=np.zeros(cache_shape, bf16),
                kv_lens=np.array([4, 8], np.int32), page_indices=np.arange(2 * pages_per_seq, dtype=np.int32),
                cu_q_lens=np.array([0, 1, 5], np.int32), distribution=np.array([1, 1, 2], np.int32))
    bad = {
        "q_len_gt_kv_len": (dict(kv_lens=np.array([4, 2], np.int32)), r"kv_len|q_len"),
        "empty_sequence": (dict(cu_q_lens=np.array([0, 1, 1], np.int32)), r"q_len|cu_q_lens"),
        "cache_dtype_unlike_kv": (dict(kv_cache=np.zeros(cache_shape, np.float32)), r"kv_cache|dtype"),
        "cache_shape_unlike_layout": (dict(kv_cache=np.zeros((8, page_size, 4, 1, head_dim), bf16)), r"kv_cache"),
        "distribution_decreasing": (dict(distribution=np.array([2, 1, 2], np.int32)), r"distribution"),
        "more_seqs_than_max": (dict(distribution=np.array([1, 1, 3], np.int32)), r"distribution|num_seqs"),
        "metadata_not_int32": (dict(kv_lens=np.array([4, 8], np.int64)), r"kv_lens|int32"),
    }
    options = {"window_zero": (dict(sliding_window=0), r"sliding_window"),
               "soft_cap_zero": (dict(soft_cap=0.0), r"soft_cap")}

    return positional_invalid_calls(impl, ARRAY_ARGS, good, bad, options, sm_scale=0.1)


SPEC = RaggedV3Spec()
