"""Flash attention's KernelSpec: the oracle's mapping, the inputs, the yardstick and the
kernel call, over the params, draws, classes and invalid calls of this package."""

from __future__ import annotations

import dataclasses

import numpy as np

from attncheck import backends, oracle, yardstick
from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.compiled import compiled, impl_key, impl_module, with_vjp
from attncheck.layouts import ErrorMapLayout, every
from attncheck.specs.base import ATTENTION_AXES, BIAS_AXES, KernelSpec, accepted_keywords
from attncheck.specs.flash.classes import BUG_CLASSES, CONTRACTS, segment_ids
from attncheck.specs.flash.draws import flash_cases, flash_data
from attncheck.specs.flash.invalid import invalid_flash_calls
from attncheck.specs.flash.params import FAMILY, NEG_INF_KINDS, BlockSizes, FlashParams



def _long_reduction_example(values: str, kv_len: int, k_major: int) -> Case[FlashParams]:
    """One bfloat16 query block over kv_len keys in 128-key sub-blocks of k_major-key grid
    steps, every pass tiled alike, every row seeing every key at the default scale."""
    return Case(FAMILY, FlashParams(
        dtype="bfloat16", batch=1, heads=1, q_len=128, kv_len=kv_len, head_dim=128, causal=False,
        sm_scale=128 ** -0.5, bias=False, segments="none", segment_starts=(), values=values,
        blocks=BlockSizes(block_q=128, block_k_major=k_major, block_k=128, block_b=1, block_q_major_dkv=128,
                          block_k_major_dkv=k_major, block_k_dkv=128, block_q_dkv=128, block_k_major_dq=k_major,
                          block_k_dq=128, block_q_dq=128)), 0)


