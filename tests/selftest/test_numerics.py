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


def test_an_exact_direction_allows_no_difference_at_all():
    """A copied direction (a KV cache): one element one ulp off fails, where the tolerance of
    a computed direction passes it; equal values and NaN where the oracle has NaN pass."""
    oracle = np.array([1.0, -2.0, np.nan, 0.5])
    off = oracle.copy()
    off[0] = np.nextafter(np.float32(1.0), np.float32(2.0))
    assert numerics.compare(off, oracle, oracle, dtype=np.float32, direction="kv_cache").passed
    cmp = numerics.compare(off, oracle, oracle, dtype=np.float32, direction="kv_cache", exact=True)
    assert not cmp.passed and cmp.budget == np.inf and "1 of 3 elements differ" in cmp.reason
    same = numerics.compare(oracle.astype(np.float32), oracle, oracle, dtype=np.float32, direction="kv_cache",
                            exact=True)
    assert same.passed and same.budget == 0 and same.allowed == 0


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
def _judged(oracle, *yardsticks, kernel=None, exact=None):
    from attncheck import check
    from attncheck.report.records import CaseRun

    base = CaseRun(case_id="c", case={}, kernel="k", impl="i", impl_ref="m:f", backend="xla", backend_settings={},
                   dtype="float32", seq_len=8, device_count=1, classes=(), repro="")
    got = np.float32(yardsticks[0] if kernel is None else kernel)
    return check.judge(base, "dq", got, oracle, tuple(yardsticks),
                       dtype=np.float32, care=None, timings={}, exact=exact)


def test_a_yardstick_as_wrong_in_float64_is_refused():
    """A wrong mapping: the same wrong gradient in any precision and summation order."""
    rng = np.random.default_rng(0)
    oracle = rng.standard_normal((4, 8))
    wrong = oracle * 1.5
    record = _judged(oracle, wrong, wrong + 1e-7 * rng.standard_normal(oracle.shape), exact=lambda: wrong)
    assert record.outcome == "error" and "the spec's mapping or the yardstick is wrong" in record.reason
    assert f"computed in float64 it is still {np.max(np.abs(oracle / 2)):.3g} from it" in record.reason


def test_a_gradient_that_cancels_to_zero_is_judged_on_its_rounding():
    """dq of a saturated softmax: about 3e-16 in float64, all rounding in float32 (measured
    on a ring case: 1.4e-5 from the oracle, 5e17 ulps at its own magnitude); the same
    yardstick in float64 lands on the oracle."""
    rng = np.random.default_rng(1)
    oracle = 3e-16 * rng.standard_normal((4, 8))
    rounded = oracle + 1e-5 * rng.standard_normal(oracle.shape)
    kernel = oracle + 1e-5 * rng.standard_normal(oracle.shape)
    record = _judged(oracle, rounded, kernel=kernel, exact=lambda: oracle + 1e-20)
    assert record.outcome == "pass", record.reason
    # A float64 yardstick that keeps more than 1/8 of the distance does not explain it...
    assert _judged(oracle, rounded, kernel=kernel, exact=lambda: rounded / 4).outcome == "error"
    # ...nor does one that was not computed, or could not be.
    assert "not computed in float64" in _judged(oracle, rounded, kernel=kernel).reason

    def broken():
        raise TypeError("float64 not supported")

    assert "computing it in float64 failed: TypeError" in _judged(oracle, rounded, kernel=kernel, exact=broken).reason


def test_the_yardstick_in_float64_is_the_oracle_where_bfloat16_cancels():
    """A bfloat16 ring case of large values (dropout, a bias with -inf rows) whose dk
    cancels: the working yardstick is 7489 ulps from the oracle in a sum too short for its
    summation orders to differ; computed in float64 it is the oracle up to float64 rounding."""
    from attncheck import specs, yardstick

    spec = specs.all_specs()["ring_attention"]
    case = spec.case(1382987043, dtype="bfloat16", devices=1, seq_len=8, per_device=8, heads=2, head_dim=16,
                     causal=True, bias="neg_inf_rows", segments="absent", segment_starts=(0, 3), float32_logits=True,
                     values="large", batch=2, sm_scale=0.3, placement="mesh", check_vma=False,
                     segment_dtype="int16", query_chunk_size=8, key_chunk_size=8, dropout_rate=0.25)
    inputs = spec.inputs(case)
    truth = spec.oracle(case, inputs)
    working = spec.yardstick(case, inputs)
    dk = numerics.compare(truth["dk"], truth["dk"], working["dk"], dtype=np.dtype("bfloat16"), direction="dk")
    assert dk.yardstick_ulps > 4096
    with yardstick.exact():
        exact = spec.yardstick(case, inputs)
    for direction, value in exact.items():
        assert value.dtype == np.float64, direction
        assert numerics.distance(value, truth[direction]) <= 1e-9 * numerics.distance(working[direction],
                                                                                     truth[direction]), direction
