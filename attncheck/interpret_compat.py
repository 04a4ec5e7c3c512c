"""What Pallas TPU interpret mode (jax 0.12.0.1) cannot do by itself, made explicit.

Each piece is scoped to a ``with`` block that leaves jax exactly as it found it on exit:

- ``emulated_tpu(device_kind)``: the TPU generation a backend emulates (entered by the
  interpret backends' ``Backend.context`` and by ``backends.export_for_tpu``). jax has two
  ways of asking "which TPU is this": ``jax._src.tpu_info.get_device_kind()`` honours
  ``jax.sharding.use_abstract_mesh`` (Mosaic lowering, ``tpu-lower``), but some of jax's
  bundled kernels read ``jax.devices()[0].device_kind`` directly (ragged paged attention's
  tuned block sizes: ``tuned_block_sizes.py`` ``get_tpu_version``/``get_device_name``), which
  on CPU says "cpu" and makes default block sizes raise ``TPU version must be 4 or higher``.
  Inside the block, those modules (``DEVICE_KIND_READERS``) see ``jax.devices()`` whose
  devices report the emulated ``device_kind``; their own code runs unchanged. Nothing else
  in jax is touched (an abstract mesh is not entered: it would nest the CPU meshes of
  ``shard_map`` kernels).
- ``ref_views()`` (entered by ``Backend.context``): loads and stores through a ref that was
  reshaped, bitcast or transposed (``ref.reshape(...)``, ``ref.bitcast(...)``, ``ref.T``),
  which the interpreter's ``get``/``swap`` callbacks reject (``to_range`` reads ``.indices``
  of every transform: ``AttributeError: 'ReshapeTransform' object has no attribute
  'indices'``); see ``_view_get``/``_view_swap`` for the exact semantics. It also splits the
  masked stores the interpreter misjudges as out of bounds (``_masked_swap``).
- ``host_callbacks()`` (entered by ``Backend.context``): the interpreter's host callbacks
  take XLA's NumPy operands as they come, without jax's move of each onto a device and back
  (most of an interpreted kernel's run time); see ``host_callbacks``.
- ``ordered_collectives()`` (entered by ``Backend.context`` for a case on several devices)
  with ``in_collective_order(fn)`` (applied by ``compiled.compiled``): every collective
  runs in program order with the interpreted kernels, the same on every device; without
  it a ring deadlocks now and then (see ``ordered_collectives``).
- ``interpreter_limitation(exc)``, ``callback_error_line(exc)``: a known interpreter
  limitation (``KNOWN_LIMITATIONS``), or an error raised inside an interpreter callback,
  named in one line, so a kernel that interpret mode cannot run is reported as such, not as
  a stack trace or as a kernel bug; ``limitation_lines(records)`` sums them up per backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import re
import threading
from collections.abc import Callable, Iterator

import numpy as np

# ----------------------------------------------------------------- TPU generation

# Modules of jax's bundled kernels that ask ``jax.devices()[0].device_kind`` (not the
# abstract mesh) which TPU they run on. Absent modules are ignored.
DEVICE_KIND_READERS = (
    "jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes",
    "jax.experimental.pallas.ops.tpu.megablox.common",
)

_lock = threading.RLock()
_open: dict[str, tuple[int, Callable[[], None]]] = {}  # name -> (open blocks, how to undo)


@contextlib.contextmanager
def _installed(name: str, install: Callable[[], Callable[[], None]]) -> Iterator[None]:
    """A change to jax made by ``install`` (which returns its undo) while any block of
    this name is open, in any thread: re-entrant, undone when the last block exits."""
    with _lock:
        depth, undo = _open.get(name, (0, None))
        _open[name] = (depth + 1, undo if depth else install())
    try:
        yield
    finally:
        with _lock:
            depth, undo = _open.pop(name)
            if depth > 1:
                _open[name] = (depth - 1, undo)
            else:
                undo()


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

    saved = []
    with _lock:
        for name in DEVICE_KIND_READERS:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(module, "jax"):
                saved.append((module, module.jax))
                module.jax = _JaxWithEmulatedDevices(jax, device_kind)
    try:
        yield
    finally:
        with _lock:
            for module, original in reversed(saved):
                module.jax = original


# ----------------------------------------------------------------- ref views


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


# ----------------------------------------------------------------- host callbacks

# Modules whose io_callbacks are the interpreter's (and this module's wrappers of them).
_INTERPRETER_CALLBACK_MODULES = ("jax._src.pallas.mosaic.interpret.", __name__)


def _callback_module(callback) -> str:
    func = callback.callback_func
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__module__", None) or ""


@contextlib.contextmanager
def host_callbacks() -> Iterator[None]:
    """Within the block, the interpreter's io_callbacks take their operands as the NumPy
    arrays XLA hands to a host callback; any other io_callback runs as jax runs it.

    jax's ``io_callback_impl`` first moves every operand onto a CPU device as a jax array
    (``device_put``), and the interpreter's callbacks turn each back into an int or a NumPy
    array (``int()``, ``np.asarray``): for an interpreted kernel, made of a callback per
    load, store, DMA and barrier, these two conversions were 55-60% of its run time
    (py-spy on ring flash attention on 8 simulated devices: 11.1 s, 2.0 s without them).
    The interpreter copies whatever it keeps of an operand (``np.array`` in
    ``_allocate_buffer``, slice assignment in the stores), so an operand that is only valid
    during the call is never kept. jax's own function also enters the CPU device and empty
    meshes around the call; these callbacks compute in NumPy (``thread_map`` runs its jax
    in threads of its own), so that is left out too (it cost 15% more)."""
    from jax._src import callback as jax_callback
    from jax._src import tree_util

    def install():
        original = jax_callback.io_callback_impl

        def io_callback_impl(*args, result_avals, callback, sharding, ordered):
            if not _callback_module(callback).startswith(_INTERPRETER_CALLBACK_MODULES):
                return original(*args, result_avals=result_avals, callback=callback, sharding=sharding,
                                ordered=ordered)
            return tree_util.tree_map(np.asarray, callback(*args))

        jax_callback.io_callback_impl = io_callback_impl

        def undo():
            jax_callback.io_callback_impl = original
        return undo

    with _installed("host_callbacks", install):
        yield


# ----------------------------------------------------------------- collective order

# The collectives XLA lowers to a cross-device rendezvous (jax._src.lax.parallel).
COLLECTIVES = ("ppermute_p", "psum_p", "psum_invariant_p", "pmax_p", "pmin_p", "all_gather_p",
               "all_gather_invariant_p", "all_to_all_p", "ragged_all_to_all_p", "reduce_scatter_p")
# Primitives whose bodies are jaxpr parameters that binding does not trace again (a
# shard_map's body is: ``get_bind_params`` evaluates it).
_BODY_HOLDERS = (("jax._src.lax.control_flow.loops", "scan_p"), ("jax._src.lax.control_flow.loops", "while_p"),
                 ("jax._src.lax.control_flow.conditionals", "cond_p"), ("jax._src.pjit", "jit_p"))


def _ordered_token(*_) -> np.ndarray:
    return np.zeros((), np.int32)


def _after_ordered_effects(xs):
    """``xs``, recomputed from the result of an ordered host callback, so after every
    ordered effect before it (the interpreter's kernels begin and end with one). XLA's CPU
    runtime orders its work by buffers: the dependency must be a value (an optimization
    barrier keeps the same buffer and orders nothing at run time)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    token = io_callback(_ordered_token, jax.ShapeDtypeStruct((), np.int32), ordered=True)
    return [jnp.where(token == 0, x, jnp.zeros_like(x)) for x in xs]


def _before_ordered_effects(xs):
    """``xs``, after an ordered host callback that reads one element of each, so every
    ordered effect after it waits for ``xs``."""
    import jax
    from jax.experimental import io_callback

    io_callback(_ordered_token, jax.ShapeDtypeStruct((), np.int32), *(x.reshape(-1)[:1] for x in xs),
                ordered=True)
    return xs


def _ordered_collective(original):
    def bind(*args, **params):
        out = original(*_after_ordered_effects(args), **params)
        return _before_ordered_effects(out) if isinstance(out, (list, tuple)) else _before_ordered_effects([out])[0]

    return bind


def _retraced(value):
    """A jaxpr parameter traced again through ``core.eval_jaxpr``, so that the collectives
    in it are bound (and ordered) again; other values as they are."""
    from jax._src import core
    from jax._src import linear_util as lu
    from jax._src.interpreters import partial_eval as pe

    if isinstance(value, tuple):
        return tuple(_retraced(v) for v in value)
    if not isinstance(value, core.Jaxpr):
        return value
    fun = lu.wrap_init(lambda *args: core.eval_jaxpr(value, value.consts, *args), debug_info=value.debug_info)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fun, value.in_avals)
    return core.Jaxpr(jaxpr, consts)


