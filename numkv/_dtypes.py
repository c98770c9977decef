"""The dtype table and the boundary between NumPy dtypes and what numba can type.

numba (0.68) types neither float16 nor any ``ml_dtypes`` type, so data crosses
the boundary as raw bits:

* scatter moves every fixed-width element as ``k`` units of an unsigned integer
  (``flat_units``), so bits are copied exactly (NaN payloads, -0.0);
* attention reads every input as raw bytes with a dtype code
  (``byte_operand``, ``kernel_dtype_codes``) and widens float16 / bfloat16 /
  float8 tile by tile with bit arithmetic; the decode tables built from
  ``ml_dtypes`` itself (``decode_table``) are the exact reference the tests
  check that against, and float8_e8m0fnu's widening.

Types are classified by identity against explicit tables, never by
``dtype.kind``: ``ml_dtypes`` types are kind ``'V'`` (except float8_e5m2, kind
``'f'``) and are not ``np.floating``.
"""

import functools

import ml_dtypes
import numpy as np

_ML_FLOAT8 = (
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
FLOAT8_TYPES = tuple(np.dtype(getattr(ml_dtypes, n)) for n in _ML_FLOAT8)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# Every fixed-width dtype tensor_scatter accepts (ONNX TensorScatter's T).
SCATTER_DTYPES = frozenset(
    [np.dtype(t) for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64, np.complex64, np.complex128,
    )]
    + [BFLOAT16, *FLOAT8_TYPES]
    + [np.dtype(ml_dtypes.float4_e2m1fn), np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)]
)
# Variable-width strings (str 'U', bytes 'S') and Python objects: scalar types,
# which every width and byte order of them shares.
STRING_TYPES = frozenset([np.str_, np.bytes_, np.object_])
# Every integer scalar type, by identity: numpy's C-named types (``longlong``
# is not ``int64`` as a type object on Linux, though equal as a dtype).
INTEGER_TYPES = frozenset(np.dtype(c).type for c in "bBhHiIlLqQ")
_UINT64_TYPES = frozenset(t for t in INTEGER_TYPES if np.dtype(t) == np.uint64)
# Fixed-width scalar types of SCATTER_DTYPES: '>f4' is as welcome as '<f4' to a bit copy.
_SCATTER_TYPES = frozenset(d.type for d in SCATTER_DTYPES) | {np.longlong, np.ulonglong}

# dtype objects, not type objects: ``view(np.dtype)`` skips a lookup (0.7 -> 0.35 us).
_UNSIGNED = {n: np.dtype(f"u{n}") for n in (1, 2, 4, 8)}


# The predicates every dtype decision in numkv goes through (never
# ``dtype.kind``: see the module docstring).

def is_scatter_dtype(dtype):
    """TensorScatter's T: every fixed-width type of SCATTER_DTYPES, any byte
    order, and strings / objects (a structured or subarray dtype is not)."""
    return (dtype.type in _SCATTER_TYPES and dtype.fields is None and dtype.subdtype is None) \
        or dtype.type in STRING_TYPES


def is_string_dtype(dtype):
    """str, bytes or object: moved by NumPy, never by a kernel."""
    return dtype.type in STRING_TYPES


def is_object_dtype(dtype):
    return dtype.type is np.object_


def is_cache_dtype(dtype):
    """What a KV cache may hold: a fixed-width TensorScatter type."""
    return is_scatter_dtype(dtype) and not is_string_dtype(dtype)


def is_integer_dtype(dtype):
    """numpy's signed and unsigned integers, any width and byte order (not
    bool, not ml_dtypes' int4 / uint4)."""
    return dtype.type in INTEGER_TYPES


def is_uint64_dtype(dtype):
    return dtype.type in _UINT64_TYPES


def is_attention_dtype(dtype):
    """Attention's Q / K / V (native byte order: the kernel reads the bits)."""
    return dtype in ATTENTION_DTYPES


