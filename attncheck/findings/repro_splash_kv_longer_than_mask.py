"""Splash attention: a kernel built for a mask of 256 keys, called with 512 keys, silently
attends to the first 256 keys only (no error).

make_splash_mha(MultiHeadMask([FullMask((256, 256))] * H)) is called with q [H, 256, D]
and k, v [H, 512, D]. _splash_attention_forward checks k against q and v (head dim, heads,
k/v leading dims) but never against the mask: the kv grid width comes from the mask info
(data_next.shape[-1] == 256 // block_kv), so keys 256..511 are never read. The fixed
behaviour is an error naming the mask / key-length mismatch; this script asserts that one
is raised.

Run:  python findings/repro_splash_kv_longer_than_mask.py
(CPU only, Pallas TPU interpret mode; exits 1 with an AssertionError while the bug is present.)
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jaxlib
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask

print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, backend {jax.default_backend()}")

H, Q_LEN, MASK_KV_LEN, KV_LEN, D = 1, 256, 256, 512, 128

rng = np.random.default_rng(0)
q = (rng.standard_normal((H, Q_LEN, D)) / np.sqrt(D)).astype(np.float32)
k = rng.standard_normal((H, KV_LEN, D)).astype(np.float32)
v = rng.standard_normal((H, KV_LEN, D)).astype(np.float32)

mask = splash_attention_mask.MultiHeadMask([splash_attention_mask.FullMask((Q_LEN, MASK_KV_LEN))] * H)
block_sizes = splash_attention_kernel.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)
kernel = splash_attention_kernel.make_splash_mha(mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=1)

error = None
try:
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        out = np.asarray(kernel(q, k, v))
except Exception as e:  # the fixed kernel raises here
    error = e
    print(f"raised {type(e).__name__}: {e}")

if error is None:
    def attention(n_keys):  # float64 softmax attention over the first n_keys keys
        s = q[0].astype(np.float64) @ k[0, :n_keys].astype(np.float64).T
        p = np.exp(s - s.max(axis=1, keepdims=True))
        return (p / p.sum(axis=1, keepdims=True)) @ v[0, :n_keys].astype(np.float64)

    got = out[0].astype(np.float64)
    for label, ref in (("all 512 keys", attention(KV_LEN)),
                       ("the first 256 keys only (the mask's kv length)", attention(MASK_KV_LEN))):
        err = np.abs(got - ref)
        i = np.unravel_index(np.argmax(err), err.shape)
        print(f"vs attention over {label}: worst element (0, {int(i[0])}, {int(i[1])}): "
              f"kernel {got[i]:.9g}, reference {ref[i]:.9g} (max |diff| {err[i]:.3g})")

assert error is not None, (
    f"splash kernel built for a mask of {MASK_KV_LEN} keys accepted k/v with {KV_LEN} keys and silently "
    f"attended to the first {MASK_KV_LEN} only; expected an error naming the mask/key-length mismatch")
print("OK: the mismatch was rejected")
