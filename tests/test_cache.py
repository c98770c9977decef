"""DynamicKVCache and StaticKVCache: storage, views, errors, the ring.

* appends read back as the concatenation of what went in, per row (ragged
  rows, padding via ``lengths``, a zero-length row), in every cache dtype,
  bit-exact;
* ``get()`` and ``append()`` return views of the buffers; a StaticKVCache never
  reallocates them and a step allocates nothing of their size (tracemalloc);
  a DynamicKVCache reallocates O(log n) times;
* every error of API.md with its exception type, and the cache unchanged after;
* circular mode: which slot holds which position, and ``attention_inputs()``
  through ``numkv.attention`` against onnx.reference's windowed attention over
  the keys in absolute-position order, for single and multi-token chunks that
  wrap around the ring;
* appends whose key and value are views of the cache's own buffers (crossed,
  overlapping, shifted; hypothesis: random overlaps) store what the views held
  before the append, for every cache kind (issue 32);
* a circular cache refuses, before writing, a chunk longer than ``max_chunk``
  that would overwrite keys its own first queries attend (issue 27);
* a DynamicKVCache's ``dtype``, what ``seq_lens``' docstring promises, and the
  caches' reprs.
"""

import copy
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import oracle
from conftest import KINDS, random_bits, same_bits
import numkv
from numkv.cache import DynamicKVCache, StaticKVCache

B, H, D, DV = 3, 2, 4, 5


def kv(rng, n, dtype=np.float32, batch=B, heads=H, d=D, dv=DV):
    k = random_bits(rng, (batch, heads, n, d), dtype) if np.dtype(dtype) != np.float32 else \
        rng.standard_normal((batch, heads, n, d)).astype(np.float32)
    v = random_bits(rng, (batch, heads, n, dv), dtype) if np.dtype(dtype) != np.float32 else \
        rng.standard_normal((batch, heads, n, dv)).astype(np.float32)
    return k, v


def make(kind, dtype=np.float32, capacity=32, window=None):
    if kind == "dynamic":
        return DynamicKVCache()
    mode = "circular" if kind == "circular" else "linear"
    return StaticKVCache(B, H, capacity, D, dtype=dtype, v_head_dim=DV, mode=mode, window=window)


def snapshot(cache):
    keys, values = cache.get()
    copy = None if keys is None else (keys.copy(), values.copy())
    bufs = None if cache._k is None else (cache._k.copy(), cache._v.copy())
    return cache.seq_lens, copy, bufs


def assert_unchanged(cache, snap):
    lens, copy, bufs = snap
    np.testing.assert_array_equal(cache.seq_lens, lens)
    if copy is not None:
        assert same_bits(cache.get()[0], copy[0]) and same_bits(cache.get()[1], copy[1])
    if bufs is not None:
        assert same_bits(cache._k, bufs[0]) and same_bits(cache._v, bufs[1])


# --- storage ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize(
    "dtype", [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
              np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)],
    ids=lambda d: d.name)
def test_append_reads_back_ragged(rng, kind, dtype):
    """Rows gain different numbers of tokens (one gains none); each row's
    cached prefix is exactly its tokens, in order, bit for bit."""
    cache = make(kind, dtype, capacity=40)
    rows = [[[], []] for _ in range(B)]  # per row: key chunks, value chunks
    for new, lengths in [(5, [5, 0, 3]), (1, None), (4, [2, 0, 4]), (1, [1, 0, 1]), (3, None)]:
        k, v = kv(rng, new, dtype)
        keys, values = cache.append(k, v, lengths=lengths)
        gained = [new] * B if lengths is None else lengths
        for b in range(B):
            rows[b][0].append(k[b, :, :gained[b]])
            rows[b][1].append(v[b, :, :gained[b]])
        lens = cache.seq_lens
        assert lens.dtype == np.int64 and cache.seq_len == lens.max()
        assert keys.shape == (B, H, cache.seq_len, D) and values.shape == (B, H, cache.seq_len, DV)
        for b in range(B):
            assert same_bits(keys[b, :, :lens[b]], np.concatenate(rows[b][0], axis=1))
            assert same_bits(values[b, :, :lens[b]], np.concatenate(rows[b][1], axis=1))
    assert cache.seq_lens.tolist() == [12, 4, 12]
    cache.reset()
    assert cache.seq_len == 0


