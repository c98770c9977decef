"""``simd._row_max``, the softmax's running maximum (LLVM IR, a register's
lanes a vector, a "NaN seen" mask): against NumPy's ``max`` over rows of
every length around the vector and loop widths, at any offset, with NaN,
+-inf and zeros anywhere in them (a zero maximum's sign is either)."""

import numba
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from numkv._kernels.simd import _row_max


@numba.njit
def row_max(flat, at, n):
    return _row_max(flat, at, n)


SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30]


@given(n=st.integers(0, 150), at=st.integers(0, 20), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2**32 - 1), specials=st.lists(st.tuples(st.integers(0, 149), st.sampled_from(SPECIALS)),
                                                          max_size=4))
@settings(max_examples=300, deadline=None)
def test_row_max_is_numpys_max(n, at, dtype, seed, specials):
    flat = np.random.default_rng(seed).standard_normal(at + n + 3).astype(dtype)
    for j, value in specials:
        if j < n:
            flat[at + j] = value
    got = row_max(flat, at, n)
    want = np.max(flat[at:at + n]) if n else -np.inf
    assert type(got) is float and (np.isnan(got) if np.isnan(want) else got == want)


def test_a_nan_anywhere_makes_it_nan():
    for n in (1, 15, 16, 17, 63, 64, 65, 129):
        for j in range(n):
            flat = np.full(n, -np.inf, np.float32)
            flat[j] = np.nan
            assert np.isnan(row_max(flat, 0, n)), (n, j)
