"""``numkv.quantize`` and ``numkv.QuantizedArray``: the half-step bound, the
byte layouts (llama.cpp's q8_0 / q4_0 blocks, onnxruntime's int8 / int4
cache), storage, slicing views, bad input, and onnxruntime's
``GroupQueryAttention`` reading the codes numkv writes (and writing the codes
numkv writes).

The bound is checked in float64, where it is exact: a code (at most 8 bits)
times a float16 scale (11 bits) and a float32 value's difference from it are
exact in float64, so ``|x - code * d| <= d / 2`` holds or fails with no
rounding in the check.
"""

import re
import zlib

import ml_dtypes
import numpy as np
import pytest

from numkv import _config
from numkv._formats import BLOCK_FORMATS, FORMATS as FORMAT_RECORDS
from numkv._quantize import BLOCK, QuantizedArray, quantize

FORMATS = list(FORMAT_RECORDS)
BLOCK_FORMATS = list(BLOCK_FORMATS)
QMAX = {"q8_0": 127, "q4_0": 7}


def _blocky(rng, shape):
    """Values whose blocks of 32 span many magnitudes: huge, tiny (float16's
    subnormal scales), exact zeros, a lone extreme, ties at half steps."""
    x = rng.standard_normal(shape).astype(np.float32)
    blocks = x.reshape(-1, BLOCK)
    magnitudes = 10.0 ** rng.uniform(-9, 4, len(blocks))  # float16 scales hold all of them
    blocks *= magnitudes[:, None].astype(np.float32)
    blocks[::7] = 0.0                                  # a block of zeros: d = 0
    blocks[1::7, 3] = -blocks[1::7].__abs__().max(1) * 4  # one negative extreme
    blocks[2::7] = np.float32(np.arange(-16, 16)) * 0.25  # exact ties at x.5 steps
    blocks[3::7] = rng.integers(-127, 128, (len(blocks[3::7]), BLOCK)).astype(np.float32)
    return blocks.reshape(shape)


def _block_scales(q):
    return q.scales.astype(np.float64)[..., None]


def _one_step_down(h):
    """The float16 magnitudes one step below ``|h|`` (0 stays 0)."""
    h = np.abs(h).astype(np.float16)
    return np.where(h > 0, np.nextafter(h, np.float16(0)), h).astype(np.float64)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_block_formats_are_within_half_a_step(fmt, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{dtype}".encode()))
    x = _blocky(rng, (3, 4, 50, 128))
    f = FORMAT_RECORDS[fmt]
    if dtype == "float16" or f.minimum:  # (a minimum is a float16 itself)
        x = np.clip(x, -60000, 60000)
    x = x.astype(getattr(ml_dtypes, dtype, dtype))
    q = quantize(x, fmt)
    wide = x.astype(np.float64).reshape(q.scales.shape + (BLOCK,))
    d = _block_scales(q)
    step = np.abs(d)
    deq = q.dequantize(np.float64).reshape(wide.shape)
    err = np.abs(wide - deq)
    assert (err <= step / 2).all(), float((err - step / 2).max())
    amax = np.abs(wide).max(-1, keepdims=True)
    lo, hi = f.code_range
    if f.quantiser == "symmetric":
        # the scale is amax / qmax to within one float16 step, never below what amax needs
        qmax = QMAX[fmt]
        assert (d >= 0).all() and ((qmax + 0.5) * d >= amax).all()
        # (a rounding and a bump: under 1.5 float16 steps, relative 2**-10 each; 2**-24 absolute among subnormals)
        assert (d <= amax / qmax * (1 + 2.0 ** -9) + 2.0 ** -24).all()
        assert ((d == 0) == (amax == 0)).all()
    elif f.quantiser == "signed":
        # the largest magnitude takes the lo end: d's sign is the other one (llama.cpp's q4_0)
        extreme = np.take_along_axis(wide, np.argmax(np.abs(wide), -1)[..., None], -1)
        assert (d * extreme <= 0).all() and ((d == 0) == (amax == 0)).all()
        opposite = np.where(wide * extreme < 0, np.abs(wide), 0).max(-1, keepdims=True)
        assert ((-lo + 0.5) * step >= amax).all() and ((hi + 0.5) * step >= opposite).all()
        # llama.cpp's step (amax / 8 in float16: the extreme exactly at -8) where the opposite
        # extreme stays within half a step of 7; else the finest float16 that keeps it there
        llama = (amax / -lo).astype(np.float16).astype(np.float64)
        keeps = ((amax / -lo >= opposite / (hi + 0.5)) & (llama * (hi + 0.5) >= opposite)
                 & (llama * (-lo + 0.5) >= amax))  # (among float16's subnormals amax / 8 may round too far down)
        assert (step == llama)[keeps].all()
        down = _one_step_down(d)  # elsewhere the finest: a step less breaks a bound
        assert (((hi + 0.5) * down < opposite) | ((-lo + 0.5) * down < amax))[~keeps].all()
        assert (~keeps).any() and keeps.any()
    else:  # affine: the minimum rounded down, the step the spread over the codes (as symmetric's)
        m = q.minima.astype(np.float64)[..., None]
        low, high = wide.min(-1, keepdims=True), wide.max(-1, keepdims=True)
        assert (m <= low).all() and (d >= 0).all()
        up = np.nextafter(q.minima, np.float16(np.inf)).astype(np.float64)[..., None]
        assert (up > low).all()
        assert ((hi + 0.5) * d >= high - m).all()
        assert (d <= (high - m) / hi * (1 + 2.0 ** -9) + 2.0 ** -24).all()
        assert ((d == 0) == (high == m)).all()
    if not f.minimum:
        # dequantising in float32 is exact (code: <= 8 bits, scale: float16)
        assert np.array_equal(q.dequantize().astype(np.float64), q.dequantize(np.float64))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_the_bound_can_fail(fmt):
    """The half-step check sees an off-by-one code: llama.cpp's q4_0 scale
    (``max / -8``, signed extreme) puts the opposite extreme a step away."""
    x = np.zeros((1, BLOCK), np.float32)
    x[0, 0], x[0, 1] = 1.0, -1.0
    q = quantize(x, fmt)
    d = _block_scales(q)[0, 0]
    llama_d = 1.0 / -8
    llama_codes = np.clip(np.rint(x / llama_d), -8, 7)
    assert np.abs(x - llama_codes * llama_d).max() > abs(llama_d) / 2
    assert np.abs(x - q.dequantize(np.float64)).max() <= abs(d) / 2


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_given_scales_are_within_half_a_step_and_saturate_beyond(fmt, per_channel):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{per_channel}".encode()))
    x = rng.standard_normal((2, 3, 40, 16)).astype(np.float32)
    lo, hi = (-128, 127) if fmt == "int8" else (-8, 7)
    scale = (rng.uniform(0.5, 2, (1, 3, 1, 16)) if per_channel else np.float64(1.3)).astype(np.float32)
    scale64 = scale.astype(np.float64)
    x = (x * hi / 3 * scale).astype(np.float32)
    head0 = scale64[0, 0, 0] if per_channel else scale64
    x[0, 0, 0] = (hi + 0.5) * head0  # a tie at the top: rounds to even, saturates to hi
    x[0, 0, 1] = 1000 * hi * head0   # far beyond: saturates
    q = quantize(x, fmt, scale=scale)
    deq = _exact_dequantize(q)
    inside = (x >= (lo - 0.5) * scale64) & (x <= (hi + 0.5) * scale64)
    err = np.abs(x - deq)
    assert (err[inside] <= np.broadcast_to(scale64 / 2, x.shape)[inside]).all()
    assert not inside.all()
    assert np.array_equal(deq[~inside], np.broadcast_to(np.where(x > 0, hi, lo) * scale64, x.shape)[~inside])


def _exact_dequantize(q):
    """int8 / int4 codes times the float32 scale, in float64 (exact)."""
    if q.format == "int8":
        codes = q.codes.astype(np.float64)
    else:
        codes = np.stack([q.codes & 15, q.codes >> 4], -1).reshape(q.shape).astype(np.float64) - 8
    return codes * q.scales.astype(np.float64)


def test_ties_round_to_even_as_onnxruntime_does():
    x = np.array([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5]], np.float32)
    assert _exact_dequantize(quantize(x, "int8", scale=1.0)).tolist() == [[0, 2, 2, 0, -2, -2, 4, -4]]
    assert _exact_dequantize(quantize(x, "int4", scale=1.0)).tolist() == [[0, 2, 2, 0, -2, -2, 4, -4]]


