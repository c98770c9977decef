"""CachedSelfAttention and the demo decoder: cached decoding == recomputation.

* the layer, MHA and GQA, with each cache kind: a ragged batch (one row with
  an empty prompt) prefilled right-padded, then decoded token by token, equals
  running the layer on each row's whole sequence without a cache;
* chunked prefill (several chunk sizes) equals one-shot prefill;
* a circular cache equals sliding-window attention over absolute positions
  (``left_window_size``), single-token and wrapping multi-token chunks;
* one case against an independent float64 layer built on onnx.reference;
* the decoder's greedy generation agrees across cache kinds, a bfloat16
  cache drifts a little, and ``python -m numkv demo`` passes its own check
  at a tiny size;
* every option of the decoder and ``generate`` (window, dtype, prefill_chunk,
  slots) is honoured on every path and cache kind, or refused, and bad
  arguments of the layer and the decoder are errors naming the argument
  (issue 32);
* quantised caches (issue 28): the layer over a q8_0 / q4_0 StaticKVCache
  (linear, and a wrapping ring) equals it over a float32 cache of the
  dequantised values, and stays within a bound derived from the step; the
  decoder with a q8_0 cache gives the float32 cache's tokens (logits within a
  budget from the step), q4_0's agreement and drift are reported; quantised
  dtypes are refused where they cannot go (a DynamicKVCache, a head size 32
  does not divide), naming the argument.
"""

import ml_dtypes
import numpy as np
import pytest

import numkv
import oracle
from conftest import KINDS
from numkv.cache import DynamicKVCache, StaticKVCache
from numkv.layers import CachedSelfAttention, Decoder, rope

E = 32
TOL = dict(rtol=2e-5, atol=2e-5)
HEADS = [pytest.param(4, 4, id="mha-Hq4-Hkv4"), pytest.param(4, 2, id="gqa-Hq4-Hkv2")]
PROMPTS = np.array([5, 0, 3])  # a ragged batch with an empty row
STEPS = 4


def make_cache(layer, kind, batch, capacity=16, window=None):
    if kind == "dynamic":
        return DynamicKVCache()
    mode = "circular" if kind == "circular" else "linear"
    return StaticKVCache(batch, layer.num_kv_heads, capacity, layer.head_dim, mode=mode, window=window)


def row_reference(layer, seq, window=None):
    """The layer on one row's whole sequence, no cache: (n, E)."""
    if seq.shape[0] == 0:
        return np.zeros((0, E), np.float32)
    return layer(seq[None], window=window)[0]


def ragged_decode(layer, cache, prompt_x, lengths, steps_x, chunk=None):
    """Prefill a right-padded batch (optionally in chunks), then decode; returns
    per row the outputs of its real tokens, in order."""
    batch, longest = prompt_x.shape[:2]
    outs = [[] for _ in range(batch)]
    chunk = chunk or max(longest, 1)
    for c0 in range(0, longest, chunk):
        part = np.clip(lengths - c0, 0, min(chunk, longest - c0))
        y = layer(prompt_x[:, c0:c0 + chunk], cache, True, lengths=part)
        for b in range(batch):
            outs[b].append(y[b, :part[b]])
    for t in range(steps_x.shape[1]):
        y = layer(steps_x[:, t:t + 1], cache, True)
        for b in range(batch):
            outs[b].append(y[b])
    return [np.concatenate(o) for o in outs]


def row_sequences(prompt_x, lengths, steps_x):
    return [np.concatenate([prompt_x[b, :lengths[b]], steps_x[b]]) for b in range(len(lengths))]


@pytest.fixture
def inputs(rng):
    prompt_x = rng.standard_normal((len(PROMPTS), PROMPTS.max(), E)).astype(np.float32)
    steps_x = rng.standard_normal((len(PROMPTS), STEPS, E)).astype(np.float32)
    return prompt_x, steps_x


