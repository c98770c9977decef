"""``numkv.tensor_scatter``: the ONNX TensorScatter op (opset 24).

coerce -> check and plan the layout (memoised) -> unsigned bit views -> serial
or parallel kernel, which trusts what it is given.  Object arrays (Python
strings) and empty caches take the plain NumPy path (slice assignments), which
tests can force with ``_config.REFERENCE``.

The in-place append of a decode loop (``out=past_cache``, plain ndarrays, an
int32/int64 ``write_indices`` array) has a fast path in front (``_append``):
the layout's checks and plan memoised in ``_appends``, the call's own checks
(flags, overlap, indices) inlined, and one kernel call on the calling thread
(float32 4-D arrays handed over whole; one token with int64 indices:
``append_token``, which copies and checks the indices itself), or one NumPy
slice assignment (batch 1).  Whatever it does not take, bad input included,
falls through to the general path (``_scatter``), which raises; nothing is
written before every check has passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional

import numpy as np

from . import _config
from ._runtime import pool
from ._dtypes import ALIGNED_UNITS, flat_units, is_object_dtype, is_scatter_dtype, unit_size
from ._quantize import QuantizedArray, scatter_operands
from ._validate import as_array, as_int, as_output, index_vector, normalize_axis, output_array

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

MODES = ("linear", "circular")
_IS_CIRCULAR = {mode: mode == "circular" for mode in MODES}

# The copy policy (``PARALLEL_MIN_BYTES``, ``RELEASE_GIL_BYTES``,
# ``CHUNK_BYTES``) is ``_config``'s tunables, read at call time.
_INT64 = np.dtype(np.int64)

_kernels = None


def _scatter_kernels():
    global _kernels
    if _kernels is None:
        from ._kernels import scatter

        _kernels = scatter
    return _kernels


def tensor_scatter(
    past_cache: ArrayLike,
    update: ArrayLike,
    write_indices: Optional[ArrayLike] = None,
    *,
    axis: int = -2,
    mode: Literal["linear", "circular"] = "linear",
    out: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Write ``update`` into a cache along its sequence axis, at each batch
    row's own position (ONNX TensorScatter, opset 24).

    For batch row ``b`` and ``i < sequence_length``, position
    ``write_indices[b] + i`` of ``past_cache[b]`` along ``axis`` (modulo
    ``max_sequence_length`` in ``"circular"`` mode) takes ``update[b]``'s
    position ``i``; every other element is ``past_cache``'s.  Bits are
    copied exactly (NaN payloads, -0.0), in every dtype.

    Parameters
    ----------
    past_cache : array_like or QuantizedArray, shape ``(batch, D1, ..., max_sequence_length, ..., Dn)``
        The cache, ``max_sequence_length`` along ``axis``.  A ``QuantizedArray``
        takes an ``update`` of its format (and scale), or a float ``update``
        it quantises first; its codes and scales are written together, along
        any axis but the last.  Any dtype of ONNX
        TensorScatter: bool, integers, float16/32/64, complex, strings
        (``U``, object) and the ``ml_dtypes`` types (bfloat16, the float8s,
        float4_e2m1fn, int4, uint4).  Strided views are written in place.
    update : array_like, shape ``(batch, D1, ..., sequence_length, ..., Dn)``
        ``past_cache``'s shape but along ``axis``, where ``sequence_length <=
        max_sequence_length``; ``past_cache``'s dtype (no casting).
    write_indices : array_like of int32 or int64, shape ``(batch,)``, optional
        Where each batch row's update starts; zeros when omitted.  Linear mode:
        ``0 <= write_indices[b] <= max_sequence_length - sequence_length``.
        Circular mode: any value, taken modulo ``max_sequence_length``.
    axis : int, default -2
        The sequence axis; may be negative, must not be the batch axis 0.
    mode : {"linear", "circular"}, default "linear"
        ``"circular"`` wraps writes around the end of the sequence axis (a
        sliding-window cache).
    out : ndarray, optional
        ``None``: the result is a new array and ``past_cache`` is not
        modified.  ``past_cache`` itself: the cache is updated in place in
        O(update) time (how a KV cache is appended to).  Any other array of
        ``past_cache``'s shape and dtype receives ``past_cache`` with the
        update applied.

    Returns
    -------
    ndarray or QuantizedArray, shape ``past_cache.shape``
        ``present_cache``: ``out`` itself when given, else a new array.

    Raises
    ------
    TypeError
        A non-array argument, ``update`` (or ``out``) of another dtype than
        ``past_cache``, a non-integer ``write_indices`` or ``axis``.
    ValueError
        Shapes that do not match, ``axis`` out of range or 0, an unknown
        ``mode``, a linear write outside the cache (the message names the
        batch row), a read-only ``out``.  Raised before anything is
        written: a failed in-place call leaves the cache as it was.

    See Also
    --------
    numkv.StaticKVCache : a KV cache that appends with this function.

    Examples
    --------
    Append one token per batch row to a ``(batch, heads, max_seq, head_dim)``
    cache, each row at its own length, in place:

    >>> import numpy as np, numkv
    >>> cache = np.zeros((2, 1, 4, 2), np.float32)
    >>> token = np.ones((2, 1, 1, 2), np.float32)
    >>> lengths = np.array([0, 2])
    >>> numkv.tensor_scatter(cache, token, lengths, out=cache) is cache
    True
    >>> cache[:, 0, :, 0]
    array([[1., 0., 0., 0.],
           [0., 0., 1., 0.]], dtype=float32)

    Without ``out`` the cache is left alone; circular mode wraps:

    >>> new = numkv.tensor_scatter(cache, 2 * token, np.array([-1, 5]), mode="circular")
    >>> new[:, 0, :, 0]
    array([[1., 0., 0., 2.],
           [0., 2., 1., 0.]], dtype=float32)
    """
    # An in-place append of plain ndarrays (a decode loop's) tries the fast
    # path first; whatever it does not take, bad input included, goes on to
    # the general path, which raises.
    if (out is past_cache and type(out) is _NDARRAY and type(update) is _NDARRAY
            and type(write_indices) is _NDARRAY and type(axis) is int and type(mode) is str):
        done = _append(out, update, write_indices, axis, mode)
        if done is not None:
            return done
    if type(past_cache) is QuantizedArray:  # codes and scales: checked, then scattered as bytes
        return _scatter_quantized(past_cache, update, write_indices, axis, mode, out)
    return _scatter(past_cache, update, write_indices, axis, mode, out)


