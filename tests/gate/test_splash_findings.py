"""Kernel findings of jax's splash attention that its case strategy does not draw (they
would fail every gate run): each is kept here as a strict xfail through the real pipeline,
so it is reported on every run and turns into a failure the day the kernel is fixed (then
drop it here and the exclusion in attncheck/specs/splash.py)."""

from __future__ import annotations

import pytest

from attncheck import check
from attncheck.backends import BACKENDS
from attncheck.specs import all_specs, resolve_impl, splash

pytestmark = [pytest.mark.gate, pytest.mark.attncheck_family(splash.FAMILY)]


def _case(q_seq_shards=1, masks=(("causal", -128),), **blocks):
    sizes = {name: 128 for name in splash.BLOCK_FIELDS} | blocks
    return all_specs()[splash.FAMILY].case(
        0, dtype="float32", api="mha", heads=4, kv_heads=2, q_len=256, kv_len=128, head_dim=64, v_head_dim=64,
        masks=masks * 4, segments="none", segment_starts=(), soft_cap=None, blocks=tuple(sizes.items()),
        fused_bwd=False, head_shards=1, q_seq_shards=q_seq_shards, values="normal")


FINDINGS = {
    # Bottom-right causal with q_len 256 > kv_len 128: queries 0..127 see no key, a whole
    # forward q block of 128 (NaN rows, zero cotangent); the dkv pass's q block of 256 also
    # holds queries that do: dk and dv come out NaN.
    "rows_without_keys_poison_a_larger_backward_block": (splash.forward_nan_rows_reach_backward,
                                                          _case(block_q_dkv=256)),
    # A full mask split over 2 q sequence shards: make_splash_mha raises "need at least one
    # array to concatenate".
    "full_mask_over_q_seq_shards": (splash.q_seq_shards_without_partial_blocks,
                                    _case(q_seq_shards=2, masks=(("full",),))),
    # Bottom-right causal with q_len 256 > kv_len 128 over 2 q sequence shards: the first
    # shard's queries see no key; make_splash_mha stops at a bare assertion. Found by the
    # gate's coverage search once it looked for q_seq_shards cases on fewer devices.
    "q_seq_shard_without_keys": (splash.q_seq_shard_without_keys, _case(q_seq_shards=2)),
}


@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_each_finding_is_a_case_the_strategy_leaves_out(name):
    # Outside the xfail below, where a wrong condition would fail as expected.
    excluded_by, case = FINDINGS[name]
    assert excluded_by(case.params)


@pytest.mark.parametrize("name", sorted(FINDINGS))
@pytest.mark.xfail(strict=True, reason="kernel finding of jax's splash attention (see FINDINGS)")
def test_known_kernel_finding(name):
    _, case = FINDINGS[name]
    spec = all_specs()[splash.FAMILY]
    target = check.Target(spec, "builtin", resolve_impl(spec.default_impls["builtin"]), BACKENDS["interpret"])
    outcome = check.check_case(target, case)
    assert outcome.records and not outcome.failures, outcome.summary()
