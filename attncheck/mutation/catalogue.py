"""The mutant catalogue: known kernel bugs the gate must catch (see attncheck.mutation.campaign).

Each entry plants one realistic bug in one kernel (``find`` occurs exactly once in
``file``; the runner refuses it otherwise). ``bug_class`` names the kind of bug (the
classes of issue 9); ``equivalent`` says why a mutant cannot be observed, when it cannot;
``sample`` marks the few fast-to-kill mutants the PR gate's self-test runs.
"""

from __future__ import annotations

from attncheck.mutation.mutant import Mutant

FLASH = "kernels/flash_attention.py"
RAGGED = "kernels/ragged_paged_attention.py"
FFN = "kernels/blockwise_ffn.py"
RING = "kernels/ring_attention.py"



def narrowed_sum(id: str, family: str, file: str, line: str, *, narrow: str, wide: str, description: str) -> Mutant:
    """A running sum rounded to a narrower dtype at each update: the statement ``line``
    (``target = expression``) becomes ``target = (expression).astype(narrow).astype(wide)``."""
    target, _, expression = line.rstrip("\n").partition(" = ")
    return Mutant(id, family, file, find=line, replace=f"{target} = ({expression}).astype({narrow}).astype({wide})\n",
                  description=description, bug_class="narrow_accumulator")


# ---------------------------------------------------------------- flash attention
# Masking and causal alignment (shared _masked_logits: forward and both backward kernels).
FLASH_MASKING = [
    Mutant("fa-causal-strict-lt", "flash_attention", FLASH,
           find="        visible = cols <= rows\n",
           replace="        visible = cols < rows\n",
           description="causal mask `<` instead of `<=`: a query no longer sees its own key",
           bug_class="mask_off_by_one"),
    Mutant("fa-causal-bottom-right", "flash_attention", FLASH,
           find="    o, l, m = _fwd_call(q, k, v, ab, segment_ids, None, _ZERO_OFFSET, _ZERO_OFFSET,\n",
           replace="    o, l, m = _fwd_call(q, k, v, ab, segment_ids, None,\n"
                   "                        jnp.full((1,), k.shape[2] - q.shape[2], jnp.int32), _ZERO_OFFSET,\n",
           description="forward aligns causal bottom-right (q offset kv_len - q_len), backward top-left",
           bug_class="causal_alignment_shift"),
    Mutant("fa-causal-rows-shifted", "flash_attention", FLASH,
           find="        rows = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)\n",
           replace="        rows = q_start + 1 + lax.broadcasted_iota(jnp.int32, s.shape, 0)\n",
           description="causal diagonal shifted by one token: each query also sees the next key",
           bug_class="causal_alignment_shift"),
    Mutant("fa-neg-inf-ab-scaled", "flash_attention", FLASH,
           find="        s = jnp.where(ab == -jnp.inf, -jnp.inf, s)\n",
           replace="        s = jnp.where(ab == -jnp.inf, s, s)\n",
           description="a -inf ab entry scaled like any logit: a negative scale makes it the largest, 0 a NaN",
           bug_class="hide_value_scaled"),
    Mutant("fa-segment-ids-inverted", "flash_attention", FLASH,
           find="        s = jnp.where(q_ids == kv_seg, s, mask_value)\n",
           replace="        s = jnp.where(q_ids != kv_seg, s, mask_value)\n",
           description="segment mask keeps keys of *other* segments",
           bug_class="segment_ids_inverted"),
]

# Scale and bias.
FLASH_SCALE = [
    Mutant("fa-sm-scale-missing", "flash_attention", FLASH,
           find="    if sm_scale != 1.0:\n        s = s * sm_scale\n",
           replace="",
           description="logits never multiplied by sm_scale (forward and backward)",
           bug_class="sm_scale_missing", sample=True),
    Mutant("fa-dkv-sm-scale-missing", "flash_attention", FLASH,
           find="        ds = (dp - _lanes_to(di_ref[0, 0, qs, :], block_k)) * p\n"
                "        if sm_scale != 1.0:\n            ds = ds * sm_scale\n",
           replace="        ds = (dp - _lanes_to(di_ref[0, 0, qs, :], block_k)) * p\n",
           description="dk misses the sm_scale chain-rule factor",
           bug_class="sm_scale_missing"),
    Mutant("fa-dq-sm-scale-doubled", "flash_attention", FLASH,
           find="        ds = (dp - _lanes_to(di_ref[0, 0], block_k)) * p\n"
                "        if sm_scale != 1.0:\n            ds = ds * sm_scale\n",
           replace="        ds = (dp - _lanes_to(di_ref[0, 0], block_k)) * p\n"
                   "        if sm_scale != 1.0:\n            ds = ds * sm_scale * sm_scale\n",
           description="dq and d_ab get sm_scale applied twice",
           bug_class="sm_scale_doubled"),
    Mutant("fa-bias-after-scale", "flash_attention", FLASH,
           find="    if ab is not None:\n        s = s + ab.astype(jnp.float32)\n"
                "    if sm_scale != 1.0:\n        s = s * sm_scale\n",
           replace="    if sm_scale != 1.0:\n        s = s * sm_scale\n"
                   "    if ab is not None:\n        s = s + ab.astype(jnp.float32)\n",
           description="bias added after scaling instead of before ((qk + ab) * scale contract)",
           bug_class="scale_bias_order_swapped"),
]