# --------------------------------------------------------------------------
# the fast path: an in-place append


def _append(out, update, write_indices, axis, mode):
    """``tensor_scatter(out, update, write_indices, out=out)`` of plain
    ndarrays and an int32 / int64 ``write_indices`` array (``tensor_scatter``
    checked the arguments' types), the in-place append of a decode loop:
    pure call overhead, so the layout's checks and plan come from one dict
    lookup (``_appends``) and the call's own checks are inlined, then one
    write on the calling thread (a large one on the pool).  ``out``, or None
    where it does not take the call: the general path then runs (and raises
    on bad input); nothing is written before every check has passed.  (Its
    writes stay inline: a Python call costs ~2% of a 1-token append.)"""
    # The flags as NumPy's bits (NPY_ARRAY_*): one attribute each, not three.
    out_bits, update_bits = out.flags.num, update.flags.num
    dtype = out.dtype
    # C-contiguous arrays of one shape and dtype share a plan whatever the
    # strides of their size-1 axes: the key spares two stride tuples (~0.2 us).
    contiguous = out_bits & update_bits & _C_CONTIGUOUS
    if contiguous:
        key = (out.shape, update.shape, dtype, axis, mode)
    else:
        key = (out.shape, update.shape, dtype, axis, mode, out.strides, update.strides)
    append = _appends.get(key, _NEW)
    if append is _NEW:
        append = _new_append(key, out, update)
    w_dtype = write_indices.dtype
    if not (append is not None and update.dtype is dtype and write_indices.shape == append[0]
            and (w_dtype is _INT64 or w_dtype is _INT32) and not _config.REFERENCE
            and out_bits & _WRITEABLE_ALIGNED == _WRITEABLE_ALIGNED and update_bits & _ALIGNED
            and ((out.base is None and update.base is None and update is not out)
                 or not np.may_share_memory(out, update))):
        return None
    _, window, plan, n_items, n_bytes, utype, circular, last, direct, seq_len, max_seq, token = append
    # Whole float32 arrays: the kernel views them itself (see
    # ``_kernels/scatter._units``), no view objects made here (-0.6 us;
    # docs/performance.md, "Figures moved out of the code").
    whole = direct and contiguous and update_bits & _WRITEABLE
    if window is not None and not (whole and token and w_dtype is _INT64):
        # Batch 1, a small write: one NumPy slice assignment where it does
        # not wrap (no kernel launch: 1.85 us); whole float32 arrays take
        # append_token (1.75 us).
        start = int(write_indices[0])
        if circular:
            start %= max_seq
        elif not 0 <= start <= last:
            _write_positions([start], seq_len, max_seq, False)  # raises, naming the row
        if start <= last:
            out[window + (slice(start, start + seq_len),)] = update
            return out
    if whole:
        dst, upd = out, update
    elif contiguous:
        dst = out.ravel().view(utype)
        upd = update.ravel().view(utype) if update_bits & _WRITEABLE else flat_units(update, utype.itemsize)
    else:
        dst = flat_units(out, utype.itemsize)
        upd = flat_units(update, utype.itemsize)
    kernels = _kernels or _scatter_kernels()
    if token and w_dtype is _INT64 and write_indices.flags.num & _C_CONTIGUOUS:
        # One token into unit-stride rows, on this thread: the kernel
        # copies and checks the caller's indices itself (a private copy
        # checked here cost 0.5 us of 2.8 at batch 4).
        bad, start = kernels.append_token(dst, upd, plan, write_indices, circular)
        if bad >= 0:  # (what the kernel read: the caller's array may have changed since)
            raise _index_error(bad, start, seq_len, max_seq)
        return out
    # The kernel runs without the GIL: it reads a checked private copy.
    starts = write_indices.copy() if w_dtype is _INT64 else write_indices.astype(_INT64)
    if not circular:  # (a loop: min() and max() cost 0.26 us at batch 4, the loop 0.11)
        for start in starts.tolist():
            if not 0 <= start <= last:
                _write_positions(starts.tolist(), seq_len, max_seq, False)  # raises, naming the row
    if n_bytes < _config.PARALLEL_MIN_BYTES:  # on this thread, as pool.run would (its call costs ~0.3 us)
        kernels.scatter_items(0, n_items, dst, upd, dst, plan, starts, circular, *pool.ALONE)
    else:
        pool.run(kernels.scatter_items, n_items, (dst, upd, dst, plan, starts, circular),
                 release_gil=n_bytes >= _config.RELEASE_GIL_BYTES)
    return out


