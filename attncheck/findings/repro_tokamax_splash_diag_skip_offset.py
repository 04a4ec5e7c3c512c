"""tokamax's splash with qk_diag_skip (or sv_diag_skip) and a CausalMask whose offset is
not a whole number of blocks: visible sub-tiles are skipped, the output is silently wrong.

SplashConfig's comment promises the skip "does not silently corrupt": any other config
raises. _make_splash_attention checks only that the mask is a CausalMask
(splash_attention_kernel.py 2894-2903), not its offset. On every partial block the kernel
then fills the sub-tiles with kv band > q band with mask_value (lines 739-770), which is
right only where the diagonal runs through the block's corner: offset 0, or a multiple of
the block. With offset -16 the partial blocks below the diagonal lose visible keys.

Run:  python findings/repro_tokamax_splash_diag_skip_offset.py
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
OFFSET = -16  # query i sees keys j <= i - 16: not a whole number of blocks
rng = np.random.default_rng(0)
q = (rng.standard_normal((HEADS, SEQ, D)) / np.sqrt(D)).astype(np.float32)  # splash has no scale argument
k, v = (rng.standard_normal((HEADS, SEQ, D)).astype(np.float32) for _ in range(2))

visible = np.arange(SEQ)[:, None] + OFFSET >= np.arange(SEQ)[None, :]
has_key = visible.any(axis=1)  # rows 0..15 see no key: undefined, not compared
s = np.where(visible, q[0].astype(np.float64) @ k[0].astype(np.float64).T, -np.inf)
p = np.exp(s - np.where(has_key, s.max(axis=1), 0.0)[:, None])
ref = (p / np.where(has_key, p.sum(axis=1), 1.0)[:, None]) @ v[0].astype(np.float64)

square = dict(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK, block_q_dkv=BLOCK, block_kv_dkv=BLOCK,
              block_kv_dkv_compute=BLOCK)
errors = {}
for skip in (False, True):
    kernel = splash.make_splash_mha(mask_lib.CausalMask((SEQ, SEQ), offset=OFFSET),
                                    config=splash.SplashConfig(**square, qk_diag_skip=skip), q_seq_shards=1)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        out = np.asarray(kernel(q, k, v))[0].astype(np.float64)
    err = np.where(has_key[:, None], np.abs(out - ref), 0.0)
    row, col = np.unravel_index(np.argmax(err), err.shape)
    errors[skip] = err.max()
    print(f"qk_diag_skip={skip}: max |kernel - float64| {err.max():.3g} at row {row}, dim {col} "
          f"(kernel {out[row, col]:.6g}, reference {ref[row, col]:.6g})")

assert errors[False] <= 1e-5, f"the kernel is wrong without the skip too: {errors[False]:.3g}"
assert errors[True] <= 1e-5, (f"qk_diag_skip with CausalMask(offset={OFFSET}) changes the output by "
                              f"{errors[True]:.3g}: it skips visible sub-tiles of the blocks below the diagonal")
print("OK: the diagonal skip is exact, or refused, for this offset")
