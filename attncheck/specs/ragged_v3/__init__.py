"""Ragged paged attention v3 family: tpu-inference's ``ragged_paged_attention(queries, keys,
values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *, sm_scale,
sliding_window, soft_cap, q_scale, k_scale, v_scale, chunk_prefill_size, d_block_sizes,
p_block_sizes, m_block_sizes) -> (out, kv_cache)`` (``v3/kernel.py``), forward only.

Its own convention, not v2's: the new tokens' K/V come as arrays and are written into the
cache by the kernel, the cache has the packed layout of ``get_kv_cache_shape`` (combined
K/V heads grouped in 32-bit words, head_dim padded to 128), the page table is flat, and
``distribution`` splits the sequences into decode, chunked prefill and mixed, each run as
its own kernel. Both results are judged: ``out`` against the float64 oracle, the updated
``kv_cache`` exactly (``exact_directions``): the new tokens' slots hold their K/V, nothing
else changes. Everything the kernel must not read holds NaN: unused pages, page tails past
kv_len, the slots the new tokens are written to (read before written: NaN), and the
padding tokens' queries, keys and values (written into the cache: NaN where none belongs).

The repository ships no v3 kernel: the family runs with ``--attncheck-impl
ragged_paged_attention_v3=<module:function>``, e.g. the wheel's kernel through
``attncheck.third_party.tpu_inference:ragged_paged_attention_v3`` (docs/DESIGN.md says why).
"""
