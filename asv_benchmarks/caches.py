"""The KV caches and the cached attention layer: one decode step each (a
quantised cache's append, and ``numkv.quantize`` itself, too), and the demo
decoder's throughput (tokens per second, a ``track_`` benchmark).

A decode step appends one token per batch row to a cache already holding
``PREFILL`` + 1 tokens (asv re-runs ``setup`` before each timed call, so every
call sees the same state); ``time_append_128`` times 128 steps in a row.  The
setup's untimed step has already grown a ``DynamicKVCache`` past the prompt, so
these are plain writes; ``time_fill_2048`` decodes 2048 tokens into a new, empty
cache, which includes every reallocation of a growing cache (its amortised cost).
"""

import timeit

import numpy as np

from ._common import QUICK, kv_formats, randn, require_attr

BATCH, KV_HEADS, HEAD_DIM, MAX_SEQ = 1, 8, 128, 4096
PREFILL = 2000
FILL = 2048


def _numkv(name):
    """A name of ``numkv.cache`` / ``numkv.layers`` (skip if not there yet)."""
    import importlib

    for module in ("numkv.cache", "numkv.layers"):
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise NotImplementedError(f"numkv has no {name} (yet)")


def _token(batch=BATCH, heads=KV_HEADS, head_dim=HEAD_DIM, n=1, seed=5):
    return randn((batch, heads, n, head_dim), np.float32, seed=seed)


def _make_cache(kind, mode="linear"):
    if kind == "static":
        return _numkv("StaticKVCache")(BATCH, KV_HEADS, MAX_SEQ, HEAD_DIM, dtype=np.float32, mode=mode)
    return _numkv("DynamicKVCache")()


class _Append:
    timer = timeit.default_timer
    steps = 128

    def _step(self):
        if self.cache.seq_len + self.steps >= MAX_SEQ:  # only if asv calls without re-running setup
            self.cache.reset()
        self.cache.append(self.key, self.value)

    def setup(self, *params):
        self._params = params
        self.key, self.value = _token(seed=7), _token(seed=8)
        self.cache = self._new_cache()
        prompt = _token(n=PREFILL, seed=6)
        self.cache.append(prompt, prompt)
        self._step()  # compile outside the timing (and grow a dynamic cache past the prompt)

    def time_append(self, *params):
        self._step()

    def time_append_128(self, *params):
        for _ in range(self.steps):
            self._step()

    def time_fill_2048(self, *params):
        cache = self._new_cache()
        for _ in range(FILL):
            cache.append(self.key, self.value)


class StaticKVCacheAppend(_Append):
    """``StaticKVCache(1, 8, 4096, 128).append`` of one token (an in-place
    ``tensor_scatter``); circular mode is the sliding-window cache."""

    params = ["linear", "circular"]
    param_names = ["mode"]

    def _new_cache(self):
        return _make_cache("static", self._params[0])


class QuantisedKVCacheAppend(_Append):
    """``StaticKVCache(1, 8, 4096, 128, dtype=...)``.append of one token,
    quantised on the way in (each block format: ``numkv._kernels.quantize``)."""

    params = kv_formats("BLOCK_FORMATS")
    param_names = ["dtype"]

    def _new_cache(self):
        return _numkv("StaticKVCache")(BATCH, KV_HEADS, MAX_SEQ, HEAD_DIM, dtype=self._params[0])


class Quantize:
    """``numkv.quantize`` of a prompt's keys, (1, 8, 2048, 128) float32, and of
    one token's, (1, 8, 1, 128): each block format."""

    params = kv_formats("BLOCK_FORMATS")
    param_names = ["format"]
    timer = timeit.default_timer

    def setup(self, fmt):
        import numkv

        self.quantize = require_attr(numkv, "quantize")
        self.prompt, self.token = _token(n=FILL, seed=12), _token(seed=13)
        self.quantize(self.token, fmt)  # compile outside the timing

    def time_prompt(self, fmt):
        self.quantize(self.prompt, fmt)

    def time_token(self, fmt):
        self.quantize(self.token, fmt)


class DynamicKVCacheAppend(_Append):
    """``DynamicKVCache().append`` of one token (1 batch row, 8 heads of 128)."""

    def _new_cache(self):
        return _make_cache("dynamic")


class CachedSelfAttentionStep:
    """``CachedSelfAttention(1024, 16, 4)`` on one new token, with a cache
    already holding 1024 tokens of the prompt."""

    params = ["static", "dynamic"]
    param_names = ["cache"]
    timer = timeit.default_timer
    embed_dim, num_heads, num_kv_heads, prompt_len = 1024, 16, 4, 1024

    def setup(self, kind):
        layer_cls = _numkv("CachedSelfAttention")
        self.layer = layer_cls(self.embed_dim, self.num_heads, self.num_kv_heads, seed=0)
        head_dim = self.embed_dim // self.num_heads
        if kind == "static":
            self.cache = _numkv("StaticKVCache")(1, self.num_kv_heads, MAX_SEQ, head_dim, dtype=np.float32)
        else:
            self.cache = _numkv("DynamicKVCache")()
        prompt = randn((1, self.prompt_len, self.embed_dim), np.float32, seed=9)
        self.layer(prompt, cache=self.cache, use_cache=True)
        self.x = randn((1, 1, self.embed_dim), np.float32, seed=10)
        self.time_one_token(kind)

    def time_one_token(self, kind):
        if self.cache.seq_len + 1 >= MAX_SEQ:  # only if asv calls without re-running setup
            self.cache.reset()
        self.layer(self.x, cache=self.cache, use_cache=True)


class DecoderThroughput:
    """The demo decoder (``numkv.layers.Decoder("small")``: 4 layers, 8:2 heads,
    embed 128) generating 32 tokens greedily for 2 prompts of 48 and 64 tokens,
    prefill included: tokens per second by cache kind ("none" recomputes the
    whole prefix at every step; "circular" keeps a 64-token window).  4 tokens
    with ``NUMKV_BENCH_QUICK=1``."""

    params = ["static", "dynamic", "circular", "none"]
    param_names = ["cache"]
    unit = "tokens/s"
    new_tokens = 4 if QUICK else 32
    window = 64

    def setup(self, kind):
        self.decoder = _numkv("Decoder")("small", seed=0)
        rng = np.random.default_rng(11)
        self.prompts = [rng.integers(0, self.decoder.vocab_size, n) for n in (48, 64)]
        self.kwargs = {"cache": None if kind == "none" else kind}
        if kind == "circular":
            self.kwargs["window"] = self.window
        self.decoder.generate(self.prompts, 2, **self.kwargs)  # compile outside the measurement

    def track_tokens_per_second(self, kind):
        start = timeit.default_timer()
        tokens, _ = self.decoder.generate(self.prompts, self.new_tokens, **self.kwargs)
        return tokens.size / (timeit.default_timer() - start)
