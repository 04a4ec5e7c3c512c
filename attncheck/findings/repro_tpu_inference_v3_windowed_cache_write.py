"""tpu-inference's ragged paged attention v3: with a sliding window, the new K/V of a
sequence whose queries span several q blocks do not all reach the updated cache. The
attention output stays right.

One mixed sequence: 4 cached tokens, 20 new ones, a window of 5, q blocks of 8 and kv
blocks of one page (8). The kernel writes a kv block's new tokens into the cache only in
the last q block's pass (kernel.py 984-992, `bq_idx == num_bq - 1`), but with a window that
pass starts at kv block `(kv_q_gap + bq_idx * bq_sz - sliding_window) // bkv_sz`
(kernel.py 939-942): kv blocks before it, holding new tokens of the earlier q blocks, are
never written. Here new tokens 0-3 (slots 4-7, kv block 0) keep what the cache held. The
same call without a window writes all 20. sglang-jax fixed this in its copy of the kernel
(sgl-project/sglang-jax PR #1606).

Run:  python findings/repro_tpu_inference_v3_windowed_cache_write.py
On a TPU it needs only jax, numpy and tpu-inference 0.32.0. On CPU, where jax 0.12.0.1's
Pallas TPU interpreter cannot run v3 by itself (DMAs from reshaped refs, stores through
bitcast refs) and importing tpu_inference pulls in vllm, it also needs attncheck: the
kernel's files from the pinned wheel as shipped, and attncheck.interpret_compat's ref views.
Exits 1 with an AssertionError while the bug is present.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

if jax.default_backend() == "tpu":
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel as v3

    interpreted = contextlib.nullcontext
else:
    from attncheck import interpret_compat
    from attncheck.third_party import tpu_inference

    v3 = tpu_inference.module("kernel")

    @contextlib.contextmanager
    def interpreted():
        with interpret_compat.ref_views(), pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            yield

print(f"jax {jax.__version__}, tpu-inference 0.32.0 v3, backend {jax.default_backend()}")

PAGE, PAGES, D = 8, 4, 128
CACHED, NEW, WINDOW, BQ = 4, 20, 5, 8
STALE = 7.0  # what every cache slot holds before the call
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((NEW, 1, D)).astype(np.float32) for _ in range(3))
cache = np.full(v3.get_kv_cache_shape(PAGES, PAGE, 1, D, jnp.float32), STALE, np.float32)
kv_lens = np.array([CACHED + NEW], np.int32)
page_indices = np.arange(PAGES, dtype=np.int32)
cu_q_lens = np.array([0, NEW], np.int32)
distribution = np.array([0, 0, 1], np.int32)  # one mixed sequence
blocks = (BQ, PAGE, BQ, PAGE)  # (bq_sz, bkv_sz, bq_csz, bkv_csz), for every case


def call(sliding_window):
    with interpreted():
        out, updated = v3.ragged_paged_attention(
            q, k, v, cache.copy(), kv_lens, page_indices, cu_q_lens, distribution, sliding_window=sliding_window,
            d_block_sizes=blocks, p_block_sizes=blocks, m_block_sizes=blocks, vmem_limit_bytes=32 * 1024 * 1024)
        return np.asarray(out, np.float64), np.asarray(updated)


def unwritten(updated):
    """The new tokens whose K or V slot (combined heads 0 and 1 of its token slot) is not theirs."""
    slots = updated.reshape(PAGES * PAGE, 2, D)[CACHED:CACHED + NEW]
    return [t for t in range(NEW) if not (np.array_equal(slots[t, 0], k[t, 0])
                                          and np.array_equal(slots[t, 1], v[t, 0]))]


def reference(sliding_window):
    """Causal attention of the new queries over all keys (the cached ones are STALE), in float64."""
    keys = np.concatenate([np.full((CACHED, D), STALE), k[:, 0]]).astype(np.float64)
    values = np.concatenate([np.full((CACHED, D), STALE), v[:, 0]]).astype(np.float64)
    pos_q, pos_k = CACHED + np.arange(NEW)[:, None], np.arange(CACHED + NEW)[None, :]
    visible = (pos_k <= pos_q) & (pos_q < pos_k + (sliding_window or CACHED + NEW))
    logits = np.where(visible, q[:, 0].astype(np.float64) @ keys.T, -np.inf)
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (weights / weights.sum(axis=1, keepdims=True)) @ values


for window in (None, WINDOW):
    out, updated = call(window)
    error = np.abs(out[:, 0] - reference(window))
    print(f"sliding_window={window}: output max |error| vs float64 {error.max():.2e}; "
          f"new tokens not written to the cache: {unwritten(updated)}")
    if window is None:
        assert not unwritten(updated), "the reproducer's own check is wrong: the windowless call must write all"
assert not unwritten(updated), (
    f"with sliding_window={WINDOW}, new tokens {unwritten(updated)} of {NEW} (slots "
    f"{[CACHED + t for t in unwritten(updated)]}) were not written to the updated cache: they hold {STALE}, "
    "what the cache held before the call")
print("OK: every new token's K and V reach the cache")
