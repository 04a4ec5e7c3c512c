"""tpu-inference's ragged paged attention v3, from its wheel (``PIN``), as gate
implementations::

    --attncheck-impl ragged_paged_attention_v3=attncheck.third_party.tpu_inference:ragged_paged_attention_v3
    --attncheck-impl ragged_paged_attention_v3=attncheck.third_party.tpu_inference:ragged_paged_attention_v3_hd64

The wheel's ``tpu_inference`` package is served as ``attncheck.third_party.tpu_inference_wheel``
(``WheelModules``): its kernel modules run as shipped. ``tpu_inference.logger`` and
``tpu_inference.utils`` (which import vllm) are shims: a logger with the two methods the
kernels call, and the wheel's own ``get_device_name``.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from jax import lax

from attncheck import domain, third_party

PIN = third_party.Pin("tpu-inference", "0.32.0", "tpu_inference")
PACKAGE = f"{__name__}_wheel"
V3 = f"{PACKAGE}.kernels.ragged_paged_attention.v3"

_LOGGER_SHIM = '''
import logging


class _Logger(logging.LoggerAdapter):
    def warning_once(self, *args, **kwargs):
        self.warning(*args, **kwargs)

    def info_once(self, *args, **kwargs):
        self.info(*args, **kwargs)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
'''

# Exported name -> (module under the v3 package, function).
_KERNELS = {"ragged_paged_attention_v3": ("kernel", "ragged_paged_attention"),
            "ragged_paged_attention_v3_reference": ("kernel", "ref_ragged_paged_attention"),
            "get_kv_cache_shape": ("kernel", "get_kv_cache_shape")}


def module(name: str):
    """A module of the v3 package (``kernel``, ``util``, ...), loaded from the pinned wheel."""
    shims = {"logger": _LOGGER_SHIM,
             "utils": "import jax\n\n\n" + third_party.function_source(PIN, "tpu_inference/utils.py",
                                                                        "get_device_name")}
    third_party.install(PIN, PACKAGE, shims)
    return importlib.import_module(f"{V3}.{name}")


def __getattr__(name: str):
    if name == "ragged_paged_attention_v3_hd64":
        # Loaded now, not at its first call: a backend's emulated TPU generation reaches the
        # modules that ask which TPU they are on when it is entered (interpret_compat).
        module("kernel_hd64")
        return _ragged_paged_attention_v3_hd64
    if name not in _KERNELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, function = _KERNELS[name]
    return getattr(module(module_name), function)


# kernel_hd64's cache holds a kv head's K and V side by side in the 128 lanes of one head
# slot ([P, page, Hkv / packing, packing, K(64) | V(64)]), where the family's convention (the
# main kernel's) holds them in two slots of combined heads, K at 2h and V at 2h + 1, each
# padded to 128 lanes. The adapter moves the K/V lanes between the two, and only them.
HD64_LANES = 64


def _hd64_cache(cache, num_kv_heads: int):
    pages, page, words, per_word, lanes = cache.shape
    combined = cache.reshape(pages, page, words * per_word, lanes)[:, :, :2 * num_kv_heads, :HD64_LANES]
    heads = jnp.concatenate([combined[:, :, 0::2], combined[:, :, 1::2]], axis=-1)
    slots = -(-num_kv_heads // per_word) * per_word
    heads = jnp.pad(heads, ((0, 0), (0, 0), (0, slots - num_kv_heads), (0, 0)))
    return heads.reshape(pages, page, slots // per_word, per_word, 2 * HD64_LANES)


def _convention_cache(updated, before, cache, num_kv_heads: int):
    """The updated hd64 cache in the convention's layout. A token slot the kernel wrote is
    the convention's new token: its K/V and zeros in every pad (lanes and combined heads);
    every other slot keeps what the convention's cache held there."""
    pages, page, words, per_word, lanes = cache.shape
    heads = updated.reshape(pages, page, -1, 2 * HD64_LANES)[:, :, :num_kv_heads]
    combined = jnp.stack([heads[..., :HD64_LANES], heads[..., HD64_LANES:]], axis=3).reshape(
        pages, page, 2 * num_kv_heads, HD64_LANES)
    bits = jnp.dtype(f"uint{8 * cache.dtype.itemsize}")
    written = (lax.bitcast_convert_type(updated, bits) != lax.bitcast_convert_type(before, bits)).reshape(
        pages, page, -1).any(axis=-1)
    flat = cache.reshape(pages, page, words * per_word, lanes)
    new_token = jnp.zeros_like(flat).at[:, :, :2 * num_kv_heads, :HD64_LANES].set(combined)
    kept = flat.at[:, :, :2 * num_kv_heads, :HD64_LANES].set(combined)
    return jnp.where(written[:, :, None, None], new_token, kept).reshape(cache.shape)


@domain.declare(takes={"head_dim": HD64_LANES, "out_dtype": None})
def _ragged_paged_attention_v3_hd64(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                   *, sm_scale=1.0, sliding_window=None, soft_cap=None, mask_value=None,
                                   q_scale=None, k_scale=None, v_scale=None, chunk_prefill_size=None,
                                   d_block_sizes=None, p_block_sizes=None, m_block_sizes=None,
                                   vmem_limit_bytes=None):
    """The wheel's ``kernel_hd64.ragged_paged_attention_hd64`` (head_dim 64; its output in
    the queries' dtype) in the family's convention: the cache converted to its layout and
    back around the call. It runs one kernel for every kind of sequence, with one block
    size pair: the mixed kernel's ``m_block_sizes`` (bq_sz, bkv_sz, ...) give it; the decode
    and prefill kernels' have no counterpart in it."""
    del d_block_sizes, p_block_sizes
    blocks = {} if m_block_sizes is None else dict(
        num_queries_per_block=m_block_sizes[0], num_kv_pages_per_block=m_block_sizes[1] // kv_cache.shape[1])
    options = {} if mask_value is None else {"mask_value": mask_value}
    num_kv_heads, kv_cache = keys.shape[1], jnp.asarray(kv_cache)
    out, updated = module("kernel_hd64").ragged_paged_attention_hd64(
        queries, keys, values, _hd64_cache(kv_cache, num_kv_heads), kv_lens, page_indices, cu_q_lens, distribution,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, q_scale=q_scale, k_scale=k_scale,
        v_scale=v_scale, chunk_prefill_size=chunk_prefill_size, vmem_limit_bytes=vmem_limit_bytes, **blocks,
        **options)
    # Waited for before the eager ops below: dispatched while the interpreted kernel still
    # runs (a second call of it, compiled), they deadlock with its simulated cores on CPU.
    out, updated = jax.block_until_ready((out, updated))
    # The kernel donated the cache it was given: what it held is converted again.
    return out, _convention_cache(updated, _hd64_cache(kv_cache, num_kv_heads), kv_cache, num_kv_heads)


_ragged_paged_attention_v3_hd64.__name__ = "ragged_paged_attention_v3_hd64"
_ragged_paged_attention_v3_hd64.__qualname__ = "ragged_paged_attention_v3_hd64"