@pytest.mark.parametrize("kind", ["dynamic", "static", "circular"])
@pytest.mark.parametrize("hq, hkv", HEADS)
def test_decode_equals_recompute(inputs, kind, hq, hkv):
    """Token-by-token decoding of a ragged batch == the whole prefix without a
    cache (a circular cache whose window covers everything included)."""
    prompt_x, steps_x = inputs
    layer = CachedSelfAttention(E, hq, hkv, seed=1, rope_base=10000.0)
    cache = make_cache(layer, kind, len(PROMPTS), capacity=16, window=16 if kind == "circular" else None)
    got = ragged_decode(layer, cache, prompt_x, PROMPTS, steps_x)
    assert cache.seq_lens.tolist() == (PROMPTS + STEPS).tolist()
    for b, seq in enumerate(row_sequences(prompt_x, PROMPTS, steps_x)):
        np.testing.assert_allclose(got[b], row_reference(layer, seq), **TOL)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_chunked_prefill_equals_one_shot(inputs, kind, chunk):
    prompt_x, steps_x = inputs
    layer = CachedSelfAttention(E, 4, 2, seed=2, rope_base=10000.0)
    one_shot = ragged_decode(layer, make_cache(layer, kind, 3), prompt_x, PROMPTS, steps_x)
    chunked = ragged_decode(layer, make_cache(layer, kind, 3), prompt_x, PROMPTS, steps_x, chunk=chunk)
    for a, b in zip(chunked, one_shot):
        np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize("capacity, window, chunk", [
    (4, 4, 1),      # ring == window: one token at a time (the layer splits)
    (6, 3, None),   # prompts prefilled in chunks of max_chunk = 4, wrapping
    (7, 3, 2),
], ids=["C4-W4", "C6-W3-auto-chunks", "C7-W3-chunk2"])
@pytest.mark.parametrize("hq, hkv", HEADS)
def test_circular_equals_sliding_window(rng, capacity, window, chunk, hq, hkv):
    lengths = np.array([9, 0, 6])
    prompt_x = rng.standard_normal((3, 9, E)).astype(np.float32)
    steps_x = rng.standard_normal((3, 6, E)).astype(np.float32)
    layer = CachedSelfAttention(E, hq, hkv, seed=3, rope_base=10000.0)
    cache = make_cache(layer, "circular", 3, capacity=capacity, window=window)
    got = ragged_decode(layer, cache, prompt_x, lengths, steps_x, chunk=chunk)
    for b, seq in enumerate(row_sequences(prompt_x, lengths, steps_x)):
        np.testing.assert_allclose(got[b], row_reference(layer, seq, window=window), **TOL)


def _layer64(layer, x, window=None):
    """An independent float64 CachedSelfAttention over onnx.reference's op."""
    x = x.astype(np.float64)
    b, s, _ = x.shape

    def split(w, heads):
        return (x @ w.astype(np.float64)).reshape(b, s, heads, layer.head_dim).transpose(0, 2, 1, 3)

    pos = np.broadcast_to(np.arange(s), (b, s))
    q = rope(split(layer.w_q, layer.num_heads), pos)
    k = rope(split(layer.w_k, layer.num_kv_heads), pos)
    v = split(layer.w_v, layer.num_kv_heads)
    extra = {} if window is None else {"left_window_size": window - 1}
    y = oracle.attention(q, k, v, is_causal=True, **extra)[0]
    return y.transpose(0, 2, 1, 3).reshape(b, s, -1) @ layer.w_o.astype(np.float64)


@pytest.mark.parametrize("window", [None, 3])
def test_layer_against_float64_oracle(rng, window):
    layer = CachedSelfAttention(E, 4, 2, seed=4, rope_base=10000.0)
    x = rng.standard_normal((2, 11, E)).astype(np.float32)
    np.testing.assert_allclose(layer(x, window=window), _layer64(layer, x, window), rtol=1e-4, atol=1e-4)


def test_low_precision_cache_is_close(inputs):
    prompt_x, steps_x = inputs
    layer = CachedSelfAttention(E, 4, 2, seed=5)
    exact = ragged_decode(layer, make_cache(layer, "static", 3), prompt_x, PROMPTS, steps_x)
    cache = StaticKVCache(3, 2, 16, layer.head_dim, dtype=ml_dtypes.bfloat16)
    rough = ragged_decode(layer, cache, prompt_x, PROMPTS, steps_x)
    assert cache.key_buffer.dtype == ml_dtypes.bfloat16
    for a, b in zip(rough, exact):
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05)