def _body_holder(original):
    def bind(*args, **params):
        return original(*args, **{name: _retraced(value) for name, value in params.items()})

    return bind


def _patched_primitives():
    from jax._src.lax import parallel

    yield from ((getattr(parallel, name), _ordered_collective) for name in COLLECTIVES)
    yield from ((getattr(importlib.import_module(module), name), _body_holder) for module, name in _BODY_HOLDERS)


@contextlib.contextmanager
def _collectives_bound_in_order() -> Iterator[None]:
    def install():
        saved = [(primitive, primitive.bind) for primitive, _ in _patched_primitives()]
        for primitive, wrap in _patched_primitives():
            primitive.bind = wrap(primitive.bind)

        def undo():
            for primitive, bind in saved:
                primitive.bind = bind
        return undo

    with _installed("collectives_bound_in_order", install):
        yield


_ordering = threading.local()


@contextlib.contextmanager
def ordered_collectives() -> Iterator[None]:
    """Within the block, functions wrapped by ``in_collective_order`` run every collective
    (``COLLECTIVES``) in program order with the interpreted kernels around it, on every
    simulated device.

    The interpreter makes all devices meet at a barrier when a kernel starts and ends, a
    barrier XLA does not know about. XLA's CPU runtime may run a kernel and a collective
    that do not depend on each other in either order, and per device: in a ring, the
    rotation of the next block and the attention over the current one. When one device
    enters the kernel while the others enter the collective, each waits for the other
    forever, until XLA's rendezvous timeout aborts the process. Tying each collective
    between two ordered host callbacks puts it in the same total order as the kernels'
    own ordered callbacks, the same on every device."""
    depth = getattr(_ordering, "depth", 0)
    _ordering.depth = depth + 1
    try:
        yield
    finally:
        _ordering.depth = depth


