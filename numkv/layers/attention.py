"""``CachedSelfAttention``: a self-attention layer in NumPy with
``numkv.attention`` doing the attention (and ``numkv.tensor_scatter`` the cache
writes, through ``numkv.cache``); the demo's decoder built of it is in
``decoder.py``.

Shapes: ``x`` is ``(B, S, E)``; inside the layer queries are ``(B, Hq, S, D)``
and keys / values ``(B, Hkv, S, D)`` strided views of the projections (never
copied: ``numkv.attention`` and ``tensor_scatter`` read strided views in place);
GQA when ``Hkv < Hq`` (``Hq % Hkv == 0``), which the attention kernel maps by
index, so K/V are never repeated.

The weights are seeded random float32 arrays: the layer exists to exercise
and time the caches (``python -m numkv demo``), not to say anything sensible.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .._dtypes import is_attention_dtype, is_float8_dtype, is_integer_dtype
from .._quantize import BLOCK
from .._validate import as_array, as_count, as_flag, as_float, index_vector
from ..cache import QUANTIZED_DTYPES, DynamicKVCache, StaticKVCache, _CacheBase

if TYPE_CHECKING:  # annotations only: numpy.typing is not imported at run time
    from numpy.typing import DTypeLike


def _attention(Q, K, V, **kwargs):
    # Imported on use: numkv.attention's module compiles nothing at import,
    # but importing it here lazily keeps ``import numkv.layers`` light.
    from .._attention import attention

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