# --------------------------------------------------------------------------
# the general path


def _scatter(past_cache, update, write_indices, axis, mode, out):
    """``tensor_scatter``'s general path: every input it takes, coerced and
    checked (``_operands``), its layout checked and planned (``_layouts``:
    once per layout), its write indices checked (``_checked_starts``), then
    the kernel or, for object arrays and empty caches, ``scatter_reference``.
    ``out`` is returned as given (a matrix, a torch tensor); the work is done
    on plain ndarray views of everything.  (The layout's few lines stay
    inline: a Python call more cost ~2% of a small call.)"""
    result, past_cache, update, out, src, in_place, axis, circular = _operands(past_cache, update, axis, mode, out)
    dtype = past_cache.dtype
    if update.dtype is not dtype and update.dtype != dtype:
        _check_layout(past_cache.shape, update.shape, dtype, update.dtype, axis)  # raises
    # The unsigned unit the kernel moves: the dtype's alignment where numpy's
    # aligned flags prove it tiles the three arrays, else from their addresses.
    out_flags, update_flags = out.flags, update.flags
    unit = ALIGNED_UNITS.get(dtype.type)
    if not (unit and out_flags.aligned and update_flags.aligned and (in_place or src.flags.aligned)):
        unit = unit_size((out, update, src))
    key = (axis, unit, in_place, dtype, past_cache.shape, update.shape, out.strides, update.strides, src.strides)
    ax, max_seq, seq_len, plan, n_bytes, n_items = _layouts.get(key) or _new_layout(key)
    starts, values = _checked_starts(write_indices, past_cache.shape[0], seq_len, max_seq, circular)
    if plan is None or _config.REFERENCE:  # object arrays, empty caches, tests
        positions = _write_positions(values, seq_len, max_seq, circular)
        scatter_reference(past_cache, update, positions, ax, out, in_place)
        return result
    dst = flat_units(out, unit, out_flags)
    kernels = _kernels or _scatter_kernels()
    args = (dst, flat_units(update, unit, update_flags), dst if in_place else flat_units(src, unit),
            plan, starts, circular)
    # Small copies stay on the calling thread (cheaper than handing out shares).
    pool.run(kernels.scatter_items, n_items, args, small=n_bytes < _config.PARALLEL_MIN_BYTES,
             release_gil=n_bytes >= _config.RELEASE_GIL_BYTES)
    return result