class FlashSpec(KernelSpec[FlashParams]):
    name = FAMILY
    params_type = FlashParams
    directions = {**ATTENTION_AXES, "dab": BIAS_AXES}
    default_impls = {"builtin": "attncheck_kernels.flash_attention:flash_attention"}
    backends = ("interpret", "interpret-hazards", "tpu-lower", "tpu")
    bug_classes = BUG_CLASSES
    examples = {"interpret": 20, "interpret-hazards": 6, "tpu-lower": 4, "tpu": 24}
    # Every two-level tiling nested under causal masking at once is too rare a draw for the
    # coverage search's budget, under either profile's strategy.
    explicit_examples = {"causal_nested_every_pass": Case(FAMILY, FlashParams(
        dtype="float32", batch=1, heads=1, q_len=512, kv_len=512, head_dim=64, causal=True, sm_scale=0.125,
        bias=False, segments="none", segment_starts=(), values="normal",
        blocks=BlockSizes(block_q=128, block_k_major=256, block_k=128, block_b=1, block_q_major_dkv=256,
                          block_k_major_dkv=256, block_k_dkv=128, block_q_dkv=128, block_k_major_dq=256,
                          block_k_dq=128, block_q_dq=128)), 0),
        # The CI profile draws head dims 64 and 128 only.
        "f32_wide_head_retiled_backward": Case(FAMILY, FlashParams(
            dtype="float32", batch=1, heads=1, q_len=256, kv_len=256, head_dim=256, causal=True, sm_scale=0.0625,
            bias=False, segments="none", segment_starts=(), values="large",
            blocks=BlockSizes(block_q=256, block_k_major=128, block_k=128, block_b=1, block_q_major_dkv=128,
                              block_k_major_dkv=128, block_k_dkv=128, block_q_dkv=128, block_k_major_dq=128,
                              block_k_dq=128, block_q_dq=128)), 0),
        # Every condition of the class at once is a rare draw. 4096 keys (32 kv blocks): there a
        # bfloat16 accumulator's out budget is about twice what it is at 2048, well past 1 on
        # every seed; a float32 one's stays far below 1 at both.
        "long_reduction_offset_values": _long_reduction_example("offset", 4 * S.LONG_REDUCTION, 512),
        # As rare. 8192 keys: 64 kv blocks.
        "long_reduction_sink": _long_reduction_example(S.SINK, 8 * S.LONG_REDUCTION, 1024)}
    contracts = CONTRACTS

    def cases(self):
        return flash_cases()

    def program(self, params):
        # The values, the ab pattern and the segment layout are data; packed and absent
        # segments differ only in their ids.
        return dataclasses.replace(params, values="", segment_starts=(), bias_values="", emptied_row=None,
                                   segments="none" if params.segments == "none" else "given")

    def other_data(self, params):
        return flash_data(params)

    def inputs(self, case: Case[FlashParams]) -> dict[str, np.ndarray]:
        p = case.params
        rng = np.random.default_rng(case.seed)
        dt = S.dtype_of(p.dtype)
        b, h, q_len, kv_len, d = p.batch, p.heads, p.q_len, p.kv_len, p.head_dim
        out = {name: S.round_to(S.attention_values(rng, p.values, shape, role=name), dt)
               for name, shape in (("q", (b, h, q_len, d)), ("k", (b, h, kv_len, d)), ("v", (b, h, kv_len, d)),
                                   ("d_out", (b, h, q_len, d)))}
        if (ids := segment_ids(p)) is not None:
            q_ids, kv_ids = ids
            out["q_segment_ids"] = np.broadcast_to(q_ids, (b, q_len)).astype(p.segment_dtype)
            out["kv_segment_ids"] = np.broadcast_to(kv_ids, (b, kv_len)).astype(p.segment_dtype)
        if p.bias:
            out["ab"] = S.round_to(_bias(rng, p, out), dt)
        return out

    # ------------------------------------------------------------------ running
    def _call(self, impl, p: FlashParams):
        module = impl_module(impl)  # SegmentIds/BlockSizes of the implementation's convention

        def forward(q, k, v, ab, q_seg, kv_seg):
            segment_ids = module.SegmentIds(q=q_seg, kv=kv_seg) if q_seg is not None else None
            return impl(q, k, v, ab, segment_ids, causal=p.causal, sm_scale=p.sm_scale,
                        block_sizes=module.BlockSizes(**p.blocks.given()),
                        **accepted_keywords(impl, vmem_limit_bytes=p.vmem_limit_bytes))

        return forward

    def evaluate(self, impl, case, inputs):
        p = case.params
        primals, rest = _operands(inputs)
        fn = compiled(("flash", impl_key(impl), self.program(p)), lambda: with_vjp(self._call(impl, p)))
        out, grads = fn(primals, inputs["d_out"], *rest)
        return {n: np.asarray(r) for n, r in zip(self.directions, (out, *grads))}

    def lower(self, impl, case):
        inputs = self.inputs(case)
        primals, rest = _operands(inputs)
        return backends.tpu_exports(self._call(impl, case.params), primals, inputs["d_out"], *rest)

    # ------------------------------------------------------------------ judging
    def oracle(self, case, inputs):
        p = case.params
        visible, fallback = _masks(p, inputs)
        # ab entries a -inf or the mask hides may be non-finite, and NaN times a scale of 0;
        # `visible` leaves them out as the kernel does.
        with np.errstate(invalid="ignore"):
            bias = None if "ab" not in inputs else np.asarray(inputs["ab"], np.float64) * p.sm_scale
        sem = dict(scale=p.sm_scale, bias=bias, visible=visible, fallback=fallback, masked_rows="zero")
        args = (inputs["q"], inputs["k"], inputs["v"])
        grads = oracle.attention_vjp(*args, inputs["d_out"], **sem)
        result = {"out": oracle.attention(*args, **sem).out, "dq": grads["dq"], "dk": grads["dk"], "dv": grads["dv"]}
        if bias is not None:
            result["dab"] = grads["dbias"] * p.sm_scale
        return result

    def yardstick(self, case, inputs):
        visible, fallback = _masks(case.params, inputs)
        return yardstick.attention_with_grads(inputs["q"], inputs["k"], inputs["v"], inputs["d_out"],
                                              scale=case.params.sm_scale, ab=inputs.get("ab"), visible=visible,
                                              fallback=fallback, masked_rows="zero")

    def error_map_layout(self, case, direction):
        # Each direction on the blocks of the pass that computes it: out (fwd), dk and dv
        # (dkv), dq and dab (dq). Under top-left causal masking the other side's blocks meet
        # the diagonal at the same positions (query i's last key is i, key j's first query
        # is j): where a causal block skip is off by one, the map breaks there.
        p = case.params
        b, q_len, kv_len = p.blocks, p.q_len, p.kv_len
        kv_dkv = (every("block_k_major_dkv", b.block_k_major_dkv, kv_len),
                  every("block_k_dkv", b.block_k_dkv, kv_len))
        rows = {"out": (every("block_q", b.block_q, q_len),), "dq": (every("block_q_dq", b.block_q_dq, q_len),),
                "dk": kv_dkv, "dv": kv_dkv, "dab": (every("block_q_dq", b.block_q_dq, q_len),)}[direction]
        diagonal = {"out": ("block_k_major", q_len), "dq": ("block_k_major_dq", q_len),
                    "dk": ("block_q_major_dkv", kv_len), "dv": ("block_q_major_dkv", kv_len)}
        if p.causal and direction in diagonal:
            name, length = diagonal[direction]
            rows += (every(f"{name} on the causal diagonal", getattr(b, name), length),)
        cols = ((every("block_k_major_dq", b.block_k_major_dq, kv_len), every("block_k_dq", b.block_k_dq, kv_len))
                if direction == "dab" else ())
        return ErrorMapLayout(self.index_names(direction), 2, 3, rows, cols)

    def invalid_calls(self, impl):
        return invalid_flash_calls(impl)


