"""Splash through ``SplashConfig``: the convention of tokamax's splash rewrite
(``tokamax._src.ops.experimental.tpu.splash_attention.splash_attention_kernel``). The
implementation is a kernel factory ``fn(mask, *, config, q_seq_shards, downcast_smem_data,
mask_value)`` (``make_splash_mha``) returning ``kernel(q, k, v, segment_ids=None)``; its
module supplies ``make_splash_mqa``, ``SplashConfig``, ``SegmentIds``, ``QKVLayout`` and the
mask classes (``mask_lib``). A caller shards it over heads (the kernel never knows) or over
the q sequence (``q_seq_shards``).

What it takes differs from jax's splash convention (``attncheck.specs.splash``): one 2-D
mask for every head, the block sizes and the kernel's options in one ``SplashConfig``
(soft cap, layouts, the reciprocal fused into the kernel, exp2, the dq reduction, stacked
q heads, the causal diagonal's skipped sub-tiles), and the fused backward only. What it
computes does not: the cases, the inputs, the oracle, the yardstick and the don't-care rows
are splash's, so both conventions are judged by one oracle. No implementation ships with
attncheck: the family runs with ``--attncheck-impl``
(``attncheck.third_party.tokamax:make_splash_mha``).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from attncheck import bugclasses, parameters
from attncheck import strategies as S
from attncheck.cases import Case
from attncheck.compiled import impl_module
from attncheck.specs.base import SOFT_CAP_IS_POSITIVE, InvalidCall, values_by_dtype
from attncheck.specs.splash import classes
from attncheck.specs.splash.draws import splash_cases
from attncheck.specs.splash.invalid import FULL_BLOCKS, INVALID_DIM, INVALID_HEADS, INVALID_LEN, invalid_calls_through
from attncheck.specs.splash.masks import build
from attncheck.specs.splash.params import NUM_LANES, SplashParams
from attncheck.specs.splash.spec import SplashSpec, mask_value_of

FAMILY = "splash_attention_config"
DIAG_SKIPS = (("qk",), ("sv",), ("qk", "sv"))
DIAG_GRIDS = (2, 4)


@dataclasses.dataclass(frozen=True)
class SplashConfigParams(SplashParams):
    """A splash case (one mask for every head, the fused backward) and the SplashConfig
    options that change how the kernel computes, not what."""

    fuse_reciprocal: bool = True  # o / l inside the kernel
    use_base2_exp: bool = True  # exp2 of log2(e)-scaled logits
    dq_reduction_steps: int | None = None  # None: dq summed over every kv step; 3: a dynamic grid
    num_stacked_q_heads: int = 1  # query heads of one kv head computed as one tile
    use_experimental_scheduler: bool = False
    diag_skip: tuple[str, ...] = ()  # "qk", "sv": matmuls of the causal diagonal's sub-tiles skipped
    qk_diag_grid: int = 2  # the diagonal block's sub-grid
    dkv_reuse_scaled_q: bool = False  # the dK matmul reuses the log2(e)-scaled q


@st.composite
def splash_config_cases(draw) -> Case[SplashConfigParams]:
    case = draw(splash_cases(per_head_masks=False, fused_bwd=True))
    p = case.params
    # Stacked heads divide the query heads of a kv head, on each head shard.
    group = p.heads if p.api == "mqa" else p.heads // p.kv_heads
    local_heads = p.heads // p.head_shards
    blocks, diag_skip, grid = p.blocks, (), 2
    # The diagonal skip takes a pure CausalMask and square blocks of one compute tile.
    if p.masks[0][0] == "causal" and draw(st.booleans()):
        diag_skip = draw(st.sampled_from(DIAG_SKIPS))
        grid = draw(st.sampled_from(DIAG_GRIDS))
        side = draw(st.sampled_from(S.divisors(math.gcd(p.q_len // p.q_seq_shards, p.kv_len), NUM_LANES)))
        blocks = dataclasses.replace(p.blocks, **dict.fromkeys(p.blocks.given(), side))
    return Case(FAMILY, SplashConfigParams(
        **{f.name: getattr(p, f.name) for f in dataclasses.fields(SplashParams)} | {"blocks": blocks},
        fuse_reciprocal=draw(st.booleans()), use_base2_exp=draw(st.booleans()),
        dq_reduction_steps=draw(st.sampled_from((None, 3))),
        num_stacked_q_heads=draw(st.sampled_from(tuple(n for n in (1, 2) if group % n == 0 == local_heads % n))),
        use_experimental_scheduler=draw(st.booleans()), diag_skip=diag_skip, qk_diag_grid=grid,
        dkv_reuse_scaled_q=draw(st.booleans())), case.seed)


def _diag_offset(p: SplashConfigParams) -> int:
    return p.masks[0][1]  # a diagonal skip is drawn for a causal mask alone


def _skip_drops_visible_keys(p: SplashConfigParams, block: int) -> bool:
    """Whether the diagonal skip leaves out a logit a query sees, on square blocks of ``block``.

    The skip takes every partial block for a diagonal one: it splits it into a
    ``qk_diag_grid`` sub-grid and leaves out each sub-tile whose kv band is after its q band.
    That holds where the causal diagonal runs through the block's corners; a partial block
    off the diagonal (an offset that is not a whole number of blocks puts one below it) has
    visible keys in those sub-tiles.
    """
    mask, seen = classes.head_masks(p)[0], classes.visible(p)[0]
    band = np.arange(block) // (block // p.qk_diag_grid)
    left_out = band[None, :] > band[:, None]  # [q, kv] within a block
    tiles = seen.reshape(p.q_len // block, block, p.kv_len // block, block).swapaxes(1, 2)
    return bool((tiles[classes.occupancy(mask, block, block) == 1] & left_out).any())


def _diag_skip_drops_visible_keys(p: SplashConfigParams) -> bool:
    # The forward skips only for one stacked q head (sv only with v's head dim minor); the
    # backward's qk skip, on its own blocks, has no such condition.
    forward = p.num_stacked_q_heads == 1 and ("qk" in p.diag_skip or (
        "sv" in p.diag_skip and p.layouts[2] == "HEAD_DIM_MINOR"))
    return (forward and _skip_drops_visible_keys(p, p.blocks.block_q)) or (
        "qk" in p.diag_skip and _skip_drops_visible_keys(p, p.blocks.block_q_dkv))


# jax's splash classes a 2-D mask and the fused backward cannot reach.
UNREACHABLE = ("per_head_masks_within_kv_group", "dq_kernel_over_kv_blocks")
PAIRS = bugclasses.pairwise(
    classes.KV_BLOCKS, classes.HEADS, classes.SHARDS,
    bugclasses.partition("exp", base2=lambda p: p.use_base2_exp, natural=lambda p: not p.use_base2_exp),
    bugclasses.partition("dq_reduction", every_kv_step=lambda p: p.dq_reduction_steps is None,
                         three_steps=lambda p: p.dq_reduction_steps == 3))


class SplashConfigSpec(SplashSpec):
    name = FAMILY
    params_type = SplashConfigParams
    default_impls = {}
    bug_classes = (bugclasses.bug_classes(
        **{name: applies for name, applies in classes.CLASSES.items() if name not in UNREACHABLE},
        reciprocal_outside_kernel=lambda p: not p.fuse_reciprocal,
        stacked_q_heads=lambda p: p.num_stacked_q_heads > 1,
        experimental_scheduler=lambda p: p.use_experimental_scheduler,
        qk_diag_skip=lambda p: "qk" in p.diag_skip,
        sv_diag_skip=lambda p: "sv" in p.diag_skip,
        diag_sub_grid_4=lambda p: bool(p.diag_skip) and p.qk_diag_grid == 4,
        # With an offset of whole blocks the diagonal runs through every partial block's
        # corners, where the skip leaves out only hidden keys.
        diag_skip_offset_whole_blocks=lambda p: bool(p.diag_skip) and _diag_offset(p) != 0 == _diag_offset(p) % (
            p.blocks.block_q),
        diag_skip_over_visible_keys=_diag_skip_drops_visible_keys,
        diag_skip_kv_blocks_several=lambda p: bool(p.diag_skip) and p.blocks.block_kv < p.kv_len,
        dkv_reuse_scaled_q=lambda p: p.dkv_reuse_scaled_q,
        # The base-2 path multiplies q by log2(e) in q's dtype: in bfloat16 that rounding is
        # a relative error of the logits that large logits make large in the probabilities.
        base2_exp_large_bf16_logits=lambda p: p.use_base2_exp and p.dtype == "bfloat16" and p.values == "large",
        every_key_hidden=lambda p: not classes.head_masks(p).any(),
    ) + bugclasses.numbers("soft_cap", lambda p: p.soft_cap, ("in (0, 1)", "one", "above 1")).classes + PAIRS
        + values_by_dtype() + bugclasses.presences(segment_ids=lambda p: p.segments != "none",
                                                   attn_logits_soft_cap=lambda p: p.soft_cap is not None))
    fixed_parameters = {
        **SplashSpec.fixed_parameters,
        "config.use_fused_bwd_kernel": "SplashConfig refuses the unfused backward (its invalid call)",
        "config.block_q_dq": "kept by SplashConfig for compatibility: the fused backward has no dq blocks",
        "config.block_kv_dq": "kept by SplashConfig for compatibility: the fused backward has no dq blocks",
        "config.q_prescaled_log2e": "changes the convention: q arrives multiplied by log2(e) and dq, dk are "
                                    "returned with respect to that q",
        "config.max_logit_const": "a caller's bound on the logits, replacing the running max: outside the "
                                  "convention (no bound holds for every drawn value distribution)",
        "config.dropout_rate": "dropout draws from a PRNG key: no float64 oracle of its random mask",
        "config.dropout_block_q": "dropout's canonical grid: dropout is not drawn",
        "config.dropout_block_kv": "dropout's canonical grid: dropout is not drawn",
        "config.fwd_cost_estimate": "a scheduling hint for XLA: changes no value",
        "config.bwd_cost_estimate": "a scheduling hint for XLA: changes no value",
        "config.residual_checkpoint_name": "a name for jax.checkpoint policies: changes no value",
        "config.interpret": SplashSpec.fixed_parameters["interpret"],
        "partial_mask_blocks_dtype": "the storage of the mask's partial blocks (int8 holds a bool exactly)",
        **parameters.outside_convention("config.attn_logits_soft_cap", ("negative", "zero"),
                                        SOFT_CAP_IS_POSITIVE),
    }
    expectations = ()

    def cases(self):
        return splash_config_cases()

    def _kernel(self, impl, p: SplashConfigParams, factory=None):
        module = impl_module(impl)
        factory = factory or (impl if p.api == "mha" else module.make_splash_mqa)
        layouts = {f"{x}_layout": module.QKVLayout[name] for x, name in zip("qkv", p.layouts)}
        config = module.SplashConfig(
            **p.blocks.given(), **layouts, attn_logits_soft_cap=p.soft_cap, fuse_reciprocal=p.fuse_reciprocal,
            use_base2_exp=p.use_base2_exp, dq_reduction_steps=p.dq_reduction_steps,
            num_stacked_q_heads=p.num_stacked_q_heads, use_experimental_scheduler=p.use_experimental_scheduler,
            qk_diag_skip="qk" in p.diag_skip, sv_diag_skip="sv" in p.diag_skip, qk_diag_grid=p.qk_diag_grid,
            dkv_reuse_scaled_q=p.dkv_reuse_scaled_q)
        mask = build(module.mask_lib, p.masks[0], (p.q_len, p.kv_len))
        return factory(mask, config=config, q_seq_shards=p.q_seq_shards, downcast_smem_data=p.downcast_smem_data,
                       **mask_value_of(p))

    @staticmethod
    def _mask_info_spec(p):
        # A 2-D mask's block info has no head axis: a caller sharding heads replicates it.
        return P(None) if p.head_shards > 1 else P("shards")

    def invalid_calls(self, impl):
        return invalid_splash_config_calls(impl)


def invalid_splash_config_calls(impl) -> list[InvalidCall]:
    """The shared splash invalid calls through a 2-D mask and a SplashConfig, and the
    SplashConfig's own."""
    module = impl_module(impl)
    mask_lib = module.mask_lib
    h, s = INVALID_HEADS, INVALID_LEN
    causal = mask_lib.CausalMask((s, s))
    fused = {name: size for name, size in FULL_BLOCKS.items() if name not in ("block_q_dq", "block_kv_dq")}

    def config(**changes):
        return module.SplashConfig(**{**fused, **changes})

    def make(mask=causal, *, q_seq_shards=1, **changes):
        return impl(mask, config=config(**changes), q_seq_shards=q_seq_shards)

    x = jnp.zeros((h, s, INVALID_DIM), jnp.float32)
    return invalid_calls_through(make, module, mask_shape=(s, s)) + [
        InvalidCall("mask_3d", lambda: make(np.ones((h, s, s), bool)), ValueError,
                    r"mask shape"),
        InvalidCall("unfused_backward", lambda: config(use_fused_bwd_kernel=False), ValueError, r"fused"),
        InvalidCall("dq_reduction_steps_unsupported", lambda: config(dq_reduction_steps=2), ValueError,
                    r"dq_reduction_steps"),
        InvalidCall("diag_skip_blocks_not_square", lambda: config(block_kv=256, qk_diag_skip=True), ValueError,
                    r"qk_diag_skip"),
        InvalidCall("diag_skip_mask_not_causal", lambda: make(mask_lib.FullMask((s, s)), sv_diag_skip=True),
                    ValueError, r"sv_diag_skip"),
        InvalidCall("diag_grid_not_power_of_two", lambda: config(qk_diag_skip=True, qk_diag_grid=3), ValueError,
                    r"qk_diag_grid"),
        InvalidCall("stacked_heads_not_dividing", lambda: make(num_stacked_q_heads=3)(x, x, x), ValueError,
                    r"num_stacked_q_heads"),
        InvalidCall("dropout_rate_one", lambda: config(dropout_rate=1.0), ValueError, r"dropout_rate"),
        InvalidCall("prescaled_q_without_exp2", lambda: config(q_prescaled_log2e=True, use_base2_exp=False),
                    ValueError, r"q_prescaled_log2e"),
    ]


SPEC = SplashConfigSpec()
