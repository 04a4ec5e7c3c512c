"""Flash attention's case parameters: the shapes and sizes drawn, the kernel's block sizes."""

from __future__ import annotations

import dataclasses
from typing import Any

from attncheck import strategies as S
from attncheck.cases import Params, Sizes

FAMILY = "flash_attention"
# What the ab entries hold besides normal values: -inf at some keys, every row keeping a
# visible key ("neg_inf"); the same and one row whose own segment's keys are all -inf
# ("neg_inf_row", the row ``emptied_row``); or NaN and +inf where the mask hides the key. A
# kernel may handle scattered -inf entries and still fail a row they empty: the cells keep
# the two apart, so a class can name each.
BIAS_VALUE_KINDS = ("normal", "neg_inf", "neg_inf_row", "nonfinite_masked")
# The running sums of the forward hold a sink's weight across kv blocks (strategies.SINK).
VALUE_KINDS = (*S.VALUE_KINDS, S.SINK)
NEG_INF_KINDS = ("neg_inf", "neg_inf_row")
SEGMENT_DTYPES = ("int32", "int16")
# None: the kernel's default; interpret mode has no VMEM, tpu-lower passes it to Mosaic.
VMEM_LIMITS = (None, 64 * 1024 * 1024)
# Besides 1/sqrt(head_dim): the scale's every cell (a mask value multiplied by a negative or
# zero scale stops hiding keys), 1 (a multiply a kernel may skip) and one that rounds.
SM_SCALES = (1.0, 1.7, 0.0, -0.5)
SEQ_LENS = S.Shapes(ci=(128, 256, 384, 512), nightly=tuple(range(128, 1025, 128)))
# Key lengths of a long reduction (kv only: the reduction is over keys). Drawn in the nightly
# only: in the CI draws they are the slowest interpreted flash cases; the CI profile has its
# class's explicit example.
LONG_KV_LENS = S.Shapes(ci=(), nightly=(2 * S.LONG_REDUCTION, 4 * S.LONG_REDUCTION))
HEAD_DIMS = S.Shapes(ci=(64, 128), nightly=(64, 128, 256))
# batch * heads <= 2 keeps CI's interpret-mode grids small; both axes still vary.
BATCH_HEADS = S.Shapes(ci=((1, 1), (2, 1), (1, 2)), nightly=((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 3)))
NUM_LANES = 128  # kv-side blocks are lane-dimension tiles
# A query segment id that never occurs in kv: its rows are fully masked.
ABSENT_SEGMENT = 1000


@dataclasses.dataclass(frozen=True)
class BlockSizes(Sizes):
    """The kernel's ``BlockSizes``, field for field: the forward's, then the dkv pass's, then
    the dq pass's tiles."""

    block_q: int
    block_k_major: int
    block_k: int
    block_b: int
    block_q_major_dkv: int
    block_k_major_dkv: int
    block_k_dkv: int
    block_q_dkv: int
    block_k_major_dq: int
    block_k_dq: int
    block_q_dq: int

    @classmethod
    def of(cls, blocks: Any) -> BlockSizes:
        """The sizes an object with these fields holds (an implementation's ``BlockSizes``)."""
        return cls(**{name: getattr(blocks, name) for name in BLOCK_FIELDS})


BLOCK_FIELDS = tuple(f.name for f in dataclasses.fields(BlockSizes))


@dataclasses.dataclass(frozen=True)
class FlashParams(Params):
    dtype: str
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool
    sm_scale: float
    bias: bool
    segments: str  # "none", "packed", or "absent" (a query segment missing from kv)
    segment_starts: tuple[int, ...]
    values: str  # a VALUE_KINDS distribution
    blocks: BlockSizes  # written to JSON as its (name, size) pairs (cases.Sizes)
    bias_values: str = "normal"  # a BIAS_VALUE_KINDS pattern of the ab entries
    emptied_row: int | None = None  # the query row "neg_inf_row" empties (None for the other kinds)
    segment_dtype: str = "int32"
    vmem_limit_bytes: int | None = None

    @property
    def sequence_length(self) -> int:
        return self.kv_len
