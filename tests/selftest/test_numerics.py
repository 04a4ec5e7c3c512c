"""The tolerance policy itself: it must pass what is as good as the yardstick and fail the rest."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attncheck import numerics

DTYPES = (np.float32, ml_dtypes.bfloat16)


@st.composite
def problem(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from(((7,), (3, 5), (2, 3, 4))))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    oracle = rng.standard_normal(shape) * draw(st.sampled_from((1e-3, 1.0, 1e3)))
    noise = rng.standard_normal(shape) * numerics.dtype_eps(dtype) * np.abs(oracle).max()
    return dtype, oracle, oracle + noise


@settings(max_examples=40)
@given(problem())
def test_kernel_as_good_as_the_yardstick_passes(p):
    dtype, oracle, yardstick = p
    cmp = numerics.compare(yardstick, oracle, yardstick, dtype=dtype, direction="out")
    assert cmp.passed, cmp.reason
    assert cmp.budget <= 1 / numerics.R_OUTPUT + 1e-12


@settings(max_examples=40)
@given(problem(), st.sampled_from(("out", "dq")))
def test_error_past_the_allowance_fails(p, direction):
    dtype, oracle, yardstick = p
    cmp0 = numerics.compare(yardstick, oracle, yardstick, dtype=dtype, direction=direction)
    kernel = oracle.copy()
    kernel.flat[0] += 1.01 * cmp0.allowed * (1 if kernel.flat[0] >= 0 else -1)
    cmp = numerics.compare(kernel, oracle, yardstick, dtype=dtype, direction=direction)
    assert not cmp.passed and cmp.budget > 1
    assert cmp.worst_index == tuple(int(i) for i in np.unravel_index(0, oracle.shape))


def test_zero_yardstick_error_is_not_impossible():
    oracle = np.array([1.0, -2.0, 0.5])
    kernel = (oracle + np.array([1, 0, 0]) * numerics.dtype_eps(np.float32)).astype(np.float32)
    cmp = numerics.compare(kernel, oracle, oracle, dtype=np.float32, direction="out")
    assert cmp.yardstick_err == 0 and cmp.passed, cmp.reason


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_must_agree_exactly(bad):
    oracle = np.ones(4)
    kernel = oracle.copy()
    kernel[2] = bad
    cmp = numerics.compare(kernel, oracle, oracle, dtype=np.float32, direction="out")
    assert not cmp.passed and "positions differ" in cmp.reason and "(2,)" in cmp.reason
    same = numerics.compare(kernel, kernel, kernel, dtype=np.float32, direction="out")
    assert same.passed


def test_dont_care_elements_are_excluded_and_only_they():
    oracle = np.zeros((2, 3))
    kernel = oracle.copy()
    kernel[1] = np.nan  # garbage in a padding row
    care = np.array([[True], [False]])
    assert numerics.compare(kernel, oracle, oracle, dtype=np.float32, direction="out", care=care).passed
    kernel[0, 1] = 1.0
    assert not numerics.compare(kernel, oracle, oracle, dtype=np.float32, direction="out", care=care).passed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [1.0, 3.0, 1e-3, 1e4, -7.5])
def test_ulp_matches_nextafter(dtype, value):
    x = np.array(value, dtype=dtype)
    spacing = float(np.abs(np.nextafter(x, np.array(np.inf, dtype=dtype)) - x)) if dtype is np.float32 else \
        float(np.abs(ml_dtypes.bfloat16(float(x)) - _next_bf16(x)))
    assert numerics.ulp_of(np.array(abs(float(x))), dtype) == pytest.approx(spacing)


def _next_bf16(x):
    bits = np.array(x, dtype=ml_dtypes.bfloat16).view(np.uint16)
    return float((bits + np.uint16(1)).view(ml_dtypes.bfloat16))


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shapes differ"):
        numerics.compare(np.zeros(3), np.zeros(4), np.zeros(4), dtype=np.float32, direction="out")


# ------------------------------------------------------------------ the yardstick's own check
def _judged(oracle, *yardsticks, kernel=None):
    from attncheck import check
    from attncheck.report.records import CaseRun

    base = CaseRun(case_id="c", case={}, kernel="k", impl="i", impl_ref="m:f", backend="xla", backend_settings={},
                   dtype="float32", seq_len=8, device_count=1, classes=(), repro="")
    got = np.float32(yardsticks[0] if kernel is None else kernel)
    return check.judge(base, "dq", got, oracle, tuple(yardsticks),
                       dtype=np.float32, care=None, timings={})


def test_a_yardstick_far_from_the_oracle_in_every_summation_order_is_refused():
    """A wrong mapping: the same wrong gradient whichever order the yardstick sums in."""
    rng = np.random.default_rng(0)
    oracle = rng.standard_normal((4, 8))
    wrong = oracle * 1.5
    record = _judged(oracle, wrong, wrong + 1e-7 * rng.standard_normal(oracle.shape))
    assert record.outcome == "error" and "the spec's mapping or the yardstick is wrong" in record.reason


def test_a_gradient_that_cancels_to_zero_is_judged_on_its_rounding():
    """dq of a saturated softmax: about 3e-16 in float64, all rounding in float32, whose two
    summation orders disagree about as much as either is from the oracle (measured on a ring
    case: 1.4e-5 and 9.5e-6 from the oracle, 1.1e-5 apart)."""
    rng = np.random.default_rng(1)
    oracle = 3e-16 * rng.standard_normal((4, 8))
    one, other = (oracle + 1e-5 * rng.standard_normal(oracle.shape) for _ in range(2))
    record = _judged(oracle, one, other, kernel=oracle + 1e-5 * rng.standard_normal(oracle.shape))
    assert record.outcome == "pass", record.reason
    # One summation order alone cannot tell rounding from a wrong mapping: refused.
    assert _judged(oracle, one, one).outcome == "error"
