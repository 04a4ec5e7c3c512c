"""Block sizes are a frozen dataclass in memory (a ``cases.Sizes``) and the list of [name, size]
pairs in JSON, as they were written before they were typed: a case id hashes that JSON. One
mechanism in ``cases`` serves every family: flash's sizes, splash's (the fused backward's
without dq tiles) and the ring flash kernel's (none given: the kernel's defaults)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attncheck.cases import Case, Params, Sizes
from attncheck.specs.flash.params import BLOCK_FIELDS, BlockSizes, FlashParams
from attncheck.specs.ring.params import FlashBlocks, FlashRingParams
from attncheck.specs.splash import params as splash_params


@dataclasses.dataclass(frozen=True)
class Tiles(Sizes):
    rows: int
    cols: int | None = None


@dataclasses.dataclass(frozen=True)
class TiledParams(Params):
    dtype: str
    tiles: Tiles


def through_json(params: Params) -> tuple[dict, Params]:
    written = json.loads(json.dumps(params.to_json()))
    return written, type(params).from_json(written)


def test_sizes_are_their_given_pairs_in_field_order_and_params_read_them_back_by_declared_type():
    written, read = through_json(TiledParams("float32", Tiles(rows=8, cols=16)))
    assert written["tiles"] == [["rows", 8], ["cols", 16]]
    assert read == TiledParams("float32", Tiles(8, 16)) and isinstance(read.tiles, Tiles)
    written, read = through_json(TiledParams("float32", Tiles(rows=8)))
    assert written["tiles"] == [["rows", 8]] and read.tiles == Tiles(8)  # a None size is left out
    assert Tiles(8).given() == {"rows": 8}


SIZES = dict(zip(BLOCK_FIELDS, (128, 256, 128, 1, 256, 512, 128, 128, 256, 128, 128)))
FLASH = FlashParams(dtype="float32", batch=1, heads=1, q_len=256, kv_len=512, head_dim=64, causal=True,
                    sm_scale=0.125, bias=False, segments="none", segment_starts=(), values="normal",
                    blocks=BlockSizes(**SIZES))
SPLASH_FIELDS = dict(dtype="float32", api="mha", heads=2, kv_heads=1, q_len=128, kv_len=256, head_dim=64,
                     v_head_dim=64, masks=(("causal", 128),) * 2, segments="none", segment_starts=(), soft_cap=None,
                     head_shards=1, q_seq_shards=1, values="normal")
SPLASH = splash_params.SplashParams(**SPLASH_FIELDS, fused_bwd=False, blocks=splash_params.BlockSizes(
    **dict.fromkeys(splash_params.BLOCK_FIELDS, 128)))
SPLASH_FUSED = splash_params.SplashParams(**SPLASH_FIELDS, fused_bwd=True, blocks=splash_params.BlockSizes(
    **dict.fromkeys(splash_params.BLOCK_FIELDS[:6], 128)))
RING_FIELDS = dict(dtype="float32", devices=2, seq_len=512, per_device=256, heads=1, head_dim=128, causal=True,
                   bias="none", segments="none", segment_starts=(), float32_logits=False, values="normal")
RING_BLOCKS = dict(block_q=128, block_k_major=256, block_k=128, block_b=1, block_k_dkv=256, block_k_dq=128)
RING_DEFAULT = FlashRingParams(**RING_FIELDS)
RING = FlashRingParams(**RING_FIELDS, flash_blocks=FlashBlocks(**RING_BLOCKS))

# (family, params, field, the pairs written, the case id the (name, size) pairs gave before the sizes were typed)
WRITTEN = [
    ("flash_attention", FLASH, "blocks", list(SIZES.items()), "flash_attention-84c07ebdd3c0"),
    ("splash_attention", SPLASH, "blocks", [(name, 128) for name in splash_params.BLOCK_FIELDS],
     "splash_attention-37b1b2f41893"),
    ("splash_attention", SPLASH_FUSED, "blocks", [(name, 128) for name in splash_params.BLOCK_FIELDS[:6]],
     "splash_attention-edfff9f81bf0"),
    ("ring_flash_attention", RING_DEFAULT, "flash_blocks", [], "ring_flash_attention-7aa108686a55"),
    ("ring_flash_attention", RING, "flash_blocks", list(RING_BLOCKS.items()), "ring_flash_attention-d2f814494e3b"),
]


@pytest.mark.parametrize("family, params, field, pairs, case_id", WRITTEN)
def test_block_sizes_are_written_as_the_pairs_and_read_back_with_the_same_case_id(family, params, field, pairs,
                                                                                   case_id):
    written, read = through_json(params)
    assert written[field] == [list(pair) for pair in pairs]
    assert read == params and type(getattr(read, field)) is type(getattr(params, field))
    case = Case(family, params, 3)
    assert case.id == case_id
    assert Case.from_json(json.loads(json.dumps(case.to_json())), type(params)).id == case_id