def _operands(past_cache, update, axis, mode, out):
    """The arguments as ndarrays, ``axis`` an int and ``mode`` a flag, and
    ``out`` made or checked: ``(result, past_cache, update, out, src,
    in_place, axis, circular)``, where ``result`` is what the call returns
    (``out`` as given, or a new array) and ``src`` what the kernel reads
    the rest of the cache from.  An input that shares memory with ``out``
    (but the cache in place) is copied first, so it is read before it is
    overwritten."""
    result = out
    # (``out is past_cache`` alone would call ``tensor_scatter(None, u)`` in place.)
    in_place = out is past_cache and out is not None
    if type(past_cache) is not np.ndarray:
        past_cache = as_output(past_cache, "past_cache") if in_place else _as_input(past_cache, "past_cache")
    if type(update) is not np.ndarray:
        update = _as_input(update, "update")
    if type(axis) is not int:
        axis = as_int(axis, "axis")
    circular = _IS_CIRCULAR.get(mode) if type(mode) is str else None
    if circular is None:
        raise ValueError(f"mode must be 'linear' or 'circular', got {mode!r}")

    if out is None:
        out = result = np.empty(past_cache.shape, past_cache.dtype)
    elif in_place:
        out = past_cache
        if not out.flags.writeable:
            raise ValueError("out (= past_cache) is read-only")
    else:
        if type(out) is not np.ndarray:
            out = as_output(out)
        output_array(out, past_cache.shape, past_cache.dtype)
        if np.may_share_memory(out, past_cache):
            past_cache = past_cache.copy()
    src = out if in_place else past_cache  # in place the kernel never reads src
    # Arrays that both own their memory cannot overlap (spares a bounds check).
    if update is out or (not (update.base is None and out.base is None)
                         and np.may_share_memory(out, update)):
        update = update.copy()
    return result, past_cache, update, out, src, in_place, axis, circular


def _checked_starts(write_indices, batch, seq_len, max_seq, circular):
    """``write_indices`` as a private int64 array (checked here, then read by
    a kernel that runs without the GIL) and as a list; a linear write outside
    the cache raises, naming the first bad row."""
    starts = write_indices
    if type(starts) is np.ndarray and starts.dtype is _INT64 and starts.shape == (batch,):
        starts = starts.copy()  # the common case: a plain copy, else a conversion
    else:
        starts = _start_indices(write_indices, batch)
    values = starts.tolist()
    if not circular and values and (min(values) < 0 or max(values) > max_seq - seq_len):
        _write_positions(values, seq_len, max_seq, circular)  # raises, naming the first bad row
    return starts, values


def _scatter_quantized(past_cache, update, write_indices, axis, mode, out):
    """``tensor_scatter`` on a ``QuantizedArray``: a float ``update`` is
    quantised (``past_cache``'s format and scale), then its storage is
    scattered into the cache's like any array's -- codes and scales
    together, each checked before anything is written."""
    past, new, dst, wrap = scatter_operands(past_cache, update, out, axis, out is past_cache)
    return wrap(tensor_scatter(past, new, write_indices, axis=axis, mode=mode, out=dst))


def _as_input(value, name):
    """``as_array`` (lists too), but None is a ``TypeError`` naming the
    argument (NumPy would make it a 0-d object array, then a rank error)."""
    if value is None:
        raise TypeError(f"{name} must be an array (numpy.ndarray, or an object with __dlpack__ or "
                        f"__array__), got None")
    return as_array(value, name)


