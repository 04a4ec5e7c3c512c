"""Splash attention family: jax's ``splash_attention`` API. The implementation is a kernel
factory ``fn(mask, *, block_sizes, attn_logits_soft_cap, head_shards, q_seq_shards)``
(``make_splash_mha``) returning ``kernel(q, k, v, segment_ids=None)``; its module supplies
``make_splash_mqa``, ``SegmentIds``, ``BlockSizes`` and the mask classes (``mask_lib``:
``CausalMask``, ``LocalMask``, ``ChunkedCausalMask``, ``FullMask``, ``NumpyMask``,
``MultiHeadMask``, ``&``/``|``), so a copy of the kernel module is verified with its own
types. q [H, Q, D], k/v [Hkv, K, D|Dv] ([K, D|Dv] for MQA); no batch axis, no scale.

Mapped onto the oracle:
- logits = q.k (the scale is folded into q, as a caller of splash does);
- soft cap ``cap * tanh(logits / cap)`` before masking;
- key j visible to query i of head h iff the head's mask holds at (i, j) and the segment
  ids are equal; the mask is given to the oracle as data (``visible``), evaluated here in
  NumPy from the case's description (never by the mask classes under test);
- GQA: query head h reads kv head h // (H / Hkv); MQA: one kv head without a head axis;
- fully masked rows (no visible key, from the mask or the segments) are undefined in
  splash: the mean of v over the kv blocks the row's q block visits, or NaN when it visits
  none, so the result depends on the block structure. Their outputs are don't-care and
  their cotangent is zero (a caller masks such rows out of the loss); dq of such a row
  must then be 0, and nothing may leak into other rows or into dk/dv.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from attncheck import backends, bugclasses, oracle, parameters, yardstick
from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.compiled import compiled, impl_key, impl_module, with_vjp
from attncheck.expectations import BUG_CLASS, INVALID_CALL, Contract, Shipped
from attncheck.specs import splash_blocks as blocks
from attncheck.specs.base import (FLOAT32_ACCUMULATION, MASK_VALUE_UNDERFLOWS, SOFT_CAP_IS_POSITIVE, InvalidCall,
                                  KernelSpec, values_by_dtype)
from attncheck.specs.splash_cases import FAMILY, NUM_LANES, SplashParams, splash_cases
from attncheck.specs.splash_masks import build


# The partitions crossed pairwise: the forward's kv blocks, the backward's kernels, the
# heads against the kv heads, and how the call is sharded: a head or q-sequence shard's
# offsets meet each.
KV_BLOCKS = bugclasses.partition("kv_blocks", one=lambda p: p.block_sizes["block_kv"] >= p.kv_len,
                                 several=lambda p: p.block_sizes["block_kv"] < p.kv_len)
HEADS = bugclasses.partition("heads", mha=lambda p: p.api == "mha" and p.kv_heads == p.heads,
                             gqa=lambda p: p.api == "mha" and p.kv_heads < p.heads, mqa=lambda p: p.api == "mqa")
SHARDS = bugclasses.partition("shards", none=lambda p: p.device_count == 1, heads=lambda p: p.head_shards > 1,
                              q_seq=lambda p: p.q_seq_shards > 1)
PAIRS = bugclasses.pairwise(
    KV_BLOCKS,
    bugclasses.partition("backward", fused=lambda p: p.fused_bwd, dq_kernel=lambda p: not p.fused_bwd),
    HEADS, SHARDS)

# Searched in this order, each class only if no earlier example exercises it: classes whose
# examples carry many conditions at once come first (fewer, richer examples).
CLASSES = dict(
    gqa=lambda p: p.api == "mha" and p.heads > p.kv_heads,
    q_len_ne_kv_len=lambda p: p.q_len != p.kv_len,
    offset_inside_kv=blocks.offset_inside_kv,
    running_max_across_kv_blocks=lambda p: blocks.keys_in_several_blocks(p, blocks.pass_blocks(p)["fwd"]),
    computed_mask_past_first_kv_block=blocks.computed_mask_past_first_kv_block,
    # k_offset must come from data_next, not from the grid index.
    computed_mask_on_shrunk_grid=lambda p: blocks.mask_is_computed(p) and blocks.shrunk_grid(p),
    skipped_block_between_visited=blocks.skipped_block_between_visited,
    full_and_partial_blocks_loaded=functools.partial(blocks.partial_blocks_loaded, with_full=True),
    partial_blocks_loaded=blocks.partial_blocks_loaded,
    shrunk_grid=blocks.shrunk_grid,
    mqa=lambda p: p.api == "mqa",
    v_head_dim_ne_head_dim=lambda p: p.v_head_dim != p.head_dim,
    # Grouped (h // group), not interleaved (h % kv_heads), query heads per kv head:
    # the two agree while there is one kv head.
    gqa_several_kv_heads=lambda p: p.api == "mha" and 1 < p.kv_heads < p.heads,
    q_block_without_keys=blocks.q_block_without_keys,
    combined_masks=blocks.combined_masks,
    window_right_side_cuts=blocks.window_right_side_cuts,
    per_head_masks_within_kv_group=blocks.per_head_masks_within_kv_group,
    chunk_boundary_inside_kv_block=blocks.chunk_boundary_inside,
    fully_masked_row_in_visited_block=blocks.fully_masked_row_in_visited_block,
    segments_vary_across_tiles=blocks.segments_vary_across_tiles,
    q_seq_shards=lambda p: p.q_seq_shards > 1,
    head_shards=lambda p: p.head_shards > 1,
    kv_compute_inner_loops=lambda p: (p.block_sizes["block_kv_compute"] < p.block_sizes["block_kv"]
                                      and p.block_sizes["block_kv_dkv_compute"] < p.block_sizes["block_kv_dkv"]),
    bwd_blocks_differ=blocks.bwd_blocks_differ,
    fused_dq_over_kv_blocks=lambda p: p.fused_bwd and blocks.keys_in_several_blocks(
        p, blocks.pass_blocks(p)["dkv"]),
    dq_kernel_over_kv_blocks=lambda p: not p.fused_bwd and blocks.keys_in_several_blocks(
        p, blocks.pass_blocks(p)["dq"]),
    soft_cap=lambda p: p.soft_cap is not None,
    # Blocks of several lane tiles in every pass, and q, k, v read transposed.
    wide_blocks=lambda p: all(p.block_sizes[f] > NUM_LANES for f in (
        "block_q", "block_kv_compute", "block_q_dkv", "block_kv_dkv_compute")),
    seq_minor_layouts=lambda p: set(p.layouts) == {"SEQ_MINOR"},
    # q and kv segment ids of different lengths, either way round, and narrow ones; on
    # one device, where the probe sees the kernel's call (a sharded one is handed to
    # shard_map), so that their parameters vary in the report too.
    segments_q_longer=lambda p: p.segments != "none" and p.q_len > p.kv_len and p.device_count == 1,
    segments_kv_longer=lambda p: p.segments != "none" and p.kv_len > p.q_len and p.device_count == 1,
    int16_segment_ids=lambda p: p.segment_dtype == "int16" and p.device_count == 1,
    bf16=lambda p: p.dtype == "bfloat16",
    large_logits=lambda p: p.values == "large",
    exact_ties=lambda p: p.values == "ties",
    # bfloat16 over many keys of v far from 0: the P @ V accumulation's precision shows.
    bf16_long_kv_offset_values=lambda p: p.dtype == "bfloat16" and p.kv_len >= 256 and p.values == "offset",
    # jax's kernel's findings (declared below): their cases run like any other.
    forward_nan_rows_reach_backward=bugclasses.Touching(blocks.forward_nan_rows_reach_backward,
                                                        blocks.nan_backward),
    q_seq_shards_without_partial_blocks=blocks.q_seq_shards_without_partial_blocks,
    q_seq_shard_without_keys=blocks.q_seq_shard_without_keys,
)


class SplashSpec(KernelSpec[SplashParams]):
    name = FAMILY
    params_type = SplashParams
    directions = {"out": ("head", "query", "dim"), "dq": ("head", "query", "dim"), "dk": ("kv_head", "key", "dim"),
                  "dv": ("kv_head", "key", "dim")}
    default_impls = {"builtin": "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel:"
                                "make_splash_mha"}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    bug_classes = (bugclasses.bug_classes(**CLASSES) + bugclasses.numbers("soft_cap", lambda p: p.soft_cap, (
        "in (0, 1)", "one", "above 1")).classes + PAIRS + values_by_dtype() + bugclasses.presences(
        segment_ids=lambda p: p.segments != "none", attn_logits_soft_cap=lambda p: p.soft_cap is not None))
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
    contracts = (FLOAT32_ACCUMULATION,
                 Contract("unseeing_rows_undefined", "a query that sees no key is undefined (the mean of v over the "
                          "kv blocks its q block visits, or NaN): its output is don't-care, its cotangent zero, and "
                          "nothing may leak into other rows"),)
    expectations = (
        Shipped("builtin", BUG_CLASS, "forward_nan_rows_reach_backward", "a forward q block that visits no kv block "
                "outputs NaN; a larger backward q block holding those rows makes their dq and the dk, dv of every key "
                "it visits NaN (attncheck finding splash_backward_block_nan)"),
        Shipped("builtin", BUG_CLASS, "q_seq_shards_without_partial_blocks", "one mask for every head with no "
                "partial block and q_seq_shards > 1: make_splash_mha fails in its mask processing (\"need at least "
                "one array to concatenate\"; attncheck finding splash_q_seq_shards_full_mask)"),
        Shipped("builtin", BUG_CLASS, "q_seq_shard_without_keys", "one mask for every head and a q shard that "
                "sees no key (q_seq_shards > 1, or a mask hiding every key): make_splash_mha stops at a bare "
                "assertion in its mask processing (attncheck finding splash_q_seq_shard_without_keys)"),
        Shipped("builtin", INVALID_CALL, "kv_longer_than_mask", "a kernel built for a [H, 256, 256] mask, called with "
                "kv_len 512, returns attention over the first 256 keys (no error, on TPU or in interpret mode; "
                "attncheck finding splash_kv_longer_than_mask)"))

    def cases(self):
        return splash_cases()

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
        out["d_out"] = S.round_to(np.where(blocks.fully_masked_rows(p)[..., None], 0.0, d_out), dt)
        ids = blocks.segment_ids(p)
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
        blocks = module.BlockSizes(**p.block_sizes, use_fused_bwd_kernel=p.fused_bwd, **layouts)
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
        # What forces a new compile: not the values, the seed or the segment layout.
        static = dataclasses.replace(p, values="", segment_starts=())
        fn = compiled((self.name, impl_key(impl), static), lambda: with_vjp(self._forward(impl, p)))
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
        sem = dict(scale=1.0, soft_cap=p.soft_cap, visible=blocks.head_masks(p)[None], masked_rows="zero",
                   q_segment_ids=inputs.get("q_segment_ids"), kv_segment_ids=inputs.get("kv_segment_ids"))
        grads = oracle.attention_vjp(q, k, v, d_out, **sem)
        return {"out": oracle.attention(q, k, v, **sem).out[0], "dq": grads["dq"][0], "dk": grads["dk"][0],
                "dv": grads["dv"][0]}

    def yardstick(self, case, inputs):
        p = case.params
        ids = [None if n not in inputs else inputs[n][None] for n in ("q_segment_ids", "kv_segment_ids")]
        seen = yardstick.visibility(np.arange(p.q_len), np.arange(p.kv_len), causal=False, q_segment_ids=ids[0],
                                    kv_segment_ids=ids[1], mask=blocks.head_masks(p)[None])
        result = yardstick.attention_with_grads(*self._batched(p, inputs), scale=1.0, visible=seen,
                                                soft_cap=p.soft_cap, masked_rows="zero")
        return {d: result[d][0] for d in ("out", "dq", "dk", "dv")}

    def care(self, case, inputs):
        # Fully masked rows are undefined in splash (block-structure dependent, NaN in a q
        # block without keys); their gradients are not (zero cotangent): dq is judged.
        return {"out": ~blocks.fully_masked_rows(case.params)[..., None]}

    def invalid_calls(self, impl):
        return invalid_splash_calls(impl)


def mask_value_of(p: SplashParams) -> dict:
    return {"mask_value": p.mask_value} if p.mask_value is not None else {}


def _with_head_axis(p: SplashParams, grad) -> np.ndarray:
    """MQA's dk/dv [K, D] as [1, K, D], the layout of every other case."""
    grad = np.asarray(grad)
    return grad[None] if p.api == "mqa" else grad


