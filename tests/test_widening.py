"""The attention kernel's widening of narrow floats, for every bit pattern.

The kernel widens float16, bfloat16 and the float8s with bit arithmetic (and
F16C's conversion where the CPU has it; float8_e4m3fn in decode's passes of
four query rows by a byte table, where the CPU has AVX-512 VBMI); the
decode tables built from
ml_dtypes itself (``_dtypes.decode_table``) are the exact reference.  Every
pattern must give the same float32 bits (any NaN for a NaN).
"""

import ml_dtypes
import numpy as np
import pytest

import numkv
from numkv import _attention
from numkv._dtypes import decode_table, e8m0_table, kernel_dtype_codes
from numkv._kernels import attention as kernels
from numkv._kernels import widen
from numkv._kernels.cpu import has_vbmi

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
    widen._widen_rows(out, np.int64(0), np.int64(1), np.int64(n), spread.view(np.uint8), codes[dtype],
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


@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_the_arithmetic_decode_matches_the_tables(name):
    """``_decode_bits`` with each row of ``FORMAT_TABLE``: the fnuz float8s'
    loop (the other formats have loops of their own, and no row)."""
    from numba import njit

    dtype = np.dtype(getattr(ml_dtypes, name, name))
    code = kernel_dtype_codes(kernels.DTYPE_CODES)[dtype]
    sign = np.uint32(0x8000 if dtype.itemsize == 2 else 0x80)

    @njit
    def decode_all(patterns, formats, out):
        shift, scale, infnan, nan_em, nan_x = widen._format(formats, code)
        for i in range(patterns.size):
            out[i] = widen._decode_bits(patterns[i], sign, shift, scale, infnan, nan_em, nan_x)

    patterns = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint32)
    out = np.empty(patterns.size, np.float32)
    decode_all(patterns, kernels.FORMAT_TABLE, out)
    assert_same_floats(out, decode_table(dtype))


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("length", [64, 16, 3], ids=["blocks", "vectors", "tail"])
def test_decode_loops_widen_every_pattern_exactly(name, length):
    """Decode reads these caches in place, widening each element as it is
    used: ``_axpy`` (the value update) and ``_dots`` (the scores), both in
    vector lanes over whole vectors (float8_e4m3fn in blocks of 64 before,
    in passes of four rows, where the CPU has byte permutes), then element
    by element.  Each loop runs as one row and as four rows, with four
    keys.  The value update adds each pattern with weight 1 to zeros (four
    keys: the pattern's row, then three rows of zeros); for the scores key
    ``j`` holds pattern ``j`` first and zeros after, and every query row is
    ``(1, 0, ...)``: either way each result is the pattern's value (plus
    zeros: -0.0 becomes 0.0)."""
    from numba import njit

    dtype = np.dtype(getattr(ml_dtypes, name, name))
    code = kernel_dtype_codes(kernels.DTYPE_CODES)[dtype]
    patterns = np.arange(1 << (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}")

    @njit
    def widen_all(v_rows, keys, q, code, values, scores, ones, q_rows):
        width = np.uint64(q.size)
        whole = values.shape[1] // 4
        zero = np.uint64(0)
        for j in range(0, whole, q.size):  # four rows of V from element 4 j: the patterns, then zeros
            at, stride = np.uint64(j), np.uint64(whole)
            kernels._axpy(values[0], (at,), ones, (zero,), v_rows, 4 * at, width, zero, 4, q.size, code)
            kernels._axpy(values[1], (at, at + stride, at + stride + stride, at + stride + stride + stride), ones,
                          (zero, zero, zero, zero), v_rows, 4 * at, width, zero, 4, q.size, code)
        n = np.uint64(scores.shape[1] // 4)  # scores[1]: four rows of n
        for j in range(0, scores.shape[1] // 4, 4):
            k_at = (np.uint64(j) * width, np.uint64(j + 1) * width, np.uint64(j + 2) * width,
                    np.uint64(j + 3) * width)
            at = np.uint64(j)
            kernels._dots(scores[0], (at,), 4, q, (np.uint64(0),), keys, k_at, q.size, code)
            kernels._dots(scores[1], (at, at + n, at + n + n, at + n + n + n), 4, q, q_rows, keys, k_at, q.size,
                          code)

    keys = np.zeros((patterns.size, length), patterns.dtype)
    keys[:, 0] = patterns
    q = np.zeros(length, np.float32)
    q[0] = 1.0
    whole = patterns.size - patterns.size % length  # values: in rows of ``length``
    values = np.zeros((2, 4 * whole), np.float32)  # one row; four rows
    scores = np.full((2, 4 * patterns.size), -1.0, np.float32)  # one row; four rows
    v_rows = np.zeros((whole // length, 4, length), patterns.dtype)  # each row of patterns, three of zeros
    v_rows[:, 0] = patterns[:whole].reshape(-1, length)
    widen_all(v_rows.reshape(-1).view(np.uint8), keys.reshape(-1).view(np.uint8), q, code, values, scores,
              np.ones(4, np.float32), (np.uint64(0),) * 4)
    if name == "float8_e4m3fn" and length == 64 and has_vbmi():  # the blocks' byte table is in the loops
        assert "vpermi2var" in widen_all.inspect_llvm(widen_all.signatures[0])
    with np.errstate(invalid="ignore"):  # signalling NaNs
        want = decode_table(dtype) + np.float32(0.0)
    assert_same_floats(values[0, :whole], want[:whole])
    for r in range(4):
        assert_same_floats(values[1, r * whole:(r + 1) * whole], want[:whole])
    assert_same_floats(scores[0, :patterns.size], want)
    for r in range(4):
        assert_same_floats(scores[1, r * patterns.size:(r + 1) * patterns.size], want)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                                  "float8_e5m2fnuz"])
def test_decode_on_a_narrow_cache_equals_its_float32_copy(name, rng):
    """Decode reads a narrow cache in place (the fnuz float8s through float32
    tiles); its output must be bit-identical to the same cache widened to
    float32 first, which decode reads in place."""
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    q = rng.standard_normal((2, 8, 1, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 300, 64)).astype(dtype)
    v = (4 * rng.standard_normal((2, 2, 300, 64))).astype(dtype)
    mask = np.ones((2, 1, 1, 300), bool)
    mask[0, ..., 100:140] = mask[1, ..., ::7] = False  # masked keys inside tiles
    for kwargs in ({}, {"is_causal": True}, {"nonpad_kv_seqlen": np.array([300, 77])}, {"attn_mask": mask}):
        got = numkv.attention(q, k, v, **kwargs)
        want = numkv.attention(q, k.astype(np.float32), v.astype(np.float32), **kwargs)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_a_narrow_cache_read_in_place_equals_its_tiles(name, rng):
    """Decode reads unit-stride narrow rows in place; rows whose elements lie
    apart are widened into float32 tiles first.  The bits must not differ."""
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    q = rng.standard_normal((1, 8, 1, 80)).astype(np.float32)  # 80: a block of 64, a vector of 16
    k, v = (rng.standard_normal((1, 2, 300, 80)).astype(dtype) for _ in range(2))
    mask = np.ones((1, 1, 1, 300), bool)
    mask[..., 100:140] = False
    k_apart, v_apart = (np.repeat(x, 2, axis=-1)[..., ::2] for x in (k, v))  # d stride 2
    for kwargs in ({}, {"attn_mask": mask}):
        np.testing.assert_array_equal(numkv.attention(q, k_apart, v_apart, **kwargs),
                                      numkv.attention(q, k, v, **kwargs))


# -- and back: a float16 Y -----------------------------------------------------------


def test_float16_y_narrowing_equals_numpys_cast():
    # Every float16 result: all float32 patterns whose top 19 bits vary, with
    # low bits at the rounding boundaries (ties, just below, just above), and
    # the quiet NaNs (a signalling NaN never comes out of the kernel).
    top = np.arange(1 << 19, dtype=np.uint32) << 13
    x = np.concatenate([top | low for low in (0, 0xFFF, 0x1000, 0x1001, 0x1FFF)]).view(np.float32)
    x = x[~np.isnan(x) | ((x.view(np.uint32) & 0x00400000) != 0)]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    got = _attention._to_float16(x)
    assert got.dtype == np.float16 and got.shape == x.shape
    bad = np.flatnonzero(got.view(np.uint16) != want.view(np.uint16))
    assert bad.size == 0, f"{bad.size} differ, e.g. float32 bits {x[bad[:4]].view(np.uint32)}"


def test_float16_prefill_takes_the_narrowing_kernel(monkeypatch):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 160, 128)).astype(np.float16)
    k = rng.standard_normal((1, 2, 160, 128)).astype(np.float16)
    v = rng.standard_normal((1, 2, 160, 128)).astype(np.float16)
    assert q.size >= _attention.NARROW_MIN
    narrowed = numkv.attention(q, k, v, is_causal=True)
    monkeypatch.setattr(_attention, "NARROW_MIN", q.size + 1)
    assert np.array_equal(numkv.attention(q, k, v, is_causal=True).view(np.uint16), narrowed.view(np.uint16))
