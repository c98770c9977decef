"""``CachedSelfAttention`` and a small Llama-style decoder, in NumPy with
``numkv.attention`` doing the attention (and ``numkv.tensor_scatter`` the cache
writes, through ``numkv.cache``).

Shapes: ``x`` is ``(B, S, E)``; inside the layer queries are ``(B, Hq, S, D)``
and keys / values ``(B, Hkv, S, D)`` strided views of the projections (never
copied: ``numkv.attention`` and ``tensor_scatter`` read strided views in place);
GQA when ``Hkv < Hq`` (``Hq % Hkv == 0``), which the attention kernel maps by
index, so K/V are never repeated.

The weights are seeded random float32 arrays: these models exist to exercise
and time the caches (``python -m numkv demo``), not to say anything sensible.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ._dtypes import is_attention_dtype, is_float8_dtype, is_integer_dtype
from ._quantize import BLOCK
from ._validate import as_array, as_count, as_flag, as_float, index_vector
from .cache import QUANTIZED_DTYPES, DynamicKVCache, StaticKVCache, _CacheBase

if TYPE_CHECKING:  # annotations only: numpy.typing is not imported at run time
    from numpy.typing import DTypeLike


def _attention(Q, K, V, **kwargs):
    # Imported on use: numkv.attention's module compiles nothing at import,
    # but importing it here lazily keeps ``import numkv.layers`` light.
    from ._attention import attention

    return attention(Q, K, V, **kwargs)


def _window(window):
    """``window``: None or an integer >= 1."""
    return None if window is None else as_count(window, "window", 1)


def _seed(seed):
    """A seed for ``numpy.random.default_rng``: an integer >= 0."""
    return as_count(seed, "seed", 0)


def _lengths(lengths, batch, new):
    """``lengths`` as int64 ``(B,)`` in ``[0, S]``, or None."""
    return None if lengths is None else index_vector(lengths, "lengths", batch, new)


def _kv_format(dtype):
    """The quantised format ``dtype`` names (one of ``QUANTIZED_DTYPES``: a
    ``StaticKVCache`` quantises on append), or None for a NumPy dtype."""
    return dtype if isinstance(dtype, str) and dtype in QUANTIZED_DTYPES else None


def _check_kv_format(dtype, dynamic, head_dim, dynamic_hint, head_hint="", advice="", v_dtype=None):
    """A quantised ``dtype`` (or ``v_dtype``) must go to a ``StaticKVCache``
    (``dynamic``: the caller would make a ``DynamicKVCache``, which grows by
    copying and holds one NumPy dtype) whose head size its block of 32
    divides.  Checked here, before anything is computed or written, so that
    the error names the caller's arguments (the hints say which)."""
    if dynamic and v_dtype is not None:
        raise ValueError(f"v_dtype gives the values a format of their own, which only a StaticKVCache "
                         f"holds: {dynamic_hint}")
    for name, held in (("dtype", dtype), ("v_dtype", v_dtype)):
        fmt = _kv_format(held)
        if fmt is None:
            continue
        if dynamic:
            raise ValueError(f"{name} {fmt!r} is a quantised format, which only a StaticKVCache holds: "
                             f"{dynamic_hint}")
        if head_dim % BLOCK:
            raise ValueError(f"{name} {fmt!r} quantises blocks of {BLOCK} along the head: head_dim {head_dim}"
                             f"{head_hint} is not a multiple of {BLOCK}{advice}")


def _cast(x, dtype):
    """Cast keys/values to a cache's dtype.  Saturate for float8 types, whose
    casts turn out-of-range values into NaN rather than the largest finite."""
    if x.dtype == dtype:
        return x
    if is_float8_dtype(dtype):
        import ml_dtypes

        top = float(ml_dtypes.finfo(dtype).max)
        x = np.clip(x, -top, top)
    return x.astype(dtype)