# Online softmax: running max, rescale, statistics used by the backward.
FLASH_SOFTMAX = [
    Mutant("fa-acc-alpha-missing", "flash_attention", FLASH,
           find="        acc_next = _lanes_to(alpha, head_dim) * acc_prev + pv\n",
           replace="        acc_next = acc_prev + pv\n",
           description="accumulator not rescaled by alpha when the running max grows",
           bug_class="missing_alpha_rescale"),
    narrowed_sum("fa-acc-in-value-dtype", "flash_attention", FLASH,
                 "        acc_next = _lanes_to(alpha, head_dim) * acc_prev + pv\n",
                 narrow="v.dtype", wide="jnp.float32",
                 description="the running P @ V accumulator held in the value dtype between kv blocks (bfloat16 for "
                             "bfloat16 values): exact to rounding over a few blocks"),
    narrowed_sum("fa-l-in-value-dtype", "flash_attention", FLASH,
                 "        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)\n",
                 narrow="v.dtype", wide="jnp.float32",
                 description="the running softmax denominator held in the value dtype between kv blocks (bfloat16 for "
                             "bfloat16 values): exact to rounding unless one key outweighs the blocks after it"),
    Mutant("fa-l-alpha-missing", "flash_attention", FLASH,
           find="        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)\n",
           replace="        l_next = l_prev + jnp.sum(p, axis=1, keepdims=True)\n",
           description="normaliser l not rescaled by alpha when the running max grows",
           bug_class="missing_alpha_rescale"),
    Mutant("fa-max-forgets-running", "flash_attention", FLASH,
           find="        m_next = jnp.maximum(jnp.maximum(m_prev, m_curr), mask_value)  # [bq, 128]\n",
           replace="        m_next = jnp.maximum(jnp.broadcast_to(m_curr, m_prev.shape), mask_value)  # [bq, 128]\n",
           description="running max replaced by the current block's max (alpha may overflow)",
           bug_class="wrong_max_update"),
    Mutant("fa-bwd-lse-sign", "flash_attention", FLASH,
           find="    p = jnp.exp(s - _lanes_to(m, width)) * _lanes_to(inv_l, width)\n",
           replace="    p = jnp.exp(s - _lanes_to(m + jnp.log(inv_l), width))\n",
           description="backward rebuilds p with lse = m + log(1/l) instead of m + log(l)",
           bug_class="lse_merge_error"),
]

# Block skipping and index maps.
FLASH_BLOCKS = [
    Mutant("fa-skip-by-first-query", "flash_attention", FLASH,
           find="    return kv_start <= q_start + q_block - 1\n",
           replace="    return kv_start <= q_start\n",
           description="causal block skip tests the q block's first query instead of its last",
           bug_class="block_skip_condition_wrong"),
    Mutant("fa-skip-strict-corner", "flash_attention", FLASH,
           find="    return kv_start <= q_start + q_block - 1\n",
           replace="    return kv_start < q_start + q_block - 1\n",
           description="causal block skip drops a block whose only visible pair is its corner",
           bug_class="block_skip_condition_wrong",
           equivalent="with offsets 0 (the public API) q_start + q_block - 1 is 7 mod 8 and kv_start is "
                      "0 mod 128, so the corner case kv_start == q_start + q_block - 1 never occurs; only "
                      "ring offsets reach it"),
    Mutant("fa-last-visible-block-by-first-query", "flash_attention", FLASH,
           find="    return lax.div(jnp.maximum(q_start + q_block - 1 - kv_offset, 0), kv_block)\n",
           replace="    return lax.div(jnp.maximum(q_start - kv_offset, 0), kv_block)\n",
           description="kv index map clamps to the block of the q block's first query: later blocks read stale keys",
           bug_class="index_map_wrong_block"),
    Mutant("fa-dab-map-clamped", "flash_attention", FLASH,
           find="        return (b, h, qi, ki)\n",
           replace="        return (b, h, qi, kv_block(qi, ki, q_off, kv_off))\n",
           description="d_ab out index map clamped like the inputs: skipped steps overwrite a real block with zeros",
           bug_class="index_map_wrong_block"),
    Mutant("fa-dkv-kv-seg-map", "flash_attention", FLASH,
           find="    def kv_seg_map(b, h, ki, qi, q_off, kv_off):\n        return (b, 0, ki)\n",
           replace="    def kv_seg_map(b, h, ki, qi, q_off, kv_off):\n        return (b, 0, 0)\n",
           description="dkv kernel always reads the first block of kv segment ids",
           bug_class="index_map_wrong_block"),
]

