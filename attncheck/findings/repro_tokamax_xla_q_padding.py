"""tokamax's dot_product_attention (implementation="xla") gives padded query rows the mean of v.

tokamax documents its dot_product_attention as jax.nn.dot_product_attention's API, extended.
jax.nn gives the rows past query_seq_lengths 0 (padding). tokamax turns query_seq_lengths
into mask.q_end (api.py 140-149), which masks those rows' logits like any hidden key
(base.py 235-236); a fully masked row then softmaxes over equal logits and returns the
uniform mean of v. The fixed behaviour: rows past query_seq_lengths are 0, as in jax.nn;
this script asserts they are.

Run:  python findings/repro_tokamax_xla_q_padding.py
(CPU only; needs tokamax 0.0.17; exits 1 with an AssertionError while the bug is present.)
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import tokamax

print(f"jax {jax.__version__}, tokamax {importlib.metadata.version('tokamax')}, backend {jax.default_backend()}")

BATCH, T, S, HEADS, HEAD_DIM = 1, 4, 6, 1, 8
Q_LEN = 2  # rows 2 and 3 are padding
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((BATCH, n, HEADS, HEAD_DIM)).astype(np.float32) for n in (T, S, S))
query_seq_lengths = np.array([Q_LEN], np.int32)

out = np.asarray(tokamax.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                               query_seq_lengths=jnp.asarray(query_seq_lengths),
                                               implementation="xla")).astype(np.float64)
jax_nn = np.asarray(jax.nn.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                 query_seq_lengths=jnp.asarray(query_seq_lengths)))

# float64 reference: softmax attention for the valid rows, 0 for the padded ones.
s = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(HEAD_DIM)
p = np.exp(s - s.max(-1, keepdims=True))
ref = np.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v.astype(np.float64))
ref[:, Q_LEN:] = 0.0

valid = np.abs(out[:, :Q_LEN] - ref[:, :Q_LEN]).max()
padded = np.abs(out[:, Q_LEN:]).max()
print(f"valid rows: max |tokamax - float64| {valid:.3g}")
print(f"padded row {Q_LEN}, first 3 of head 0: tokamax {out[0, Q_LEN, 0, :3]}, jax.nn {jax_nn[0, Q_LEN, 0, :3]}, "
      f"float64 reference {ref[0, Q_LEN, 0, :3]}")
print(f"mean of v over every key, first 3: {v[0, :, 0, :3].astype(np.float64).mean(0)}")
assert valid <= 1e-5, f"the valid rows are wrong too: {valid:.3g}"
assert padded == 0.0, (f"rows past query_seq_lengths are not 0 (max |out| {padded:.3g}): tokamax gives them the "
                       "mean of v where jax.nn.dot_product_attention gives 0")
print("OK: padded query rows are 0, as in jax.nn")
