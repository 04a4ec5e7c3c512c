"""Findings upstream can act on: each deviation the gate found in the kernels jax ships
(and in third-party kernels: ``Finding.package``), with a standalone reproducer and an
issue draft beside this module.

``repro_<id>.py`` needs only jax and numpy (and the third-party package; never attncheck, except
on CPU for a kernel the interpreter cannot run alone: ``Finding.fetched_by``), builds its input literally,
calls the kernel as its users do in interpret mode on CPU, prints the kernel against a
plain reference at the worst element, and exits 1 with an AssertionError while the
deviation is present (0 once it is fixed). ``issue_<id>.md`` is the report a jax
maintainer can act on: environment, reproducer, expected vs actual, the kernel's lines,
why it matters, a suggested fix. ``attncheck findings`` lists them; ``attncheck findings
export DIR`` writes the pairs; ``tests/selftest/test_findings.py`` runs every reproducer
on the pinned jax, and says "fixed upstream" of one that stops reproducing (its
expectation goes stale in the gate too).
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

HERE = pathlib.Path(__file__).resolve().parent
SINCE = "jax 0.12.0.1"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One deviation of a kernel jax ships. ``held_as``: how the gate holds it: the family's
    declared deviation (``kind:name``, ``attncheck.expectations``) or its contract (the
    kernel's property the oracle is given); ``by_design`` ones are behaviour the kernel's
    own reference shares, stated as such and not filed."""

    id: str
    family: str
    kernel: str  # the module its users call
    title: str
    source: str  # file and lines in jax 0.12.0.1, relative to the jax package
    held_as: str
    since: str = SINCE
    by_design: bool = False
    # A third-party kernel's: the package its reproducer imports besides jax and numpy, and
    # the table of expectations (from the repository root) that declares its deviation.
    package: str | None = None
    declared_in: str | None = None
    # A kernel jax's interpreter cannot run by itself, from a package that cannot be imported
    # on CPU: the attncheck.third_party module whose ``PIN`` fetches its files. On CPU its
    # reproducer takes them from there and runs under attncheck.interpret_compat; on a TPU it
    # imports the package alone.
    fetched_by: str | None = None

    @property
    def reproducer(self) -> pathlib.Path | None:
        path = HERE / f"repro_{self.id}.py"
        return path if path.is_file() else None

    @property
    def issue(self) -> pathlib.Path | None:
        path = HERE / f"issue_{self.id}.md"
        return path if path.is_file() else None