# -- layouts and storage ------------------------------------------------------


def test_q8_0_is_llama_cpp_block_q8_0():
    """Per block: the float16 scale's two bytes (little-endian), then the 32
    int8 codes; 34 bytes per 32 elements."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 96)).astype(np.float32)
    q = quantize(x, "q8_0")
    blocks = x.reshape(2, 3, 32).astype(np.float64)
    d = q.scales
    assert d.dtype == np.float16 and d.shape == (2, 3)
    codes = np.clip(np.rint(blocks / d.astype(np.float64)[..., None]), -127, 127).astype(np.int8)
    want = np.concatenate([d[..., None].view(np.uint8), codes.view(np.uint8)], -1).reshape(2, 3 * 34)
    assert q.storage.dtype == np.uint8 and np.array_equal(q.storage, want)
    assert np.array_equal(q.codes, codes)
    assert q.nbytes == x.size * 34 // 32


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "float8_e4m3fn"])
def test_the_kernels_blocks_equal_the_numpy_path_bit_for_bit(fmt, dtype, monkeypatch):
    """``_kernels.quantize`` against the plain NumPy path
    (``_quantize._numpy_blocks``, what numkv ran before the kernel):
    scales from float16's subnormals to its largest, blocks of zeros, ties
    at half steps, scales that rounding took below ``amax / (qmax + 1/2)``."""
    rng = np.random.default_rng(3)
    x = _blocky(rng, (64, 8, 3 * BLOCK))
    x.reshape(-1, BLOCK)[5::11] *= np.float32(60000.0 / 10 ** 4)  # scales near float16's largest
    if FORMAT_RECORDS[fmt].minimum:  # minima near float16's largest (a minimum is a float16)
        x = np.clip(x, -65280, 65280)  # (65280: a bfloat16 too)
    x = x.astype(getattr(ml_dtypes, dtype, dtype))
    with np.errstate(over="ignore", invalid="ignore"):
        finite = np.isfinite(x.astype(np.float64)).all(axis=-1)
    x = x[finite]
    kernel = quantize(x, fmt).storage
    monkeypatch.setattr(_config, "REFERENCE", True)
    assert np.array_equal(kernel, quantize(x, fmt).storage)


# The largest magnitude of a block of ones and one negative extreme that
# each quantiser takes: symmetric, from ``amax = 65520 * qmax`` on ``amax /
# qmax`` rounds to float16's inf (65520: float16's largest, 65504, plus half
# its last step), one float64 step below the scale is 65504, which holds the
# block within half a step (``65504 * (qmax + 1/2)`` is more); signed, the
# same with ``amax / 8``;
# affine, the minimum is a float16 itself.
_LARGEST = {"symmetric": lambda f: np.nextafter(65520.0 * f.qmax, 0),
            "signed": lambda f: np.nextafter(65520.0 * -f.code_range[0], 0),
            "affine": lambda f: 65504.0}


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "numpy"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_a_block_beyond_a_float16_scale_is_refused_naming_it(fmt, reference, monkeypatch):
    monkeypatch.setattr(_config, "REFERENCE", reference)
    f = FORMAT_RECORDS[fmt]
    largest = _LARGEST[f.quantiser](f)
    x = np.ones((2, 3, 64))
    x[1, 2, 40] = -largest
    q = quantize(x, fmt)
    assert abs(q.scales[1, 2, 1]) == np.float16(65504) or q.minima[1, 2, 1] == np.float16(-65504)
    assert np.abs(q.dequantize(np.float64) - x).max() <= abs(float(q.scales[1, 2, 1])) / 2
    words = f"beyond what a float16 scale{' or minimum' if f.minimum else ''} holds"
    for big in (np.nextafter(largest, np.inf), 2 * largest, 1e300):
        x[1, 2, 40] = -big
        with pytest.raises(ValueError, match=re.escape(f"x has a block of {fmt} at (1, 2, 1) with largest magnitude "
                                                       f"{float(big)!r}, {words}")):
            quantize(x, fmt)
    x[0, 1, 7] = np.nan  # a value that is not finite is named first, wherever it is
    with pytest.raises(ValueError, match=r"x holds nan \(at \(0, 1, 7\)\)"):
        quantize(x, fmt)


def test_a_scale_rounds_once_from_float64_to_float16():
    """The kernel's float16 rounding (``_float16_bits``) against NumPy's, on
    every positive float16, the ties between neighbours and one float64 step
    either side of them, the edges of the range and float64's subnormals."""
    import numba

    from numkv._kernels.quantize import _float16_bits

    @numba.njit
    def bits_of(xs, out):
        for i in range(xs.size):
            out[i] = _float16_bits(xs[i])

    halves = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = (halves[:-1] + halves[1:]) / 2  # exact in float64
    xs = np.concatenate([halves, ties, np.nextafter(ties, 0), np.nextafter(ties, np.inf),
                         [65504.0, 65519.99, 65520.0, 65536.0, 1e300, 2.0 ** -25, 2.0 ** -25 * 1.0000001,
                          5e-324, 2.2e-308, 1e-310]])
    got = np.empty(xs.size, np.int64)
    bits_of(xs, got)
    with np.errstate(over="ignore"):
        want = xs.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want)