# The invalid calls' shapes: H heads of S tokens of D, a causal mask, and blocks of 128 in
# every pass.
INVALID_HEADS, INVALID_LEN, INVALID_DIM = 2, 256, 128
FULL_BLOCKS = dict(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
                   block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)


def invalid_splash_calls(impl) -> list[InvalidCall]:
    """jax's convention: a MultiHeadMask, BlockSizes, head shards, the dq kernel."""
    module = impl_module(impl)
    mask_lib = module.mask_lib
    h, s = INVALID_HEADS, INVALID_LEN
    causal = mask_lib.MultiHeadMask([mask_lib.CausalMask((s, s))] * h)

    def make(mask=causal, *, q_seq_shards=1, **changes):
        # Built inside the call: constructors that validate must raise under pytest.raises.
        return impl(mask, block_sizes=module.BlockSizes(**{**FULL_BLOCKS, **changes}), head_shards=1,
                    q_seq_shards=q_seq_shards)

    x = jnp.zeros((h, s, INVALID_DIM), jnp.float32)
    return invalid_calls_through(make, module, mask_shape=(h, s, s)) + [
        InvalidCall("fused_with_dq_blocks", lambda: module.BlockSizes(block_q=128, block_kv=128,
                                                                      use_fused_bwd_kernel=True, block_q_dq=128),
                    ValueError, r"dq"),
        InvalidCall("block_kv_dq_not_lane_multiple", lambda: _grad_of(make(block_kv_dq=64), x), ValueError,
                    r"bkv=64"),
        InvalidCall("no_backward_blocks", lambda: _grad_of(impl(causal, block_sizes=module.BlockSizes(128, 128),
                                                                head_shards=1, q_seq_shards=1), x),
                    ValueError, r"backward blocks"),
        InvalidCall("mask_2d", lambda: make(mask_lib.CausalMask((s, s))), ValueError, r"mask shape"),
        InvalidCall("head_mask_shapes_differ", lambda: mask_lib.MultiHeadMask(
            [mask_lib.CausalMask((s, s)), mask_lib.CausalMask((s, 2 * s))]), ValueError, r"mask shape"),
        InvalidCall("multi_head_mask_nested", lambda: mask_lib.MultiHeadMask([causal]), ValueError,
                    r"MultiHeadMask"),
        InvalidCall("head_shards_not_dividing", lambda: impl(causal, block_sizes=module.BlockSizes(**FULL_BLOCKS),
                                                             head_shards=3, q_seq_shards=1), ValueError,
                    r"head_shards"),
    ]


