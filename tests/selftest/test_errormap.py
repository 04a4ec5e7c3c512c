"""Error maps (attncheck/report/errormap.py): a planted block-edge error lands in the
right cells, sentinels (exact 0, NaN/Inf mismatch, don't care) survive pooling and JSON,
the text grid and the SVG draw the block boundaries, the gate's choice of which records
carry a map, and every built-in spec lays out every direction of a real case."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import zlib

import jsonschema
import numpy as np
import pytest

from attncheck import check, coverage, layouts, numerics, specs
from attncheck.backends import BACKENDS
from attncheck.report import errormap as em
from attncheck.report import plots
from attncheck.specs.flash.params import BlockSizes
from tests.selftest import harness, toy_spec

SCHEMA = harness.load_schema()
MAP_VALIDATOR = jsonschema.Draft202012Validator(
    {"$schema": SCHEMA["$schema"], "$defs": SCHEMA["$defs"], "$ref": "#/$defs/error_map"})
NAMES = ("batch", "head", "query", "dim")


def noisy(shape, seed=0, noise=1e-7):
    rng = np.random.default_rng(seed)
    oracle = rng.standard_normal(shape)
    return oracle + noise * rng.standard_normal(shape), oracle


def grid_rows(text: str) -> list[str]:
    """The cell rows of a text grid, between the frame's bars."""
    return [line.split("|", 1)[1].rsplit("|", 1)[0] for line in text.splitlines() if re.match(r"\s*\d+ \|", line)]


def test_a_block_edge_error_lands_in_its_cells_and_the_worst_slice_is_kept():
    kernel, oracle = noisy((2, 2, 512, 128))
    kernel[1, 0, 128, 5] += 1e-3  # the first row of the second block, one head, one batch
    m = em.build(kernel, oracle, allowed=1e-6, direction="out",
                 layout=layouts.ErrorMapLayout(NAMES, 2, 3, (layouts.every("block_q", 128, 512),)))
    assert m.values.shape == (64, 64) and (m.rows.step, m.cols.step) == (8, 2)
    assert m.rows.bounds == (("block_q", (128, 256, 384)),)
    assert np.argwhere(m.values > 1).tolist() == [[16, 2]]  # query 128 // 8, dim 5 // 2
    assert m.worst_cell() == (16, 2) and m.describe_cell(16, 2) == "query 128-135, dim 4-5"
    # Reduced over batch and head, with the worst index of each kept.
    (batch, bstep, bvalues), (head, hstep, hvalues) = m.reduced
    assert (batch, head, bstep, hstep) == ("batch", "head", 1, 1)
    assert bvalues[1] == pytest.approx(m.budget) and bvalues[0] < 1
    assert hvalues[0] == pytest.approx(m.budget) and hvalues[1] < 1


