"""Quantised K/V with scales: ``numkv.quantize`` and ``numkv.QuantizedArray``.

The formats are the records of ``numkv._formats`` (one each: block size and
bytes, code range, how the scale -- and a minimum -- is stored and derived,
the quantiser); this module reads them and names none.  Round to nearest
(NumPy's ``rint``: ties to even, as onnxruntime's own quantiser rounds),
every element within half a step of its value:

``q8_0``
    llama.cpp's ``block_q8_0``: per block of 32 elements along the last axis a
    float16 scale ``d`` then 32 int8 codes, 34 bytes; value = ``d * code``.
``q4_0``
    llama.cpp's ``block_q4_0``: a float16 ``d`` then 16 bytes, byte ``j``
    holding element ``j`` (low nibble) and element ``j + 16`` (high nibble),
    each as ``code + 8``; 18 bytes per 32 elements; value = ``d * code``,
    ``code`` in ``[-8, 7]``; ``d``'s sign puts the block's largest
    magnitude at ``-8`` (as llama.cpp), its size the finest that keeps every
    element within half a step.
``q4_1``
    llama.cpp's ``block_q4_1``: float16 ``d`` and ``m``, then 16 bytes of
    codes ``0..15`` in q4_0's nibble order; 20 bytes per 32; value = ``d *
    code + m``.
``int8``, ``int4``
    onnxruntime's ``GroupQueryAttention`` quantised cache: codes
    ``clip(rint(x / scale), -128, 127)`` (int4: ``[-8, 7]``, stored biased
    ``code + 8``, two per byte, the even element in the low nibble) with a
    scale given per tensor or per channel ``(1, heads, 1, head_size)``.

The block formats keep their scale beside their codes (one byte buffer,
llama.cpp's own layout): a row of a cache is one contiguous run of bytes, so
appending a token writes its codes and scales in one copy, a slice along the
sequence axis is a view, and the attention kernel reads one buffer per
tensor (a dtype code and byte strides, like any other input).

Block scales (``numkv._formats``' quantisers).  llama.cpp takes ``d = amax /
127`` (q8_0) and ``d = max / -8`` with the signed extreme (q4_0); the second
puts the opposite extreme a whole step away (``-max`` -> code 8, clamped to
7).  numkv takes ``d`` as the smallest float16 that keeps every element of
a block within ``d / 2`` of its value (tested), near the block's extreme
over the code range: ``amax / qmax`` rounded to float16, one float16 step
up where rounding took it below; a block of zeros has ``d = 0``.

Nothing here imports numba at import time: this is the wrapper layer
(validation, layout, NumPy arithmetic); the blocks are made by a kernel
(``_kernels.quantize``), and the attention kernels read the codes in place.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING

import numpy as np

from . import _config, _formats
from ._dtypes import BFLOAT16, is_attention_dtype, is_integer_dtype
from ._validate import as_array

if TYPE_CHECKING:  # annotations only: numpy.typing is not imported at run time
    from numpy.typing import ArrayLike, DTypeLike

NAMES = _formats.NAMES
BLOCK = 32  # elements per block of the block formats, along the last axis
# float16's largest value plus half its last step: from here on, float16 rounds to inf.
_FLOAT16_LIMIT = 65520.0
_FLOAT16 = np.dtype(np.float16)
_FLOAT32, _FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)
_UINT8, _INT8 = np.dtype(np.uint8), np.dtype(np.int8)
_DEQUANTIZE_DTYPES = (_FLOAT32, _FLOAT64, _FLOAT16, BFLOAT16)
_QUANTISERS = {"symmetric": 0, "signed": 1, "affine": 2}  # the kernel's ``scheme`` argument
_BLOCK_LIST = " / ".join(_formats.BLOCK_FORMATS)
_GIVEN_LIST = " / ".join(_formats.GIVEN_FORMATS)


def _record(format):
    return _formats.FORMATS[format]


class QuantizedArray:
    """An array stored as integer codes with scales (see ``numkv.quantize``).

    Attributes
    ----------
    format : str
        One of ``numkv.quantize``'s formats (``numkv._formats.FORMATS``).
    shape : tuple of int
        The logical shape (what ``dequantize()`` returns).
    codes : ndarray
        A block format's codes, ``(*shape[:-1], blocks, 32)`` int8 for 8-bit
        codes, ``(*shape[:-1], blocks, 16)`` uint8 for 4-bit ones (llama.cpp's
        nibble order, biased as stored); a given-scale format's codes, int8
        ``shape``, or uint8 ``(*shape[:-1], shape[-1] // 2)`` (biased
        nibbles, even element low).  Views of ``storage``.
    scales : ndarray
        A block format's float16 scales ``(*shape[:-1], blocks)`` (a view of
        ``storage``); a given-scale format's float32 scale, 0-d (per tensor)
        or ``(1, heads, 1, head_size)`` (per channel), read-only.
    minima : ndarray or None
        A block format with a minimum: its float16 minima ``(*shape[:-1],
        blocks)`` (a view of ``storage``); else None.
    storage : ndarray
        What the kernels read and ``tensor_scatter`` writes: a block format's
        uint8 ``(*shape[:-1], blocks * bytes_per_block)``, llama.cpp's
        blocks; a given-scale format's codes.
    nbytes : int
        Bytes of codes and scales this array spans.

    Slicing with integers and slices along every axis but the last gives a
    ``QuantizedArray`` view (no copy).
    """

    __slots__ = ("_format", "_scale", "_shape", "_storage")

    def __init__(self, format, storage, scale=None, *, _shape=None):
        """Internal: use ``numkv.quantize`` or ``QuantizedArray.from_parts``
        (the kernels trust what is built here, so even this checks the
        storage's type: a few attribute reads)."""
        f = _formats.FORMATS.get(format)
        if f is None or type(storage) is not np.ndarray or storage.dtype != f.storage or not storage.ndim \
                or storage.shape[-1] % f.block_bytes or ((scale is None) != f.derived):
            raise TypeError(f"QuantizedArray({format!r}, ...) takes its format's storage "
                            f"({f.storage if f else 'its'} rows{'' if f is None or f.derived else ' and a scale'}): "
                            f"build one with numkv.quantize or QuantizedArray.from_parts")
        self._format = format
        self._storage = storage
        # a given-scale format: the read-only float32 scale, 0-d (per tensor)
        # or of the logical rank with length 1 along every axis it does not vary on
        self._scale = scale
        if _shape is None:
            _shape = storage.shape[:-1] + (storage.shape[-1] // f.block_bytes * f.block,)
        self._shape = tuple(_shape)

    # -- construction from parts ------------------------------------------------

    @classmethod
    def from_parts(cls, format: str, codes: ArrayLike, scales: ArrayLike,
                   minima: ArrayLike | None = None) -> QuantizedArray:
        """A ``QuantizedArray`` from its codes, scales (and, for a format
        with one, minima) as ``.codes``, ``.scales`` and ``.minima`` describe
        them (e.g. onnxruntime's ``present_key`` and its ``k_scale``).  A
        given-scale format's codes are viewed, not copied; a block format's
        codes and scales are copied into llama.cpp's interleaved blocks.

        Raises
        ------
        ValueError, TypeError
            An unknown format, codes of the wrong dtype, or codes, scales and
            minima whose shapes disagree (naming the argument).
        """
        format = _format(format)
        f = _record(format)
        codes = as_array(codes, "codes", sequences=False)
        if codes.dtype != f.codes_dtype:
            raise TypeError(f"codes of {format} must have dtype {f.codes_dtype}, got {codes.dtype}")
        if (minima is not None) != f.minimum:
            raise ValueError(f"{format} {'takes' if f.minimum else 'has no'} minima"
                             f"{'' if f.minimum else '; minima must be None'}")
        if f.derived:
            width = f.block * f.bits // 8
            if codes.ndim < 2 or codes.shape[-1] != width:
                raise ValueError(f"codes of {format} must have shape (..., blocks, {width}), got {codes.shape}")
            parts = [("scales", scales)] + ([("minima", minima)] if f.minimum else [])
            blocks = np.empty(codes.shape[:-1] + (f.block_bytes,), _UINT8)
            for i, (name, part) in enumerate(parts):
                part = as_array(part, name, sequences=False)
                if part.dtype != _FLOAT16:
                    raise TypeError(f"{name} of {format} must have dtype float16, got {part.dtype}")
                if part.shape != codes.shape[:-1]:
                    raise ValueError(f"{name} has shape {part.shape}; codes of shape {codes.shape} need "
                                     f"{codes.shape[:-1]} (one a block)")
                _check_finite_scales(part.astype(np.float32), name,
                                     zero_ok=True, signed=name == "minima" or f.quantiser == "signed")
                blocks[..., 2 * i:2 * i + 2] = part[..., None].view(_UINT8)
            blocks[..., f.header:] = codes.view(_UINT8)
            storage = blocks.reshape(codes.shape[:-2] + (codes.shape[-2] * f.block_bytes,))
            return cls(format, storage)
        if codes.ndim < 1:
            raise ValueError(f"codes must have rank >= 1, got shape {codes.shape}")
        shape = codes.shape[:-1] + (codes.shape[-1] * 8 // f.bits,)
        return cls(format, codes, _given_scale(scales, shape, "scales"), _shape=shape)

    # -- the public view ----------------------------------------------------------

    @property
    def format(self) -> str:
        return self._format

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def storage(self) -> np.ndarray:
        return self._storage

    @property
    def codes(self) -> np.ndarray:
        f = _record(self._format)
        if f.derived:
            return self._blocks()[..., f.header:].view(f.codes_dtype)
        return self._storage

    @property
    def scales(self) -> np.ndarray:
        if _record(self._format).derived:
            return self._blocks()[..., :2].view(_FLOAT16)[..., 0]
        return self._scale

    @property
    def minima(self) -> np.ndarray | None:
        if not _record(self._format).minimum:
            return None
        return self._blocks()[..., 2:4].view(_FLOAT16)[..., 0]

    @property
    def per_channel(self) -> bool:
        """A given-scale format: whether the scale varies along the heads or channels."""
        return self._scale is not None and self._scale.ndim > 0

    @property
    def nbytes(self) -> int:
        rows = math.prod(self._storage.shape)
        if self._scale is None:
            return rows
        return rows + self._scale.nbytes

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d QuantizedArray")
        return self._shape[0]

    def __array__(self, dtype=None, copy=None):
        # Without it NumPy reads the object as nested sequences and, the last
        # axis not being indexable by an int, returns an empty last axis.
        raise TypeError(f"a {self._format} QuantizedArray holds codes and scales, not an array of values: "
                        f"call .dequantize() for its values, or read .codes and .scales")

    def __repr__(self) -> str:
        kind = ""
        if self._scale is not None:
            kind = ", per channel" if self.per_channel else ", per tensor"
        return f"QuantizedArray({self._format!r}, shape={self._shape}{kind}, nbytes={self.nbytes})"

    def _blocks(self):
        s, size = self._storage, _record(self._format).block_bytes
        return s.reshape(s.shape[:-1] + (s.shape[-1] // size, size))

    def scale_view(self) -> np.ndarray | None:
        """A given-scale format: the float32 scale broadcast to the logical
        shape (a read-only view with zero strides); None for a block format."""
        return None if self._scale is None else np.broadcast_to(self._scale, self._shape)

    def dequantize(self, dtype: DTypeLike = np.float32) -> np.ndarray:
        """The values as a new array of ``dtype`` (float32 by default;
        float64, float16 or bfloat16 too): ``scale * code`` (``+ minimum``),
        computed in float32 (float64 for float64) and cast once."""
        dtype = np.dtype(dtype)
        if dtype not in _DEQUANTIZE_DTYPES:
            raise TypeError(f"dtype must be float32, float64, float16 or bfloat16, got {dtype}")
        wide = _FLOAT64 if dtype == _FLOAT64 else _FLOAT32
        f = _record(self._format)
        stored = self.codes
        if f.nibbles:
            stored = _formats.unpack_nibbles(stored, f.nibbles)
        values = stored.astype(wide)
        if f.bias:
            values -= f.bias
        if f.derived:
            blocks = self._blocks()
            out = values * blocks[..., :2].view(_FLOAT16).astype(wide)  # (..., blocks, 1) scales
            if f.minimum:
                out += blocks[..., 2:4].view(_FLOAT16).astype(wide)
            out = out.reshape(self._shape)
        else:
            out = values * self._scale.astype(wide)
        return out if out.dtype == dtype else out.astype(dtype)

    def __getitem__(self, key) -> QuantizedArray:
        key = _basic_key(key, len(self._shape))
        storage = self._storage[key]
        scale = self._scale
        if scale is not None and scale.ndim:  # index it where it varies, keep its 1s elsewhere
            scale = scale[tuple(k if n > 1 else 0 if isinstance(k, int) else slice(None)
                                for k, n in zip(key, scale.shape))]
        shape = storage.shape[:-1] + (self._shape[-1],)
        return QuantizedArray(self._format, storage, scale, _shape=shape)

    def same_scales(self, other: QuantizedArray) -> bool:
        """A given-scale format: whether ``other`` has this array's scale
        (equal values where both broadcast)."""
        a, b = self._scale, other._scale
        try:
            return bool(np.array_equal(*np.broadcast_arrays(a, b)))
        except ValueError:
            return False


def _basic_key(key, ndim):
    """``key`` as a tuple of integers and slices over the leading axes (never
    the last): what keeps a slice of codes and scales a view."""
    if not isinstance(key, tuple):
        key = (key,)
    out = []
    for k in key:
        if isinstance(k, slice):
            out.append(k)
            continue
        if isinstance(k, (bool, np.bool_)) or k is None or k is Ellipsis:
            raise TypeError(f"QuantizedArray takes integers and slices as indices, got {k!r}")
        try:
            out.append(operator.index(k))
        except TypeError:
            raise TypeError(f"QuantizedArray takes integers and slices as indices (basic slicing), "
                            f"got {type(k).__name__}") from None
    if len(out) > ndim:
        raise IndexError(f"too many indices for a QuantizedArray of rank {ndim}: {len(out)}")
    if len(out) == ndim:
        last = out[-1]
        if not (isinstance(last, slice) and last == slice(None)):
            raise IndexError(f"a QuantizedArray is sliced along its leading and sequence axes only; "
                             f"the last axis (head size) takes ':' only, got {last!r}")
        out.pop()
    return tuple(out)


# -- quantize -----------------------------------------------------------------


def _format(format):
    if not isinstance(format, str):
        raise TypeError(f"format must be a string, one of {NAMES}, got {format!r}")
    if format not in _formats.FORMATS:
        raise ValueError(f"format must be one of {', '.join(map(repr, NAMES))}, got {format!r}")
    return format


def quantize(x: ArrayLike, format: str, *, scale: ArrayLike | None = None) -> QuantizedArray:
    """Quantise ``x`` into integer codes with scales.

    Parameters
    ----------
    x : array_like
        A float array (float16, bfloat16, float32, float64, float8), finite.
        q8_0 / q4_0 quantise blocks of 32 elements along the last axis, which
        32 must divide; int4 packs pairs along it, so it must be even.
    format : {"q8_0", "q4_0", "int8", "int4"}
        See the module docstring: llama.cpp's q8_0 / q4_0 blocks (a float16
        scale per block of 32 derived from the block's largest magnitude),
        or onnxruntime's GroupQueryAttention int8 / int4 cache with a given
        ``scale``.
    scale : float or array_like, optional
        int8 / int4 only (required there): positive and finite; a scalar (or
        an array of one element) is per tensor, an array broadcastable to
        ``(1, heads, 1, head_size)`` of a 4-D ``x`` is per channel.

    Returns
    -------
    QuantizedArray

    Notes
    -----
    Round to nearest: every element is within half a step (``scale / 2``)
    of its value.  q8_0 / q4_0 choose their block scale so that this holds
    for every finite block whose scale float16 can hold; int8 / int4 saturate
    at the code range like onnxruntime, so the bound holds for values within
    ``(qmax + 1/2) * scale`` (127.5 or 7.5 steps; 128.5 or 8.5 below zero).

    Raises
    ------
    TypeError, ValueError
        A non-float ``x``, an unknown format, a head size the block does not
        divide, a NaN or infinite value, a ``scale`` where none is taken or
        of the wrong shape, NaN, zero or negative: naming the argument.

    Examples
    --------
    >>> import numpy as np, numkv
    >>> k = np.linspace(-1, 1, 2 * 8 * 64, dtype=np.float32).reshape(1, 2, 8, 64)
    >>> qk = numkv.quantize(k, "q8_0")
    >>> qk.shape, qk.codes.shape, qk.scales.shape, qk.nbytes
    ((1, 2, 8, 64), (1, 2, 8, 2, 32), (1, 2, 8, 2), 1088)
    >>> bool(np.abs(qk.dequantize() - k).max() <= qk.scales.max() / 2)
    True
    >>> qk[:, :, :5].shape                  # a view of the first five positions
    (1, 2, 5, 64)
    >>> q = np.ones((1, 4, 1, 64), np.float32)
    >>> y = numkv.attention(q, qk, qk)      # read in the kernel, never dequantised whole
    >>> bool(np.array_equal(y, numkv.attention(q, qk.dequantize(), qk.dequantize())))
    True
    >>> qv = numkv.quantize(k, "int8", scale=np.full((1, 2, 1, 64), 1 / 127, np.float32))
    >>> qv.codes.dtype, qv.per_channel
    (dtype('int8'), True)
    """
    return quantize_as(x, format, scale, "x")


def quantize_as(x, format, scale, name, scale_name="scale"):
    """``quantize``, with the argument names its messages use (``update``,
    ``key``...: callers that quantise on write)."""
    format = _format(format)
    x = as_array(x, name)
    if not is_attention_dtype(x.dtype):
        raise TypeError(f"{name} has dtype {x.dtype}; quantize takes float16, bfloat16, float32, "
                        f"float64 or an ml_dtypes float8 type")
    if x.ndim < 1:
        raise ValueError(f"{name} must have rank >= 1 (blocks run along the last axis), got a 0-d array")
    d = x.shape[-1]
    f = _record(format)
    if f.derived:
        if scale is not None:
            raise ValueError(f"{format} derives a scale per block of {f.block}; scale must be None, "
                             f"got {scale!r}")
        if d % f.block:
            raise ValueError(f"{name}'s head size (last axis) {d} is not a multiple of {format}'s "
                             f"block of {f.block}")
        return _quantize_blocks(x, f, name)
    if scale is None:
        raise ValueError(f"{format} takes a given {scale_name}: a scalar (per tensor) or an array "
                         f"broadcastable to (1, heads, 1, head_size) (per channel)")
    if d % f.block:
        raise ValueError(f"{name}'s head size (last axis) {d} is odd; {format} packs two codes per byte")
    scale_view = _given_scale(scale, x.shape, scale_name)
    wide = x.astype(np.float64)
    _check_finite_values(wide, name)
    lo, hi = f.code_range
    codes = np.clip(np.rint(wide / scale_view), lo, hi).astype(np.int8)
    if f.nibbles:
        codes = _formats.pack_nibbles(codes + f.bias, f.nibbles)
    return QuantizedArray(format, codes, scale_view, _shape=x.shape)


def _quantize_blocks(x, f, name):
    """A block format ``f`` of ``x`` (last axis a multiple of 32) as
    llama.cpp's blocks (``_kernels.quantize``: the scales and codes of
    ``numkv._formats``' quantisers in one pass; ``_numpy_blocks``' twenty-odd
    NumPy operations took 24-28 us for one token's keys of 8 heads of 64,
    the call ~5 us with the kernel)."""
    global _kernel
    if _config.REFERENCE:  # the plain NumPy form, no numba
        blocks_of = _numpy_blocks
    else:
        if _kernel is None:
            from ._kernels.quantize import quantize_blocks as _kernel
        blocks_of = _kernel
    d = x.shape[-1]
    wide = np.ascontiguousarray(x, dtype=np.float64).reshape(math.prod(x.shape[:-1]), d)
    out = np.empty((wide.shape[0], f.row_bytes(d)), _UINT8)
    lo, hi = f.code_range
    failed, at = blocks_of(wide, out, _QUANTISERS[f.quantiser], lo, hi, f.header, f.bits == 4, f.bias)
    if failed == 1:
        _not_finite(wide.reshape(x.shape), at, name)
    if failed == 2:
        block = wide.reshape(-1, BLOCK)[at]
        where = tuple(int(i) for i in np.unravel_index(at, x.shape[:-1] + (d // BLOCK,)))
        raise ValueError(
            f"{name} has a block of {f.name} at {where} with largest magnitude "
            f"{float(np.abs(block).max())!r}, beyond what a float16 scale{' or minimum' if f.minimum else ''} "
            f"holds (the block's range over its {hi - lo} steps{', and its minimum,' if f.minimum else ''} "
            f"rounds to float16's inf from {_FLOAT16_LIMIT:g} on)")
    return QuantizedArray(f.name, out.reshape(x.shape[:-1] + (out.shape[-1],)), _shape=x.shape)


_kernel = None  # _kernels.quantize.quantize_blocks, imported on the first block format (numba with it)


def _float16_at_least(target, *bounds):
    """The smallest float16 ``h`` (>= 0) near ``target`` with ``h * k >=
    v`` for every ``(k, v)`` of ``bounds``: ``target`` rounded to float16,
    one step up where rounding took it below (inf past float16)."""
    with np.errstate(over="ignore"):
        h = target.astype(_FLOAT16)
        short = np.zeros(h.shape, bool)
        for k, v in bounds:
            short |= h.astype(np.float64) * k < v
        h[short] = np.nextafter(h[short], _FLOAT16.type(np.inf))
    return h


def _numpy_blocks(x, out, scheme, lo, hi, header, packed, bias):
    """``_kernels.quantize.quantize_blocks`` in NumPy (some twenty array
    operations: what numkv ran before that kernel, and the simple path tests
    force with ``_config.REFERENCE``), with its contract: the
    blocks of the float64 rows ``x`` into ``out``; ``(0, 0)``, ``(1, i)``
    where element ``i`` (flat) is not finite, else ``(2, b)`` where block
    ``b`` (flat) needs a scale (or minimum) beyond float16."""
    finite = np.isfinite(x)
    if not finite.all():
        return 1, int(np.argmin(finite))
    blocks = x.reshape(x.shape[0], x.shape[1] // BLOCK, BLOCK)
    magnitude = np.abs(blocks)
    amax = magnitude.max(axis=-1, initial=0.0)
    minimum = np.zeros(amax.shape)
    parts = []
    if scheme == 0:
        d = _float16_at_least(amax / hi, (hi + 0.5, amax))
    elif scheme == 1:
        extreme = np.take_along_axis(blocks, np.argmax(magnitude, axis=-1)[..., None], -1)  # the first largest
        with np.errstate(over="ignore", under="ignore"):  # (the kernel's test: the product's sign)
            opposite = np.where(blocks * extreme < 0, magnitude, 0.0).max(axis=-1)
        below, above = -lo + 0.5, hi + 0.5
        d = _float16_at_least(np.maximum(amax / -lo, opposite / above), (below, amax), (above, opposite))
        d = np.where((extreme[..., 0] > 0) & (d > 0), -d, d)  # the extreme takes the lo end
    else:
        low, high = blocks.min(axis=-1), blocks.max(axis=-1)
        with np.errstate(over="ignore"):
            m = (low + 0.0).astype(_FLOAT16)  # (+ 0.0: -0.0 is 0)
            above = m.astype(np.float64) > low  # rounded up: one step toward -inf
            m[above] = np.nextafter(m[above], _FLOAT16.type(-np.inf))
        minimum = m.astype(np.float64)
        spread = high - minimum + 0.0  # (a block of -0.0: +0)
        d = _float16_at_least(spread / hi, (hi + 0.5, spread))  # (inf where m is: refused below)
        parts = [m[..., None].view(_UINT8)]
    fits = np.isfinite(d)
    if not fits.all():
        return 2, int(np.argmin(fits))
    step = d.astype(np.float64)[..., None]
    codes = np.zeros(blocks.shape, np.float64)
    np.divide(blocks - minimum[..., None], step, out=codes, where=step != 0)
    codes = np.clip(np.rint(codes), lo, hi).astype(np.int16) + bias
    body = _formats.pack_nibbles(codes, "halves") if packed else codes.astype(np.int8).view(_UINT8)
    out[...] = np.concatenate([d[..., None].view(_UINT8), *parts, body], axis=-1).reshape(out.shape)
    return 0, 0


def _check_finite_values(wide, name):
    if not np.isfinite(wide).all():
        _not_finite(wide, int(np.argmin(np.isfinite(wide))), name)


def _not_finite(wide, at, name):
    """Raise for element ``at`` (flat) of ``wide``, named by its position."""
    where = tuple(int(i) for i in np.unravel_index(at, wide.shape))
    raise ValueError(f"{name} holds {float(wide.reshape(-1)[at])} (at {where}): a quantised format holds "
                     f"finite values only")


def _check_finite_scales(values, name, zero_ok=False, signed=False):
    bad = ~np.isfinite(values) if signed else ~np.isfinite(values) | (values < 0 if zero_ok else values <= 0)
    if bad.any():
        at = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), values.shape))
        value = float(values[at])
        raise ValueError(f"{name} holds {value} (at {at}); {'it' if signed else 'a scale'} must be finite"
                         f"{'' if signed else ' and >= 0' if zero_ok else ' and positive'}")


def _given_scale(scale, shape, name):
    """A given int8 / int4 scale as a read-only float32 view broadcast to
    ``shape``: a single value (per tensor), or per channel, broadcastable to
    ``(1, heads, 1, head_size)`` of a 4-D ``shape``."""
    arr = as_array(scale, name)
    if arr.dtype == np.bool_ or not (is_integer_dtype(arr.dtype) or arr.dtype in (_FLOAT16, _FLOAT32, _FLOAT64)):
        raise TypeError(f"{name} must be a real number or a float array, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):
        arr = arr.astype(np.float32)
    _check_finite_scales(arr, name)
    if arr.size == 1 and arr.ndim <= len(shape):
        arr = arr.reshape(())
    else:
        if len(shape) != 4:
            raise ValueError(f"a per-channel {name} needs a 4-D (batch, heads, seq, head_size) array, "
                             f"got shape {tuple(shape)}")
        padded = (1,) * (4 - arr.ndim) + arr.shape if arr.ndim <= 4 else None
        if padded is None or padded[0] != 1 or padded[2] != 1 or padded[1] not in (1, shape[1]) \
                or padded[3] not in (1, shape[3]):
            raise ValueError(f"{name} has shape {arr.shape}; a per-channel scale broadcasts to "
                             f"(1, heads, 1, head_size) = (1, {shape[1]}, 1, {shape[3]})")
        arr = arr.reshape(padded)
    arr = np.array(arr)  # ours, so nobody changes it under the codes
    arr.flags.writeable = False
    return arr


# -- tensor_scatter on a QuantizedArray --------------------------------------------


def scatter_operands(past_cache, update, out, axis, in_place):
    """``tensor_scatter``'s operands for a QuantizedArray ``past_cache``:
    ``(past storage, update storage, out storage or None, wrap)``, every
    check made and a float ``update`` quantised (with ``past_cache``'s
    format, and scale for int8 / int4), before anything is written; ``wrap``
    turns the storage ``tensor_scatter`` returns into the result.  The bits
    move as any other array's (codes and scales together: q8_0 / q4_0 keep
    them in one row)."""
    fmt = past_cache.format
    ndim = past_cache.ndim
    if isinstance(axis, (int, np.integer)) and not isinstance(axis, (bool, np.bool_)) \
            and -ndim <= axis < ndim and axis % ndim == ndim - 1:
        raise ValueError(f"axis {axis} is the quantised last axis (head size); a QuantizedArray is "
                         f"scattered along a sequence axis")
    if not isinstance(update, QuantizedArray):
        update = as_array(update, "update")
    if update.ndim != ndim:
        raise ValueError(f"update has rank {update.ndim}, past_cache has rank {ndim}")
    if update.shape[-1] != past_cache.shape[-1]:
        raise ValueError(f"update.shape[{ndim - 1}] = {update.shape[-1]} does not match "
                         f"past_cache.shape[{ndim - 1}] = {past_cache.shape[-1]}")
    if isinstance(update, QuantizedArray):
        if update.format != fmt:
            raise TypeError(f"update has format {update.format}, past_cache has {fmt} (no implicit "
                            f"conversion)")
        if not _record(fmt).derived and not past_cache.same_scales(update):
            raise ValueError(f"update's {fmt} scale differs from past_cache's: codes of one cache "
                             f"share one scale")
    else:
        scale = None if _record(fmt).derived else past_cache.scales
        update = quantize_as(update, fmt, scale, "update", "past_cache's scale")
    out_storage = None
    if in_place:
        out_storage = past_cache.storage
    elif out is not None:
        if not isinstance(out, QuantizedArray):
            raise TypeError(f"out must be a QuantizedArray like past_cache, got {type(out).__name__}")
        if out.format != fmt or out.shape != past_cache.shape:
            raise ValueError(f"out is a {out.format} array of shape {out.shape}, expected {fmt} of "
                             f"shape {past_cache.shape}")
        if not _record(fmt).derived and not past_cache.same_scales(out):
            raise ValueError(f"out's {fmt} scale differs from past_cache's")
        out_storage = out.storage
    scale = None if _record(fmt).derived else past_cache.scales

    def wrap(storage):
        if in_place or out is not None:
            return out
        return QuantizedArray(fmt, storage, scale, _shape=past_cache.shape)

    return past_cache.storage, update.storage, out_storage, wrap


def zeros(format: str, shape: tuple[int, ...]) -> QuantizedArray:
    """A block format's ``QuantizedArray`` of ``shape`` holding zeros (zero
    codes, scales and minima): a cache's buffer before anything is appended."""
    format = _format(format)
    f = _record(format)
    if not f.derived:
        raise ValueError(f"zeros takes a block format ({_BLOCK_LIST}; {_GIVEN_LIST} need a scale: quantize "
                         f"an array), got {format!r}")
    shape = tuple(shape)
    if not shape or shape[-1] % f.block:
        raise ValueError(f"the head size (last axis) {shape[-1] if shape else None} is not a multiple of "
                         f"{format}'s block of {f.block}")
    storage = np.zeros(shape[:-1] + (f.row_bytes(shape[-1]),), _UINT8)
    return QuantizedArray(format, storage, _shape=shape)


# -- what numkv.attention needs of a QuantizedArray -------------------------------------

def kind(x):
    """What must agree between K and past_key (V and past_value): the dtype
    of an array, the format of a QuantizedArray (as a string)."""
    return x.format if type(x) is QuantizedArray else str(x.dtype)


def check_attention_operand(x, name):
    """A QuantizedArray as attention's K, V, past_key or past_value: 4-D
    ``(batch, heads, seq, head_size)`` with contiguous rows, which is what
    ``quantize`` and slicing give."""
    if name == "Q":
        raise TypeError("Q cannot be a QuantizedArray: numkv reads quantised K, V, past_key and "
                        "past_value; pass Q as a float array")
    if x.ndim != 4:
        raise ValueError(f"{name} is a QuantizedArray of shape {x.shape}; attention takes it 4-D "
                         f"(batch, heads, seq, head_size)")
    return x


def check_same_scales(past, new, past_name, name):
    """``past`` (past_key / past_value) must match ``new`` (K / V): same format,
    and for int8 / int4 the same scale (one scale folds into Q and Y)."""
    if type(new) is QuantizedArray and not _record(new.format).derived and not new.same_scales(past):
        raise ValueError(f"{past_name}'s {new.format} scale differs from {name}'s: numkv folds one "
                         f"scale into Q and Y")


def kernel_array(x):
    """The array the attention kernel reads for ``x``: its storage for a
    QuantizedArray (rows of bytes, the last axis contiguous), else ``x``."""
    if type(x) is not QuantizedArray:
        return x
    storage = x.storage
    if storage.ndim and storage.strides[-1] != storage.itemsize:  # from_parts of a strided view only
        storage = np.ascontiguousarray(storage)
    return storage


def folded_query(q, k, acc_dtype):
    """Q with an int8 / int4 K's scale folded in (``q_d s_d``: the score
    ``sum_d q_d (s_d c_d)`` becomes ``sum_d (q_d s_d) c_d``), as a new
    ``acc_dtype`` array; Q itself for any other K."""
    if type(k) is not QuantizedArray or _record(k.format).derived:
        return q
    return q.astype(acc_dtype) * _per_query_head(k.scales, q.shape[1] // k.shape[1]).astype(acc_dtype)


def output_scale(v, q_heads, acc_dtype):
    """The factor Y takes for an int8 / int4 V (``y_d = s_d sum_j p_j c_jd / l``),
    broadcastable to ``(B, Hq, Sq, Dv)``; None for any other V."""
    if type(v) is not QuantizedArray or _record(v.format).derived:
        return None
    return _per_query_head(v.scales, q_heads // v.shape[1]).astype(acc_dtype)


def _per_query_head(scale, group):
    """A kv head's scale for each of its ``group`` query heads."""
    if scale.ndim and scale.shape[1] > 1 and group > 1:
        return np.repeat(scale, group, axis=1)
    return scale


def dequantized(x, dtype):
    """``x`` as ``dtype`` values (the reference path): a QuantizedArray dequantised."""
    return x.dequantize(dtype) if type(x) is QuantizedArray else x.astype(dtype)
