"""``numkv.attention(..., qk_precision="int8")`` (API.md): the query
quantised to int8 per block of 32 along the head (scale ``amax / 127`` in
float32, codes rounded half to even, clipped to +-127), then attention over
that dequantised query and the dequantised K/V.  The oracle quantises with
its own NumPy and runs the float64 naive attention of ``naive.py``."""

import ml_dtypes
import numpy as np
import pytest

import numkv
from naive import attention as naive_attention


def int8_query(q):
    """The contract's query, independently: float32 scale per 32, ties to even."""
    x = np.asarray(q, np.float32)
    out = np.empty_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        for start in range(0, x.shape[-1], 32):
            block = x[index][start:start + 32]
            scale = np.float32(np.max(np.abs(block))) / np.float32(127)
            codes = np.zeros(32) if scale == 0 else np.clip(np.round(block / scale), -127, 127)  # (round: half to even)
            out[index][start:start + 32] = codes.astype(np.float32) * scale
    return out


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "int8", "int4"])
@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16", "float16"])
def test_int8_query_equals_attention_over_the_dequantised_query(fmt, q_dtype):
    rng = np.random.default_rng(3)
    q = (rng.standard_normal((2, 8, 3, 64)) * 2).astype(np.float32)
    q[0, 0, 0, :32] = 0  # a zero block: scale 0, codes 0
    q = q.astype(getattr(ml_dtypes, q_dtype, q_dtype))
    k, v = (rng.standard_normal((2, 2, 40, 64)).astype(np.float32) for _ in range(2))
    scale = None if fmt.startswith("q") else 0.05
    kq, vq = numkv.quantize(k, fmt, scale=scale), numkv.quantize(v, fmt, scale=scale)
    y = numkv.attention(q, kq, vq, qk_precision="int8", is_causal=True, nonpad_kv_seqlen=np.array([40, 17]))
    assert y.dtype == q.dtype
    want = naive_attention(int8_query(q).astype(np.float64), kq.dequantize(np.float64), vq.dequantize(np.float64),
                           is_causal=True, nonpad_kv_seqlen=np.array([40, 17]))
    tol = 1e-5 if q_dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol)
    exact = numkv.attention(q, kq, vq, is_causal=True, nonpad_kv_seqlen=np.array([40, 17]))
    if q_dtype == "float32":
        assert not np.array_equal(y, exact)  # the query was quantised


def test_codes_round_half_to_even_and_clip():
    """A block whose largest magnitude is 127: its scale is 1, and x.5 values
    round to the even code (2.5 -> 2, 3.5 -> 4, -2.5 -> -2)."""
    q = np.zeros((1, 1, 1, 32), np.float32)
    q[..., :5] = [127, 2.5, 3.5, -2.5, 0.5]
    np.testing.assert_array_equal(int8_query(q)[0, 0, 0, :5], [127, 2, 4, -2, 0])
    # Two keys, each picking one element of the query: Y tells their scores apart.
    k2 = numkv.quantize(np.stack([np.eye(32, dtype=np.float32)[1], np.eye(32, dtype=np.float32)[2]])[None, None],
                        "q8_0")
    v2 = numkv.quantize(np.array([[1.0] + [0] * 31, [0.0] * 32], np.float32)[None, None], "q8_0")
    y = numkv.attention(q, k2, v2, qk_precision="int8", scale=1.0)
    # scores: q.k_1 = 2 (2.5 quantised), q.k_2 = 4 (3.5 quantised): softmax weight of key 1
    d = np.asarray(k2.dequantize())[0, 0]
    s = np.array([2.0 * d[0, 1], 4.0 * d[1, 2]])
    np.testing.assert_allclose(y[0, 0, 0, 0], np.exp(s[0]) / np.exp(s).sum() * v2.dequantize()[0, 0, 0, 0],
                               rtol=1e-6)


def test_three_d_inputs_quantise_each_head_alone():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 5, 4 * 64), np.float32)
    k = rng.standard_normal((1, 5, 2 * 64), np.float32)
    kq = numkv.quantize(k.reshape(1, 5, 2, 64).transpose(0, 2, 1, 3), "q8_0")
    y4 = numkv.attention(q.reshape(1, 5, 4, 64).transpose(0, 2, 1, 3), kq, kq, qk_precision="int8")
    want = numkv.attention(int8_query(q.reshape(1, 5, 4, 64).transpose(0, 2, 1, 3)), kq.dequantize(),
                           kq.dequantize())
    np.testing.assert_allclose(y4, want, rtol=1e-6, atol=1e-6)


def test_bad_qk_precision_is_a_value_error_naming_it():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 1, 64), np.float32)
    k = rng.standard_normal((1, 2, 8, 64), np.float32)
    kq = numkv.quantize(k, "q8_0")
    with pytest.raises(ValueError, match="qk_precision must be None or 'int8'"):
        numkv.attention(q, kq, kq, qk_precision="int4")
    with pytest.raises(ValueError, match="qk_precision='int8' needs a quantised K"):
        numkv.attention(q, k, k, qk_precision="int8")
    with pytest.raises(ValueError, match="qk_precision='int8' needs a quantised K"):
        numkv.attention(q, kq[:, :, :1], kq[:, :, :1], past_key=k, past_value=k, qk_precision="int8")
    k48 = numkv.quantize(rng.standard_normal((1, 2, 8, 48), np.float32), "int8", scale=0.1)
    with pytest.raises(ValueError, match="blocks of 32"):
        numkv.attention(rng.standard_normal((1, 2, 1, 48), np.float32), k48, k48, qk_precision="int8")
    np.testing.assert_array_equal(numkv.attention(q, kq, kq, qk_precision=None), numkv.attention(q, kq, kq))


def test_paged_and_varlen_take_qk_precision():
    """``paged_attention(..., qk_precision="int8")`` over quantised pages
    equals ``numkv.attention`` with it on each sequence alone;
    ``varlen_attention``'s K is never quantised: a ValueError naming it."""
    rng = np.random.default_rng(6)
    pages_k = numkv.quantize(rng.standard_normal((6, 4, 2, 64)).astype(np.float32), "q8_0")
    pages_v = numkv.quantize(rng.standard_normal((6, 4, 2, 64)).astype(np.float32), "q8_0")
    q = rng.standard_normal((3, 4, 64)).astype(np.float32)
    table = np.array([[5, 1, 3], [0, 2, -1]])
    y = numkv.paged_attention(q, pages_k, pages_v, table, np.array([10, 6]), np.array([0, 1, 3]),
                              is_causal=True, qk_precision="int8")
    keys = np.concatenate([pages_k.dequantize()[p] for p in (5, 1, 3)])[:10]
    values = np.concatenate([pages_v.dequantize()[p] for p in (5, 1, 3)])[:10]
    k4 = numkv.quantize(keys.transpose(1, 0, 2)[None], "q8_0")
    v4 = numkv.quantize(values.transpose(1, 0, 2)[None], "q8_0")
    want = numkv.attention(q[:1].transpose(1, 0, 2)[None], k4, v4, qk_precision="int8", is_causal=True,
                           nonpad_kv_seqlen=np.array([10]))
    np.testing.assert_allclose(y[:1], want[0].transpose(1, 0, 2), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="qk_precision='int8' needs a quantised K"):
        numkv.varlen_attention(q, q, q, np.array([0, 3]), np.array([0, 3]), qk_precision="int8")
