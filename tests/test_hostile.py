"""Hostile input (issue 32) and the contract kept everywhere (issue 27).

Each reproducer of the issues is a test here, and the class behind it:

* a cache append whose key and value are views of the cache's own buffers
  (crossed, overlapping, shifted) stores what they held before the append,
  for every cache kind (hypothesis: random overlaps);
* a circular cache refuses, before writing, a chunk that would overwrite keys
  its own first queries attend;
* every option of the layer, the decoder and ``generate`` is honoured on
  every path (cached, uncached, chunked prefill) or refused, and bad
  arguments are errors naming the argument.
"""

import copy

import numpy as np
import pytest
from hypothesis import given, strategies as st

import numkv
from numkv.cache import DynamicKVCache, StaticKVCache
from numkv.layers import CachedSelfAttention, Decoder

KINDS = ("dynamic", "static", "circular")


def _cache(kind, batch=2, heads=2, capacity=12, dim=3, window=None):
    if kind == "dynamic":
        return DynamicKVCache()
    mode = "circular" if kind == "circular" else "linear"
    if kind == "circular" and window is None:
        window = capacity // 2
    return StaticKVCache(batch, heads, capacity, dim, mode=mode, window=window)


# --- appends that alias the cache's own buffers ---------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_crossed_views_of_the_buffers_are_read_before_written(kind):
    """Issue 32.1: key = a view of the value buffer, value = a view of the key
    buffer.  The key write overwrote the value's source before it was read."""
    c = _cache(kind, batch=1, heads=1, capacity=4, dim=2, window=4 if kind == "circular" else None)
    if kind == "dynamic":
        c.append(np.zeros((1, 1, 1, 2), np.float32), np.zeros((1, 1, 1, 2), np.float32))
        c.crop(0)
    c._k[...] = 1.0
    c._v[...] = 2.0
    keys, values = c.append(c._v[:, :, :1], c._k[:, :, :1])  # key holds 2.0, value 1.0
    assert keys.ravel().tolist() == [2.0, 2.0]
    assert values.ravel().tolist() == [1.0, 1.0]


def test_the_issue_reproducer():
    c = numkv.StaticKVCache(1, 1, 4, 2)
    c.key_buffer[...] = 1.0
    c.value_buffer[...] = 2.0
    c.append(c.value_buffer[:, :, :1], c.key_buffer[:, :, :1])
    keys, values = c.get()
    assert keys.tolist() == [[[[2.0, 2.0]]]] and values.tolist() == [[[[1.0, 1.0]]]]


@given(kind=st.sampled_from(KINDS), fill=st.integers(1, 5), new=st.integers(1, 3),
       key_src=st.sampled_from(["k", "v"]), value_src=st.sampled_from(["k", "v"]),
       key_shift=st.integers(-4, 4), value_shift=st.integers(-4, 4), seed=st.integers(0, 2 ** 16))
def test_aliased_appends_store_what_the_views_held(kind, fill, new, key_src, value_src, key_shift,
                                                   value_shift, seed):
    """Random overlaps of the new keys / values with either buffer, around
    the write position (before, across or after it): the result equals
    appending copies taken before the call."""
    rng = np.random.default_rng(seed)
    cache = _cache(kind, capacity=12, window=12 - 3 + 1 if kind == "circular" else None)  # max_chunk 3
    data = rng.standard_normal((2, 2, fill, 3)).astype(np.float32)
    cache.append(data, -data)
    bufs = {"k": cache._k, "v": cache._v}
    for buf in bufs.values():  # stale slots past the rows' ends hold data too
        buf[:, :, fill:] = rng.standard_normal(buf[:, :, fill:].shape)
    capacity = bufs["k"].shape[2]
    key_at = int(np.clip(fill + key_shift, 0, capacity - new))
    value_at = int(np.clip(fill + value_shift, 0, capacity - new))
    key = bufs[key_src][:, :, key_at:key_at + new]
    value = bufs[value_src][:, :, value_at:value_at + new]
    expected = copy.deepcopy(cache)
    want = expected.append(key.copy(), value.copy())
    got = cache.append(key, value)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(cache.seq_lens, expected.seq_lens)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_over_a_cache_fed_its_own_views(kind):
    """CachedSelfAttention appends through the same path: a cache whose
    buffers it wrote keeps agreeing with recomputation after it."""
    layer = CachedSelfAttention(8, 2, seed=1)
    cache = layer.new_cache(1, None if kind == "dynamic" else 8, mode="circular" if kind == "circular" else "linear",
                            window=8 if kind == "circular" else None)
    x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)
    y = layer(x, cache, True)
    np.testing.assert_allclose(y, layer(x), rtol=1e-5, atol=1e-5)