# Scratch initialisation, backward offsets, dtypes.
FLASH_STATE = [
    Mutant("fa-fwd-acc-not-initialised", "flash_attention", FLASH,
           find="            m_scr[b], l_scr[b], acc_scr[b] = m0, l0, acc0\n",
           replace="            m_scr[b], l_scr[b] = m0, l0\n",
           description="forward accumulator scratch never zeroed at the first kv step",
           bug_class="scratch_not_initialised"),
    Mutant("fa-dq-scratch-init-never", "flash_attention", FLASH,
           find="    @pl.when(kv_idx == 0)\n    def _init():\n        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)\n",
           replace="    @pl.when(kv_idx == num_kv)\n    def _init():\n        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)\n",
           description="dq scratch initialised on a grid step that never exists",
           bug_class="scratch_not_initialised"),
    Mutant("fa-dkv-q-offset-minor-block", "flash_attention", FLASH,
           find="    q_start = q_off_ref[0] + q_idx * block_q_major\n",
           replace="    q_start = q_off_ref[0] + q_idx * block_q\n",
           description="dkv kernel computes the q block offset with the minor block size",
           bug_class="bwd_chunk_offset_wrong"),
    Mutant("fa-dq-kv-sub-offset-dropped", "flash_attention", FLASH,
           find="            q_start=q_start, kv_start=kv_start + i * block_k, causal=causal,\n"
                "            sm_scale=sm_scale, mask_value=mask_value)\n"
                "        m = jnp.maximum(m_ref[0, 0], mask_value)\n",
           replace="            q_start=q_start, kv_start=kv_start, causal=causal,\n"
                   "            sm_scale=sm_scale, mask_value=mask_value)\n"
                   "        m = jnp.maximum(m_ref[0, 0], mask_value)\n",
           description="dq kernel's causal mask ignores the kv sub-block offset",
           bug_class="bwd_chunk_offset_wrong"),
    Mutant("fa-dk-grad-bf16", "flash_attention", FLASH,
           find="_ZERO_OFFSET, dk_dtype=k.dtype, dv_dtype=v.dtype, **common)",
           replace="_ZERO_OFFSET, dk_dtype=jnp.bfloat16, dv_dtype=v.dtype, **common)",
           description="dk written in bfloat16 whatever the input dtype",
           bug_class="grad_wrong_dtype"),
    Mutant("fa-pv-early-bf16", "flash_attention", FLASH,
           find="        pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)\n",
           replace="        pv = lax.dot(p.astype(jnp.bfloat16).astype(v.dtype), v, preferred_element_type=jnp.float32)\n",
           description="forward probabilities rounded to bfloat16 before P@V even for float32 inputs",
           bug_class="early_bf16_cast"),
    Mutant("fa-dq-ds-early-bf16", "flash_attention", FLASH,
           find="        dq_scr[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)\n",
           replace="        dq_scr[...] += lax.dot(ds.astype(jnp.bfloat16).astype(k.dtype), k,\n"
                   "                               preferred_element_type=jnp.float32)\n",
           description="dq kernel rounds ds to bfloat16 before ds@K even for float32 inputs",
           bug_class="early_bf16_cast"),
]

# ---------------------------------------------------------------- ragged paged attention
# Causal / window masks, window block skipping, kv_len validity.
RAGGED_MASKING = [
    Mutant("rpa-causal-strict-lt", "ragged_paged_attention", RAGGED,
           find="    visible = k_pos <= q_pos\n    if sliding_window is not None:\n"
                "      visible = jnp.logical_and(visible, q_pos - k_pos < sliding_window)\n",
           replace="    visible = k_pos < q_pos\n    if sliding_window is not None:\n"
                   "      visible = jnp.logical_and(visible, q_pos - k_pos < sliding_window)\n",
           description="causal mask `<` instead of `<=`: a token no longer sees itself",
           bug_class="mask_off_by_one", sample=True),
    Mutant("rpa-causal-top-left", "ragged_paged_attention", RAGGED,
           find="    q_pos = (kv_len - (q_end - q_start)) + (tok - q_start)\n",
           replace="    q_pos = tok - q_start\n",
           description="causal alignment top-left instead of bottom-right (context ignored)",
           bug_class="causal_alignment_shift"),
    Mutant("rpa-window-le", "ragged_paged_attention", RAGGED,
           find="      visible = jnp.logical_and(visible, q_pos - k_pos < sliding_window)\n",
           replace="      visible = jnp.logical_and(visible, q_pos - k_pos <= sliding_window)\n",
           description="sliding window admits one key too many (`<=` instead of `<`)",
           bug_class="sliding_window_edge"),
    Mutant("rpa-window-first-block-rounded-up", "ragged_paged_attention", RAGGED,
           find="      blk_start = first_key // num_kv_per_blk\n",
           replace="      blk_start = cdiv(first_key, num_kv_per_blk)\n",
           description="sliding-window block skip rounds the first needed block up: its keys are dropped",
           bug_class="block_skip_condition_wrong"),
    Mutant("rpa-kv-valid-off-by-one", "ragged_paged_attention", RAGGED,
           find="    kv_row_valid = kv_row < kv_len - kv_blk_start\n",
           replace="    kv_row_valid = kv_row <= kv_len - kv_blk_start\n",
           description="the row at kv_len counted as valid: its cache garbage is not zeroed",
           bug_class="mask_off_by_one"),
]

