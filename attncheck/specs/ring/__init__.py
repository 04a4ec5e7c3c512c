"""Ring attention families, verified over 1, 2, 4 and 8 devices against the *global* oracle.

Conventions (kernels/ring_attention.py): [B, S, H, D] sharded contiguously on S over a 1-D
mesh; logits = (q.k) * sm_scale + bias (bias after the scale); causal over global
positions (top-left); segment ids (q, kv) equal attend, and they may cross device
boundaries; bias [B|1, H|1, S|1, S] sharded on queries, replicated on keys; a query that
sees no key (its segment absent from kv) outputs 0 with no gradient ("zero").

- ``ring_attention``: blockwise pure JAX (chunks inside each device), backend xla;
- ``ring_attention_standard``: one boolean-masked block per step (the mask carries causal
  and segments), backend xla;
- ``ring_flash_attention``: the Pallas flash kernels per step, Pallas backends.
"""
