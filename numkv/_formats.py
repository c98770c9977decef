"""The quantised K/V storage formats: one ``Format`` record each, in one
registry (``FORMATS``), as ggml keeps one row of ``type_traits`` per type.

Everything else derives from these records: ``numkv.quantize`` and
``QuantizedArray`` (layout, checks, dequantising), the kernels' dtype codes
and byte counts (``_kernels.layout.QUANT_TABLE``), their widening (the IR in
``_kernels.widen`` reads the record's fields, never a format's name), the
quantiser kernel, the caches' and ``numkv.transformers``' dtypes, the bench's
cases, the warmup, the demo's choices and the asv parameters.  Adding a
format is a record here, its tests and its docs (docs/design.md, "Adding a
format").

Plain Python and NumPy: no numba, nothing compiled.

Byte layouts (a row of a tensor along its last axis, contiguous):

* a block format (``scale == "block"``): per block of ``block`` elements its
  ``header`` -- a float16 scale ``d``, then (``minimum``) a float16 minimum
  ``m`` -- then its codes: one byte each, or two per byte (``nibbles``);
  value = ``d * code + m`` (``m`` 0 without a minimum);
* a given-scale format (``scale == "given"``): the codes alone; the scale,
  per tensor or per channel, is folded into Q (keys) and Y (values) by the
  attention wrapper; value = ``scale * code``.

Codes are stored as ``code + bias``.  ``nibbles``: ``"halves"`` -- byte ``j``
of a block holds element ``j`` in its low nibble and element ``j + block / 2``
in its high one (llama.cpp); ``"pairs"`` -- byte ``j`` holds elements ``2 j``
(low) and ``2 j + 1`` (onnxruntime).

Quantisers (``quantiser``), round to nearest (ties to even), every element
within half a step (``|d| / 2``) of its value:

* ``"symmetric"``: ``d >= 0`` the smallest float16 with ``(qmax + 1/2) d >=
  amax`` near ``amax / qmax``;
* ``"signed"``: ``d``'s sign puts the block's largest magnitude at the
  ``lo`` end of the code range, its size llama.cpp's ``amax / |lo|`` (q4_0:
  ``d = max / -8``, the extreme exactly on -8) rounded to float16, or, where
  that would leave the largest magnitude of the other sign (``opposite``)
  beyond ``hi + 1/2`` steps, the smallest float16 with ``(hi + 1/2) |d| >=
  opposite``: the finest step with the extreme at ``lo`` that keeps every
  element within half a step (llama.cpp's own ``max / -8`` clamps an element
  at ``-max`` a whole step away).  (``amax / (|lo| + 1/2)``, finer still,
  keeps the bound too, but its half-step error on the extreme cost more
  than the finer step saved: 0.99x llama.cpp's RMS on Gaussian data, 1.04x
  on keys with outlier channels, against 0.998x and 0.9995x; tests/test_llama_cpp_formats.py);
* ``"affine"``: ``m`` the block's minimum rounded down to float16, ``d >= 0``
  the smallest float16 with ``(hi + 1/2) d >= max - m``;
* ``"given"``: ``clip(rint(x / scale), lo, hi)``, the scale the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# The formats' dtype codes follow the kernels' nine float dtypes
# (``_kernels.layout.DTYPE_CODES``, which asserts it).
FIRST_CODE = 9


@dataclass(frozen=True)
class Format:
    """One quantised K/V storage format (see the module docstring)."""

    name: str
    block: int  # elements a block along the last axis (the head size is a multiple of it)
    block_bytes: int  # bytes a block: header and codes
    bits: int  # bits a code: 8, or 4 (two per byte)
    code_range: tuple[int, int]  # (lo, hi), the codes before the bias
    scale: str  # "block": derived per block, in its header; "given": per tensor or channel, folded into Q / Y
    quantiser: str  # "symmetric", "signed", "affine" or "given"
    minimum: bool = False  # a float16 minimum after the scale: value = d * code + m
    bias: int = 0  # stored code = code + bias
    nibbles: str | None = None  # 4-bit codes: "halves" (llama.cpp) or "pairs" (the even element low)
    onnxruntime_bits: int = 0  # onnxruntime's GroupQueryAttention cache of this bit width has this layout
    summary: str = ""

    @property
    def code(self) -> int:
        """The format's dtype code in the kernels' ``desc`` rows."""
        return FIRST_CODE + tuple(FORMATS).index(self.name)

    @property
    def derived(self) -> bool:
        """Whether the scale is derived per block (and stored in it)."""
        return self.scale == "block"

    @property
    def header(self) -> int:
        """Bytes of scale (and minimum) heading each block."""
        return 2 * (1 + self.minimum) if self.derived else 0

    @property
    def storage(self) -> np.dtype:
        """The dtype of ``QuantizedArray.storage``: bytes of blocks, or the codes themselves."""
        return np.dtype(np.int8) if not self.derived and self.bits == 8 and not self.bias else np.dtype(np.uint8)

    @property
    def codes_dtype(self) -> np.dtype:
        """The dtype of ``QuantizedArray.codes`` (int8 codes, else the packed or biased bytes)."""
        return np.dtype(np.int8) if self.bits == 8 and not self.bias else np.dtype(np.uint8)

    @property
    def qmax(self) -> int:
        """The largest code magnitude a symmetric scale is derived for."""
        return max(-self.code_range[0], self.code_range[1]) if self.quantiser == "symmetric" else self.code_range[1]

    def row_bytes(self, width: int) -> int:
        """Bytes a row of ``width`` elements (a multiple of ``block``) spans."""
        return width // self.block * self.block_bytes


def _block(name, bits, code_range, quantiser, **fields):
    codes = 32 * bits // 8
    return Format(name, 32, 2 * (1 + fields.get("minimum", False)) + codes, bits, code_range, "block", quantiser,
                  **fields)


# In this order: a format's dtype code is ``FIRST_CODE`` plus its index.
FORMATS = {f.name: f for f in (
    _block("q8_0", 8, (-127, 127), "symmetric",
           summary="llama.cpp's block_q8_0: a float16 scale and 32 int8 codes, 34 bytes per 32"),
    _block("q4_0", 4, (-8, 7), "signed", bias=8, nibbles="halves",
           summary="llama.cpp's block_q4_0: a float16 scale (signed) and 32 4-bit codes, 18 bytes per 32"),
    _block("q4_1", 4, (0, 15), "affine", minimum=True, nibbles="halves",
           summary="llama.cpp's block_q4_1: a float16 scale d and minimum m, 32 4-bit codes (x = d q + m), "
                   "20 bytes per 32"),
    Format("int8", 1, 1, 8, (-128, 127), "given", "given", onnxruntime_bits=8,
           summary="onnxruntime's GroupQueryAttention int8 cache: codes, a given scale per tensor or channel"),
    Format("int4", 2, 1, 4, (-8, 7), "given", "given", bias=8, nibbles="pairs", onnxruntime_bits=4,
           summary="onnxruntime's GroupQueryAttention int4 cache: biased nibbles, the even element low"),
)}

NAMES = tuple(FORMATS)
# Formats whose scale is derived per block: what a cache quantises into on
# append, what ``numkv.transformers.KVCache`` and the demo offer.
BLOCK_FORMATS = tuple(name for name, f in FORMATS.items() if f.derived)
# Formats whose scale is given (per tensor or per channel) and folded into Q / Y.
GIVEN_FORMATS = tuple(name for name, f in FORMATS.items() if not f.derived)


def unpack_nibbles(packed: np.ndarray, order: str) -> np.ndarray:
    """The 4-bit codes (still biased) of the bytes ``packed`` along its last
    axis, in element order: ``"halves"`` (a block's bytes: low nibbles, then
    high ones) or ``"pairs"`` (each byte's low nibble, then its high one).
    The one nibble decoder of the NumPy side (the kernels' is
    ``_kernels.widen._unpack_nibbles``)."""
    low, high = packed & 15, packed >> 4
    if order == "halves":
        return np.concatenate([low, high], axis=-1)
    return np.stack([low, high], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def pack_nibbles(codes: np.ndarray, order: str) -> np.ndarray:
    """``unpack_nibbles``' inverse: biased 4-bit codes (uint8, an even last
    axis) packed two per byte."""
    codes = codes.astype(np.uint8)
    if order == "halves":
        half = codes.shape[-1] // 2
        return codes[..., :half] | (codes[..., half:] << 4)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)
