"""KV caches for autoregressive decoding: plain Python over ``tensor_scatter``.

Shapes, in the names used throughout: ``B`` batch rows, ``H`` key/value heads,
``C`` the buffer's capacity (``max_seq_len``), ``D`` / ``Dv`` key / value head
size, ``S`` the number of new positions in one ``append``.  Keys and values are
stored ``(B, H, C, D)`` — the layout ``numkv.attention`` reads in place.

Every row keeps its own length (``seq_lens``), so a batch of prompts of
different lengths lives in one cache: ``append`` writes row ``b``'s new keys at
``seq_lens[b]`` with one ``tensor_scatter(..., out=buffer)`` call, O(new tokens).
An optional ``lengths`` says how many of the ``S`` new positions of each row are
real tokens (right-padded chunks); the padding is written but not counted, and
the row's next append overwrites it.

After an ``append``, ``attention_inputs()`` gives the keyword arguments that make
``numkv.attention(Q, **inputs)`` correct for the queries of that append (the
offset causal mask, ragged rows, the sliding window): see ``CachedSelfAttention``
in ``numkv.layers``.

Errors follow API.md: shapes and modes -> ``ValueError``, a key or value of
another dtype -> ``TypeError`` (never a silent cast).  Everything is checked
before anything is written, so a failed ``append`` leaves the cache unchanged.
A key or value that overlaps the cache's own buffers (a view of them) is
copied before the write, so it is stored as it was before the call.

A cache is not thread-safe: ``append``, ``crop`` and ``reset`` read and then
replace its lengths, so two threads appending to one cache at once lose
tokens (and may write over each other's).  Give each thread its own cache, or
hold a lock around every call that changes one.  (Reading ``get()`` views
while no thread writes is safe.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _formats
from ._dtypes import is_attention_dtype, is_cache_dtype
from ._quantize import BLOCK, QuantizedArray, quantize_as, zeros
from ._scatter import MODES, tensor_scatter
from ._validate import as_array, as_count, as_int64, index_vector

if TYPE_CHECKING:  # annotations only: numpy.typing is not imported at run time
    from numpy.typing import DTypeLike


_count = as_count  # a plain integer argument >= minimum (bools rejected, int64 at most)


def _as_kv(array, name):
    # Arrays only (subclasses, torch tensors...), no lists: a list of Python
    # floats would become float64, a cast the caller did not ask for.
    array = as_array(array, name, sequences=False)
    if array.ndim != 4:
        raise ValueError(f"{name} must have rank 4 (batch, heads, new_seq, head_dim), got shape {array.shape}")
    return array


# The formats a StaticKVCache quantises its keys and values into on append
# (``numkv.quantize``: each new token's blocks on their own): the block
# formats of ``numkv._formats``.
QUANTIZED_DTYPES = _formats.BLOCK_FORMATS
_QUANTIZED_LIST = ", ".join(QUANTIZED_DTYPES)


def _static_cache_dtype(dtype, name="dtype"):
    """``_cache_dtype``, or one of ``QUANTIZED_DTYPES`` (kept as its name)."""
    if isinstance(dtype, str) and dtype in QUANTIZED_DTYPES:
        return dtype
    return _cache_dtype(dtype, name)


def _cache_dtype(dtype, name="dtype"):
    if isinstance(dtype, str) and dtype in QUANTIZED_DTYPES:  # (a DynamicKVCache: it grows by copying)
        raise TypeError(f"{name} {dtype!r}: a quantised cache is a StaticKVCache(..., {name}={dtype!r})")
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{name} {dtype!r} is not a NumPy dtype nor a quantised format ({_QUANTIZED_LIST}) "
                        f"({exc})") from None
    if not is_cache_dtype(dtype):
        raise TypeError(f"{name} {dtype} is not supported for a KV cache "
                        f"(a fixed-width TensorScatter type)")
    return dtype


def _held(buffer):
    """What a buffer holds: its dtype, or its format's name."""
    return buffer.format if type(buffer) is QuantizedArray else buffer.dtype


