"""The ring families' specs: the three variants' KernelSpecs (the inputs, the oracle and
yardstick mapping, the kernel call) and SPECS."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from attncheck import backends, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.compiled import compiled, impl_key, with_vjp
from attncheck.layouts import ErrorMapLayout, every
from attncheck.specs.base import ATTENTION_AXES, BIAS_AXES, KernelSpec
from attncheck.specs.ring.classes import (BLOCKWISE_CLASSES, FLASH_CLASSES, RING_CLASSES, RING_CONTRACTS,
                                          STANDARD_CLASSES)
from attncheck.specs.ring.draws import ring_cases, ring_data
from attncheck.specs.ring.invalid import ring_invalid_calls, standard_invalid_calls
from attncheck.specs.ring.params import (ABSENT_SEGMENT, AXIS_NAME, KEY_PADDING_BIAS, ChunkedRingParams,
                                         FlashRingParams, MaskedRingParams, RingParams)


class RingSpec(KernelSpec[RingParams]):
    """One ring variant; subclasses say how to call it."""

    params_type = RingParams
    directions = {**ATTENTION_AXES, "dbias": BIAS_AXES}
    bug_classes = RING_CLASSES
    head_dims = S.Shapes(ci=(32, 64), nightly=(16, 32, 64, 128))
    per_device_lens = S.Shapes(ci=(16, 32), nightly=(8, 16, 32, 64))
    max_tokens = 256
    fixed_parameters = {"dropout_rng.dtype": "the key type of jax.random.key, the convention's rng"}
    contracts = RING_CONTRACTS

    def cases(self):
        return ring_cases(self.name, self.per_device_lens, self.head_dims, self.params_type, self.max_tokens)

    def program(self, params):
        # Not the values or the segment layout (packed and absent segments differ only in
        # their ids); the seed is traced.
        return dataclasses.replace(params, values="", segment_starts=(),
                                   segments="none" if params.segments == "none" else "given")

    def other_data(self, params):
        return ring_data(params)

    def inputs(self, case):
        p = case.params
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(p.dtype)
        b, s, h, d = p.batch, p.seq_len, p.heads, p.head_dim
        # Values are drawn head-major ([B, H, S, D], as the helpers tie keys along S) and
        # handed to the kernel as [B, S, H, D].
        out = {name: S.round_to(S.attention_values(rng, p.values, (b, h, s, d), role=name), dt)
               .transpose(0, 2, 1, 3) for name in ("q", "k", "v", "d_out")}
        if p.bias in ("full", "neg_inf_rows"):
            bias = rng.standard_normal((1, h, s, s))
            if p.bias == "neg_inf_rows":
                rows = rng.random(s) < 0.2
                rows[0] |= not rows.any()  # the class's row, whatever the seed
                bias[..., rows, :] = -np.inf
            out["bias"] = S.round_to(bias, dt)
        elif p.bias in ("key_padding", "batch_keys"):
            padded = rng.random((b if p.bias == "batch_keys" else 1, s)) < 0.25
            out["bias"] = S.round_to(np.where(padded, KEY_PADDING_BIAS, 0.0)[:, None, None, :], dt)
        if p.segments != "none":
            ids = S.segment_ids_from_layout(p.segment_starts, s)
            q_ids = ids.copy()
            if p.segments == "absent":
                q_ids[ids == ids.max()] = ABSENT_SEGMENT
            out["q_segment_ids"] = np.broadcast_to(q_ids, (b, s)).astype(p.segment_dtype)
            out["kv_segment_ids"] = np.broadcast_to(ids, (b, s)).astype(p.segment_dtype)
        return out

    # ------------------------------------------------------------------ running
    # Inputs the kernel takes besides the differentiated q, k, v and bias.
    EXTRAS = ("q_segment_ids", "kv_segment_ids")

    def evaluate(self, impl, case, inputs):
        p = case.params
        names = ("q", "k", "v") + (("bias",) if "bias" in inputs else ())
        call = self.call(impl, p)
        fn = compiled(("ring", impl_key(impl), self.program(p)),
                      lambda: with_vjp(lambda *a: call(*a[:-2], extras=a[-2], seed=a[-1])))
        extras = {n: inputs[n] for n in self.EXTRAS if n in inputs}
        out, grads = fn(tuple(inputs[n] for n in names), inputs["d_out"], extras, np.uint32(case.seed))
        results = dict(zip(self.directions, (out, *grads)))
        # Back to head-major [B, H, S, D] for comparison with the oracle.
        return {k: np.asarray(v).transpose(0, 2, 1, 3) if k != "dbias" else np.asarray(v) for k, v in results.items()}

    def call(self, impl, p: RingParams):
        """f(q, k, v[, bias], *, extras, seed) calling the implementation."""
        raise NotImplementedError

    # ------------------------------------------------------------------ judging
    def _semantics(self, p: RingParams, inputs):
        # A key whose bias is -inf takes no part: a row of them sees nothing (zero).
        explicit = [inputs[n] for n in ("attn_mask",) if n in inputs]
        if "bias" in inputs:
            explicit.append(np.asarray(inputs["bias"], np.float64) != -np.inf)
        visible = None
        for mask in explicit:
            full = np.broadcast_to(mask, (p.batch, p.heads, p.seq_len, p.seq_len))
            visible = full if visible is None else visible & full
        sem = dict(scale=p.scale, causal=p.causal, bias=inputs.get("bias"), visible=visible,
                   q_segment_ids=inputs.get("q_segment_ids"), kv_segment_ids=inputs.get("kv_segment_ids"),
                   masked_rows="zero")
        if "dropout_keep" in inputs:
            sem["dropout_multiplier"] = inputs["dropout_keep"] / (1.0 - p.dropout_rate)
        return sem

    @staticmethod
    def _head_major(inputs):
        return [inputs[n].transpose(0, 2, 1, 3) for n in ("q", "k", "v", "d_out")]

    def oracle(self, case, inputs):
        q, k, v, d_out = self._head_major(inputs)
        sem = self._semantics(case.params, inputs)
        result = {"out": oracle.attention(q, k, v, **sem).out}
        grads = oracle.attention_vjp(q, k, v, d_out, **sem)
        result.update({d: grads[d] for d in ("dq", "dk", "dv")})
        if "bias" in inputs:
            result["dbias"] = grads["dbias"]
        return result

    def yardstick(self, case, inputs):
        p = case.params
        q, k, v, d_out = self._head_major(inputs)
        sem = self._semantics(p, inputs)
        visible = yardstick.visibility(np.arange(p.seq_len), np.arange(p.seq_len), causal=p.causal,
                                       q_segment_ids=sem["q_segment_ids"], kv_segment_ids=sem["kv_segment_ids"])
        if sem["visible"] is not None:
            visible = visible & sem["visible"]
        return yardstick.attention_with_grads(q, k, v, d_out, scale=sem["scale"], bias=sem["bias"],
                                              visible=visible, masked_rows="zero", seq_major=True,
                                              dropout_multiplier=sem.get("dropout_multiplier"))

    def error_map_layout(self, case, direction):
        # The global sequence cut into each device's shard, and (blockwise ring) the chunks
        # inside a shard: a wrong ring offset shows as a shard-wide pattern.
        p = case.params

        def bounds(chunk: str):
            return (every("device shard", p.per_device, p.seq_len),
                    every(chunk, getattr(p, chunk, None), p.seq_len))

        if direction == "dbias":
            return ErrorMapLayout(BIAS_AXES, 2, 3, bounds("query_chunk_size"), bounds("key_chunk_size"))
        rows = bounds("query_chunk_size" if direction in ("out", "dq") else "key_chunk_size")
        return ErrorMapLayout(ATTENTION_AXES[direction], 2, 3, rows)

    def invalid_calls(self, impl):
        return ring_invalid_calls(impl, flash=isinstance(self, RingFlashSpec))


def _long_reduction_example(family: str, values: str) -> Case[ChunkedRingParams]:
    """A blockwise ring's row over 2048 keys in 64 key chunks, in bfloat16 compute."""
    return Case(family, ChunkedRingParams(
        dtype="bfloat16", devices=2, seq_len=2 * S.LONG_REDUCTION, per_device=S.LONG_REDUCTION, heads=1,
        head_dim=64, causal=False, bias="none", segments="none", segment_starts=(), float32_logits=False,
        values=values, check_vma=False, query_chunk_size=128, key_chunk_size=32), 0)


