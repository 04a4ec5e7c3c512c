"""The ragged paged attention v3 family's KernelSpec: the oracle mapping, the inputs, the
yardstick and the kernel's call."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

from attncheck import backends, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.layouts import ErrorMapLayout, every
from attncheck.oracle.ragged_v3 import merged
from attncheck.specs.base import MASK_VALUE_UNDERFLOWS, SOFT_CAP_IS_POSITIVE, KernelSpec, accepted_keywords
from attncheck.specs.ragged_v3.classes import BUG_CLASSES, CONTRACTS, _valid_rows
from attncheck.specs.ragged_v3.draws import ragged_v3_cases
from attncheck.specs.ragged_v3.invalid import invalid_v3_calls
from attncheck.specs.ragged_v3.params import ARRAY_ARGS, BLOCKS, FAMILY, KV_DTYPES, MASK_VALUE, RaggedV3Params


class RaggedV3Spec(KernelSpec[RaggedV3Params]):
    name = FAMILY
    params_type = RaggedV3Params
    directions = {"out": ("token", "q_head", "dim"), "kv_cache": ("page", "slot", "word", "lane_group", "lane")}
    exact_directions = frozenset({"kv_cache"})
    default_impls = {}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    fixed_parameters = {
        **{f"{name}.dtype": "the kernel requires int32 metadata" for name in
           ("kv_lens", "page_indices", "cu_q_lens", "distribution")},
        "distribution.shape[0]": "distribution is (decode end, chunked prefill end, mixed end) by the convention",
        **parameters.outside_convention("soft_cap", ("negative", "zero"), SOFT_CAP_IS_POSITIVE),
        **parameters.outside_convention("mask_value", ("*",), MASK_VALUE_UNDERFLOWS),
        **{f"{name}": "a quantization scale is positive; its cells are drawn by the family"
           for name in ("q_scale", "k_scale", "v_scale")},
        **{f"d_block_sizes[{i}]": "a decode kernel's q block is one token" for i in (0, 2)},
        **{f"{kind}_block_sizes.len": "(bq_sz, bkv_sz, bq_csz, bkv_csz) by the convention" for kind in "dpm"},
        "debug_mode": "prints instead of computing (the kernel's docstring): not a mode to verify",
        "disable_bounds_checks": "Mosaic's own checks on a TPU; interpret mode checks every access itself",
        "disable_semaphore_checks": "Mosaic's own checks on a TPU; interpret mode checks semaphores itself",
        "skip_kv_mask": "the convention is causal attention within each sequence (the oracle's)",
        "use_causal_mask": "the convention is causal attention within each sequence (the oracle's)",
        "update_kv_cache": "KV sharing (False) reads a cache another layer wrote: outside this convention",
    }
    bug_classes = BUG_CLASSES
    examples = {"interpret": 24, "interpret-hazards": 6, "tpu-lower": 3, "tpu": 36}
    # A decode and a mixed sequence whose windows start two and three kv blocks in, a
    # mixed one whose new tokens cross a page: where the kv loop's first block and the
    # cache update of a windowed sequence are exercised together.
    explicit_examples = {"window_starts_past_first_kv_block": Case(FAMILY, RaggedV3Params(
        dtype="float32", kv_dtype="float32", head_dim=128, page_size=16, num_q_heads=4, num_kv_heads=2,
        seqs=((1, 90), (6, 120), (3, 40)), distribution=(1, 1, 3), chunk_prefill_size=None, sliding_window=5,
        soft_cap=None, sm_scale=128 ** -0.5, q_scale=None, k_scale=None, v_scale=None, blocks="small",
        values="normal"), 7),
        # 20 new tokens of a mixed sequence in three q blocks of 8, under a window of 5.
        "windowed_new_tokens_over_several_q_blocks": Case(FAMILY, RaggedV3Params(
            dtype="float32", kv_dtype="float32", head_dim=128, page_size=8, num_q_heads=2, num_kv_heads=2,
            seqs=((1, 30), (20, 50)), distribution=(1, 1, 2), chunk_prefill_size=None, sliding_window=5,
            soft_cap=None, sm_scale=128 ** -0.5, q_scale=None, k_scale=None, v_scale=None, blocks="small",
            values="normal"), 3),
        # A decode query at position 32 under a window of 1: its kv loop starts at key 0, and
        # the first compute chunk (keys 0-15) hides every key from it; -1e30 rounds to
        # -1.00026e30 in bfloat16.
        "inexact_mask_value_over_a_hidden_chunk": Case(FAMILY, RaggedV3Params(
            dtype="bfloat16", kv_dtype="bfloat16", head_dim=128, page_size=8, num_q_heads=2, num_kv_heads=2,
            seqs=((1, 33), (1, 5)), distribution=(2, 2, 2), chunk_prefill_size=None, sliding_window=1,
            soft_cap=None, sm_scale=128 ** -0.5, q_scale=None, k_scale=None, v_scale=None, blocks="small",
            values="normal", mask_value=MASK_VALUE), 5)}
    contracts = CONTRACTS

    def cases(self):
        return ragged_v3_cases()

    def inputs(self, case):
        p = case.params
        rng = np.random.default_rng(case.seed)
        shapes, page_size = p.shapes, p.page_size
        q_dt, kv_dt = S.dtype_of(p.dtype), KV_DTYPES[p.kv_dtype]
        n = len(p.seqs)
        q_lens = np.array([q for q, _ in p.seqs] + [0] * (shapes.max_seqs - n))
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        spread = S.LARGE_LOGIT_STD if p.values == "large" else 1.0
        queries = rng.standard_normal((shapes.max_tokens, p.num_q_heads, p.head_dim))
        new = rng.standard_normal((2, shapes.max_tokens, p.num_kv_heads, p.head_dim))
        new[0] *= spread
        queries[cu[n]:] = new[:, cu[n]:] = np.nan  # padding tokens
        keys, values = (x.astype(np.float32).astype(kv_dt) for x in new)
        # The cache: history of every sequence in shuffled pages, NaN everywhere else (the
        # new tokens' slots included); zero pads, as merge_kv writes them.
        order = rng.permutation(shapes.total_pages)
        page_indices = rng.integers(0, shapes.total_pages, size=shapes.max_seqs * shapes.pages_per_seq)
        cache = np.full(p.cache_shape, np.nan, dtype=np.float32)
        tokens = cache.reshape(-1, *cache.shape[2:])
        used = 0
        for s, (q_len, kv_len) in enumerate(p.seqs):
            pages = -(-kv_len // page_size)
            page_indices[s * shapes.pages_per_seq: s * shapes.pages_per_seq + pages] = order[used:used + pages]
            used += pages
            old = kv_len - q_len
            rows = order[used - pages:used].repeat(page_size) * page_size + np.tile(np.arange(page_size), pages)
            history = rng.standard_normal((2, old, p.num_kv_heads, p.head_dim))
            tokens[rows[:old]] = merged(history[0] * spread, history[1], cache.shape)
        kv_lens = np.zeros(shapes.max_seqs, np.int32)
        kv_lens[:n] = [k for _, k in p.seqs]
        # Metadata past the last sequence is padding the kernel must not trust.
        kv_lens[n:] = rng.integers(0, page_size * shapes.pages_per_seq + 1, size=shapes.max_seqs - n)
        return {"queries": S.round_to(queries, q_dt), "keys": keys, "values": values,
                "kv_cache": cache.astype(kv_dt), "kv_lens": kv_lens, "page_indices": page_indices.astype(np.int32),
                "cu_q_lens": cu, "distribution": np.array(p.distribution, np.int32)}

    @staticmethod
    def _options(p: RaggedV3Params) -> dict:
        return dict(sm_scale=p.sm_scale, sliding_window=p.sliding_window, soft_cap=p.soft_cap, q_scale=p.q_scale,
                    k_scale=p.k_scale, v_scale=p.v_scale, chunk_prefill_size=p.chunk_prefill_size)

    def _call(self, impl, p: RaggedV3Params):
        knobs = accepted_keywords(impl, out_dtype=p.out_dtype and np.dtype(p.out_dtype), mask_value=p.mask_value,
                                  vmem_limit_bytes=p.vmem_limit_bytes)
        return lambda *args: impl(*args, **self._options(p), **(BLOCKS[p.blocks] or {}), **knobs)

    def evaluate(self, impl, case, inputs):
        # The kernel donates its array arguments: each call gets buffers of its own.
        args = [jax.device_put(np.array(inputs[n], copy=True)) for n in ARRAY_ARGS]
        out, cache = self._call(impl, case.params)(*args)
        return {"out": np.asarray(out), "kv_cache": np.asarray(cache)}

    def lower(self, impl, case):
        args = [self.inputs(case)[n] for n in ARRAY_ARGS]
        return {"lower-fwd": lambda: backends.export_for_tpu(self._call(impl, case.params), *args)}

    def oracle(self, case, inputs):
        truth = oracle.ragged_paged_attention_v3(*(inputs[n] for n in ARRAY_ARGS), **self._options(case.params))
        return {"out": truth.out, "kv_cache": truth.kv_cache.astype(np.float64)}

    def output_dtypes(self, case):
        return {"out": S.dtype_of(case.params.dtype), "kv_cache": KV_DTYPES[case.params.kv_dtype]}

    def care(self, case, inputs):
        return _valid_rows(case, inputs)

    def yardstick(self, case, inputs):
        """Dense XLA attention over every sequence's keys (the cache's history and the new
        tokens) in working precision."""
        p = case.params
        shapes = p.shapes
        q_dt, kv_dt = S.dtype_of(p.dtype), KV_DTYPES[p.kv_dtype]
        tokens = inputs["kv_cache"].reshape(-1, p.cache_shape[2] * p.cache_shape[3], p.cache_shape[-1])
        capacity = p.page_size * shapes.pages_per_seq
        k = np.zeros((shapes.max_seqs * capacity, p.num_kv_heads, p.head_dim), np.float32)
        v = np.zeros_like(k)
        q_pos, kv_pos = np.full(shapes.max_tokens, -1), np.full(shapes.max_seqs * capacity, 1 << 30)
        seq_of_token, seq_of_key = np.full(shapes.max_tokens, -1), np.repeat(np.arange(shapes.max_seqs), capacity)
        cu, table = inputs["cu_q_lens"], inputs["page_indices"].reshape(shapes.max_seqs, -1)
        for s, (q_len, kv_len) in enumerate(p.seqs):
            old = kv_len - q_len
            positions = np.arange(old)
            history = tokens[table[s, positions // p.page_size] * p.page_size + positions % p.page_size]
            keys = slice(s * capacity, s * capacity + kv_len)
            k[keys] = np.concatenate([history[:, 0:2 * p.num_kv_heads:2, :p.head_dim],
                                      inputs["keys"][cu[s]:cu[s] + q_len]]).astype(np.float32)
            v[keys] = np.concatenate([history[:, 1:2 * p.num_kv_heads:2, :p.head_dim],
                                      inputs["values"][cu[s]:cu[s] + q_len]]).astype(np.float32)
            kv_pos[keys] = np.arange(kv_len)
            q_pos[cu[s]: cu[s] + q_len] = old + np.arange(q_len)
            seq_of_token[cu[s]: cu[s] + q_len] = s
        queries = np.nan_to_num(inputs["queries"].astype(np.float32))
        if p.q_scale is not None:
            # Divided in the queries' dtype, as naive code does: the scale too is rounded to it.
            info = ml_dtypes.finfo(kv_dt)
            divided = (queries / np.float32(np.asarray(p.q_scale, q_dt))).astype(q_dt).astype(np.float32)
            queries = np.clip(divided, float(info.min), float(info.max)).astype(kv_dt).astype(np.float32) * p.q_scale
        k = (k * (p.k_scale or 1.0)).astype(q_dt)
        v = (v * (p.v_scale or 1.0)).astype(q_dt)
        visible = yardstick.visibility(q_pos, kv_pos, causal=True, window=p.sliding_window,
                                       q_segment_ids=seq_of_token[None], kv_segment_ids=seq_of_key[None])
        out = yardstick.attention(queries.astype(q_dt).transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                  v.transpose(1, 0, 2)[None], scale=p.sm_scale, visible=visible, soft_cap=p.soft_cap,
                                  masked_rows="zero")
        return {"out": np.asarray(out)[0].transpose(1, 0, 2).astype(q_dt)}

    def error_map_layout(self, case, direction):
        if direction == "kv_cache":
            return ErrorMapLayout(self.index_names(direction), 0, 1, (), ())
        p = case.params
        ends = tuple(int(e) for e in np.cumsum([q for q, _ in p.seqs]))
        return ErrorMapLayout(self.index_names(direction), 0, 1, (("sequence end", ends),),
                              (every("kv head", p.num_q_heads // p.num_kv_heads, p.num_q_heads),))

    def invalid_calls(self, impl):
        return invalid_v3_calls(impl)


SPEC = RaggedV3Spec()