def test_static_append_never_reallocates(rng):
    cache = StaticKVCache(B, H, 64, D, v_head_dim=DV)
    kbuf, vbuf = cache.key_buffer, cache.value_buffer
    for n in (7, 1, 1, 3):
        k, v = kv(rng, n)
        keys, values = cache.append(k, v)
        assert cache.key_buffer is kbuf and cache.value_buffer is vbuf
        assert keys.base is kbuf and values.base is vbuf  # views, not copies
    got_k, got_v = cache.get()
    assert np.shares_memory(got_k, kbuf) and np.shares_memory(got_v, vbuf)
    assert got_k.shape[2] == 12


def test_static_step_allocates_nothing_of_buffer_size(rng):
    """One decode step costs O(new token): tracemalloc sees no buffer-sized
    allocation over many steps (a copy of either buffer would be 512 KiB)."""
    cache = StaticKVCache(2, 4, 4096, 16)
    k, v = kv(rng, 1, batch=2, heads=4, d=16, dv=16)
    cache.append(k, v)  # warm: compile and plan caches
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(200):
            cache.append(k, v)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert cache.seq_len == 201
    assert peak < 64 * 1024, peak


def test_dynamic_growth_is_amortised(rng):
    """Capacity doubles: 300 one-token appends reallocate a handful of times,
    and views returned earlier keep their data."""
    cache = DynamicKVCache()
    k, v = kv(rng, 1)
    first, _ = cache.append(k, v)
    buffers = {id(cache._k)}
    for _ in range(299):
        keys, _ = cache.append(k, v)
        buffers.add(id(cache._k))
    assert cache.seq_len == 300 and cache.capacity < 2 * 300
    assert len(buffers) <= 6  # 16 -> 32 -> ... -> 512
    np.testing.assert_array_equal(first[:, :, 0], k[:, :, 0])
    assert np.shares_memory(keys, cache._k)


def test_crop(rng):
    for cache in (DynamicKVCache(), make("static")):
        k, v = kv(rng, 6)
        cache.append(k, v, lengths=[6, 2, 4])
        cache.crop(3)
        assert cache.seq_lens.tolist() == [3, 2, 3]
        cache.crop(-2)
        assert cache.seq_lens.tolist() == [1, 0, 1]
        k2, v2 = kv(rng, 1)
        keys, _ = cache.append(k2, v2)
        np.testing.assert_array_equal(keys[0, :, :2], np.concatenate([k[0, :, :1], k2[0]], axis=1))


# --- errors ----------------------------------------------------------------

BAD_APPENDS = {
    "batch": (ValueError, r"shape\[0\] \(batch\)", lambda k, v: (k[:2], v[:2])),
    "heads": (ValueError, r"shape\[1\] \(heads\)", lambda k, v: (k[:, :1], v[:, :1])),
    "head_dim": (ValueError, r"key.shape\[3\] \(head_dim\)", lambda k, v: (k[..., :3], v)),
    "v_head_dim": (ValueError, r"value.shape\[3\] \(v_head_dim\)", lambda k, v: (k, v[..., :3])),
    "seq-differs": (ValueError, "new positions", lambda k, v: (k, v[:, :, :1])),
    "rank": (ValueError, "rank 4", lambda k, v: (k[0], v[0])),
    "key-dtype": (TypeError, "key has dtype float16", lambda k, v: (k.astype(np.float16), v)),
    "value-dtype": (TypeError, "value has dtype bfloat16", lambda k, v: (k, v.astype(ml_dtypes.bfloat16))),
    "float64": (TypeError, "no implicit casting", lambda k, v: (k.astype(np.float64), v.astype(np.float64))),
    "list": (TypeError, "numpy.ndarray", lambda k, v: (k.tolist(), v)),
}


@pytest.mark.parametrize("kind", ["dynamic", "static", "circular"])
@pytest.mark.parametrize("case", list(BAD_APPENDS))
def test_bad_append_leaves_cache_unchanged(rng, kind, case):
    exc, message, spoil = BAD_APPENDS[case]
    cache = make(kind, capacity=8, window=4 if kind == "circular" else None)
    k, v = kv(rng, 3)
    cache.append(k, v, lengths=[3, 1, 2])
    snap = snapshot(cache)
    with pytest.raises(exc, match=message):
        cache.append(*spoil(*kv(rng, 2)))
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("kind", ["dynamic", "static", "circular"])
@pytest.mark.parametrize("lengths, exc, message", [
    ([1, 2, 3], ValueError, r"lengths\[2\] = 3 is outside \[0, 2\]"),
    ([1, -1, 0], ValueError, r"lengths\[1\] = -1"),
    ([1, 2], ValueError, "shape"),
    ([1.0, 2.0, 0.0], TypeError, "integer"),
])
def test_bad_lengths(rng, kind, lengths, exc, message):
    cache = make(kind, capacity=8, window=4 if kind == "circular" else None)
    cache.append(*kv(rng, 1))
    snap = snapshot(cache)
    with pytest.raises(exc, match=message):
        cache.append(*kv(rng, 2), lengths=np.array(lengths))
    assert_unchanged(cache, snap)


