"""paged_attention's KernelSpec: its inputs (the page pool and its table), the call of an
implementation and its mapping onto the dense oracle and the yardstick."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8, QuantizedTensor

from attncheck import backends, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.compiled import compiled, impl_key
from attncheck.specs.base import MASK_VALUE_UNDERFLOWS, SOFT_CAP_IS_POSITIVE, KernelSpec, accepted_keywords
from attncheck.specs.paged.classes import BUG_CLASSES, CONTRACTS, EXPECTATIONS
from attncheck.specs.paged.draws import paged_cases, paged_data
from attncheck.specs.paged.invalid import invalid_paged_calls
from attncheck.specs.paged.params import FAMILY, PagedParams

SPARE_PAGES = 3  # pages in the pool no sequence owns: NaN
# What the slots past a length inside a read compute block hold: finite, so the additive
# mask can hide them, and large, so that one leaking in is far off.
TAIL_GARBAGE = 100.0


class PagedSpec(KernelSpec[PagedParams]):
    name = FAMILY
    params_type = PagedParams
    directions = {"out": ("batch", "q_head", "dim")}
    default_impls = {"jax": "jax.experimental.pallas.ops.tpu.paged_attention.paged_attention_kernel:paged_attention"}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    bug_classes = BUG_CLASSES
    examples = {"interpret": 8, "interpret-hazards": 3, "tpu-lower": 4, "tpu": 24}
    fixed_parameters = {
        "*_pages.weight.dtype": "quantized pages are jax's paged_attention.quantization_utils format: int8",
        "*_pages.scales.dtype": "quantization_utils' scales are float32",
        "*_pages.scales.shape[3]": "quantization_utils' scales are per token: width 1",
        "lengths.dtype": "the kernel's scalar-prefetch operands are int32",
        "page_indices.dtype": "the kernel's scalar-prefetch operands are int32",
        **parameters.outside_convention("attn_logits_soft_cap", ("negative", "zero"), SOFT_CAP_IS_POSITIVE),
        **parameters.outside_convention("mask_value", ("*",), MASK_VALUE_UNDERFLOWS)}
    contracts = CONTRACTS
    expectations = EXPECTATIONS

    def cases(self):
        return paged_cases()

    def program(self, params):
        # Lengths, page tables and values are data.
        return dataclasses.replace(params, lengths=(), values="")

    def other_data(self, params):
        return paged_data(params)

    def inputs(self, case):
        p = case.params
        rng = np.random.default_rng(case.seed)
        spread = S.LARGE_LOGIT_STD if p.values == "large" else 1.0
        total = p.batch * p.pages_per_sequence + SPARE_PAGES
        page_indices = rng.permutation(total)[:p.batch * p.pages_per_sequence].reshape(p.batch, -1)
        # Every slot of the pool: what it holds depends on whether the kernel reads it.
        slot = np.full((total, p.page_size), "unread")
        for b, length in enumerate(p.lengths):
            t = np.arange(p.read_tokens(length))
            slot[page_indices[b, t // p.page_size], t % p.page_size] = np.where(t < length, "valid", "tail")
        shape = (p.kv_heads, total, p.page_size, p.head_dim)
        out = {"q": S.round_to(rng.standard_normal((p.batch, p.q_heads, p.head_dim)) * spread, S.dtype_of(p.dtype)),
               "lengths": np.array(p.lengths, np.int32), "page_indices": page_indices.astype(np.int32)}
        for name, magnitude in (("k", spread), ("v", 1.0)):
            if p.page_dtype == "int8":
                scales = rng.uniform(0.5, 2.0, shape[:-1] + (1,)) * magnitude
                scales[:, slot == "tail"] *= TAIL_GARBAGE
                scales[:, slot == "unread"] = np.nan
                out[f"{name}_pages"] = rng.integers(-127, 128, shape).astype(np.int8)
                out[f"{name}_scales"] = scales.astype(np.float32)
            else:
                values = rng.standard_normal(shape) * magnitude
                values[:, slot == "tail"] *= TAIL_GARBAGE
                values[:, slot == "unread"] = np.nan
                out[f"{name}_pages"] = S.round_to(values, S.dtype_of(p.page_dtype))
        return out

    # ------------------------------------------------------------------ running
    @staticmethod
    def _call(impl, p: PagedParams):
        options = dict(attn_logits_soft_cap=p.soft_cap, pages_per_compute_block=p.pages_per_compute_block,
                       megacore_mode=p.megacore_mode, inline_seq_dim=p.inline_seq_dim,
                       **accepted_keywords(impl, mask_value=p.mask_value))

        def forward(q, k_pages, v_pages, k_scales, v_scales, lengths, page_indices):
            if k_scales is not None:
                k_pages, v_pages = QuantizedTensor(k_pages, k_scales), QuantizedTensor(v_pages, v_scales)
            return impl(q, k_pages, v_pages, lengths, page_indices, **options)

        return forward

    @staticmethod
    def _args(inputs):
        return tuple(inputs.get(n) for n in ("q", "k_pages", "v_pages", "k_scales", "v_scales", "lengths",
                                             "page_indices"))

    def evaluate(self, impl, case, inputs):
        fn = compiled((FAMILY, impl_key(impl), self.program(case.params)), lambda: self._call(impl, case.params))
        return {"out": np.asarray(fn(*self._args(inputs)))}

    def lower(self, impl, case):
        args = self._args(self.inputs(case))
        return {"lower-fwd": lambda: backends.export_for_tpu(self._call(impl, case.params), *args)}

    # ------------------------------------------------------------------ judging
    @staticmethod
    def _dense(p: PagedParams, inputs, dtype, dequantize=None):
        """k and v as the kernel computes with them, in ``dtype``, gathered through the page
        table to [B, Hkv, L, D] (0 past each length), and visible [B, 1, 1, L]. int8 pages
        are ``dequantize(weight, scales)`` (default: weight * scales / 127.5 in ``dtype``)."""
        t = np.arange(p.capacity)
        visible = t[None, :] < np.asarray(p.lengths)[:, None]
        dense = []
        for name in ("k", "v"):
            pages = inputs[f"{name}_pages"]
            if p.page_dtype == "int8":
                scales = inputs[f"{name}_scales"]
                pages = (dequantize(pages, scales) if dequantize is not None
                         else pages.astype(dtype) * scales.astype(dtype) / dtype(MAX_INT8))
            else:  # the declared contract: every float page is loaded as bfloat16
                pages = pages.astype(ml_dtypes.bfloat16).astype(dtype)
            gathered = pages[:, inputs["page_indices"][:, t // p.page_size], t % p.page_size].transpose(1, 0, 2, 3)
            dense.append(np.where(visible[:, None, :, None], gathered, np.zeros((), dtype)))
        return dense[0], dense[1], visible[:, None, None, :]

    def oracle(self, case, inputs):
        p = case.params
        k, v, visible = self._dense(p, inputs, np.float64)
        q = inputs["q"][:, :, None]  # one query per head: [B, Hq, 1, D]
        out = oracle.attention(q, k, v, scale=1.0, soft_cap=p.soft_cap, visible=visible, masked_rows="zero").out
        return {"out": out[:, :, 0]}

    def yardstick(self, case, inputs):
        """Naive attention in the kernel's grouped layout: the query heads of a kv head as its
        rows ([B, Hkv, G, D]); XLA's CPU dot per query head is luckier than the kernel's
        [G, D] x [D, L] and would flag correct results. It computes in the promotion of q's
        dtype and the pages' computed dtype (bfloat16 for float pages, as declared; float32
        for dequantised int8). int8 pages are dequantised by XLA, as a jax program writes it
        (``weight * scales / 127.5``): XLA multiplies by the rounded reciprocal of 127.5,
        which rounds otherwise than NumPy's division, enough to move a "large" case's worst
        output."""
        p = case.params
        q = inputs["q"]
        compute = np.promote_types(q.dtype, np.float32 if p.page_dtype == "int8" else ml_dtypes.bfloat16)
        k, v, visible = self._dense(p, inputs, compute.type, _dequantized_by_xla)
        grouped = q.reshape(p.batch, p.kv_heads, p.groups, p.head_dim)
        out = yardstick.attention(grouped, k, v, scale=1.0, soft_cap=p.soft_cap, visible=visible, masked_rows="zero")
        return {"out": out.reshape(q.shape)}

    def invalid_calls(self, impl):
        return invalid_paged_calls(impl)


@jax.jit
def _xla_dequantized(weight, scales):
    return weight.astype(jnp.float32) * scales / MAX_INT8


def _dequantized_by_xla(weight, scales) -> np.ndarray:
    return np.asarray(_xla_dequantized(weight, scales))


SPEC = PagedSpec()
