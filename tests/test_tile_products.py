"""Prefill's tile products (``numkv._kernels.gemm``): register blocks in
LLVM IR, against NumPy, on shapes that leave partial blocks of rows and
columns, rows read in place with gaps between them, and the causal trim
(blocks past every key their rows attend are skipped).

The register block depends on the CPU (AVX-512's or AVX2's,
``cpu.has_avx512``); both are compiled here, each in a fresh dispatcher
under ``cpu.forcing``, and AVX-512's runs where the CPU has it.
"""

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numkv._kernels import cpu
from numkv._kernels.gemm import CACHE_LINE, _gemm_accumulate, _gemm_scores, _kt_stride, _transpose


def _scores(q, kf, ko, kld, s, rows, n, d_k, kt, hi, nq, j0):
    _gemm_scores(q, kf, ko, kld, s, rows, n, d_k, kt, hi, nq, j0)


def _accumulate(p, vf, vo, vld, acc, rows, n, d_v, hi, nq, j0):
    _gemm_accumulate(p, vf, vo, vld, acc, rows, n, d_v, hi, nq, j0)


def _transposed(src, at, ld, n, width, dst, ldt):
    _transpose(src, at, ld, n, width, dst, ldt)


BLOCKS = {"avx512": True, "avx2": False}
_compiled = {}


def compiled(name, avx512):
    """A fresh dispatcher of the wrapper ``name`` compiled with the register
    block of ``avx512`` (skipped where the CPU cannot run it)."""
    if avx512 and not cpu.has_avx512():
        pytest.skip("this CPU lacks AVX-512: its register block cannot run here")
    key = name, avx512
    if key not in _compiled:
        function = {"scores": _scores, "accumulate": _accumulate, "transpose": _transposed}[name]
        dispatcher = numba.njit(function)
        with cpu.forcing(avx512=avx512):
            for dtype in (np.float32, np.float64):  # compile both here, under the forced choice
                f, i = numba.from_dtype(dtype)[::1], numba.int64
                if name == "scores":
                    dispatcher.compile((f, f, i, i, f, i, i, i, f, i[::1], i, i))
                elif name == "accumulate":
                    dispatcher.compile((f, f, i, i, f, i, i, i, i[::1], i, i))
                else:
                    dispatcher.compile((f, i, i, i, i, f, i))
        dispatcher.disable_compile()
        _compiled[key] = dispatcher
    return _compiled[key]


GUARD = -7.0  # what lies past the scratch: the products' vector stores are not bounds-checked


def transposed_keys(n, d, dtype):
    """The scratch ``_gemm_scores`` takes K transposed into, no larger than
    it asks, and what lies past its end (``GUARD``: 64 elements)."""
    size = d * (n + 2 * CACHE_LINE // np.dtype(dtype).itemsize)
    whole = np.full(size + 64, GUARD, dtype)
    whole[:size] = np.nan
    return whole[:size], whole[size:]


def rows_view(flat, at, ld, n, width):
    return np.lib.stride_tricks.as_strided(flat[at:], (n, width), (ld * flat.itemsize, flat.itemsize))


def case(rng, dtype, rows, n, d, gap, nq, j0, causal):
    """Operands: ``rows`` query rows (``nq`` queries, G = rows / nq heads),
    ``n`` key rows of ``d`` lying ``d + gap`` apart from an offset, and each
    query's last key (``hi``: the causal diagonal from key ``j0``, or past
    the tile)."""
    q = rng.standard_normal(rows * d).astype(dtype)
    ld, at = d + gap, 3
    kf = rng.standard_normal(at + n * ld + gap).astype(dtype)
    if causal:
        hi = j0 + np.arange(nq, dtype=np.int64) - rng.integers(0, 3)
    else:
        hi = np.full(nq, j0 + n + 5, np.int64)
    return q, kf, at, ld, hi


def limits(hi, rows, nq, j0, n):
    """Keys each row attends within the tile."""
    return np.clip(hi[np.arange(rows) % nq] - j0 + 1, 0, n)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, n, d, gap, nq", [(512, 256, 128, 0, 128), (7, 5, 3, 2, 7), (13, 67, 65, 9, 13),
                                                 (24, 64, 64, 0, 6), (1, 1, 1, 0, 1), (40, 130, 17, 1, 10),
                                                 (9, 45, 40, 3, 9), (12, 512, 32, 0, 12), (12, 496, 16, 0, 12)])