def test_q4_0_is_llama_cpp_block_q4_0():
    """Per block: the float16 scale, then 16 bytes; byte j holds element j in
    its low nibble and element j + 16 in its high nibble, each as code + 8."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    q = quantize(x, "q4_0")
    d = q.scales.astype(np.float64)[..., None]
    codes = np.clip(np.rint(x.reshape(3, 2, 32) / d), -8, 7).astype(np.int64) + 8
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    want = np.concatenate([q.scales[..., None].view(np.uint8), packed], -1).reshape(3, 2 * 18)
    assert np.array_equal(q.storage, want)
    assert np.array_equal(q.codes, packed)
    assert q.nbytes == x.size * 18 // 32


def test_int4_packs_the_even_element_low_and_int8_is_plain():
    x = np.array([[[[1.0, -2.0, 7.0, -8.0, 0.0, 3.0]]]], np.float32)
    q = quantize(x, "int4", scale=1.0)
    assert q.codes.dtype == np.uint8 and q.codes.shape == (1, 1, 1, 3)
    assert q.codes[0, 0, 0].tolist() == [(1 + 8) | ((-2 + 8) << 4), (7 + 8) | ((-8 + 8) << 4), 8 | (11 << 4)]
    assert q.nbytes == 3 + 4  # codes + one float32 scale
    q8 = quantize(x, "int8", scale=np.full((1, 1, 1, 6), 0.5, np.float32))
    assert q8.codes.dtype == np.int8 and q8.codes[0, 0, 0].tolist() == [2, -4, 14, -16, 0, 6]
    assert q8.nbytes == 6 + 6 * 4 and q8.per_channel and q8.scales.shape == (1, 1, 1, 6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_storage_per_element(fmt):
    x = np.ones((1, 8, 4096, 128), np.float32)
    q = quantize(x, fmt, scale=None if fmt in BLOCK_FORMATS else np.ones((1, 8, 1, 128), np.float32))
    per_element = q.nbytes / x.size
    limit = {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "int8": 1 + 1e-3, "int4": 0.5 + 1e-3}[fmt]
    assert per_element <= limit, per_element


# -- slicing -----------------------------------------------------------------


def _example(fmt, rng, shape=(2, 3, 9, 64)):
    x = rng.standard_normal(shape).astype(np.float32)
    scale = None
    if fmt == "int8":
        scale = rng.uniform(0.01, 0.03, (1, shape[1], 1, shape[3])).astype(np.float32)
    elif fmt == "int4":
        scale = np.float32(0.4)
    return x, quantize(x, fmt, scale=scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("key", [
    (slice(None), slice(None), slice(2, 7)), (1,), (slice(None), 2), (0, slice(1, 3), slice(None, None, -2)),
    (1, 2, 4), (slice(None), slice(None), slice(3, 3)), (1, 0, slice(None), slice(None)),
], ids=["seq-range", "batch-int", "head-int", "reversed-seq", "one-row", "empty", "full-last"])
def test_slices_are_views_and_dequantize_alike(fmt, key, rng):
    _, q = _example(fmt, rng)
    whole = q.dequantize()
    part = q[key]
    assert isinstance(part, QuantizedArray) and part.format == fmt
    want = whole[key]
    assert part.shape == want.shape
    assert np.array_equal(part.dequantize(), want)
    if part.storage.size:
        assert np.shares_memory(part.storage, q.storage)
        assert np.shares_memory(part.codes, q.storage)
    if fmt in BLOCK_FORMATS:
        assert np.array_equal(part.scales, q.scales[key])
        assert part.nbytes == want.size // BLOCK * {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]
        if FORMAT_RECORDS[fmt].minimum:
            assert np.array_equal(part.minima, q.minima[key])


@pytest.mark.parametrize("key, error", [
    ((0, 0, 0, 1), IndexError), ((0, 0, 0, slice(0, 32)), IndexError), ((0, 0, 0, 0, 0), IndexError),
    ((Ellipsis, 1), TypeError), ((None,), TypeError), ((np.array([0, 1]),), TypeError), ((True,), TypeError),
])
def test_slicing_the_head_axis_or_fancy_indexing_is_refused(key, error, rng):
    _, q = _example("q8_0", rng)
    with pytest.raises(error):
        q[key]


def test_from_parts_round_trips(rng):
    for fmt in FORMATS:
        _, q = _example(fmt, rng)
        back = QuantizedArray.from_parts(fmt, q.codes, q.scales, q.minima)
        assert back.shape == q.shape and np.array_equal(back.dequantize(), q.dequantize())
        assert np.array_equal(back.storage, q.storage)


# -- bad input ---------------------------------------------------------------


@pytest.mark.parametrize("call, error, words", [
    (lambda x: quantize(x, "q5_0"), ValueError, "format"),
    (lambda x: quantize(x, 8), TypeError, "format"),
    (lambda x: quantize(x[..., :48], "q8_0"), ValueError, "head size"),
    (lambda x: quantize(x[..., :33], "int4", scale=1.0), ValueError, "head size"),
    (lambda x: quantize(x, "q4_0", scale=1.0), ValueError, "scale"),
    (lambda x: quantize(x, "int8"), ValueError, "scale"),
    (lambda x: quantize(x, "int8", scale=0.0), ValueError, "scale"),
    (lambda x: quantize(x, "int8", scale=-1.0), ValueError, "scale"),
    (lambda x: quantize(x, "int4", scale=np.nan), ValueError, "scale"),
    (lambda x: quantize(x, "int4", scale=np.inf), ValueError, "scale"),
    (lambda x: quantize(x, "int8", scale=np.ones((1, 3, 1, 64), np.float32)), ValueError, "scale"),
    (lambda x: quantize(x, "int8", scale=np.ones((2, 2, 1, 64), np.float32)), ValueError, "scale"),
    (lambda x: quantize(x, "int8", scale=np.ones((1, 2, 1, 64)) * [[[[0]], [[1]]]]), ValueError, "scale"),
    (lambda x: quantize(x, "int8", scale="1"), TypeError, "scale"),
    (lambda x: quantize(x[0], "int8", scale=np.ones(64, np.float32)), ValueError, "scale"),
    (lambda x: quantize(x.astype(np.int32), "q8_0"), TypeError, "x"),
    (lambda x: quantize(np.where(x > 2, np.nan, x), "q8_0"), ValueError, "x"),
    (lambda x: quantize(np.where(x > 2, -np.inf, x), "int8", scale=1.0), ValueError, "x"),
    (lambda x: quantize(x * 1e7, "q8_0"), ValueError, "float16"),
    (lambda x: quantize(x * 1e6, "q4_0"), ValueError, "float16"),
    (lambda x: quantize(np.float32(1.0), "q8_0"), ValueError, "x"),
    (lambda x: QuantizedArray.from_parts("q8_0", np.zeros((2, 32), np.int8), np.zeros(3, np.float16)),
     ValueError, "scales"),
    (lambda x: QuantizedArray.from_parts("q8_0", np.zeros((2, 32), np.int16), np.zeros(2, np.float16)),
     TypeError, "codes"),
    (lambda x: QuantizedArray.from_parts("q4_0", np.zeros((2, 16), np.uint8), np.zeros(2, np.float32)),
     TypeError, "scales"),
    (lambda x: QuantizedArray.from_parts("int8", np.zeros((1, 2, 3, 4), np.int8), np.ones((1, 3, 1, 4))),
     ValueError, "scales"),
    (lambda x: QuantizedArray.from_parts("int4", np.zeros((1, 2, 3, 4), np.uint8), np.float32(np.nan)),
     ValueError, "scales"),
    (lambda x: QuantizedArray.from_parts("q4_1", np.zeros((2, 16), np.uint8), np.zeros(2, np.float16)),
     ValueError, "minima"),
    (lambda x: QuantizedArray.from_parts("q8_0", np.zeros((2, 32), np.int8), np.zeros(2, np.float16),
                                         np.zeros(2, np.float16)), ValueError, "minima"),
    (lambda x: QuantizedArray.from_parts("q4_1", np.zeros((2, 16), np.uint8), np.zeros(2, np.float16),
                                         np.zeros(3, np.float16)), ValueError, "minima"),
    (lambda x: QuantizedArray.from_parts("q4_1", np.zeros((2, 16), np.uint8), np.zeros(2, np.float16),
                                         np.full(2, np.inf, np.float16)), ValueError, "minima"),
    (lambda x: QuantizedArray.from_parts("q8_0", np.zeros((2, 32), np.int8), -np.ones(2, np.float16)),
     ValueError, "scales"),
    (lambda x: quantize(x * 1e5, "q4_1"), ValueError, "float16"),
    (lambda x: quantize(x, "q8_0").dequantize(np.int8), TypeError, "dtype"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_is_refused_with_a_message_naming_it(call, error, words):
    x = np.random.default_rng(0).standard_normal((2, 2, 3, 64)).astype(np.float32)
    with pytest.raises(error, match=words):
        call(x)


def test_a_given_scale_is_copied_and_read_only():
    scale = np.full((1, 1, 1, 4), 0.5, np.float32)
    q = quantize(np.ones((1, 1, 2, 4), np.float32), "int8", scale=scale)
    scale[...] = 100.0
    assert (q.dequantize() == 1.0).all()
    with pytest.raises(ValueError):
        q.scales[...] = 2.0


@pytest.mark.parametrize("f16c", [True, False], ids=["f16c", "no-f16c"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tile_widening_gives_the_dequantised_values(fmt, f16c):
    """The tile loop (``widen._rows_quantized``) on rows of every format (a row of 32 blocks,
    every code and scales from subnormal to large; int8 / int4 rows of a
    width 32 does not divide take the element tail) into float32 and
    float64 tiles: exactly ``dequantize()`` (int8 / int4: the codes, whose
    scales fold elsewhere).  Compiled afresh with F16C forced on or off."""
    from numba import njit

    from numkv._dtypes import e8m0_table
    from numkv._kernels import cpu, layout, widen

    if f16c and not cpu.has_f16c():
        pytest.skip("this CPU has no F16C")
    rng = np.random.default_rng(4)
    width = 1024 if fmt in BLOCK_FORMATS else 1000
    x = (rng.standard_normal((3, width)) * 10.0 ** rng.uniform(-6, 3, (3, 1))).astype(np.float32)
    q = quantize(x, fmt, scale=None if fmt in BLOCK_FORMATS else np.float32(1.0) / 16)
    # (float32 values: a minimum's sum rounds once there; without one, exact)
    want = q.dequantize().astype(np.float64) if fmt in BLOCK_FORMATS else _exact_dequantize(q) * 16
    storage = np.ascontiguousarray(q.storage).view(np.uint8)
    row_bytes = storage.shape[-1]
    code = FORMAT_RECORDS[fmt].code

    @njit  # ``code`` a constant of it, as in loop_functions' functions
    def kernel(out, r0, n, width, buf, base, seq_stride, stride, table, formats):
        widen._rows_quantized(out, r0, n, width, buf, code, base, seq_stride, stride, table, formats)

    with cpu.forcing(f16c=f16c):
        for dtype in (np.float32, np.float64):
            out = np.full((4, width), -1.0, dtype)
            kernel(out, np.int64(1), np.int64(3), np.int64(width), storage.reshape(-1),
                   np.int64(0), np.int64(row_bytes), np.int64(1), e8m0_table(), layout.FORMAT_TABLE)
            assert (out[0] == -1).all()
            assert np.array_equal(out[1:], want), (dtype, np.abs(out[1:] - want).max())


@pytest.mark.parametrize("f16c", [True, False], ids=["f16c", "no-f16c"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_loops_read_quantized_rows_in_place(fmt, f16c):
    """Decode's loops (``decode_loops._axpy``, the value update, and
    ``_dots``, the scores) over quantised rows in place: a row added with
    weight 1 to zeros is its dequantised values exactly; a score is the dot
    product with them (to float32 rounding), for one and for four query
    rows.  Compiled afresh with F16C forced on or off."""
    from numba import njit

    from numkv._kernels import cpu, decode_loops, layout

    if f16c and not cpu.has_f16c():
        pytest.skip("this CPU has no F16C")
    d = 128 if fmt in BLOCK_FORMATS else 104  # int8 / int4: whole vectors, then a tail
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((8, d)) * 10.0 ** rng.uniform(-3, 2, (8, 1))).astype(np.float32)
    q = quantize(x, fmt, scale=None if fmt in BLOCK_FORMATS else np.float32(1.0) / 16)
    # (float32 values: a minimum's sum rounds once there; without one, exact)
    want = q.dequantize().astype(np.float64) if fmt in BLOCK_FORMATS else _exact_dequantize(q) * 16
    storage = np.ascontiguousarray(q.storage).view(np.uint8)
    ld = np.uint64(storage.shape[-1])
    code = FORMAT_RECORDS[fmt].code
    query = rng.standard_normal((4, d)).astype(np.float32)

    @njit  # ``code`` a constant of it, as in loop_functions' functions
    def run(rows, ld, q, values, scores, ones):
        zero = np.uint64(0)
        width = np.uint64(q.shape[1])
        n = values.shape[0]
        for j in range(n):  # one row a call, and the same row into four accumulators
            decode_loops._axpy(values[j, 0], (zero,), ones, (zero,), rows, np.uint64(j) * ld, ld, zero, 1,
                               q.shape[1], code)
            decode_loops._axpy(values[j, 1:].reshape(-1), (zero, width, width + width, width + width + width), ones,
                               (zero, zero, zero, zero), rows, np.uint64(j) * ld, ld, zero, 1, q.shape[1], code)
        qf = q.reshape(-1)
        for j in range(0, n, 4):
            k_at = (np.uint64(j) * ld, np.uint64(j + 1) * ld, np.uint64(j + 2) * ld, np.uint64(j + 3) * ld)
            s = np.uint64(j)
            decode_loops._dots(scores[0], (s,), 4, qf, (zero,), rows, k_at, q.shape[1], code, zero)
            decode_loops._dots(scores[1], (s, s + np.uint64(n), s + np.uint64(2 * n), s + np.uint64(3 * n)), 4, qf,
                               (zero, width, width + width, width + width + width), rows, k_at, q.shape[1], code, zero)

    values = np.zeros((8, 5, d), np.float32)
    scores = np.full((2, 4 * 8), np.nan, np.float32)
    with cpu.forcing(f16c=f16c):
        run(storage.reshape(-1), ld, query, values, scores, np.ones(4, np.float32))
    for r in range(5):
        assert np.array_equal(values[:, r], want), r
    dots = query.astype(np.float64) @ want.T  # (4 rows, 8 keys)
    np.testing.assert_allclose(scores[0, :8], dots[0], rtol=1e-5, atol=1e-5 * np.abs(dots).max())
    np.testing.assert_allclose(scores[1].reshape(4, 8), dots, rtol=1e-5, atol=1e-5 * np.abs(dots).max())


# -- numkv.attention reads QuantizedArray K / V in the kernel ---------------------------------
#
# The answer is numkv.attention over K.dequantize(), V.dequantize() (float32
# arrays: the kernel's float32 path).  q8_0 / q4_0 / int4-per-tensor widen to
# those very float32 values (a code times a float16 scale is exact), so Y
# comes out with the same bits; int8 / int4 with a per-channel scale fold it
# into Q and Y (``sum_d (q_d s_d) c_d`` for ``sum_d q_d (s_d c_d)``), which
# differs by float32 rounding: ``rtol = atol = 1e-5`` (measured <= 1e-6 on
# outputs of order 1) against ~1e-2 for a code one step off.

import numkv  # noqa: E402
from numkv import _attention, _config  # noqa: E402

ATTN_TOL = 1e-5
ATTENTION_CASES = {
    # name: (Hq, Hkv, Sq, Skv, past, D, kwargs)
    "decode-gqa": (8, 2, 1, 70, 0, 64, {}),
    "decode-gqa-past-causal": (8, 2, 1, 9, 61, 64, dict(is_causal=True)),
    "decode-mqa-softcap": (4, 1, 1, 70, 0, 32, dict(softcap=3.0)),
    "prefill-gqa-causal": (8, 2, 40, 40, 0, 64, dict(is_causal=True)),
    "prefill-past-causal-window": (4, 2, 20, 20, 30, 64, dict(is_causal=True, left_window_size=13)),
    "prefill-right-window-mask": (4, 2, 17, 33, 0, 96, dict(right_window_size=5, left_window_size=7)),
    "nonpad-decode-causal": (8, 2, 1, 50, 0, 64, dict(is_causal=True, nonpad=(50, 17))),
    "nonpad-prefill-causal": (8, 4, 12, 50, 0, 64, dict(is_causal=True, nonpad=(31, 12))),
    "float-mask": (8, 2, 3, 45, 0, 64, dict(mask=True)),
}


def _scale_for(fmt, x, per_channel=True):
    if fmt in BLOCK_FORMATS:
        return None
    qmax = 127 if fmt == "int8" else 7
    if per_channel:
        return (np.abs(x).max(axis=(0, 2), keepdims=True) / qmax).astype(np.float32)
    return np.float32(np.abs(x).max() / qmax)


def _attention_case(name, fmt, per_channel=True):
    hq, hkv, sq, skv, past, d, kwargs = ATTENTION_CASES[name]
    if fmt == "int8" and name == "prefill-right-window-mask":
        d = 40  # a head size 32 does not divide: int8 rows take the element-by-element tail
    rng = np.random.default_rng(zlib.crc32(f"{name}{fmt}{per_channel}".encode()))
    b = 2
    kwargs = dict(kwargs)
    q = rng.standard_normal((b, hq, sq, d)).astype(np.float32)
    k_all = (rng.standard_normal((b, hkv, past + skv, d)) * rng.uniform(0.3, 2, (1, hkv, 1, d))).astype(np.float32)
    v_all = rng.standard_normal((b, hkv, past + skv, d)).astype(np.float32)
    # a cache of capacity past + skv + 5: the arrays the call reads are slices of it
    cap = past + skv + 5
    k_buf = quantize(np.concatenate([k_all, np.zeros((b, hkv, 5, d), np.float32)], 2), fmt,
                     scale=_scale_for(fmt, k_all, per_channel))
    v_buf = quantize(np.concatenate([v_all, np.zeros((b, hkv, 5, d), np.float32)], 2), fmt,
                     scale=_scale_for(fmt, v_all, per_channel))
    assert k_buf.shape[2] == cap
    args = dict(K=k_buf[:, :, past:past + skv], V=v_buf[:, :, past:past + skv])
    if past:
        args.update(past_key=k_buf[:, :, :past], past_value=v_buf[:, :, :past])
    if "nonpad" in kwargs:
        kwargs["nonpad_kv_seqlen"] = np.array(kwargs.pop("nonpad"), np.int64)
    if kwargs.pop("mask", False):
        kwargs["attn_mask"] = rng.standard_normal((sq, past + skv)).astype(np.float32)
    return q, args, kwargs


def _dequantized(args):
    return {n: (a.dequantize() if isinstance(a, QuantizedArray) else a) for n, a in args.items()}


def _call(q, args, kwargs):
    return numkv.attention(q, args["K"], args["V"], past_key=args.get("past_key"),
                           past_value=args.get("past_value"), **kwargs)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_over_quantized_equals_attention_over_dequantized(name, fmt):
    q, args, kwargs = _attention_case(name, fmt)
    got = _call(q, args, kwargs)
    want = _call(q, _dequantized(args), kwargs)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=ATTN_TOL, atol=ATTN_TOL)
    if fmt in BLOCK_FORMATS:  # the same float32 values reach the same arithmetic
        assert np.array_equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["decode-gqa-past-causal", "prefill-past-causal-window", "nonpad-decode-causal"])
def test_small_tiles_and_key_chunks_and_the_reference_path_agree(name, fmt, monkeypatch):
    """Forced tile sizes and key-range chunks (the split decode's merge), and
    the plain NumPy path: all equal the kernel's default call."""
    q, args, kwargs = _attention_case(name, fmt)
    want = _call(q, _dequantized(args), kwargs)
    call = _attention.prepare(q, args["K"], args["V"], past_key=args.get("past_key"),
                              past_value=args.get("past_value"), **kwargs)
    for block_q, block_k, chunk in ((1, 7, 16), (3, 16, None), (None, 5, 11)):
        got = _attention.run(call, block_q=block_q, block_k=block_k, kv_chunk=chunk)
        np.testing.assert_allclose(got, want, rtol=ATTN_TOL, atol=ATTN_TOL,
                                   err_msg=f"block_q={block_q} block_k={block_k} chunk={chunk}")
    monkeypatch.setattr(_config, "REFERENCE", True)
    np.testing.assert_allclose(_call(q, args, kwargs), want, rtol=ATTN_TOL, atol=ATTN_TOL)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_per_tensor_scales_and_a_float16_query(fmt):
    q, args, kwargs = _attention_case("decode-gqa-past-causal", fmt, per_channel=False)
    q16 = q.astype(np.float16)
    got = _call(q16, args, kwargs)
    want = _call(q16, _dequantized(args), kwargs)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("key", [(slice(None), slice(None), slice(None, None, -1)),
                                 (slice(None), slice(None, None, 2), slice(3, None, 3)),
                                 (slice(1, None), slice(None), slice(5, 60))],
                         ids=["reversed-seq", "every-other-head-seq-step-3", "batch-and-seq-range"])
def test_strided_quantized_views_are_read_in_place(fmt, key):
    """Views with negative and stepped strides along the batch, head and
    sequence axes: the kernel reads them through their strides (decode's
    loops and the tiles alike) and gets attention over their dequantised values."""
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{key}".encode()))
    x = rng.standard_normal((3, 4, 70, 64)).astype(np.float32)
    k = quantize(x, fmt, scale=_scale_for(fmt, x))[key]
    v = quantize(x[:, :, ::-1] * 2, fmt, scale=_scale_for(fmt, x * 2))[key]
    hq = 2 * k.shape[1]
    for sq, kwargs in ((1, {}), (20, dict(is_causal=True))):
        q = rng.standard_normal((k.shape[0], hq, sq, 64)).astype(np.float32)
        np.testing.assert_allclose(numkv.attention(q, k, v, **kwargs),
                                   numkv.attention(q, k.dequantize(), v.dequantize(), **kwargs),
                                   rtol=ATTN_TOL, atol=ATTN_TOL)


def test_quantized_attention_can_fail():
    """The comparison sees a scale off by one block: V's scales rolled along
    the blocks (what reading the wrong block's scale would give)."""
    q, args, kwargs = _attention_case("decode-gqa", "q8_0")
    v = args["V"]
    wrong = QuantizedArray.from_parts("q8_0", v.codes, np.roll(v.scales, 1, axis=-1))
    got = _call(q, dict(args, V=wrong), kwargs)
    want = _call(q, _dequantized(args), kwargs)
    assert not np.allclose(got, want, rtol=ATTN_TOL, atol=ATTN_TOL)


def test_quantized_attention_makes_no_dequantised_copy():
    """The wrapper allocates nothing of the cache's size (numpy's allocations
    are what tracemalloc sees; a dequantised K and V would be 8 MiB here)."""
    import tracemalloc

    rng = np.random.default_rng(5)
    k = quantize(rng.standard_normal((1, 4, 4096, 128)).astype(np.float32), "q8_0")
    v = quantize(rng.standard_normal((1, 4, 4096, 128)).astype(np.float32), "q8_0")
    q = rng.standard_normal((1, 16, 1, 128)).astype(np.float32)
    numkv.attention(q, k, v)  # compiled
    tracemalloc.start()
    try:
        numkv.attention(q, k, v)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


@pytest.mark.parametrize("call, error, words", [
    (lambda q, k, v: numkv.attention(quantize(q, "q8_0"), k, v), TypeError, "Q"),
    (lambda q, k, v: numkv.attention(q[:, :, 0], k[:, 0], v[:, 0], q_num_heads=4, kv_num_heads=2), ValueError, "K"),
    (lambda q, k, v: numkv.attention(q, k, v, past_key=k.dequantize(), past_value=v), TypeError, "past_key"),
    (lambda q, k, v: numkv.attention(q, k, v, past_key=quantize(k.dequantize(), "q4_0"), past_value=v),
     TypeError, "past_key"),
    (lambda q, k, v: numkv.attention(q, quantize(k.dequantize(), "int8", scale=0.1), v,
                                     past_key=quantize(k.dequantize(), "int8", scale=0.2), past_value=v),
     ValueError, "past_key"),
    (lambda q, k, v: numkv.attention(q, k[:, :1], v), ValueError, "heads"),
])
def test_bad_quantized_attention_input_is_refused(call, error, words):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 3, 64)).astype(np.float32)
    k = quantize(rng.standard_normal((2, 2, 5, 64)).astype(np.float32), "q8_0")
    v = quantize(rng.standard_normal((2, 2, 5, 64)).astype(np.float32), "q8_0")
    with pytest.raises(error, match=words):
        call(q, k, v)


