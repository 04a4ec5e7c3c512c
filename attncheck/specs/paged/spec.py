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

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8, QuantizedTensor

from attncheck import backends, bugclasses, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case, Params
from attncheck.compiled import compiled, impl_key
from attncheck.expectations import BUG_CLASS, Contract, Shipped
from attncheck.specs.base import (FLOAT32_ACCUMULATION, MASK_VALUE_UNDERFLOWS, SOFT_CAP_IS_POSITIVE, InvalidCall,
                                  KernelSpec, accepted_keywords, values_by_dtype)

FAMILY = "paged_attention"
# (batch, q_heads, kv_heads, head_dim, page_size, pages_per_sequence): head_dim a multiple
# of 128 (the kernel's m/l outputs reuse q's block, which must be lane-shaped to lower).
SHAPES = (
    (2, 8, 4, 128, 16, 4),  # 2 query heads per kv head: q launched as float32 [G, 1, D] blocks
    (4, 16, 2, 128, 8, 4),  # 8 per kv head: q keeps its dtype (and bf16 the running output)
    (2, 4, 1, 256, 16, 2),  # one kv head (MQA)
)
# (q dtype, page dtype): int8 pages are QuantizedTensors.
DTYPE_PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"),
               ("bfloat16", "float32"), ("float32", "int8"), ("bfloat16", "int8"))
SPARE_PAGES = 3  # pages in the pool no sequence owns: NaN
# An explicit mask value, large enough that masked logits underflow like the default's.
MASK_VALUE = -1e30
SOFT_CAP = 10.0  # below the logits' spread (q.k has std sqrt(D) >= 11): it saturates
SOFT_CAPS = (None, SOFT_CAP, 0.7, 1.0)  # and the cap's other cells: below 1, 1
# What the slots past a length inside a read compute block hold: finite, so the additive
# mask can hide them, and large, so that one leaking in is far off.
TAIL_GARBAGE = 100.0
MEGACORE_CORES = 2


