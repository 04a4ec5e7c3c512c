"""Ragged paged attention v2 family: ``ragged_paged_attention(queries, kv_pages, kv_lens,
page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap, k_scale, v_scale,
num_kv_pages_per_block, num_queries_per_block)`` (tpu-inference's convention, forward only).

Mapped onto the ragged oracle: K/V interleaved on the combined-heads axis (K of kv head h
at 2h, V at 2h+1), bottom-right causal alignment, window ``q_pos - kv_pos < window``,
soft cap after the scale. Everything the kernel must never read holds poison: NaN in
unused pages, in page tails past kv_len and in padding query tokens; indices past the
buffer in unused page-table slots, garbage in the metadata of sequences past num_seqs. Output rows of tokens
that belong to no sequence (at or past ``cu_q_lens[num_seqs]``) are zeros, as the kernel's
docstring and the convention's reference promise.
"""