def test_layer_errors(rng):
    layer = CachedSelfAttention(E, 4, 2)
    x = rng.standard_normal((2, 3, E)).astype(np.float32)
    with pytest.raises(ValueError, match="use_cache=True needs a cache"):
        layer(x, use_cache=True)
    with pytest.raises(ValueError, match="shape"):
        layer(x[..., :8])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        CachedSelfAttention(E, 4, 3)
    ring = make_cache(layer, "circular", 2, capacity=8, window=4)
    with pytest.raises(ValueError, match="differs from the circular cache's window 4"):
        layer(x, ring, True, window=3)
    static = make_cache(layer, "static", 2, capacity=4)
    layer(x, static, True)
    with pytest.raises(ValueError, match="overflow"):
        layer(x, static, True)
    assert static.seq_lens.tolist() == [3, 3]
    y = layer(x, None, False)  # no cache: plain causal attention
    assert y.shape == x.shape and y.dtype == np.float32


# --- the decoder -------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder():
    return Decoder("tiny", seed=0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, n) for n in (7, 2, 5)]


@pytest.fixture(scope="module")
def recomputed(decoder, prompts):
    return decoder.generate(prompts, 5)


@pytest.mark.parametrize("kwargs", [
    dict(cache="dynamic"), dict(cache="static"), dict(cache="static", prefill_chunk=3),
    dict(cache="dynamic", prefill_chunk=2), dict(cache="circular", window=64),
], ids=["dynamic", "static", "static-chunk3", "dynamic-chunk2", "circular-wide"])
def test_generate_agrees(decoder, prompts, recomputed, kwargs):
    tokens, logits = decoder.generate(prompts, 5, **kwargs)
    np.testing.assert_array_equal(tokens, recomputed[0])
    np.testing.assert_allclose(logits, recomputed[1], rtol=1e-4, atol=1e-3)


def test_generate_circular_equals_windowed(decoder, prompts):
    windowed = decoder.generate(prompts, 6, window=3)
    tokens, logits = decoder.generate(prompts, 6, cache="circular", window=3, slots=5)
    np.testing.assert_array_equal(tokens, windowed[0])
    np.testing.assert_allclose(logits, windowed[1], rtol=1e-4, atol=1e-3)


def test_generate_bfloat16_drift(decoder, prompts, recomputed):
    _, logits = decoder.generate(prompts, 1, cache="static", dtype=ml_dtypes.bfloat16)
    scale = np.abs(recomputed[1][:, 0]).max()
    assert np.abs(logits[:, 0] - recomputed[1][:, 0]).max() < 0.05 * scale


def test_generate_rejects_empty_prompt(decoder):
    with pytest.raises(ValueError, match="at least one token"):
        decoder.generate([np.array([1, 2]), np.array([], int)], 2)