# Logit scale and soft cap, K/V dequantization and zeroing, GQA mapping, dtypes.
RAGGED_VALUES = [
    Mutant("rpa-sm-scale-missing", "ragged_paged_attention", RAGGED,
           find="          preferred_element_type=jnp.float32) * sm_scale\n      if soft_cap",
           replace="          preferred_element_type=jnp.float32)\n      if soft_cap",
           description="logits never multiplied by sm_scale",
           bug_class="sm_scale_missing"),
    Mutant("rpa-soft-cap-no-outer-scale", "ragged_paged_attention", RAGGED,
           find="        logits = soft_cap * jnp.tanh(logits / soft_cap)\n      logits = jnp.where(visible",
           replace="        logits = jnp.tanh(logits / soft_cap)\n      logits = jnp.where(visible",
           description="soft cap computed as tanh(x / cap) without the outer cap factor",
           bug_class="soft_cap_formula"),
    Mutant("rpa-soft-cap-before-scale", "ragged_paged_attention", RAGGED,
           find="          preferred_element_type=jnp.float32) * sm_scale\n      if soft_cap is not None:\n"
                "        logits = soft_cap * jnp.tanh(logits / soft_cap)\n      logits = jnp.where(visible",
           replace="          preferred_element_type=jnp.float32)\n      if soft_cap is not None:\n"
                   "        logits = soft_cap * jnp.tanh(logits / soft_cap)\n      logits = logits * sm_scale\n"
                   "      logits = jnp.where(visible",
           description="soft cap applied before sm_scale instead of after",
           bug_class="scale_bias_order_swapped"),
    Mutant("rpa-k-scale-dropped", "ragged_paged_attention", RAGGED,
           find="      k = jnp.where(kv_row_valid, _convert_kv(k, k_scale, k_dtype), 0)\n",
           replace="      k = jnp.where(kv_row_valid, _convert_kv(k, None, k_dtype), 0)\n",
           description="k_scale not applied when dequantizing K",
           bug_class="kv_scale_dropped"),
    Mutant("rpa-v-scale-dropped", "ragged_paged_attention", RAGGED,
           find="      v = jnp.where(kv_row_valid, _convert_kv(v, v_scale, v_dtype), 0)\n",
           replace="      v = jnp.where(kv_row_valid, _convert_kv(v, None, v_dtype), 0)\n",
           description="v_scale not applied when dequantizing V",
           bug_class="kv_scale_dropped"),
    Mutant("rpa-v-not-zeroed", "ragged_paged_attention", RAGGED,
           find="      v = jnp.where(kv_row_valid, _convert_kv(v, v_scale, v_dtype), 0)\n",
           replace="      v = _convert_kv(v, v_scale, v_dtype)\n",
           description="V rows past kv_len not zeroed: 0 * NaN garbage reaches P@V",
           bug_class="kv_zeroing_skipped"),
    Mutant("rpa-k-not-zeroed", "ragged_paged_attention", RAGGED,
           find="      k = jnp.where(kv_row_valid, _convert_kv(k, k_scale, k_dtype), 0)\n",
           replace="      k = _convert_kv(k, k_scale, k_dtype)\n",
           description="K rows past kv_len not zeroed",
           bug_class="kv_zeroing_skipped",
           equivalent="a K row past kv_len only affects its own logit column, and every key at or past "
                      "kv_len is causally invisible (k_pos >= kv_len > q_pos), so jnp.where replaces that "
                      "whole column by mask_value before any max, exp or sum"),
    Mutant("rpa-gqa-kv-head-divided", "ragged_paged_attention", RAGGED,
           find="      k = _fold_rows(kv_bufs[buf_idx, :, :, 2 * h, :])\n"
                "      v = _fold_rows(kv_bufs[buf_idx, :, :, 2 * h + 1, :])\n",
           replace="      k = _fold_rows(kv_bufs[buf_idx, :, :, 2 * (h // group), :])\n"
                   "      v = _fold_rows(kv_bufs[buf_idx, :, :, 2 * (h // group) + 1, :])\n",
           description="GQA: kv head index divided by the group size a second time",
           bug_class="gqa_head_mapping_wrong"),
    Mutant("rpa-probs-early-bf16", "ragged_paged_attention", RAGGED,
           find="      pv = jnp.dot(probs.astype(v.dtype), v,\n",
           replace="      pv = jnp.dot(probs.astype(jnp.bfloat16).astype(v.dtype), v,\n",
           description="probabilities rounded to bfloat16 before P@V even for float32 K/V",
           bug_class="early_bf16_cast"),
]

# Online softmax state in VMEM scratch.
RAGGED_SOFTMAX = [
    Mutant("rpa-acc-alpha-missing", "ragged_paged_attention", RAGGED,
           find="      acc_ref[h] = acc_ref[h] * alpha[:, :1] + pv\n",
           replace="      acc_ref[h] = acc_ref[h] + pv\n",
           description="accumulator not rescaled by alpha between kv blocks",
           bug_class="missing_alpha_rescale"),
    narrowed_sum("rpa-acc-in-value-dtype", "ragged_paged_attention", RAGGED,
                 "      acc_ref[h] = acc_ref[h] * alpha[:, :1] + pv\n",
                 narrow="q_ref.dtype", wide="jnp.float32",
                 description="the running P @ V accumulator held in the query dtype between kv blocks (bfloat16 "
                             "for bfloat16 queries): exact to rounding over a few blocks"),
    narrowed_sum("rpa-l-in-value-dtype", "ragged_paged_attention", RAGGED,
                 "      l_ref[h] = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)\n",
                 narrow="q_ref.dtype", wide="jnp.float32",
                 description="the running softmax denominator held in the query dtype between kv blocks (bfloat16 for "
                             "bfloat16 queries): exact to rounding unless one key outweighs the blocks after it"),
    Mutant("rpa-l-alpha-missing", "ragged_paged_attention", RAGGED,
           find="      l_ref[h] = alpha * l_prev + jnp.sum(probs, axis=1, keepdims=True)\n",
           replace="      l_ref[h] = l_prev + jnp.sum(probs, axis=1, keepdims=True)\n",
           description="normaliser l not rescaled by alpha between kv blocks (lse merge)",
           bug_class="lse_merge_error"),
    Mutant("rpa-max-forgets-running", "ragged_paged_attention", RAGGED,
           find="      m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))\n",
           replace="      m_next = jnp.broadcast_to(jnp.max(logits, axis=1, keepdims=True), m_prev.shape)\n",
           description="running max replaced by the current block's max",
           bug_class="wrong_max_update"),
    Mutant("rpa-state-init-once-per-step", "ragged_paged_attention", RAGGED,
           find="    pl.when(has_work)(init_softmax_state)\n",
           replace="    pl.when(has_work & (seq_idx == first_seq))(init_softmax_state)\n",
           description="softmax scratch initialised once per grid step, not per sequence",
           bug_class="scratch_not_initialised"),
]

