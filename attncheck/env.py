"""The process environment of an attncheck run: platform and simulated device count.

Set only when a run asks for attncheck (the pytest plugin is inert otherwise), before jax
creates its backends: XLA reads the device count when the CPU backend starts.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

# Ring kernels are verified on 1, 2, 4 and 8 simulated CPU devices.
HOST_DEVICE_COUNT = 8
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# "1": a TPU is there (use it), "0": ignore any TPU; unset: detect.
TPU_OVERRIDE_ENV = "ATTNCHECK_TPU"


def tpu_present() -> bool:
    """Whether this machine has a TPU jax can use, without starting a jax backend: libtpu is
    installed and the kernel exposes accelerator devices. ``ATTNCHECK_TPU`` overrides."""
    override = os.environ.get(TPU_OVERRIDE_ENV, "")
    if override in ("0", "1"):
        return override == "1"
    if importlib.util.find_spec("libtpu") is None:
        return False
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def _backends_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(bridge is not None and getattr(bridge, "_backends", None))


def configure() -> list[str]:
    """Pin the CPU platform unless a TPU is present (jax would probe for accelerators on
    every worker start) and ask XLA for HOST_DEVICE_COUNT CPU devices. A platform or
    device count the user chose wins. Returns warnings: what could not be applied because
    jax had already started its backends."""
    warnings = []
    if not tpu_present() and "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules and not _backends_started():
            import jax

            jax.config.update("jax_platforms", "cpu")
    if DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
        if _backends_started():
            warnings.append(f"jax started its backends before attncheck could ask for "
                            f"{HOST_DEVICE_COUNT} CPU devices; cases on more devices than there are will fail")
        else:
            import chex

            chex.set_n_cpu_devices(HOST_DEVICE_COUNT)
    return warnings