def test_demo_runs_and_agrees(capsys):
    from numkv.__main__ import main

    assert main(["demo", "--size", "tiny", "--batch", "2", "--prompt-len", "6",
                 "--new-tokens", "3", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "all cached runs agree" in out and "MISMATCH" not in out
    for label in ("(a)", "(b) DynamicKVCache", "(c)", "(d) StaticKVCache bfloat16", "(e) circular"):
        assert label in out


def test_demo_fails_on_disagreement(monkeypatch, capsys):
    """A cache run whose logits drift must make the demo exit non-zero."""
    from numkv.__main__ import main

    real = Decoder.generate

    def spoiled(self, prompts, new_tokens, **kwargs):
        tokens, logits = real(self, prompts, new_tokens, **kwargs)
        if kwargs.get("cache") == "dynamic":
            logits = logits + 0.5
        return tokens, logits

    monkeypatch.setattr(Decoder, "generate", spoiled)
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--size", "tiny", "--batch", "2", "--prompt-len", "4", "--new-tokens", "2"])
    assert exc.value.code == 1
    assert "MISMATCH vs (a): logits differ" in capsys.readouterr().out


def test_demo_tolerates_near_ties_only():
    from numkv._cli.demo import _compare

    ref_logits = np.zeros((1, 3, 4), np.float32)
    ref_logits[0, :, 1] = 5.0
    ref_logits[0, 1, 2] = 5.0 - 1e-6  # a near-tie at step 1
    ref_tokens = np.array([[1, 1, 1]])
    ok, note, _, _ = _compare(np.array([[1, 2, 0]]), ref_logits.copy(), ref_tokens, ref_logits)
    assert ok and "near-ties at row 0 step 1" in note
    ok, note, _, _ = _compare(np.array([[3, 1, 1]]), ref_logits.copy(), ref_tokens, ref_logits)
    assert not ok and "tokens differ (row 0, step 0)" in note


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_linear_cache_with_window_equals_sliding_window(inputs, kind):
    """A linear cache keeps everything; ``window`` limits what is attended."""
    prompt_x, steps_x = inputs
    layer = CachedSelfAttention(E, 4, 2, seed=6, rope_base=10000.0)
    cache = make_cache(layer, kind, 3)
    outs = [[] for _ in range(3)]
    y = layer(prompt_x, cache, True, lengths=PROMPTS, window=3)
    for b in range(3):
        outs[b].append(y[b, :PROMPTS[b]])
    for t in range(STEPS):
        y = layer(steps_x[:, t:t + 1], cache, True, window=3)
        for b in range(3):
            outs[b].append(y[b])
    for b, seq in enumerate(row_sequences(prompt_x, PROMPTS, steps_x)):
        np.testing.assert_allclose(np.concatenate(outs[b]), row_reference(layer, seq, window=3), **TOL)


# -- a layer over a cache of every kind fed its own buffers (issue 32) --


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


# -- every option of the decoder and generate, on every path, or refused (issue 32) --


TOKEN_PROMPTS = [np.arange(1, 9), np.arange(20, 31)]


def test_generate_honours_window_with_linear_caches(decoder):
    """Issue 32.2: cache="dynamic" | "static" ignored ``window``."""
    ref = decoder.generate(TOKEN_PROMPTS, 4, window=3)[0]
    assert ref.tolist() == [[234, 226, 4, 189], [177, 148, 156, 95]]
    for kind in ("dynamic", "static"):
        np.testing.assert_array_equal(decoder.generate(TOKEN_PROMPTS, 4, cache=kind, window=3)[0], ref)


@pytest.fixture(scope="module")
def uncached(decoder):
    return {w: decoder.generate(TOKEN_PROMPTS, 4, window=w) for w in (None, 2, 5)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 2, 5])
@pytest.mark.parametrize("prefill_chunk", [None, 1, 3])
def test_every_option_through_every_cache_kind(decoder, uncached, kind, window, prefill_chunk):
    if kind == "circular" and window is None:
        pytest.skip("a circular cache needs a window")
    tokens, logits = decoder.generate(TOKEN_PROMPTS, 4, cache=kind, window=window, prefill_chunk=prefill_chunk)
    np.testing.assert_array_equal(tokens, uncached[window][0])
    np.testing.assert_allclose(logits, uncached[window][1], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_honours_the_cache_dtype(decoder, uncached, kind):
    """``dtype`` reaches every cache kind (a DynamicKVCache took float32)."""
    window = 5 if kind == "circular" else None
    exact = decoder.generate(TOKEN_PROMPTS, 4, cache=kind, window=window)[1]
    low = decoder.generate(TOKEN_PROMPTS, 4, cache=kind, window=window, dtype=np.float16)[1]
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
        decoder.generate(TOKEN_PROMPTS, 2, **kwargs)


# -- arguments checked up front, named in the error (issue 32) --


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
    (lambda: Decoder("tiny").generate(TOKEN_PROMPTS, 2, cache="static", prefill_chunk=-1), ValueError,
     "prefill_chunk must be >= 1"),
    (lambda: Decoder("tiny").generate(TOKEN_PROMPTS, 2, cache="static", prefill_chunk=0), ValueError,
     "prefill_chunk must be >= 1"),
    (lambda: Decoder("tiny").generate(TOKEN_PROMPTS, -1), ValueError, "new_tokens must be >= 0"),
    (lambda: Decoder("tiny").generate(TOKEN_PROMPTS, 2.5), TypeError, "new_tokens must be an integer"),
    (lambda: Decoder("tiny").generate(TOKEN_PROMPTS, 2, window="3"), TypeError, "window must be an integer"),
    (lambda: Decoder("tiny").generate(TOKEN_PROMPTS, 2, progress=3), TypeError, "progress must be callable"),
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
        tokens, logits = decoder.generate(TOKEN_PROMPTS, 0, cache=kind)
        assert tokens.shape == (2, 0) and logits.shape == (2, 0, decoder.vocab_size)


# -- a zero-length input; generate's cache argument --


def test_layer_zero_length_input():
    y = CachedSelfAttention(16, 2)(np.zeros((2, 0, 16), np.float32))
    assert y.shape == (2, 0, 16)


def test_generate_says_it_takes_the_kind_of_cache():
    decoder = Decoder("tiny")
    with pytest.raises(TypeError, match=r"cache names the kind .*'dynamic', 'static', 'circular'"
                                        r".*got DynamicKVCache\(empty"):
        decoder.generate([np.array([1, 2])], 2, cache=numkv.DynamicKVCache())
    with pytest.raises(ValueError, match="cache must be None or one of 'dynamic', 'static', 'circular', got 'Static'"):
        decoder.generate([np.array([1, 2])], 2, cache="Static")


# -- quantised caches (issue 28): q8_0 / q4_0 StaticKVCaches under the layer and the decoder --


class DequantisingCache(StaticKVCache):
    """A float32 StaticKVCache that stores what a ``fmt`` cache would hold:
    each append's keys and values quantised (each token's blocks on their
    own) and dequantised."""

    def __init__(self, fmt, *args, v_fmt=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fmt, self.v_fmt = fmt, v_fmt or fmt

    def append(self, key, value, lengths=None):
        return super().append(numkv.quantize(key, self.fmt).dequantize(),
                              numkv.quantize(value, self.v_fmt).dequantize(), lengths)


QUANT_KINDS = [pytest.param("linear", None, 16, id="static"),
               pytest.param("circular", 3, 6, id="circular-C6-W3")]  # the ring wraps


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("mode, window, capacity", QUANT_KINDS)
def test_quantised_cache_equals_a_float_cache_of_its_values(inputs, fmt, mode, window, capacity):
    """The layer over a q8_0 / q4_0 cache (quantised on append, read in
    place) == the layer over a float32 cache holding the dequantised keys
    and values, to float32 rounding: the layer hands the cache its float32
    keys and attends what the cache holds, nothing else."""
    prompt_x, steps_x = inputs
    layer = CachedSelfAttention(E, 4, 2, seed=7, head_dim=32, rope_base=10000.0)
    cache = layer.new_cache(3, capacity, dtype=fmt, mode=mode, window=window)
    assert cache.dtype == fmt and type(cache.get()[0]) is numkv.QuantizedArray
    got = ragged_decode(layer, cache, prompt_x, PROMPTS, steps_x)
    ref = ragged_decode(layer, DequantisingCache(fmt, 3, 2, capacity, 32, mode=mode, window=window),
                        prompt_x, PROMPTS, steps_x)
    assert cache.seq_lens.tolist() == (PROMPTS + STEPS).tolist()
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, **TOL)


# (q4_1: its step is the block's spread, at most twice amax, over 15)
@pytest.mark.parametrize("fmt, qmax", [("q8_0", 127), ("q4_0", 7), ("q4_1", 7)])
def test_quantised_cache_within_the_bound_its_step_gives(inputs, fmt, qmax):
    """The layer's output over a quantised cache against the float32 cache's,
    within a bound derived from the quantisation step alone.

    Every stored key / value element is within half a step of its value
    (API.md), the step at most ``amax / qmax`` (rounded up to float16: x
    (1 + 2**-10), one more float16 step at most), so ``|dk|, |dv| <= h =
    max|x| / (2 qmax) * (1 + 2**-9)``.  For one query row, each score
    ``scale * q.k_j`` moves by at most ``eps = scale * ||q||_1 * h_K``, so
    each softmax weight by a factor within ``exp(+-2 eps)`` and ``sum_j
    p_j v_j`` by at most ``h_V + (exp(2 eps) - 1) max|v|``; the output
    projection multiplies that by at most ``max_e sum_i |w_o[i, e]|``.
    Plus float32 rounding (1e-5 of the output scale).  Holds for q4_0 too,
    where it is loose."""
    prompt_x, steps_x = inputs
    layer = CachedSelfAttention(E, 4, 2, seed=8, head_dim=32)  # no rope: q, k, v are the projections
    exact = ragged_decode(layer, layer.new_cache(3, 16), prompt_x, PROMPTS, steps_x)
    rough = ragged_decode(layer, layer.new_cache(3, 16, dtype=fmt), prompt_x, PROMPTS, steps_x)
    x = np.concatenate(row_sequences(prompt_x, PROMPTS, steps_x))          # every real token
    q = (x @ layer.w_q).reshape(len(x), layer.num_heads, 32)
    k, v = x @ layer.w_k, x @ layer.w_v
    h_k, h_v = (np.abs(a).max() / (2 * qmax) * (1 + 2.0 ** -9) for a in (k, v))
    eps = np.abs(q).sum(axis=-1).max() / np.sqrt(32) * h_k
    d_attn = h_v + np.expm1(2 * eps) * np.abs(v).max()
    d_out = d_attn * np.abs(layer.w_o).sum(axis=0).max()
    worst = max(np.abs(a - b).max() for a, b in zip(rough, exact))
    scale = max(np.abs(b).max() for b in exact)
    assert worst <= d_out + 1e-5 * scale, (worst, d_out)
    assert worst > 0  # the cache did quantise
    print(f"{fmt}: max |dy| {worst:.3g}, bound {d_out:.3g}, |y| <= {scale:.3g}")


QUANT_DECODER = dict(num_heads=2, num_kv_heads=1)  # "tiny" with a head size of 32 (the presets' tiny has 16)


@pytest.fixture(scope="module")
def quant_decoder():
    return Decoder("tiny", seed=0, **QUANT_DECODER)


@pytest.fixture(scope="module")
def quant_prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, n) for n in (12, 7, 16)]