# Manual K/V DMA: wait placement, double-buffer slots, page table.
RAGGED_DMA = [
    Mutant("rpa-read-before-wait", "ragged_paged_attention", RAGGED,
           find="      wait_kv_block(seq_idx, kv_blk_idx, buf_idx)\n      attend_kv_block(seq_idx, kv_blk_idx, buf_idx)\n",
           replace="      attend_kv_block(seq_idx, kv_blk_idx, buf_idx)\n      wait_kv_block(seq_idx, kv_blk_idx, buf_idx)\n",
           description="K/V block read before its DMA is waited",
           bug_class="dma_wait_moved"),
    Mutant("rpa-prefetch-same-slot", "ragged_paged_attention", RAGGED,
           find="      next_buf = 1 - buf_idx\n",
           replace="      next_buf = buf_idx\n",
           description="next block prefetched into the slot still being computed on",
           bug_class="dma_wait_moved"),
    Mutant("rpa-page-slot-shifted", "ragged_paged_attention", RAGGED,
           find="      page = page_indices_ref[s, jnp.minimum(slot, pages_per_seq - 1)]\n",
           replace="      page = page_indices_ref[s, jnp.minimum(slot + 1, pages_per_seq - 1)]\n",
           description="page table read one slot ahead: the wrong page is DMA'd",
           bug_class="index_map_wrong_block"),
]

# ---------------------------------------------------------------- blockwise FFN
# Chunking (scan over sequence chunks), biases, precision of weights and activations.
FFN_MUTANTS = [
    Mutant("ffn-chunk-output-order", "blockwise_ffn", FFN,
           find="    out = jnp.moveaxis(out, 0, -3)\n",
           replace="    out = jnp.moveaxis(jnp.flip(out, 0), 0, -3)\n",
           description="chunks written back in reverse order", bug_class="index_map_wrong_block",
           sample=True),
    Mutant("ffn-chunks-strided", "blockwise_ffn", FFN,
           find="    chunks = jnp.moveaxis(inputs.reshape(*lead, num_chunks, chunk_size, features), -3, 0)\n",
           replace="    chunks = jnp.moveaxis(jnp.swapaxes(inputs.reshape(*lead, chunk_size, num_chunks, features),\n"
                   "                                       -3, -2), -3, 0)\n",
           description="chunk c takes positions c, c + n, c + 2n, ... but is written back contiguously",
           bug_class="index_map_wrong_block"),
    Mutant("ffn-b-in-dropped", "blockwise_ffn", FFN,
           find="    if params.b_in is not None:\n        h = h + params.b_in\n",
           replace="",
           description="first-layer bias never added",
           bug_class="bias_dropped"),
    Mutant("ffn-weights-bf16", "blockwise_ffn", FFN,
           find="        params = jax.tree.map(lambda p, dt: p.astype(dt), params32, param_dtypes)\n",
           replace="        params = jax.tree.map(lambda p, dt: p.astype(jnp.bfloat16).astype(dt), params32, param_dtypes)\n",
           description="weights rounded to bfloat16 inside each chunk even for float32 models",
           bug_class="early_bf16_cast"),
    Mutant("ffn-weight-grads-bf16", "blockwise_ffn", FFN,
           find="    return p.astype(jnp.float32) if jnp.issubdtype(p.dtype, jnp.floating) and p.dtype.itemsize < 4 else p\n",
           replace="    return p.astype(jnp.bfloat16) if jnp.issubdtype(p.dtype, jnp.floating) else p\n",
           description="weights enter the scan, and their cotangents are summed over chunks, in bfloat16",
           bug_class="grad_wrong_dtype"),
    Mutant("ffn-pre-activation-bf16", "blockwise_ffn", FFN,
           find="    y = jnp.matmul(activation(h).astype(x.dtype), params.w_out, preferred_element_type=jnp.float32)\n",
           replace="    y = jnp.matmul(activation(h.astype(jnp.bfloat16)).astype(x.dtype), params.w_out,\n"
                   "                   preferred_element_type=jnp.float32)\n",
           description="pre-activation rounded to bfloat16 before gelu whatever the model dtype",
           bug_class="early_bf16_cast"),
    Mutant("ffn-no-remat", "blockwise_ffn", FFN,
           find="    remat: bool = True,\n",
           replace="    remat: bool = False,\n",
           description="chunks not rematerialised (memory only)",
           bug_class="remat_dropped",
           equivalent="jax.checkpoint changes what the backward stores, not what it computes: same "
                      "operations on the same values, so outputs and gradients are identical"),
]

