"""A splash case: its parameters, its static shape buckets and block sizes, and the
strategy that draws it."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.specs.splash_masks import mask_descriptions

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
BLOCK_FIELDS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")


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
    blocks: tuple[tuple[str, int], ...]  # BlockSizes fields as (name, value) pairs
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

    @property
    def block_sizes(self) -> dict[str, int]:
        return dict(self.blocks)


@st.composite
def block_sizes(draw, q_len: int, kv_len: int, fused: bool) -> tuple[tuple[str, int], ...]:
    """Valid block sizes (lane multiples, dividing their axis; q blocks divide a q shard)."""
    q_blocks, kv_blocks = S.divisors(q_len, NUM_LANES), S.divisors(kv_len, NUM_LANES)
    sizes = {"block_q": draw(st.sampled_from(q_blocks)), "block_kv": draw(st.sampled_from(kv_blocks))}
    sizes["block_kv_compute"] = draw(st.sampled_from(S.divisors(sizes["block_kv"], NUM_LANES)))
    sizes["block_q_dkv"] = draw(st.sampled_from(q_blocks))
    sizes["block_kv_dkv"] = draw(st.sampled_from(kv_blocks))
    sizes["block_kv_dkv_compute"] = draw(st.sampled_from(S.divisors(sizes["block_kv_dkv"], NUM_LANES)))
    # Drawn either way (the same number of choices keeps the shrinker from preferring the
    # fused backward), dropped when fused: it computes dq in the dkv kernel.
    dq = {"block_q_dq": draw(st.sampled_from(q_blocks)), "block_kv_dq": draw(st.sampled_from(kv_blocks))}
    return tuple(sizes.items()) + (() if fused else tuple(dq.items()))


# How a case is sharded: (head_shards, q_seq_shards).
SHARDINGS = ((1, 1), (2, 1), (1, 2))


@st.composite
def splash_cases(draw, *, shardings: tuple[tuple[int, int], ...] = SHARDINGS, per_head_masks: bool = True,
                 fused_bwd: bool | st.SearchStrategy[bool] = st.booleans()) -> Case[SplashParams]:
    """Splash cases; a convention that takes less draws less: ``shardings`` it shards by,
    ``per_head_masks`` (one mask for every head when False), ``fused_bwd`` a value or a
    strategy."""
    api, heads, kv_heads, q_len, kv_len, head_dim, v_head_dim = draw(st.sampled_from(SHAPES))
    head_shards, q_seq_shards = draw(st.sampled_from(shardings))
    if q_len // q_seq_shards < NUM_LANES:  # a q shard holds whole q blocks of a lane multiple
        q_seq_shards = 1
    if per_head_masks and draw(st.booleans()):  # a different mask per head
        masks = tuple(draw(mask_descriptions(q_len, kv_len)) for _ in range(heads))
    else:
        masks = (draw(mask_descriptions(q_len, kv_len)),) * heads
    segments = draw(st.sampled_from(("none", "packed")))
    fused = draw(fused_bwd) if isinstance(fused_bwd, st.SearchStrategy) else fused_bwd
    return Case(FAMILY, SplashParams(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), api=api, heads=heads, kv_heads=kv_heads, q_len=q_len,
        kv_len=kv_len, head_dim=head_dim, v_head_dim=v_head_dim, masks=masks, segments=segments,
        segment_starts=draw(S.segment_layout(min(q_len, kv_len))) if segments != "none" else (),
        soft_cap=draw(st.sampled_from(SOFT_CAPS)),
        blocks=draw(block_sizes(q_len // q_seq_shards, kv_len, fused)), fused_bwd=fused,
        head_shards=head_shards, q_seq_shards=q_seq_shards, values=draw(st.sampled_from(S.VALUE_KINDS)),
        downcast_smem_data=draw(st.booleans()), mask_value=draw(st.sampled_from((None, MASK_VALUE))),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in "qkv"),
        segment_dtype=draw(st.sampled_from(("int32", "int16"))) if segments != "none" else "int32"),
        draw(S.seeds))