def test_float_and_quantized_k_v_mix():
    """K and V are read on their own: a q4_0 K with a float32 V, and an
    int8 V with a float16 K."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 8, 2, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 30, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 30, 64)).astype(np.float32)
    qk, qv = quantize(k, "q4_0"), quantize(v, "int8", scale=_scale_for("int8", v))
    np.testing.assert_allclose(numkv.attention(q, qk, v), numkv.attention(q, qk.dequantize(), v),
                               rtol=ATTN_TOL, atol=ATTN_TOL)
    np.testing.assert_allclose(numkv.attention(q, k.astype(np.float16), qv),
                               numkv.attention(q, k.astype(np.float16), qv.dequantize()),
                               rtol=ATTN_TOL, atol=ATTN_TOL)


# -- tensor_scatter on a QuantizedArray, and a quantised StaticKVCache ------------------------


def _cache_and_update(fmt, rng, seq=2):
    x = rng.standard_normal((2, 3, 10, 64)).astype(np.float32)
    scale = None if fmt in BLOCK_FORMATS else np.float32(0.05) if fmt == "int4" else \
        rng.uniform(0.01, 0.03, (1, 3, 1, 64)).astype(np.float32)
    return quantize(x, fmt, scale=scale), rng.standard_normal((2, 3, seq, 64)).astype(np.float32), scale


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_appends_codes_and_scales_in_place(fmt, mode, rng):
    cache, update, scale = _cache_and_update(fmt, rng)
    before = cache.dequantize()
    storage = cache.storage
    starts = np.array([1, 9 if mode == "circular" else 7])  # the second row wraps in circular mode
    out = numkv.tensor_scatter(cache, update, starts, axis=2, mode=mode, out=cache)
    assert out is cache and cache.storage is storage
    want = before.copy()
    written = quantize(update, fmt, scale=scale).dequantize()
    for b, s in enumerate(starts):
        for t in range(update.shape[2]):
            want[b, :, (s + t) % 10] = written[b, :, t]
    assert np.array_equal(cache.dequantize(), want)
    # a QuantizedArray update of the same format moves the same bytes
    again = quantize(np.random.default_rng(7).standard_normal((2, 3, 10, 64)).astype(np.float32), fmt, scale=scale)
    copy = numkv.tensor_scatter(again, quantize(update, fmt, scale=scale), starts, axis=-2, mode=mode)
    assert isinstance(copy, QuantizedArray) and copy is not again
    assert np.array_equal(copy.dequantize()[0, :, 1:3], written[0])
    assert not np.shares_memory(copy.storage, again.storage)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad, error, words", [
    (dict(update=lambda u: np.where(u > 1, np.nan, u)), ValueError, "update"),
    (dict(update=lambda u: u.astype(np.int16)), TypeError, "update"),
    (dict(update=lambda u: u[..., :32]), ValueError, "update"),
    (dict(axis=-1), ValueError, "axis"),
    (dict(axis=0), ValueError, "axis"),
    (dict(starts=[0, 9]), ValueError, "write_indices"),
    (dict(starts=[-1, 0]), ValueError, "write_indices"),
])
def test_a_refused_scatter_leaves_the_cache_byte_for_byte(fmt, bad, error, words, rng):
    cache, update, _ = _cache_and_update(fmt, rng)
    before = cache.storage.copy()
    update = bad.get("update", lambda u: u)(update)
    with pytest.raises(error, match=words):
        numkv.tensor_scatter(cache, update, np.array(bad.get("starts", [0, 1])), axis=bad.get("axis", 2),
                             out=cache)
    assert np.array_equal(cache.storage, before)


def test_scatter_refuses_another_format_or_scale(rng):
    cache, update, _ = _cache_and_update("int8", rng)
    with pytest.raises(ValueError, match="scale"):
        numkv.tensor_scatter(cache, quantize(update, "int8", scale=0.5), axis=2, out=cache)
    with pytest.raises(TypeError, match="format"):
        numkv.tensor_scatter(cache, quantize(update, "q8_0"), axis=2, out=cache)
    with pytest.raises(TypeError, match="out"):
        numkv.tensor_scatter(cache, update, axis=2, out=cache.dequantize())


# K and V formats of a cache: each block format for both, then mixed (llama.cpp's -ctk / -ctv)
KV_FORMATS = [(fmt, fmt) for fmt in BLOCK_FORMATS] + [("q8_0", "q4_0"), ("q4_1", "q8_0"), ("q4_0", "float32")]
BYTES_PER_32 = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "float32": 128}


def _stored(x, fmt):
    """What a cache of ``fmt`` holds of the float32 ``x``, as float32."""
    return x if fmt == "float32" else quantize(x, fmt).dequantize()


@pytest.mark.parametrize("fmt, v_fmt", KV_FORMATS, ids=[f"{k}-{v}" for k, v in KV_FORMATS])
def test_static_cache_quantises_on_append_and_decodes_like_the_dequantised_cache(fmt, v_fmt, rng):
    b, hkv, hq, d, cap = 2, 2, 8, 64, 40
    cache = numkv.StaticKVCache(b, hkv, cap, d, dtype=fmt, v_dtype=v_fmt)
    assert cache.dtype == fmt and cache.v_dtype == v_fmt
    assert cache.nbytes == b * hkv * cap * d // BLOCK * (BYTES_PER_32[fmt] + BYTES_PER_32[v_fmt])
    keys = rng.standard_normal((b, hkv, 12, d)).astype(np.float32)
    values = rng.standard_normal((b, hkv, 12, d)).astype(np.float32)
    q = rng.standard_normal((b, hq, 12, d)).astype(np.float32)
    # a prefill of 9 tokens, then decode steps of one
    k_view, v_view = cache.append(keys[:, :, :9], values[:, :, :9])
    assert isinstance(k_view, QuantizedArray) and k_view.shape == (b, hkv, 9, d)
    assert isinstance(v_view, QuantizedArray) == (v_fmt != "float32")
    ys = [numkv.attention(q[:, :, :9], **cache.attention_inputs())]
    for t in range(9, 12):
        cache.append(keys[:, :, t:t + 1], values[:, :, t:t + 1])
        ys.append(numkv.attention(q[:, :, t:t + 1], **cache.attention_inputs()))
    k_all, v_all = cache.get()
    assert isinstance(k_all, QuantizedArray) and np.shares_memory(k_all.storage, cache.key_buffer.storage)
    # each token's blocks quantised on their own: the cache holds quantize(keys)
    assert np.array_equal(k_all.dequantize(), _stored(keys, fmt))
    assert np.array_equal(v_all if v_fmt == "float32" else v_all.dequantize(), _stored(values, v_fmt))
    want = numkv.attention(q, _stored(keys, fmt), _stored(values, v_fmt), is_causal=True)
    np.testing.assert_allclose(np.concatenate(ys, axis=2), want, rtol=ATTN_TOL, atol=ATTN_TOL)


@pytest.mark.parametrize("fmt, v_fmt", KV_FORMATS, ids=[f"{k}-{v}" for k, v in KV_FORMATS])
def test_a_circular_quantised_cache_decodes_like_a_float_one_holding_the_same_values(fmt, v_fmt, rng):
    """A sliding-window ring (its attention_inputs() a mask over slots):
    quantised, and float32 holding the dequantised keys and values, give the
    same bits through a prefill, the ring's wrap, a crop and more steps."""
    b, hkv, hq, d = 2, 2, 8, 64
    cache = numkv.StaticKVCache(b, hkv, 16, d, dtype=fmt, v_dtype=v_fmt, mode="circular", window=12)
    plain = numkv.StaticKVCache(b, hkv, 16, d, dtype=np.float32, mode="circular", window=12)
    for t in range(30):
        n = 5 if t == 0 else 1
        k, v = (rng.standard_normal((b, hkv, n, d)).astype(np.float32) for _ in range(2))
        cache.append(k, v)
        plain.append(_stored(k, fmt), _stored(v, v_fmt))
        if t == 20:
            cache.crop(-3)
            plain.crop(-3)
            continue
        q = rng.standard_normal((b, hq, n, d)).astype(np.float32)
        assert np.array_equal(numkv.attention(q, **cache.attention_inputs()),
                              numkv.attention(q, **plain.attention_inputs()))
    assert "dtype=" + fmt in repr(cache) and cache.dtype == fmt
    assert ("v_dtype=" + v_fmt in repr(cache)) == (v_fmt != fmt)


