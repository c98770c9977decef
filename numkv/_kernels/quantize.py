"""q8_0 / q4_0 blocks of float64 rows in one pass: ``numkv._quantize``'s
arithmetic (its module docstring: ``d`` is ``amax / qmax`` rounded to
float16, one float16 step up where rounding took it below ``amax / (qmax +
1/2)``; codes ``clip(rint(x / d))``, 0 where ``d`` is 0), bit for bit.

Its NumPy form (``numkv._quantize._numpy_blocks``, the path tests force
and compare with) took 24-28 us for one token's keys of 8 heads of 64
(some twenty array operations of ~1 us on 16 blocks), twice an append;
with this kernel the call takes ~5 us (docs/performance.md).  What the
arithmetic finds -- a value that is not finite, a block whose scale float16
cannot hold -- it returns, and the wrapper raises: checked in Python first,
the blocks' maxima would be a pass of their own.
"""

import numpy as np

from .._config import jit
from .simd import _float64_bits

# sha256 of the sources of the modules this one compiles into its kernel:
# numba's disk cache notices edits to a kernel's own file only, and
# ``tests/test_kernel_layout.py`` fails, printing the new value, until this
# is updated after a helper changes (updating it makes numba recompile).
HELPERS_SHA256 = "6c818b8a6d9112eee2f4ad1ad6653d891b1000aeb475068e4dc2aa49d71aa784"

BLOCK = 32  # elements a block (``numkv._quantize.BLOCK``)
_FLOAT64_MAX = float(np.finfo(np.float64).max)


@jit()
def quantize_blocks(x, out, qmax, lo, hi, packed):
    """Rows of ``x`` (float64, ``(rows, d)`` C-contiguous, ``d % 32 == 0``)
    into ``out`` (uint8, ``(rows, d // 32 * block_bytes)``, the caller's
    scratch): per block its float16 scale (2 bytes, little-endian) and its
    codes, one int8 each, or (``packed``: q4_0) ``code + 8`` two per byte,
    element ``j`` in the low nibble of byte ``j`` and element ``j + 16`` in
    its high one.  Returns ``(0, 0)``; ``(1, i)`` where element ``i`` (flat)
    is not finite, else ``(2, b)`` where block ``b`` (flat) needs a scale
    beyond float16 (``out`` is then partly written)."""
    rows, d = x.shape
    blocks = d // BLOCK
    width = 2 + (BLOCK // 2 if packed else BLOCK)
    for r in range(rows):
        for c in range(d):
            if not abs(x[r, c]) <= _FLOAT64_MAX:  # inf or NaN
                return 1, r * d + c
    for r in range(rows):
        for k in range(blocks):
            c0, at = k * BLOCK, k * width
            amax = 0.0
            for j in range(c0, c0 + BLOCK):
                v = abs(x[r, j])
                amax = v if v > amax else amax
            h = _float16_bits(amax / qmax)
            if h != 0x7C00 and _half_value(h) * (qmax + 0.5) < amax:  # rounding took it below
                h += 1  # one float16 step up (0x7BFF + 1 is 0x7C00: beyond float16 too)
            if h == 0x7C00:
                return 2, r * blocks + k
            out[r, at] = h & 0xFF
            out[r, at + 1] = h >> 8
            # x / d, not x * (1 / d), which rounds twice; a block of zeros (d = 0): 0 / 1
            step = _half_value(h) if h else 1.0
            for j in range(BLOCK // 2 if packed else BLOCK):
                low = int(np.rint(x[r, c0 + j] / step))
                low = lo if low < lo else hi if low > hi else low
                if not packed:
                    out[r, at + 2 + j] = low & 0xFF
                    continue
                high = int(np.rint(x[r, c0 + j + BLOCK // 2] / step))
                high = lo if high < lo else hi if high > hi else high
                out[r, at + 2 + j] = (low + 8) | ((high + 8) << 4)
    return 0, 0


@jit(inline=True)
def _half_value(h):
    """The float16 of bits ``h`` (finite, positive) as a float64, exactly."""
    exponent, mantissa = h >> 10, h & 0x3FF
    if exponent == 0:
        return mantissa * 2.0 ** -24
    return (1024 + mantissa) * 2.0 ** (exponent - 25)


@jit(inline=True)
def _float16_bits(x):
    """float16 bits of the float64 ``x >= 0``, rounded to nearest, ties to
    even (as NumPy's ``astype(float16)``: one rounding, not through float32);
    0x7C00 (inf) past float16's range."""
    bits = _float64_bits(x)
    exponent = (bits >> 52) - 1023
    if exponent > 15:
        return 0x7C00
    full = (bits & ((1 << 52) - 1)) | (1 << 52)  # 53 significant bits (x is normal or 0)
    if x == 0.0:
        return 0
    if exponent >= -14:  # a normal float16: keep 11 bits
        shift, base = 42, (exponent + 15) << 10
        kept = full >> shift
        h = base + (kept - 1024)
    else:  # a subnormal float16: units of 2**-24
        shift = 28 - exponent
        if shift > 54:
            return 0
        kept = full >> shift
        h = kept
    rest = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rest > half or (rest == half and kept & 1):
        h += 1  # (a carry out of the mantissa steps the exponent: the encoding's order)
    return h if h < 0x7C00 else 0x7C00