def rope(x, positions, base=10000.0):
    """Rotary position embedding (the "rotate half" layout of Llama).

    ``x`` ``(B, H, S, D)``, ``positions`` ``(B, S)`` absolute positions per row,
    so rows of a ragged batch each rotate by their own positions.  Angles in
    float64: position x frequency loses digits in float32 at long contexts.
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) / half)
    angle = positions[:, None, :, None] * inv_freq                   # (B, 1, S, D/2)
    cos, sin = np.cos(angle).astype(x.dtype), np.sin(angle).astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _dense(x, w):
    """``x @ w`` over the last axis as one 2-D GEMM: numpy's stacked (3-D)
    matmul runs 5-10x slower here (measured 20-55 ms against 3.9 ms for
    (4, 96, 128) @ (128, 352), numpy 2.4 / OpenBLAS, 2 cores)."""
    lead = x.shape[:-1]
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(lead + (w.shape[1],))


def _init(rng, fan_in, fan_out, scale=1.0):
    return (rng.standard_normal((fan_in, fan_out)) * (scale / math.sqrt(fan_in))).astype(np.float32)


class CachedSelfAttention:
    """Causal multi-head self-attention with an optional KV cache.

    Holds float32 seeded random weights ``w_q (E, Hq*D)``, ``w_k``/``w_v
    (E, Hkv*D)`` and ``w_o (Hq*D, E)``.

    Parameters
    ----------
    embed_dim : int
        ``E``, the size of each token's vector (>= 1).
    num_heads : int
        Query heads ``Hq`` (>= 1).
    num_kv_heads : int, optional
        Key/value heads ``Hkv`` (GQA/MQA when fewer than ``Hq``; ``Hq`` must
        be a multiple).  Default ``num_heads``.
    seed : int, default 0
        Seed of the weights (>= 0).
    head_dim : int, optional
        ``D``; default ``embed_dim // num_heads`` (which must divide).
    rope_base : float, optional
        Turns on rotary position embedding of queries and keys with this
        base (positive; ``D`` must be even).

    Notes
    -----
    ``layer(x, cache=None, use_cache=False, *, lengths=None, window=None)``
    maps ``x`` ``(B, S, E)`` to ``y`` of the same shape (float32):

    * without a cache, causal attention over ``x`` itself
      (``numkv.attention(..., is_causal=True)``);
    * with ``use_cache=True``, the new keys/values are appended to ``cache`` (a
      ``DynamicKVCache`` or ``StaticKVCache``, any float dtype: keys/values are
      cast to it here, explicitly; or a ``StaticKVCache`` of a quantised format
      (``numkv.quantize``'s block formats), which quantises the float32 keys/values itself
      and is read in place) and the queries attend everything cached
      with the offset causal mask: query ``i`` of row ``b`` sits at absolute
      position ``seq_lens[b] + i``.  Multi-token inputs (chunked prefill) and
      ragged rows work; a circular cache's window applies, and inputs longer
      than its ``max_chunk`` are split into chunks.

    ``lengths`` ``(B,)``: real tokens per row of a right-padded ``x`` (the
    cache counts only those; outputs at padding positions are meaningless).
    ``window``: attend only the last ``window`` positions (sliding-window
    attention, on every path; must match a circular cache's own window).
    A cache given with ``use_cache=False`` is refused rather than ignored.

    Examples
    --------
    >>> import numpy as np, numkv
    >>> layer = numkv.CachedSelfAttention(64, 8, 2)           # E=64, 8 query heads, 2 kv heads
    >>> cache = layer.new_cache(batch_size=1, max_seq_len=32)
    >>> x = np.ones((1, 5, 64), np.float32)
    >>> y = layer(x, cache, use_cache=True)                      # prefill 5 tokens
    >>> y = layer(x[:, -1:], cache, use_cache=True)              # one decode step
    >>> y.shape, cache.seq_lens.tolist()
    ((1, 1, 64), [6])
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *,
                 seed: int = 0, head_dim: int | None = None, rope_base: float | None = None) -> None:
        embed_dim = as_count(embed_dim, "embed_dim", 1)
        num_heads = as_count(num_heads, "num_heads", 1)
        num_kv_heads = num_heads if num_kv_heads is None else as_count(num_kv_heads, "num_kv_heads", 1)
        seed = _seed(seed)
        head_dim = None if head_dim is None else as_count(head_dim, "head_dim", 1)
        if rope_base is not None:
            rope_base = as_float(rope_base, "rope_base")
            if not 0 < rope_base < math.inf:
                raise ValueError(f"rope_base must be a positive finite number, got {rope_base}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
            )
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
            head_dim = embed_dim // num_heads
        if rope_base is not None and head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim, self.rope_base = head_dim, rope_base
        rng = np.random.default_rng(seed)
        self.w_q = _init(rng, embed_dim, num_heads * head_dim)
        self.w_k = _init(rng, embed_dim, num_kv_heads * head_dim)
        self.w_v = _init(rng, embed_dim, num_kv_heads * head_dim)
        self.w_o = _init(rng, num_heads * head_dim, embed_dim)

    def new_cache(self, batch_size: int, max_seq_len: int | None = None, *, dtype: DTypeLike = np.float32,
                  mode: str = "linear", window: int | None = None,
                  v_dtype: DTypeLike | None = None) -> DynamicKVCache | StaticKVCache:
        """A cache shaped for this layer (``num_kv_heads`` heads of ``head_dim``).

        Parameters
        ----------
        batch_size : int
            Rows of the inputs the cache will serve.
        max_seq_len : int, optional
            None: a ``DynamicKVCache(dtype=dtype)`` (linear, grows); else a
            ``StaticKVCache`` of this many positions per row.
        dtype : dtype or str, default float32
            The cache's dtype (a float type the layer can attend), or a
            quantised format (a ``StaticKVCache`` only, so it needs
            ``max_seq_len``; ``head_dim`` a multiple of 32).
        v_dtype : dtype or str, optional
            The values' own dtype or format (a ``StaticKVCache``'s); default ``dtype``.
        mode, window
            A ``StaticKVCache``'s (``"circular"`` and its window need ``max_seq_len``).

        Returns
        -------
        DynamicKVCache or StaticKVCache

        Raises
        ------
        ValueError
            A quantised ``dtype`` without ``max_seq_len`` or with a
            ``head_dim`` its block of 32 does not divide; see also the caches'.
        """
        _check_kv_format(dtype, max_seq_len is None, self.head_dim,
                         "pass max_seq_len for a StaticKVCache (a DynamicKVCache grows by copying)",
                         v_dtype=v_dtype)
        if max_seq_len is None:
            if mode != "linear" or window is not None:
                raise ValueError("a circular cache (mode, window) needs max_seq_len: a DynamicKVCache "
                                 "is linear")
            as_count(batch_size, "batch_size", 0)
            return DynamicKVCache(dtype=dtype)
        return StaticKVCache(batch_size, self.num_kv_heads, max_seq_len, self.head_dim,
                             dtype=dtype, v_dtype=v_dtype, mode=mode, window=window)

    def _split(self, x, heads):
        b, s, _ = x.shape
        return x.reshape(b, s, heads, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x: np.ndarray, cache: DynamicKVCache | StaticKVCache | None = None,
                 use_cache: bool = False, *, lengths: np.ndarray | None = None,
                 window: int | None = None) -> np.ndarray:
        """``y`` ``(B, S, E)`` float32 for ``x`` ``(B, S, E)``: see the class notes.

        Raises
        ------
        TypeError
            ``x`` not numbers, ``cache`` not a numkv cache, ``use_cache`` not a
            bool, ``window`` / ``lengths`` not integers.
        ValueError
            Shapes that do not fit the layer or the cache, ``use_cache``
            without a cache (or a cache without it), ``window < 1``; the cache
            is left unchanged.
        """
        x = as_array(x, "x")
        if not is_attention_dtype(x.dtype) and not is_integer_dtype(x.dtype):
            raise TypeError(f"x must hold numbers (a float or integer dtype), got dtype {x.dtype}")
        if x.ndim != 3 or x.shape[2] != self.embed_dim:
            raise ValueError(f"x must have shape (batch, seq, {self.embed_dim}), got {x.shape}")
        use_cache = as_flag(use_cache, "use_cache")
        if cache is not None and not isinstance(cache, _CacheBase):
            raise TypeError(f"cache must be a numkv DynamicKVCache or StaticKVCache, got "
                            f"{type(cache).__name__}")
        if use_cache and cache is None:
            raise ValueError("use_cache=True needs a cache")
        if cache is not None and not use_cache:
            raise ValueError("a cache was given with use_cache=False, which would ignore it: pass "
                             "use_cache=True to use it, or no cache")
        window = _window(window)
        batch, new, _ = x.shape
        if use_cache:
            self._check_cache(cache, batch)
        lengths = _lengths(lengths, batch, new)
        x = x.astype(np.float32, copy=False)
        q = self._split(_dense(x, self.w_q), self.num_heads)
        k = self._split(_dense(x, self.w_k), self.num_kv_heads)
        v = self._split(_dense(x, self.w_v), self.num_kv_heads)
        if use_cache:
            start = cache.seq_lens
            if start.shape != (batch,):  # an empty DynamicKVCache has no rows yet
                start = np.zeros(batch, np.int64)
        else:
            start = np.zeros(batch, np.int64)
        if self.rope_base is not None:
            positions = start[:, None] + np.arange(new)
            q, k = rope(q, positions, self.rope_base), rope(k, positions, self.rope_base)
        if new == 0:
            y = np.zeros((batch, self.num_heads, 0, self.head_dim), np.float32)
        elif use_cache:
            y = self._attend_cached(q, k, v, cache, lengths, window)
        else:
            extra = {} if window is None else {"left_window_size": window - 1}
            y = _attention(q, k, v, is_causal=True, **extra)
        return _dense(y.transpose(0, 2, 1, 3).reshape(batch, new, self.num_heads * self.head_dim), self.w_o)

    def _check_cache(self, cache, batch):
        """The cache's batch, heads and head size against this layer's, so a
        mismatch names the cache rather than keys the caller never saw."""
        if cache._k is None:  # an empty DynamicKVCache: the first append fixes them
            return
        b, h, _, d = cache._k.shape
        dv = cache._v.shape[3]
        for what, have, want in (("batch size", b, batch), ("kv heads", h, self.num_kv_heads),
                                 ("head_dim", d, self.head_dim), ("v_head_dim", dv, self.head_dim)):
            if have != want:
                raise ValueError(f"cache has {what} {have}, the layer's input needs {want}")

    def _attend_cached(self, q, k, v, cache, lengths, window):
        extra = {}
        if getattr(cache, "mode", "linear") == "circular":
            if window is not None and window != cache.window:
                raise ValueError(f"window {window} differs from the circular cache's window {cache.window}")
        elif window is not None:
            extra["left_window_size"] = window - 1
        dtype = cache.dtype if cache.dtype is not None else k.dtype
        v_dtype = getattr(cache, "v_dtype", dtype)
        # A quantised StaticKVCache takes the float32 keys and values as they
        # are and quantises each new token's blocks on append; attention then
        # reads its QuantizedArray views in place.
        for held in (dtype, v_dtype):
            if _kv_format(held) is None and not is_attention_dtype(held):  # checked before the cache is written
                raise TypeError(
                    f"cache has dtype {held}; the layer attends its keys and values, so it must hold "
                    f"a float type Attention takes (float16, bfloat16, float32, float64, float8) "
                    f"or a quantised format ({', '.join(QUANTIZED_DTYPES)})")
        if _kv_format(dtype) is None:
            k = _cast(k, dtype)
        if _kv_format(v_dtype) is None:
            v = _cast(v, v_dtype)
        new = q.shape[2]
        step = cache.max_chunk or new
        outputs = []
        for c0 in range(0, new, step):
            c1 = min(c0 + step, new)
            part = None if lengths is None else np.clip(lengths - c0, 0, c1 - c0)
            cache.append(k[:, :, c0:c1], v[:, :, c0:c1], lengths=part)
            inputs = cache.attention_inputs()
            outputs.append(_attention(q[:, :, c0:c1], inputs.pop("K"), inputs.pop("V"), **inputs, **extra))
        return outputs[0] if len(outputs) == 1 else np.concatenate(outputs, axis=2)


class RMSNorm:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis."""

    def __init__(self, dim, rng, eps=1e-6):
        self.weight = (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
        self.eps = eps

    def __call__(self, x):
        scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale * self.weight).astype(np.float32, copy=False)


def _silu(x):
    return x / (1.0 + np.exp(-x))


class DecoderBlock:
    """Pre-norm Llama block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``
    with a SwiGLU MLP ``w_down(silu(w_gate x) * w_up x)``."""

    def __init__(self, cfg, rng, seed):
        e, m = cfg["embed_dim"], cfg["mlp_dim"]
        self.attn_norm = RMSNorm(e, rng)
        self.attn = CachedSelfAttention(e, cfg["num_heads"], cfg["num_kv_heads"], seed=seed,
                                        rope_base=cfg["rope_base"])
        self.mlp_norm = RMSNorm(e, rng)
        self.w_gate, self.w_up = _init(rng, e, m), _init(rng, e, m)
        self.w_down = _init(rng, m, e, scale=1.0 / math.sqrt(2 * cfg["num_layers"]))

    def __call__(self, x, cache, lengths, window):
        x = x + self.attn(self.attn_norm(x), cache, cache is not None, lengths=lengths, window=window)
        h = self.mlp_norm(x)
        return x + _dense(_silu(_dense(h, self.w_gate)) * _dense(h, self.w_up), self.w_down)


PRESETS = {
    # name: embed_dim, layers, heads, kv heads (GQA), SwiGLU width, vocabulary
    "tiny": dict(embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=176, vocab_size=256),
    "small": dict(embed_dim=128, num_layers=4, num_heads=8, num_kv_heads=2, mlp_dim=352, vocab_size=512),
    "base": dict(embed_dim=256, num_layers=6, num_heads=8, num_kv_heads=4, mlp_dim=704, vocab_size=1024),
}

CACHE_KINDS = ("dynamic", "static", "circular")


class Decoder:
    """A small Llama-style decoder with seeded random weights.

    Token embedding, ``num_layers`` blocks (RMSNorm, rotary GQA
    ``CachedSelfAttention``, SwiGLU MLP), a final RMSNorm and an output head
    tied to the embedding.  It exists to exercise and time the caches, not to
    say anything sensible.

    Parameters
    ----------
    size : {"tiny", "small", "base"}
        A preset of ``PRESETS``.
    seed : int, default 0
        Seed of the weights (>= 0).
    **overrides
        Any field of the preset: ``embed_dim``, ``num_layers``, ``num_heads``,
        ``num_kv_heads``, ``mlp_dim``, ``vocab_size`` (integers >= 1),
        ``rope_base``, ``input_scale`` (positive numbers).

    Notes
    -----
    ``decoder(tokens, caches=None, *, lengths=None, window=None)`` maps int
    tokens ``(B, S)`` to float32 logits ``(B, S, vocab_size)``; ``caches`` is
    one cache per layer (``new_caches``), ``lengths`` the real tokens per row
    of a right-padded batch, ``window`` a sliding window (on every path).
    ``generate`` decodes greedily.

    Examples
    --------
    >>> import numpy as np
    >>> from numkv.layers import Decoder
    >>> decoder = Decoder("tiny", seed=0)
    >>> prompts = [np.arange(1, 9), np.arange(20, 31)]          # two prompts, 8 and 11 tokens
    >>> tokens, logits = decoder.generate(prompts, 4, cache="static")
    >>> tokens.shape, logits.shape
    ((2, 4), (2, 4, 256))
    >>> bool((tokens == decoder.generate(prompts, 4)[0]).all())  # == recomputing without a cache
    True
    """

    def __init__(self, size: str = "tiny", *, seed: int = 0, **overrides) -> None:
        if not isinstance(size, str) or size not in PRESETS:
            raise ValueError(f"size must be one of {sorted(PRESETS)}, got {size!r}")
        seed = _seed(seed)
        cfg = dict(PRESETS[size], rope_base=10000.0, input_scale=0.1)
        unknown = set(overrides) - set(cfg)
        if unknown:
            raise TypeError(f"unknown Decoder settings: {sorted(unknown)}")
        for name, value in overrides.items():
            if name in ("rope_base", "input_scale"):
                value = as_float(value, name)
                if not 0 < value < math.inf:
                    raise ValueError(f"{name} must be a positive finite number, got {value}")
            else:
                value = as_count(value, name, 1)
            cfg[name] = value
        self.config = cfg
        rng = np.random.default_rng(seed)
        # Unit-variance embedding entries: tied to the head, they spread the
        # logits by ~sqrt(embed_dim), so greedy choices are rarely near-ties
        # that float rounding could flip between equivalent computations.
        self.embedding = rng.standard_normal((cfg["vocab_size"], cfg["embed_dim"])).astype(np.float32)
        # ... but entering the residual stream at full scale, a token's own
        # embedding dominates the tied head and the model echoes its last
        # token forever; scaled down, the blocks (and so the cache) decide.
        self.input_scale = np.float32(cfg["input_scale"])
        self.blocks = [DecoderBlock(cfg, rng, seed=seed * 1000 + i) for i in range(cfg["num_layers"])]
        self.norm = RMSNorm(cfg["embed_dim"], rng)

    @property
    def vocab_size(self):
        return self.config["vocab_size"]

    def new_caches(self, kind: str, batch_size: int, max_seq_len: int | None = None, *,
                   dtype: DTypeLike = np.float32, window: int | None = None,
                   v_dtype: DTypeLike | None = None) -> list:
        """One cache per layer.

        Parameters
        ----------
        kind : {"dynamic", "static", "circular"}
            ``"dynamic"``: ``DynamicKVCache`` (no ``max_seq_len``);
            ``"static"``: linear ``StaticKVCache`` of ``max_seq_len`` positions;
            ``"circular"``: ``window`` positions attended in a ring of
            ``max_seq_len`` slots (default ``2 * window``).
        batch_size : int
            Rows.
        max_seq_len : int, optional
            See ``kind``.
        dtype : dtype or str, default float32
            The caches' dtype, or a quantised format: ``"static"`` and
            ``"circular"`` caches only, and a head size (``embed_dim //
            num_heads``) that the block of 32 divides.
        v_dtype : dtype or str, optional
            The values' own dtype or format (``"static"`` and ``"circular"``
            caches); default ``dtype``.
        window : int, optional
            The ring's window: circular caches only (for a linear cache, pass
            ``window`` to the decoder's call).

        Returns
        -------
        list of DynamicKVCache or StaticKVCache

        Raises
        ------
        ValueError
            A kind, size or window out of place, or a quantised ``dtype``
            with ``kind="dynamic"`` or a head size not a multiple of 32.
        """
        if not isinstance(kind, str) or kind not in CACHE_KINDS:
            raise ValueError(f"kind must be one of {CACHE_KINDS}, got {kind!r}")
        self._check_cache_dtype(dtype, kind, v_dtype)
        as_count(batch_size, "batch_size", 0)
        if kind == "dynamic" and max_seq_len is not None:
            raise ValueError("max_seq_len applies to 'static' and 'circular' caches: a dynamic one grows")
        if kind == "static" and max_seq_len is None:
            raise ValueError("a 'static' cache needs max_seq_len")
        if kind != "circular" and window is not None:
            raise ValueError(f"window makes a 'circular' cache; a {kind!r} cache keeps every token "
                             f"(pass window to the decoder's call to attend a sliding window)")
        window = _window(window)
        caches = []
        for block in self.blocks:
            if kind == "dynamic":
                caches.append(DynamicKVCache(dtype=dtype))
            elif kind == "static":
                caches.append(block.attn.new_cache(batch_size, max_seq_len, dtype=dtype, v_dtype=v_dtype))
            else:
                if window is None:
                    raise ValueError("a circular cache needs a window")
                slots = 2 * window if max_seq_len is None else max_seq_len
                caches.append(block.attn.new_cache(batch_size, slots, dtype=dtype, v_dtype=v_dtype,
                                                   mode="circular", window=window))
        return caches

    def _check_cache_dtype(self, dtype, kind, v_dtype=None):
        """A quantised ``dtype`` needs a StaticKVCache kind and a head size
        of whole blocks: refused here, naming the decoder's settings."""
        cfg = self.config
        _check_kv_format(dtype, kind == "dynamic", self.blocks[0].attn.head_dim,
                         "use cache kind 'static' or 'circular' (a 'dynamic' cache grows by copying)",
                         f" (embed_dim {cfg['embed_dim']} / num_heads {cfg['num_heads']})",
                         "; Decoder('base') or Decoder('tiny', num_heads=2, num_kv_heads=1) have 32",
                         v_dtype=v_dtype)

    def __call__(self, tokens: np.ndarray, caches: Sequence | None = None, *,
                 lengths: np.ndarray | None = None, window: int | None = None) -> np.ndarray:
        """Logits ``(B, S, vocab_size)`` float32 for int ``tokens`` ``(B, S)``
        (see the class notes); with ``caches`` the tokens are appended to them."""
        tokens = as_array(tokens, "tokens")
        if tokens.ndim != 2 or not is_integer_dtype(tokens.dtype):
            raise ValueError(f"tokens must be a 2-D integer array (batch, seq), got {tokens.dtype} {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"tokens must lie in [0, {self.vocab_size})")
        if caches is not None:
            if isinstance(caches, _CacheBase) or not hasattr(caches, "__len__"):
                raise TypeError(f"caches must be a sequence of one cache per layer (new_caches), got "
                                f"{type(caches).__name__}")
            if len(caches) != len(self.blocks):
                raise ValueError(f"need one cache per layer ({len(self.blocks)}), got {len(caches)}")
            for i, cache in enumerate(caches):
                if not isinstance(cache, _CacheBase):
                    raise TypeError(f"caches[{i}] must be a numkv DynamicKVCache or StaticKVCache, "
                                    f"got {type(cache).__name__}")
        window = _window(window)
        if lengths is not None:
            lengths = _lengths(lengths, tokens.shape[0], tokens.shape[1])
        x = self.embedding[tokens] * self.input_scale
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i], lengths, window)
        return _dense(self.norm(x), self.embedding.T)

    def generate(self, prompts: Sequence, new_tokens: int, *, cache: str | None = None,
                 dtype: DTypeLike = np.float32, window: int | None = None, slots: int | None = None,
                 prefill_chunk: int | None = None,
                 progress: Callable[[int, int], object] | None = None,
                 v_dtype: DTypeLike | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Greedy decoding of ``new_tokens`` tokens after each prompt.

        Every option is honoured on every path it applies to (uncached,
        cached, chunked prefill) and refused (``ValueError``) where it does
        not apply, never ignored.

        Parameters
        ----------
        prompts : sequence of 1-D int arrays
            At least one prompt, each of at least one token in
            ``[0, vocab_size)``; lengths may differ (ragged batch).
        new_tokens : int
            Tokens to generate per prompt (>= 0).
        cache : {None, "dynamic", "static", "circular"}
            The *kind* of caches to use, not a cache object.  None recomputes
            the whole prefix every step; a kind makes one cache of it per
            layer (``new_caches``), prefills the right-padded prompts into
            them and then decodes one token per row per step, each row at its
            own position.  (To decode with caches of your own, call
            ``decoder(tokens, caches)`` step by step.)
        dtype : dtype or str, default float32
            The caches' dtype (only with a cache); the quantised formats with
            ``"static"`` and ``"circular"`` caches (``new_caches``).
        v_dtype : dtype or str, optional
            The caches' values' own dtype or format (``new_caches``); default ``dtype``.
        window : int, optional
            Sliding-window attention over the last ``window`` positions, on
            every path (required for ``"circular"``, whose ring it sizes).
        slots : int, optional
            The circular cache's capacity (>= ``window``; default ``window`` +
            the longest prompt - 1, so prefill needs one chunk).  Circular only.
        prefill_chunk : int, optional
            Prefill in chunks of this many tokens (>= 1; only with a cache).
        progress : callable, optional
            ``progress(done, total)``, called after each token.

        Returns
        -------
        tokens : ndarray, int64, shape ``(B, new_tokens)``
        logits : ndarray, float32, shape ``(B, new_tokens, vocab_size)``
            The logits each token was picked from.

        Raises
        ------
        TypeError
            An argument of the wrong type (``cache`` a cache object, a float
            count, non-integer prompts, ``progress`` not callable).
        ValueError
            An unknown kind, a value out of range, an option where it does
            not apply.
        """
        if cache is not None and not isinstance(cache, str):
            raise TypeError(
                f"cache names the kind of per-layer caches generate makes: None, "
                f"{', '.join(map(repr, CACHE_KINDS))}; got {cache!r}.  To decode with caches of "
                f"your own, make one per layer (decoder.new_caches) and call decoder(tokens, caches)")
        if cache is not None and cache not in CACHE_KINDS:
            raise ValueError(f"cache must be None or one of {', '.join(map(repr, CACHE_KINDS))}, got {cache!r}")
        new_tokens = as_count(new_tokens, "new_tokens", 0)
        window = _window(window)
        # Every option is honoured on every path it applies to, or refused:
        # a cache's options need a cache, the ring's size a ring.
        if cache is None:
            if _kv_format(dtype) is not None or np.dtype(dtype) != np.float32:
                shown = _kv_format(dtype) or np.dtype(dtype)
                raise ValueError(f"dtype is the caches' dtype: it needs cache=..., got dtype {shown} "
                                 f"with cache=None (which computes in float32)")
            if v_dtype is not None:
                raise ValueError(f"v_dtype is the caches' values' dtype: it needs cache=..., got {v_dtype!r}")
            if prefill_chunk is not None:
                raise ValueError("prefill_chunk splits the caches' prefill: it needs cache=...")
        else:
            self._check_cache_dtype(dtype, cache, v_dtype)
        if slots is not None:
            if cache != "circular":
                raise ValueError(f"slots is the capacity of a 'circular' cache; got cache={cache!r}")
            slots = as_count(slots, "slots", 1)
            if window is not None and slots < window:
                raise ValueError(f"slots {slots} < window {window}: the ring must hold the window")
        if prefill_chunk is not None:
            prefill_chunk = as_count(prefill_chunk, "prefill_chunk", 1)
        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be callable (done, total) or None, got {type(progress).__name__}")
        prompts = self._prompts(prompts)
        lens = np.array([p.size for p in prompts], np.int64)
        batch, rows = len(prompts), np.arange(len(prompts))
        out_tokens = np.zeros((batch, new_tokens), np.int64)
        out_logits = np.zeros((batch, new_tokens, self.vocab_size), np.float32)
        padded = np.zeros((batch, int(lens.max()) + new_tokens), np.int64)
        for b, p in enumerate(prompts):
            padded[b, :p.size] = p
        if cache is None:
            for t in range(new_tokens):
                ends = lens + t
                logits = self(padded[:, :int(ends.max())], window=window)[rows, ends - 1]
                self._pick(logits, t, out_tokens, out_logits, padded, ends, progress)
            return out_tokens, out_logits
        longest = int(lens.max())
        if cache == "circular":
            if slots is None:
                slots = window + longest - 1 if window is not None else None
            caches = self.new_caches(cache, batch, slots, dtype=dtype, window=window, v_dtype=v_dtype)
        else:  # a linear cache keeps every token; the window applies to what is attended
            caches = self.new_caches(cache, batch, None if cache == "dynamic" else longest + new_tokens,
                                     dtype=dtype, v_dtype=v_dtype)
        if new_tokens == 0:
            return out_tokens, out_logits
        chunk = prefill_chunk or longest
        for c0 in range(0, longest, chunk):
            c1 = min(c0 + chunk, longest)
            logits = self(padded[:, c0:c1], caches, lengths=np.clip(lens - c0, 0, c1 - c0), window=window)
            last = (lens - 1 >= c0) & (lens - 1 < c1)
            if c0 == 0:
                final = logits[rows, np.clip(lens - 1 - c0, 0, c1 - c0 - 1)]
            final[last] = logits[rows[last], lens[last] - 1 - c0]
        for t in range(new_tokens):
            ends = lens + t
            self._pick(final, t, out_tokens, out_logits, padded, ends, progress)
            if t + 1 < new_tokens:
                final = self(out_tokens[:, t:t + 1], caches, window=window)[:, 0]
        return out_tokens, out_logits

    def _prompts(self, prompts):
        """``prompts`` as a list of 1-D int64 arrays of tokens in the vocabulary."""
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            raise TypeError(f"prompts must be a sequence of 1-D integer arrays, got {type(prompts).__name__}")
        checked = []
        for i, p in enumerate(prompts):
            p = as_array(p, f"prompts[{i}]")
            if p.ndim != 1:
                raise ValueError(f"prompts[{i}] must be 1-D, got shape {p.shape}")
            if p.size and not is_integer_dtype(p.dtype):
                raise TypeError(f"prompts[{i}] must hold integer tokens, got dtype {p.dtype}")
            if p.size and (p.min() < 0 or p.max() >= self.vocab_size):
                raise ValueError(f"prompts[{i}] has tokens outside [0, {self.vocab_size})")
            checked.append(p.astype(np.int64))
        if not checked or min(p.size for p in checked) < 1:
            raise ValueError("generate needs at least one prompt, each of at least one token")
        return checked

    def _pick(self, logits, t, out_tokens, out_logits, padded, ends, progress):
        out_logits[:, t] = logits
        out_tokens[:, t] = np.argmax(logits, axis=-1)
        padded[np.arange(len(ends)), ends] = out_tokens[:, t]
        if progress is not None:
            progress(t + 1, out_tokens.shape[1])
