"""tpu-inference's ragged paged attention v3: a mask value that bfloat16 rounds away from
zero (-1e30 is -1.00026e30 in bfloat16) makes a windowed row NaN when its kv loop starts a
whole compute chunk before its first visible key.

One decode query at position 32 under a window of 1 (it sees key 32 alone), bfloat16
queries and cache, kv blocks of 32 keys in compute chunks of 16. The kv loop starts at
block 0 (kernel.py 939-942), whose first chunk (keys 0-15) hides every key from the row:
its logits are all mask_value. The running max is kept in the output dtype (kernel.py 502,
`s_rowmax.astype(out_dtype)`): -1e30 rounds to -1.00026e30, below the logits, so
`exp(s - m)` overflows to inf (kernel.py 506), and the next chunk's rescale
`exp(m_prev - m_curr) * l_prev` is 0 * inf: NaN. The kernel's default mask value,
finfo(bfloat16).min, is exact in bfloat16 and gives the right row. Expected: the
attention of the visible key for any finite mask value that hides the keys.

Run:  python findings/repro_tpu_inference_v3_inexact_mask_value_nan.py
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

PAGE, PAGES, D, KV_LEN, WINDOW = 8, 8, 128, 33, 1
rng = np.random.default_rng(0)
# NumPy arrays: the kernel donates its queries and cache, and each call gets its own copy.
q, k, v = (rng.standard_normal((1, 1, D)).astype(jnp.bfloat16) for _ in range(3))
history = rng.standard_normal((KV_LEN - 1, 2, D))  # K and V of the 32 cached tokens
shape = v3.get_kv_cache_shape(PAGES, PAGE, 1, D, jnp.bfloat16)
cache = np.zeros(shape, np.float32).reshape(PAGES * PAGE, 2, D)
cache[:KV_LEN - 1] = history
cache = cache.reshape(shape).astype(jnp.bfloat16)
kv_lens = np.array([KV_LEN], np.int32)
page_indices = np.arange(PAGES, dtype=np.int32)
cu_q_lens = np.array([0, 1], np.int32)
distribution = np.array([1, 1, 1], np.int32)  # one decode sequence
blocks = (1, 32, 1, 16)  # (bq_sz, bkv_sz, bq_csz, bkv_csz) of the decode kernel


def call(mask_value):
    with interpreted():
        out, _ = v3.ragged_paged_attention(
            q, k, v, cache, kv_lens, page_indices, cu_q_lens, distribution, sm_scale=D ** -0.5,
            sliding_window=WINDOW, mask_value=mask_value, d_block_sizes=blocks, p_block_sizes=blocks,
            m_block_sizes=blocks, vmem_limit_bytes=32 * 1024 * 1024)
        return np.asarray(out, np.float64)[0, 0]


# Under a window of 1 the query sees its own key alone: the output is that token's value.
expected = np.asarray(v, np.float64)[0, 0]
for mask_value in (None, -1e30):
    out = call(mask_value)
    print(f"mask_value={mask_value}: NaN elements {int(np.isnan(out).sum())} of {D}; "
          f"max |out - v[32]| {np.abs(out - expected).max():.2e}")
    if mask_value is None:
        assert np.allclose(out, expected, atol=1e-2), "the reproducer's own check is wrong: the default must be right"
assert not np.isnan(out).any(), (
    f"mask_value=-1e30 (a finite mask value, -1.00026e30 in bfloat16) makes the row NaN in {int(np.isnan(out).sum())} "
    f"of {D} elements, where the default mask value gives v[32]")
print("OK: a finite mask value gives the visible key's value")
