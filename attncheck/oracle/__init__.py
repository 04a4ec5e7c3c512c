"""Independent float64 reference oracles (NumPy only): the truth every verdict rests on."""

from attncheck.oracle.dense import MASKED_ROW_CONVENTIONS, AttentionResult, attention, attention_vjp
from attncheck.oracle.ffn import feed_forward, feed_forward_vjp
from attncheck.oracle.ragged import RaggedResult, ragged_paged_attention
from attncheck.oracle.ragged_v3 import RaggedV3Result, ragged_paged_attention_v3
from attncheck.oracle.ring import global_positions, ring_step_offsets

__all__ = [
    "MASKED_ROW_CONVENTIONS",
    "AttentionResult",
    "RaggedResult",
    "RaggedV3Result",
    "attention",
    "attention_vjp",
    "feed_forward",
    "feed_forward_vjp",
    "global_positions",
    "ragged_paged_attention",
    "ragged_paged_attention_v3",
    "ring_step_offsets",
]
