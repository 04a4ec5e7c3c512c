"""``ref_views()`` (entered by ``Backend.context``): loads, stores and DMAs through a ref that
was reshaped, bitcast or transposed (``ref.reshape(...)``, ``ref.bitcast(...)``, ``ref.T``),
which the interpreter's ``get``/``swap``/``store`` callbacks reject (``to_range`` reads
``.indices`` of every transform: ``AttributeError: 'ReshapeTransform' object has no attribute
'indices'``); a DMA reads its source with ``get`` and writes its destination with ``store``.
See ``_view_get``/``_view_swap``/``_view_store`` for the exact semantics. It also splits the masked stores
the interpreter misjudges as out of bounds (``_masked_swap``).
"""

from __future__ import annotations

import contextlib
import dataclasses
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


def _apply(transforms, positions: np.ndarray) -> np.ndarray:
    """The transforms after the first view transform, applied to the byte positions of the
    view (shape: the view's + one trailing axis, the bytes each element is made of in order
    of significance; ``_byte_positions``). A bitcast regroups them as
    ``jax._src.state.utils.bitcast`` defines it (and Mosaic lays it out): a bitwidth change
    scales the second-minor dimension, consecutive rows packing into one element (row 2a in
    the low bits of ``out[a]``)."""
    indexing, types = _state_types()
    for t in transforms:
        if isinstance(t, indexing.NDIndexer):
            positions = positions[_static_index(t, positions.shape[:-1])]
        elif isinstance(t, types.ReshapeTransform):
            positions = positions.reshape(tuple(t.shape) + positions.shape[-1:])
        elif isinstance(t, types.TransposeTransform):
            permutation = tuple(int(p) for p in t.permutation)
            positions = positions.transpose(permutation + (positions.ndim - 1,))
        elif isinstance(t, types.BitcastTransform):
            src, dst = 8 * positions.shape[-1], _bits(t.dtype)
            if src != dst and positions.ndim < 3:
                raise NotImplementedError("Bitcast 1D ref with bitwidth change is not supported.")
            *lead, rows, cols, group = positions.shape
            if src < dst:
                ratio = dst // src
                if rows % ratio:
                    raise ValueError(f"ref bitcast: second-minor dimension {rows} of {src}-bit elements cannot be "
                                     f"packed into {np.dtype(t.dtype)}")
                positions = np.moveaxis(positions.reshape(*lead, rows // ratio, ratio, cols, group), -3, -2)
                positions = positions.reshape(*lead, rows // ratio, cols, ratio * group)
            elif src > dst:
                ratio = src // dst
                positions = np.moveaxis(positions.reshape(*lead, rows, cols, ratio, group // ratio), -2, -3)
                positions = positions.reshape(*lead, rows * ratio, cols, group // ratio)
        else:
            raise NotImplementedError(f"ref transform {type(t).__name__} after a ref reshape/bitcast/transpose")
    return positions


def _result_dtype(transforms, dtype: np.dtype) -> np.dtype:
    """The dtype of the view after the transforms: the last bitcast's, else the ref's."""
    _, types = _state_types()
    for t in transforms:
        if isinstance(t, types.BitcastTransform):
            dtype = np.dtype(t.dtype)
    return dtype


def _box(flat: np.ndarray, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The strided box of the view that holds exactly these flat positions, or None. No
    positions (a zero-length DMA) make an empty box: the access touches nothing, which is
    what the race and out-of-bounds checks then see."""
    if flat.size == 0:
        return tuple(slice(0, 0, 1) for _ in shape)
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


def _byte_positions(view_shape, itemsize: int) -> np.ndarray:
    """Byte i of element e of the view is at position e * itemsize + i."""
    flat = np.arange(int(np.prod(view_shape)), dtype=np.int64) * itemsize
    return (flat[:, None] + np.arange(itemsize)).reshape(tuple(view_shape) + (itemsize,))


@dataclasses.dataclass(frozen=True)
class _Access:
    """A load or store through a reshaped/bitcast/transposed ref, resolved against the ref
    after its leading indexers (the view): the strided box of the view that holds every
    element touched (None when they form none), and where each byte of the accessed value
    lies in that box."""

    prefix: tuple  # the leading indexers
    view_shape: tuple[int, ...]
    dtype: np.dtype  # the ref's
    result_dtype: np.dtype  # the accessed value's
    positions: np.ndarray  # the value's shape + (its itemsize,): byte positions in the view
    box: tuple[slice, ...] | None

    @classmethod
    def of(cls, memory_space, buffer_id, device_id, local_core_id, prefix, rest) -> _Access:
        shape, dtype = _buffer_shape(memory_space, buffer_id, device_id, local_core_id)
        view_shape = _view_shape(prefix, shape)
        positions = _apply(rest, _byte_positions(view_shape, dtype.itemsize))
        box = _box(np.unique(positions // dtype.itemsize), view_shape)
        return cls(prefix, view_shape, dtype, _result_dtype(rest, dtype), positions, box)

    @property
    def box_shape(self) -> tuple[int, ...]:
        return tuple(len(range(s.start, s.stop, s.step)) for s in self.box)

    @property
    def box_indexer(self):
        return (*self.prefix, _box_indexer(self.box, self.view_shape))

    def box_bytes(self) -> np.ndarray:
        """The byte positions in the box (C order) of the value's bytes."""
        itemsize = self.dtype.itemsize
        coords = np.unravel_index(self.positions // itemsize, self.view_shape)
        local = tuple((c - s.start) // s.step for c, s in zip(coords, self.box))
        return np.ravel_multi_index(local, self.box_shape) * itemsize + self.positions % itemsize

    def value_from(self, region: np.ndarray, box_region: bool) -> np.ndarray:
        """The accessed value, gathered from the box's (or the whole view's) elements."""
        raw = np.ascontiguousarray(region).view(np.uint8).ravel()
        picked = raw[self.box_bytes() if box_region else self.positions]
        return np.ascontiguousarray(picked).view(self.result_dtype).reshape(self.positions.shape[:-1])

    def stored(self, val: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The box's new elements (and mask) for a store of ``val``: the store must write
        every byte of the box exactly once (a store that writes part of an element, or an
        element twice, is not supported)."""
        where = self.box_bytes().ravel()
        size = int(np.prod(self.box_shape)) * self.dtype.itemsize
        if where.size != size or np.unique(where).size != size:
            raise NotImplementedError("store through a reshaped or bitcast ref that writes part of an element of "
                                      "the ref, or one element twice")
        new = np.empty(size, np.uint8)
        new[where] = np.ascontiguousarray(val, self.result_dtype).view(np.uint8).ravel()
        new = new.view(self.dtype).reshape(self.box_shape)
        if mask is None:
            return new, None
        bytes_mask = np.empty(size, bool)
        bytes_mask[where] = np.broadcast_to(np.asarray(mask)[..., None], self.positions.shape).ravel()
        bytes_mask = bytes_mask.reshape(*self.box_shape, self.dtype.itemsize)
        if np.any(bytes_mask != bytes_mask[..., :1]):
            raise NotImplementedError("masked store through a bitcast ref that masks part of an element of the ref")
        return new, bytes_mask[..., 0]


def _view_get(original, token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
    """A load through a reshaped/bitcast/transposed ref: the elements it touches are read
    from the buffer (one strided box when they form one, which is then all that the
    out-of-bounds and race checks see; else the whole view before the first reshape), and
    the value is gathered from their bytes."""
    prefix, rest = _split(_concrete(transforms))
    if not rest:
        return original(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs)
    access = _Access.of(memory_space, buffer_id, device_id, local_core_id, prefix, rest)
    if access.box is None:
        token, view = original(token, device_id, local_core_id, memory_space, buffer_id, prefix, *args, **kwargs)
    else:
        token, view = original(token, device_id, local_core_id, memory_space, buffer_id, access.box_indexer,
                               *args, **kwargs)
    return token, access.value_from(view, access.box is not None)


def _store_access(memory_space, buffer_id, device_id, local_core_id, prefix, rest) -> _Access:
    access = _Access.of(memory_space, buffer_id, device_id, local_core_id, prefix, rest)
    if access.box is None:
        raise NotImplementedError("store through a reshaped ref whose elements do not form one strided box "
                                  "of the ref before the reshape")
    return access


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
    """A store through a reshaped/bitcast/transposed ref: exact when the elements it writes
    form one strided box of the view and it writes whole elements (then that box is what is
    written and race-checked); any other raises NotImplementedError."""
    prefix, rest = _split(_concrete(transforms))
    if not rest:
        return _masked_swap(original, token, device_id, local_core_id, memory_space, buffer_id, prefix, val, mask,
                            **kwargs)
    access = _store_access(memory_space, buffer_id, device_id, local_core_id, prefix, rest)
    new, new_mask = access.stored(np.asarray(val), mask)
    token, old = _masked_swap(original, token, device_id, local_core_id, memory_space, buffer_id,
                              access.box_indexer, new, new_mask, **kwargs)
    return token, access.value_from(np.asarray(old), True)


def _view_store(original, token, device_id, local_core_id, memory_space, buffer_id, transforms, val, *args,
                **kwargs):
    """An unmasked store through a view (the write of a DMA to a reshaped or bitcast ref),
    as ``_view_swap``."""
    prefix, rest = _split(_concrete(transforms))
    if not rest:
        return original(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, *args, **kwargs)
    access = _store_access(memory_space, buffer_id, device_id, local_core_id, prefix, rest)
    new, _ = access.stored(np.asarray(val), None)
    return original(token, device_id, local_core_id, memory_space, buffer_id, access.box_indexer, new, *args,
                    **kwargs)


@contextlib.contextmanager
def ref_views() -> Iterator[None]:
    """Within the block, the TPU interpreter's loads, stores and DMAs accept reshaped,
    bitcast and transposed refs (see ``_view_get``/``_view_swap``/``_view_store``). Re-entrant; the interpreter's
    own functions are back in place when the outermost block exits. Kernels traced inside
    keep the wrapper in their compiled callbacks (it defers to the original for plain
    indexers)."""
    ipc = _interpreter()

    def install():
        originals = (ipc.get, ipc.swap, ipc.store)
        get_impl, swap_impl, store_impl = (f.__wrapped__ for f in originals)

        def get(*args, **kwargs):
            return _view_get(get_impl, *args, **kwargs)

        def swap(*args, **kwargs):
            return _view_swap(swap_impl, *args, **kwargs)

        def store(*args, **kwargs):
            return _view_store(store_impl, *args, **kwargs)

        # One fail_on_exception around the whole access, as around the originals: it
        # records the failure for the other simulated cores exactly once.
        ipc.get, ipc.swap, ipc.store = (ipc.fail_on_exception(f) for f in (get, swap, store))

        def undo():
            ipc.get, ipc.swap, ipc.store = originals
        return undo

    with _installed("ref_views", install):
        yield