def is_float8_dtype(dtype):
    """Whether ``dtype`` (a dtype, not a scalar type) is one of ml_dtypes' float8s."""
    # The size first: comparing with ml_dtypes' dtypes costs ~40 ns each.
    return dtype.itemsize == 1 and dtype in FLOAT8_TYPES


def is_mask_dtype(dtype):
    """An ``attn_mask``: bool, or additive in any integer (ONNX's U) or any
    float Attention takes (float8 too: they widen to float32 exactly)."""
    return dtype == np.bool_ or is_integer_dtype(dtype) or dtype in ATTENTION_DTYPES


# Scalar type -> the unit numpy's ``aligned`` flag proves an array of it tiles
# into: the dtype's alignment (its size, except complex64 4, complex128 8,
# 'U' 4, 'S' 1).  Keyed by type, not dtype: byte order does not matter to a
# bit copy, and ml_dtypes' dtypes hash alike, so looking them up cost ~0.7 us.
# (longlong: numpy's other 64-bit integer type, equal to int64 as a dtype.)
ALIGNED_UNITS = {d.type: d.alignment for d in (*SCATTER_DTYPES, *map(np.dtype, "qQUS"))
                 if d.alignment in _UNSIGNED}


def unit_size(arrays):
    """The widest unsigned unit (8, 4, 2 or 1 bytes) that tiles every element,
    stride and start address of ``arrays`` exactly (``arrays[0]``'s dtype),
    from the addresses and strides themselves (``ALIGNED_UNITS`` is the
    shortcut where numpy's aligned flags settle it)."""
    itemsize = arrays[0].itemsize
    for unit in (8, 4, 2):
        if itemsize % unit == 0 and all(
            a.ctypes.data % unit == 0 and all(s % unit == 0 for s in a.strides)
            for a in arrays
        ):
            return unit
    return 1


class _Buffer:
    """Exposes raw memory through ``__array_interface__``; keeps ``owner`` alive."""

    def __init__(self, owner, interface):
        self.base = owner
        self.__array_interface__ = interface


def flat_units(arr, unit, flags=None):
    """``flat_view(arr, <unsigned of unit bytes>)``'s buffer; C-contiguous
    arrays take a cheaper path (a 1-token append is pure call overhead, and
    a caller that has ``arr.flags`` at hand passes it on)."""
    utype = _UNSIGNED[unit]
    if flags is None:
        flags = arr.flags
    if flags.c_contiguous and flags.writeable:
        return arr.ravel().view(utype)
    return flat_view(arr, utype)[0]