_appends = {}  # the in-place fast path's layouts: key -> ``_new_append``'s entry
_NEW = object()
_NDARRAY = np.ndarray
_INT32 = np.dtype(np.int32)
_FLOAT32 = np.dtype(np.float32)
# ndarray.flags.num's bits (NumPy's C API constants NPY_ARRAY_*).
_C_CONTIGUOUS, _ALIGNED, _WRITEABLE = 0x1, 0x100, 0x400
_WRITEABLE_ALIGNED = _WRITEABLE | _ALIGNED
_UNSIGNED = {n: np.dtype(f"u{n}") for n in (1, 2, 4, 8)}  # dtypes, not types: a cheaper view


def _new_append(key, out, update):
    """The in-place fast path's entry for this layout: ``(batch_shape, window,
    plan, n_items, n_bytes, unsigned dtype, circular, last linear start, direct,
    seq_len, max_seq, token)`` (``window``: batch 1's index but the
    sequence axis, else None; ``direct``: float32 arrays the kernel takes whole;
    ``token``: ``append_token`` can take it), or
    None where the general path must run: bad input (it raises there, naming
    the argument), object arrays, empty caches, a dtype without an aligned unit."""
    _, _, dtype, axis, mode = key[:5]
    entry = None
    unit = ALIGNED_UNITS.get(dtype.type)
    if mode in _IS_CIRCULAR and unit and 0 not in out.shape and not is_object_dtype(dtype):
        try:
            ax = _check_layout(out.shape, update.shape, dtype, update.dtype, axis)
        except (TypeError, ValueError):
            ax = None
        if ax is not None:
            plan, n_bytes, n_items = _make_plan(ax, unit, dtype.itemsize, True, out.shape, update.shape,
                                                (out.strides, update.strides, out.strides))
            max_seq, seq_len = out.shape[ax], update.shape[ax]
            # 4-D float32 only: each rank the kernel takes whole is one more
            # compiled variant (~0.9 s cold); KV caches are 4-D.
            direct = dtype is _FLOAT32 and out.ndim == 4
            # Batch 1: the index of the whole row but the sequence axis.
            window = (slice(None),) * ax if out.shape[0] == 1 and n_bytes < _config.PARALLEL_MIN_BYTES else None
            # One token into unit-stride rows, small enough for the calling thread.
            token = seq_len == 1 and plan[5] != 0 and n_bytes < _config.PARALLEL_MIN_BYTES
            entry = ((out.shape[0],), window, plan, n_items, n_bytes, _UNSIGNED[unit], _IS_CIRCULAR[mode],
                     max_seq - seq_len, direct, seq_len, max_seq, token)
    if len(_appends) >= 1024:
        _appends.clear()
    _appends[key] = entry
    return entry


_layouts = {}  # layout key -> (axis, max_seq, seq_len, plan, bytes written, work items); a few per cache in use


def _new_layout(key):
    """Check the shapes, dtypes and axis of a layout, and plan the kernel's work."""
    axis, unit, in_place, dtype, shape, update_shape, *strides = key
    ax = _check_layout(shape, update_shape, dtype, dtype, axis)
    max_seq, seq_len = shape[ax], update_shape[ax]
    plan, n_bytes, n_items = None, 0, 0
    if not is_object_dtype(dtype) and 0 not in shape:  # else NumPy's slices (or nothing) do it
        plan, n_bytes, n_items = _make_plan(ax, unit, dtype.itemsize, in_place, shape, update_shape, strides)
    if len(_layouts) >= 1024:
        _layouts.clear()
    layout = _layouts[key] = (ax, max_seq, seq_len, plan, n_bytes, n_items)
    return layout


def _check_layout(shape, update_shape, dtype, update_dtype, axis):
    """The sequence axis (non-negative) once every shape, dtype and axis rule holds."""
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"past_cache must have rank >= 2 (batch, ..., sequence, ...), got rank {ndim}")
    if len(update_shape) != ndim:
        raise ValueError(f"update has rank {len(update_shape)}, past_cache has rank {ndim}")
    if update_dtype != dtype:
        raise TypeError(
            f"update has dtype {update_dtype}, past_cache has dtype {dtype} (no implicit casting)"
        )
    if not is_scatter_dtype(dtype):
        raise TypeError(f"past_cache dtype {dtype} is not supported by TensorScatter")
    ax = normalize_axis(axis, ndim)
    if ax == 0:
        raise ValueError(f"axis {axis} is the batch axis; the sequence axis must be 1..{ndim - 1} (or negative)")
    for d in range(ndim):
        if d != ax and shape[d] != update_shape[d]:
            raise ValueError(
                f"update.shape[{d}] = {update_shape[d]} does not match past_cache.shape[{d}] = {shape[d]} "
                f"(the sequence axis is axis={axis}; another layout takes its own axis=)"
            )
    if update_shape[ax] > shape[ax]:
        raise ValueError(
            f"update sequence_length {update_shape[ax]} (axis {ax}) > max_sequence_length {shape[ax]}"
        )
    return ax


