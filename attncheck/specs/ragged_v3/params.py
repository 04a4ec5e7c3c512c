"""The ragged paged attention v3 family's parameters: the static layouts, the drawn
values' domains, the block-size sets and :class:`RaggedV3Params`."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from attncheck import strategies as S
from attncheck.cases import Params
from attncheck.oracle.ragged_v3 import packing

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