def test_quantised_cache_refuses_what_it_cannot_hold(rng):
    with pytest.raises(ValueError, match="head_dim"):
        numkv.StaticKVCache(1, 2, 8, 48, dtype="q8_0")
    with pytest.raises((TypeError, ValueError), match="dtype"):
        numkv.StaticKVCache(1, 2, 8, 64, dtype="q5_0")
    with pytest.raises(TypeError, match="StaticKVCache"):
        numkv.DynamicKVCache(dtype="q8_0")
    cache = numkv.StaticKVCache(1, 2, 8, 64, dtype="q4_0")
    before = cache.key_buffer.storage.copy()
    with pytest.raises(TypeError, match="key"):
        cache.append(np.zeros((1, 2, 1, 64), np.int8), np.zeros((1, 2, 1, 64), np.float32))
    with pytest.raises(ValueError, match="key"):
        cache.append(np.full((1, 2, 1, 64), np.inf, np.float32), np.zeros((1, 2, 1, 64), np.float32))
    assert np.array_equal(cache.key_buffer.storage, before) and cache.seq_len == 0
    # separate K and V formats: v_dtype named, checked, and a bad value leaves both buffers as they were
    with pytest.raises(ValueError, match="v_head_dim"):
        numkv.StaticKVCache(1, 2, 8, 64, v_head_dim=48, dtype=np.float32, v_dtype="q4_1")
    with pytest.raises(TypeError, match="v_dtype"):
        numkv.StaticKVCache(1, 2, 8, 64, dtype="q8_0", v_dtype="q5_0")
    mixed = numkv.StaticKVCache(1, 2, 8, 64, dtype="q8_0", v_dtype=np.float16)
    k_before, v_before = mixed.key_buffer.storage.copy(), mixed.value_buffer.copy()
    with pytest.raises(TypeError, match="value"):  # float16 values, no cast
        mixed.append(np.zeros((1, 2, 1, 64), np.float32), np.zeros((1, 2, 1, 64), np.float32))
    with pytest.raises(ValueError, match="key"):
        mixed.append(np.full((1, 2, 1, 64), np.nan, np.float32), np.zeros((1, 2, 1, 64), np.float16))
    assert np.array_equal(mixed.key_buffer.storage, k_before) and np.array_equal(mixed.value_buffer, v_before)
    assert mixed.seq_len == 0


