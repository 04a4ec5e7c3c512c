"""Paged attention family (decode): ``paged_attention(q, k_pages, v_pages, lengths,
page_indices, *, attn_logits_soft_cap, pages_per_compute_block, megacore_mode,
inline_seq_dim)``, the convention of jax's bundled TPU kernel, forward only.

q [B, Hq, D] (one query token per sequence); k/v pages [Hkv, total_pages, page_size, D],
or int8 ``QuantizedTensor(weight, scales)`` of jax's ``quantization_utils`` (scales
[Hkv, total_pages, page_size, 1], the value is weight * scale / 127.5); lengths int32 [B];
page_indices int32 [B, pages_per_sequence]: token t of sequence b is slot t % page_size of
page page_indices[b, t // page_size].

Mapped onto the dense oracle: the keys t < lengths[b] gathered through the page table
([B, Hkv, L, D], visible = t < length), logits = q.k (no scale), soft cap cap * tanh(x / cap),
query head h reads kv head h // (Hq / Hkv); a length-0 sequence outputs 0.

The contract the oracle is told, beyond that:
- float pages are computed with as bfloat16 (the kernel loads every page as bfloat16 whatever
  its dtype): the oracle and the yardstick get float32 pages rounded to bfloat16;
- the mask is additive (q.k + mask value): page slots past a length inside the last compute
  block the sequence reads must hold finite values (they hold large finite garbage here);
  every page no read block touches holds NaN (NaN scales for int8 pages), spare pages too;
- a length-0 sequence outputs 0. With ``inline_seq_dim=False`` jax's kernel never writes
  that row (NaN or stale values): a finding, shipped as the declared deviation of the
  ``zero_length_not_inline`` class, whose rows are judged apart (``attncheck.expectations``);
- megacore modes run on two simulated cores per device (on one, the kernel hangs).
"""