class BlockwiseRingSpec(RingSpec):
    """Dropout: the keep mask is the convention's ``attention_dropout_mask`` (a function of
    the rng and global indices only); the oracle applies it as inverted dropout, and
    tests/gate/test_dropout_mask.py judges the mask itself statistically."""

    name = "ring_attention"
    default_impls = {"builtin": "attncheck_kernels.ring_attention:ring_attention_sharded"}
    keyword_targets = ("attncheck_kernels.ring_attention:ring_attention",)
    backends = ("xla",)
    params_type = ChunkedRingParams
    examples = {"xla": 48}
    # A rare draw: a one-token first segment, so one query sees one key and the others none;
    # dq and dk are 0 in truth, a kernel's a rounding of dP - rowsum(dO * O).
    explicit_examples = {"only_one_key_rows": Case(name, ChunkedRingParams(
        dtype="float32", devices=2, seq_len=16, per_device=8, heads=1, head_dim=32, causal=False, bias="none",
        segments="absent", segment_starts=(0, 1), float32_logits=False, values="normal", check_vma=False,
        query_chunk_size=8, key_chunk_size=8), 0),
        # Every condition of the classes at once is too rare a draw for the search, and long
        # devices among the draws would take a large share of the CI gate's time. A ring of 2
        # (one ring of 8 is the ring_of_8 class's) reduces over 2048 keys in 64 key chunks; the
        # sink's rows, device 0's, step through 63 of them after it.
        "long_reduction_offset_values": _long_reduction_example(name, "offset"),
        "long_reduction_sink": _long_reduction_example(name, S.SINK)}
    bug_classes = BLOCKWISE_CLASSES
    fixed_parameters = {**RingSpec.fixed_parameters, **parameters.outside_convention(
        "attn_pdrop", ("negative", "one", "above 1"),
        "a dropout rate is a probability below 1 (at 1 the keep scale 1 / (1 - rate) divides by zero)")}

    def inputs(self, case):
        p = case.params
        out = super().inputs(case)
        if p.dropout_rate:
            keep = _dropout_mask_fn()(jax.random.key(np.uint32(case.seed)), p.dropout_rate, p.batch, p.heads,
                                      p.seq_len, p.seq_len)
            out["dropout_keep"] = np.asarray(keep, dtype=np.float64)
        return out

    def call(self, impl, p: ChunkedRingParams):
        def f(q, k, v, bias=None, *, extras, seed=None):
            dropout = (dict(dropout_rng=jax.random.key(seed), attn_pdrop=p.dropout_rate, deterministic=False)
                       if p.dropout_rate else {})
            return impl(q, k, v, bias, _segment_ids(extras, p), causal=p.causal, float32_logits=p.float32_logits,
                        query_chunk_size=p.query_chunk_size, key_chunk_size=p.key_chunk_size,
                        **_placement(p), **_scale_and_precision(p), **dropout)
        return f


