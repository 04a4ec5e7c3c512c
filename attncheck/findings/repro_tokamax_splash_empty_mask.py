"""tokamax's splash: a mask that hides every key builds a kernel whose call stops at an
IndexError from inside jax's scatter, naming no argument.

CausalMask(offset=-128) & LocalMask(window (32, 0)) on 256 queries x 128 keys: query i
sees keys j <= i - 128 and i - 32 <= j <= i, which no key satisfies. make_splash_mha
accepts the mask; the call's find_bounds (splash_attention_mask_info.py 42-45) sets
element 0 of the empty active_rows. jax's splash stops at a bare assert in make_splash_mha
for the same mask. Expected: a ValueError that says the mask hides every key (or an
output of the fully masked rows' convention).

Run:  python findings/repro_tokamax_splash_empty_mask.py
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

Q_LEN, KV_LEN, D, BLOCK = 256, 128, 128, 128
shape = (Q_LEN, KV_LEN)
mask = mask_lib.CausalMask(shape, offset=-128) & mask_lib.LocalMask(shape, window_size=(32, 0), offset=0)
visible = (np.arange(Q_LEN)[:, None] - 128 >= np.arange(KV_LEN)) & (
    np.abs(np.arange(Q_LEN)[:, None] - np.arange(KV_LEN) - 16) <= 16)
print(f"keys visible to any query: {int(visible.sum())}")
blocks = dict(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK, block_q_dkv=BLOCK, block_kv_dkv=BLOCK,
              block_kv_dkv_compute=BLOCK)
kernel = splash.make_splash_mha(mask, config=splash.SplashConfig(**blocks), q_seq_shards=1)
x = np.zeros((1, Q_LEN, D), np.float32)
y = np.zeros((1, KV_LEN, D), np.float32)
try:
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        np.asarray(kernel(x, y, y))
    raised = None
except Exception as exc:  # noqa: BLE001 - which exception it is, is the finding
    raised = exc
print(f"call: {type(raised).__name__ if raised else 'returned'}: {raised}")
assert raised is None or (isinstance(raised, ValueError) and "mask" in str(raised).lower()), (
    f"a mask hiding every key stops the call at {type(raised).__name__}: {raised} (from inside find_bounds), "
    "not a ValueError about the mask")
print("OK: the call returns, or refuses the mask in its own words")