# ---------------------------------------------------------------- ring attention (three families)
# The ring loop and rotation are shared; each mutant is run against the family whose gate
# exercises the code it changes (blockwise: ring_attention; masked: ring_attention_standard;
# Pallas steps: ring_flash_attention).
RING_MUTANTS = [
    Mutant("ring-rotate-backwards", "ring_attention_standard", RING,
           find="    perm = [(i, (i + 1) % n) for i in range(n)]\n",
           replace="    perm = [(i, (i - 1) % n) for i in range(n)]\n",
           description="kv blocks rotate i -> i - 1 while the loop assumes i -> i + 1",
           bug_class="ring_rotation_direction", sample=True),
    Mutant("ring-standard-mask-local-keys", "ring_attention_standard", RING,
           find="                mask=_query_major_chunk(ctx.mask, iq * qc, k_start, qc, kc),\n",
           replace="                mask=_query_major_chunk(ctx.mask, iq * qc, ik * kc, qc, kc),\n",
           description="mask columns sliced at the local key offset instead of the global one",
           bug_class="index_map_wrong_block"),
    Mutant("ring-causal-every-step", "ring_attention", RING,
           find="        state, _ = _chunk_grid(cfg, ctx, kv, kv_block * sk,\n",
           replace="        state, _ = _chunk_grid(cfg, ctx, kv, lax.axis_index(cfg.axis_name) * sk,\n",
           description="forward treats every ring step's kv block as the diagonal block (causal per step)",
           bug_class="causal_every_ring_step"),
    Mutant("ring-dkdv-not-rotated", "ring_attention", RING,
           find="        return (carry, _rotate(kv_state, axis_name), _rotate(kv_grads, axis_name)), None\n",
           replace="        return (carry, _rotate(kv_state, axis_name), kv_grads), None\n",
           description="dk/dv accumulators stay on the device instead of travelling with their kv block",
           bug_class="dkdv_not_rotated"),
    Mutant("ring-lse-from-first-step", "ring_attention", RING,
           find="    state, _ = _ring_loop(step, state, (k, v, kv_seg), (), axis_name=cfg.axis_name)\n"
                "    acc, l, m = map(_from_chunks, state)\n"
                "    seen = l > 0\n"
                "    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)\n",
           replace="    first, _ = step(state, (k, v, kv_seg), (), lax.axis_index(cfg.axis_name))\n"
                   "    state, _ = _ring_loop(step, state, (k, v, kv_seg), (), axis_name=cfg.axis_name)\n"
                   "    acc, l, m = map(_from_chunks, state)\n"
                   "    seen = l > 0\n"
                   "    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)\n"
                   "    _, l, m = map(_from_chunks, first)\n"
                   "    seen = l > 0\n",
           description="backward residual lse taken after the first ring step (own block) instead of the last",
           bug_class="residual_wrong_ring_step"),
    Mutant("ring-lse-sign", "ring_attention", RING,
           find="    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)\n",
           replace="    lse = jnp.where(seen, m - jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)\n",
           description="logsumexp residual merges m and log(l) with the wrong sign",
           bug_class="lse_merge_error"),
    Mutant("ring-bwd-q-offset-chunk", "ring_attention", RING,
           find="    ctx = _RingContext(q, bias, mask, q_seg, seed, lax.axis_index(ax) * sq)\n",
           replace="    ctx = _RingContext(q, bias, mask, q_seg, seed, lax.axis_index(ax) * cfg.query_chunk_size)\n",
           description="backward places this device's queries at axis_index * chunk instead of * local length",
           bug_class="bwd_chunk_offset_wrong"),
    Mutant("ring-flash-causal-every-step", "ring_flash_attention", RING,
           find="            _flash_segments(q_seg, kv_seg_blk), carry, **cfg.kernel_kwargs(q_offset, kv_offset))\n",
           replace="            _flash_segments(q_seg, kv_seg_blk), carry, **cfg.kernel_kwargs(0, 0))\n",
           description="forward flash step gets offsets 0: the causal diagonal is applied on every ring step",
           bug_class="causal_every_ring_step"),
    Mutant("ring-flash-bwd-offsets-swapped", "ring_flash_attention", RING,
           find="        kwargs = cfg.kernel_kwargs(q_offset, kv_offset)\n",
           replace="        kwargs = cfg.kernel_kwargs(kv_offset, q_offset)\n",
           description="backward flash steps get q and kv offsets swapped",
           bug_class="bwd_chunk_offset_wrong"),
    Mutant("ring-flash-carry-normalised", "ring_flash_attention", FLASH,
           find="            return m_in_ref[b, 0], l0, o_in_ref[b, 0] * _lanes_to(l0, head_dim)\n",
           replace="            return m_in_ref[b, 0], l0, o_in_ref[b, 0]\n",
           description="flash step folds the normalised carry o in without multiplying back by l",
           bug_class="lse_merge_error"),
    Mutant("ring-flash-bias-times-scale", "ring_flash_attention", RING,
           find="    cols = _key_columns(bias, kv_offset, kv_len).astype(_ACC_DTYPE) / cfg.sm_scale\n",
           replace="    cols = _key_columns(bias, kv_offset, kv_len).astype(_ACC_DTYPE) * cfg.sm_scale\n",
           description="bias converted to the kernel's (qk + ab) * scale convention with * instead of /",
           bug_class="scale_bias_order_swapped"),
    Mutant("ring-di-from-rounded-output", "ring_attention_standard", RING,
           find="    di = jnp.sum(g.astype(_ACC_DTYPE) * out, axis=-1)  # [B, Sq, H]; out is float32\n",
           replace="    di = jnp.sum(g.astype(_ACC_DTYPE) * out.astype(q.dtype).astype(_ACC_DTYPE), axis=-1)\n",
           description="backward's di = rowsum(dO * O) from the output rounded to q.dtype (bfloat16 loses dq, dk)",
           bug_class="early_bf16_cast"),
    narrowed_sum("ring-l-in-value-dtype", "ring_attention", RING,
                 "    l = l * alpha + p.sum(axis=-1)\n",
                 narrow="v_c.dtype", wide="_ACC_DTYPE",
                 description="the running softmax denominator held in the compute dtype between key chunks and "
                             "ring steps (bfloat16 for bfloat16 inputs without float32_logits): exact to rounding "
                             "unless one key outweighs the chunks after it"),
    narrowed_sum("ring-acc-in-value-dtype", "ring_attention", RING,
                 "    acc = acc * alpha[..., None] + _einsum(cfg, \"bqhk,bkhd->bqhd\", "
                 "p_dropped.astype(v_c.dtype), v_c)\n",
                 narrow="v_c.dtype", wide="_ACC_DTYPE",
                 description="the running P @ V accumulator held in the compute dtype between key chunks and ring steps "
                             "(bfloat16 for bfloat16 inputs without float32_logits): exact to rounding over a few chunks"),
    # Shows only on a row that sees no key at all (its running max stays -inf).
    Mutant("ring-masked-row-nan", "ring_attention", RING,
           find="    m_shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)\n",
           replace="    m_shift = m_new\n",
           description="running max of a row with no visible key not guarded: exp(-inf - -inf) = NaN",
           bug_class="fully_masked_row_nan"),
]

# ---------------------------------------------------------------- splash attention (jax's, installed)
# Planted in a copy of jax's kernel module; the gate runs the copy's make_splash_mha.
SPLASH_KERNEL = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel"