# --- the ring refuses a chunk it cannot serve, before writing ------------------------


def test_circular_refuses_a_wrapping_chunk_longer_than_max_chunk():
    """Issue 27: an append longer than max_chunk that wraps the ring was
    written (its last keys overwriting keys its first queries need) and only
    ``attention_inputs()`` refused, too late.  Now the append refuses first."""
    cache = StaticKVCache(1, 1, 8, 2, mode="circular", window=6)  # max_chunk 3
    k = np.arange(12, dtype=np.float32).reshape(1, 1, 6, 2)
    cache.append(k, k)
    before = (cache._k.copy(), cache._v.copy(), cache.seq_lens)
    with pytest.raises(ValueError, match="max_chunk = 3.*wraps the circular cache"):
        cache.append(k[:, :, :4], k[:, :, :4])
    np.testing.assert_array_equal(cache._k, before[0])
    np.testing.assert_array_equal(cache._v, before[1])
    np.testing.assert_array_equal(cache.seq_lens, before[2])
    cache.append(k[:, :, :3], k[:, :, :3])  # max_chunk positions: served
    assert cache.attention_inputs()["attn_mask"].shape == (1, 1, 3, 8)


# --- every option honoured on every path, or refused -----------------------------------


@pytest.fixture(scope="module")
def decoder():
    return Decoder("tiny", seed=0)


PROMPTS = [np.arange(1, 9), np.arange(20, 31)]


def test_generate_honours_window_with_linear_caches(decoder):
    """Issue 32.2: cache="dynamic" | "static" ignored ``window``."""
    ref = decoder.generate(PROMPTS, 4, window=3)[0]
    assert ref.tolist() == [[234, 226, 4, 189], [177, 148, 156, 95]]
    for kind in ("dynamic", "static"):
        np.testing.assert_array_equal(decoder.generate(PROMPTS, 4, cache=kind, window=3)[0], ref)


@pytest.fixture(scope="module")
def uncached(decoder):
    return {w: decoder.generate(PROMPTS, 4, window=w) for w in (None, 2, 5)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 2, 5])
