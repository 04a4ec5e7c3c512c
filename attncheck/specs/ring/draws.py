"""The ring families' draws: a case of each variant, the data of a case's program, and the
ring flash kernel's block sizes."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.specs.ring.params import (BIAS_KINDS, DEVICE_COUNTS, DROPOUT_RATES, NUM_LANES, PLACEMENTS,
                                         SEGMENT_KINDS, SM_SCALES, VALUE_KINDS, ChunkedRingParams, FlashBlocks,
                                         FlashRingParams, MaskedRingParams, RingParams)


@st.composite
def flash_block_sizes(draw, per_device: int, batch: int) -> FlashBlocks:
    """The flash kernel's block sizes for one ring step's (q block, kv block) of per_device
    tokens each; the backward's major blocks mirror the forward's."""
    k_major = draw(st.sampled_from(S.divisors(per_device, NUM_LANES)))
    return FlashBlocks(block_q=draw(st.sampled_from(S.divisors(per_device, NUM_LANES))), block_k_major=k_major,
                       block_k=draw(st.sampled_from(S.divisors(k_major, NUM_LANES))),
                       block_b=draw(st.sampled_from(S.divisors(batch, 1))),
                       block_k_dkv=draw(st.sampled_from(S.divisors(k_major, NUM_LANES))),
                       block_k_dq=draw(st.sampled_from(S.divisors(k_major, NUM_LANES))))


@st.composite
def ring_cases(draw, family: str, per_device_lens: S.Shapes, head_dims: S.Shapes,
               params_type: type[RingParams], max_tokens: int) -> Case[RingParams]:
    devices = draw(st.sampled_from(DEVICE_COUNTS))
    per_device = draw(st.sampled_from([n for n in per_device_lens() if n * devices <= max_tokens]
                                      or [min(per_device_lens())]))
    seq = per_device * devices
    segments = draw(st.sampled_from(SEGMENT_KINDS))
    sm_scale, bias = draw(st.sampled_from(SM_SCALES)), draw(st.sampled_from(BIAS_KINDS))
    if params_type is FlashRingParams and sm_scale == 0.0:
        bias = "none"  # the ring flash kernel takes the bias as bias / sm_scale: 0 is an invalid call
    params = dict(
        dtype=draw(st.sampled_from(tuple(S.DTYPES))), devices=devices, seq_len=seq, per_device=per_device,
        heads=draw(st.sampled_from((1, 2))), head_dim=draw(st.sampled_from(head_dims())), causal=draw(st.booleans()),
        bias=bias, segments=segments,
        segment_starts=S.drawn_segment_layout(draw, segments, seq),
        float32_logits=draw(st.booleans()), values=draw(st.sampled_from(VALUE_KINDS)),
        batch=draw(st.sampled_from((1, 2))), sm_scale=sm_scale,
        placement=draw(st.sampled_from(PLACEMENTS)), check_vma=draw(st.booleans()),
        single_segment_ids=segments == "packed" and draw(st.booleans()),
        segment_dtype=draw(st.sampled_from(("int32", "int16"))) if segments != "none" else "int32",
        highest_precision=draw(st.booleans()))
    if params_type is ChunkedRingParams:
        params["query_chunk_size"] = draw(st.sampled_from(S.divisors(per_device, 8)))
        params["key_chunk_size"] = draw(st.sampled_from(S.divisors(per_device, 8)))
        params["dropout_rate"] = draw(st.sampled_from(DROPOUT_RATES))
    elif params_type is FlashRingParams:
        params["flash_blocks"] = draw(st.one_of(st.just(FlashBlocks()), flash_block_sizes(per_device, params["batch"])))
        params["vmem_limit_bytes"] = draw(st.sampled_from((None, 64 * 1024 * 1024)))
    elif params_type is MaskedRingParams:
        params["random_mask"] = draw(st.booleans())
    return Case(family, params_type(**params), draw(S.seeds))


@st.composite
def ring_data(draw, p: RingParams) -> RingParams:
    """The params with another draw of what the kernel is given as data
    (``RingSpec.program``): the values and the segment layout."""
    return dataclasses.replace(p, segment_starts=S.drawn_segment_layout(draw, p.segments, p.seq_len),
                               values=draw(st.sampled_from(VALUE_KINDS)))
