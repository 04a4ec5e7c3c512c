"""Parameter coverage: the surface read off a kernel call, and the check that every
parameter varied in a run (or is declared fixed, with the reason)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attncheck import compiled, parameters
from attncheck.report import merge, parameter_coverage
from attncheck.report.policy import Policy
from attncheck.report import records as rec
from tests.selftest import harness, test_report


@dataclasses.dataclass(frozen=True)
class Blocks:
    block_q: int = 128
    block_k: int = 128


class Segments(NamedTuple):
    q: jax.Array
    kv: jax.Array


def kernel(q, k, v, ab=None, segment_ids=None, *, causal=False, sm_scale=1.0, block_sizes=None, debug=False):
    return q


def sharded(q, k, v, *, num_devices=None, **kwargs):
    return q


def target(q, k, v, *, axis_name, causal=False, precision=None):
    return q


def test_the_surface_names_every_keyword_config_field_and_array_axis():
    q = np.zeros((2, 4, 8, 16), np.float32)
    seg = Segments(np.zeros((2, 8), np.int32), np.zeros((2, 8), np.int32))
    found = parameters.surface(kernel, (q, q, q), dict(segment_ids=seg, causal=True, block_sizes=Blocks(64)))
    assert found == {
        "q": "<array>", "k": "<array>", "v": "<array>",
        "q.dtype": "float32", "q.shape[0]": "2", "q.shape[1]": "4", "q.shape[2]": "8", "q.shape[3]": "16",
        "k.dtype": "float32", "k.shape[0]": "2", "k.shape[1]": "4", "k.shape[2]": "8", "k.shape[3]": "16",
        "v.dtype": "float32", "v.shape[0]": "2", "v.shape[1]": "4", "v.shape[2]": "8", "v.shape[3]": "16",
        "ab": "None", "segment_ids": "<Segments>", "segment_ids.q": "<array>", "segment_ids.kv": "<array>",
        "segment_ids.q.dtype": "int32", "segment_ids.q.shape[0]": "2",
        "segment_ids.q.shape[1]": "8", "segment_ids.kv.dtype": "int32", "segment_ids.kv.shape[0]": "2",
        "segment_ids.kv.shape[1]": "8", "causal": "True", "sm_scale": "1.0",
        "block_sizes": "<Blocks>", "block_sizes.block_q": "64", "block_sizes.block_k": "128",
        "debug": "False"}  # a keyword left out has its default
    # An optional array is a parameter value too: given or None.
    assert parameters.surface(kernel, (q, q, q, q), {})["ab"] == "<array>"


def test_an_optional_tuple_records_whether_it_was_given():
    given, absent = {}, {}
    parameters.describe("block_sizes", (8, 32), given)
    parameters.describe("block_sizes", None, absent)
    assert given == {"block_sizes": "<tuple>", "block_sizes.len": "2", "block_sizes[0]": "8", "block_sizes[1]": "32"}
    assert absent == {"block_sizes": "None"}


def test_keywords_forwarded_through_kwargs_come_from_the_function_they_reach():
    q = np.zeros((1, 8, 2, 4), np.float32)
    found = parameters.surface(sharded, (q, q, q), dict(num_devices=2, causal=True), keyword_targets=[target])
    assert (found["num_devices"], found["causal"], found["precision"]) == ("2", "True", "None")
    assert found["axis_name"] == parameters.DEFAULT and "kwargs" not in found  # required there: no default


def test_the_probe_records_without_running_the_kernel_even_inside_jit_and_vjp():
    ran = []

    def impl(q, k, *, scale):
        ran.append(1)
        return q * scale

    def run(fn):  # what a spec's run does: jit, vjp, a traced scalar
        return jax.jit(lambda q, k, s: jax.vjp(lambda q: fn(q, k, scale=s), q)[0])(jnp.ones(3), jnp.ones(4), 2.0)

    found = parameters.record(run, impl)
    assert found == {"q": "<array>", "q.dtype": "float32", "q.shape[0]": "3", "k": "<array>", "k.dtype": "float32",
                     "k.shape[0]": "4", "scale": parameters.TRACED, "scale.dtype": "float32"}
    assert ran == []
    assert parameters.record(lambda fn: 1 / 0, impl) is None  # never reached: nothing to record


def test_a_factory_runs_and_its_product_is_probed():
    def make(mask_name, *, block=128):
        return lambda q, *, cap=None: q

    found = parameters.record(lambda fn: fn("causal", block=64)(np.zeros((2, 8))), make)
    assert found == {"mask_name": "'causal'", "block": "64", "call.q": "<array>", "call.q.dtype": "float64",
                     "call.q.shape[0]": "2", "call.q.shape[1]": "8", "call.cap": "None"}


class Layout(enum.IntEnum):
    HEAD_DIM_MINOR = 1
    SEQ_MINOR = 2


def test_an_enum_value_is_a_value_not_a_presence_marker():
    found = parameters.record(lambda fn: fn(np.zeros(2), layout=Layout.SEQ_MINOR),
                              lambda x, *, layout=Layout.HEAD_DIM_MINOR: x)
    assert found["layout"] == "Layout.SEQ_MINOR"
    counts = parameter_coverage.table([("f", found), ("f", found)])
    assert "layout (always Layout.SEQ_MINOR)" in parameter_coverage.unvaried(counts, {})["f"]


def test_a_parameter_that_kept_one_value_is_unvaried_unless_declared_fixed():
    counts = parameter_coverage.table([("f", {"a": "1", "b": "x", "q.shape[0]": "2", "q": "<array>", "s": "<traced>"}),
                               ("f", {"a": "2", "b": "x", "q.shape[0]": "2", "q": "<array>", "s": "<traced>"})])
    assert counts["f"]["a"].cases == {"1": 1, "2": 1} and not counts["f"]["b"].varied
    assert parameter_coverage.unvaried(counts, {}) == {"f": ["b (always x)", "q.shape[0] (always 2)"]}
    assert parameter_coverage.unvaried(counts, {"f": {"*.shape[0]": "batch fixed"}}) == {"f": ["b (always x)"]}
    assert parameter_coverage.fixed_reason("q.shape[0]", {"q.shape[*]": "batch fixed"}) == "batch fixed"
    assert parameter_coverage.fixed_reason("q.shape[1]", {"q.shape[0]": "only axis 0"}) is None  # brackets are literal


@pytest.mark.parametrize("value, cells", [
    ("-0.3", ("negative", "not a power of two")), ("-0.5", ("negative",)), ("0.0", ("zero",)),
    ("0.125", ("in (0, 1)",)), ("0.3", ("in (0, 1)", "not a power of two")), ("1.0", ("one",)),
    ("1.7", ("above 1", "not a power of two")), ("-1e+30", ("negative", "not a power of two")),
    ("None", ()), ("<default>", ()), ("inf", ()), ("float32", ()),
])
def test_a_real_value_falls_in_its_cells(value, cells):
    assert parameters.number_cells(value) == cells


def test_a_real_parameter_must_reach_every_cell_unless_declared_outside_the_convention():
    counts = parameter_coverage.table([("f", {"scale": v, "block": b, "cap": c})
                               for v, b, c in (("0.3", "128", "None"), ("1.0", "256", "2.0"), ("-0.5", "512", "0.7"))])
    assert not parameter_coverage.real_valued(counts["f"]["block"])  # sizes are written as integers
    assert parameter_coverage.cells(counts["f"]["scale"]) == {"negative": 1, "zero": 0, "in (0, 1)": 1, "one": 1,
                                                      "above 1": 0, "not a power of two": 1}
    assert parameter_coverage.unreached(counts, {}) == {"f": ["cap negative", "cap zero", "cap one", "scale zero",
                                                      "scale above 1"]}
    declared = {**parameters.outside_convention("cap", ("negative", "zero"), "a cap is positive"),
                **parameters.outside_convention("scale", ("*",), "any")}
    assert parameter_coverage.unreached(counts, {"f": declared}) == {"f": ["cap one"]}
    assert parameter_coverage.unreached(counts, {"f": {"cap": "kept at one value", "scale=*": "any"}}) == {}
    with pytest.raises(ValueError, match="cells \\['positive'\\]"):
        parameters.outside_convention("cap", ("positive",), "")


def test_value_cell_classes_reach_their_cells_and_name_them():
    from attncheck import bugclasses

    classes = bugclasses.numbers("sm_scale", lambda p: p, ("negative", "in (0, 1)", "not a power of two")).classes
    assert [c.name for c in classes] == ["sm_scale_negative", "sm_scale_in_0_1", "sm_scale_not_a_power_of_two"]
    assert [[c.applies(v) for v in (-0.5, 0.25, 0.3, None)] for c in classes] == [
        [True, False, False, False], [False, True, True, False], [False, False, True, False]]
    with pytest.raises(ValueError, match="numbers\\('sm_scale'\\)"):
        bugclasses.numbers("sm_scale", lambda p: p, ("small",))


def test_an_unreached_cell_is_a_coverage_problem_named_in_the_report(tmp_path):
    writer = rec.RecordWriter(tmp_path, test_report.RUN_ID, "main")
    for case, scale in (("c0", "0.5"), ("c1", "-1.5")):
        writer.write(dataclasses.replace(test_report.record(case), parameters={"scale": scale}))
    report = merge.merge(tmp_path, test_report.RUN_ID, merge.RunOutcome(complete=True),
                         Policy(applicable={"toy_attention": ()}, require_coverage=True,
                                fixed_parameters={"toy_attention": {"scale=zero": "no zero scale"}}))
    assert report.problems == ["value coverage: toy_attention never drew scale one, scale above 1"]
    from attncheck.report import render

    text = "\n".join(render.render_parameters_markdown(report))
    assert ("<code>scale</code>, cases per cell: negative 1, zero 0 (outside the convention: no zero scale), "
            "in (0, 1) 1, **one 0**, **above 1 0**, not a power of two 1") in text


def test_the_probe_lives_in_the_implementations_module_under_its_own_name():
    # Specs find a convention's helper types (BlockSizes, mask_lib) in the implementation's
    # module, also for a functools.partial such as jax's make_splash_mha.
    made = functools.partial(kernel, causal=True)
    globals()["made_kernel"] = made
    try:
        probed = parameters.probe(made)
        assert compiled.impl_module(probed) is sys.modules[__name__]
        assert compiled.impl_key(probed) != compiled.impl_key(made)
    finally:
        del globals()["made_kernel"]


def test_cases_whose_call_could_not_be_probed_are_a_coverage_problem(tmp_path):
    writer = rec.RecordWriter(tmp_path, test_report.RUN_ID, "main")
    for case, surface in (("c0", {"a": "1"}), ("c1", {"a": "2"}), ("c2", None)):
        writer.write(dataclasses.replace(test_report.record(case), parameters=surface))

    def problems(require_coverage):
        return merge.merge(tmp_path, test_report.RUN_ID, merge.RunOutcome(complete=True),
                           Policy(applicable={"toy_attention": ()}, require_coverage=require_coverage)).problems

    assert problems(True) == ["parameter coverage: toy_attention: the call of 1 case(s) could not be probed "
                              "(attncheck.parameters), so their parameters are unknown"]
    assert problems(False) == []


def test_a_keyword_the_spec_never_passes_fails_the_gate(gate_dir, pytester):
    """The check is generic: a keyword added to an implementation shows up as never varied
    without anyone touching the spec."""
    result = harness.run_gate(pytester, "rep", "--attncheck-require-coverage", "-k", "not invalid",
                              harness.impl_option("toy_attention_new_keyword"))
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    report = harness.load_report(gate_dir / "rep")
    assert report["verdict"] == "FAIL" and report["totals"]["failures"] == 0
    assert report["problems"] == ["parameter coverage: toy_attention never varied window (always None)"]
    assert report["parameters"]["toy_attention"]["window"] == {"None": report["totals"]["cases"]}
    # The built-in implementation, without the keyword: every parameter varied or is declared fixed.
    result = harness.run_gate(pytester, "rep2", "--attncheck-require-coverage", "-k", "not invalid")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
