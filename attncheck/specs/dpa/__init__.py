"""dot_product_attention family: the convention of ``jax.nn.dot_product_attention(query, key,
value, bias=None, mask=None, *, scale, is_causal, query_seq_lengths, key_value_seq_lengths,
local_window_size)`` on [B, T, N, H] / [B, S, K, H], outputs and gradients.

Two default implementations of the convention: jax.nn's own (XLA, backend ``xla``) and this
project's flash kernel behind a thin adapter (``kernels/dot_product_attention.py``, the
Pallas backends). Any other kernel with this signature (tokamax's ``dot_product_attention``)
is verified with ``--attncheck-impl dot_product_attention=pkg.mod:fn``, on every backend.

Mapped onto the dense oracle (head-major, [B, N, T, H]):
- logits = scale * q.k + bias (scale defaults to 1 / sqrt(H)); query head n reads kv head
  n // (N / K); bias [B|1, N|1, T, S] and its gradient summed back to its shape;
- visible = mask AND causal (top-left: key j <= query i, whatever T and S) AND window
  (i - left <= j <= i + right) AND j < kv length AND i < query length, as an explicit mask;
- a row that sees no key outputs the mean of v over all S keys, with the gradient of that
  mean ("mean_of_v"): what jax.nn's large finite mask value gives;
- rows past a query length output 0 and take no gradient (their cotangent is zeroed).
"""
