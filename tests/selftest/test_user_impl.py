"""--attncheck-impl runs a family's whole gate against any implementation of its convention."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from attncheck import check, selection, specs
from attncheck.backends import BACKENDS
from tests.selftest import chaos, toy_forward_spec, toy_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUNDLED_FLASH = "jax.experimental.pallas.ops.tpu.flash_attention:flash_attention"


def test_unknown_family_or_bad_reference_is_a_clear_usage_error(tmp_path):
    for bad, message in (("nope=attncheck_kernels.flash_attention:flash_attention", "FAMILY one of"),
                         ("flash_attention=no_colon", "package.module:function")):
        proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "attncheck.gate", "-q", "--co",
                               "--attncheck-report", str(tmp_path), "--attncheck-impl", bad],
                              cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode != 0 and message in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]


def test_the_invalid_calls_are_built_for_a_user_implementation():
    tests = selection.invalid_input_tests(selection.Options(kernels="flash_attention",
                                                            impls=(f"flash_attention={BUNDLED_FLASH}",)))
    assert tests and all(t.call is not None and t.impl_name == "user" for t in tests), [t.unbuilt for t in tests]


def test_invalid_calls_that_cannot_be_built_are_one_failing_test_not_a_collection_error(monkeypatch):
    spec = specs.all_specs()["flash_attention"]

    def lacks_a_helper(impl):
        raise AttributeError("module 'theirs' has no attribute 'BlockSizes'")

    monkeypatch.setattr(spec, "invalid_calls", lacks_a_helper)
    tests = selection.invalid_input_tests(selection.Options(kernels="flash_attention"))
    assert [(t.id, t.call, t.unbuilt) for t in tests] == [
        ("flash_attention-builtin-invalid_calls", None,
         "AttributeError: module 'theirs' has no attribute 'BlockSizes'")]


# ------------------------------------------------------------------ what an implementation returns
# A user's implementation that returns the wrong tree, shape or dtype is told so in chex's
# words (attncheck.structure): where its output is first seen (compiled.with_vjp, tracing
# the toy family's forward and VJP) and per direction against the oracle (check.judge, for
# a spec that hands on whatever the implementation returned).
TOY_CASE = dict(dtype="float32", batch=2, heads=2, seq_len=8, head_dim=4, causal=False, sm_scale=toy_spec.SM_SCALE)
TOY_SHAPE = (2, 2, 8, 4)


def returns_tuple(q, k, v, *, causal: bool, sm_scale: float):
    return (toy_spec.toy_attention(q, k, v, causal=causal, sm_scale=sm_scale),)


class HandsOnSpec(toy_forward_spec.ToyForwardSpec):
    """The forward-only toy family, its ``evaluate`` handing on what the implementation
    returned as it came (a user's spec need not make it a NumPy array)."""

    def evaluate(self, impl, case, inputs):
        return {"out": self._forward(impl, case.params)(inputs["q"], inputs["k"], inputs["v"])}


def _records(impl, spec=toy_spec.SPEC) -> dict:
    case = spec.case(3, **TOY_CASE)
    return {r.direction: r for r in check.check_case(check.Target(spec, "user", impl, BACKENDS["xla"]), case).records}


def test_an_output_of_another_shape_is_an_error_in_chex_words():
    traced = _records(chaos.wrong_shape)
    assert list(traced) == ["all"] and traced["all"].outcome == "error"
    assert (f"the output: shapes differ ([Chex] Assertion assert_shape failed: Error in shape compatibility check: "
            f"input 0 has shape (2, 2, 8, 3) but expected {TOY_SHAPE}.)") in traced["all"].reason, traced["all"].reason
    judged = _records(chaos.wrong_shape, HandsOnSpec())["out"]
    assert judged.outcome == "error" and judged.reason == (
        f"out: shapes differ ([Chex] Assertion assert_shape failed: Error in shape compatibility check: input 0 has "
        f"shape (2, 2, 8, 3) but expected {TOY_SHAPE}.)"), judged.reason


def test_a_tuple_where_an_array_is_expected_is_an_error_in_chex_words():
    chex_says = ("([Chex] Assertion assert_trees_all_equal_structs failed: Error in tree structs equality check: "
                 "trees 0 and 1 do not match, tree 0: PyTreeDef((*,)) tree 1: PyTreeDef(*))")
    traced = _records(returns_tuple)
    assert list(traced) == ["all"] and traced["all"].outcome == "error"
    assert (f"the output: the implementation returned tuple, expected an array of shape {TOY_SHAPE} {chex_says}"
            in traced["all"].reason), traced["all"].reason
    judged = _records(returns_tuple, HandsOnSpec())["out"]
    assert judged.outcome == "error", judged.reason
    assert judged.reason == (f"out: the implementation returned tuple, expected an array of shape {TOY_SHAPE} "
                             f"{chex_says}")


def test_an_output_in_another_dtype_fails_in_chex_words_and_a_right_one_passes():
    records = _records(chaos.wrong_dtype)
    assert records["out"].outcome == "fail" and records["out"].reason.startswith(
        "returned out in float16, expected float32 (the dtype of its input; [Chex] Assertion assert_type failed: "
        "Error in type compatibility check: input 0 has type float16 but expected float32.); "), records["out"].reason
    # The check changes nothing for an implementation that returns what is expected, as an
    # array of jax's or of NumPy's.
    for spec in (toy_spec.SPEC, HandsOnSpec()):
        assert all(r.outcome == "pass" for r in _records(toy_spec.toy_attention, spec).values())
