"""Paged attention computes float32 K/V pages in bfloat16.

MultiPageAsyncCopyDescriptor.wait_and_get_loaded() passes every loaded page through
_maybe_dequantize(x, None), whose default dtype is jnp.bfloat16: unquantized pages are cast
with x.astype(jnp.bfloat16) whatever their dtype. With float32 q and float32 pages the
result is therefore only bfloat16-accurate (~1e-3 relative), three orders of magnitude
worse than a float32 computation (~1e-7). Nothing in the docstring says so. The fixed
behaviour: float32 pages are used in float32, with an error near float32 rounding; this
script asserts a relative error below 1e-5.

Run:  python findings/repro_paged_float_pages_bfloat16.py
(CPU only, Pallas TPU interpret mode; exits 1 with an AssertionError while the bug is present.)
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, backend {jax.default_backend()}")

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, PAGES_PER_SEQ = 1, 8, 1, 128, 16, 2
rng = np.random.default_rng(0)
q = (rng.standard_normal((BATCH, Q_HEADS, HEAD_DIM)) / np.sqrt(HEAD_DIM)).astype(np.float32)
k_pages = rng.standard_normal((KV_HEADS, BATCH * PAGES_PER_SEQ, PAGE_SIZE, HEAD_DIM)).astype(np.float32)
v_pages = rng.standard_normal((KV_HEADS, BATCH * PAGES_PER_SEQ, PAGE_SIZE, HEAD_DIM)).astype(np.float32)
page_indices = np.arange(BATCH * PAGES_PER_SEQ, dtype=np.int32).reshape(BATCH, PAGES_PER_SEQ)
lengths = np.array([PAGE_SIZE * PAGES_PER_SEQ], np.int32)

with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    out = paged_attention(q, k_pages, v_pages, lengths, page_indices, pages_per_compute_block=1)
print(f"output dtype {out.dtype}")
got = np.asarray(out)[0].astype(np.float64)

keys = k_pages[0, page_indices[0]].reshape(-1, HEAD_DIM)
values = v_pages[0, page_indices[0]].reshape(-1, HEAD_DIM)


def attention64(keys, values):
    s = q[0].astype(np.float64) @ keys.astype(np.float64).T
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ values.astype(np.float64)


ref = attention64(keys, values)
scale = np.abs(ref).max()
# Yardsticks: the same attention in plain float32 jax.numpy, and in float64 from bfloat16-rounded K/V.
f32 = np.asarray(jax.nn.softmax(jnp.asarray(q[0]) @ jnp.asarray(keys).T, axis=-1) @ jnp.asarray(values))


def bf16(x):
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


ref_bf16_kv = attention64(bf16(keys), bf16(values))

err = np.abs(got - ref)
i = np.unravel_index(np.argmax(err), err.shape)
print(f"worst element (0, {int(i[0])}, {int(i[1])}): kernel {got[i]:.9g}, float64 reference {ref[i]:.9g}")
print(f"relative max error vs float64 reference: kernel {err[i] / scale:.3g}, "
      f"float32 jax.numpy {np.abs(f32 - ref).max() / scale:.3g}")
print(f"kernel vs float64 attention over bfloat16-rounded K/V: max |diff| {np.abs(got - ref_bf16_kv).max():.3g}")
assert err[i] / scale <= 1e-5, (
    f"paged_attention with float32 q and pages is only bfloat16-accurate: relative error {err[i] / scale:.3g} "
    f"(a float32 computation gets {np.abs(f32 - ref).max() / scale:.3g})")
print("OK: float32 pages computed in float32")
