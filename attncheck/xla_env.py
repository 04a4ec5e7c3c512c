"""Process environment that must be in place before jax is imported."""

from __future__ import annotations

import os
import sys
import warnings

# Ring kernels are verified on 1, 2, 4 and 8 simulated CPU devices.
HOST_DEVICE_COUNT = 8
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def configure_before_jax_import() -> None:
    """Ask XLA for HOST_DEVICE_COUNT CPU devices, keeping any other XLA_FLAGS the user set.

    A device count the user already chose wins; so does an already imported jax, which
    cannot be changed any more (we warn, since multi-device cases will then be skipped).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_COUNT_FLAG not in flags:
        if "jax" in sys.modules:
            warnings.warn("attncheck: jax was imported before the attncheck plugin; "
                          f"{_DEVICE_COUNT_FLAG} could not be applied", stacklevel=2)
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={HOST_DEVICE_COUNT}".strip()
    # Pinning the CPU platform avoids jax probing for accelerators on every worker start;
    # a TPU runner exports ATTNCHECK_TPU=1 so jax picks the TPU.
    if os.environ.get("ATTNCHECK_TPU", "") != "1":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