@pytest.fixture(scope="module")
def float_cached(quant_decoder, quant_prompts):
    return quant_decoder.generate(quant_prompts, 8, cache="static")


def _budget(decoder, qmax):
    """A first-order budget for the logits' drift, as a fraction of the
    logit scale: each layer's keys and values each move by at most half a
    step, ``1 / (2 qmax)`` of their block's largest magnitude, and each of
    the two perturbs that layer's attention output, through a weighted
    average, by about that fraction of its scale; the residual stream adds
    the layers' shares: ``2 L / (2 qmax)``.  q8_0, L = 2: 1.6% (measured
    0.9% over 4 x 32 tokens, 0.6% at the 'base' preset's six layers)."""
    return 2 * decoder.config["num_layers"] / (2 * qmax)


@pytest.mark.parametrize("kind", ["static", "circular"])
def test_generate_q8_0_gives_the_float32_caches_tokens(quant_decoder, quant_prompts, float_cached, kind):
    """Issue 28's acceptance, on a small model: a q8_0 cache decodes the
    float32 cache's tokens, its logits within the budget its step gives
    (``_budget``; q4_0's drift, 18x the step, lies well beyond it)."""
    window = 64 if kind == "circular" else None  # the ring holds everything: == the linear cache
    tokens, logits = quant_decoder.generate(quant_prompts, 8, cache=kind, dtype="q8_0", window=window)
    np.testing.assert_array_equal(tokens, float_cached[0])
    scale = np.abs(float_cached[1]).max()
    drift = np.abs(logits - float_cached[1]).max()
    assert 0 < drift <= _budget(quant_decoder, 127) * scale, (drift, scale)


