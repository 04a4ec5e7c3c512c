"""--attncheck-impl runs a family's whole gate against any implementation of its convention."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from attncheck import selection, specs

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUNDLED_FLASH = "jax.experimental.pallas.ops.tpu.flash_attention:flash_attention"


def test_unknown_family_or_bad_reference_is_a_clear_usage_error(tmp_path):
    for bad, message in (("nope=kernels.flash_attention:flash_attention", "FAMILY one of"),
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
        ("flash_attention-builtin-invalid_calls", None, "AttributeError: module 'theirs' has no attribute 'BlockSizes'")]
