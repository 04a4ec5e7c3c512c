"""The ragged paged attention v2 family's parameters: the static layouts, the drawn
values' domains and :class:`RaggedParams`."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from attncheck import strategies as S
from attncheck.cases import Params

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