class StandardRingSpec(RingSpec):
    name = "ring_attention_standard"
    default_impls = {"builtin": "attncheck_kernels.ring_attention:ring_attention_standard_sharded"}
    keyword_targets = ("attncheck_kernels.ring_attention:ring_attention_standard",)
    backends = ("xla",)
    params_type = MaskedRingParams
    examples = {"xla": 52}
    EXTRAS = RingSpec.EXTRAS + ("attn_mask",)
    fixed_parameters = {**RingSpec.fixed_parameters,
                        "attn_mask.dtype": "the convention's mask is boolean (an invalid call pins the rejection)"}
    bug_classes = STANDARD_CLASSES
    # A draw of the class shows a backward's rounded-O di only on some data (few seeds of
    # this configuration do): this is one of them.
    explicit_examples = {"bf16_large_logits": Case(name, MaskedRingParams(
        dtype="bfloat16", devices=1, seq_len=8, per_device=8, heads=1, head_dim=32, causal=False, bias="none",
        segments="packed", segment_starts=(0, 6), float32_logits=False, values="large", batch=2, sm_scale=0.3,
        random_mask=True), 15)}

    def cases(self):
        return super().cases().map(lambda c: Case(c.family, dataclasses.replace(c.params, bias="none"), c.seed))

    def inputs(self, case):
        p = case.params
        out = super().inputs(case)
        if p.random_mask:
            rng = np.random.default_rng(case.seed + 1)
            mask = rng.random((p.batch, p.heads, p.seq_len, p.seq_len)) < 0.7
            mask[..., rng.random(p.seq_len) < 0.2, :] = False  # rows that see no key
            out["attn_mask"] = mask & _rules_mask(p, out)
        return out

    def call(self, impl, p: MaskedRingParams):
        # The mask carries causal and segments.
        def f(q, k, v, bias=None, *, extras, seed=None):
            mask = extras["attn_mask"] if "attn_mask" in extras else _rules_mask(p, extras, jnp)
            return impl(q, k, v, mask, float32_logits=p.float32_logits, **_placement(p), **_scale_and_precision(p))
        return f

    def invalid_calls(self, impl):
        return standard_invalid_calls(impl)


