"""The ragged paged attention v2 family's KernelSpec: the oracle mapping, the inputs, the
yardstick and the kernel's call."""

from __future__ import annotations

import dataclasses

import numpy as np

from attncheck import backends, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.layouts import ErrorMapLayout, every
from attncheck.specs.base import MASK_VALUE_UNDERFLOWS, SOFT_CAP_IS_POSITIVE, KernelSpec, accepted_keywords
from attncheck.specs.ragged.classes import BUG_CLASSES, CONTRACTS
from attncheck.specs.ragged.draws import ragged_cases, ragged_data
from attncheck.specs.ragged.invalid import invalid_ragged_calls
from attncheck.specs.ragged.params import ARRAY_ARGS, FAMILY, KV_DTYPES, RaggedParams

KV_SCALE_IS_POSITIVE = "a quantization scale maps stored values back to real ones: a positive factor"


class RaggedSpec(KernelSpec[RaggedParams]):
    name = FAMILY
    fixed_parameters = {
        **{f"{name}.dtype": "the kernel requires int32 metadata (an invalid call pins the rejection)"
           for name in ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")},
        "num_seqs.shape[0]": "num_seqs is one int32 by the convention",
        **parameters.outside_convention("soft_cap", ("negative", "zero"), SOFT_CAP_IS_POSITIVE),
        **parameters.outside_convention("k_scale", ("negative", "zero"), KV_SCALE_IS_POSITIVE),
        **parameters.outside_convention("v_scale", ("negative", "zero"), KV_SCALE_IS_POSITIVE),
        **parameters.outside_convention("mask_value", ("*",), MASK_VALUE_UNDERFLOWS),
    }
    params_type = RaggedParams
    directions = {"out": ("token", "q_head", "dim")}
    default_impls = {"builtin": "attncheck_kernels.ragged_paged_attention:ragged_paged_attention"}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    bug_classes = BUG_CLASSES
    examples = {"interpret": 26, "interpret-hazards": 6, "tpu-lower": 4, "tpu": 36}
    # Every condition of the class at once is a rare draw. 16 query rows of 2 heads: 32
    # margins, a step of 0.65 logits across the sink's window.
    explicit_examples = {"long_reduction_sink": Case(FAMILY, RaggedParams(
        dtype="bfloat16", kv_dtype="bfloat16", page_size=16, num_q_heads=2, num_kv_heads=2,
        seqs=((16, S.MANY_KV_BLOCKS * 16),), sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
        sm_scale=128 ** -0.5, num_kv_pages_per_block=1, num_queries_per_block=None, padding="repeat_last",
        values=S.SINK, layout="long"), 0)}
    contracts = CONTRACTS

    def cases(self):
        return ragged_cases()

    def program(self, params):
        # The sequences and the metadata are arrays: the kernel's own jit compiles once per
        # layout and options.
        return dataclasses.replace(params, seqs=(), padding="", values="")

    def other_data(self, params):
        return ragged_data(params)

    def inputs(self, case):
        p = case.params
        rng = np.random.default_rng(case.seed)
        q_dt, kv_dt = S.dtype_of(p.dtype), KV_DTYPES[p.kv_dtype]
        seqs, page_size = p.seqs, p.page_size
        hq, hkv = p.num_q_heads, p.num_kv_heads
        num_seqs = len(seqs)
        shapes = p.shapes
        q_lens = np.array([q for q, _ in seqs] + [0] * (shapes.max_seqs - num_seqs))
        kv_lens = np.array([k for _, k in seqs] + [0] * (shapes.max_seqs - num_seqs), dtype=np.int32)
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        spread = S.LARGE_LOGIT_STD if p.values == "large" else 1.0
        queries = rng.standard_normal((shapes.max_tokens, hq, shapes.head_dim)) * spread
        if p.values == S.SINK:
            queries += S.sink_margins(shapes.max_tokens * hq).reshape(shapes.max_tokens, hq, 1)
        queries[cu[num_seqs]:] = np.nan  # padding tokens
        # Pages: a shuffled, non-contiguous allocation; everything unallocated is poison, and
        # an unused page-table slot names no page, so that a read of one stops the
        # interpreter on every draw, not only where a garbage index fell out of range.
        order = rng.permutation(shapes.total_pages)
        page_indices = rng.integers(shapes.total_pages, 3 * shapes.total_pages,
                                    size=(shapes.max_seqs, shapes.pages_per_seq)).astype(np.int32)
        kv = np.full((shapes.total_pages, page_size, 2 * hkv, shapes.head_dim), _poison(kv_dt), dtype=np.float64)
        used = 0
        for s, (_, kv_len) in enumerate(seqs):
            pages = -(-kv_len // page_size)
            page_indices[s, :pages] = order[used:used + pages]
            used += pages
            for page in range(pages):
                rows = min(page_size, kv_len - page * page_size)
                kv[order[used - pages + page], :rows] = rng.standard_normal((rows, 2 * hkv, shapes.head_dim))
        kv[:, :, 0::2] *= spread  # K only: large logits
        if p.values == S.SINK:
            for s, (_, kv_len) in enumerate(seqs):
                if kv_len:
                    kv[page_indices[s, 0], 0, 0::2] += S.sink_key(shapes.head_dim)
        if p.values == "offset":
            kv[:, :, 1::2] += S.V_OFFSET  # V only (poison stays poison)
        if kv_dt == np.int8:
            kv = np.where(np.isnan(kv), 127, np.clip(np.round(kv * 30), -127, 127))
        _pad_metadata(p.padding, rng, kv_lens, cu, num_seqs)
        return {"queries": S.round_to(queries, q_dt), "kv_pages": kv.astype(np.float32).astype(kv_dt),
                "kv_lens": kv_lens, "page_indices": page_indices, "cu_q_lens": cu,
                "num_seqs": np.array([num_seqs], dtype=np.int32)}

    @staticmethod
    def _options(p: RaggedParams):
        return dict(sm_scale=p.sm_scale, sliding_window=p.sliding_window, soft_cap=p.soft_cap,
                    k_scale=p.k_scale, v_scale=p.v_scale)

    def _call(self, impl, p: RaggedParams):
        knobs = accepted_keywords(impl, mask_value=p.mask_value, vmem_limit_bytes=p.vmem_limit_bytes)
        return lambda *args: impl(*args, **self._options(p), num_kv_pages_per_block=p.num_kv_pages_per_block,
                                  num_queries_per_block=p.num_queries_per_block, **knobs)

    def _args(self, inputs):
        return tuple(inputs[n] for n in ARRAY_ARGS)

    def evaluate(self, impl, case, inputs):
        # Called eagerly: the kernel validates concrete metadata, then runs its own jit.
        return {"out": np.asarray(self._call(impl, case.params)(*self._args(inputs)))}

    def lower(self, impl, case):
        args = self._args(self.inputs(case))
        return {"lower-fwd": lambda: backends.export_for_tpu(self._call(impl, case.params), *args)}

    def oracle(self, case, inputs):
        return {"out": oracle.ragged_paged_attention(*self._args(inputs), **self._options(case.params)).out}

    def yardstick(self, case, inputs):
        """Dense XLA attention over every sequence's gathered keys, in working precision."""
        p = case.params
        seqs, page_size, shapes = p.seqs, p.page_size, p.shapes
        capacity = page_size * shapes.pages_per_seq
        q_dt = S.dtype_of(p.dtype)
        kv = np.zeros((shapes.max_seqs * capacity,) + inputs["kv_pages"].shape[2:], dtype=np.float32)
        q_pos = np.full(shapes.max_tokens, -1)
        kv_pos = np.full(shapes.max_seqs * capacity, 1 << 30)
        seq_of_token = np.full(shapes.max_tokens, -1)
        seq_of_key = np.repeat(np.arange(shapes.max_seqs), capacity)
        cu = inputs["cu_q_lens"]
        for s, (q_len, kv_len) in enumerate(seqs):
            pages = inputs["page_indices"][s, : -(-kv_len // page_size)]
            gathered = inputs["kv_pages"][pages].reshape((-1,) + kv.shape[1:])[:kv_len]
            kv[s * capacity: s * capacity + kv_len] = gathered.astype(np.float32)
            kv_pos[s * capacity: s * capacity + kv_len] = np.arange(kv_len)
            q_pos[cu[s]: cu[s] + q_len] = kv_len - q_len + np.arange(q_len)
            seq_of_token[cu[s]: cu[s] + q_len] = s
        k, v = kv[:, 0::2], kv[:, 1::2]
        k_dt = _kv_compute_dtype(q_dt, inputs["kv_pages"].dtype, p.k_scale)
        v_dt = _kv_compute_dtype(q_dt, inputs["kv_pages"].dtype, p.v_scale)
        k = (k * (1.0 if p.k_scale is None else p.k_scale)).astype(k_dt)
        v = (v * (1.0 if p.v_scale is None else p.v_scale)).astype(v_dt)
        visible = yardstick.visibility(q_pos, kv_pos, causal=True, window=p.sliding_window,
                                      q_segment_ids=seq_of_token[None], kv_segment_ids=seq_of_key[None])
        queries = np.nan_to_num(inputs["queries"]).transpose(1, 0, 2)[None]
        out = yardstick.attention(queries, k.transpose(1, 0, 2)[None].astype(q_dt),
                                 v.transpose(1, 0, 2)[None], scale=p.sm_scale, visible=visible,
                                 soft_cap=p.soft_cap, masked_rows="zero")
        return {"out": np.asarray(out)[0].transpose(1, 0, 2).astype(q_dt)}

    def error_map_layout(self, case, direction):
        # Tokens x query heads: the q blocks of the grid, where each sequence's tokens end
        # (a softmax state carried over a sequence boundary shows below it), and which q
        # heads share a kv head (a GQA mix-up shows as a wrong group).
        p = case.params
        ends = tuple(int(e) for e in np.cumsum([q_len for q_len, _ in p.seqs]))
        return ErrorMapLayout(self.index_names(direction), 0, 1,
                              (every("q block", p.q_block_tokens, p.shapes.max_tokens), ("sequence end", ends)),
                              (every("kv head", p.num_q_heads // p.num_kv_heads, p.num_q_heads),))

    def invalid_calls(self, impl):
        return invalid_ragged_calls(impl)


def _poison(dtype) -> float:
    """What unread memory holds: NaN where the dtype has one, else its largest value."""
    dtype = np.dtype(dtype)
    if dtype == np.int8:
        return 127
    return np.nan


def _pad_metadata(padding: str, rng, kv_lens, cu, num_seqs) -> None:
    """Metadata past num_seqs is padding the kernel must not trust."""
    if padding == "minus_one":
        kv_lens[num_seqs:] = -1
        cu[num_seqs + 1:] = -1
    elif padding == "garbage":
        kv_lens[num_seqs:] = rng.integers(0, 10**6, size=len(kv_lens) - num_seqs)
        cu[num_seqs + 1:] = rng.integers(0, 10**6, size=len(kv_lens) - num_seqs)


def _kv_compute_dtype(q_dtype, kv_dtype, scale):
    """The dtype the kernel computes K or V in: the query dtype for scaled or packed caches,
    else the promotion of the two (the convention of the seed's reference)."""
    if scale is not None or np.dtype(kv_dtype) not in S.DTYPES.values():
        return np.dtype(q_dtype)
    return np.promote_types(q_dtype, kv_dtype)


SPEC = RaggedSpec()
