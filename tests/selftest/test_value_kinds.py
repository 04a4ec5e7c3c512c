"""The value kinds a case draws its operands from: each reaches the domain it names, for
the operand it names, and leaves the others standard normal."""

from __future__ import annotations

import numpy as np
import pytest

from attncheck import strategies as S

ROLES = ("q", "k", "v", "bias", "cotangent")
SHAPE = (2, 3, 4096, 8)


def _values(kind: str, role: str) -> np.ndarray:
    return S.attention_values(np.random.default_rng(0), kind, SHAPE, role=role)


def _standard_normal(x: np.ndarray) -> bool:
    return abs(x.mean()) < 0.02 and abs(x.std() - 1) < 0.02


@pytest.mark.parametrize("kind, role, mean, std", [
    ("large", "q", 0.0, 4.0),
    ("large", "k", 0.0, 4.0),
    ("offset", "v", 4.0, 1.0),
])
def test_a_kind_moves_its_operand_only(kind, role, mean, std):
    x = _values(kind, role)
    assert abs(x.mean() - mean) < 0.05 and abs(x.std() - std) < 0.05
    assert all(_standard_normal(_values(kind, other)) for other in ROLES if other != role and not (
        kind == "large" and other in ("q", "k")))


def test_normal_is_standard_normal_for_every_operand():
    assert all(_standard_normal(_values("normal", role)) for role in ROLES)


def test_ties_repeat_each_key_once_and_nothing_else():
    k = _values("ties", "k")
    assert np.array_equal(k[..., 0::2, :], k[..., 1::2, :])
    assert len(np.unique(k[0, 0, :, 0])) == SHAPE[2] // 2
    assert all(_standard_normal(_values("ties", role)) for role in ROLES if role != "k")


def test_every_kind_is_one_of_these():
    assert set(S.VALUE_KINDS) == {"normal", "large", "ties", "offset"}