def _grad_of(kernel, x):
    return jax.grad(lambda q: kernel(q, x, x).sum())(x)


def invalid_calls_through(make, module, *, mask_shape: tuple[int, ...]) -> list[InvalidCall]:
    """The invalid calls every splash convention shares, through its ``make(mask=<causal>,
    *, q_seq_shards=1, **block_sizes)`` (the kernel it builds) and its module's mask_lib
    and SegmentIds; ``mask_shape``: the shape of the convention's mask."""
    mask_lib = module.mask_lib
    h, s, d = INVALID_HEADS, INVALID_LEN, INVALID_DIM
    x = jnp.zeros((h, s, d), jnp.float32)

    def call(*args, **changes):
        return make(**changes)(*args)

    return [
        InvalidCall("block_kv_not_multiple_of_compute", lambda: call(x, x, x, block_kv=256, block_kv_compute=192),
                    ValueError, r"bkv_compute"),
        InvalidCall("block_kv_compute_not_lane_multiple", lambda: call(x, x, x, block_kv_compute=64), ValueError,
                    r"bkv_compute=64"),
        InvalidCall("block_q_not_dividing", lambda: make(block_q=96), ValueError, r"q_block_size"),
        InvalidCall("block_kv_not_dividing", lambda: make(block_kv=96, block_kv_compute=96), ValueError,
                    r"kv_block_size"),
        InvalidCall("block_kv_dkv_compute_above_block", lambda: _grad_of(make(block_kv_dkv_compute=256), x),
                    ValueError, r"bkv_compute=256"),
        InvalidCall("mask_not_bool", lambda: make(np.ones(mask_shape, np.int32)), ValueError, r"(?i)mask.*bool"),
        InvalidCall("combined_mask_shapes_differ", lambda: mask_lib.CausalMask((s, s)) & mask_lib.FullMask((s, 2 * s)),
                    ValueError, r"shape"),
        InvalidCall("chunk_size_zero", lambda: mask_lib.ChunkedCausalMask((s, s), chunk_size=0), ValueError,
                    r"chunk_size"),
        InvalidCall("q_seq_shards_not_dividing", lambda: make(q_seq_shards=3), ValueError, r"q_seq_shards"),
        InvalidCall("k_head_dim", lambda: call(x, x[..., :64], x), ValueError, r"'key' head dimension"),
        InvalidCall("kv_heads_not_dividing", lambda: call(x, *(jnp.zeros((3, s, d), jnp.float32),) * 2), ValueError,
                    r"'key' heads"),
        InvalidCall("v_len_differs_from_k", lambda: call(x, x, x[:, :128]), ValueError, r"'value'"),
        InvalidCall("mha_with_2d_k", lambda: call(x, x[0], x[0]), ValueError, r"'key' tensor"),
        InvalidCall("segment_ids_with_batch_axis", lambda: call(
            x, x, x, module.SegmentIds(jnp.zeros((1, s), jnp.int32), jnp.zeros((1, s), jnp.int32))), ValueError,
                    r"q segment_ids"),
        InvalidCall("kv_segment_ids_shape", lambda: call(
            x, x, x, module.SegmentIds(jnp.zeros((s,), jnp.int32), jnp.zeros((s // 2,), jnp.int32))), ValueError,
                    r"kv segment_ids"),
        InvalidCall("kv_longer_than_mask", lambda: call(x, *(jnp.zeros((h, 2 * s, d), jnp.float32),) * 2),
                    ValueError, r"(?i)mask"),
    ]


SPEC = SplashSpec()