class RingFlashSpec(RingSpec):
    name = "ring_flash_attention"
    default_impls = {"builtin": "attncheck_kernels.ring_attention:ring_flash_attention_tpu_sharded"}
    keyword_targets = ("attncheck_kernels.ring_attention:ring_flash_attention_tpu",)
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    params_type = FlashRingParams
    # >= 128 tokens per device (128-lane blocks); 256 makes each step multi-block.
    head_dims = S.Shapes(ci=(128, 64), nightly=(64, 128, 256))
    per_device_lens = S.Shapes(ci=(128, 256), nightly=(128, 256, 384, 512))
    max_tokens = 1024
    examples = {"interpret": 6, "interpret-hazards": 2, "tpu-lower": 2, "tpu": 6}
    bug_classes = FLASH_CLASSES

    def call(self, impl, p: FlashRingParams):
        given = p.flash_blocks.given()
        blocks = {"block_sizes": _block_sizes_type(impl)(**given)} if given else {}
        vmem = {"vmem_limit_bytes": p.vmem_limit_bytes} if p.vmem_limit_bytes else {}

        def f(q, k, v, bias=None, *, extras, seed=None):
            return impl(q, k, v, bias, _segment_ids(extras, p), causal=p.causal, float32_logits=p.float32_logits,
                        **_placement(p), **_scale_and_precision(p, precision=False), **blocks, **vmem)
        return f

    def lower(self, impl, case):
        inputs = self.inputs(case)
        call = self.call(impl, case.params)
        extras = {n: inputs[n] for n in self.EXTRAS if n in inputs}
        primals = [inputs[n] for n in ("q", "k", "v", "bias") if n in inputs]
        # The kernel runs its own shard_map over the CPU devices: no abstract TPU mesh around it.
        return backends.tpu_exports(lambda *p: call(*p, extras=extras), primals, inputs["d_out"],
                                    device_kind=None)


def _placement(p: RingParams) -> dict:
    """How the call names its devices: by count, by count and axis name, or by a mesh."""
    if p.placement == "mesh":
        return dict(mesh=Mesh(np.array(jax.devices()[:p.devices]), (AXIS_NAME,)), axis_name=AXIS_NAME,
                    check_vma=p.check_vma)
    named = {"axis_name": AXIS_NAME} if p.placement == "named_axis" else {}
    return dict(num_devices=p.devices, check_vma=p.check_vma, **named)


def _scale_and_precision(p: RingParams, precision: bool = True) -> dict:
    """sm_scale when the case gives one (else the kernel's default), and precision=HIGHEST
    where the variant takes a precision."""
    options = {} if p.sm_scale is None else {"sm_scale": p.sm_scale}
    if precision and p.highest_precision:
        options["precision"] = jax.lax.Precision.HIGHEST
    return options


def _segment_ids(extras, p: RingParams):
    """The convention's segment ids: a (q, kv) pair, or one array when both are the same."""
    if "q_segment_ids" not in extras:
        return None
    if p.single_segment_ids:
        return extras["kv_segment_ids"]
    return SegmentPair(extras["q_segment_ids"], extras["kv_segment_ids"])


def _rules_mask(p: RingParams, inputs, xp=np):
    """[B|1, 1, S, S] bool: causal and segment equality, as the standard ring's mask."""
    mask = xp.ones((p.seq_len, p.seq_len), bool)
    if p.causal:
        mask = xp.tril(mask)
    mask = mask[None, None]
    if "q_segment_ids" in inputs:
        mask = mask & (inputs["q_segment_ids"][:, None, :, None] == inputs["kv_segment_ids"][:, None, None, :])
    return mask


def _block_sizes_type(impl):
    """The flash kernel's BlockSizes the ring flash convention takes: the implementation's
    module's own, or that of the flash module it is built on."""
    module = sys.modules[impl.__module__]
    found = getattr(module, "BlockSizes", None) or next(
        (m.BlockSizes for m in vars(module).values() if inspect.ismodule(m) and hasattr(m, "BlockSizes")), None)
    if found is None:
        raise TypeError(f"{impl.__module__} exposes no flash BlockSizes for the ring flash kernel's block_sizes")
    return found


def _dropout_mask_fn():
    from attncheck_kernels.ring_attention import attention_dropout_mask

    return attention_dropout_mask


class SegmentPair(NamedTuple):
    """(q, kv) segment ids: the convention accepts any pair with these attributes."""

    q: jax.Array
    kv: jax.Array


SPECS = [BlockwiseRingSpec(), StandardRingSpec(), RingFlashSpec()]
