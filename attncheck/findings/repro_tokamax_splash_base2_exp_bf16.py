"""tokamax's splash: the base-2 exponent path (SplashConfig.use_base2_exp, on by default)
multiplies q by log2(e) in q's own dtype, so with bfloat16 inputs and large logits its
output is about ten times further from the exact attention than the natural-exp path's.

One head, 256 queries x 256 keys, head dim 128, FullMask, bfloat16 q, k, v whose logits
have a standard deviation of about 20. Both configurations compute in float32 after the
q.k dot; the base-2 one first rounds q * LOG2E to bfloat16 (splash_attention_kernel.py
722-726, and in the dq and dkv kernels 1800-1804, 1979-1985), a relative error of up to
2**-9 in every logit, which a large logit carries into the probabilities. Expected: the
base-2 path as close to the exact attention as the natural one (scale q by log2(e) in
float32, or fold it into the logits after the dot).

Run:  python findings/repro_tokamax_splash_base2_exp_bf16.py
(CPU only, Pallas TPU interpret mode; needs tokamax 0.0.17; exits 1 with an AssertionError
while the deviation is present.)
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel as splash
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask as mask_lib

print(f"jax {jax.__version__}, tokamax {importlib.metadata.version('tokamax')}, backend {jax.default_backend()}")

H, L, D, BLOCK = 1, 256, 128, 128
rng = np.random.default_rng(0)
scale = (20 / np.sqrt(D)) ** 0.5  # logits q.k of standard deviation about 20
q, k, v = (jnp.asarray(rng.standard_normal((H, L, D)) * s, jnp.bfloat16) for s in (scale, scale, 1.0))
q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
logits = q64 @ k64.swapaxes(-1, -2)
p = np.exp(logits - logits.max(-1, keepdims=True))
exact = (p / p.sum(-1, keepdims=True)) @ v64

blocks = dict(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK, block_q_dkv=BLOCK, block_kv_dkv=BLOCK,
              block_kv_dkv_compute=BLOCK)
errors = {}
for base2 in (False, True):
    kernel = splash.make_splash_mha(mask_lib.FullMask((L, L)),
                                    config=splash.SplashConfig(**blocks, use_base2_exp=base2), q_seq_shards=1)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        out = np.asarray(kernel(q, k, v), np.float64)
    errors[base2] = np.abs(out - exact)
    i = np.unravel_index(errors[base2].argmax(), out.shape)
    print(f"use_base2_exp={base2}: max abs error {errors[base2].max():.4f} at {tuple(int(n) for n in i)} "
          f"(kernel {out[i]:.4f}, exact {exact[i]:.4f})")
assert errors[True].max() <= 2 * errors[False].max(), (
    f"the base-2 path's output is {errors[True].max() / errors[False].max():.1f} times further from the exact "
    "attention than the natural-exp path's: q * log2(e) is rounded to bfloat16")
print("OK: the base-2 path is as close to the exact attention as the natural one")
