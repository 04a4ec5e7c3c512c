"""Flash attention's block sizes are a dataclass in memory and the list of [name, size] pairs
in JSON, as they were written before the dataclass: a case id hashes that JSON."""

from __future__ import annotations

import json

from attncheck.cases import Case
from attncheck.specs.flash.params import BLOCK_FIELDS, BlockSizes, FlashParams

SIZES = dict(zip(BLOCK_FIELDS, (128, 256, 128, 1, 256, 512, 128, 128, 256, 128, 128)))
PARAMS = FlashParams(dtype="float32", batch=1, heads=1, q_len=256, kv_len=512, head_dim=64, causal=True,
                     sm_scale=0.125, bias=False, segments="none", segment_starts=(), values="normal",
                     blocks=BlockSizes(**SIZES))


def test_block_sizes_are_written_as_the_list_of_name_size_pairs():
    written = json.loads(json.dumps(PARAMS.to_json()))
    assert written["blocks"] == [[name, size] for name, size in SIZES.items()]
    assert [name for name, _ in written["blocks"]] == list(BLOCK_FIELDS)


def test_params_with_block_sizes_round_trip_through_json():
    read = FlashParams.from_json(json.loads(json.dumps(PARAMS.to_json())))
    assert read == PARAMS and isinstance(read.blocks, BlockSizes)
    case = Case("flash_attention", PARAMS, 3)
    assert Case.from_json(json.loads(json.dumps(case.to_json())), FlashParams).id == case.id


def test_the_case_id_is_the_one_the_pairs_gave():
    # Made by the params whose blocks field held the (name, size) pairs.
    assert Case("flash_attention", PARAMS, 3).id == "flash_attention-84c07ebdd3c0"