class _CacheBase:
    """What both caches share: per-row lengths, argument checks, the scatter
    write, and the attention inputs of the last append.

    Subclasses own ``_k``, ``_v`` (the buffers, or None), ``_lens`` (int64
    tokens appended per row), ``_last`` (``(start, S)`` of the last append).
    """

    mode = "linear"

    # -- lengths -----------------------------------------------------------
    @property
    def seq_lens(self) -> np.ndarray:
        """Tokens appended to each row since the last ``reset``: int64 ``(B,)``,
        a copy; also the absolute position each row's next token will take.

        In a linear cache it is each row's valid prefix, and may be passed as
        ``numkv.attention``'s ``nonpad_kv_seqlen`` over ``get()`` (or the
        buffers) where that valid prefix is all that matters:

        * without ``is_causal`` (and windows): queries that may see every
          token held, e.g. a decode step's one query per row after its key
          was appended;
        * with ``is_causal=True`` only when the ``Sq`` queries of ``Q`` are
          the last ``Sq`` tokens of *every* row, i.e. the queries of an append
          made without ``lengths`` (or with ``lengths`` all equal to ``S``):
          the causal offset is ``nonpad_kv_seqlen[b] - Sq``.

        After an append with ``lengths`` (a right-padded chunk), row ``b``'s
        queries start at its old length, not at ``seq_lens[b] - S``, so
        ``seq_lens`` would shift the causal diagonal left and real queries
        would lose keys (or attend none: zero rows).  Use
        ``attention_inputs()`` there, and always for a circular cache (slot
        order is not position order).
        """
        return self._lens.copy()

    @property
    def seq_len(self) -> int:
        """The longest row's ``seq_lens`` (0 when empty)."""
        return int(self._lens.max()) if self._lens.size else 0

    # -- checks ------------------------------------------------------------
    def _check_pair(self, key, value, batch, heads, head_dim, v_head_dim, dtype, v_dtype=None):
        """The checked key and value (quantised for a quantised cache, whose
        ``dtype`` / ``v_dtype`` is a format's name); ``v_dtype`` None: ``dtype``."""
        key, value = _as_kv(key, "key"), _as_kv(value, "value")
        v_dtype = dtype if v_dtype is None else v_dtype
        for name, arr, dim, size, held in (("key", key, "head_dim", head_dim, dtype),
                                           ("value", value, "v_head_dim", v_head_dim, v_dtype)):
            if isinstance(held, str):  # a QUANTIZED_DTYPES buffer: float keys, quantised here
                if not is_attention_dtype(arr.dtype):
                    raise TypeError(f"{name} has dtype {arr.dtype}; a {held} cache quantises float keys "
                                    f"and values (float16, bfloat16, float32, float64 or float8)")
            elif arr.dtype != held:
                raise TypeError(f"{name} has dtype {arr.dtype}, the cache holds {held} (no implicit casting)")
            if arr.shape[0] != batch:
                raise ValueError(f"{name}.shape[0] (batch) = {arr.shape[0]}, the cache has batch_size {batch}")
            if arr.shape[1] != heads:
                raise ValueError(f"{name}.shape[1] (heads) = {arr.shape[1]}, the cache has num_heads {heads}")
            if arr.shape[3] != size:
                raise ValueError(f"{name}.shape[3] ({dim}) = {arr.shape[3]}, the cache has {dim} {size}")
        if key.shape[2] != value.shape[2]:
            raise ValueError(f"key has {key.shape[2]} new positions, value has {value.shape[2]}")
        # both quantised (finite, within float16's scales) before either is written
        if isinstance(dtype, str):
            key = quantize_as(key, dtype, None, "key")
        if isinstance(v_dtype, str):
            value = quantize_as(value, v_dtype, None, "value")
        return key, value

    def _new_lengths(self, lengths, batch, new):
        """Tokens each row really gains: ``new`` everywhere, or ``lengths``."""
        if lengths is None:
            return np.full(batch, new, np.int64)
        return index_vector(lengths, "lengths", batch, new)

    def _check_fits(self, start, new, capacity):
        over = np.flatnonzero(start + new > capacity)
        if over.size:
            b = int(over[0])
            raise ValueError(
                f"cache overflow at batch row {b}: seq_lens[{b}] = {start[b]} + {new} new "
                f"> max_seq_len {capacity}"
            )

    # -- the write ---------------------------------------------------------
    def _detach(self, key, value):
        """``key`` and ``value``, copied where they may overlap a buffer this
        append writes.  The key buffer is written before the value buffer is
        read, so a value that is a view of the key buffer (or a key that is a
        view of either) would otherwise be read after it was overwritten.
        ``np.may_share_memory`` compares bounds only (no exact solve): a false
        positive costs a copy of the new tokens, O(new tokens) like the write."""
        if type(key) is QuantizedArray:  # quantised on the way in: new arrays, nobody's view
            return key, value
        buffers = [b for b in (self._k, self._v) if b is not None]
        # An array that owns its memory overlaps the buffers (which own theirs)
        # only by being one of them: no bounds check for it.
        if any(key is b or (key.base is not None and np.may_share_memory(key, b)) for b in buffers):
            key = key.copy()
        if any(value is b or (value.base is not None and np.may_share_memory(value, b)) for b in buffers):
            value = value.copy()
        return key, value

    def _write(self, key, value, start, gained):
        """Scatter at each row's own position, in place: O(new tokens)."""
        if key.shape[2]:
            tensor_scatter(self._k, key, start, axis=2, mode=self.mode, out=self._k)
            tensor_scatter(self._v, value, start, axis=2, mode=self.mode, out=self._v)
        self._last = (start, key.shape[2])
        self._lens = start + gained

    def get(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Views of what the cache holds, no copy.

        Returns
        -------
        keys : ndarray or QuantizedArray (a quantised cache), shape ``(B, H, n, D)``, or None (an empty ``DynamicKVCache``)
        values : ndarray or QuantizedArray, shape ``(B, H, n, Dv)``, or None
            ``n`` is the longest row's length (``seq_len``; for a circular
            cache at most ``max_seq_len``, in slot order: ``positions()``).
            Rows shorter than ``n`` hold stale data past their own length;
            ``seq_lens`` says where each row ends.  The views alias the cache:
            later appends write through them.
        """
        if self._k is None:
            return None, None
        n = self._held()
        return self._k[:, :, :n], self._v[:, :, :n]

    def _held(self):
        return self.seq_len

    def attention_inputs(self) -> dict:
        """Keyword arguments for ``numkv.attention(Q, **inputs)`` where ``Q``
        holds the queries of the last ``append`` (``S`` of them per row, at
        absolute positions ``seq_lens_before[b] + i``).

        Returns
        -------
        dict
            ``K``, ``V`` (views of the buffers) and ``nonpad_kv_seqlen`` /
            ``is_causal`` or ``attn_mask``.

        Raises
        ------
        ValueError
            Without a previous append (or after ``crop``).

        Notes
        -----
        Linear caches: ``K``/``V`` up to the furthest written position, with
        ``nonpad_kv_seqlen = start + S`` and ``is_causal=True``, which puts the
        causal diagonal at offset ``start[b]`` per row (API.md: offset =
        ``nonpad_kv_seqlen[b] - q_sequence_length``).  Padding queries of a
        right-padded chunk see padding keys; their outputs are meaningless and
        ignored, while real queries never reach past their own position.
        """
        if self._k is None or self._last is None:
            raise ValueError("attention_inputs() needs a previous append")
        start, new = self._last
        extent = start + new
        n = int(extent.max()) if extent.size else 0
        return dict(K=self._k[:, :, :n], V=self._v[:, :, :n],
                    nonpad_kv_seqlen=extent, is_causal=True)

    def __repr__(self):
        """Class, shapes, dtype, mode and each row's length, e.g.
        ``StaticKVCache(batch_size=2, num_heads=8, max_seq_len=1024,
        head_dim=64, dtype=float32, mode='linear', seq_lens=[5, 3])``."""
        name = type(self).__name__
        if self._k is None:
            return f"{name}(empty: batch, heads, head sizes and dtype come with the first append)"
        batch, heads, capacity, head_dim = self._k.shape
        fields = [f"batch_size={batch}", f"num_heads={heads}",
                  # a static cache's capacity is its constructor's max_seq_len; a dynamic one grows
                  f"max_seq_len={capacity}" if isinstance(self, StaticKVCache) else f"capacity={capacity}",
                  f"head_dim={head_dim}"]
        if self._v.shape[3] != head_dim:
            fields.append(f"v_head_dim={self._v.shape[3]}")
        dtype, v_dtype = (str(_held(buffer)) for buffer in (self._k, self._v))
        fields.append(f"dtype={dtype}")
        if v_dtype != dtype:
            fields.append(f"v_dtype={v_dtype}")
        fields.append(f"mode={self.mode!r}")
        if self.mode == "circular":
            fields.append(f"window={self.window}")
        lens = np.array2string(self._lens, separator=", ", threshold=16, edgeitems=4)
        return f"{name}({', '.join(fields)}, seq_lens={lens})"

    def _crop_lengths(self, n):
        n = as_int64(n, "n")
        if n >= 0:
            return np.minimum(self._lens, n)
        return np.maximum(self._lens + n, 0)

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens of each row (``n < 0``: drop ``-n`` from
        each row's end), e.g. to roll back rejected speculative tokens.  Only
        the lengths change; the dropped positions are overwritten later.

        Parameters
        ----------
        n : int
            Tokens to keep per row (rows shorter keep theirs), or, negative,
            tokens to drop from each row's end.
        """
        self._lens = self._crop_lengths(n)
        self._last = None


