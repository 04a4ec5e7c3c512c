"""``vmapped_grids()`` (entered by ``Backend.context``): a ``pallas_call`` under ``jax.vmap``
interprets as Mosaic compiles it.

vmap adds a grid dimension per batched axis (``grid_mapping.vmapped_dims``) but leaves the
kernel's ``dimension_semantics`` as its author wrote them, one per dimension of the
unbatched grid. Mosaic's lowering inserts ``"parallel"`` at each vmapped dimension; the
interpreter (jax 0.12.0.1) zips the short tuple with the whole grid and stops
("safe_zip() argument 1 has length 2 but argument 0 has length 3"). tokamax vmaps its
splash kernel over the batch, so without this none of its calls interpret.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from attncheck.interpret_compat.install import _installed


def _with_vmapped_dims(semantics: tuple, grid_mapping) -> tuple:
    """The semantics of the whole grid: ``"parallel"`` at each vmapped dimension, as
    Mosaic's lowering reads them (``MosaicGridMapping``)."""
    given = iter(semantics)
    return tuple("parallel" if i in grid_mapping.vmapped_dims else next(given)
                 for i in range(len(grid_mapping.grid)))


@contextlib.contextmanager
def vmapped_grids() -> Iterator[None]:
    """Within the block, the interpreter reads a vmapped kernel's dimension semantics with
    its vmapped dimensions parallel; any other kernel's it reads unchanged."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as module

    def install():
        original = module.interpret_pallas_call

        def interpret_pallas_call(*args, grid_mapping, compiler_params, **params):
            semantics = getattr(compiler_params, "dimension_semantics", None)
            if semantics is not None and grid_mapping.vmapped_dims \
                    and len(semantics) + len(grid_mapping.vmapped_dims) == len(grid_mapping.grid):
                compiler_params = dataclasses.replace(
                    compiler_params, dimension_semantics=_with_vmapped_dims(tuple(semantics), grid_mapping))
            return original(*args, grid_mapping=grid_mapping, compiler_params=compiler_params, **params)

        module.interpret_pallas_call = interpret_pallas_call
        return lambda: setattr(module, "interpret_pallas_call", original)

    with _installed("vmapped_grids", install):
        yield