def _start_indices(write_indices, batch):
    """``write_indices`` as a new int64 array of shape ``(batch,)``."""
    if write_indices is None:
        return np.zeros(batch, np.int64)
    return index_vector(write_indices, "write_indices", batch)


def _write_positions(values, seq_len, max_seq, circular):
    """Each batch row's start position (``values``, a list) in ``[0, max_seq)``,
    or the ``ValueError`` naming the first row whose linear write falls
    outside the cache."""
    if circular:
        return [w % max_seq for w in values] if max_seq else values
    for b, w in enumerate(values):
        if w < 0 or w + seq_len > max_seq:
            raise _index_error(b, w, seq_len, max_seq)
    return values


def _index_error(b, w, seq_len, max_seq):
    if w < 0:
        return ValueError(f"write_indices[{b}] = {w} is negative (linear mode)")
    return ValueError(
        f"write_indices[{b}] = {w}: {w} + sequence_length {seq_len} > max_sequence_length {max_seq}"
    )


def _make_plan(axis, unit, itemsize, in_place, shape, update_shape, strides):
    """The kernel's int64 plan (see ``_kernels/scatter.py``) for these layouts,
    the number of bytes the call will write, and its number of work items."""
    shapes = (shape, update_shape, shape)
    rows, cols, seq = [], [], []
    for shp, st in zip(shapes, strides):
        st = [s // unit for s in st]
        lo = sum((n - 1) * s for n, s in zip(shp, st) if s < 0)
        rows.append(_offsets(shp[:axis], st[:axis]) - lo)
        cols.append(_offsets(shp[axis + 1:] + (itemsize // unit,), st[axis + 1:] + [1]))
        seq.append(st[axis])
    n_rows, n_cols = rows[0].size, cols[0].size
    seq_len, max_seq = update_shape[axis], shape[axis]
    contiguous = all(np.array_equal(c, np.arange(n_cols)) for c in cols)
    # Positions per work item: ~64 KiB each, so a long copy spreads over the
    # threads while a 1-token append stays one item per row.
    chunk = max(1, _config.CHUNK_BYTES // (n_cols * unit))
    header = [n_rows, n_cols, seq_len, max_seq, int(not in_place), int(contiguous), *seq, chunk]
    batch_of = np.arange(n_rows, dtype=np.int64) // (n_rows // shape[0])
    # (Left writeable: numba types a read-only argument on a slow path, +2 us a call.)
    plan = np.concatenate([np.array(header, np.int64), *rows, batch_of, *cols])
    n_pos = seq_len if in_place else max_seq
    return plan, n_rows * n_pos * n_cols * unit, n_rows * -(-n_pos // chunk)


def _offsets(shape, strides):
    """Flat C-order offsets of every index of ``shape`` under ``strides``."""
    off = np.zeros(1, np.int64)
    for n, s in zip(shape, strides):
        off = (off[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    return off


def scatter_reference(past_cache, update, positions, axis, out, in_place):
    """The plain NumPy path, one slice assignment per batch row (two where a
    circular write wraps) at checked ``positions``: any dtype, object arrays
    too.  Tests can force it with ``_config.REFERENCE``."""
    if not in_place:
        np.copyto(out, past_cache)
    if update.size == 0:
        return out
    max_seq, seq_len = out.shape[axis], update.shape[axis]
    head = (slice(None),) * (axis - 1)
    for b, start in enumerate(positions):
        if start + seq_len <= max_seq:
            out[(b,) + head + (slice(start, start + seq_len),)] = update[b]
        else:  # a circular write that wraps: two slices
            first = max_seq - start
            out[(b,) + head + (slice(start, max_seq),)] = update[(b,) + head + (slice(0, first),)]
            out[(b,) + head + (slice(0, seq_len - first),)] = update[(b,) + head + (slice(first, seq_len),)]
    return out