class DynamicKVCache(_CacheBase):
    """A KV cache that grows as tokens arrive.

    The first ``append`` fixes batch size, heads, head sizes (and the dtype,
    unless the constructor did).  Keys and values live in a preallocated
    ``(B, H, capacity, D)`` buffer whose capacity doubles when it runs out,
    so ``n`` appends cost O(n) amortised copying instead of the O(n^2) of
    concatenating per token.  Supports the same ragged rows and ``lengths``
    as ``StaticKVCache`` (linear mode).  Not thread-safe (module docstring).

    Parameters
    ----------
    dtype : dtype, optional
        The dtype every key and value must have (``TypeError`` otherwise);
        None: the first append's.  Any fixed-width ``tensor_scatter`` dtype.

    Examples
    --------
    >>> import numpy as np, numkv
    >>> cache = numkv.DynamicKVCache()
    >>> k = np.zeros((2, 4, 3, 8), np.float32)          # (batch, kv heads, new, head_dim)
    >>> keys, values = cache.append(k, k)
    >>> keys.shape, cache.seq_lens.tolist()
    ((2, 4, 3, 8), [3, 3])
    """

    MIN_CAPACITY = 16

    def __init__(self, *, dtype: DTypeLike | None = None) -> None:
        # None: the first append's dtype; else every key and value must have this one.
        self._dtype = None if dtype is None else _cache_dtype(dtype)
        self.reset()

    def reset(self) -> None:
        """Forget everything, shapes included (buffers released); a dtype given
        to the constructor stays."""
        self._k = self._v = None
        self._lens = np.zeros(0, np.int64)
        self._last = None

    @property
    def dtype(self) -> np.dtype | None:
        """The stored dtype: the constructor's, else the first append's
        (``None`` before it)."""
        return self._dtype if self._k is None else self._k.dtype

    @property
    def capacity(self) -> int:
        """Positions the buffers hold now (0 before the first append); doubles
        when an append needs more."""
        return 0 if self._k is None else self._k.shape[2]

    max_chunk = None  # any number of new positions per append

    def append(self, key: np.ndarray, value: np.ndarray,
               lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Append new keys and values at each row's length.

        Parameters
        ----------
        key : ndarray, shape ``(B, H, S, D)``
            New keys, in the cache's dtype (no implicit cast).  A view of the
            cache's own buffers is copied first.
        value : ndarray, shape ``(B, H, S, Dv)``
            New values, same dtype.
        lengths : int array, shape ``(B,)``, optional
            Real tokens per row, each in ``[0, S]``; the rest of the ``S``
            positions are padding (written, not counted).  Default: all ``S``.

        Returns
        -------
        keys, values : ndarray
            ``get()``: views of everything cached.

        Raises
        ------
        TypeError
            A key or value of another dtype, or not an array.
        ValueError
            A batch / head / head size mismatch, bad ``lengths``; nothing is
            written then.
        """
        if self._k is None:
            # The first append fixes the shapes and dtype the others must match.
            key, value = _as_kv(key, "key"), _as_kv(value, "value")
            if not is_cache_dtype(key.dtype):
                raise TypeError(f"key has dtype {key.dtype}, which a KV cache cannot hold "
                                f"(a fixed-width TensorScatter type)")
            batch, heads, _, head_dim = key.shape
            v_head_dim = value.shape[3]
            dtype = key.dtype if self._dtype is None else self._dtype
            start = np.zeros(batch, np.int64)
        else:
            batch, heads, _, head_dim = self._k.shape
            v_head_dim, dtype = self._v.shape[3], self._k.dtype
            start = self._lens
        key, value = self._check_pair(key, value, batch, heads, head_dim, v_head_dim, dtype)
        new = key.shape[2]
        gained = self._new_lengths(lengths, batch, new)
        # Validated: from here on nothing can fail but memory allocation.
        key, value = self._detach(key, value)
        if self._k is None:
            shape = (batch, heads, max(self.MIN_CAPACITY, new))
            self._k = np.zeros(shape + (head_dim,), key.dtype)
            self._v = np.zeros(shape + (v_head_dim,), key.dtype)
            self._lens = start
        needed = int((start + new).max()) if batch else 0
        if needed > self.capacity:
            self._grow(max(needed, 2 * self.capacity))
        self._write(key, value, start, gained)
        return self.get()

    def _grow(self, capacity):
        # Copy only each row's valid prefix region: padding written past a
        # row's length by the previous append is dead once a new append starts.
        used = self.seq_len
        k = np.zeros(self._k.shape[:2] + (capacity, self._k.shape[3]), self._k.dtype)
        v = np.zeros(self._v.shape[:2] + (capacity, self._v.shape[3]), self._v.dtype)
        k[:, :, :used] = self._k[:, :, :used]
        v[:, :, :used] = self._v[:, :, :used]
        self._k, self._v = k, v  # views handed out earlier keep the old buffers


class StaticKVCache(_CacheBase):
    """A preallocated KV cache: ``(B, H, max_seq_len, D)`` key and value buffers.

    Parameters
    ----------
    batch_size : int
        Rows ``B`` (>= 0); each keeps its own length (``seq_lens``).
    num_heads : int
        Key/value heads ``H`` (>= 1): the *kv* heads of a GQA/MQA layer
        (``num_kv_heads``), not its query heads.
    max_seq_len : int
        Positions per row (>= 1): the capacity of a linear cache, the ring's
        slots of a circular one.
    head_dim : int
        Key head size ``D`` (>= 1).
    dtype : dtype or str, default float32
        Any fixed-width ``tensor_scatter`` dtype; keys and values must arrive
        in it.  Or a quantised format (``numkv.quantize``, head sizes a
        multiple of 32): float keys and values of any attention dtype are
        quantised on append, each new token's blocks on their own, and
        ``get()`` / ``attention_inputs()`` hand over ``QuantizedArray`` views
        that ``numkv.attention`` reads in place.
    v_head_dim : int, optional
        Value head size ``Dv``; default ``head_dim``.
    v_dtype : dtype or str, optional
        What the values are stored as, as ``dtype`` (default: ``dtype``):
        keys and values in different formats, e.g. ``dtype="q8_0",
        v_dtype="q4_0"`` (llama.cpp's ``-ctk`` / ``-ctv``: 4-bit keys are
        the quality risk, 4-bit values much less so).
    mode : {"linear", "circular"}
        ``"circular"``: a sliding-window ring (below).
    window : int, optional
        Circular mode only: positions each query attends, in
        ``[1, max_seq_len]``; default ``max_seq_len``.

    Raises
    ------
    TypeError
        A non-integer size, a dtype a cache cannot hold.
    ValueError
        A size out of range, an unknown mode, a window without circular mode
        or beyond ``max_seq_len``, buffers too big for one array.

    Notes
    -----
    Not thread-safe: see the module docstring (one cache per thread, or a lock).

    ``append`` writes each row's new keys at that row's own length with
    ``numkv.tensor_scatter(buffer, key, seq_lens, axis=2, mode=mode,
    out=buffer)``: no allocation for the buffers, O(new tokens) per call.
    ``get()`` returns views, never copies.  Any dtype ``tensor_scatter`` takes
    (float32, float16, bfloat16, the float8 types of ``ml_dtypes``, ...); keys
    and values must arrive in that dtype (no implicit cast); a cache of a
    block format of ``numkv.quantize`` takes float keys and values and
    quantises them on append.

    ``mode="linear"``: row ``b`` holds positions ``0 .. seq_lens[b] - 1`` in
    order; appending past ``max_seq_len`` raises ``ValueError``.

    ``mode="circular"``: a sliding-window (ring buffer) cache.  Position ``p``
    lives in slot ``p % max_seq_len``; queries attend the last ``window``
    positions (``window`` defaults to ``max_seq_len``).  Two things differ from a
    linear cache, and the design answers both:

    * slot order is not position order once the ring wraps, so the causal and
      window rules can't be expressed by key index (``is_causal``,
      ``left_window_size``).  ``attention_inputs()`` instead builds a boolean
      mask from each slot's absolute position (O(B x S x slots) bytes; for
      one-token steps with ``window == max_seq_len`` every held slot is in the
      window and a plain ``nonpad_kv_seqlen`` does).
    * a chunk of ``S`` tokens is written before its queries attend, so its last
      keys overwrite the slots of the ``S - 1`` oldest positions — which its
      first queries still need when ``window`` fills the ring.  Hence the
      capacity must be ``>= window + S - 1`` for a chunk that is attended:
      ``max_chunk = max_seq_len - window + 1``.  ``append`` itself takes up to
      ``max_seq_len`` positions, but refuses (``ValueError``, before writing
      anything) one longer than ``max_chunk`` that wraps the ring, whose last
      keys would overwrite keys its first queries attend; a longer one that
      does not wrap overwrote nothing, and ``attention_inputs()`` serves it.  Give the cache a window smaller than its capacity
      to prefill in chunks; ``CachedSelfAttention`` splits longer inputs into
      chunks of ``max_chunk`` by itself.  (The other answer, attending before
      writing, would need old and new keys in one ``K`` without a copy.)

    In circular mode ``seq_lens`` still counts every token appended (the
    absolute position of the next one); the ring holds the last
    ``min(seq_lens[b], max_seq_len)`` of them, ``positions()`` says which.

    Examples
    --------
    >>> import numpy as np, numkv
    >>> cache = numkv.StaticKVCache(2, 4, 128, 8)       # batch 2, 4 kv heads, 128 positions
    >>> k = np.zeros((2, 4, 5, 8), np.float32)
    >>> keys, values = cache.append(k, k, lengths=np.array([5, 3]))   # ragged rows
    >>> cache.seq_lens.tolist(), keys.shape
    ([5, 3], (2, 4, 5, 8))
    >>> Q = np.zeros((2, 8, 5, 8), np.float32)          # the chunk's queries, 8 query heads
    >>> numkv.attention(Q, **cache.attention_inputs()).shape
    (2, 8, 5, 8)
    """

    def __init__(self, batch_size: int, num_heads: int, max_seq_len: int, head_dim: int, *,
                 dtype: DTypeLike = np.float32, v_head_dim: int | None = None, v_dtype: DTypeLike | None = None,
                 mode: str = "linear", window: int | None = None) -> None:
        batch_size = _count(batch_size, "batch_size", 0)
        num_heads = _count(num_heads, "num_heads", 1)
        max_seq_len = _count(max_seq_len, "max_seq_len", 1)
        head_dim = _count(head_dim, "head_dim", 1)
        v_head_dim = head_dim if v_head_dim is None else _count(v_head_dim, "v_head_dim", 1)
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"mode must be 'linear' or 'circular', got {mode!r}")
        if window is not None and mode != "circular":
            raise ValueError("window applies to mode='circular' only")
        window = max_seq_len if window is None else _count(window, "window", 1)
        if window > max_seq_len:
            raise ValueError(f"window {window} > max_seq_len {max_seq_len}")
        dtype = _static_cache_dtype(dtype, "dtype")
        v_dtype = dtype if v_dtype is None else _static_cache_dtype(v_dtype, "v_dtype")
        for name, size, held in (("head_dim", head_dim, dtype), ("v_head_dim", v_head_dim, v_dtype)):
            if isinstance(held, str) and size % _formats.FORMATS[held].block:
                raise ValueError(f"{name} {size} is not a multiple of {held}'s block of "
                                 f"{_formats.FORMATS[held].block}")
        self.mode = mode
        self.window = window
        # np.zeros: calloc'd pages, so a large unused capacity costs no time.
        shape = (batch_size, num_heads, max_seq_len)
        try:
            self._k, self._v = (zeros(held, shape + (size,)) if isinstance(held, str)  # codes and scales, zero
                                else np.zeros(shape + (size,), held)
                                for held, size in ((dtype, head_dim), (v_dtype, v_head_dim)))
        except ValueError as exc:  # numpy's "array is too big": say which arguments made it
            raise ValueError(f"batch_size {batch_size} x num_heads {num_heads} x max_seq_len "
                             f"{max_seq_len} x head_dim {max(head_dim, v_head_dim)} is too big "
                             f"for one array ({exc})") from None
        self.reset()

    @property
    def key_buffer(self) -> np.ndarray:
        """The whole ``(B, H, max_seq_len, D)`` key buffer (the cache's own array)."""
        return self._k

    @property
    def value_buffer(self) -> np.ndarray:
        """The whole ``(B, H, max_seq_len, Dv)`` value buffer (the cache's own array)."""
        return self._v

    @property
    def dtype(self) -> np.dtype | str:
        """The dtype of the key buffer, or its format (a string: a quantised cache)."""
        return _held(self._k)

    @property
    def v_dtype(self) -> np.dtype | str:
        """The dtype of the value buffer, or its format (``dtype`` unless ``v_dtype`` was given)."""
        return _held(self._v)

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers (codes and scales of a quantised cache)."""
        return int(self._k.nbytes + self._v.nbytes)

    @property
    def capacity(self) -> int:
        """``max_seq_len``: positions per row."""
        return self._k.shape[2]

    max_seq_len = capacity

    @property
    def max_chunk(self) -> int | None:
        """Circular mode: the most new positions one append may take and still
        be attended (``max_seq_len - window + 1``); None in linear mode."""
        return self.capacity - self.window + 1 if self.mode == "circular" else None

    def reset(self) -> None:
        """Empty every row; the buffers stay allocated (and are not cleared)."""
        self._lens = np.zeros(self._k.shape[0], np.int64)
        # Circular mode: per row, one past the furthest position written since
        # reset (padding included) — what crop() must not uncover.
        self._high = np.zeros(self._k.shape[0], np.int64)
        self._last = None

    def append(self, key: np.ndarray, value: np.ndarray,
               lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Write new keys and values at each row's ``seq_lens``, in place
        (``tensor_scatter(..., out=buffer)``), O(new tokens).

        Parameters
        ----------
        key : ndarray, shape ``(B, H, S, D)``
            New keys, in the cache's dtype (no implicit cast); for a
            quantised cache float keys, quantised here, each
            token's blocks on their own.  A view of the cache's own buffers
            is copied first.
        value : ndarray, shape ``(B, H, S, Dv)``
            New values, same dtype.
        lengths : int array, shape ``(B,)``, optional
            How many of the ``S`` positions of each row are real tokens, each
            in ``[0, S]``; the rest are padding (written, so they must fit, but
            not counted).  Default: all ``S``.

        Returns
        -------
        keys, values : ndarray
            ``get()``: views of the buffers.

        Raises
        ------
        TypeError
            Another dtype, or not an array.
        ValueError
            A batch / head / head size mismatch, bad ``lengths``, an overflow
            (linear); more than ``max_seq_len`` positions, padding that would
            overwrite keys still needed, or more than ``max_chunk`` positions
            that wrap the ring (circular).  Nothing is written then.
        """
        batch, heads, _, head_dim = self._k.shape
        key, value = self._check_pair(key, value, batch, heads, head_dim, self._v.shape[3], self.dtype, self.v_dtype)
        new = key.shape[2]
        gained = self._new_lengths(lengths, batch, new)
        start = self._lens
        if self.mode == "linear":
            self._check_fits(start, new, self.capacity)
        else:
            if new > self.capacity:
                raise ValueError(f"{new} new positions > max_seq_len {self.capacity} of the circular cache")
            high = np.maximum(self._high, start + new)
            self._check_ring(start + gained, high, "padding written by this append")
            self._check_chunk(start, new)
        key, value = self._detach(key, value)
        self._write(key, value, start, gained)
        if self.mode == "circular":
            self._high = high
        return self.get()

    def _check_chunk(self, start, new):
        """Circular mode: a chunk of ``new > max_chunk`` positions that wraps
        the ring (``start[b] + new > max_seq_len``) overwrites, with its last
        keys, keys of positions its first queries attend: refuse it before
        anything is written (the caller can split it and try again).  A
        longer chunk that does not wrap loses nothing."""
        if new <= self.max_chunk:
            return
        bad = np.flatnonzero(start + new > self.capacity)
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"an append of {new} positions > max_chunk = {self.max_chunk} (max_seq_len "
                f"{self.capacity} - window {self.window} + 1) at row {b}'s position {start[b]} wraps "
                f"the circular cache: its last keys would overwrite keys its first queries attend; "
                f"append at most max_chunk positions at a time")

    def _check_ring(self, lens, high, culprit):
        """Circular mode: a later chunk of up to ``max_chunk`` queries from
        position ``lens[b]`` needs the positions ``first = max(0, lens[b] -
        window + 1) .. lens[b] - 1`` (none where ``lens[b]`` is 0 or the
        window 1); slot ``p % C`` still holds ``p`` iff nothing at ``p + C``
        or beyond was written, i.e. iff ``p >= high[b] - C`` with ``high[b]``
        one past the furthest position written since reset (padding
        included).  So the ring is sound iff those positions are none or
        ``first >= high[b] - C``: then nothing has wrapped (``high[b] <= C``),
        or ``lens[b] >= high[b] - max_chunk`` and stale slots sit a full
        window behind every later query, which the window mask hides; slots
        written past ``lens[b]`` hold positions the slot order reads as none
        yet."""
        first = np.maximum(lens - self.window + 1, 0)
        bad = np.flatnonzero((first < lens) & (first < high - self.capacity))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"row {b} of the circular cache would keep {lens[b]} tokens, but {culprit} "
                f"(up to position {high[b] - 1}) overwrote keys its next queries need "
                f"(max_chunk = {self.max_chunk})"
            )

    def _held(self):
        return min(self.seq_len, self.capacity) if self.mode == "circular" else self.seq_len

    def positions(self) -> np.ndarray:
        """Absolute position held by each slot of ``get()``, ``(B, slots)``
        int64, -1 where a slot holds nothing (yet) for that row."""
        n = self._held()
        slots = np.arange(n)
        if self.mode == "linear":
            return np.where(slots < self._lens[:, None], slots, -1)
        return self._slot_positions(self._lens, n)

    def _slot_positions(self, end, n):
        # Slot s holds the latest position p < end with p % C == s (or none).
        end = end[:, None]
        pos = end - 1 - (end - 1 - np.arange(n)) % self.capacity
        return np.where(pos >= 0, pos, -1)

    def attention_inputs(self) -> dict:
        """Keyword arguments for ``numkv.attention(Q, **inputs)`` where ``Q``
        holds the queries of the last ``append``.  Linear mode: ``K`` and
        ``V`` up to the furthest written position, ``nonpad_kv_seqlen`` and
        ``is_causal=True`` (as ``DynamicKVCache.attention_inputs`` says; a
        ``ValueError`` without a previous append).  Circular mode: the held slots
        with a boolean ``attn_mask`` ``(B, 1, S, slots)`` that lets query
        ``q = start[b] + i`` attend the slot holding position ``p`` iff
        ``q - window < p <= q`` — attention over the last ``window`` absolute
        positions, whatever order the ring keeps them in.  Padding written by
        an earlier append with ``lengths`` sits in slots whose interpreted
        position is at least ``window`` behind every later query, so the
        window rule masks it too.
        """
        if self.mode == "linear":
            return super().attention_inputs()
        if self._last is None:
            raise ValueError("attention_inputs() needs a previous append")
        # append() refused every chunk whose last keys overwrote keys its first
        # queries attend (_check_chunk), so whatever it wrote can be served.
        start, new = self._last
        extent = start + new
        n = min(int(extent.max()) if extent.size else 0, self.capacity)
        K, V = self._k[:, :, :n], self._v[:, :, :n]
        if new == 1 and self.window == self.capacity:
            # The ring holds exactly the last min(extent, C) positions, in
            # slots 0 .. min(extent, C) - 1: a valid prefix.
            return dict(K=K, V=V, nonpad_kv_seqlen=np.minimum(extent, self.capacity))
        pos = self._slot_positions(extent, n)[:, None, :]           # (B, 1, n)
        query = (start[:, None] + np.arange(new))[:, :, None]       # (B, S, 1)
        mask = (pos >= 0) & (pos <= query) & (pos > query - self.window)
        return dict(K=K, V=V, attn_mask=mask[:, None])

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens of each row (``n < 0``: drop ``-n`` per
        row).  Circular mode allows it only while the positions the next
        queries need have not been overwritten (``ValueError`` otherwise)."""
        lens = self._crop_lengths(n)
        if self.mode == "circular":
            self._check_ring(lens, self._high, "later positions")
            # A row cropped to nothing needs none of its slots again: what it
            # wrote before is as good as never written.
            self._high = np.where(lens == 0, 0, self._high)
        self._lens = lens
        self._last = None