def test_linear_overflow_names_the_row(rng):
    cache = make("static", capacity=8)
    cache.append(*kv(rng, 6), lengths=[6, 3, 5])
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"overflow at batch row 0: seq_lens\[0\] = 6 \+ 3 new > max_seq_len 8"):
        cache.append(*kv(rng, 3))
    assert_unchanged(cache, snap)
    cache.append(*kv(rng, 2))  # fits every row: fine
    assert cache.seq_lens.tolist() == [8, 5, 7]


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(mode="ring"), ValueError, "mode must be 'linear' or 'circular'"),
    (dict(window=4), ValueError, "window applies to mode='circular' only"),
    (dict(mode="circular", window=9), ValueError, "window 9 > max_seq_len 8"),
    (dict(mode="circular", window=0), ValueError, "window must be >= 1"),
    (dict(dtype=object), TypeError, "not supported"),
], ids=["unknown-mode", "window-linear", "window-too-big", "window-zero", "object-dtype"])
def test_bad_construction(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        StaticKVCache(B, H, 8, D, **kwargs)


def test_dynamic_first_append_fixes_shapes(rng):
    cache = DynamicKVCache()
    with pytest.raises(TypeError, match="value has dtype float16"):
        cache.append(rng.standard_normal((B, H, 2, D)).astype(np.float32),
                     rng.standard_normal((B, H, 2, D)).astype(np.float16))
    assert cache.get() == (None, None) and cache.seq_len == 0
    cache.append(*kv(rng, 2))
    assert cache.dtype == np.float32
    with pytest.raises(ValueError, match="num_heads 2"):
        cache.append(*kv(rng, 1, heads=3))
    cache.reset()
    cache.append(*kv(rng, 1, heads=3))  # reset forgets the shapes
    assert cache.get()[0].shape == (B, 3, 1, D)


# --- the ring --------------------------------------------------------------


def test_circular_slots_hold_latest_positions(rng):
    cache = StaticKVCache(1, 1, 5, 1, mode="circular", window=3)
    assert cache.max_chunk == 3
    for start in range(0, 12, 3):
        key = np.arange(start, start + 3, dtype=np.float32).reshape(1, 1, 3, 1)
        keys, _ = cache.append(key, key)
        pos = cache.positions()
        # every slot holds the latest position congruent to it
        np.testing.assert_array_equal(keys[0, 0, :, 0], pos[0])
    assert cache.seq_lens.tolist() == [12] and pos[0].tolist() == [10, 11, 7, 8, 9]


def _chunks_vs_oracle(rng, cache, sizes, lengths_per_chunk, window, hq=4):
    """Append chunks, attend each chunk's queries through attention_inputs(),
    compare with onnx.reference over the same keys in absolute order."""
    from numkv._attention import attention

    batch, heads, d = cache.key_buffer.shape[0], cache.key_buffer.shape[1], cache.key_buffer.shape[3]
    history_k = [np.zeros((heads, 0, d), np.float32) for _ in range(batch)]
    history_v = [np.zeros((heads, 0, d), np.float32) for _ in range(batch)]
    for new, lengths in zip(sizes, lengths_per_chunk):
        start = cache.seq_lens
        k, v = (rng.standard_normal((batch, heads, new, d)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((batch, hq, new, d)).astype(np.float32)
        cache.append(k, v, lengths=lengths)
        y = attention(q, **cache.attention_inputs())
        gained = [new] * batch if lengths is None else lengths
        for b in range(batch):
            # The written chunk (padding included) extends the row's history.
            full_k = np.concatenate([history_k[b], k[b]], axis=1)
            full_v = np.concatenate([history_v[b], v[b]], axis=1)
            expected = oracle.attention(q[b:b + 1], full_k[None], full_v[None], is_causal=True,
                                        nonpad_kv_seqlen=np.array([start[b] + new]),
                                        left_window_size=window - 1)[0]
            real = gained[b]  # padding queries are meaningless
            np.testing.assert_allclose(y[b, :, :real], expected[0, :, :real], rtol=2e-5, atol=2e-6)
            history_k[b] = full_k[:, :start[b] + real]
            history_v[b] = full_v[:, :start[b] + real]


@pytest.mark.parametrize("capacity, window, sizes", [
    (6, 6, [1] * 15),                       # full-ring window, one token at a time
    (7, 4, [1] * 15),                       # window < ring, one token at a time
    (7, 4, [4, 3, 4, 2, 4, 1, 4]),          # chunks of max_chunk that wrap
    (6, 3, [2, 4, 4, 3, 1, 4, 4]),
], ids=["C6-W6-single", "C7-W4-single", "C7-W4-chunks", "C6-W3-chunks"])
def test_circular_attention_is_windowed_attention(rng, capacity, window, sizes):
    cache = StaticKVCache(2, 2, capacity, 8, mode="circular", window=window)
    _chunks_vs_oracle(rng, cache, sizes, [None] * len(sizes), window)


def test_circular_ragged_padding(rng):
    """Right-padded chunks (one row idle) in a ring: padding may land in slots,
    the window rule still masks it."""
    cache = StaticKVCache(3, 2, 7, 8, mode="circular", window=4)
    sizes = [4, 4, 2, 1, 4, 3, 1]
    lengths = [[4, 0, 2], [3, 0, 4], [2, 1, 0], [1, 1, 0], [4, 2, 4], [1, 3, 3], [1, 1, 1]]
    _chunks_vs_oracle(rng, cache, sizes, [np.array(x) for x in lengths], window=4)


def test_circular_ragged_prefill_before_the_ring_wraps(rng):
    """A right-padded prefill into a ring of window = max_seq_len (max_chunk
    1), then decode steps that wrap it: nothing has wrapped when the padding
    is written, so nothing it overwrote is needed (refused before the
    adversarial review of 2026-11-27)."""
    cache = StaticKVCache(2, 2, 8, 8, mode="circular")
    sizes = [3] + [1] * 10
    lengths = [np.array([3, 1])] + [np.array([1, 1])] * 10
    _chunks_vs_oracle(rng, cache, sizes, lengths, window=8)


def test_circular_crop_before_the_ring_wraps(rng):
    """A crop of more than max_chunk tokens before the ring has wrapped: the
    positions kept were never overwritten."""
    cache, linear = StaticKVCache(1, 1, 8, 2, mode="circular"), StaticKVCache(1, 1, 8, 2)
    k = rng.standard_normal((1, 1, 6, 2)).astype(np.float32)
    for c in (cache, linear):
        c.append(k[:, :, :3], k[:, :, :3])
        c.append(k[:, :, 3:4], k[:, :, 3:4])
        c.crop(2)
        c.append(k[:, :, 4:], k[:, :, 4:])
    q = rng.standard_normal((1, 1, 2, 2)).astype(np.float32)
    assert cache.seq_lens.tolist() == [4]
    np.testing.assert_allclose(numkv.attention(q, **cache.attention_inputs()),
                               numkv.attention(q, **linear.attention_inputs()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [4, 1])
def test_circular_crop_that_needs_no_slot_after_the_ring_wrapped(rng, window):
    """After the ring wrapped, a crop to 0 tokens (or any crop at window 1,
    whose queries attend only their own key) needs no slot it held: it is
    accepted, and the cache then serves as a fresh one holding what came
    after (both were refused, and a crop to 0 left every later append
    refused too)."""
    cache, fresh = (StaticKVCache(1, 1, 4, 2, mode="circular", window=window) for _ in "ab")
    k = rng.standard_normal((1, 1, 9, 2)).astype(np.float32)
    for i in range(6):
        cache.append(k[:, :, i:i + 1], k[:, :, i:i + 1])
    cache.crop(0 if window > 1 else -5)
    if window > 1:
        assert cache.seq_lens.tolist() == [0]
    else:
        fresh.append(k[:, :, :1], k[:, :, :1])  # the cropped cache's length
    for i in range(6, 9):
        q = rng.standard_normal((1, 1, 1, 2)).astype(np.float32)
        for c in (cache, fresh):
            c.append(k[:, :, i:i + 1], k[:, :, i:i + 1])
        np.testing.assert_allclose(numkv.attention(q, **cache.attention_inputs()),
                                   numkv.attention(q, **fresh.attention_inputs()), rtol=1e-6, atol=1e-6)


def test_linear_ragged_attention_inputs(rng):
    cache = StaticKVCache(3, 2, 16, 8)
    sizes = [4, 1, 3, 1, 2]
    lengths = [[4, 0, 2], [1, 1, 0], [3, 2, 3], [1, 1, 1], [0, 2, 1]]
    _chunks_vs_oracle(rng, cache, sizes, [np.array(x) for x in lengths], window=10 ** 6)


def test_circular_long_append_then_attend(rng):
    """append() takes up to max_seq_len positions (it is a ring); a chunk longer
    than max_chunk that does not wrap overwrote nothing, so attention_inputs
    serves it (as a linear cache would), and one that wraps is refused before
    anything is written (issue 27: it used to be written, then refused)."""
    cache = StaticKVCache(1, 1, 8, 2, mode="circular", window=6)
    linear = StaticKVCache(1, 1, 8, 2)
    k = rng.standard_normal((1, 1, 5, 2)).astype(np.float32)
    q = rng.standard_normal((1, 1, 5, 2)).astype(np.float32)
    cache.append(k, k)
    linear.append(k, k)
    y = numkv.attention(q, **cache.attention_inputs())
    np.testing.assert_allclose(y, numkv.attention(q, **linear.attention_inputs(), left_window_size=5),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="max_seq_len 8"):
        cache.append(*(rng.standard_normal((1, 1, 9, 2)).astype(np.float32),) * 2)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="wraps the circular cache"):
        cache.append(*(rng.standard_normal((1, 1, 4, 2)).astype(np.float32),) * 2)
    assert_unchanged(cache, snap)
    cache.append(k[:, :, :1], k[:, :, :1])
    assert cache.attention_inputs()["attn_mask"].shape == (1, 1, 1, 6)


def test_circular_padding_and_crop_guard(rng):
    """Padding or a crop that would uncover overwritten slots is refused."""
    cache = StaticKVCache(1, 1, 5, 2, mode="circular", window=4)  # max_chunk 2
    k = rng.standard_normal((1, 1, 2, 2)).astype(np.float32)
    for _ in range(4):
        cache.append(k, k)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="overwrote keys its next queries need"):
        cache.append(*(rng.standard_normal((1, 1, 4, 2)).astype(np.float32),) * 2, lengths=np.array([1]))
    assert_unchanged(cache, snap)
    cache.crop(-2)  # 6 >= 8 - 2: the window before position 6 is intact
    with pytest.raises(ValueError, match="cannot|overwrote"):
        cache.crop(5)
    assert cache.seq_lens.tolist() == [6]


# -- appends that alias the cache's own buffers (issue 32) --


def _cache(kind, batch=2, heads=2, capacity=12, dim=3, window=None):
    if kind == "dynamic":
        return DynamicKVCache()
    mode = "circular" if kind == "circular" else "linear"
    if kind == "circular" and window is None:
        window = capacity // 2
    return StaticKVCache(batch, heads, capacity, dim, mode=mode, window=window)


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


# -- the ring refuses a chunk it cannot serve, before writing (issue 27) --


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


# -- a DynamicKVCache's dtype (issue 32) --


def test_dynamic_cache_takes_a_dtype():
    cache = DynamicKVCache(dtype=np.float16)
    assert cache.dtype == np.float16
    with pytest.raises(TypeError, match="cache holds float16"):
        cache.append(np.zeros((1, 1, 1, 2), np.float32), np.zeros((1, 1, 1, 2), np.float32))
    assert cache.seq_len == 0
    cache.append(np.zeros((1, 1, 1, 2), np.float16), np.zeros((1, 1, 1, 2), np.float16))
    cache.reset()
    assert cache.dtype == np.float16


# -- what seq_lens' docstring promises (issue 32) --


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


# -- reprs --


def test_static_cache_repr_names_shapes_dtype_mode_and_lengths():
    cache = numkv.StaticKVCache(2, 8, 1024, 64)
    kv = np.zeros((2, 8, 5, 64), np.float32)
    cache.append(kv, kv, lengths=[5, 3])
    assert repr(cache) == ("StaticKVCache(batch_size=2, num_heads=8, max_seq_len=1024, head_dim=64, "
                           "dtype=float32, mode='linear', seq_lens=[5, 3])")


def test_circular_cache_repr_shows_window_and_value_head_size():
    cache = numkv.StaticKVCache(3, 2, 40, 16, v_head_dim=8, dtype=ml_dtypes.bfloat16,
                                mode="circular", window=32)
    assert repr(cache) == ("StaticKVCache(batch_size=3, num_heads=2, max_seq_len=40, head_dim=16, "
                           "v_head_dim=8, dtype=bfloat16, mode='circular', window=32, seq_lens=[0, 0, 0])")


def test_dynamic_cache_repr_before_and_after_the_first_append():
    cache = numkv.DynamicKVCache()
    assert repr(cache).startswith("DynamicKVCache(empty")
    cache.append(np.zeros((1, 2, 20, 4), np.float16), np.zeros((1, 2, 20, 4), np.float16))
    assert repr(cache) == ("DynamicKVCache(batch_size=1, num_heads=2, capacity=20, head_dim=4, "
                           "dtype=float16, mode='linear', seq_lens=[20])")


def test_repr_of_a_large_batch_stays_short():
    assert len(repr(numkv.StaticKVCache(10_000, 1, 4, 2))) < 200


@pytest.mark.parametrize("seed", range(12))
def test_circular_scripts_refuse_exactly_what_the_ring_lost(seed):
    """Random appends (ragged lengths, chunks up to the capacity) and crops on
    a circular cache, with a shadow of which position each slot holds: a
    call is refused iff it would leave a position some later query needs
    overwritten, and every accepted append's queries equal onnx.reference's
    over the history within the window (from the adversarial review of
    2026-11-27: 323 of 1300 refusals were of sound states)."""
    rng = np.random.default_rng(seed)
    batch, capacity = int(rng.integers(1, 4)), int(rng.integers(2, 10))
    window = int(rng.integers(1, capacity + 1))
    cache = StaticKVCache(batch, 1, capacity, 4, mode="circular", window=window)
    history = [np.zeros((2, 1, 0, 4), np.float32) for _ in range(batch)]  # K and V of each row's tokens
    shadow = -np.ones((batch, capacity), np.int64)  # the position each slot holds

    def intact(slots, lens, upto):  # positions each row's queries up to ``upto[b]`` need, in ``slots``
        return all(slots[b, p % capacity] == p for b in range(batch) for query in range(lens[b], upto[b] + 1)
                   for p in range(max(0, query - window + 1), min(query, upto[b])))

    for _ in range(25):
        lens = cache.seq_lens
        if rng.random() < 0.25 and lens.max() > 0:
            n = int(rng.integers(-4, 3))
            new_lens = np.maximum(lens + n, 0) if n < 0 else np.minimum(lens, n)
            sound = intact(shadow, new_lens, new_lens)
            try:
                cache.crop(n)
            except ValueError:
                assert not sound and (cache.seq_lens == lens).all()
                continue
            assert sound
            for b in range(batch):
                history[b] = history[b][:, :, :new_lens[b]]
            continue
        size = int(rng.integers(1, capacity + 1))
        lengths = rng.integers(0, size + 1, batch) if rng.random() < 0.5 else None
        gained = np.full(batch, size) if lengths is None else lengths
        k, v, q = (rng.standard_normal((batch, 1, size, 4)).astype(np.float32) for _ in "kvq")
        slots = shadow.copy()
        for b in range(batch):
            for i in range(size):
                slots[b, (lens[b] + i) % capacity] = lens[b] + i
        sound = intact(slots, lens, lens + gained)
        try:
            cache.append(k, v, lengths=lengths)
        except ValueError:
            assert not sound and (cache.seq_lens == lens).all()
            continue
        assert sound
        shadow = slots
        y = numkv.attention(q, **cache.attention_inputs())
        for b in range(batch):
            # The written chunk, padding included, after the row's history (as ``_chunks_vs_oracle``).
            full = np.concatenate([history[b], np.stack([k[b], v[b]])], axis=2)
            expected = oracle.attention(q[b:b + 1], full[0][None], full[1][None], is_causal=True,
                                        nonpad_kv_seqlen=np.array([lens[b] + size]),
                                        left_window_size=window - 1)[0]
            np.testing.assert_allclose(y[b, :, :gained[b]], expected[0, :, :gained[b]], rtol=2e-5, atol=2e-6)
            history[b] = full[:, :, :lens[b] + gained[b]]
