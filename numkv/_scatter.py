"""``numkv.tensor_scatter``: the ONNX TensorScatter op (opset 24).

coerce -> validate everything -> canonical (P, Smax, R) layouts -> unsigned bit
views -> serial or parallel kernel.  Object arrays (Python strings) and small
in-place updates of a few batch rows take the plain NumPy path (slice
assignments), which tests can force with ``_config.REFERENCE``.
"""

import functools

import numpy as np

from . import _config
from ._dtypes import flat_units, is_scatter_dtype, unit_size
from ._validate import as_array, as_int, index_vector, normalize_axis, output_array

MODES = ("linear", "circular")

# Below this many bytes moved the serial kernel wins: the parallel launch
# costs more than the copy itself (see README, "Benchmarks").
PARALLEL_MIN_BYTES = 1 << 18
CHUNK_BYTES = 1 << 16
# A small in-place update of at most this many batch rows is copied with NumPy
# slice assignments: ~1 us a row against the kernel path's ~8 us of fixed cost
# (argument views, plan lookup, dispatch); measured crossover 4-8 rows.
SLICE_MAX_ROWS = 4
SLICE_MAX_BYTES = 1 << 16
_INT64 = np.dtype(np.int64)

_kernels = None


def _scatter_kernels():
    global _kernels
    if _kernels is None:
        from ._kernels import scatter

        _kernels = scatter
    return _kernels


def tensor_scatter(past_cache, update, write_indices=None, *, axis=-2, mode="linear", out=None):
    """Write ``update`` into ``past_cache`` along ``axis`` at per-batch-row
    ``write_indices`` (ONNX TensorScatter, opset 24).

    Parameters
    ----------
    past_cache : ndarray, shape ``(batch, D1, ..., max_sequence_length, ..., Dn)``
    update : ndarray, ``past_cache``'s shape and dtype except ``sequence_length <=
        max_sequence_length`` along ``axis``
    write_indices : int array of shape ``(batch,)``, optional
        Where each batch row's update starts; zeros when omitted.  In
        ``"circular"`` mode taken modulo ``max_sequence_length`` (negative too).
    axis : int, default -2
        The sequence axis; may be negative, must not be the batch axis 0.
    mode : ``"linear"`` or ``"circular"``
    out : ndarray, optional
        ``None``: a new array (``past_cache`` is not modified).  ``past_cache``
        itself: updated in place in O(update) time.  Any other array of the same
        shape and dtype receives ``past_cache`` with the update applied.

    Returns
    -------
    ndarray
        ``present_cache`` (``out`` when given).

    Raises
    ------
    TypeError, ValueError
        On bad input, before anything is written.
    """
    # (Type checks inlined: a 1-token append is pure call overhead.)
    if type(past_cache) is not np.ndarray:
        past_cache = as_array(past_cache, "past_cache")
    if type(update) is not np.ndarray:
        update = as_array(update, "update")
    max_seq, seq_len, ax = _check_shapes(past_cache, update, axis)
    if mode not in MODES:
        raise ValueError(f"mode must be 'linear' or 'circular', got {mode!r}")
    write_at = _write_positions(write_indices, past_cache.shape[0], seq_len, max_seq, mode)

    in_place = out is past_cache
    if out is None:
        out = np.empty(past_cache.shape, past_cache.dtype)
    elif not in_place:
        output_array(out, past_cache.shape, past_cache.dtype)
        if np.may_share_memory(out, past_cache):
            past_cache = past_cache.copy()
    elif not out.flags.writeable:
        raise ValueError("out (= past_cache) is read-only")
    # Arrays that both own their memory cannot overlap (spares a bounds check).
    if update is out or (not (update.base is None and out.base is None)
                         and np.may_share_memory(out, update)):
        update = update.copy()

    if past_cache.size == 0 or (in_place and seq_len == 0):
        if not in_place:
            np.copyto(out, past_cache)
        return out
    if (_config.REFERENCE or past_cache.dtype.kind == "O"
            or (in_place and len(write_at) <= SLICE_MAX_ROWS and update.nbytes <= SLICE_MAX_BYTES)):
        return scatter_reference(past_cache, update, write_at, ax, out, in_place)
    _scatter_bits(past_cache, update, write_at, ax, out, in_place)
    return out


def _check_shapes(past_cache, update, axis):
    """``(max_seq, seq_len, axis)`` once every shape, dtype and axis rule holds."""
    if type(axis) is not int:
        axis = as_int(axis, "axis")
    return _checked_layout(past_cache.shape, update.shape, past_cache.dtype, update.dtype, axis)


