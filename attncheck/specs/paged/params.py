"""paged_attention's parameters: the shapes, dtypes, soft caps and mask values drawn, and
``PagedParams``."""

from __future__ import annotations

import dataclasses

from attncheck.cases import Params

FAMILY = "paged_attention"
# (batch, q_heads, kv_heads, head_dim, page_size, pages_per_sequence): head_dim a multiple
# of 128 (the kernel's m/l outputs reuse q's block, which must be lane-shaped to lower).
SHAPES = (
    (2, 8, 4, 128, 16, 4),  # 2 query heads per kv head: q launched as float32 [G, 1, D] blocks
    (4, 16, 2, 128, 8, 4),  # 8 per kv head: q keeps its dtype (and bf16 the running output)
    (2, 4, 1, 256, 16, 2),  # one kv head (MQA)
)
# (q dtype, page dtype): int8 pages are QuantizedTensors.
DTYPE_PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"),
               ("bfloat16", "float32"), ("float32", "int8"), ("bfloat16", "int8"))
# An explicit mask value, large enough that masked logits underflow like the default's.
MASK_VALUE = -1e30
SOFT_CAP = 10.0  # below the logits' spread (q.k has std sqrt(D) >= 11): it saturates
SOFT_CAPS = (None, SOFT_CAP, 0.7, 1.0)  # and the cap's other cells: below 1, 1
MEGACORE_CORES = 2


@dataclasses.dataclass(frozen=True)
class PagedParams(Params):
    dtype: str  # q and the output
    page_dtype: str  # "float32", "bfloat16", or "int8" (QuantizedTensor)
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    pages_per_sequence: int
    pages_per_compute_block: int
    lengths: tuple[int, ...]
    megacore_mode: str | None
    inline_seq_dim: bool
    soft_cap: float | None
    values: str  # "normal" or "large"
    mask_value: float | None = None  # None: the kernel's default

    @property
    def sequence_length(self) -> int:
        return max(self.lengths)

    @property
    def simulated_cores(self) -> int | None:
        return MEGACORE_CORES if self.megacore_mode else None

    @property
    def capacity(self) -> int:
        return self.page_size * self.pages_per_sequence

    @property
    def block_tokens(self) -> int:
        return self.page_size * self.pages_per_compute_block

    @property
    def groups(self) -> int:
        return self.q_heads // self.kv_heads

    def read_tokens(self, length: int) -> int:
        """Tokens of the compute blocks the kernel loads for a sequence of this length."""
        return -(-length // self.block_tokens) * self.block_tokens
