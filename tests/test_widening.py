"""The attention kernel's widening of narrow floats, for every bit pattern.

The kernel widens float16, bfloat16 and the float8s with bit arithmetic (and
F16C's conversion where the CPU has it); the decode tables built from
ml_dtypes itself (``_dtypes.decode_table``) are the exact reference.  Every
pattern must give the same float32 bits (any NaN for a NaN).
"""

import ml_dtypes
import numpy as np
import pytest

from numkv._dtypes import decode_table, e8m0_table, kernel_dtype_codes
from numkv._kernels import attention as kernels

NARROW = ["float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
          "float8_e8m0fnu"]


def widened(dtype, patterns, stride=1):
    """``patterns`` (unsigned bits of ``dtype``) through ``_widen_rows``, as a
    (1, n) row read with element ``stride``."""
    codes = kernel_dtype_codes(kernels.DTYPE_CODES)
    n = patterns.size
    spread = np.zeros(n * stride, patterns.dtype)
    spread[::stride] = patterns
    out = np.full((1, n), -1.0, np.float32)
    kernels._widen_rows(out, np.int64(0), np.int64(1), np.int64(n), spread.view(np.uint8), codes[dtype],
                        np.int64(0), np.int64(n * stride), np.int64(stride), e8m0_table(),
                        kernels.FORMAT_TABLE)
    return out[0]


def assert_same_floats(got, want):
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), f"NaN differs at patterns {np.flatnonzero(np.isnan(got) != nan)[:8]}"
    bad = np.flatnonzero(got[~nan].view(np.uint32) != want[~nan].view(np.uint32))
    assert bad.size == 0, f"{bad.size} patterns differ, e.g. {np.flatnonzero(~nan)[bad[:8]]}"


@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("stride", [1, 3], ids=["contiguous", "strided"])
def test_every_bit_pattern_widens_exactly(name, stride):
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    patterns = np.arange(1 << (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}")
    assert_same_floats(widened(dtype, patterns, stride), decode_table(dtype))


@pytest.mark.parametrize("name", ["float16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                  "float8_e5m2fnuz"])
def test_the_arithmetic_decode_matches_the_tables(name):
    """``_decode_bits`` with each format's parameters, as used where F16C
    is missing (float16, e5m2, e4m3fn) and always (the fnuz types)."""
    from numba import njit

    dtype = np.dtype(getattr(ml_dtypes, name, name))
    code = kernel_dtype_codes(kernels.DTYPE_CODES)[dtype]
    sign = np.uint32(0x8000 if dtype.itemsize == 2 else 0x80)

    @njit
    def decode_all(patterns, formats, out):
        shift, scale, infnan, nan_em, nan_x = kernels._format(formats, code)
        for i in range(patterns.size):
            out[i] = kernels._decode_bits(patterns[i], sign, shift, scale, infnan, nan_em, nan_x)

    patterns = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint32)
    out = np.empty(patterns.size, np.float32)
    decode_all(patterns, kernels.FORMAT_TABLE, out)
    assert_same_floats(out, decode_table(dtype))
