"""The block formats' blocks of float64 rows in one pass: ``numkv._quantize``'s
arithmetic (the quantisers of ``numkv._formats``: ``d`` the smallest
float16 that keeps every element within half a step, near the block's
extreme over the code range; codes ``clip(rint((x - m) / d))``, 0 where
``d`` is 0), bit for bit.

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
HELPERS_SHA256 = "8259778696a9c293cd13cab225470892a23efb7ed72415658cd1fd4bfa9b3faa"

BLOCK = 32  # elements a block (``numkv._quantize.BLOCK``)
_FLOAT64_MAX = float(np.finfo(np.float64).max)


@jit()
def quantize_blocks(x, out, scheme, lo, hi, header, packed, bias):
    """Rows of ``x`` (float64, ``(rows, d)`` C-contiguous, ``d % 32 == 0``)
    into ``out`` (uint8, ``(rows, d // 32 * block_bytes)``, the caller's
    scratch): per block its float16 scale (2 bytes, little-endian), for
    ``scheme`` 2 its float16 minimum, then its codes ``q + bias``, one byte
    each, or (``packed``) two per byte, element ``j`` in the low nibble of
    byte ``j`` and element ``j + 16`` in its high one.  ``scheme``: 0
    symmetric, 1 signed, 2 affine (``numkv._formats``' quantisers; ``header``
    the bytes before the codes).  Returns ``(0, 0)``; ``(1, i)`` where
    element ``i`` (flat) is not finite, else ``(2, b)`` where block ``b``
    (flat) needs a scale (or minimum) beyond float16 (``out`` is then partly
    written)."""
    rows, d = x.shape
    blocks = d // BLOCK
    width = header + (BLOCK // 2 if packed else BLOCK)
    for r in range(rows):
        for c in range(d):
            if not abs(x[r, c]) <= _FLOAT64_MAX:  # inf or NaN
                return 1, r * d + c
    for r in range(rows):
        for k in range(blocks):
            c0, at = k * BLOCK, k * width
            amax, extreme, low, high = 0.0, 0.0, x[r, c0], x[r, c0]
            for j in range(c0, c0 + BLOCK):
                v = abs(x[r, j])
                if v > amax:  # (the first of the largest magnitudes, as llama.cpp)
                    amax, extreme = v, x[r, j]
                low = x[r, j] if x[r, j] < low else low
                high = x[r, j] if x[r, j] > high else high
            minimum, m = 0.0, 0
            if scheme == 0:
                h = _float16_bits(amax / hi)
                if h != 0x7C00 and _half_value(h) * (hi + 0.5) < amax:  # rounding took it below
                    h += 1  # one float16 step up (0x7BFF + 1 is 0x7C00: beyond float16 too)
                sign = 0
            elif scheme == 1:
                opposite = 0.0  # the largest magnitude of the other sign than the extreme's
                for j in range(c0, c0 + BLOCK):
                    if x[r, j] * extreme < 0.0:
                        v = abs(x[r, j])
                        opposite = v if v > opposite else opposite
                # the extreme at lo (llama.cpp's amax / 8), coarser only where the
                # opposite extreme would fall beyond hi + 1/2
                below, above = -lo + 0.5, hi + 0.5
                target = amax / -lo if amax / -lo > opposite / above else opposite / above
                h = _float16_bits(target)
                if h != 0x7C00 and (_half_value(h) * below < amax or _half_value(h) * above < opposite):
                    h += 1
                sign = 0x8000 if extreme > 0.0 else 0  # the extreme takes the lo end: d's sign is the other
            else:
                m = _float16_bits(abs(low))  # the minimum rounded down (toward -inf)
                if low < 0.0 and m != 0x7C00 and _half_value(m) < -low:
                    m += 1
                elif low > 0.0 and m != 0x7C00 and _half_value(m) > low:
                    m -= 1
                if m == 0x7C00:
                    return 2, r * blocks + k
                minimum = -_half_value(m) if low < 0.0 else _half_value(m)
                m = m | 0x8000 if low < 0.0 and m else m
                spread = high - minimum
                h = _float16_bits(spread / hi)
                if h != 0x7C00 and _half_value(h) * (hi + 0.5) < spread:
                    h += 1
                sign = 0
            if h == 0x7C00:
                return 2, r * blocks + k
            if h == 0:
                sign = 0  # a block of zeros: d = +0
            out[r, at] = (h | sign) & 0xFF
            out[r, at + 1] = (h | sign) >> 8
            if header == 4:
                out[r, at + 2] = m & 0xFF
                out[r, at + 3] = m >> 8
            # x / d, not x * (1 / d), which rounds twice; a block of zeros (d = 0): 0 / 1
            step = (-_half_value(h) if sign else _half_value(h)) if h else 1.0
            for j in range(BLOCK // 2 if packed else BLOCK):
                first = int(np.rint((x[r, c0 + j] - minimum) / step))
                first = lo if first < lo else hi if first > hi else first
                if not packed:
                    out[r, at + header + j] = (first + bias) & 0xFF
                    continue
                second = int(np.rint((x[r, c0 + j + BLOCK // 2] - minimum) / step))
                second = lo if second < lo else hi if second > hi else second
                out[r, at + header + j] = (first + bias) | ((second + bias) << 4)
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