def test_the_maps_worst_cell_is_the_comparisons_budget_and_worst_element():
    kernel, oracle = noisy((1, 2, 256, 64), seed=3, noise=1e-5)
    yardstick = oracle + 1e-6 * np.random.default_rng(4).standard_normal(oracle.shape)
    cmp = numerics.compare(kernel, oracle, yardstick, dtype=np.float32, direction="out")
    m = em.build(kernel, oracle, allowed=cmp.allowed, direction="out")
    assert m.budget == pytest.approx(cmp.budget, rel=1e-12)
    assert (m.rows.step, m.cols.step) == (4, 1)  # 256 queries in 64 cells, 64 dims in 64
    assert m.worst_cell() == (cmp.worst_index[2] // 4, cmp.worst_index[3])


def test_an_exact_directions_map_is_zero_where_equal_and_worst_where_not():
    oracle = np.array([[1.0, np.nan], [2.0, 3.0]])
    kernel = oracle.copy()
    kernel[1, 1] = 3.5
    budgets = em.element_budgets(kernel, oracle, 0.0)
    assert budgets[0, 0] == budgets[0, 1] == budgets[1, 0] == 0
    assert budgets[1, 1] == np.finfo(np.float64).max


def test_sentinels_exact_zero_mismatch_and_dont_care():
    oracle = np.ones((1, 1, 16, 4))
    kernel = oracle.copy()
    kernel[0, 0, 3, 1] = np.nan  # NaN where the oracle has none
    kernel[0, 0, 5, 0] = oracle[0, 0, 5, 0] = np.inf  # the same Inf on both sides: agreement
    kernel[0, 0, 7, 2] += 0.5
    care = np.ones((1, 1, 16, 1), bool)
    care[0, 0, 12:] = False  # padding rows: don't care, even where garbage
    kernel[0, 0, 13] = np.nan
    m = em.build(kernel, oracle, allowed=0.1, direction="out", care=care)
    assert math.isinf(m.values[3, 1]) and m.mismatch.sum() == 1
    assert m.values[5, 0] == 0 and m.values[7, 2] == pytest.approx(5.0)
    assert m.dont_care[12:].all() and not m.dont_care[:12].any()
    # Pooling keeps them: a mismatch dominates its cell; a cell is don't-care only if all of it is.
    coarse = m.coarsened(4, 4)
    assert coarse.values.shape == (4, 4) and coarse.rows.step == 4
    assert math.isinf(coarse.values[0, 1]) and coarse.dont_care[3].all() and not coarse.dont_care[:3].any()
    # Text: '!' for the mismatch, '~' for don't care, ' ' for exact 0, '*' for a budget of 5.
    rows = grid_rows(m.to_text(max_rows=16))
    assert rows[3][1] == "!" and rows[12] == "~~~~" and rows[0] == "    " and rows[7][2] == "*"


def test_json_round_trip_is_compact_and_matches_the_schema():
    kernel, oracle = noisy((2, 1, 512, 512), seed=1)
    kernel[0, 0, 200:210, 300] = np.nan
    kernel[0, 0, 0, 0] = oracle[0, 0, 0, 0]
    care = np.ones((1, 1, 512, 1), bool)
    care[0, 0, 500:] = False
    layout = layouts.ErrorMapLayout(("batch", "head", "query", "key"), 2, 3, (layouts.every("block_q_dq", 128, 512),),
                               (layouts.every("block_k_major_dq", 256, 512), layouts.every("block_k_dq", 128, 512)))
    m = em.build(kernel, oracle, allowed=1e-6, direction="dab", layout=layout, care=care)
    data = json.loads(json.dumps(m.to_json(), allow_nan=False))
    MAP_VALIDATOR.validate(data)
    assert len(json.dumps(data)) < 12_000  # 64 x 64 cells in 2 bytes each, compressed
    back = em.ErrorMap.from_json(data)
    assert back.values.shape == m.values.shape
    assert (back.dont_care == m.dont_care).all() and (back.mismatch == m.mismatch).all()
    assert ((back.values == 0) == (m.values == 0)).all()
    finite = (m.values > 0) & np.isfinite(m.values)
    assert np.allclose(back.values[finite], m.values[finite], rtol=0.01)
    assert back.rows.bounds == m.rows.bounds and back.cols.bounds == m.cols.bounds
    assert (back.shape, back.axis_names, back.direction) == (m.shape, m.axis_names, "dab")
    assert back.to_json() == data  # decoding and encoding again changes nothing
    with pytest.raises(ValueError, match="version"):
        em.ErrorMap.from_json({**data, "version": 99})
    with pytest.raises(ValueError, match="do not decode to 64 x 64"):
        em.ErrorMap.from_json({**data, "cells": [64, 64, data["cells"][2][:-8]]})


def test_text_grid_draws_block_boundaries_where_they_are():
    kernel, oracle = noisy((1, 1, 64, 16))
    kernel[0, 0, 32, :] += 1e-2  # the first row of the third block of 16
    m = em.build(kernel, oracle, allowed=1e-6, direction="dk",
                 layout=layouts.ErrorMapLayout(NAMES, 2, 3, (layouts.every("block_k", 16, 64),),
                                               (layouts.every("lanes", 8, 16),)))
    lines = m.to_text().splitlines()
    assert lines[0].startswith("dk: |kernel - oracle| / allowed over [query x dim], max over batch, head")
    assert "block_k every 16" in lines[1] and "lanes every 8" in lines[1]
    rows = [line for line in lines if re.match(r"\s*\d+ \|", line)]
    assert len(rows) == 32 and all(r.count("|") == 3 for r in rows)  # frame + one column boundary
    separators = [line for line in lines[2:] if line.strip().startswith("+")]
    assert len(separators) == 2 + 3  # frame top and bottom, boundaries at 16, 32, 48
    bad = [r for r in rows if set(r) & set("*#%@")]
    assert len(bad) == 1 and bad[0].split("|")[0].strip() == "32"  # the block's first row, nothing else


def test_the_gate_keeps_the_maps_of_failures_and_of_budgets_past_a_threshold():
    """A property of each record alone: the same records get the same maps whichever worker
    runs them, in whatever order."""
    maps = em.PastBudget()
    key = ("k", "builtin", "out")
    assert maps.keep(key, em.MAP_BUDGET, failing=False) and maps.keep(key, 0.01, failing=True)
    assert not maps.keep(key, em.MAP_BUDGET / 2, failing=False)
    assert maps.keep(key, em.MAP_BUDGET, failing=False)  # again: nothing remembered
    assert em.EveryMap().keep(key, 0.0, failing=False)


def test_the_check_pipeline_attaches_maps_as_the_policy_says():
    spec = toy_spec.SPEC
    case = spec.case(3, dtype="float32", batch=2, heads=2, seq_len=16, head_dim=4, causal=False,
                     sm_scale=toy_spec.SM_SCALE)

    def run(impl, maps):
        return check.check_case(check.Target(spec, "user", impl, BACKENDS["xla"]), case, maps=maps).records

    assert all(r.error_map is None for r in run(toy_spec.toy_attention, None))
    every = run(toy_spec.toy_attention, em.EveryMap())
    assert [r.error_map.direction for r in every] == list(toy_spec.SPEC.directions)
    for r in every:
        assert r.passed and r.error_map.budget == pytest.approx(r.budget, rel=0.01)
        assert 0 < r.timings["error_map_s"] <= r.timings["compare_s"]
    # The chunk-edge bug: the key at the chunk boundary gets no weight, so its dv row is
    # what the oracle has there exactly, off by the whole row: the worst row of dv's map.
    maps = em.PastBudget()
    edge = {r.direction: r for r in run(toy_spec.toy_attention_chunk_edge, maps)}
    assert all(not r.passed and r.error_map is not None for r in edge.values())
    dv = edge["dv"].error_map
    assert dv.rows.bounds == (("key chunk", (8,)),) and dv.worst_cell()[0] == 8
    # A passing case keeps a map where its budget reaches the threshold, run after run.
    for _ in range(2):
        passing = run(toy_spec.toy_attention, em.PastBudget(threshold=every[1].budget))
        assert [r.error_map is not None for r in passing] == [r.budget >= every[1].budget for r in every]


def test_a_layout_that_does_not_fit_is_an_error_record_naming_it():
    class Misfit(toy_spec.ToySpec):
        def error_map_layout(self, case, direction):
            return layouts.ErrorMapLayout(("query", "dim"), 0, 1)

    case = toy_spec.SPEC.case(3, dtype="float32", batch=2, heads=2, seq_len=8, head_dim=4, causal=False,
                              sm_scale=toy_spec.SM_SCALE)
    records = check.check_case(check.Target(Misfit(), "user", toy_spec.toy_attention, BACKENDS["xla"]), case,
                               maps=em.EveryMap()).records
    assert {r.outcome for r in records} == {"error"}
    assert all("error_map_layout does not fit" in r.reason and "names 2 axes" in r.reason for r in records)


def test_svg_draws_image_axes_and_each_boundary_escaped():
    kernel, oracle = noisy((1, 1, 512, 128))
    m = em.build(kernel, oracle, allowed=1e-6, direction="out",
                 layout=layouts.ErrorMapLayout(("b", "h", "<query>", "dim"), 2, 3, (layouts.every("q<b>", 128, 512),)))
    svg = plots.error_map(m, title="out <x>", element_id="map-1")
    assert svg.count("<image") == 1 and "data:image/png;base64," in svg
    assert svg.count('class="bound"') == 3 and "&lt;query&gt;" in svg and "q&lt;b&gt;" in svg
    assert "<x>" not in svg and "<query>" not in svg


def test_png_is_valid():
    data = plots.png(np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3))
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR" and struct.unpack(">II", data[16:24]) == (3, 2)
    idat = data.index(b"IDAT")
    size, = struct.unpack(">I", data[idat - 4:idat])
    raw = zlib.decompress(data[idat + 4: idat + 4 + size])
    assert raw == b"\x00" + bytes(range(9)) + b"\x00" + bytes(range(9, 18))


