"""tokamax's splash: a kernel built for a mask of K keys takes a call with more keys without
an error, and computes something the mask never said.

make_splash_mha(FullMask((256, 256))) called with k, v of 512 keys: the forward checks k
against q and v (splash_attention_kernel.py 1183-1236), never against the shape of the
mask the kernel was built for. Here it attends to all 512 keys, as if the mask went on;
jax's splash, given the same call, attends to the first 256 only (attncheck finding
splash_kv_longer_than_mask). Either is a guess at a mask nobody gave: the call should be
refused, naming the mask's shape and the keys'.

Run:  python findings/repro_tokamax_splash_kv_longer_than_mask.py
(CPU only, Pallas TPU interpret mode; needs tokamax 0.0.17; exits 1 with an AssertionError
while the bug is present.)
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.metadata

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask_lib

print(f"jax {jax.__version__}, tokamax {importlib.metadata.version('tokamax')}, backend {jax.default_backend()}")

HEADS, SEQ, D, BLOCK = 1, 256, 128, 128
rng = np.random.default_rng(0)
q = (rng.standard_normal((HEADS, SEQ, D)) / np.sqrt(D)).astype(np.float32)
k, v = (rng.standard_normal((HEADS, 2 * SEQ, D)).astype(np.float32) for _ in range(2))  # twice the mask's keys
blocks = dict(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK, block_q_dkv=BLOCK, block_kv_dkv=BLOCK,
              block_kv_dkv_compute=BLOCK)
kernel = splash.make_splash_mha(mask_lib.FullMask((SEQ, SEQ)), config=splash.SplashConfig(**blocks),
                                q_seq_shards=1)
try:
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        out = np.asarray(kernel(q, k, v))[0].astype(np.float64)
except ValueError as exc:
    print(f"refused: {exc}")
    out = None
if out is not None:
    def attend(keys):
        s = q[0].astype(np.float64) @ k[0, :keys].astype(np.float64).T
        p = np.exp(s - s.max(axis=1, keepdims=True))
        return (p / p.sum(axis=1, keepdims=True)) @ v[0, :keys].astype(np.float64)
    print(f"max |kernel - attention over all {2 * SEQ} keys| {np.abs(out - attend(2 * SEQ)).max():.3g}; "
          f"over the first {SEQ} keys {np.abs(out - attend(SEQ)).max():.3g}")
assert out is None, f"a kernel built for a {SEQ} x {SEQ} mask took {2 * SEQ} keys without an error"
print("OK: keys beyond the mask are refused")
