"""``emulated_tpu(device_kind)``: the TPU generation a backend emulates (entered by the
interpret backends' ``Backend.context`` and by ``backends.export_for_tpu``).

jax has two ways of asking "which TPU is this": ``jax._src.tpu_info.get_device_kind()``
honours ``jax.sharding.use_abstract_mesh`` (Mosaic lowering, ``tpu-lower``), but some of
jax's bundled kernels read ``jax.devices()[0].device_kind`` directly (ragged paged
attention's tuned block sizes: ``tuned_block_sizes.py`` ``get_tpu_version``/
``get_device_name``), which on CPU says "cpu" and makes default block sizes raise ``TPU
version must be 4 or higher``. Inside the block, those modules (``DEVICE_KIND_READERS``, and
any loaded copy of them: a module with jax's ``jax`` and one of ``READER_FUNCTIONS``, such
as a team's fork of ragged paged attention) see ``jax.devices()`` whose devices report the
emulated ``device_kind``; their own code runs unchanged. And ``pltpu.get_tpu_info()``, which
kernels ask for VMEM capacity (tpu-inference's ragged paged attention v3 does, for its
default ``vmem_limit_bytes``), answers for the emulated generation where no abstract mesh
names one: ``jax._src.tpu_info.get_device_kind`` and ``get_num_device_cores`` defer to an
abstract mesh as before, and otherwise give the emulated kind and one core (what
``backends.tpu_mesh`` says), and ``get_tpu_info``'s cache is cleared on entry and exit. An
abstract mesh itself is not entered: it would nest the CPU meshes of ``shard_map``
kernels.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator

from attncheck.interpret_compat.install import _lock

# Modules of jax's bundled kernels that ask ``jax.devices()[0].device_kind`` (not the
# abstract mesh) which TPU they run on. Absent modules are ignored.
DEVICE_KIND_READERS = (
    "jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes",
    "jax.experimental.pallas.ops.tpu.megablox.common",
)
# The functions by which those modules ask: a loaded module that defines one and holds jax
# as ``jax`` is a copy of one of them.
READER_FUNCTIONS = ("get_tpu_version", "get_device_name", "tpu_kind")


def _readers(jax_module) -> list:
    """jax's reader modules and every loaded copy of them."""
    modules = []
    for name in DEVICE_KIND_READERS:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            continue
    copies = [m for m in list(sys.modules.values()) if getattr(m, "jax", None) is jax_module
              and any(callable(getattr(m, f, None)) for f in READER_FUNCTIONS)]
    return list(dict.fromkeys(modules + copies))


class _EmulatedDevice:
    """A device that reports another ``device_kind``; everything else is the real one's."""

    def __init__(self, device, device_kind: str):
        self._device = device
        self.device_kind = device_kind

    def __getattr__(self, name):
        return getattr(self._device, name)

    def __repr__(self):
        return f"{self._device!r} (emulating {self.device_kind})"


class _JaxWithEmulatedDevices:
    """Stands for the ``jax`` module inside a reader module: ``devices()`` reports the
    emulated kind, every other attribute is jax's own."""

    def __init__(self, jax_module, device_kind: str):
        self._jax = jax_module
        self._device_kind = device_kind

    def devices(self, *args, **kwargs):
        return [_EmulatedDevice(d, self._device_kind) for d in self._jax.devices(*args, **kwargs)]

    def __getattr__(self, name):
        return getattr(self._jax, name)


@contextlib.contextmanager
def emulated_tpu(device_kind: str | None) -> Iterator[None]:
    """Within the block, jax's kernels that read ``jax.devices()[0].device_kind`` see
    ``device_kind`` (e.g. "TPU v5 lite"). ``None``: nothing changes (native backends)."""
    if device_kind is None:
        yield
        return
    if not isinstance(device_kind, str) or "TPU" not in device_kind:
        raise ValueError(f"emulated_tpu: device_kind must name a TPU (e.g. 'TPU v5 lite'), got {device_kind!r}")
    import jax
    from jax._src import mesh as mesh_lib
    from jax._src import tpu_info

    def abstract_device():
        return mesh_lib.get_abstract_mesh().abstract_device

    def get_device_kind() -> str:
        return abstract_device().device_kind if abstract_device() else device_kind

    def get_num_device_cores() -> int:
        return abstract_device().num_cores if abstract_device() else 1

    saved = []
    with _lock:
        for module in _readers(jax):
            if hasattr(module, "jax"):
                saved.append((module, "jax", module.jax))
                module.jax = _JaxWithEmulatedDevices(jax, device_kind)
        for name, answer in (("get_device_kind", get_device_kind), ("get_num_device_cores", get_num_device_cores)):
            saved.append((tpu_info, name, getattr(tpu_info, name)))
            setattr(tpu_info, name, answer)
        tpu_info.get_tpu_info.cache_clear()
    try:
        yield
    finally:
        with _lock:
            for module, name, original in reversed(saved):
                setattr(module, name, original)
            tpu_info.get_tpu_info.cache_clear()