def _splash(id_, find, replace, description, bug_class):
    return Mutant(id_, "splash_attention", None, find=find, replace=replace, description=description,
                  bug_class=bug_class, module=SPLASH_KERNEL, impl="make_splash_mha")


# The forward's k and v index maps (the dq kernel's differ in their signature).
_SPLASH_FWD_KV_MAPS = ("    prefix = () if is_mqa else (_div(h, q_heads_per_kv_head),)\n"
                       "    return from_head_minor((*prefix, next_j, 0), k_layout)\n\n"
                       "  v_layout = block_sizes.v_layout\n"
                       "  def v_index_map(h, i, j, data_next_ref, block_mask_ref, mask_next_ref=None):\n"
                       "    next_j, *_ = _next_nonzero(\n"
                       "        h, i, j, data_next_ref, block_mask_ref, mask_next_ref\n"
                       "    )\n"
                       "    prefix = () if is_mqa else (_div(h, q_heads_per_kv_head),)\n")

SPLASH_MUTANTS = [
    _splash("splash-l-alpha-missing",
            "    l_next = l_curr + alpha * l_prev\n", "    l_next = l_curr + l_prev\n",
            "forward softmax denominator not rescaled by alpha when the running max rises", "missing_alpha_rescale"),
    _splash("splash-k-offset-grid-index",
            "        k_offset=global_kv_index * bkv + kv_compute_index * bkv_compute,\n",
            "        k_offset=j * bkv + kv_compute_index * bkv_compute,\n",
            "in-kernel mask placed at the grid's kv index instead of data_next's (wrong on a shrunk grid)",
            "shrunk_grid_offset"),
    _splash("splash-gqa-interleaved", _SPLASH_FWD_KV_MAPS,
            _SPLASH_FWD_KV_MAPS.replace("_div(h, q_heads_per_kv_head)", "lax.rem(h, num_kv_heads)"),
            "forward reads kv head h % Hkv (interleaved) instead of h // (H / Hkv) (grouped)", "gqa_head_mapping"),
    _splash("splash-dkv-gqa-reinit",
            "    should_initialize = jnp.logical_and(\n        should_initialize, q_head_index_per_kv_head == 0\n    )\n",
            "",
            "dk/dv scratch zeroed for every query head of a kv group: only the group's last head is summed",
            "gqa_accumulation_reset"),
    _splash("splash-full-block-masked",
            "        jnp.bitwise_or(mask, jnp.broadcast_to(should_not_mask, mask.shape))\n", "        mask\n",
            "a full block applies whatever partial mask block is loaded (should_not_mask ignored)",
            "mask_block_mixup"),
    _splash("splash-soft-cap-after-mask",
            "    qk = cap_logits(qk)\n    qk = jnp.where(mask, qk, mask_value)\n",
            "    qk = jnp.where(mask, qk, mask_value)\n    qk = cap_logits(qk)\n",
            "soft cap applied after masking: masked logits become -cap, not excluded", "soft_cap_order"),
    _splash("splash-dkv-soft-cap-derivative",
            "      g = ds * (1 - d)\n      ds = g + g * d\n    dk_dims",
            "      ds = ds * (1 - d)\n    dk_dims",
            "dk (and the fused dq) use 1 - tanh instead of 1 - tanh^2 as the soft cap's derivative",
            "soft_cap_derivative"),
    _splash("splash-dq-di-missing",
            "        do.astype(v.dtype), v, dp_dims, preferred_element_type=jnp.float32,\n    )\n"
            "    ds = (dp - di) * p\n",
            "        do.astype(v.dtype), v, dp_dims, preferred_element_type=jnp.float32,\n    )\n"
            "    ds = dp * p\n",
            "dq kernel drops rowsum(dO * O) from dS", "softmax_bwd_delta_missing"),
]

# ---------------------------------------------------------------- paged attention (jax's, installed)
PAGED_MODULE = "jax.experimental.pallas.ops.tpu.paged_attention.paged_attention_kernel"


def _paged(id, find, replace, description, bug_class):
    return Mutant(id, "paged_attention", None, find=find, replace=replace, description=description,
                  bug_class=bug_class, module=PAGED_MODULE, impl="paged_attention")


PAGED_MUTANTS = [
    _paged("pa-length-mask-off-by-one",
           "    mask = i * bk + jax.lax.broadcasted_iota(jnp.int32, qk.shape, 1) < length\n",
           "    mask = i * bk + jax.lax.broadcasted_iota(jnp.int32, qk.shape, 1) <= length\n",
           "the slot just past a sequence's length is visible", "mask_off_by_one"),
    _paged("pa-soft-cap-not-rescaled", "      qk = capped_qk * attn_logits_soft_cap\n", "      qk = capped_qk\n",
           "soft cap returns tanh(qk / cap) without multiplying back by cap", "soft_cap_wrong"),
    _paged("pa-normaliser-not-rescaled", "    l_next = alpha * l_prev + beta * l_curr\n",
           "    l_next = l_prev + beta * l_curr\n",
           "online softmax keeps the old normaliser unscaled when the running max rises", "online_softmax_rescale"),
    _paged("pa-prefetch-skips-one-empty-sequence",
           "            lambda _, b: jnp.where(lengths_ref[b] == 0, b + b_step, b),\n",
           "            lambda _, b: b,\n",
           "the prefetch skips only the first of several empty sequences: the next one computes with the "
           "pages of an empty one", "prefetch_wrong_block"),
    _paged("pa-megacore-kv-head-index", "  h = h * h_step + h_start\n", "  h = h + h_start\n",
           "megacore kv_head: a core's later steps load the pages of another core's kv head", "core_index_wrong"),
    _paged("pa-int8-scales-bf16", "      scales_jax_array = self._scales_vmem_buffer[...].astype(jnp.float32)\n",
           "      scales_jax_array = self._scales_vmem_buffer[...].astype(jnp.bfloat16)\n",
           "int8 dequantisation scales rounded to bfloat16", "dequantization_precision"),
    _paged("pa-megacore-batch-inline-length", "    length = lengths_ref[b * num_cores + core_index]\n",
           "    length = lengths_ref[b + core_index]\n",
           "megacore batch, inline: a core's second sequence uses the length of another", "core_index_wrong"),
]