@pytest.mark.parametrize("prefill_chunk", [None, 1, 3])
def test_every_option_through_every_cache_kind(decoder, uncached, kind, window, prefill_chunk):
    if kind == "circular" and window is None:
        pytest.skip("a circular cache needs a window")
    tokens, logits = decoder.generate(PROMPTS, 4, cache=kind, window=window, prefill_chunk=prefill_chunk)
    np.testing.assert_array_equal(tokens, uncached[window][0])
    np.testing.assert_allclose(logits, uncached[window][1], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_honours_the_cache_dtype(decoder, uncached, kind):
    """``dtype`` reaches every cache kind (a DynamicKVCache took float32)."""
    window = 5 if kind == "circular" else None
    exact = decoder.generate(PROMPTS, 4, cache=kind, window=window)[1]
    low = decoder.generate(PROMPTS, 4, cache=kind, window=window, dtype=np.float16)[1]
    assert not np.array_equal(low, exact)
    np.testing.assert_allclose(low[:, 0], exact[:, 0], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype=np.float16), "dtype is the caches' dtype"),
    (dict(prefill_chunk=2), "prefill_chunk splits the caches' prefill"),
    (dict(slots=4), "slots is the capacity of a 'circular' cache"),
    (dict(cache="static", slots=4), "slots is the capacity"),
    (dict(cache="circular", window=4, slots=3), "slots 3 < window 4"),
])
def test_generate_refuses_options_it_would_ignore(decoder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        decoder.generate(PROMPTS, 2, **kwargs)


def test_dynamic_cache_takes_a_dtype():
    cache = DynamicKVCache(dtype=np.float16)
    assert cache.dtype == np.float16
    with pytest.raises(TypeError, match="cache holds float16"):
        cache.append(np.zeros((1, 1, 1, 2), np.float32), np.zeros((1, 1, 1, 2), np.float32))
    assert cache.seq_len == 0
    cache.append(np.zeros((1, 1, 1, 2), np.float16), np.zeros((1, 1, 1, 2), np.float16))
    cache.reset()
    assert cache.dtype == np.float16


# --- arguments checked up front, named in the error -------------------------------------


def _x(batch=1, seq=2, embed=8):
    return np.ones((batch, seq, embed), np.float32)


@pytest.mark.parametrize("call, error, match", [
    (lambda: CachedSelfAttention("16", 4), TypeError, "embed_dim must be an integer"),
    (lambda: CachedSelfAttention(16, 0), ValueError, "num_heads must be >= 1"),
    (lambda: CachedSelfAttention(16, 4, 3), ValueError, "num_heads .* multiple of num_kv_heads"),
    (lambda: CachedSelfAttention(16, 4, seed=-1), ValueError, "seed must be >= 0"),
    (lambda: CachedSelfAttention(16, 4, head_dim=2.0), TypeError, "head_dim must be an integer"),
    (lambda: CachedSelfAttention(16, 4, rope_base=-1.0), ValueError, "rope_base must be a positive"),
    (lambda: CachedSelfAttention(8, 2)(_x(), cache=object(), use_cache=True), TypeError,
     "cache must be a numkv DynamicKVCache or StaticKVCache, got object"),
    (lambda: CachedSelfAttention(8, 2)(_x(), window="a"), TypeError, "window must be an integer"),
    (lambda: CachedSelfAttention(8, 2)(_x(), window=0), ValueError, "window must be >= 1"),
    (lambda: CachedSelfAttention(8, 2)(_x(), use_cache="yes"), TypeError, "use_cache must be True or False"),
    (lambda: CachedSelfAttention(8, 2)(_x(), DynamicKVCache()), ValueError, "use_cache=False"),
    (lambda: CachedSelfAttention(8, 2)(_x(), StaticKVCache(1, 1, 8, 4), True), ValueError,
     "cache has kv heads 1, the layer's input needs 2"),
    (lambda: CachedSelfAttention(8, 2)(_x(), StaticKVCache(3, 2, 8, 4), True), ValueError,
     "cache has batch size 3"),
    (lambda: CachedSelfAttention(8, 2)(_x().astype(bool)), TypeError, "x must hold numbers"),
    (lambda: Decoder("tiny", seed=-1), ValueError, "seed must be >= 0"),
    (lambda: Decoder(["tiny"]), ValueError, "size must be one of"),
    (lambda: Decoder("tiny", num_layers=0), ValueError, "num_layers must be >= 1"),
    (lambda: Decoder("tiny", rope_base="x"), TypeError, "rope_base must be a number"),
    (lambda: Decoder("tiny")(np.ones((1, 2), int), caches=DynamicKVCache()), TypeError,
     "caches must be a sequence"),
    (lambda: Decoder("tiny")(np.ones((1, 2), int), caches=[object(), object()]), TypeError,
     r"caches\[0\] must be a numkv"),
    (lambda: Decoder("tiny")(np.ones((1, 2), int), window=-1), ValueError, "window must be >= 1"),
    (lambda: Decoder("tiny").generate(PROMPTS, 2, cache="static", prefill_chunk=-1), ValueError,
     "prefill_chunk must be >= 1"),
    (lambda: Decoder("tiny").generate(PROMPTS, 2, cache="static", prefill_chunk=0), ValueError,
     "prefill_chunk must be >= 1"),
    (lambda: Decoder("tiny").generate(PROMPTS, -1), ValueError, "new_tokens must be >= 0"),
    (lambda: Decoder("tiny").generate(PROMPTS, 2.5), TypeError, "new_tokens must be an integer"),
    (lambda: Decoder("tiny").generate(PROMPTS, 2, window="3"), TypeError, "window must be an integer"),
    (lambda: Decoder("tiny").generate(PROMPTS, 2, progress=3), TypeError, "progress must be callable"),
    (lambda: Decoder("tiny").generate([np.array([1.5, 2.0])], 2), TypeError, r"prompts\[0\] must hold integer"),
    (lambda: Decoder("tiny").generate([np.array([1, 999])], 2), ValueError, r"prompts\[0\] has tokens outside"),
    (lambda: Decoder("tiny").generate(3, 2), TypeError, "prompts must be a sequence"),
    (lambda: Decoder("tiny").new_caches("static", 2), ValueError, "a 'static' cache needs max_seq_len"),
    (lambda: Decoder("tiny").new_caches("dynamic", 2, 8), ValueError, "max_seq_len applies to"),
    (lambda: Decoder("tiny").new_caches("static", 2, 8, window=3), ValueError, "window makes a 'circular'"),
    (lambda: CachedSelfAttention(8, 2).new_cache(1, mode="circular"), ValueError, "needs max_seq_len"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_generate_with_no_new_tokens(decoder):
    for kind in (None, "static"):
        tokens, logits = decoder.generate(PROMPTS, 0, cache=kind)
        assert tokens.shape == (2, 0) and logits.shape == (2, 0, decoder.vocab_size)


# --- the plain NumPy path keeps API.md's NaN / Inf rules ------------------------------


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("rule", ["nonpad", "causal", "window", "bool-mask", "float-mask"])
def test_reference_path_ignores_excluded_non_finite_keys(monkeypatch, rule, value):
    """Issue 27: with NUMKV_REFERENCE=1, a key excluded by nonpad_kv_seqlen
    (or mask / causal / window) holding inf or NaN turned every row NaN."""
    from numkv import _config

    monkeypatch.setattr(_config, "REFERENCE", True)
    rng = np.random.default_rng(3)
    sq = 40 if rule == "causal" else 5
    q = rng.standard_normal((1, 4, sq, 8), np.float32)
    k = rng.standard_normal((1, 2, 40, 8), np.float32)
    v = rng.standard_normal((1, 2, 40, 8), np.float32)
    attrs, excluded, rows = {}, np.zeros(40, bool), slice(None)
    if rule == "nonpad":
        attrs["nonpad_kv_seqlen"] = np.array([30])
        excluded[30:] = True
    elif rule == "causal":
        attrs["is_causal"] = True
        excluded[20:] = True
        rows = slice(0, 20)
    elif rule == "window":
        attrs.update(left_window_size=2, right_window_size=0)
        excluded[5:] = True
    else:
        excluded[10:30] = True
        mask = ~excluded[None, None, None, :]
        attrs["attn_mask"] = mask if rule == "bool-mask" else np.where(mask, 0.0, -np.inf).astype(np.float32)
    clean = numkv.attention(q, k, v, **attrs)[:, :, rows]
    k[:, :, excluded] = value
    v[:, :, excluded] = value
    y = numkv.attention(q, k, v, **attrs)[:, :, rows]
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, clean, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(_config, "REFERENCE", False)  # the kernel agrees
    np.testing.assert_allclose(numkv.attention(q, k, v, **attrs)[:, :, rows], y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["q", "k-attended", "v-attended", "v-underflowed"])
def test_reference_path_keeps_the_nan_of_attended_keys(monkeypatch, where):
    """...while NaN / inf in what a query does attend still reaches its row,
    as on the kernel's path (an attended key multiplies its V even when its
    weight underflowed to 0: ``0 * inf``)."""
    from numkv import _config

    rng = np.random.default_rng(4)
    q = np.abs(rng.standard_normal((1, 2, 3, 8), np.float32))
    k = rng.standard_normal((1, 1, 12, 8), np.float32)
    v = rng.standard_normal((1, 1, 12, 8), np.float32)
    if where == "q":
        q[0, 1, 2, 0] = np.nan
    elif where == "k-attended":
        k[0, 0, 4, 1] = np.nan
    elif where == "v-attended":
        v[0, 0, 4, 1] = np.inf
    else:
        k[0, 0, 4] = -1000.0
        v[0, 0, 4, 1] = np.inf
    got = {}
    for reference in (True, False):
        monkeypatch.setattr(_config, "REFERENCE", reference)
        got[reference] = numkv.attention(q, k, v)
    assert np.array_equal(np.isnan(got[True]), np.isnan(got[False]))
    assert not np.isfinite(got[True]).all()
    np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5)  # inf == inf, nan == nan


# --- numkv.onnx on zero-size shapes -----------------------------------------------------

# (Q shape, K/V shape, attributes, whether onnx.reference 1.23.2 answers: it
# fails itself on an empty K and on 3-D inputs with no query, where the
# shapes are still determined)
ZERO_SIZE = {
    "q-seq-0": ((1, 2, 0, 4), (1, 2, 3, 4), {}, True),
    "batch-0": ((0, 2, 3, 4), (0, 2, 3, 4), {}, True),
    "q-heads-0": ((1, 0, 3, 4), (1, 1, 3, 4), {}, True),
    "kv-seq-0": ((1, 2, 3, 4), (1, 2, 0, 4), {"is_causal": 1}, False),
    "3d-q-seq-0": ((1, 0, 8), (1, 3, 8), {"q_num_heads": 2, "kv_num_heads": 2}, False),
}


@pytest.mark.parametrize("case", ZERO_SIZE)
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_onnx_attention_on_zero_size_shapes(case, mode):
    """Issue 32.3: numkv.onnx.attention failed with 'cannot reshape array of
    size 0' where numkv.attention (and onnx.reference, where it answers) do."""
    pytest.importorskip("onnx")
    import numkv.onnx
    import oracle

    q_shape, kv_shape, attrs, reference_answers = ZERO_SIZE[case]
    Q, K = np.zeros(q_shape, np.float32), np.ones(kv_shape, np.float32)
    got = numkv.onnx.attention(Q, K, K, qk_matmul_output_mode=mode, **attrs)
    y = numkv.attention(Q, K, K, **attrs)
    assert got[0].shape == y.shape and got[0].dtype == np.float32
    np.testing.assert_array_equal(got[0], y)
    if reference_answers:
        want = oracle.attention(Q, K, K, qk_matmul_output_mode=mode, float64=False, **attrs)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == np.float32
            np.testing.assert_array_equal(g, w)
    else:
        b = q_shape[0]
        hq, hkv = (q_shape[1], kv_shape[1]) if len(q_shape) == 4 else (attrs["q_num_heads"], attrs["kv_num_heads"])
        sq, skv = q_shape[-2], kv_shape[-2]
        d = (kv_shape[3] if len(kv_shape) == 4 else kv_shape[2] // hkv)
        assert got[1].shape == got[2].shape == (b, hkv, skv, d)
        assert got[3].shape == (b, hq, sq, skv)


@pytest.mark.parametrize("case", ["q-seq-0", "batch-0", "kv-seq-0"])
def test_onnx_evaluator_on_zero_size_shapes_with_every_output(case):
    onnx = pytest.importorskip("onnx")
    from onnx import helper

    import numkv.onnx

    q_shape, kv_shape, attrs, _ = ZERO_SIZE[case]
    f = onnx.TensorProto.FLOAT
    outputs = ["Y", "present_key", "present_value", "qk"]
    node = helper.make_node("Attention", ["Q", "K", "V"], outputs, **attrs)
    graph = helper.make_graph([node], "zero", [helper.make_tensor_value_info(n, f, None) for n in "QKV"],
                              [helper.make_tensor_value_info(o, f, None) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    feeds = {"Q": np.zeros(q_shape, np.float32), "K": np.ones(kv_shape, np.float32),
             "V": np.ones(kv_shape, np.float32)}
    got = numkv.onnx.evaluator(model).run(None, feeds)
    assert [g.shape for g in got] == [r.shape for r in numkv.onnx.attention(*feeds.values(), **attrs)]
    if case != "kv-seq-0":  # onnx.reference cannot take an empty K
        want = onnx.reference.ReferenceEvaluator(model).run(None, feeds)
        assert [g.shape for g in got] == [w.shape for w in want]


# --- masks wider than the computation, byte order -------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("value", [1e39, -1e39, 1e300, -1e300])
def test_a_float64_mask_beyond_float32_gives_the_references_values(dtype, value):
    """Issue 32.4: a finite float64 mask value beyond float32's range became
    inf in the float32 computation, and the row NaN (``inf - inf``)."""
    import warnings

    import ml_dtypes
    import oracle

    dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 3, 8)).astype(dtype)
    k = rng.standard_normal((1, 1, 4, 8)).astype(dtype)
    v = rng.standard_normal((1, 1, 4, 8)).astype(dtype)
    mask = np.zeros((3, 4))
    mask[1, 2] = value      # one key of row 1
    mask[2, :] = value      # every key of row 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow in a cast either
        y = numkv.attention(q, k, v, attn_mask=mask)
    reference = oracle.attention(q, k, v, attn_mask=mask)[0]
    assert np.isfinite(y.astype(np.float32)).all()
    tol = 2e-5 if dtype.itemsize >= 4 or dtype.itemsize == 1 else 4e-3
    np.testing.assert_allclose(y.astype(np.float64), reference, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["f2", "f4", "f8", "i4", "i8", "u2"])
def test_masks_of_either_byte_order_read_alike(dtype):
    """Issue 32.6: a big-endian float mask was refused with a message listing
    float32 as allowed, while big-endian integer masks were accepted."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 4, 8)).astype(np.float32)
    mask = rng.integers(-3, 3, (3, 4)).astype("<" + dtype)
    if dtype[0] == "f":
        mask[0, 1] = -np.inf
    big = mask.astype(">" + dtype)
    np.testing.assert_array_equal(numkv.attention(q, k, k, attn_mask=big),
                                  numkv.attention(q, k, k, attn_mask=mask))


def test_a_non_native_query_says_what_to_do():
    q = np.zeros((1, 1, 1, 4), ">f4")
    k = np.zeros((1, 1, 2, 4), np.float32)
    with pytest.raises(TypeError, match=r"Q has dtype >f4 in non-native byte order; pass Q.astype"):
        numkv.attention(q, k, k)


# --- what seq_lens' docstring promises ---------------------------------------------------


def test_seq_lens_as_nonpad_kv_seqlen_exactly_where_documented():
    """``seq_lens`` serves as ``nonpad_kv_seqlen`` with ``is_causal`` after an
    append without ``lengths``; after a padded one only ``attention_inputs()``
    is right (seq_lens shifts the diagonal and zeroes real queries)."""
    rng = np.random.default_rng(8)
    cache = StaticKVCache(2, 1, 16, 4)
    q = rng.standard_normal((2, 2, 3, 4)).astype(np.float32)
    k = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
    cache.append(k, k)
    keys, values = cache.get()
    right = numkv.attention(q, **cache.attention_inputs())
    np.testing.assert_allclose(numkv.attention(q, keys, values, nonpad_kv_seqlen=cache.seq_lens, is_causal=True),
                               right, rtol=1e-6, atol=1e-6)
    cache.append(k, k, lengths=np.array([3, 1]))  # row 1: one real token, two of padding
    keys, values = cache.get()
    right = numkv.attention(q, **cache.attention_inputs())
    naive = numkv.attention(q, keys, values, nonpad_kv_seqlen=cache.seq_lens, is_causal=True)
    np.testing.assert_allclose(naive[0], right[0], rtol=1e-6, atol=1e-6)  # the unpadded row agrees
    assert not np.allclose(naive[1, :, 0], right[1, :, 0])                # row 1's real query does not


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_appending_the_buffers_themselves(mode):
    """The whole buffers (arrays that own their memory) as key and value, crossed."""
    c = StaticKVCache(1, 1, 3, 2, mode=mode)
    c.key_buffer[...] = np.arange(6, dtype=np.float32).reshape(1, 1, 3, 2)
    c.value_buffer[...] = -np.arange(6, dtype=np.float32).reshape(1, 1, 3, 2)
    k0, v0 = c.key_buffer.copy(), c.value_buffer.copy()
    keys, values = c.append(c.value_buffer, c.key_buffer)
    np.testing.assert_array_equal(keys, v0)
    np.testing.assert_array_equal(values, k0)


def _zeros(*shape):
    return np.zeros(shape, np.float32)


ZERO_SIZE_WITH_INPUTS = {
    "q-seq-0-mask": dict(Q=_zeros(1, 2, 0, 4), K=_zeros(1, 2, 3, 4), V=_zeros(1, 2, 3, 4), attn_mask=_zeros(0, 3)),
    "empty-past-and-k": dict(Q=_zeros(1, 2, 2, 4), K=_zeros(1, 2, 0, 4), V=_zeros(1, 2, 0, 4),
                             past_key=_zeros(1, 2, 0, 4), past_value=_zeros(1, 2, 0, 4)),
    "batch-0-nonpad": dict(Q=_zeros(0, 2, 2, 4), K=_zeros(0, 2, 3, 4), V=_zeros(0, 2, 3, 4),
                           nonpad_kv_seqlen=np.zeros(0, np.int64)),
    "v-head-0": dict(Q=_zeros(1, 2, 2, 4), K=_zeros(1, 2, 3, 4), V=_zeros(1, 2, 3, 0)),
    "empty-k-empty-mask": dict(Q=_zeros(1, 2, 2, 4), K=_zeros(1, 2, 0, 4), V=_zeros(1, 2, 0, 4),
                               attn_mask=np.zeros((2, 0), bool)),
}


@pytest.mark.parametrize("case", ZERO_SIZE_WITH_INPUTS)
@pytest.mark.parametrize("mode", [0, 3])
def test_onnx_attention_on_zero_size_shapes_with_masks_and_pasts(case, mode):
    pytest.importorskip("onnx")
    import numkv.onnx

    inputs = ZERO_SIZE_WITH_INPUTS[case]
    y, present_key, present_value, scores = numkv.onnx.attention(**inputs, qk_matmul_output_mode=mode)
    np.testing.assert_array_equal(y, numkv.attention(**inputs))
    b, hq, sq, _ = inputs["Q"].shape
    past = inputs.get("past_key", _zeros(b, 2, 0, 4)).shape[2]
    total = past + inputs["K"].shape[2]
    assert present_key.shape == (b, 2, total, 4) and present_value.shape == (b, 2, total, inputs["V"].shape[3])
    assert scores.shape == (b, hq, sq, total)
