"""Splash attention: make_splash_mha with a CausalMask whose first q shard sees no key
and q_seq_shards=2 stops at a bare `assert current_block_mask.size > 0`.

Bottom-right causal mask with q_len 256 > kv_len 128 (CausalMask(offset=-128)): queries
0..127 see no key, queries 128..255 see keys 0..q-128. With q_seq_shards=2 the first q
shard (rows 0..127) has no visible block; process_mask's grid shrinking reduces that
shard's block mask to zero columns and then asserts it is non-empty. The fixed behaviour:
the kernel is built and, sharded over 2 devices along the q sequence, returns the right
attention for every query that sees a key (rows without keys are undefined, as the
CausalMask docstring says, and are not compared).

Run:  python findings/repro_splash_q_seq_shard_without_keys.py
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

OFFSET = -128  # bottom-right aligned causal: query i sees keys j <= i - 128
mask = splash_attention_mask.MultiHeadMask(
    [splash_attention_mask.CausalMask((Q_LEN, KV_LEN), offset=OFFSET)] * H)
block_sizes = splash_attention_kernel.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)

try:
    kernel = splash_attention_kernel.make_splash_mha(
        mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=Q_SEQ_SHARDS)
except Exception as e:
    frame = traceback.extract_tb(e.__traceback__)[-1]  # where it was raised
    where = f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.line})"
    error = type(e).__name__ + (f": {e}" if str(e) else "")
    print(f"make_splash_mha raised {error} at {where}")
    raise AssertionError(f"make_splash_mha(CausalMask(offset={OFFSET}), q_seq_shards={Q_SEQ_SHARDS}) raised "
                         f"{error} at {where}") from e

# The kernel as q_seq_shards is meant to be used: q rows split over devices, k/v replicated.
mesh = Mesh(np.array(jax.devices()[:Q_SEQ_SHARDS]), ("q_seq",))
kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, "q_seq")))
sharded = jax.shard_map(lambda q, k, v, kernel: kernel(q, k, v), mesh=mesh,
                        in_specs=(P(None, "q_seq", None), P(), P(), kernel_spec),
                        out_specs=P(None, "q_seq", None), check_vma=False)
with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    out = np.asarray(sharded(q, k, v, kernel))[0].astype(np.float64)

visible = np.arange(Q_LEN)[:, None] + OFFSET >= np.arange(KV_LEN)[None, :]
has_key = visible.any(axis=1)
s = np.where(visible, q[0].astype(np.float64) @ k[0].astype(np.float64).T, -np.inf)
p = np.exp(s - np.where(has_key, s.max(axis=1), 0.0)[:, None])
ref = (p / np.where(has_key, p.sum(axis=1), 1.0)[:, None]) @ v[0].astype(np.float64)
err = np.where(np.isnan(out), np.inf, np.abs(out - ref))
err[~has_key] = 0.0  # rows without keys are undefined
i = np.unravel_index(np.argmax(err), err.shape)
print(f"worst element among rows with keys (0, {int(i[0])}, {int(i[1])}): kernel {out[i]:.9g}, "
      f"reference {ref[i]:.9g}")
assert err[i] <= 1e-4, f"wrong attention with q_seq_shards={Q_SEQ_SHARDS}: max |diff| {err[i]:.3g}"
print("OK: kernel built and matches the float64 reference")
