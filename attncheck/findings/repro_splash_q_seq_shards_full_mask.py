"""Splash attention: make_splash_mha(FullMask, q_seq_shards=2) crashes with
"ValueError: need at least one array to concatenate".

A mask with no partial block (a FullMask: every block is fully visible) has no mask_next
array. With q_seq_shards > 1, the grid-shrinking code of process_mask pads and concatenates
the per-shard mask_next arrays unconditionally (np.concatenate of an empty list). The fixed
behaviour: the kernel is built, and sharded over 2 devices along the q sequence (as
q_seq_shards promises) it returns full attention; this script checks that against a
float64 reference.

Run:  python findings/repro_splash_q_seq_shards_full_mask.py
(CPU only, 2 simulated devices, Pallas TPU interpret mode; exits 1 with an AssertionError
while the bug is present.)
"""

import os
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import jax
import jaxlib
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, backend {jax.default_backend()}, "
      f"devices {len(jax.devices())}")

H, Q_LEN, KV_LEN, D, Q_SEQ_SHARDS = 1, 256, 128, 64, 2

rng = np.random.default_rng(0)
q = (rng.standard_normal((H, Q_LEN, D)) / np.sqrt(D)).astype(np.float32)
k = rng.standard_normal((H, KV_LEN, D)).astype(np.float32)
v = rng.standard_normal((H, KV_LEN, D)).astype(np.float32)

mask = splash_attention_mask.MultiHeadMask([splash_attention_mask.FullMask((Q_LEN, KV_LEN))] * H)
block_sizes = splash_attention_kernel.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)

try:
    kernel = splash_attention_kernel.make_splash_mha(
        mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=Q_SEQ_SHARDS)
except Exception as e:
    frame = traceback.extract_tb(e.__traceback__)[-1]  # where it was raised
    where = f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.line})"
    error = type(e).__name__ + (f": {e}" if str(e) else "")
    print(f"make_splash_mha raised {error} at {where}")
    raise AssertionError(f"make_splash_mha(FullMask, q_seq_shards={Q_SEQ_SHARDS}) raised "
                         f"{error} at {where}") from e

# The kernel as q_seq_shards is meant to be used: q rows split over devices, k/v replicated.
mesh = Mesh(np.array(jax.devices()[:Q_SEQ_SHARDS]), ("q_seq",))
kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, "q_seq")))
sharded = jax.shard_map(lambda q, k, v, kernel: kernel(q, k, v), mesh=mesh,
                        in_specs=(P(None, "q_seq", None), P(), P(), kernel_spec),
                        out_specs=P(None, "q_seq", None), check_vma=False)
with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    out = np.asarray(sharded(q, k, v, kernel))[0].astype(np.float64)

s = q[0].astype(np.float64) @ k[0].astype(np.float64).T
p = np.exp(s - s.max(axis=1, keepdims=True))
ref = (p / p.sum(axis=1, keepdims=True)) @ v[0].astype(np.float64)
err = np.where(np.isnan(out), np.inf, np.abs(out - ref))
i = np.unravel_index(np.argmax(err), err.shape)
print(f"worst element (0, {int(i[0])}, {int(i[1])}): kernel {out[i]:.9g}, reference {ref[i]:.9g}")
assert err[i] <= 1e-4, f"wrong attention with q_seq_shards={Q_SEQ_SHARDS}: max |diff| {err[i]:.3g}"
print("OK: kernel built and matches the float64 reference")
