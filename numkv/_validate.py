"""Argument checks shared by the wrappers.

Every message names the argument (and axis or batch row) at fault and the
offending value, in the ONNX operators' words.  Nothing here writes anything.
"""

import operator

import numpy as np


def as_array(value, name):
    if isinstance(value, np.ndarray):
        return value
    try:
        return np.asarray(value)
    except Exception as exc:  # pragma: no cover - numpy's own message is kept
        raise TypeError(f"{name} must be array-like, got {type(value).__name__}") from exc


def as_int(value, name):
    """An attribute that must be a plain integer (bools are rejected)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def as_float(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def normalize_axis(axis, ndim, name="axis"):
    if type(axis) is not int:
        axis = as_int(axis, name)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name} {axis} is out of range for rank {ndim}")
    return axis % ndim


def index_vector(value, name, length, upper=None, upper_label=""):
    """An integer vector of shape ``(length,)`` as int64 (a copy: later checks
    and kernels never see the caller's array change under them); with
    ``upper``, every entry must lie in ``[0, upper]``."""
    arr = value if isinstance(value, np.ndarray) else as_array(value, name)
    if arr.size == 0 and arr.ndim == 1 and length == 0:
        return np.zeros(0, np.int64)  # batch 0: np.asarray([]) is float64
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array (int32 or int64), got dtype {arr.dtype}")
    if arr.shape != (length,):
        raise ValueError(f"{name} must have shape (batch_size,) = ({length},), got {arr.shape}")
    if arr.dtype.kind == "u" and length and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} has an entry above the int64 range")
    arr = np.array(arr, dtype=np.int64)
    if upper is not None:
        bad = np.flatnonzero((arr < 0) | (arr > upper))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}] = {int(arr[i])} is outside [0, {upper_label}{upper}]")
    return arr


def output_array(out, shape, dtype, name="out"):
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype}, expected {dtype}")
    if out.shape != shape:
        raise ValueError(f"{name} has shape {out.shape}, expected {shape}")
    if not out.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return out
