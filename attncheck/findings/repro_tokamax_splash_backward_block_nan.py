"""tokamax's splash: dk/dv come out NaN when a forward q block that sees no key lies
inside a larger backward (dkv) q block, as in jax's splash (attncheck finding
splash_backward_block_nan), whose kernel tokamax's rewrite keeps here.

Bottom-right causal mask with q_len 256 > kv_len 128 (CausalMask(offset=-128)): queries
0..127 see no key, queries 128..255 see keys 0..q-128. With block_q=128 the forward q
block 0 visits no kv block and writes out = 0 * (1/0) = NaN and logsumexp = -inf for those
rows. The dkv pass with block_q_dkv=256 processes rows 0..255 together; for rows 0..127
exp(qk - logsumexp) = exp(mask_value + inf) = inf and di = rowsum(dO * O) = NaN, so dk and
dv of every key (all of which ARE visible to queries 128..255) are NaN, even though the
cotangent of the key-less rows is zero.

Run:  python findings/repro_tokamax_splash_backward_block_nan.py
(CPU only, Pallas TPU interpret mode; needs tokamax 0.0.17; exits 1 with an AssertionError while the bug is present.)
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.metadata

import jax
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_kernel
from tokamax._src.ops.experimental.tpu.splash_attention import splash_attention_mask

print(f"jax {jax.__version__}, tokamax {importlib.metadata.version('tokamax')}, backend {jax.default_backend()}")

H, Q_LEN, KV_LEN, D = 1, 256, 128, 64
OFFSET = -128  # bottom-right aligned causal: query i sees keys j <= i - 128

rng = np.random.default_rng(0)
q = (rng.standard_normal((H, Q_LEN, D)) / np.sqrt(D)).astype(np.float32)  # splash has no scale argument
k = rng.standard_normal((H, KV_LEN, D)).astype(np.float32)
v = rng.standard_normal((H, KV_LEN, D)).astype(np.float32)
visible = np.arange(Q_LEN)[:, None] + OFFSET >= np.arange(KV_LEN)[None, :]  # [Q, K]
has_key = visible.any(axis=1)  # rows 0..127: False
d_out = rng.standard_normal((H, Q_LEN, D)).astype(np.float32)
d_out[:, ~has_key] = 0.0  # rows without keys are undefined: give them a zero cotangent

mask = splash_attention_mask.CausalMask((Q_LEN, KV_LEN), offset=OFFSET)
config = splash_attention_kernel.SplashConfig(
    block_q=128, block_kv=128, block_kv_compute=128,
    block_q_dkv=256, block_kv_dkv=128, block_kv_dkv_compute=128)  # dkv q block 256 > forward q block 128
kernel = splash_attention_kernel.make_splash_mha(mask, config=config, q_seq_shards=1)

with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
    out, vjp = jax.vjp(kernel, q, k, v)
    dq, dk, dv = vjp(d_out)

# float64 reference (rows without keys: output undefined, not compared; zero cotangent).
q64, k64, v64, do64 = (x[0].astype(np.float64) for x in (q, k, v, d_out))
s = np.where(visible, q64 @ k64.T, -np.inf)
m = np.where(has_key, s.max(axis=1), 0.0)
p = np.where(visible, np.exp(s - m[:, None]), 0.0)
p /= np.where(has_key, p.sum(axis=1), 1.0)[:, None]
out_ref = p @ v64
dp = do64 @ v64.T
ds = p * (dp - (do64 * out_ref).sum(axis=1, keepdims=True))
ref = {"out": out_ref, "dq": ds @ k64, "dk": ds.T @ q64, "dv": p.T @ do64}
got = {"out": np.asarray(out)[0], "dq": np.asarray(dq)[0], "dk": np.asarray(dk)[0], "dv": np.asarray(dv)[0]}
rows = {"out": has_key}  # compare the forward only where it is defined


def worst(name):
    g, r = got[name].astype(np.float64), ref[name]
    if name in rows:
        g, r = g[rows[name]], r[rows[name]]
        offset = int(np.flatnonzero(rows[name])[0])
    else:
        offset = 0
    err = np.abs(g - r)
    err = np.where(np.isnan(err), np.inf, err)
    i = np.unravel_index(np.argmax(err), err.shape)
    where = (int(i[0]) + offset,) + tuple(int(x) for x in i[1:])
    print(f"{name}: worst element {where}: kernel {g[i]:.9g}, reference {r[i]:.9g}; "
          f"NaN elements {int(np.isnan(g).sum())} of {g.size}")
    return err[i] <= 1e-4 * max(1.0, np.abs(r).max())


ok = {name: worst(name) for name in ("out", "dq", "dk", "dv")}
bad = [name for name, good in ok.items() if not good]
assert not bad, (f"tokamax splash attention gradients wrong for {bad}: a key-less forward q block inside a larger "
                 f"dkv q block makes dk/dv NaN (see worst elements above)")
print("OK: gradients match the float64 reference")