def _example_with_most_directions(spec):
    examples = coverage.examples(spec)
    return next((c for c in examples if {"bias", "b_in_given__b_out_given"} & set(spec.classes(c))), examples[0])


@pytest.mark.parametrize("family", ["flash_attention", "ragged_paged_attention", "blockwise_ffn", "ring_attention",
                                    "ring_attention_standard", "ring_flash_attention"])
def test_every_builtin_spec_lays_out_every_direction(family):
    spec = specs.all_specs()[family]
    case = _example_with_most_directions(spec)
    inputs = spec.inputs(case)
    truth = spec.oracle(case, inputs)
    care = spec.care(case, inputs)
    for direction, oracle in truth.items():
        layout = spec.error_map_layout(case, direction)
        assert layout is not None and len(layout.axis_names) == np.ndim(oracle), (direction, np.shape(oracle))
        m = em.build(oracle, oracle, allowed=1.0, direction=direction, layout=layout, care=care.get(direction))
        assert m.values.shape[0] <= em.MAX_CELLS and m.values.shape[1] <= em.MAX_CELLS
        assert m.budget in (0.0, em.DONT_CARE)
        assert all(0 < p < axis.length for axis in (m.rows, m.cols) if axis for _, ps in axis.bounds for p in ps)
    assert family != "flash_attention" or "dab" in truth
    p = case.params
    if family == "ragged_paged_attention":
        layout = spec.error_map_layout(case, "out")
        assert list(dict(layout.row_bounds)["sequence end"]) == list(inputs["cu_q_lens"][1:len(p.seqs) + 1])
        assert dict(layout.col_bounds)["kv head"] == tuple(range(p.num_q_heads // p.num_kv_heads, p.num_q_heads,
                                                                 p.num_q_heads // p.num_kv_heads))
    if family == "ring_attention":
        assert dict(spec.error_map_layout(case, "dk").row_bounds)["device shard"] == tuple(
            range(p.per_device, p.seq_len, p.per_device))


# Block sizes that differ wherever two could be confused within a direction or between
# passes, on a query axis shorter than the key axis.
FLASH_BLOCKS = dict(block_q=128, block_k_major=256, block_k=128, block_b=1, block_q_major_dkv=512,
                    block_k_major_dkv=256, block_k_dkv=128, block_q_dkv=256, block_k_major_dq=512, block_k_dq=128,
                    block_q_dq=256)
FLASH_BOUNDS = {"out": ({"block_q", "block_k_major on the causal diagonal"}, set()),
                "dq": ({"block_q_dq", "block_k_major_dq on the causal diagonal"}, set()),
                "dk": ({"block_k_major_dkv", "block_k_dkv", "block_q_major_dkv on the causal diagonal"}, set()),
                "dv": ({"block_k_major_dkv", "block_k_dkv", "block_q_major_dkv on the causal diagonal"}, set()),
                "dab": ({"block_q_dq"}, {"block_k_major_dq", "block_k_dq"})}


def test_flash_maps_draw_each_pass_on_its_own_blocks():
    """Every boundary set named after a BlockSizes field sits at the multiples of that
    field, on the axis it tiles; each direction shows the blocks of the pass computing it."""
    spec = specs.all_specs()["flash_attention"]
    example = coverage.examples(spec)[0]
    params = dataclasses.replace(example.params, q_len=512, kv_len=1024, causal=True,
                                 blocks=BlockSizes(**FLASH_BLOCKS))
    case = dataclasses.replace(example, params=params)
    lengths = {"query": 512, "key": 1024}
    for direction, (row_names, col_names) in FLASH_BOUNDS.items():
        layout = spec.error_map_layout(case, direction)
        assert {n for n, _ in layout.row_bounds} == row_names and {n for n, _ in layout.col_bounds} == col_names
        for axis, bounds in ((layout.rows, layout.row_bounds), (layout.cols, layout.col_bounds)):
            for name, positions in bounds:
                block = FLASH_BLOCKS[name.removesuffix(" on the causal diagonal")]
                length = lengths[layout.axis_names[axis]]
                assert positions == tuple(range(block, length, block)), (direction, name)
    # Without causal masking there is no diagonal to draw.
    acausal = dataclasses.replace(case, params=dataclasses.replace(params, causal=False))
    assert {n for n, _ in spec.error_map_layout(acausal, "out").row_bounds} == {"block_q"}
