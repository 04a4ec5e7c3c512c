"""A splash case's parameters: its static shape buckets, the values drawn, its shardings
and the kernel's block sizes."""

from __future__ import annotations

import dataclasses

from attncheck.cases import Params, Sizes

FAMILY = "splash_attention"
NUM_LANES = 128  # every block size here is a multiple of it (backward q blocks must be, to lower)
# Static shape buckets (api, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim): every case
# of a bucket with the same mask and blocks reuses one compiled kernel. The first is the
# cheapest and the richest (GQA, q shorter than kv: offsets matter, two kv blocks): the
# coverage search shrinks toward it. Square; three kv blocks (a skipped block between
# visited ones); q longer than kv (bottom-right causal empties whole q blocks) with GQA over
# two kv heads (grouped, not interleaved, query heads per kv head).
SHAPES = (
    ("mha", 2, 1, 128, 256, 64, 64),
    ("mha", 2, 2, 256, 256, 128, 128),
    ("mqa", 2, 1, 256, 384, 128, 64),
    ("mha", 4, 2, 256, 128, 64, 64),
)
# A soft cap the logits (q pre-scaled by 1/sqrt(D): standard deviation 1, or 16 for "large"
# values) reach, so that a wrong cap changes the result.
SOFT_CAP = 3.0
SOFT_CAPS = (None, SOFT_CAP, 0.7, 1.0)  # and the cap's other cells: below 1, 1
LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")
# An explicit mask value: masked logits still underflow (a fully masked row is don't-care).
MASK_VALUE = -1e30
# How a case is sharded: (head_shards, q_seq_shards).
SHARDINGS = ((1, 1), (2, 1), (1, 2))


@dataclasses.dataclass(frozen=True)
class BlockSizes(Sizes):
    """The kernel's ``BlockSizes`` sizes, field for field: the forward's, the dkv pass's,
    then the dq pass's tiles; the fused backward computes dq in the dkv pass and has no dq
    tiles (None: left out of the JSON pairs, as they were before the sizes were typed)."""

    block_q: int
    block_kv: int
    block_kv_compute: int
    block_q_dkv: int
    block_kv_dkv: int
    block_kv_dkv_compute: int
    block_q_dq: int | None = None
    block_kv_dq: int | None = None


BLOCK_FIELDS = tuple(f.name for f in dataclasses.fields(BlockSizes))


@dataclasses.dataclass(frozen=True)
class SplashParams(Params):
    dtype: str
    api: str  # "mha" (make_splash_mha; GQA when kv_heads < heads) or "mqa" (make_splash_mqa)
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    masks: tuple  # one mask description per query head
    segments: str  # "none" or "packed"
    segment_starts: tuple[int, ...]
    soft_cap: float | None
    blocks: BlockSizes  # written to JSON as its (name, size) pairs (cases.Sizes)
    fused_bwd: bool  # use_fused_bwd_kernel: dq from the dkv kernel
    head_shards: int
    q_seq_shards: int
    values: str  # an S.VALUE_KINDS distribution
    downcast_smem_data: bool = True  # the mask metadata kept in SMEM as narrow ints
    # QKVLayout names of q, k and v inside the kernel (the arrays given are [.., S, D] either way)
    layouts: tuple[str, str, str] = ("HEAD_DIM_MINOR",) * 3
    segment_dtype: str = "int32"
    mask_value: float | None = None  # None: the kernel's default

    @property
    def sequence_length(self) -> int:
        return self.kv_len

    @property
    def device_count(self) -> int:
        return self.head_shards * self.q_seq_shards
