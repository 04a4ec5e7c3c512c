"""Ragged paged attention: a k_scale without a v_scale (or the reverse) stops the kernel at
a bare `assert k.dtype == v.dtype` when the cache's dtype is not the queries'.

The kernel converts a scaled cache operand to the query dtype (`k.astype(float32) *
k_scale`, then `.astype(q_ref.dtype)`) and leaves an unscaled one in the cache's dtype. With
float32 queries, a bfloat16 cache and only v_scale given, v becomes float32 while k stays
bfloat16, and the assertion in the kernel body fails while it is traced. Both scales are
optional keywords of their own (`k_scale: float | None = None`, `v_scale: ...`), and
static_validate_inputs accepts the call.

Here: one sequence, (q_len, kv_len) = (1, 8), float32 queries, bfloat16 pages, v_scale 2.0.

Run:  python findings/repro_rpa_one_kv_scale.py
(CPU only, Pallas TPU interpret mode; exits 1 with an AssertionError while the bug is present.)
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention, static_validate_inputs

print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, backend {jax.default_backend()}")

PAGE_SIZE, HEAD_DIM, V_SCALE = 8, 128, 2.0
rng = np.random.default_rng(0)
# kv_pages: [total_num_pages, page_size, num_combined_kv_heads (K, V interleaved), head_dim]
kv_pages = jnp.asarray(rng.standard_normal((1, PAGE_SIZE, 2, HEAD_DIM)), jnp.bfloat16)
q = rng.standard_normal((1, 1, HEAD_DIM)).astype(np.float32)  # [tokens, q_heads, head_dim]
kv_lens = np.array([PAGE_SIZE], np.int32)
page_indices = np.array([[0]], np.int32)
cu_q_lens = np.array([0, 1], np.int32)
num_seqs = np.array([1], np.int32)

static_validate_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, v_scale=V_SCALE)
print("static_validate_inputs accepted the call (v_scale given, k_scale None)")

keys = np.asarray(kv_pages[0, :, 0], np.float64)
values = np.asarray(kv_pages[0, :, 1], np.float64) * V_SCALE
s = keys @ q[0, 0].astype(np.float64)  # sm_scale 1.0; the decode token sees all 8 keys
p = np.exp(s - s.max())
ref = (p / p.sum()) @ values
try:
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        out = ragged_paged_attention(jnp.asarray(q), kv_pages, kv_lens, page_indices, cu_q_lens,
                                     num_seqs, v_scale=V_SCALE, num_kv_pages_per_block=1, num_queries_per_block=1)
except AssertionError as exc:
    raise AssertionError("ragged_paged_attention: v_scale without k_scale (float32 queries, bfloat16 cache) stops "
                         f"at a bare assert inside the kernel ({type(exc).__name__}: {exc!r})") from exc
got = np.asarray(out)[0, 0].astype(np.float64)
i = int(np.argmax(np.abs(got - ref)))
print(f"token 0, worst element (0, 0, {i}): kernel {got[i]:.9g}, reference {ref[i]:.9g}")
assert np.abs(got - ref).max() <= 1e-2, f"ragged_paged_attention with v_scale alone is off by {np.abs(got - ref).max()}"
print("OK: the output matches the float64 reference")
