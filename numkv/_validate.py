"""Argument checks shared by the wrappers.

Every message names the argument (and axis or batch row) at fault and the
offending value, in the ONNX operators' words.  Nothing here writes anything.
"""

import operator

import numpy as np

from ._dtypes import is_integer_dtype, is_uint64_dtype

INT64_MAX = np.iinfo(np.int64).max


def as_array(value, name, sequences=True):
    """``value`` as a plain ``numpy.ndarray``, viewing its memory where it can.

    * an ndarray subclass is seen as its base class (``np.matrix`` keeps its
      2-D shape but loses its ``*`` and indexing rules; a masked array with no
      masked element is its data, one with masked elements is a ``TypeError``);
    * an object with ``__dlpack__`` (torch CPU tensors) is viewed through
      DLPack, never copied; one with ``__array__`` goes through ``np.asarray``;
    * anything else (lists, scalars) only with ``sequences``: ``np.asarray``.

    Whatever NumPy cannot take is a ``TypeError`` naming the argument.
    """
    if type(value) is np.ndarray:
        return value
    if isinstance(value, np.ndarray):
        return _base_view(value, name)
    try:
        if hasattr(value, "__dlpack__"):
            return np.from_dlpack(value)
        if hasattr(value, "__array__") or sequences:
            return np.asarray(value)
    except Exception as exc:
        raise TypeError(_conversion_error(value, name, exc)) from exc
    raise TypeError(f"{name} must be an array (numpy.ndarray, or an object with __dlpack__ or "
                    f"__array__), got {type(value).__name__}")


def as_output(value, name="out"):
    """A writeable view of ``value`` (an ndarray, a subclass, or a DLPack
    producer such as a torch CPU tensor): what is written through it lands in
    ``value``.  An object with only ``__array__`` could hand over a copy, so
    it is not taken."""
    if isinstance(value, np.ndarray) or hasattr(value, "__dlpack__"):
        return as_array(value, name)
    raise TypeError(f"{name} must be a numpy.ndarray or an object with __dlpack__ (written in "
                    f"place), got {type(value).__name__}")


def _base_view(value, name):
    if isinstance(value, np.ma.MaskedArray):
        mask = value.mask
        if mask is not np.ma.nomask and mask.any():
            raise TypeError(
                f"{name} is a masked array with masked elements, which numkv does not know "
                f"how to treat: pass {name}.filled(fill_value) (or an attn_mask for attention)")
        return value.data.view(np.ndarray)
    return value.view(np.ndarray)


def _conversion_error(value, name, exc):
    """The ``TypeError`` message for an object NumPy could not take, with the
    zero-copy recipe for torch's 16- and 8-bit floats (NumPy has no dtype of
    its own for them; ml_dtypes has, under the same names)."""
    dtype = str(getattr(value, "dtype", ""))
    kind = dtype.rpartition(".")[2]
    if dtype.startswith("torch.") and (kind == "bfloat16" or kind.startswith("float8")):
        bits = "int16" if kind == "bfloat16" else "uint8"
        return (f"{name} is a {dtype} tensor, which NumPy cannot view; pass "
                f"{name}.view(torch.{bits}).numpy().view(ml_dtypes.{kind}) (no copy), "
                f"or convert it to float32 ({exc})")
    return f"{name} cannot be viewed as a NumPy array ({type(value).__name__}): {exc}"


def as_int(value, name):
    """An attribute that must be a plain integer (bools are rejected)."""
    if type(value) is int:  # the common case, first (decode calls are small)
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def as_int64(value, name):
    """``as_int`` within int64 (what the kernels compute with)."""
    value = as_int(value, name)
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueError(f"{name} = {value} is outside the int64 range")
    return value


def as_count(value, name, minimum=0):
    """A plain integer ``>= minimum`` within int64 (bools rejected)."""
    value = as_int64(value, name)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def as_flag(value, name):
    """A bool (or NumPy bool): ``TypeError`` for anything else, so that a
    string such as ``"False"`` is never taken as true."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


def as_float(value, name):
    """A real number as a Python float (bools, strings and complex rejected);
    an integer too large for a float is a ``ValueError``."""
    if type(value) is float:
        return value
    if isinstance(value, (bool, np.bool_, str, bytes, complex, np.complexfloating)) \
            or not hasattr(value, "__float__"):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} = {value} is beyond the float64 range") from None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a number, got {value!r}") from exc


def normalize_axis(axis, ndim, name="axis"):
    axis = as_int(axis, name)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name} {axis} is out of range for rank {ndim}")
    return axis % ndim


def index_vector(value, name, length, upper=None, upper_label=""):
    """An integer vector of shape ``(length,)`` as int64 (a copy: later checks
    and kernels never see the caller's array change under them); with
    ``upper``, every entry must lie in ``[0, upper]``."""
    if isinstance(value, (list, tuple)):  # Python ints beyond int64 would become object or float
        for i, v in enumerate(value):
            if type(v) is int and not -INT64_MAX - 1 <= v <= INT64_MAX:
                raise ValueError(f"{name}[{i}] = {v} is outside the int64 range")
    arr = as_array(value, name)
    if arr.size == 0 and arr.ndim == 1 and length == 0:
        return np.zeros(0, np.int64)  # batch 0: np.asarray([]) is float64
    if not is_integer_dtype(arr.dtype):
        raise TypeError(f"{name} must be an integer array (int32 or int64), got dtype {arr.dtype}")
    if arr.shape != (length,):
        raise ValueError(f"{name} must have shape (batch_size,) = ({length},), got {arr.shape}")
    if is_uint64_dtype(arr.dtype) and length and int(arr.max()) > INT64_MAX:
        raise ValueError(f"{name} has an entry above the int64 range")
    arr = np.array(arr, dtype=np.int64)
    if upper is not None:
        bad = np.flatnonzero((arr < 0) | (arr > upper))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{name}[{i}] = {int(arr[i])} is outside [0, {upper_label}{upper}]")
    return arr


def output_array(out, shape, dtype, name="out"):
    """``out`` checked against the result's shape and dtype (``out`` is
    already a plain ndarray: see ``as_output``)."""
    if out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype}, expected {dtype}")
    if out.shape != shape:
        raise ValueError(f"{name} has shape {out.shape}, expected {shape}")
    if not out.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return out
