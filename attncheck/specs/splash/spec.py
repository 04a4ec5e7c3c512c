"""The splash_attention spec: jax's splash kernel factory called on a case's masks and
blocks (sharded as its callers shard it), its inputs, and the oracle's and yardstick's
reading of it."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from attncheck import backends, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.compiled import compiled, impl_key, impl_module, with_vjp
from attncheck.specs.base import MASK_VALUE_UNDERFLOWS, SOFT_CAP_IS_POSITIVE, KernelSpec
from attncheck.specs.splash.classes import (BUG_CLASSES, CONTRACTS, EXPECTATIONS, fully_masked_rows, head_masks,
                                            segment_ids)
from attncheck.specs.splash.draws import splash_cases, splash_data
from attncheck.specs.splash.invalid import invalid_splash_calls
from attncheck.specs.splash.masks import build
from attncheck.specs.splash.params import FAMILY, SplashParams


class SplashSpec(KernelSpec[SplashParams]):
    name = FAMILY
    params_type = SplashParams
    directions = {"out": ("head", "query", "dim"), "dq": ("head", "query", "dim"), "dk": ("kv_head", "key", "dim"),
                  "dv": ("kv_head", "key", "dim")}
    default_impls = {"builtin": "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel:"
                                "make_splash_mha"}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    bug_classes = BUG_CLASSES
    examples = {"interpret": 4, "interpret-hazards": 2, "tpu-lower": 4, "tpu": 16}
    fixed_parameters = {
        "mask.*": "the mask zoo is the case's data, drawn by the spec's own strategy with a bug class per "
                  "kind; its structure is not a parameter",
        "interpret": "interpret mode comes from the backend (force_tpu_interpret_mode with its hazard "
                     "settings); interpret=True would bypass them",
        "save_residuals": "returns the forward's logsumexp residuals besides the output: not part of the "
                          "convention's output, not judged",
        "residual_checkpoint_name": "a name for jax.checkpoint policies: changes no value",
        **parameters.outside_convention("attn_logits_soft_cap", ("negative", "zero"), SOFT_CAP_IS_POSITIVE),
        **parameters.outside_convention("mask_value", ("*",), MASK_VALUE_UNDERFLOWS)}
    contracts = CONTRACTS
    expectations = EXPECTATIONS

    def cases(self):
        return splash_cases()

    def program(self, params):
        # Not the values, the seed or the segment layout.
        return dataclasses.replace(params, values="", segment_starts=())

    def other_data(self, params):
        return splash_data(params)

    def inputs(self, case: Case[SplashParams]) -> dict[str, np.ndarray]:
        p = case.params
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(p.dtype)
        kv_lead = () if p.api == "mqa" else (p.kv_heads,)

        def values(role, shape):
            return S.attention_values(rng, p.values, shape, role=role)

        # Splash has no scale argument: its callers fold 1/sqrt(D) into q.
        out = {"q": S.round_to(values("q", (p.heads, p.q_len, p.head_dim)) * p.head_dim ** -0.5, dt),
               "k": S.round_to(values("k", kv_lead + (p.kv_len, p.head_dim)), dt),
               "v": S.round_to(values("v", kv_lead + (p.kv_len, p.v_head_dim)), dt)}
        # Fully masked rows are don't-care: a caller keeps them out of its loss.
        d_out = values("d_out", (p.heads, p.q_len, p.v_head_dim))
        out["d_out"] = S.round_to(np.where(fully_masked_rows(p)[..., None], 0.0, d_out), dt)
        ids = segment_ids(p)
        if ids is not None:
            out["q_segment_ids"], out["kv_segment_ids"] = (x.astype(p.segment_dtype) for x in ids)
        return out

    # ------------------------------------------------------------------ running
    def _kernel(self, impl, p: SplashParams, factory=None):
        """The implementation's kernel for the case's masks and blocks; MQA cases build it
        with ``make_splash_mqa`` of the implementation's module (``factory``: a stand-in
        for that)."""
        module = impl_module(impl)
        factory = factory or (impl if p.api == "mha" else module.make_splash_mqa)
        shape = (p.q_len, p.kv_len)
        mask = module.mask_lib.MultiHeadMask([build(module.mask_lib, d, shape) for d in p.masks])
        layouts = {f"{x}_layout": module.QKVLayout[name] for x, name in zip("qkv", p.layouts)}
        blocks = module.BlockSizes(**p.blocks.given(), use_fused_bwd_kernel=p.fused_bwd, **layouts)
        return factory(mask, block_sizes=blocks, attn_logits_soft_cap=p.soft_cap, head_shards=p.head_shards,
                       q_seq_shards=p.q_seq_shards, downcast_smem_data=p.downcast_smem_data, **mask_value_of(p))

    # How the kernel's mask info is sharded over a mesh's "shards" axis: by heads or by q rows.
    @staticmethod
    def _mask_info_spec(p: SplashParams) -> P:
        return P("shards", None) if p.head_shards > 1 else P(None, "shards")

    def _forward(self, impl, p: SplashParams, factory=None, mesh=None):
        """forward(q, k, v, q_segment_ids, kv_segment_ids) with the implementation's kernel
        (``_kernel``), under shard_map when the case is sharded (over ``mesh``, default the
        case's CPU devices)."""
        kernel = self._kernel(impl, p, factory)
        module = impl_module(impl)

        def forward(q, k, v, q_seg, kv_seg, kernel=kernel):
            return kernel(q, k, v, None if q_seg is None else module.SegmentIds(q=q_seg, kv=kv_seg))

        if p.device_count == 1:
            return forward
        # Heads or q sequence split over devices, as splash's callers shard it: a device
        # holds its query heads (and their kv heads, unless every head shares one) or its
        # q rows; the kernel's mask info is sharded to match.
        mesh = mesh or Mesh(np.array(jax.devices()[:p.device_count]), ("shards",))
        by_heads = p.head_shards > 1
        rows = P("shards", None, None) if by_heads else P(None, "shards", None)
        kv_sharded = by_heads and p.api == "mha" and p.kv_heads % p.head_shards == 0
        kv = P("shards", None, None) if kv_sharded else P()
        q_ids = P(None) if by_heads else P("shards")
        kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, self._mask_info_spec(p)))
        # check_vma=False: the kernel's pallas_call does not declare how its outputs vary.
        sharded = jax.shard_map(forward, mesh=mesh, in_specs=(rows, kv, kv, q_ids, P(None), kernel_spec),
                                out_specs=rows, check_vma=False)
        return lambda q, k, v, q_seg, kv_seg: sharded(q, k, v, q_seg, kv_seg, kernel)

    def parameters(self, impl, case, inputs):
        p = case.params
        if p.api == "mha":
            return super().parameters(impl, case, inputs)
        return parameters.record(lambda probe: self._forward(impl, p, factory=probe)(
            inputs["q"], inputs["k"], inputs["v"], inputs.get("q_segment_ids"), inputs.get("kv_segment_ids")),
            impl_module(impl).make_splash_mqa)

    def evaluate(self, impl, case, inputs):
        p = case.params
        fn = compiled((self.name, impl_key(impl), self.program(p)), lambda: with_vjp(self._forward(impl, p)))
        out, (dq, dk, dv) = fn((inputs["q"], inputs["k"], inputs["v"]), inputs["d_out"],
                               inputs.get("q_segment_ids"), inputs.get("kv_segment_ids"))
        return {"out": np.asarray(out), "dq": np.asarray(dq), "dk": _with_head_axis(p, dk),
                "dv": _with_head_axis(p, dv)}

    def lower(self, impl, case):
        p = case.params
        inputs = self.inputs(case)
        # A sharded kernel's shard_map runs over TPUs of the emulated generation, which its
        # Mosaic lowering asks (over the CPU devices it failed: "Unsupported TPU device kind").
        mesh = backends.tpu_mesh(p.device_count, "shards") if p.device_count > 1 else None
        return backends.tpu_exports(self._forward(impl, p, mesh=mesh), (inputs["q"], inputs["k"], inputs["v"]),
                                    inputs["d_out"], inputs.get("q_segment_ids"), inputs.get("kv_segment_ids"),
                                    mesh=mesh)

    # ------------------------------------------------------------------ judging
    @staticmethod
    def _batched(p: SplashParams, inputs):
        """q, k, v, d_out as [1, H, S, D] (MQA: one kv head)."""
        kv = (lambda x: x[None, None]) if p.api == "mqa" else (lambda x: x[None])
        return inputs["q"][None], kv(inputs["k"]), kv(inputs["v"]), inputs["d_out"][None]

    def oracle(self, case, inputs):
        p = case.params
        q, k, v, d_out = self._batched(p, inputs)
        sem = dict(scale=1.0, soft_cap=p.soft_cap, visible=head_masks(p)[None], masked_rows="zero",
                   q_segment_ids=inputs.get("q_segment_ids"), kv_segment_ids=inputs.get("kv_segment_ids"))
        grads = oracle.attention_vjp(q, k, v, d_out, **sem)
        return {"out": oracle.attention(q, k, v, **sem).out[0], "dq": grads["dq"][0], "dk": grads["dk"][0],
                "dv": grads["dv"][0]}

    def yardstick(self, case, inputs):
        p = case.params
        ids = [None if n not in inputs else inputs[n][None] for n in ("q_segment_ids", "kv_segment_ids")]
        seen = yardstick.visibility(np.arange(p.q_len), np.arange(p.kv_len), causal=False, q_segment_ids=ids[0],
                                    kv_segment_ids=ids[1], mask=head_masks(p)[None])
        result = yardstick.attention_with_grads(*self._batched(p, inputs), scale=1.0, visible=seen,
                                                soft_cap=p.soft_cap, masked_rows="zero")
        return {d: result[d][0] for d in ("out", "dq", "dk", "dv")}

    def care(self, case, inputs):
        # Fully masked rows are undefined in splash (block-structure dependent, NaN in a q
        # block without keys); their gradients are not (zero cotangent): dq is judged.
        return {"out": ~fully_masked_rows(case.params)[..., None]}

    def invalid_calls(self, impl):
        return invalid_splash_calls(impl)


def mask_value_of(p: SplashParams) -> dict:
    return {"mask_value": p.mask_value} if p.mask_value is not None else {}


def _with_head_axis(p: SplashParams, grad) -> np.ndarray:
    """MQA's dk/dv [K, D] as [1, K, D], the layout of every other case."""
    grad = np.asarray(grad)
    return grad[None] if p.api == "mqa" else grad


SPEC = SplashSpec()
