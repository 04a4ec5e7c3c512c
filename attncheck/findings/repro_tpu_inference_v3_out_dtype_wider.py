"""tpu-inference's ragged paged attention v3: out_dtype=float32 with bfloat16 queries (the
docstring's "the dtype of the output and the accumulator for matmul") stops the call while
the kernel is traced, at a reshape error from inside the kernel, naming no argument.

The kernel's output aliases its queries' buffer (input_output_aliases 7: 0), so the output
block `bo_x2_ref` has the queries' dtype. The final store (kernel.py 1083-1089) bitcasts
the float32 tile into that bfloat16 block's int32 view, which holds half as many rows:
`cannot reshape array of shape (1, 16, 128) (size 2048) into shape (8, 128) (size 1024)`.
static_validate_inputs deletes out_dtype unchecked (kernel.py 1490). Expected: a float32
output, or a ValueError that names out_dtype.

Run:  python findings/repro_tpu_inference_v3_out_dtype_wider.py
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

PAGE, PAGES, D, NEW = 16, 2, 128, 8
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((NEW, 1, D)), jnp.bfloat16) for _ in range(3))
cache = jnp.zeros(v3.get_kv_cache_shape(PAGES, PAGE, 1, D, jnp.bfloat16), jnp.bfloat16)
kv_lens = np.array([NEW], np.int32)
page_indices = np.arange(PAGES, dtype=np.int32)
cu_q_lens = np.array([0, NEW], np.int32)
distribution = np.array([0, 0, 1], np.int32)  # one mixed (prefill) sequence
blocks = (NEW, PAGE, NEW, PAGE)  # (bq_sz, bkv_sz, bq_csz, bkv_csz), for every case

try:
    with interpreted():
        out, _ = v3.ragged_paged_attention(
            q, k, v, cache, kv_lens, page_indices, cu_q_lens, distribution, out_dtype=jnp.float32,
            d_block_sizes=blocks, p_block_sizes=blocks, m_block_sizes=blocks, vmem_limit_bytes=32 * 1024 * 1024)
        out = np.asarray(out)
    raised = None
except Exception as exc:  # noqa: BLE001 - which exception it is, is the finding
    raised = exc
print(f"call: {type(raised).__name__ + ': ' + str(raised).splitlines()[0] if raised else 'returned'}")
assert raised is None or (isinstance(raised, ValueError) and "out_dtype" in str(raised)), (
    f"out_dtype=float32 with bfloat16 queries stops the call at {type(raised).__name__}: "
    f"{str(raised).splitlines()[0]} (from inside the kernel's output store), not a ValueError naming out_dtype")
if raised is None:
    f64 = [np.asarray(x, np.float64)[:, 0] for x in (q, k, v)]
    logits = np.where(np.tril(np.ones((NEW, NEW), bool)), f64[0] @ f64[1].T, -np.inf)
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    error = np.abs(out[:, 0] - (weights / weights.sum(axis=1, keepdims=True)) @ f64[2]).max()
    print(f"output dtype {out.dtype}, max |error| vs float64 {error:.2e}")
    assert out.dtype == np.float32 and error < 1e-2, "out_dtype=float32 returned, but not float32 attention"
print("OK: out_dtype=float32 gives a float32 output, or is refused by name")