def in_collective_order(fn: Callable) -> Callable:
    """``fn``, which under ``ordered_collectives`` is traced to a jaxpr (any derivative in
    it already taken), and that jaxpr evaluated again with every collective between two
    ordered host callbacks. Values and gradients are unchanged (no-op callbacks and a
    select that always picks the value); outside the block ``fn`` runs as it is."""
    import jax
    from jax._src import core

    @functools.wraps(fn)
    def ordered(*args):
        if not getattr(_ordering, "depth", 0):
            return fn(*args)
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        with _collectives_bound_in_order():
            flat = core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), flat)

    return ordered


# ----------------------------------------------------------------- limitations


@dataclasses.dataclass(frozen=True)
class Limitation:
    """An operation interpret mode cannot run, recognised by its exception."""

    operation: str  # what the kernel does that the interpreter cannot run
    types: tuple[str, ...]  # exception type names (anywhere in the cause/context chain)
    pattern: str  # regex on that exception's message or on the innermost traceback text


UNSUPPORTED_PREFIX = "unsupported by interpret mode: "

_VIEW_IN_A_DMA = "where the interpreter takes only indexers (a DMA, a semaphore)"
KNOWN_LIMITATIONS = (
    # ref_views() covers loads and stores; DMAs and semaphores still reach to_range.
    Limitation(f"ref reshape (ReshapeTransform) {_VIEW_IN_A_DMA}", ("AttributeError",),
               r"'ReshapeTransform' object has no attribute 'indices'"),
    Limitation(f"ref bitcast (BitcastTransform) {_VIEW_IN_A_DMA}", ("AttributeError",),
               r"'BitcastTransform' object has no attribute 'indices'"),
    Limitation(f"ref transpose (TransposeTransform) {_VIEW_IN_A_DMA}", ("AttributeError",),
               r"'TransposeTransform' object has no attribute 'indices'"),
    Limitation("store through a ref view that is not one strided box", ("NotImplementedError",),
               r"store through a (bitcast ref|reshaped ref whose elements)"),
    Limitation("sub-byte ref bitcast", ("NotImplementedError",), r"ref bitcast of \w+: sub-byte"),
    # The interpreter's own NotImplementedErrors (interpret_pallas_call.py).
    Limitation("masked load (load_p with mask)", ("NotImplementedError",), r"masked load_p"),
    Limitation("run_scoped with collective axes", ("NotImplementedError",),
               r"run_scoped_p with collective axes is not supported"),
    Limitation("non-decrementing semaphore wait", ("NotImplementedError",),
               r"Non-decrementing wait is not supported"),
    Limitation("a memory space the interpreter does not model", ("NotImplementedError",),
               r"Unsupported memory space"),
    # A kernel that asks the TPU generation in a way emulated_tpu() does not answer.
    Limitation("TPU generation query outside a TPU", ("NotImplementedError", "ValueError"),
               r"TPU version must be 4 or higher|Unsupported TPU device kind"),
)


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """The exception and its causes (or the exceptions it was raised while handling)."""
    seen, out = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def interpreter_limitation(exc: BaseException) -> str | None:
    """One line naming the interpret-mode limitation that ``exc`` is, or None when it is not
    a known one. The interpreter wraps callback errors (``JaxRuntimeError: INTERNAL:
    CpuCallback error ... AttributeError: ...``), so messages are searched too."""
    for error in exception_chain(exc):
        text = f"{type(error).__name__}: {error}"
        names = {type(error).__name__} | {c.__name__ for c in type(error).__mro__}
        for limitation in KNOWN_LIMITATIONS:
            typed = bool(names & set(limitation.types)) or any(f"{t}: " in text for t in limitation.types)
            if typed and re.search(limitation.pattern, text):
                return f"{UNSUPPORTED_PREFIX}{limitation.operation}"
    return None


