"""Flash attention family: ``flash_attention(q, k, v, ab=None, segment_ids=None, *, causal,
sm_scale, block_sizes)`` on [B, H, S, D] (the convention of jax's bundled TPU kernel).

Mapped onto the oracle (the kernel's module docstring states each of these exactly):
- logits = (q.k + ab) * sm_scale  ->  oracle bias = ab * sm_scale, d_ab = d_bias * sm_scale;
- causal is top-left: key j visible to query i iff j <= i (positions 0..Q-1, 0..K-1); a
  causally hidden key takes no part, so causal block skipping changes nothing;
- segment ids: a key of another segment has its logit *replaced* by the mask value. A row
  that sees no key of its own segment (its segment is absent from kv, or every such key
  has a -inf bias) averages v uniformly over the causally visible keys of other segments,
  and its gradient is the softmax gradient at those uniform weights, through the logits
  (the oracle's ``fallback``), in every masking mode, causal included;
- a -inf entry of ab takes no part; a row whose visible keys all have -inf (and no other
  segment to fall back on) is 0 with zero gradient; NaN or +inf in ab at a key the mask
  hides (causally, or by segment) changes nothing.
"""