def test_generate_q4_0_drift_is_reported(quant_decoder, quant_prompts, float_cached, capsys):
    """q4_0 (7 steps each side of zero) may change tokens: its agreement and
    drift are reported, and the drift of the first token's logits (always
    comparable) stays within q4_0's own budget."""
    tokens, logits = quant_decoder.generate(quant_prompts, 8, cache="static", dtype="q4_0")
    scale = np.abs(float_cached[1]).max()
    first = np.abs(logits[:, 0] - float_cached[1][:, 0]).max()
    assert 0 < first <= _budget(quant_decoder, 7) * scale, (first, scale)
    q8 = quant_decoder.generate(quant_prompts, 1, cache="static", dtype="q8_0")[1]
    assert np.abs(q8[:, 0] - float_cached[1][:, 0]).max() < first  # the coarser step drifts further
    with capsys.disabled():
        print(f"\nq4_0 cache: {np.mean(tokens == float_cached[0]):.0%} of tokens equal to the float32 "
              f"cache's, first-token max |dlogit| {first:.3g} = {first / scale:.1%} of max |logit| {scale:.3g}")


@pytest.mark.parametrize("call, error, match", [
    (lambda: Decoder("tiny", **QUANT_DECODER).new_caches("dynamic", 2, dtype="q8_0"), ValueError,
     "dtype 'q8_0' is a quantised format, which only a StaticKVCache holds: use cache kind 'static'"),
    (lambda: Decoder("tiny", **QUANT_DECODER).generate(TOKEN_PROMPTS, 2, cache="dynamic", dtype="q4_0"),
     ValueError, "dtype 'q4_0' is a quantised format"),
    (lambda: Decoder("tiny", **QUANT_DECODER).generate(TOKEN_PROMPTS, 2, dtype="q8_0"), ValueError,
     "dtype is the caches' dtype: it needs cache=..., got dtype q8_0"),
    (lambda: Decoder("tiny").generate(TOKEN_PROMPTS, 2, cache="static", dtype="q8_0"), ValueError,
     r"head_dim 16 \(embed_dim 64 / num_heads 4\) is not a multiple of 32"),
    (lambda: Decoder("tiny").new_caches("circular", 2, window=4, dtype="q4_0"), ValueError,
     "head_dim 16"),
    (lambda: CachedSelfAttention(64, 2).new_cache(1, dtype="q8_0"), ValueError,
     "only a StaticKVCache holds: pass max_seq_len"),
    (lambda: CachedSelfAttention(64, 4).new_cache(1, 8, dtype="q4_0"), ValueError,
     "head_dim 16 is not a multiple of 32"),
    (lambda: CachedSelfAttention(64, 4, head_dim=48).new_cache(1, 8, dtype="q8_0"), ValueError,
     "head_dim 48 is not a multiple of 32"),
    (lambda: Decoder("tiny", **QUANT_DECODER).generate(TOKEN_PROMPTS, 2, cache="static", dtype="q5_0"),
     TypeError, "dtype 'q5_0'"),
    (lambda: Decoder("tiny", **QUANT_DECODER).generate(TOKEN_PROMPTS, 2, cache="static", v_dtype="q5_0"),
     TypeError, "v_dtype 'q5_0'"),
    (lambda: Decoder("tiny", **QUANT_DECODER).generate(TOKEN_PROMPTS, 2, v_dtype="q4_0"), ValueError,
     "v_dtype is the caches' values' dtype: it needs cache=..."),
    (lambda: Decoder("tiny", **QUANT_DECODER).generate(TOKEN_PROMPTS, 2, cache="dynamic", v_dtype="q4_0"),
     ValueError, "v_dtype gives the values a format of their own"),
    (lambda: Decoder("tiny").new_caches("static", 2, 8, dtype="q8_0", v_dtype="q4_1"), ValueError,
     "dtype 'q8_0' quantises blocks of 32"),
    (lambda: CachedSelfAttention(64, 4).new_cache(1, 8, v_dtype="q4_1"), ValueError,
     "v_dtype 'q4_1' quantises blocks of 32 along the head: head_dim 16"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_quantised_dtypes_refused_where_they_cannot_go(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("fmt, v_fmt", [("q8_0", "q4_0"), ("q4_0", "q8_0"), ("q4_1", "q4_0")])
@pytest.mark.parametrize("mode, window, capacity", QUANT_KINDS)
def test_separate_k_and_v_formats_equal_a_float_cache_of_their_values(inputs, fmt, v_fmt, mode, window, capacity):
    """``new_cache(dtype=fmt, v_dtype=v_fmt)``: keys in one format, values in
    another (llama.cpp's -ctk / -ctv) == a float32 cache holding each one's
    dequantised values, to float32 rounding."""
    prompt_x, steps_x = inputs
    layer = CachedSelfAttention(E, 4, 2, seed=7, head_dim=32, rope_base=10000.0)
    cache = layer.new_cache(3, capacity, dtype=fmt, v_dtype=v_fmt, mode=mode, window=window)
    assert cache.dtype == fmt and cache.v_dtype == v_fmt
    got = ragged_decode(layer, cache, prompt_x, PROMPTS, steps_x)
    ref = ragged_decode(layer, DequantisingCache(fmt, 3, 2, capacity, 32, v_fmt=v_fmt, mode=mode, window=window),
                        prompt_x, PROMPTS, steps_x)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, **TOL)
    # and not the cache of one format for both (the values' format matters)
    same = ragged_decode(layer, DequantisingCache(fmt, 3, 2, capacity, 32, mode=mode, window=window),
                         prompt_x, PROMPTS, steps_x)
    assert any(not np.allclose(a, b, **TOL) for a, b in zip(got, same))


def test_a_refused_quantised_dtype_computes_nothing(quant_decoder, monkeypatch):
    """The dtype is checked before any layer runs (no prefill thrown away)."""
    monkeypatch.setattr(Decoder, "__call__", lambda *a, **k: pytest.fail("the decoder ran"))
    with pytest.raises(ValueError, match="quantised format"):
        quant_decoder.generate(TOKEN_PROMPTS, 2, cache="dynamic", dtype="q8_0")
