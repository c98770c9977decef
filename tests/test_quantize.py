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

import zlib

import ml_dtypes
import numpy as np
import pytest

from numkv._quantize import BLOCK, QuantizedArray, quantize

FORMATS = ["q8_0", "q4_0", "int8", "int4"]
BLOCK_FORMATS = ["q8_0", "q4_0"]
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


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_block_formats_are_within_half_a_step(fmt, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}{dtype}".encode()))
    x = _blocky(rng, (3, 4, 50, 128))
    if dtype == "float16":
        x = np.clip(x, -60000, 60000)
    x = x.astype(getattr(ml_dtypes, dtype, dtype))
    q = quantize(x, fmt)
    wide = x.astype(np.float64).reshape(q.scales.shape + (BLOCK,))
    d = _block_scales(q)
    deq = q.dequantize(np.float64).reshape(wide.shape)
    err = np.abs(wide - deq)
    assert (err <= d / 2).all(), float((err - d / 2).max())
    # the scale is amax / qmax to within one float16 step, never below what amax needs
    amax = np.abs(wide).max(-1, keepdims=True)
    qmax = QMAX[fmt]
    assert ((qmax + 0.5) * d >= amax).all()
    # (a rounding and a bump: under 1.5 float16 steps, relative 2**-10 each; 2**-24 absolute among subnormals)
    assert (d <= amax / qmax * (1 + 2.0 ** -9) + 2.0 ** -24).all()
    assert ((d == 0) == (amax == 0)).all()
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
    assert np.abs(x - q.dequantize(np.float64)).max() <= d / 2


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
    limit = {"q8_0": 34 / 32, "q4_0": 18 / 32, "int8": 1 + 1e-3, "int4": 0.5 + 1e-3}[fmt]
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
        assert part.nbytes == want.size // BLOCK * (34 if fmt == "q8_0" else 18)


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
        back = QuantizedArray.from_parts(fmt, q.codes, q.scales)
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
    # and a cache read with another nibble order or scale axis would not pass
    wrong = numkv.attention(q4, qk.dequantize(), qv.dequantize()[..., ::-1].copy())
    assert not np.allclose(got, wrong, rtol=1e-3, atol=1e-3 * np.abs(want).max())