def flat_view(arr, dtype):
    """A 1-D ``dtype`` view over every byte ``arr`` spans, from its lowest
    address; returns ``(flat, base, strides)`` where ``arr[idx]`` is
    ``flat[base + sum(idx * strides)]`` (strides in items of ``dtype``).

    Works for any strides (negative, zero, transposed) without copying; the
    caller guarantees ``dtype.itemsize`` divides the address and the strides.
    The view is always typed writeable, so that numba compiles one variant
    whether an input is read-only or not: only kernel *outputs* are ever
    written through it, and the wrappers check those are writeable.
    """
    strides = [s // dtype.itemsize for s in arr.strides]
    if arr.size == 0:  # nothing is read; keep the type numba sees
        return np.zeros(1, dtype), 0, strides
    flags = arr.flags
    if flags.c_contiguous and flags.writeable and arr.dtype == dtype:  # the common case, cheapest
        return arr.reshape(-1), 0, strides
    if flags.writeable and all(s > 0 or n == 1 for s, n in zip(strides, arr.shape)):  # (read-only: another numba type)
        # A permutation of a C-contiguous block (3-D inputs seen as 4-D, K/V
        # transposes; a size-1 axis's stride, 0 for a new axis, is never
        # used): un-permute, and ravel is a view.  ~4x cheaper than building
        # the view from the address, and calls are small in decode.
        dense = arr.transpose(sorted(range(arr.ndim), key=strides.__getitem__, reverse=True))
        if dense.flags.c_contiguous:
            return dense.ravel().view(dtype), 0, strides
        # A view into a C-contiguous buffer (a cache's first keys, ``buffer[:, :, :n]``): the
        # buffer's flat view from the view's first element, ~2x cheaper than from the address.
        owner = arr.base
        if type(owner) is np.ndarray and owner.flags.c_contiguous and owner.flags.writeable \
                and not owner.dtype.hasobject and owner.nbytes % dtype.itemsize == 0:
            start, rem = divmod(arr.ctypes.data - owner.ctypes.data, dtype.itemsize)
            end = start + sum((n - 1) * s for n, s in zip(arr.shape, strides)) + arr.itemsize // dtype.itemsize
            if not rem and 0 <= start and end * dtype.itemsize <= owner.nbytes:  # (a base that holds it)
                return owner.reshape(-1).view(dtype)[start:end], 0, strides
    lo = sum((n - 1) * s for n, s in zip(arr.shape, strides) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(arr.shape, strides) if s > 0)
    interface = {
        "shape": (hi - lo + arr.itemsize // dtype.itemsize,),
        "typestr": dtype.str,
        "data": (arr.ctypes.data + lo * dtype.itemsize, False),
        "strides": None,
        "version": 3,
    }
    return np.asarray(_Buffer(arr, interface)), -lo, strides


@functools.lru_cache(maxsize=None)
def decode_table(dtype):
    """float32 value of every bit pattern of a 16- or 8-bit float type."""
    bits = np.arange(1 << (8 * dtype.itemsize), dtype=_UNSIGNED[dtype.itemsize])
    table = bits.view(dtype).astype(np.float32)
    table.flags.writeable = False
    return table


# Attention's Q/K/V dtypes: float16/bfloat16/float32/float64 (ONNX T1/T2) and,
# beyond the spec, float8 (a quantised KV cache, widened tile by tile).
ATTENTION_DTYPES = frozenset(
    [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BFLOAT16, *FLOAT8_TYPES]
)


NO_BYTES = np.zeros(8, np.uint8)  # the bytes of an empty operand: never read
_BYTE = np.dtype(np.uint8)


def byte_operand(arr):
    """``(bytes, base, strides)``: the attention kernel's view of an input, its
    memory as flat bytes, with the base offset and strides in elements of
    ``arr``'s dtype (so one compiled kernel reads every dtype)."""
    flags = arr.flags
    if not arr.size:  # nothing is read (an empty past)
        return NO_BYTES, 0, [0] * arr.ndim
    if flags.c_contiguous and flags.writeable:  # the common case, at a tenth of the cost
        n = arr.itemsize
        return arr.ravel().view(_BYTE), 0, [s // n for s in arr.strides]
    if not flags.aligned:  # rare (a view into packed bytes): costs one O(input) copy
        arr = np.ascontiguousarray(arr)
    flat, base, strides = flat_view(arr, _UNSIGNED[arr.itemsize])
    return flat.view(np.uint8), base, strides


def block_bytes(arr):
    """``byte_operand(arr)[0]`` for an ``arr`` that is a permutation of a
    C-contiguous array's axes (the caller knows): its bytes in memory order,
    a view, at a sixth of the cost."""
    return arr.ravel("K").view(_BYTE) if arr.size else NO_BYTES


@functools.lru_cache(maxsize=None)
def kernel_dtype_codes(names):
    """``{dtype: code}`` for the kernel's tuple of dtype ``names`` (code = index)."""
    return {np.dtype(getattr(ml_dtypes, name, name)): code for code, name in enumerate(names)}


@functools.cache
def e8m0_table():
    """float8_e8m0fnu's 256 values (powers of two and NaN: no bit trick pays)."""
    return decode_table(np.dtype(ml_dtypes.float8_e8m0fnu))
