"""``ref_views()`` (entered by ``Backend.context``): loads and stores through a ref that
was reshaped, bitcast or transposed (``ref.reshape(...)``, ``ref.bitcast(...)``, ``ref.T``),
which the interpreter's ``get``/``swap`` callbacks reject (``to_range`` reads ``.indices`` of
every transform: ``AttributeError: 'ReshapeTransform' object has no attribute 'indices'``);
see ``_view_get``/``_view_swap`` for the exact semantics. It also splits the masked stores
the interpreter misjudges as out of bounds (``_masked_swap``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from attncheck.interpret_compat.install import _installed


def _interpreter():
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return interpret_pallas_call


def _state_types():
    from jax._src.state import indexing, types

    return indexing, types


def _bits(dtype) -> int:
    from jax._src import dtypes

    bits = dtypes.itemsize_bits(np.dtype(dtype))
    # ml_dtypes' 4-bit (and narrower) types take a byte each in NumPy: their packing cannot
    # be mirrored with ndarray.view.
    if bits < 8:
        raise NotImplementedError(f"ref bitcast of {np.dtype(dtype).name}: sub-byte dtypes are not supported")
    return bits


def np_bitcast(x: np.ndarray, dtype) -> np.ndarray:
    """``ref.bitcast(dtype)`` on values, as ``jax._src.state.utils.bitcast`` defines it (and
    Mosaic lays it out): a bitwidth change scales the second-minor dimension, consecutive
    rows packing into one element (row 2a in the low bits of ``out[a]``)."""
    dtype = np.dtype(dtype)
    src, dst = _bits(x.dtype), _bits(dtype)
    if src != dst and x.ndim < 2:
        raise NotImplementedError("Bitcast 1D ref with bitwidth change is not supported.")
    if src != dst and x.shape[-2] * src % dst:
        raise ValueError(f"ref bitcast: second-minor dimension {x.shape[-2]} of {x.dtype} cannot be packed "
                         f"into {dtype}")
    if src < dst:
        ratio = dst // src
        packed = x.reshape(*x.shape[:-2], x.shape[-2] // ratio, ratio, x.shape[-1]).swapaxes(-1, -2)
        return np.ascontiguousarray(packed).view(dtype)[..., 0]
    if src > dst:
        ratio = src // dst
        unpacked = np.ascontiguousarray(x).view(dtype).reshape(*x.shape, ratio)
        return unpacked.swapaxes(-1, -2).reshape(*x.shape[:-2], x.shape[-2] * ratio, x.shape[-1])
    return np.ascontiguousarray(x).view(dtype)


def _static_index(indexer, shape: tuple[int, ...]) -> tuple:
    """An NDIndexer with concrete values as a NumPy index; out-of-bounds raises (what the
    interpreter does under ``out_of_bounds_reads='raise'``, the setting attncheck uses)."""
    indexing, _ = _state_types()
    index = []
    for axis, item in enumerate(indexer.indices):
        dim = shape[axis]
        if isinstance(item, indexing.Slice):
            start, size, stride = int(item.start), int(item.size), int(item.stride)
            if size and not (0 <= start and start + (size - 1) * stride < dim):
                raise IndexError(f"Out-of-bounds access through a ref view: slice start {start}, size {size}, "
                                 f"stride {stride} of an axis of size {dim}")
            index.append(slice(start, start + size * stride, stride))
        else:
            value = int(np.asarray(item))
            if not 0 <= value < dim:
                raise IndexError(f"Out-of-bounds access through a ref view: index {value} of an axis of size {dim}")
            index.append(value)
    return tuple(index)


def _apply(transforms, values: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The transforms after the first view transform, applied to the values of the view and
    to their positions. ``positions`` has one trailing axis more: the flat positions in the
    view that each element is made of (several after a packing bitcast)."""
    indexing, types = _state_types()
    for t in transforms:
        if isinstance(t, indexing.NDIndexer):
            index = _static_index(t, values.shape)
            values, positions = values[index], positions[index]
        elif isinstance(t, types.ReshapeTransform):
            values = values.reshape(t.shape)
            positions = positions.reshape(tuple(t.shape) + positions.shape[-1:])
        elif isinstance(t, types.TransposeTransform):
            permutation = tuple(int(p) for p in t.permutation)
            values = values.transpose(permutation)
            positions = positions.transpose(permutation + (values.ndim,))
        elif isinstance(t, types.BitcastTransform):
            src, dst = _bits(values.dtype), _bits(t.dtype)
            values = np_bitcast(values, t.dtype)
            if src < dst:
                ratio = dst // src
                *lead, rows, cols, group = positions.shape
                positions = np.moveaxis(positions.reshape(*lead, rows // ratio, ratio, cols, group), -3, -2)
                positions = positions.reshape(*lead, rows // ratio, cols, ratio * group)
            elif src > dst:
                positions = np.repeat(positions, src // dst, axis=-3)
        else:
            raise NotImplementedError(f"ref transform {type(t).__name__} after a ref reshape/bitcast/transpose")
    return values, positions


def _box(flat: np.ndarray, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The strided box of the view that holds exactly these flat positions, or None."""
    if flat.size == 0:
        return None
    coords = np.unravel_index(flat, shape)
    box, count = [], 1
    for axis_coords in coords:
        values = np.unique(axis_coords)
        step = int(values[1] - values[0]) if values.size > 1 else 1
        if values.size > 1 and np.any(np.diff(values) != step):
            return None
        box.append(slice(int(values[0]), int(values[-1]) + 1, step))
        count *= values.size
    return tuple(box) if count == np.unique(flat).size else None


def _box_indexer(box: tuple[slice, ...], shape: tuple[int, ...]):
    indexing, _ = _state_types()
    return indexing.NDIndexer.from_indices_shape(
        tuple(indexing.Slice(s.start, len(range(s.start, s.stop, s.step)), s.step) for s in box), shape)


def _split(transforms) -> tuple[tuple, tuple]:
    """(leading indexers, the rest from the first reshape/bitcast/transpose on)."""
    indexing, _ = _state_types()
    transforms = tuple(transforms)
    for i, t in enumerate(transforms):
        if not isinstance(t, indexing.NDIndexer):
            return transforms[:i], transforms[i:]
    return transforms, ()


def _view_shape(prefix, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the ref after its leading indexers (integer indices drop their axis)."""
    indexing, _ = _state_types()
    for indexer in prefix:
        new = []
        for axis, dim in enumerate(shape):
            item = indexer.indices[axis] if axis < len(indexer.indices) else None
            if item is None:
                new.append(dim)
            elif isinstance(item, indexing.Slice):
                new.append(int(item.size))
        shape = tuple(new)
    return shape


def _buffer_shape(memory_space, buffer_id, device_id, local_core_id) -> tuple[tuple[int, ...], np.dtype]:
    ipc = _interpreter()
    space = ipc.TPU_MEMORY_SPACE_NAMES[int(memory_space)]
    core = ipc._local_core_id_or_zero_if_hbm(int(local_core_id), space)
    shared = ipc._get_shared_memory()
    with shared.lock:
        buffer = shared.mem[(space, int(buffer_id), int(device_id), core)]
        return tuple(buffer.logical_shape), np.dtype(buffer.dtype)


def _concrete(transforms):
    import jax

    try:
        return jax.tree.map(int, transforms)
    except (TypeError, ValueError):
        raise ValueError("Advanced indexers are not supported on TPU") from None


def _positions(view_shape) -> np.ndarray:
    return np.arange(int(np.prod(view_shape)), dtype=np.int64).reshape(tuple(view_shape) + (1,))


def _view_get(original, token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
    """A load through a reshaped/bitcast/transposed ref: the elements it touches are read
    from the buffer (one strided box when they form one, which is then all that the
    out-of-bounds and race checks see; else the whole view before the first reshape), and
    the transforms are applied to them in NumPy."""
    prefix, rest = _split(_concrete(transforms))
    if not rest:
        return original(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs)
    shape, dtype = _buffer_shape(memory_space, buffer_id, device_id, local_core_id)
    view_shape = _view_shape(prefix, shape)
    template = np.zeros(view_shape, dtype)
    _, positions = _apply(rest, template, _positions(view_shape))
    box = _box(positions.ravel(), view_shape)
    if box is None:
        token, view = original(token, device_id, local_core_id, memory_space, buffer_id, prefix, *args, **kwargs)
    else:
        token, part = original(token, device_id, local_core_id, memory_space, buffer_id,
                               (*prefix, _box_indexer(box, view_shape)), *args, **kwargs)
        # Elements outside the box are never part of the result; a poison value makes any
        # mistake in that bookkeeping loud.
        from jax._src.pallas.mosaic.interpret import utils as interpret_utils

        view = np.full(view_shape, interpret_utils.get_uninitialized_value(dtype, "nan"), dtype)
        view[box] = part
    values, _ = _apply(rest, np.asarray(view), _positions(view_shape))
    return token, values


def _masked_swap(original, token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask,
                 **kwargs):
    """A swap, with a masked one split along its leading axis where jax's bookkeeping would
    misjudge it. ``SharedMemory.swap_buffer_content`` (jax 0.12.0.1, shared_memory.py:751-753)
    marks out-of-bounds mask entries with ``in_bounds_mask[in_bounds_shape[i]:] = False`` for
    every axis i, which always indexes axis 0: a masked store to a (8, 1, 128) range clears
    rows 1-7 and is reported as an out-of-bounds masked swap. Chunks of at most
    min(extent of the other axes) rows are judged right; each is the same swap of its rows."""
    val = np.asarray(val)
    mask = None if mask is None else np.asarray(mask)
    rows = val.shape[0] if val.ndim >= 2 else 0
    chunk = min(val.shape[1:]) if val.ndim >= 2 else 0
    if mask is None or rows <= chunk or chunk == 0 or not mask[chunk:].any():
        return original(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask, **kwargs)
    indexing, _ = _state_types()
    olds = []
    for start in range(0, rows, chunk):
        size = min(chunk, rows - start)
        rows_of = indexing.NDIndexer.from_indices_shape(
            (indexing.Slice(start, size, 1),) + tuple(indexing.Slice(0, d, 1) for d in val.shape[1:]), val.shape)
        token, old = original(token, device_id, local_core_id, memory_space, buffer_id, (*transforms, rows_of),
                              val[start:start + size], mask[start:start + size], **kwargs)
        olds.append(np.asarray(old))
    return token, np.concatenate(olds, axis=0)


def _view_swap(original, token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask,
               **kwargs):
    """A store through a reshaped/transposed ref: exact when the elements it writes form one
    strided box of the view (then that box is what is written and race-checked); any other
    store through a view, and any store through a bitcast, raises NotImplementedError."""
    _, types = _state_types()
    prefix, rest = _split(_concrete(transforms))
    if not rest:
        return _masked_swap(original, token, device_id, local_core_id, memory_space, buffer_id, prefix, val, mask,
                            **kwargs)
    if any(isinstance(t, types.BitcastTransform) for t in rest):
        raise NotImplementedError("store through a bitcast ref (ref.bitcast) is not supported in interpret mode")
    shape, dtype = _buffer_shape(memory_space, buffer_id, device_id, local_core_id)
    view_shape = _view_shape(prefix, shape)
    _, positions = _apply(rest, np.zeros(view_shape, dtype), _positions(view_shape))
    positions = positions[..., 0]
    box = _box(positions.ravel(), view_shape)
    if box is None:
        raise NotImplementedError("store through a reshaped ref whose elements do not form one strided box "
                                  "of the ref before the reshape")
    box_shape = tuple(len(range(s.start, s.stop, s.step)) for s in box)
    coords = np.unravel_index(positions, view_shape)
    where = tuple((c - s.start) // s.step for c, s in zip(coords, box))
    val = np.asarray(val)
    new = np.empty(box_shape, val.dtype)
    new[where] = val
    new_mask = None
    if mask is not None:
        new_mask = np.zeros(box_shape, bool)
        new_mask[where] = np.asarray(mask)
    token, old = _masked_swap(original, token, device_id, local_core_id, memory_space, buffer_id,
                              (*prefix, _box_indexer(box, view_shape)), new, new_mask, **kwargs)
    return token, np.asarray(old)[where]


@contextlib.contextmanager
def ref_views() -> Iterator[None]:
    """Within the block, the TPU interpreter's loads and stores accept reshaped, bitcast
    and transposed refs (see ``_view_get``/``_view_swap``). Re-entrant; the interpreter's
    own functions are back in place when the outermost block exits. Kernels traced inside
    keep the wrapper in their compiled callbacks (it defers to the original for plain
    indexers)."""
    ipc = _interpreter()

    def install():
        originals = (ipc.get, ipc.swap)
        get_impl, swap_impl = (f.__wrapped__ for f in originals)

        def get(*args, **kwargs):
            return _view_get(get_impl, *args, **kwargs)

        def swap(*args, **kwargs):
            return _view_swap(swap_impl, *args, **kwargs)

        # One fail_on_exception around the whole access, as around the originals: it
        # records the failure for the other simulated cores exactly once.
        ipc.get, ipc.swap = ipc.fail_on_exception(get), ipc.fail_on_exception(swap)

        def undo():
            ipc.get, ipc.swap = originals
        return undo

    with _installed("ref_views", install):
        yield