# Memoised: a decode loop checks the same shapes every step (0.9 -> 0.3 us).
@functools.lru_cache(maxsize=256)
def _checked_layout(shape, update_shape, dtype, update_dtype, axis):
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
                f"update.shape[{d}] = {update_shape[d]} does not match past_cache.shape[{d}] = {shape[d]}"
            )
    max_seq, seq_len = shape[ax], update_shape[ax]
    if seq_len > max_seq:
        raise ValueError(
            f"update sequence_length {seq_len} (axis {ax}) > max_sequence_length {max_seq}"
        )
    return max_seq, seq_len, ax


def _write_positions(write_indices, batch, seq_len, max_seq, mode):
    """Per-batch-row start positions in ``[0, max_seq)`` as a fresh int64
    array (a copy: the kernel trusts these bounds, so nobody else holds it)."""
    if write_indices is None:
        return np.zeros(batch, np.int64)
    if (type(write_indices) is np.ndarray and write_indices.dtype is _INT64
            and write_indices.shape == (batch,)):
        starts = write_indices.copy()  # the common case, checked in 1/3 of the time
    else:
        starts = index_vector(write_indices, "write_indices", batch)
    if mode == "circular":
        return starts % max_seq if max_seq else starts
    if batch <= 64:  # Python's min/max over a short list beat two numpy reductions
        values = starts.tolist()
        low, high = (min(values), max(values)) if batch else (0, 0)
    else:
        low, high = starts.min(), starts.max()
    if low < 0 or high > max_seq - seq_len:
        for b, w in enumerate(starts.tolist()):
            if w < 0:
                raise ValueError(f"write_indices[{b}] = {w} is negative (linear mode)")
            if w + seq_len > max_seq:
                raise ValueError(
                    f"write_indices[{b}] = {w}: {w} + sequence_length {seq_len} "
                    f"> max_sequence_length {max_seq}"
                )
    return starts


def _scatter_bits(past_cache, update, write_at, axis, out, in_place):
    """Run the kernel over unsigned bit views of the three arrays."""
    arrays = (out, update) if in_place else (out, update, past_cache)
    unit = unit_size(arrays)
    src = out if in_place else past_cache  # in place the kernel never reads src
    key = (axis, unit, out.itemsize, in_place, out.shape, update.shape,
           out.strides, update.strides, src.strides)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _make_plan(*key)
    dst = flat_units(out, unit)
    k = _scatter_kernels()
    kernel = k.scatter_parallel if plan[1] >= PARALLEL_MIN_BYTES else k.scatter_serial
    kernel(dst, flat_units(update, unit), dst if in_place else flat_units(src, unit), plan[0], write_at)


_plans = {}  # layout key -> (plan, bytes written); a few entries per cache in use


def _make_plan(axis, unit, itemsize, in_place, shape, update_shape, *strides):
    """The kernel's int64 plan (see ``_kernels/scatter.py``) for these layouts,
    and the number of bytes the call will write."""
    if len(_plans) > 1024:
        _plans.clear()
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
    chunk = max(1, CHUNK_BYTES // (n_cols * unit))
    header = [n_rows, n_cols, seq_len, max_seq, int(not in_place), int(contiguous), *seq, chunk]
    batch_of = np.arange(n_rows, dtype=np.int64) // (n_rows // shape[0])
    plan = np.concatenate([np.array(header, np.int64), *rows, batch_of, *cols])
    plan.flags.writeable = False
    n_pos = seq_len if in_place else max_seq
    return plan, n_rows * n_pos * n_cols * unit


def _offsets(shape, strides):
    """Flat C-order offsets of every index of ``shape`` under ``strides``."""
    off = np.zeros(1, np.int64)
    for n, s in zip(shape, strides):
        off = (off[:, None] + np.arange(n, dtype=np.int64) * s).ravel()
    return off


def scatter_reference(past_cache, update, write_at, axis, out, in_place):
    """The plain NumPy path, one slice assignment per batch row (two where a
    circular write wraps): any dtype, object arrays too.  Tests can force it
    with ``_config.REFERENCE``; small in-place updates take it for speed."""
    if not in_place:
        np.copyto(out, past_cache)
    max_seq, seq_len = out.shape[axis], update.shape[axis]
    head = (slice(None),) * (axis - 1)
    for b, start in enumerate(write_at.tolist()):
        if start + seq_len <= max_seq:
            out[(b,) + head + (slice(start, start + seq_len),)] = update[b]
        else:  # a circular write that wraps: two slices
            first = max_seq - start
            out[(b,) + head + (slice(start, max_seq),)] = update[(b,) + head + (slice(0, first),)]
            out[(b,) + head + (slice(0, seq_len - first),)] = update[(b,) + head + (slice(first, seq_len),)]
    return out