def limitation_lines(records) -> list[str]:
    """One line per backend x kernel/impl x limitation (``Record``s in): how many cases
    interpret mode could not run and why."""
    cases: dict[tuple, set] = {}
    for r in records:
        if r.outcome == "error" and r.reason.startswith(UNSUPPORTED_PREFIX):
            key = (r.backend, f"{r.kernel}/{r.impl}", r.reason[len(UNSUPPORTED_PREFIX):])
            cases.setdefault(key, set()).add(r.case_id)
    return [f"{backend}: {kernel}: {len(ids)} case(s) not run, {UNSUPPORTED_PREFIX}{operation}"
            for (backend, kernel, operation), ids in sorted(cases.items())]


_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$", re.MULTILINE)


def callback_error_line(exc: BaseException) -> str | None:
    """For an error raised inside an interpreter callback, which reaches the caller as
    ``JaxRuntimeError: INTERNAL: CpuCallback error calling callback: Traceback ...``, the
    line of the error itself (e.g. ``IndexError: Out-of-bounds read of ...``); else None."""
    text = str(exc)
    if "CpuCallback error" not in text:
        return None
    lines = [m for m in _ERROR_LINE.finditer(text) if m.group(1) != "JaxRuntimeError"]
    if not lines:
        return None
    return f"{lines[-1].group(1)}: {lines[-1].group(2).strip()} (raised in an interpret-mode callback)"
