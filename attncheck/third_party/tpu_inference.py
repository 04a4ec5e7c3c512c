"""tpu-inference's ragged paged attention v3, from its wheel (``PIN``), as gate
implementations::

    --attncheck-impl ragged_paged_attention_v3=attncheck.third_party.tpu_inference:ragged_paged_attention_v3

The wheel's ``tpu_inference`` package is served as ``attncheck.third_party.tpu_inference_wheel``
(``WheelModules``): its kernel modules run as shipped. ``tpu_inference.logger`` and
``tpu_inference.utils`` (which import vllm) are shims: a logger with the two methods the
kernels call, and the wheel's own ``get_device_name``.
"""

from __future__ import annotations

import importlib

from attncheck import third_party

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
    if name not in _KERNELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, function = _KERNELS[name]
    return getattr(module(module_name), function)
