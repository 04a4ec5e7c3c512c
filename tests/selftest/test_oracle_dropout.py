"""The dense oracle's dropout_multiplier: forward closed forms and the VJP by finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attncheck import oracle

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")
RATE = 0.25
FD_STEP = 1e-6


@st.composite
def dropout_problem(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    b, h, q, k, d = 1, 2, draw(st.integers(1, 5)), draw(st.integers(1, 6)), 3
    keep = rng.random((b, h, q, k)) > RATE
    options = dict(scale=0.5, causal=draw(st.booleans()), dropout_multiplier=keep / (1 - RATE),
                   bias=rng.standard_normal((b, h, q, k)) if draw(st.booleans()) else None)
    arrays = [rng.standard_normal(s) for s in ((b, h, q, d), (b, h, k, d), (b, h, k, d), (b, h, q, d))]
    return arrays, options


def test_multiplier_of_ones_changes_nothing():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 4, 3)) for _ in range(3))
    plain = oracle.attention(q, k, v, scale=0.5, causal=True)
    ones = oracle.attention(q, k, v, scale=0.5, causal=True, dropout_multiplier=np.ones((1, 2, 4, 4)))
    np.testing.assert_array_equal(plain.out, ones.out)


def test_dropping_a_key_removes_its_value_but_not_its_weight_in_the_normaliser():
    q = np.zeros((1, 1, 1, 2))  # equal logits: each of the 2 keys has probability 1/2
    k = np.ones((1, 1, 2, 2))
    v = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])
    keep = np.array([[[[1.0, 0.0]]]]) / (1 - RATE)
    result = oracle.attention(q, k, v, scale=1.0, dropout_multiplier=keep)
    np.testing.assert_allclose(result.out[0, 0, 0], [0.5 / (1 - RATE), 0.0], rtol=1e-15)
    assert result.lse[0, 0, 0] == pytest.approx(np.log(2.0))


@settings(max_examples=30, deadline=None)
@given(dropout_problem())
def test_vjp_matches_central_finite_differences(problem):
    (q, k, v, d_out), options = problem
    grads = oracle.attention_vjp(q, k, v, d_out, **options)
    loss = lambda q, k, v: np.sum(d_out * oracle.attention(q, k, v, **options).out)  # noqa: E731
    for name, index in (("dq", 0), ("dk", 1), ("dv", 2)):
        args = [q, k, v]
        numeric = np.zeros_like(args[index])
        for i in np.ndindex(args[index].shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[index][i] += FD_STEP
            minus[index][i] -= FD_STEP
            numeric[i] = (loss(*plus) - loss(*minus)) / (2 * FD_STEP)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-8, err_msg=name)
