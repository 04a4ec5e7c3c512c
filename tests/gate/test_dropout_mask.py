"""The ring kernels' dropout keep mask, judged on its own.

The gate's oracle applies the convention's mask as given (inverted dropout), which proves
the kernel uses the mask it documents, on every device count and chunking; this judges
the mask: the keep rate, independence across batch, heads, positions and seeds.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

pytestmark = [pytest.mark.gate, pytest.mark.attncheck_family("ring_attention")]
RATE = 0.25
SHAPE = (2, 2, 256, 256)  # batch, heads, q, kv


@pytest.fixture
def keep_mask(attncheck_kernel_time):
    """The kernel's keep mask of a seed."""
    from attncheck_kernels.ring_attention import attention_dropout_mask

    def make(seed):
        with attncheck_kernel_time():
            return np.asarray(attention_dropout_mask(jax.random.key(seed), RATE, *SHAPE)).astype(bool)

    return make


def test_keep_rate_matches_one_minus_rate_within_five_sigma(keep_mask):
    keep = keep_mask(0)
    n = keep.size
    sigma = np.sqrt(RATE * (1 - RATE) / n)
    assert abs(keep.mean() - (1 - RATE)) < 5 * sigma, keep.mean()
    for axis in range(4):  # no slice along any axis is far off either
        per_slice = keep.mean(axis=tuple(i for i in range(4) if i != axis))
        slice_sigma = np.sqrt(RATE * (1 - RATE) * per_slice.size / n)
        assert np.all(np.abs(per_slice - (1 - RATE)) < 6 * slice_sigma), (axis, per_slice.min(), per_slice.max())


def test_masks_differ_across_batch_heads_and_seeds(keep_mask):
    keep = keep_mask(0)
    agree = lambda a, b: np.mean(a == b)  # noqa: E731  independent masks agree on 1 - 2 r (1 - r) = 62.5%
    expected = 1 - 2 * RATE * (1 - RATE)
    for a, b in ((keep[0, 0], keep[1, 0]), (keep[0, 0], keep[0, 1]), (keep[0, 0], keep_mask(1)[0, 0]),
                 (keep[0, 0, :-1], keep[0, 0, 1:])):
        assert abs(agree(a, b) - expected) < 0.02, agree(a, b)
    assert np.array_equal(keep, keep_mask(0)), "the mask must be a function of the seed"
