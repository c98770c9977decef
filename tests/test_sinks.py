"""``sinks`` in ``numkv.attention``: a logit per query head in the softmax's
denominator, with no value (API.md; gpt-oss, transformers' ``s_aux``).

Checked against the float64 loop (``naive.attention``), with the kernel's
forced tilings and a split key range (whose chunks merge), the NumPy reference
path, and transformers' eager gpt-oss attention; and the bad inputs."""

import types

import ml_dtypes
import numpy as np
import pytest

import naive
import numkv
from numkv import _attention, _config

F32, F64, BF16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16)

# (block_q, block_k, kv_chunk): 1-key tiles, odd tiles, and key ranges split in chunks that merge.
TILES = [(None, None, None), (1, 1, 1), (3, 5, 7), (2, 16, 64), (16, 64, 3)]


def _inputs(rng, b, hq, hkv, sq, skv, d, dtype=F32, kv="float"):
    q = rng.standard_normal((b, hq, sq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, skv, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, skv, d)).astype(dtype)
    if kv == "q8_0":
        return q, numkv.quantize(k.astype(np.float32), "q8_0"), numkv.quantize(v.astype(np.float32), "q8_0")
    return q, k, v


def _as_float(x):
    return x.dequantize() if isinstance(x, numkv.QuantizedArray) else np.asarray(x, np.float64)


CASES = [
    pytest.param(dict(b=2, hq=4, hkv=2, sq=5, skv=7, d=32), {}, id="gqa-Hq4-Hkv2"),
    pytest.param(dict(b=1, hq=8, hkv=2, sq=9, skv=9, d=32), dict(is_causal=True), id="gqa-causal"),
    pytest.param(dict(b=2, hq=6, hkv=3, sq=11, skv=11, d=32), dict(is_causal=True, left_window_size=3),
                 id="gqa-causal-window3"),
    pytest.param(dict(b=1, hq=4, hkv=1, sq=1, skv=600, d=32), {}, id="mqa-decode-T600"),
    pytest.param(dict(b=2, hq=4, hkv=2, sq=3, skv=40, d=32), dict(softcap=2.0, is_causal=True),
                 id="softcap-causal"),
    pytest.param(dict(b=1, hq=32, hkv=8, sq=20, skv=20, d=32), dict(is_causal=True), id="gemm-rows"),
]


@pytest.mark.parametrize("shape, attrs", CASES)
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float64", "q8_0"])
def test_sinks_equal_the_float64_loop(shape, attrs, kv, rng):
    dtype = {"bfloat16": BF16, "float64": F64}.get(kv, F32)
    q, k, v = _inputs(rng, **shape, dtype=dtype, kv="q8_0" if kv == "q8_0" else "float")
    sinks = rng.standard_normal(shape["hq"]) * 2 + np.log(shape["skv"])  # a share like the keys'
    want = naive.attention(_as_float(q), _as_float(k), _as_float(v), sinks=sinks, **attrs)
    without = naive.attention(_as_float(q), _as_float(k), _as_float(v), **attrs)
    assert np.abs(want - without).max() > 0.1 * np.abs(without).max()  # the sinks matter in this case
    rtol, atol = {"bfloat16": (2 ** -7, 1e-5), "float64": (1e-12, 1e-12)}.get(kv, (1e-5, 1e-5))
    call = _attention.prepare(q, k, v, sinks=sinks, **attrs)
    for block_q, block_k, kv_chunk in TILES:
        y = _attention.run(call, block_q=block_q, block_k=block_k, kv_chunk=kv_chunk)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=rtol, atol=atol,
                                   err_msg=f"block_q={block_q} block_k={block_k} kv_chunk={kv_chunk}")
    y = numkv.attention(q, k, v, sinks=sinks, **attrs)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=rtol, atol=atol)


def test_split_key_range_merges_with_sinks(rng):
    """A long decode whose key range the default plan splits into chunks."""
    q, k, v = _inputs(rng, 1, 32, 8, 1, 5000, 64)
    sinks = rng.standard_normal(32) * 3 + 2
    call = _attention.prepare(q, k, v, sinks=sinks)
    y = _attention.run(call)
    want = naive_fast(q, k, v, sinks)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def naive_fast(q, k, v, sinks):
    """The same formula vectorised (float64), for shapes too long for the loop."""
    g = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, g, 1).astype(np.float64), np.repeat(v, g, 1).astype(np.float64)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), kr) / np.sqrt(q.shape[3])
    sk = np.asarray(sinks, np.float64)[None, :, None, None]
    top = np.maximum(s.max(-1, keepdims=True), sk)
    e = np.exp(s - top)
    return np.einsum("bhqk,bhkd->bhqd", e / (e.sum(-1, keepdims=True) + np.exp(sk - top)), vr)


def test_large_sinks_do_not_overflow_and_minus_inf_is_no_sink(rng):
    q, k, v = _inputs(rng, 1, 4, 2, 3, 10, 8)
    big = np.array([200.0, -200.0, 0.0, 80.0])
    np.testing.assert_allclose(numkv.attention(q, k, v, sinks=big), naive_fast(q, k, v, big), rtol=1e-5, atol=1e-30)
    assert np.isfinite(numkv.attention(q, k, v, sinks=big)).all()
    none = np.full(4, -np.inf)
    np.testing.assert_array_equal(numkv.attention(q, k, v, sinks=none), numkv.attention(q, k, v))