# -- onnxruntime's GroupQueryAttention reads and writes the same codes --------------

ort = pytest.importorskip("onnxruntime")


def _gqa_session(bits, per_channel, b, hq, hkv, past, d):
    from onnx import TensorProto, helper

    code_type = TensorProto.INT8 if bits == 8 else TensorProto.UINT8
    width = d if bits == 8 else d // 2
    scale_shape = [1, hkv, 1, d] if per_channel else [1]
    quant_type = "PER_CHANNEL" if per_channel else "PER_TENSOR"
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
             "", "", "", "", "", "k_scale", "v_scale"]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=hq, kv_num_heads=hkv,
                            k_quant_type=quant_type, v_quant_type=quant_type, kv_cache_bit_width=bits)
    info = helper.make_tensor_value_info
    graph = helper.make_graph([node], "gqa", [
        info("query", TensorProto.FLOAT, [b, 1, hq * d]), info("key", TensorProto.FLOAT, [b, 1, hkv * d]),
        info("value", TensorProto.FLOAT, [b, 1, hkv * d]),
        info("past_key", code_type, [b, hkv, past, width]), info("past_value", code_type, [b, hkv, past, width]),
        info("seqlens_k", TensorProto.INT32, [b]), info("total_sequence_length", TensorProto.INT32, []),
        info("k_scale", TensorProto.FLOAT, scale_shape), info("v_scale", TensorProto.FLOAT, scale_shape),
    ], [info("output", TensorProto.FLOAT, None), info("present_key", code_type, None),
        info("present_value", code_type, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_onnxruntime_group_query_attention_reads_and_writes_numkv_codes(fmt, per_channel):
    """A decode step: onnxruntime's GroupQueryAttention gets numkv's codes as
    its past cache and a new float token.  The token's codes it writes into
    ``present_key`` / ``present_value`` are the codes ``numkv.quantize``
    gives, and its Y is ``numkv.attention`` over the dequantised cache
    (onnxruntime reads the codes with numkv's meaning: a wrong nibble order,
    bias or scale axis moves Y by far more than 1e-3)."""
    import numkv

    rng = np.random.default_rng(zlib.crc32(f"{fmt}{per_channel}".encode()))
    b, hq, hkv, past, d = 2, 8, 2, 37, 64
    bits = 8 if fmt == "int8" else 4
    qmax = 127 if bits == 8 else 7
    k_all = rng.standard_normal((b, hkv, past + 1, d)).astype(np.float32)
    v_all = rng.standard_normal((b, hkv, past + 1, d)).astype(np.float32)
    if per_channel:  # channels of different ranges, and scales to match
        k_all *= rng.uniform(0.2, 3, (1, hkv, 1, d)).astype(np.float32)
        v_all *= rng.uniform(0.2, 3, (1, hkv, 1, d)).astype(np.float32)
        k_scale = (np.abs(k_all).max(axis=(0, 2), keepdims=True) / qmax).astype(np.float32)
        v_scale = (np.abs(v_all).max(axis=(0, 2), keepdims=True) / qmax).astype(np.float32)
    else:
        k_scale = np.float32(np.abs(k_all).max() / qmax)
        v_scale = np.float32(np.abs(v_all).max() / qmax)
    qk = quantize(k_all, fmt, scale=k_scale)
    qv = quantize(v_all, fmt, scale=v_scale)
    query = rng.standard_normal((b, 1, hq * d)).astype(np.float32)
    session = _gqa_session(bits, per_channel, b, hq, hkv, past, d)
    feeds = dict(
        query=query,
        key=k_all[:, :, past:].transpose(0, 2, 1, 3).reshape(b, 1, hkv * d),
        value=v_all[:, :, past:].transpose(0, 2, 1, 3).reshape(b, 1, hkv * d),
        past_key=np.ascontiguousarray(qk.codes[:, :, :past]),
        past_value=np.ascontiguousarray(qv.codes[:, :, :past]),
        seqlens_k=np.full(b, past, np.int32), total_sequence_length=np.array(past + 1, np.int32),
        k_scale=np.asarray(k_scale).reshape(-1 if not per_channel else k_scale.shape),
        v_scale=np.asarray(v_scale).reshape(-1 if not per_channel else v_scale.shape))
    if not per_channel:
        feeds["k_scale"] = feeds["k_scale"].reshape(1)
        feeds["v_scale"] = feeds["v_scale"].reshape(1)
    y, present_key, present_value = session.run(None, feeds)
    assert np.array_equal(present_key, qk.codes) and np.array_equal(present_value, qv.codes)
    q4 = query.reshape(b, 1, hq, d).transpose(0, 2, 1, 3)
    # (a decode step attends every key: no causal rule, which numkv would
    # anchor at key 0 here, as there is no past_key)
    want = numkv.attention(q4, qk.dequantize(), qv.dequantize())
    got = y.reshape(b, 1, hq, d).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    # numkv reading the codes and scales themselves (measured: max|dY| <= 1.2e-6 on |Y| <= 4.6)
    np.testing.assert_allclose(got, numkv.attention(q4, qk, qv), rtol=1e-3, atol=1e-3 * np.abs(want).max())
    # and a cache read with another nibble order or scale axis would not pass
    wrong = numkv.attention(q4, qk.dequantize(), qv.dequantize()[..., ::-1].copy())
    assert not np.allclose(got, wrong, rtol=1e-3, atol=1e-3 * np.abs(want).max())


# -- the bench's quantised decodes ----------------------------------------------------------------


def test_the_bench_holds_the_quantised_decodes_and_they_agree():
    """``python -m numkv bench`` has a decode over each format at Skv=16384;
    the same cases on a short cache run, and every implementation's Y
    matches numkv's (onnxruntime's GroupQueryAttention reads the same codes
    and writes the last token's as numkv did)."""
    from numkv._cli import bench_cases, timing

    ids = [case.id for case in bench_cases.default_cases()]
    for fmt in FORMATS:
        assert f"decode-Skv16384-kv-{fmt}" in ids
    for case in bench_cases.quantized_decode_cases(threads=1, kv_len=96):
        result = timing.time_case(case, timing.Settings(1, 0.05, 1))
        ran = [t for t in result.timings if t.seconds is not None]
        assert len(ran) == (3 if "int" in case.id else 2), [(t.impl.label, t.note) for t in result.timings]
        for t in ran[1:]:
            assert t.max_dy is not None and t.max_dy < 1e-5, (case.id, t.impl.label, t.max_dy)
        assert ran[0].impl.work < ran[1].impl.work / 3  # bytes read: codes and scales, not float32


def test_the_docstring_examples_run():
    import doctest

    import numkv._quantize

    result = doctest.testmod(numkv._quantize, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 8 and result.failed == 0, result


def test_the_constructor_refuses_storage_the_kernel_would_misread():
    with pytest.raises(TypeError, match="numkv.quantize"):
        QuantizedArray("q8_0", np.zeros((2, 68), np.float32))
    with pytest.raises(TypeError, match="numkv.quantize"):
        QuantizedArray("q8_0", np.zeros((2, 60), np.uint8))
    with pytest.raises(TypeError, match="numkv.quantize"):
        QuantizedArray("int8", np.zeros((1, 2, 3, 4), np.int8))  # no scale


def test_a_non_finite_value_is_named_at_its_position_in_x():
    x = np.zeros((1, 1, 1, 64), np.float32)
    x[0, 0, 0, 35] = np.inf
    with pytest.raises(ValueError, match=r"x holds inf \(at \(0, 0, 0, 35\)\)"):
        numkv.quantize(x, "q8_0")


def test_numkv_onnx_names_a_quantised_operand():
    pytest.importorskip("onnx")
    import numkv.onnx

    k = numkv.quantize(np.ones((1, 1, 4, 32), np.float32), "q8_0")
    with pytest.raises(TypeError, match="K is a QuantizedArray"):
        numkv.onnx.attention(np.ones((1, 1, 1, 32), np.float32), k, k)


def test_numpy_cannot_read_a_quantized_array_as_values():
    """np.asarray read it as nested sequences: an empty last axis, no error
    (np.mean gave NaN).  Now a TypeError that says what to call."""
    qa = numkv.quantize(np.ones((1, 2, 4, 32), np.float32), "q8_0")
    for convert in (np.asarray, np.mean, lambda x: np.array(x, np.float32)):
        with pytest.raises(TypeError, match=r"call \.dequantize\(\)"):
            convert(qa)
    with pytest.raises(TypeError, match="update cannot be viewed.*dequantize"):
        numkv.tensor_scatter(np.zeros((1, 2, 4, 32), np.float32), qa[:, :, :1])
