"""The ring families' params: the global sequence over the devices, the bias, segment and
value layouts, and each variant's options (chunks and dropout, flash blocks, a mask)."""

from __future__ import annotations

import dataclasses

from attncheck import strategies as S
from attncheck.cases import Params, Sizes

DEVICE_COUNTS = (1, 2, 4, 8)
NUM_LANES = 128  # the ring flash kernel's blocks are lane tiles
ABSENT_SEGMENT = 1000
# "full": [1, H, S, S]; "key_padding": [1, 1, 1, S] soft padding of some keys; "batch_keys":
# [B, 1, 1, S], another padding per batch element; "neg_inf_rows": full, with some query
# rows all -inf (they see no key: 0, no gradient).
BIAS_KINDS = ("none", "full", "key_padding", "batch_keys", "neg_inf_rows")
SEGMENT_KINDS = ("none", "packed", "absent")
# Bias of the padded keys in "key_padding": soft, so no row becomes fully masked by it.
KEY_PADDING_BIAS = -30.0
# The running sums of a ring step hold a sink's weight across key chunks (strategies.SINK).
VALUE_KINDS = (*S.VALUE_KINDS, S.SINK)
DROPOUT_RATES = (0.0, 0.25, 0.3, 0.5)  # 0.3: a keep scale 1 / 0.7 that rounds
EXPLICIT_SM_SCALE = 0.3
# Every cell of the scale (a hide value times a negative or zero scale stops hiding; 1 a
# multiply a kernel may skip); None is the kernel's default 1/sqrt(head_dim).
SM_SCALES = (None, EXPLICIT_SM_SCALE, 1.0, 1.7, 0.0, -0.5)
# How the devices are named: by count (the kernel's own mesh and axis name), by count with
# an axis name, or by a mesh of our own.
PLACEMENTS = ("count", "named_axis", "mesh")
AXIS_NAME = "ring"


@dataclasses.dataclass(frozen=True)
class RingParams(Params):
    dtype: str
    devices: int
    seq_len: int  # global, sharded contiguously over the devices
    per_device: int
    heads: int
    head_dim: int
    causal: bool
    bias: str  # a BIAS_KINDS layout
    segments: str  # a SEGMENT_KINDS layout
    segment_starts: tuple[int, ...]
    float32_logits: bool
    values: str  # a VALUE_KINDS distribution
    batch: int = 1
    sm_scale: float | None = None  # None: the kernel's default 1/sqrt(head_dim)
    placement: str = "count"  # a PLACEMENTS way of naming the devices
    check_vma: bool = True
    single_segment_ids: bool = False  # one array for q and kv instead of a (q, kv) pair
    segment_dtype: str = "int32"
    highest_precision: bool = False  # precision=HIGHEST where the variant takes one

    @property
    def device_count(self) -> int:
        return self.devices

    @property
    def sequence_length(self) -> int:
        return self.seq_len

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.sm_scale is None else self.sm_scale


@dataclasses.dataclass(frozen=True)
class ChunkedRingParams(RingParams):
    """The blockwise ring's chunking and dropout on top."""

    query_chunk_size: int = 0
    key_chunk_size: int = 0
    dropout_rate: float = 0.0


@dataclasses.dataclass(frozen=True)
class FlashBlocks(Sizes):
    """The flash kernel's ``BlockSizes`` fields a ring step's call gives (the backward's major
    blocks mirror the forward's); none given (written as no pairs): the kernel's defaults,
    fitted per call."""

    block_q: int | None = None
    block_k_major: int | None = None
    block_k: int | None = None
    block_b: int | None = None
    block_k_dkv: int | None = None
    block_k_dq: int | None = None


@dataclasses.dataclass(frozen=True)
class FlashRingParams(RingParams):
    """The ring flash kernel's block sizes per ring step (none given: its defaults)."""

    flash_blocks: FlashBlocks = FlashBlocks()
    vmem_limit_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class MaskedRingParams(RingParams):
    """The standard ring's boolean mask: from the rules (causal, segments) or random, with
    some rows all False, per batch element and head."""

    random_mask: bool = False