def test_a_row_that_attends_nothing_is_zero_with_sinks(rng):
    q, k, v = _inputs(rng, 2, 4, 2, 3, 6, 8)
    y = numkv.attention(q, k, v, nonpad_kv_seqlen=np.array([0, 6]), sinks=np.ones(4))
    assert (y[0] == 0).all() and (y[1] != 0).any()


def test_reference_path_takes_sinks(rng, monkeypatch):
    q, k, v = _inputs(rng, 2, 4, 2, 5, 9, 8)
    sinks = rng.standard_normal(4) * 2
    attrs = dict(is_causal=True, left_window_size=2, sinks=sinks)
    kernel = numkv.attention(q, k, v, **attrs)
    monkeypatch.setattr(_config, "REFERENCE", True)
    reference = numkv.attention(q, k, v, **attrs)
    want = naive.attention(q, k, v, **attrs)
    np.testing.assert_allclose(reference, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kernel, reference, rtol=2e-5, atol=2e-6)


def test_a_kept_plan_keys_on_the_sinks(rng):
    """Two calls of one shape with different sinks: the second must not run the first's plan."""
    q, k, v = _inputs(rng, 1, 4, 2, 1, 50, 8)
    a, b = np.zeros(4), np.full(4, 3.0)
    ya = numkv.attention(q, k, v, sinks=a)
    yb = numkv.attention(q, k, v, sinks=b)
    np.testing.assert_allclose(yb, naive_fast(q, k, v, b), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(numkv.attention(q, k, v, sinks=a), ya)


@pytest.mark.parametrize("sinks, exc, match", [
    pytest.param(np.zeros(3), ValueError, r"sinks must have shape \(q_num_heads,\) = \(4,\), got \(3,\)", id="short"),
    pytest.param(np.zeros((1, 4)), ValueError, r"sinks must have shape", id="2-d"),
    pytest.param(np.array([0, 0, np.nan, 0]), ValueError, "sinks must be finite or -inf, got nan", id="nan"),
    pytest.param(np.array([0, np.inf, 0, 0]), ValueError, "sinks must be finite or -inf, got inf", id="inf"),
    pytest.param(np.array([True] * 4), TypeError, "sinks has dtype bool", id="bool"),
    pytest.param(np.array(["a"] * 4), TypeError, "sinks has dtype <U1", id="str"),
    pytest.param("oops", TypeError, "sinks", id="not-an-array"),
])
def test_bad_sinks(sinks, exc, match):
    q, k, v = np.ones((1, 4, 2, 8), np.float32), np.ones((1, 2, 3, 8), np.float32), np.ones((1, 2, 3, 8), np.float32)
    with pytest.raises(exc, match=match):
        numkv.attention(q, k, v, sinks=sinks)


# --------------------------------------------------------------------------
# transformers' eager gpt-oss attention


def _additive_mask(sq, skv, causal, window):
    i = np.arange(sq)[:, None] + (skv - sq)
    j = np.arange(skv)[None, :]
    keep = np.ones((sq, skv), bool)
    if causal:
        keep &= j <= i
    if window:
        keep &= j > i - window  # transformers' sliding window: the query and window - 1 before it
    return np.where(keep, 0.0, -np.inf).astype(np.float32)[None, None]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sq, skv, window", [(7, 7, None), (9, 9, 4), (1, 600, None), (3, 700, 128)],
                         ids=["prefill", "prefill-window4", "decode-T600", "chunk-window128"])
def test_sinks_equal_transformers_eager_gpt_oss(sq, skv, window, dtype, rng):
    torch = pytest.importorskip("torch")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    hq, hkv, d = 8, 2, 16
    tdtype = getattr(torch, dtype)
    q = torch.from_numpy(rng.standard_normal((1, hq, sq, d)).astype(np.float32)).to(tdtype)
    k = torch.from_numpy(rng.standard_normal((1, hkv, skv, d)).astype(np.float32)).to(tdtype)
    v = torch.from_numpy(rng.standard_normal((1, hkv, skv, d)).astype(np.float32)).to(tdtype)
    sinks = torch.from_numpy(rng.standard_normal(hq).astype(np.float32) * 2).to(tdtype)
    # eager in float32 over the same (rounded) values: the exact answer to compare with
    module = types.SimpleNamespace(num_key_value_groups=hq // hkv, sinks=sinks.float(), training=False)
    mask = torch.from_numpy(_additive_mask(sq, skv, True, window))
    scaling = d ** -0.5
    want, _ = gpt_oss.eager_attention_forward(module, q.float(), k.float(), v.float(), mask.float(), scaling)

    import numkv.transformers as nt

    kw = dict(scale=scaling, is_causal=True, nonpad_kv_seqlen=np.array([skv]), sinks=nt.as_numpy(sinks, "s"))
    if window:
        kw["left_window_size"] = window - 1
    got = numkv.attention(nt.as_numpy(q, "q"), nt.as_numpy(k, "k"), nt.as_numpy(v, "v"), **kw)
    got = torch.from_numpy(np.asarray(got, np.float32)).transpose(1, 2)
    tol = 1e-5 if dtype == "float32" else 2 ** -7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