@dataclasses.dataclass(frozen=True)
class PagedParams(Params):
    dtype: str  # q and the output
    page_dtype: str  # "float32", "bfloat16", or "int8" (QuantizedTensor)
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    pages_per_sequence: int
    pages_per_compute_block: int
    lengths: tuple[int, ...]
    megacore_mode: str | None
    inline_seq_dim: bool
    soft_cap: float | None
    values: str  # "normal" or "large"
    mask_value: float | None = None  # None: the kernel's default

    @property
    def sequence_length(self) -> int:
        return max(self.lengths)

    @property
    def simulated_cores(self) -> int | None:
        return MEGACORE_CORES if self.megacore_mode else None

    @property
    def capacity(self) -> int:
        return self.page_size * self.pages_per_sequence

    @property
    def block_tokens(self) -> int:
        return self.page_size * self.pages_per_compute_block

    @property
    def groups(self) -> int:
        return self.q_heads // self.kv_heads

    def read_tokens(self, length: int) -> int:
        """Tokens of the compute blocks the kernel loads for a sequence of this length."""
        return -(-length // self.block_tokens) * self.block_tokens


@st.composite
def paged_cases(draw) -> Case[PagedParams]:
    batch, q_heads, kv_heads, head_dim, page_size, pages = draw(st.sampled_from(SHAPES))
    capacity = page_size * pages
    length = st.one_of(st.integers(0, capacity), st.sampled_from((1, capacity)))
    megacore = [None] + ["kv_head"] * (kv_heads % 2 == 0) + ["batch"] * (batch % 2 == 0)
    dtype, page_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    inline = draw(st.booleans())
    lengths = st.lists(length, min_size=batch, max_size=batch)
    # Not inline, an empty sequence's row is judged apart (its deviation): some sequence must have work.
    lengths = lengths if inline else lengths.filter(any)
    return Case(FAMILY, PagedParams(
        dtype=dtype, page_dtype=page_dtype, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
        head_dim=head_dim, page_size=page_size, pages_per_sequence=pages,
        pages_per_compute_block=draw(st.sampled_from(S.divisors(pages, 1))),
        lengths=tuple(draw(lengths)), megacore_mode=draw(st.sampled_from(megacore)), inline_seq_dim=inline,
        soft_cap=draw(st.sampled_from(SOFT_CAPS)), values=draw(st.sampled_from(S.NORMAL_AND_LARGE)),
        mask_value=draw(st.sampled_from((None, MASK_VALUE)))),
        draw(S.seeds))


def _with_several_keys(predicate):
    """What changes the logits (soft cap, dequantised k, rounding of q) shows only where a
    softmax spans several keys: over one key the output is that key's v whatever its logit."""
    return lambda p: any(n >= 2 for n in p.lengths) and predicate(p)


def _megacore_batch_steps(p: PagedParams) -> bool:
    """Megacore over the batch with a second step per core, every sequence of its own length."""
    return (p.megacore_mode == "batch" and p.batch > MEGACORE_CORES and all(p.lengths)
            and len(set(p.lengths)) == len(p.lengths))


def zero_lengths_between_others(p: PagedParams) -> bool:
    """Two or more empty sequences between ones with work: the prefetch of the next block
    must skip the first and then loop over the rest (a wrong skip loads the pages of a
    sequence nobody reads, and the next one computes with them)."""
    return any(n and not any(p.lengths[b + 1:b + 3]) and any(p.lengths[b + 3:]) for b, n in enumerate(p.lengths))


# Crossed pairwise: how many pages a compute block reads, where the lengths end in them, and
# how megacore splits the work: the page walk, the length mask and the core's share meet.
PAIRS = bugclasses.pairwise(
    bugclasses.partition("compute_block", one_page=lambda p: p.pages_per_compute_block == 1,
                         several_pages=lambda p: p.pages_per_compute_block > 1),
    bugclasses.partition("lengths_end", in_first_block=lambda p: any(0 < n < p.block_tokens for n in p.lengths),
                         in_a_later_block=lambda p: any(n > p.block_tokens and n % p.block_tokens for n in p.lengths),
                         on_a_block_edge=lambda p: any(n and n % p.block_tokens == 0 for n in p.lengths)),
    bugclasses.partition("megacore", off=lambda p: p.megacore_mode is None,
                         kv_head=lambda p: p.megacore_mode == "kv_head", batch=lambda p: p.megacore_mode == "batch"))


class PagedSpec(KernelSpec[PagedParams]):
    name = FAMILY
    params_type = PagedParams
    directions = {"out": ("batch", "q_head", "dim")}
    default_impls = {"jax": "jax.experimental.pallas.ops.tpu.paged_attention.paged_attention_kernel:paged_attention"}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    bug_classes = bugclasses.bug_classes(
        # Slots past the length inside a page it reads: masked by position, not by page.
        length_not_page_multiple=lambda p: any(n % p.page_size for n in p.lengths),
        # A whole page of garbage inside the last compute block a sequence reads.
        page_past_length_in_last_block=lambda p: any(p.read_tokens(n) - n >= p.page_size for n in p.lengths),
        # Page-table entries past the read blocks point at NaN pages: reading too far shows.
        unread_pages_in_table=lambda p: any(p.read_tokens(n) < p.capacity for n in p.lengths),
        full_page_table=lambda p: p.capacity in p.lengths,
        zero_length_checked=lambda p: p.inline_seq_dim and 0 in p.lengths,
        zero_length_not_inline=bugclasses.Touching(lambda p: not p.inline_seq_dim and 0 in p.lengths,
                                                 lambda case, inputs: {"out": (np.asarray(case.params.lengths) == 0)
                                                                       [:, None, None]}),
        zero_lengths_between_others=zero_lengths_between_others,
        # The online softmax rescales across compute blocks only where a later block raises
        # the running max (one row per query head).
        softmax_spans_blocks=lambda p: bugclasses.expected_max_rises(
            [(0, n) for n in p.lengths], p.block_tokens) * p.q_heads >= 3,
        groups_below_8=lambda p: 1 < p.groups < 8,
        groups_multiple_of_8=lambda p: p.groups % 8 == 0,
        mqa=lambda p: p.kv_heads == 1,
        # Each core must take its own kv heads in every step, not only the first; the
        # prefetch after a core's last kv head of one sequence must go to the next sequence,
        # so two sequences with work.
        megacore_kv_head=lambda p: (p.megacore_mode == "kv_head" and p.kv_heads > MEGACORE_CORES
                                    and sum(map(bool, p.lengths)) >= 2),
        # Each core must take its own sequences in every step (so a second step per core),
        # and a wrong one shows where they all differ. The inline kernel indexes lengths
        # with its own arithmetic.
        megacore_batch_inline=lambda p: _megacore_batch_steps(p) and p.inline_seq_dim,
        megacore_batch_grid=lambda p: _megacore_batch_steps(p) and not p.inline_seq_dim,
        seq_dim_not_inline=lambda p: not p.inline_seq_dim,
        # A length that ends inside a compute block after the first, several pages per block:
        # the mask and the page walk meet inside a later block.
        length_ends_in_later_compute_block=lambda p: p.pages_per_compute_block > 1 and any(
            n > p.block_tokens and n % p.block_tokens for n in p.lengths),
        # The mask value only matters where a read block holds slots past a length.
        explicit_mask_value=_with_several_keys(lambda p: p.mask_value is not None
                                               and any(p.read_tokens(n) > n for n in p.lengths)),
        int8_pages=_with_several_keys(lambda p: p.page_dtype == "int8"),
        mixed_dtypes=_with_several_keys(lambda p: p.page_dtype != p.dtype),
        soft_cap=_with_several_keys(lambda p: p.soft_cap is not None),
        large_logits=_with_several_keys(lambda p: p.values == "large"),
        # With a multiple of 8 query heads per kv head and a bf16 q the running output is kept in bf16
        # between compute blocks.
        bf16_running_output=lambda p: (p.dtype == "bfloat16" and p.groups % 8 == 0
                                       and any(n > p.block_tokens for n in p.lengths)),
    ) + (bugclasses.numbers("soft_cap", lambda p: p.soft_cap, ("in (0, 1)", "one", "above 1")).classes + PAIRS
         + values_by_dtype(S.NORMAL_AND_LARGE)
         + bugclasses.presences(attn_logits_soft_cap=lambda p: p.soft_cap is not None))
    examples = {"interpret": 8, "interpret-hazards": 3, "tpu-lower": 4, "tpu": 24}
    fixed_parameters = {
        "*_pages.weight.dtype": "quantized pages are jax's paged_attention.quantization_utils format: int8",
        "*_pages.scales.dtype": "quantization_utils' scales are float32",
        "*_pages.scales.shape[3]": "quantization_utils' scales are per token: width 1",
        "lengths.dtype": "the kernel's scalar-prefetch operands are int32",
        "page_indices.dtype": "the kernel's scalar-prefetch operands are int32",
        **parameters.outside_convention("attn_logits_soft_cap", ("negative", "zero"), SOFT_CAP_IS_POSITIVE),
        **parameters.outside_convention("mask_value", ("*",), MASK_VALUE_UNDERFLOWS)}
    contracts = (FLOAT32_ACCUMULATION,
        Contract("bfloat16_pages", "float pages are computed with as bfloat16 (the kernel loads every page so): the "
                 "oracle and the yardstick get the pages rounded to bfloat16, the tolerance is not widened"),
        Contract("additive_mask", "the mask is additive: slots past a length inside the last compute block read must "
                 "hold finite values (NaN there poisons the row); pages no read block touches hold NaN"),
        Contract("megacore_cores", "megacore modes run on 2 simulated cores (on one the kernel hangs on kv_head)"))
    expectations = (
        Shipped("jax", BUG_CLASS, "zero_length_not_inline", "with inline_seq_dim=False the output row of a length-0 "
                "sequence is never written (NaN, or the previous sequence's output): the 2024 fix that initialises "
                "the outputs covers only the inline path (attncheck finding paged_inline_false_empty_sequence)"),)

    def cases(self):
        return paged_cases()

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
        # Lengths, page tables and values are data: one program per static configuration.
        static = dataclasses.replace(case.params, lengths=(), values="")
        fn = compiled((FAMILY, impl_key(impl), static), lambda: self._call(impl, case.params))
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
        which moved the worst output of a "large" case by 1e-5 against NumPy's division."""
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


def invalid_paged_calls(impl) -> list[InvalidCall]:
    batch, q_heads, kv_heads, head_dim, page_size, pages = 2, 4, 2, 128, 16, 4
    pool = np.zeros((kv_heads, batch * pages, page_size, head_dim), np.float32)
    good = dict(q=np.zeros((batch, q_heads, head_dim), np.float32), k_pages=pool, v_pages=pool,
                lengths=np.array([17, 64], np.int32),
                page_indices=np.arange(batch * pages, dtype=np.int32).reshape(batch, pages))
    bad = {
        "kv_pages_shapes_differ": (dict(v_pages=pool[:, :-1]), r"k_pages and v_pages"),
        "q_heads_not_multiple": (dict(q=np.zeros((batch, 3, head_dim), np.float32)), r"(?i)Q heads"),
        "head_dim_mismatch": (dict(q=np.zeros((batch, q_heads, 64), np.float32)), r"head_dim"),
        "block_not_dividing_pages": (dict(pages_per_compute_block=3), r"pages_per_compute_block"),
        "lengths_batch": (dict(lengths=np.array([4, 4, 4], np.int32)), r"lengths"),
        "page_indices_batch": (dict(page_indices=good["page_indices"][:1]), r"page_indices"),
        "lengths_not_int32": (dict(lengths=np.array([4.0, 4.0], np.float32)), r"lengths"),
        "megacore_kv_head_odd_heads": (dict(k_pages=pool[:1], v_pages=pool[:1], megacore_mode="kv_head",
                                            q=np.zeros((batch, 1, head_dim), np.float32)),
                                       r"(?i)KV heads.*megacore_mode"),
        "megacore_batch_odd_batch": (dict(q=good["q"][:1], lengths=good["lengths"][:1],
                                          page_indices=good["page_indices"][:1], megacore_mode="batch"),
                                     r"(?i)batch.*megacore_mode"),
        "megacore_mode_unknown": (dict(megacore_mode="cores"), r"megacore_mode"),
    }
    return [InvalidCall(kind, lambda change=change: impl(**{**good, "pages_per_compute_block": 2, **change}),
                        ValueError, match) for kind, (change, match) in bad.items()]


SPEC = PagedSpec()
