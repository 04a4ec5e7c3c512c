"""tokamax (``PIN``) for the families it fits: its ``dot_product_attention``, one gate
implementation per path it ships, and its splash rewrite for ``splash_attention_config``::

    --attncheck-impl dot_product_attention=attncheck.third_party.tokamax:dot_product_attention_mosaic
    --attncheck-impl dot_product_attention=attncheck.third_party.tokamax:dot_product_attention_xla
    --attncheck-impl splash_attention_config=attncheck.third_party.tokamax:make_splash_mha

tokamax installs beside the pinned jax (``pip install 'attncheck[third-party]'``). Its
``mosaic`` path is the Pallas TPU kernel; off a TPU tokamax refuses it ("Not supported on
cpu") unless its device check is bypassed (``bypass_device_check``), which is what the
interpret backends need: they run it in forced interpret mode. Without the bypass,
``tokamax.dot_product_attention`` with its default implementations falls back to XLA,
and the interpret backends record that no Pallas kernel ran. Its splash kernel checks no
device: the interpret backends run it as shipped.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata

from attncheck import domain, third_party

PIN = third_party.Pin("tokamax", "0.0.17", "tokamax")


def load():
    """The installed tokamax package, at ``PIN``'s version."""
    try:
        installed = importlib.metadata.version(PIN.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise third_party.Unavailable(f"{PIN.distribution} is not installed (pip install "
                                      f"'attncheck[third-party]', which pins {PIN.requirement})") from None
    if installed != PIN.version:
        raise third_party.Unavailable(f"{PIN.distribution} {installed} is installed; attncheck verifies "
                                      f"{PIN.requirement}")
    return importlib.import_module(PIN.top_level)


def _implementation(name: str, *, bypass_device_check: bool):
    """tokamax's implementation object of that name; with ``bypass_device_check`` its
    forward and its VJP op both skip the device check (the VJP op runs when the gradient
    is traced, outside any context the forward set)."""
    found = load().dot_product_attention.__globals__["IMPLEMENTATIONS"][name]
    if not bypass_device_check:
        return found
    return dataclasses.replace(found, bypass_device_check=True,
                               vjp=dataclasses.replace(found.vjp, bypass_device_check=True))


def _path(name: str, *, bypass_device_check: bool):
    def dot_product_attention(query, key, value, bias=None, mask=None, **kwargs):
        implementation = _implementation(name, bypass_device_check=bypass_device_check)
        return load().dot_product_attention(query, key, value, bias, mask, implementation=(implementation,),
                                            **kwargs)
    dot_product_attention.__name__ = dot_product_attention.__qualname__ = f"dot_product_attention_{name}"
    dot_product_attention.__doc__ = f"tokamax's dot_product_attention through its {name!r} implementation."
    return dot_product_attention


# Its blocks are multiples of 128 (the heuristic config takes 128 each way, and its Config
# admits no other size), so a sequence must be too.
dot_product_attention_mosaic = domain.declare(sequence_multiple=128)(_path("mosaic_tpu", bypass_device_check=True))
dot_product_attention_xla = _path("xla", bypass_device_check=False)


SPLASH = "tokamax._src.ops.experimental.tpu.splash_attention.splash_attention_kernel"


def __getattr__(name: str):
    # tokamax's own make_splash_mha (its module supplies the convention's types), loaded
    # only when asked for: importing this module needs no tokamax.
    if name != "make_splash_mha":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    load()
    return importlib.import_module(SPLASH).make_splash_mha