def _bias(rng: np.random.Generator, p: FlashParams, inputs) -> np.ndarray:
    """ab in float64, with the non-finite entries its kind asks for. -inf goes only where
    the key is of the query's own segment (a fallback key's bias is replaced, not used): at
    some keys, each row keeping the last key it sees, and at every key of the emptied row,
    which then falls back on its other segments' keys or, without any, is 0."""
    ab = rng.standard_normal((p.batch, p.heads, p.q_len, p.kv_len))
    same, causal = _segment_equal(inputs), _causal(p)
    if p.bias_values in NEG_INF_KINDS:
        seen = np.broadcast_to(same & causal, ab.shape)
        last_seen = p.kv_len - 1 - np.argmax(seen[..., ::-1], axis=-1)
        kept = seen & (np.arange(p.kv_len) == last_seen[..., None])
        hidden = same & (rng.random(ab.shape) < 0.1) & ~kept
        if p.bias_values == "neg_inf_row":
            hidden = hidden | (same & (np.arange(p.q_len) == p.emptied_row)[:, None])
        ab = np.where(hidden, -np.inf, ab)
    elif p.bias_values == "nonfinite_masked":
        hidden = ~causal & (rng.random(ab.shape) < 0.5)
        ab = np.where(hidden, np.where(rng.random(ab.shape) < 0.5, np.nan, np.inf), ab)
    return ab


def _causal(p: FlashParams) -> np.ndarray:
    """[1, 1, Q, K] top-left causal visibility (all True when not causal)."""
    return (np.arange(p.kv_len)[None, :] <= np.arange(p.q_len)[:, None] if p.causal
            else np.ones((p.q_len, p.kv_len), bool))[None, None]


def _segment_equal(inputs) -> np.ndarray:
    """[B|1, 1, Q, K]: the key is of the query's segment (all True without segment ids)."""
    if "q_segment_ids" not in inputs:
        return np.ones((1, 1, 1, 1), bool)
    return (inputs["q_segment_ids"][:, :, None] == inputs["kv_segment_ids"][:, None, :])[:, None]


def _masks(p: FlashParams, inputs) -> tuple[np.ndarray, np.ndarray]:
    """(visible, fallback) [B, H, Q, K] as the kernel's docstring defines them: a key is
    visible when causally visible, of the query's segment and without a -inf bias; a row
    with no visible key falls back on its causally visible keys of other segments."""
    full = (p.batch, p.heads, p.q_len, p.kv_len)
    same, causal = _segment_equal(inputs), _causal(p)
    visible = causal & same
    if "ab" in inputs:
        visible = visible & (np.asarray(inputs["ab"], np.float64) != -np.inf)
    return np.broadcast_to(visible, full), np.broadcast_to(causal & ~same, full)


def _operands(inputs):
    """(primals, the rest of forward's arguments): the bias is a primal when given."""
    primals = [inputs[n] for n in ("q", "k", "v", "ab") if n in inputs]
    rest = ([] if "ab" in inputs else [None]) + [inputs.get("q_segment_ids"), inputs.get("kv_segment_ids")]
    return primals, rest



SPEC = FlashSpec()
