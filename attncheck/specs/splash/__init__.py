"""Splash attention family: jax's ``splash_attention`` API. The implementation is a kernel
factory ``fn(mask, *, block_sizes, attn_logits_soft_cap, head_shards, q_seq_shards)``
(``make_splash_mha``) returning ``kernel(q, k, v, segment_ids=None)``; its module supplies
``make_splash_mqa``, ``SegmentIds``, ``BlockSizes`` and the mask classes (``mask_lib``:
``CausalMask``, ``LocalMask``, ``ChunkedCausalMask``, ``FullMask``, ``NumpyMask``,
``MultiHeadMask``, ``&``/``|``), so a copy of the kernel module is verified with its own
types. q [H, Q, D], k/v [Hkv, K, D|Dv] ([K, D|Dv] for MQA); no batch axis, no scale.

Mapped onto the oracle:
- logits = q.k (the scale is folded into q, as a caller of splash does);
- soft cap ``cap * tanh(logits / cap)`` before masking;
- key j visible to query i of head h iff the head's mask holds at (i, j) and the segment
  ids are equal; the mask is given to the oracle as data (``visible``), evaluated here in
  NumPy from the case's description (never by the mask classes under test);
- GQA: query head h reads kv head h // (H / Hkv); MQA: one kv head without a head axis;
- fully masked rows (no visible key, from the mask or the segments) are undefined in
  splash: the mean of v over the kv blocks the row's q block visits, or NaN when it visits
  none, so the result depends on the block structure. Their outputs are don't-care and
  their cotangent is zero (a caller masks such rows out of the loss); dq of such a row
  must then be 0, and nothing may leak into other rows or into dk/dv.
"""