_SPLASH = "jax.experimental.pallas.ops.tpu.splash_attention"
_PAGED = "jax.experimental.pallas.ops.tpu.paged_attention"
_FLASH = "jax.experimental.pallas.ops.tpu.flash_attention"
_V3 = "tpu_inference.kernels.ragged_paged_attention.v3.kernel"
_TOKAMAX_SPLASH = "tokamax._src.ops.experimental.tpu.splash_attention.splash_attention_kernel"
FINDINGS = (
    Finding("rpa_empty_sequence_prefetch", "ragged_paged_attention", "jax.experimental.pallas.ops.tpu."
            "ragged_paged_attention", "a sequence with q_len = kv_len = 0 makes the next sequence attend to the "
            "empty sequence's KV page (the kv prefetch chain gets out of step); dynamic_validate_inputs accepts it",
            "experimental/pallas/ops/tpu/ragged_paged_attention/kernel.py 404-409, 591-619, 658-665",
            "bug class empty_seq_before_another: jax's kernel fails it as --attncheck-impl"),
    Finding("rpa_one_kv_scale", "ragged_paged_attention", "jax.experimental.pallas.ops.tpu.ragged_paged_attention",
            "a k_scale without a v_scale (or the reverse), the cache's dtype not the queries', stops the kernel at a "
            "bare assert k.dtype == v.dtype; static_validate_inputs accepts the call",
            "experimental/pallas/ops/tpu/ragged_paged_attention/kernel.py 476, 630-637",
            "bug class one_kv_scale_cache_unlike_queries: jax's kernel fails it as --attncheck-impl"),
    Finding("splash_backward_block_nan", "splash_attention", _SPLASH, "a forward q block without visible keys "
            "inside a larger backward q block makes dk, dv (or dq) NaN",
            "experimental/pallas/ops/tpu/splash_attention/splash_attention_kernel.py 841-851, 1794-1804, 2288-2289",
            "bug_class:forward_nan_rows_reach_backward"),
    Finding("splash_kv_longer_than_mask", "splash_attention", _SPLASH, "a kernel built for a mask of K keys, "
            "called with more keys, attends to the first K only, without an error",
            "experimental/pallas/ops/tpu/splash_attention/splash_attention_kernel.py 942-972, 1135-1140",
            "invalid_call:kv_longer_than_mask"),
    Finding("splash_q_seq_shards_full_mask", "splash_attention", _SPLASH, "one mask without partial blocks and "
            "q_seq_shards > 1: make_splash_mha raises \"need at least one array to concatenate\"",
            "experimental/pallas/ops/tpu/splash_attention/splash_attention_mask_info.py 929-939",
            "bug_class:q_seq_shards_without_partial_blocks"),
    Finding("splash_q_seq_shard_without_keys", "splash_attention", _SPLASH, "a q shard that sees no key "
            "(q_seq_shards > 1, or one shard under a mask hiding every key): make_splash_mha stops at a bare assert",
            "experimental/pallas/ops/tpu/splash_attention/splash_attention_mask_info.py 863-873",
            "bug_class:q_seq_shard_without_keys"),
    Finding("paged_inline_false_empty_sequence", "paged_attention", _PAGED, "with inline_seq_dim=False the output "
            "row of a length-0 sequence is never written (NaN, or the previous sequence's output)",
            "experimental/pallas/ops/tpu/paged_attention/paged_attention_kernel.py 235-256, 298-301",
            "bug_class:zero_length_not_inline"),
    Finding("paged_float_pages_bfloat16", "paged_attention", _PAGED, "float32 K/V pages are computed in bfloat16 "
            "(undocumented; relative error 2.2e-3 where float32 attention has 5.8e-7)",
            "experimental/pallas/ops/tpu/paged_attention/paged_attention_kernel.py 90-116, 270-272",
            "contract:bfloat16_pages (the oracle gets the pages rounded to bfloat16)"),
    Finding("flash_nonfinite_bias", "flash_attention", _FLASH, "NaN for a row whose visible ab is all -inf, for a "
            "-inf entry times a scale <= 0, and from a non-finite ab entry the mask hides: ab is added before the "
            "mask and scaled with the logits, as in jax's own mha_reference",
            f"experimental/pallas/ops/tpu/flash_attention.py ({_FLASH}.mha_reference)",
            "bug classes bias_neg_inf_row_empty, bias_neg_inf_nonpositive_scale, bias_nonfinite_where_masked: "
            "this repository's kernel promises otherwise",
            by_design=True),
    Finding("flash_absent_segment_rows", "flash_attention", _FLASH, "a causal row whose segment is absent from "
            "the keys averages the kv blocks it happens to visit (a mask value, not -inf, as in mha_reference)",
            f"experimental/pallas/ops/tpu/flash_attention.py ({_FLASH}.mha_reference)",
            "bug classes causal_absent_rows_skip_blocks, causal_neg_inf_row_falls_back: this repository's kernel "
            "promises otherwise", by_design=True),
    Finding("tokamax_xla_q_padding", "dot_product_attention", "tokamax.dot_product_attention (implementation='xla')",
            "rows past query_seq_lengths are the mean of v where jax.nn gives 0 (and their cotangent reaches dv): "
            "query_seq_lengths becomes mask.q_end, a fully masked row",
            "tokamax/_src/ops/attention/api.py 140-149, base.py 235-236", "bug_class:q_padding",
            since="tokamax 0.0.17", package="tokamax", declared_in="tests/third_party/tokamax.toml"),
    *(Finding(f"tokamax_splash_{name}", "splash_attention_config", _TOKAMAX_SPLASH, title, source, held_as,
              since="tokamax 0.0.17", package="tokamax", declared_in="tests/third_party/tokamax.toml")
      for name, title, source, held_as in (
          ("diag_skip_offset", "qk_diag_skip or sv_diag_skip with a CausalMask whose offset is not a whole number "
           "of blocks skips visible sub-tiles: out and gradients silently wrong (SplashConfig promises it raises)",
           "splash_attention_kernel.py 739-770, 2894-2903", "bug_class:diag_skip_over_visible_keys"),
          ("backward_block_nan", "as in jax's splash: a forward q block without visible keys inside a larger "
           "backward q block makes dq, dk, dv NaN", "splash_attention_kernel.py 608-958, 1871-2193",
           "bug_class:forward_nan_rows_reach_backward"),
          ("empty_mask", "a mask that hides every key: the kernel's call stops at an IndexError from inside jax's "
           "scatter, naming no argument", "splash_attention_mask_info.py 42-45, splash_attention_kernel.py 1255",
           "bug_class:every_key_hidden"),
          ("kv_longer_than_mask", "a kernel built for a mask of K keys takes a call with more keys without an "
           "error (a FullMask then attends to every key)", "splash_attention_kernel.py 1183-1236",
           "invalid_call:kv_longer_than_mask"),
          ("base2_exp_bf16", "use_base2_exp (the default) rounds q * log2(e) to bfloat16: with large logits out "
           "and its gradients are about ten times further from exact than the natural-exp path's",
           "splash_attention_kernel.py 722-726, 1800-1804, 1979-1985", "bug_class:base2_exp_large_bf16_logits"))),
    *(Finding(f"tpu_inference_v3_{name}", "ragged_paged_attention_v3", _V3, title, source, held_as,
              since="tpu-inference 0.32.0", package="tpu_inference", declared_in="tests/third_party/tpu_inference.toml",
              fetched_by="attncheck.third_party.tpu_inference")
      for name, title, source, held_as in (
          ("windowed_cache_write", "with a sliding window, the new K/V of a sequence whose queries span several q "
           "blocks do not all reach the updated cache (the output stays right): kv blocks before the last q block's "
           "window are never written", "v3/kernel.py 939-942, 984-992",
           "bug_class:windowed_new_tokens_over_several_q_blocks"),
          ("out_dtype_wider", "out_dtype=float32 with bfloat16 queries stops the call at a reshape error from the "
           "kernel's output store (the output aliases the queries' buffer); static_validate_inputs deletes out_dtype "
           "unchecked", "v3/kernel.py 1083-1089, 1490, 1860-1863", "bug_class:accumulator_wider_than_queries"),
          ("inexact_mask_value_nan", "a mask value bfloat16 rounds away from zero (-1e30) makes a windowed row NaN "
           "when its first compute chunk hides every key: the running max, rounded to the output dtype, lies below "
           "the logits and exp overflows", "v3/kernel.py 496-512, 939-942",
           "bug_class:inexact_mask_value_over_a_hidden_chunk"))),
)


def export(directory: pathlib.Path) -> list[pathlib.Path]:
    """Write each finding's reproducer and issue draft into ``directory``."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for finding in FINDINGS:
        for source in (finding.reproducer, finding.issue):
            if source is not None:
                written.append(pathlib.Path(shutil.copy2(source, directory / source.name)))
    return written
