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
])
def test_a_kind_moves_its_operand_only(kind, role, mean, std):
    x = _values(kind, role)
    assert abs(x.mean() - mean) < 0.05 and abs(x.std() - std) < 0.05
    assert all(_standard_normal(_values(kind, other)) for other in ROLES if other != role and not (
        kind == "large" and other in ("q", "k")))


def test_offset_moves_v_up_on_the_first_half_of_the_keys_and_down_on_the_second():
    v = _values("offset", "v")
    first, second = v[..., : SHAPE[2] // 2, :], v[..., SHAPE[2] // 2:, :]
    assert abs(first.mean() - 4.0) < 0.05 and abs(second.mean() + 4.0) < 0.05
    assert abs(first.std() - 1) < 0.05 and abs(second.std() - 1) < 0.05
    assert all(_standard_normal(_values("offset", other)) for other in ROLES if other != "v")
    # An odd number of keys: the middle one goes up.
    odd = S.attention_values(np.random.default_rng(0), "offset", (3, 2), role="v")
    assert (odd[:2] > 0).all() and (odd[2] < 0).all() and (np.abs(odd) > 1).all()


def test_normal_is_standard_normal_for_every_operand():
    assert all(_standard_normal(_values("normal", role)) for role in ROLES)


def test_ties_repeat_each_key_once_and_nothing_else():
    k = _values("ties", "k")
    assert np.array_equal(k[..., 0::2, :], k[..., 1::2, :])
    assert len(np.unique(k[0, 0, :, 0])) == SHAPE[2] // 2
    assert all(_standard_normal(_values("ties", role)) for role in ROLES if role != "k")


def test_every_kind_is_one_of_these():
    assert set(S.VALUE_KINDS) == {"normal", "large", "ties", "offset"}


def test_sink_draws_every_query_to_key_0_by_a_margin_growing_over_the_queries():
    q = S.attention_values(np.random.default_rng(0), S.SINK, (256, 128), role="q")
    k = S.attention_values(np.random.default_rng(1), S.SINK, (4096, 128), role="k")
    logits = q @ k.T / np.sqrt(128)
    margin = logits[:, 0] - np.median(logits[:, 1:], axis=1)
    # Each row's margin is its share of SINK_GAP plus noise of std about 2 (its own q against
    # key 0's): the mean of 16 rows is within 2 of the share's.
    share = S.SINK_GAP * np.linspace(0, 1, 256)
    assert abs(margin[:16].mean() - share[:16].mean()) < 2 and abs(margin[-16:].mean() - share[-16:].mean()) < 2
    # The shares' spread (std 5.8) against that noise: a correlation of about 0.95.
    assert np.corrcoef(margin, np.arange(256))[0, 1] > 0.9
    assert _standard_normal(k[1:])
    assert all(_standard_normal(_values(S.SINK, role)) for role in ROLES if role not in "qk")
