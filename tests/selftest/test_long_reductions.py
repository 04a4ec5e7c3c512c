"""Long reductions in the working precision: a kernel that accumulates P @ V in bfloat16 is
exact to rounding over a few keys and wrong over thousands whose values are offset from 0
(each term's low bits are lost once the running sum is large), and one whose running softmax
denominator is bfloat16 is wrong after a sink that outweighs the blocks after it. The
families draw such rows (``strategies.LONG_REDUCTION`` keys, v offset by
``strategies.V_OFFSET``, ``strategies.SINK``), and the same tolerance that passes a float32
accumulator fails a bfloat16 one there."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp

from attncheck import strategies as S

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLASS = "long_reduction_offset_values"


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None):
    """jax.nn's attention weights, and P @ V summed key by key in the value dtype (a
    bfloat16 accumulator for bfloat16 inputs)."""
    b, s, kv_heads, h = value.shape
    group = query.shape[2] // kv_heads

    def weights_of_keys(first):
        # jax.nn's output for a value that is 1 at (key first + c, column c): its weights of
        # those keys.
        keys = jnp.arange(s)[:, None] == first + jnp.arange(h)[None, :]
        selector = jnp.broadcast_to(keys[None, :, None, :], value.shape).astype(value.dtype)
        return jax.nn.dot_product_attention(query, key, selector, bias, mask, scale=scale, is_causal=is_causal,
                                            query_seq_lengths=query_seq_lengths,
                                            key_value_seq_lengths=key_value_seq_lengths,
                                            local_window_size=local_window_size)

    weights = jnp.concatenate([weights_of_keys(first) for first in range(0, s, h)], axis=-1)[..., :s]  # [B, T, N, S]
    v = jnp.repeat(value, group, axis=2)  # [B, S, N, H]

    def add_key(total, key_terms):
        p_j, v_j = key_terms  # [B, T, N], [B, N, H]
        return (total + p_j[..., None] * v_j[:, None]).astype(value.dtype), None

    total = jnp.zeros(query.shape[:3] + (h,), value.dtype)
    return jax.lax.scan(add_key, total, (jnp.moveaxis(weights, -1, 0), jnp.moveaxis(v, 1, 0)))[0]


def blockwise_dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None):
    """jax.nn's attention in blocks of 128 keys with an online softmax whose running
    denominator is rounded to the value dtype between blocks (bfloat16 for bfloat16 inputs);
    calls that hide keys go to jax.nn itself."""
    if mask is not None or is_causal or query_seq_lengths is not None or key_value_seq_lengths is not None or (
            local_window_size is not None):
        return jax.nn.dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                                            query_seq_lengths=query_seq_lengths,
                                            key_value_seq_lengths=key_value_seq_lengths,
                                            local_window_size=local_window_size)
    group = query.shape[2] // key.shape[2]
    k, v = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("btnh,bsnh->bnts", query, k, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    m = jnp.full(logits.shape[:-1] + (1,), -jnp.inf)
    l = jnp.zeros_like(m)
    acc = jnp.zeros(logits.shape[:-1] + (v.shape[-1],))
    for start in range(0, logits.shape[-1], 128):
        block = logits[..., start:start + 128]
        m_next = jnp.maximum(m, block.max(axis=-1, keepdims=True))
        p, alpha = jnp.exp(block - m_next), jnp.exp(m - m_next)
        l = (alpha * l + p.sum(axis=-1, keepdims=True)).astype(value.dtype).astype(jnp.float32)
        acc = alpha * acc + jnp.einsum("bnts,bsnh->bnth", p.astype(value.dtype), v[:, start:start + 128],
                                       preferred_element_type=jnp.float32)
        m = m_next
    return jnp.transpose(acc / l, (0, 2, 1, 3)).astype(query.dtype)


def _gate(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_STEP_SUMMARY"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "attncheck", "gate", "--attncheck-kernel", "dot_product_attention",
                           "--attncheck-backend", "xla", "--attncheck-report", str(tmp_path), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    return proc, json.loads((tmp_path / "report.json").read_text())


def test_a_bfloat16_accumulator_of_p_times_v_fails_on_long_offset_rows_only(tmp_path):
    proc, report = _gate(tmp_path, "--attncheck-impl", f"dot_product_attention={__name__}:dot_product_attention",
                         "-k", "matches")
    failing = [r for r in report["records"] if r["outcome"] != "pass"]
    assert proc.returncode != 0 and report["verdict"] == "FAIL", (proc.stdout + proc.stderr)[-3000:]
    assert any(CLASS in r["classes"] for r in failing), [(r["case_id"], r["classes"]) for r in failing]
    # Exact to rounding elsewhere: over few keys, and in float32 (a float32 accumulator).
    assert all(r["seq_len"] >= S.LONG_REDUCTION and r["dtype"] == "bfloat16" for r in failing), [
        (r["case_id"], r["seq_len"], r["dtype"]) for r in failing]
    assert any(r["outcome"] == "pass" and r["seq_len"] < S.LONG_REDUCTION for r in report["records"])


def test_a_bfloat16_running_denominator_fails_on_long_sink_rows_only(tmp_path):
    proc, report = _gate(tmp_path, "--attncheck-impl",
                         f"dot_product_attention={__name__}:blockwise_dot_product_attention", "-k", "matches")
    failing = [r for r in report["records"] if r["outcome"] != "pass"]
    assert proc.returncode != 0 and report["verdict"] == "FAIL", (proc.stdout + proc.stderr)[-3000:]
    assert any("long_reduction_sink" in r["classes"] for r in failing), [(r["case_id"], r["classes"]) for r in failing]
    # Exact to rounding elsewhere: a few blocks' roundings, and float32's.
    assert all(r["seq_len"] >= 4 * S.LONG_REDUCTION and r["dtype"] == "bfloat16" for r in failing), [
        (r["case_id"], r["seq_len"], r["dtype"]) for r in failing]