@pytest.mark.parametrize("causal", [False, True], ids=["whole", "causal"])
def test_the_products_equal_numpy(block, dtype, rows, n, d, gap, nq, causal):
    rng = np.random.default_rng(rows * n + d)
    j0 = 100
    q, kf, at, ld, hi = case(rng, dtype, rows, n, d, gap, nq, j0, causal)
    keys = rows_view(kf, at, ld, n, d).astype(np.float64)
    want = q.reshape(rows, d).astype(np.float64) @ keys.T
    tol = 1e-5 if dtype == np.float32 else 1e-13
    scale = np.abs(q.reshape(rows, d)) @ np.abs(keys).T  # the error bound's scale: sum of |products|

    s = np.full(rows * n, np.nan, dtype)
    kt, past = transposed_keys(n, d, dtype)
    compiled("scores", BLOCKS[block])(q, kf, at, ld, s, rows, n, d, kt, hi, nq, j0)
    assert np.all(past == GUARD)
    s = s.reshape(rows, n)
    attended = np.arange(n)[None, :] < limits(hi, rows, nq, j0, n)[:, None]
    assert np.all(np.abs(s - want)[attended] <= tol * scale[attended])

    # acc += p V, p zero past each row's last key (as the softmax leaves it) and NaN in no-man's land.
    p = rng.random((rows, n)).astype(dtype)
    p[~attended] = 0.0
    acc0 = rng.standard_normal((rows, d)).astype(dtype)
    acc = acc0.ravel().copy()
    compiled("accumulate", BLOCKS[block])(p.ravel(), kf, at, ld, acc, rows, n, d, hi, nq, j0)
    want = acc0.astype(np.float64) + p.astype(np.float64) @ keys
    bound = np.abs(acc0) + p @ np.abs(keys)
    assert np.all(np.abs(acc.reshape(rows, d) - want) <= tol * bound)


@pytest.mark.parametrize("block", BLOCKS)
def test_a_result_does_not_depend_on_its_block(block):
    """Each entry is one chain of FMAs in order: the product of all rows and
    columns at once equals, bit for bit, row by row and column by column."""
    rng = np.random.default_rng(7)
    rows, n, d = 19, 70, 33
    q, kf, at, ld, hi = case(rng, np.float32, rows, n, d, 4, rows, 0, False)
    scores = compiled("scores", BLOCKS[block])
    whole = np.empty(rows * n, np.float32)
    kt, _ = transposed_keys(n, d, np.float32)
    scores(q, kf, at, ld, whole, rows, n, d, kt, hi, rows, 0)
    for r in (0, 6, 18):
        for j in (0, 17, 69):
            one = np.empty(1, np.float32)
            scores(q[r * d:(r + 1) * d], kf, at + j * ld, ld, one, 1, 1, d, kt, hi[r:r + 1], 1, 0)
            assert one[0] == whole[r * n + j]


@pytest.mark.parametrize("block", BLOCKS)
@given(n=st.integers(1, 70), width=st.integers(1, 70), gap=st.integers(0, 20), at=st.integers(0, 5),
       pad=st.integers(0, 17), dtype=st.sampled_from([np.float32, np.float64]))
@settings(max_examples=60, deadline=None)
def test_transpose(block, n, width, gap, at, pad, dtype):
    """``width`` rows of ``n``, ``n + pad`` apart: the gaps left as they were."""
    src = np.arange(at + n * (width + gap), dtype=dtype)
    dst = np.full(width * (n + pad), -1, dtype)
    compiled("transpose", BLOCKS[block])(src, at, width + gap, n, width, dst, n + pad)
    rows = dst.reshape(width, n + pad)
    assert np.array_equal(rows[:, :n], rows_view(src, at, width + gap, n, width).T)
    assert np.all(rows[:, n:] == -1)


def test_k_transposed_rows_lie_an_odd_number_of_cache_lines_apart():
    """Rows a power of two of bytes apart put a block's vectors in few of
    the L1's sets (512 float32 keys: 2 KiB); an odd number of lines apart
    they fall in every set in turn.  The stride holds a row, and at most two
    lines more (the scratch the kernel allocates)."""
    for itemsize in (4, 8):
        line = CACHE_LINE // itemsize
        for n in range(1, 1100):
            ldt = _kt_stride(n, itemsize)
            assert n <= ldt < n + 2 * line and ldt % line == 0 and ldt // line % 2 == 1, (itemsize, n, ldt)


def test_a_token_major_v_is_copied_into_the_products_tiles_with_the_same_bits():
    """The matrix products read V's rows in place only where they lie one
    after another (``loop_functions.read_in_place``); a token-major V's
    (3-D inputs, packed sequences: rows ``Hkv * D`` apart) are copied into
    the tile first, K's are read in place by the transposition, decode's
    loops read both in place.  Y's bits are the head-major V's, a masked
    key's non-finite V included (the tile then goes to the loops)."""
    import numkv
    from numkv._kernels.layout import F32
    from numkv._kernels.loop_functions import read_in_place

    assert read_in_place(0, F32, 1, 128, 128, gemm=True, values=True)
    assert not read_in_place(0, F32, 1, 8 * 128, 128, gemm=True, values=True)
    assert read_in_place(0, F32, 1, 8 * 128, 128, gemm=True)
    assert read_in_place(0, F32, 1, 8 * 128, 128, gemm=False, values=True)

    rng = np.random.default_rng(11)
    hq, hkv, s, d = 8, 2, 70, 24  # 4 query heads a kv head: 16 or more rows a tile take the products
    q, k, v = (rng.standard_normal((2, h, s, d)).astype(np.float32) for h in (hq, hkv, hkv))
    v[1, 0, 50] = np.inf  # past the causal edge of queries < 50
    token_major = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(2, s, -1) for x in (q, k, v)]
    for causal in (False, True):
        want = numkv.attention(q, k, v, is_causal=causal)
        got = numkv.attention(*token_major, q_num_heads=hq, kv_num_heads=hkv, is_causal=causal)
        np.testing.assert_array_equal(got, want.transpose(0, 2, 1, 3).reshape(2, s, -1))
    assert not np.isfinite(want[1, :2, 50:]).any() and np.isfinite(want[1, :2, :50]).all()