# ---------------------------------------------------------------- dot_product_attention (the flash adapter)
DPA = "kernels/dot_product_attention.py"
DPA_MUTANTS = [
    Mutant("dpa-bias-times-scale", "dot_product_attention", DPA,
           find="bias.astype(jnp.float32) / sm_scale", replace="bias.astype(jnp.float32) * sm_scale",
           description="bias converted to the kernel's (q.k + ab) * scale with * instead of /",
           bug_class="scale_bias_order_swapped"),
    Mutant("dpa-window-right-side-ignored", "dot_product_attention", DPA,
           find="(j <= i + window[1])", replace="(j <= i)",
           description="local window keeps only its left side", bug_class="mask_wrong"),
    Mutant("dpa-masked-rows-not-replaced", "dot_product_attention", DPA,
           find="        out = jnp.where(~visible.any(axis=-1)[..., None], mean_v.astype(out.dtype), out)\n",
           replace="",
           description="rows that see no key keep the kernel's uniform average over the padded keys",
           bug_class="fully_masked_row_wrong"),
    Mutant("dpa-gqa-tiled-heads", "dot_product_attention", DPA,
           find="        x = jnp.repeat(x.transpose(0, 2, 1, 3), repeat, axis=1)\n",
           replace="        x = jnp.tile(x.transpose(0, 2, 1, 3), (1, repeat, 1, 1))\n",
           description="kv heads tiled instead of repeated: query head n reads kv head n % K, not n // G",
           bug_class="gqa_head_mapping"),
    Mutant("dpa-padded-keys-visible", "dot_product_attention", DPA,
           find="(0, s_pad - s)), constant_values=MASKED_AB)", replace="(0, s_pad - s)))",
           description="keys added to reach the kernel's tile get logit 0 instead of being hidden",
           bug_class="padding_leak"),
    Mutant("dpa-query-lengths-ignored", "dot_product_attention", DPA,
           find="    if query_seq_lengths is not None:\n        out = out *",
           replace="    if False:\n        out = out *",
           description="rows past a query length are not zeroed", bug_class="mask_wrong"),
]

# Promises of the kernels' docstrings (each seen only by the contract classes that draw
# them) and parameters that once never varied (block_b).
CONTRACT_MUTANTS = [
    Mutant("fa-no-mask-floor", "flash_attention", FLASH,
           find="        m_next = jnp.maximum(jnp.maximum(m_prev, m_curr), mask_value)  # [bq, 128]\n",
           replace="        m_next = jnp.maximum(m_prev, m_curr)  # [bq, 128]\n",
           description="running max not floored: a row whose visible ab entries are all -inf gives NaN, not 0",
           bug_class="neg_inf_bias_nan"),
    Mutant("fa-causal-additive-fallback", "flash_attention", FLASH,
           find="        s = jnp.where(visible, s, mask_value)\n    return s, visible\n",
           replace="        s = jnp.where(visible, s, mask_value)\n        visible = None\n    return s, visible\n",
           description="causally hidden keys masked additively: a row of an absent segment averages the "
                       "hidden keys of the blocks it visits too (the seeds' block-size-dependent answer)",
           bug_class="fully_masked_row_block_dependent"),
    Mutant("fa-block-b-first-query", "flash_attention", FLASH,
           find="            q_ref[b, 0], k_ref[b, 0, ks, :],\n",
           replace="            q_ref[0, 0], k_ref[b, 0, ks, :],\n",
           description="a forward tile over several batch elements reads the first element's queries for all",
           bug_class="batch_tile_index"),
    Mutant("rpa-padding-rows-stale", "ragged_paged_attention", RAGGED,
           find="  o_ref[...] = jnp.zeros_like(o_ref)\n",
           replace="",
           description="output rows owned by no sequence keep stale memory instead of the promised zeros",
           bug_class="padding_rows_not_zero"),
    Mutant("ffn-same-rng-every-chunk", "blockwise_ffn", FFN,
           find="        return ffn(params, x, rng=jax.random.fold_in(rng, index))\n",
           replace="        return ffn(params, x, rng=rng)\n",
           description="every chunk gets the same dropout key instead of fold_in(rng, chunk index)",
           bug_class="rng_not_per_chunk"),
]

# An optional input's presence read off another's: seen only where the draws give the
# inputs apart (``bugclasses.presences``).
PRESENCE_MUTANTS = [
    Mutant("ffn-b-out-by-b-in", "blockwise_ffn", FFN,
           find="    if params.b_out is not None:\n",
           replace="    if params.b_in is not None:\n",
           description="b_out added where b_in is given: one bias's presence read off the other's",
           bug_class="optional_input_presence"),
]

CATALOGUE: list[Mutant] = [
    *FLASH_MASKING, *FLASH_SCALE, *FLASH_SOFTMAX, *FLASH_BLOCKS, *FLASH_STATE,
    *RAGGED_MASKING, *RAGGED_VALUES, *RAGGED_SOFTMAX, *RAGGED_DMA,
    *FFN_MUTANTS,
    *RING_MUTANTS,
    *SPLASH_MUTANTS,
    *PAGED_MUTANTS,
    *DPA_MUTANTS,
    *CONTRACT_MUTANTS,
    *PRESENCE_MUTANTS,
]
