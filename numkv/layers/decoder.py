"""The demo's model: a small Llama-style decoder with seeded random weights
(``python -m numkv demo``), built of ``CachedSelfAttention`` and NumPy.  It
exists to exercise and time the caches, not to say anything sensible.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .._dtypes import is_integer_dtype
from .._validate import as_array, as_count, as_float
from ..cache import DynamicKVCache, _CacheBase
from .attention import CachedSelfAttention, _check_kv_format, _dense, _init, _kv_format, _lengths, _seed, _window

if TYPE_CHECKING:  # annotations only: numpy.typing is not imported at run time
    from numpy.typing import DTypeLike


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
