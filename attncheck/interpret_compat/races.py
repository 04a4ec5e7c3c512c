"""``empty_accesses()`` (entered by ``Backend.context``): the race detector holds that an
access of no elements touches nothing.

jax 0.12.0.1's ``race_detection_state._slices_overlap`` compares starts only ("Do we need
to handle zero-length slices?"), so a zero-length DMA whose start lies inside another
DMA's range is reported as a race with it. Kernels issue such DMAs as a matter of course:
tpu-inference's v3 copies ``clip(kv_left - i * page_size, 0, page_size)`` tokens of every
page of a kv block, zero for the pages past a sequence's end, into the block its next
fetch fills. An access of at least one element is judged as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from attncheck.interpret_compat.install import _installed


def _is_empty(index) -> bool:
    """A slice of no elements (an integer index or a whole axis holds at least one)."""
    if not isinstance(index, slice) or index == slice(None):
        return False
    return int(index.stop) <= (0 if index.start is None else int(index.start))


@contextlib.contextmanager
def empty_accesses() -> Iterator[None]:
    """Within the block, two ranges overlap only where neither is empty on some axis and
    every axis overlaps, as jax judges non-empty ones."""
    from jax._src.pallas.mosaic.interpret import race_detection_state as module

    def install():
        original = module._slices_overlap

        def _slices_overlap(index1, index2):
            return not (_is_empty(index1) or _is_empty(index2)) and original(index1, index2)

        module._slices_overlap = _slices_overlap
        return lambda: setattr(module, "_slices_overlap", original)

    with _installed("empty_accesses", install):
        yield
