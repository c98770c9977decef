"""numkv.tensor_scatter against onnx.reference's TensorScatter, bit-exact.

* the grid: every dtype x rank 2-5 x every axis (positive and negative), both
  modes (wrap-around and negative circular indices), with and without
  ``write_indices``, and the three ``out`` forms;
* strided inputs (transposed, sliced, negative and step strides, unaligned,
  broadcast updates), through the serial and the parallel kernel;
* the reference path (``_config.REFERENCE``) agrees with the kernels;
* every bad input of API.md: exception type, a message naming the argument and
  value, and a failed in-place call leaves the cache byte-identical;
* hypothesis properties: the written window reads back as the update, circular ==
  linear on a rolled cache, in place == functional;
* a structured array's field as the cache, the update passed as ``out``.
"""

import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numkv
import oracle
from conftest import SCATTER_DTYPES, random_bits, same_bits
from numkv import _config, _scatter
from numkv._runtime import pool, thread_count
from numkv._kernels import scatter as scatter_kernels
from numba.core import types as numba_types

HUGE = 1 << 62  # PARALLEL_MIN_BYTES that no input reaches: always the serial kernel


def random_values(rng, shape, dtype):
    """``conftest.random_bits``, with strings built without a Python loop (the
    strided tests make buffers of thousands of them)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "UO":
        width = dtype.itemsize // 4 if dtype.kind == "U" else 5
        letters = np.frombuffer(b"abcxyz", np.uint8).astype(np.uint32)
        codes = rng.choice(letters, (*shape, width))
        strings = np.ascontiguousarray(codes).view(f"<U{width}")[..., 0]
        return strings.astype(dtype)
    return random_bits(rng, shape, dtype)


def dtype_id(dtype):
    return {"U": f"U{dtype.itemsize // 4}", "O": "object"}.get(dtype.kind, dtype.name)


DTYPE_PARAMS = [pytest.param(d, id=dtype_id(d)) for d in SCATTER_DTYPES]


def by_name(*names):
    return [p for p in DTYPE_PARAMS if p.id in names]


def scatter_window(cache, update, write_indices, axis, mode):
    """Per batch row, the cache positions the update lands on (independent of
    numkv and of the oracle)."""
    max_seq, seq_len = cache.shape[axis], update.shape[axis]
    starts = np.zeros(cache.shape[0], np.int64) if write_indices is None else np.asarray(write_indices)
    positions = [int(w) + np.arange(seq_len) for w in starts]
    if mode == "circular":
        positions = [p % max_seq for p in positions]
    return positions


def check_forms(past, update, write_indices, axis, mode, rng, expected=None):
    """Run the three ``out`` forms and compare each with the oracle, bit-exact.

    Checks ``past`` is not modified unless it is ``out``, that ``out`` is the
    object returned, and that a functional result owns its memory.
    """
    if expected is None:
        expected = oracle.tensor_scatter(past, update, write_indices, axis=axis, mode=mode)
    past_before = past.copy()
    update_before = update.copy()
    where = f"axis={axis} mode={mode} write_indices={write_indices}"

    got = numkv.tensor_scatter(past, update, write_indices, axis=axis, mode=mode)
    assert same_bits(got, expected), f"out=None, {where}"
    assert not np.shares_memory(got, past) and not np.shares_memory(got, update)
    assert same_bits(past, past_before), f"past_cache modified with out=None, {where}"

    out = random_values(rng, past.shape, past.dtype)  # garbage: every element must be written
    got = numkv.tensor_scatter(past, update, write_indices, axis=axis, mode=mode, out=out)
    assert got is out
    assert same_bits(out, expected), f"out=other, {where}"
    assert same_bits(past, past_before), f"past_cache modified with out=other, {where}"

    # In place, through the kernel and through the NumPy reference path.
    for reference in (False, True):
        cache = past.copy()
        saved, _config.REFERENCE = _config.REFERENCE, reference
        try:
            got = numkv.tensor_scatter(cache, update, write_indices, axis=axis, mode=mode, out=cache)
        finally:
            _config.REFERENCE = saved
        assert got is cache
        assert same_bits(cache, expected), f"out=past_cache (reference path: {reference}), {where}"
        assert same_bits(update, update_before)


# --------------------------------------------------------------------------- grid

MAX_SEQ, SEQ_LEN = 5, 3
OTHER_DIMS = (2, 3, 2, 2, 2)  # batch 2 first; small, the oracle loops in Python
RANK_AXES = [(rank, axis) for rank in range(2, 6)
             for axis in [*range(1, rank), *range(-(rank - 1), 0)]]
# linear: rows write at different places, one ending exactly at max_seq.
# circular: both rows wrap around; one index negative, one above max_seq.
WRITE_INDICES = {"linear": [None, [2, 0]], "circular": [None, [-2, 9]]}


@pytest.mark.parametrize("rank, axis", [pytest.param(r, a, id=f"rank{r}-axis{a}") for r, a in RANK_AXES])
@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_grid_matches_oracle(dtype, rank, axis, rng):
    shape = list(OTHER_DIMS[:rank])
    shape[axis] = MAX_SEQ
    update_shape = list(shape)
    update_shape[axis] = SEQ_LEN
    past = random_values(rng, shape, dtype)
    update = random_values(rng, update_shape, dtype)
    for mode, cases in WRITE_INDICES.items():
        for write_indices in cases:
            w = None if write_indices is None else np.array(write_indices, np.int64)
            check_forms(past, update, w, axis, mode, rng)


def test_grid_wraps_where_expected():
    """The grid's circular indices really wrap, and its linear ones reach the end."""
    past = np.zeros((2, MAX_SEQ), np.int8)
    update = np.ones((2, SEQ_LEN), np.int8)
    got = numkv.tensor_scatter(past, update, np.array(WRITE_INDICES["circular"][1]), axis=1, mode="circular")
    np.testing.assert_array_equal(got, [[1, 0, 0, 1, 1], [1, 1, 0, 0, 1]])
    got = numkv.tensor_scatter(past, update, np.array(WRITE_INDICES["linear"][1]), axis=1)
    np.testing.assert_array_equal(got, [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])


def test_default_axis_is_minus_two(rng):
    past = random_values(rng, (2, 3, 6, 4), np.float32)
    update = random_values(rng, (2, 3, 2, 4), np.float32)
    got = numkv.tensor_scatter(past, update, [1, 4])
    assert same_bits(got, oracle.tensor_scatter(past, update, [1, 4], axis=-2))
    got = numkv.tensor_scatter(past, update, np.array([1, 4]), axis=np.int64(2))
    assert same_bits(got, oracle.tensor_scatter(past, update, [1, 4], axis=2))


# --------------------------------------------------------------------------- layouts
#
# A layout is (buffer shape, view of buffer): the view has the logical shape.
# In place on a view, the buffer outside the view must stay as it was.

def layout(name, shape, axis, dtype):
    ndim = len(shape)
    dtype = np.dtype(dtype)
    if name == "contiguous":
        return shape, lambda b: b
    if name == "transposed":
        return shape[::-1], lambda b: b.T
    if name == "negative":  # every axis but batch reversed
        return shape, lambda b: b[(slice(None),) + (slice(None, None, -1),) * (ndim - 1)]
    if name == "step":
        return [2 * n + 1 for n in shape], lambda b: b[tuple(slice(1, None, 2) for _ in shape)]
    if name == "sliced":  # longer along the sequence axis, as buf[:, :, :n]
        big = list(shape)
        big[axis] += 3
        index = tuple(slice(None, n) for n in shape)
        return big, lambda b: b[index]
    if name == "batch-major-seq":  # sequence axis outermost in memory, batch reversed
        perm = [axis] + [d for d in range(ndim) if d != axis]
        inv = list(np.argsort(perm))
        return [shape[p] for p in perm], lambda b: b.transpose(inv)[::-1]
    if name == "unaligned":  # a byte buffer at an odd address (smallest unit = 1)
        size = int(np.prod(shape)) * dtype.itemsize
        return [size + 1], lambda b: b[1:].view(dtype).reshape(shape)
    raise AssertionError(name)


def make(rng, shape, axis, dtype, name):
    """``(view, buffer, view_of)``: a view of ``shape`` in ``name``'s layout
    over a random ``buffer``, and the function that takes one from the other."""
    buf_shape, view_of = layout(name, list(shape), axis % len(shape), dtype)
    if name == "unaligned":
        buf = np.zeros(buf_shape, np.uint8)
        view = view_of(buf)
        view[...] = random_values(rng, view.shape, dtype)
    else:
        buf = random_values(rng, buf_shape, dtype)
        view = view_of(buf)
    assert view.shape == tuple(shape), (name, view.shape, shape)
    return view, buf, view_of


CACHE_LAYOUTS = ["contiguous", "transposed", "negative", "step", "sliced", "batch-major-seq", "unaligned"]
UPDATE_LAYOUTS = ["contiguous", "transposed", "negative", "step", "broadcast", "unaligned"]
LAYOUT_DTYPES = by_name("float32", "complex128", "U5", "bfloat16", "uint4", "bool", "float64", "object")


def make_update(rng, shape, axis, dtype, name):
    if name == "broadcast":  # zero strides on every axis but the last
        row = random_values(rng, (1,) * (len(shape) - 1) + (shape[-1],), dtype)
        return np.broadcast_to(row, shape)
    return make(rng, shape, axis, dtype, name)[0]


@pytest.mark.parametrize("path", ["serial", "parallel"])
@pytest.mark.parametrize("dtype, cache_layout", [
    pytest.param(p.values[0], layout, id=f"{p.id}-{layout}") for p in LAYOUT_DTYPES for layout in CACHE_LAYOUTS
    if not (p.id == "object" and layout == "unaligned")  # object arrays have no byte-buffer view
])
def test_strided_layouts(dtype, cache_layout, path, rng, monkeypatch):
    monkeypatch.setattr(_config, "PARALLEL_MIN_BYTES", 0 if path == "parallel" else HUGE)
    calls = spy_kernels(monkeypatch)
    shape = (2, 5, 6, 7)  # every non-batch dim can be the sequence axis; all sizes differ
    for axis in (2, -1, 1):
        update_shape = list(shape)
        update_shape[axis] = 3
        for update_layout in UPDATE_LAYOUTS:
            if dtype.kind == "O" and update_layout == "unaligned":
                continue
            update = make_update(rng, update_shape, axis, dtype, update_layout)
            for mode, w in (("linear", [2, 0]), ("circular", [4, -4])):
                where = f"cache {cache_layout}, update {update_layout}, axis {axis}, {mode}"
                past, buf, view_of = make(rng, shape, axis, dtype, cache_layout)
                expected = oracle.tensor_scatter(np.array(past), np.array(update), w, axis=axis, mode=mode)
                check_forms(past, update, w, axis, mode, rng, expected)

                # in place on the strided cache itself: the rest of the buffer stays
                expected_buf = buf.copy()
                view_of(expected_buf)[...] = expected
                got = numkv.tensor_scatter(past, update, w, axis=axis, mode=mode, out=past)
                assert got is past
                assert same_bits(np.array(past), expected), where
                assert same_bits(buf, expected_buf), f"buffer outside the view written: {where}"

                # into a strided out of another layout: only out's own elements are written
                past, buf, _ = make(rng, shape, axis, dtype, cache_layout)
                buf_before = buf.copy()
                out, out_buf, out_view_of = make(rng, shape, axis, dtype, "step")
                expected_buf = out_buf.copy()
                expected = oracle.tensor_scatter(np.array(past), np.array(update), w, axis=axis, mode=mode)
                out_view_of(expected_buf)[...] = expected
                assert numkv.tensor_scatter(past, update, w, axis=axis, mode=mode, out=out) is out
                assert same_bits(out_buf, expected_buf), where
                assert same_bits(buf, buf_before), where
    if dtype.kind != "O":
        assert calls[path] and not calls["parallel" if path == "serial" else "serial"]


def test_sliced_cache_wraps_at_its_own_length():
    """buf[:, :, :n] has max_sequence_length n, not the buffer's length."""
    buf = np.zeros((2, 1, 8, 1), np.int32)
    cache = buf[:, :, :5]
    update = np.arange(1, 7, dtype=np.int32).reshape(2, 1, 3, 1)
    numkv.tensor_scatter(cache, update, [4, 6], mode="circular", out=cache)
    np.testing.assert_array_equal(buf[:, 0, :, 0], [[2, 3, 0, 0, 1, 0, 0, 0], [0, 4, 5, 6, 0, 0, 0, 0]])
    message = "write_indices[0] = 3: 3 + sequence_length 3 > max_sequence_length 5"
    with pytest.raises(ValueError, match=re.escape(message)):
        numkv.tensor_scatter(cache, update, [3, 0], out=cache)


def test_update_aliasing_the_cache(rng, monkeypatch):
    """An update that is a view of the cache (or of out) is read before it is overwritten."""
    for path in (0, HUGE):
        monkeypatch.setattr(_config, "PARALLEL_MIN_BYTES", path)
        past = random_values(rng, (2, 3, 8, 4), np.float32)
        update = past[:, :, 2:6]
        expected = oracle.tensor_scatter(past.copy(), update.copy(), [3, 1])
        cache = past.copy()
        assert numkv.tensor_scatter(cache, cache[:, :, 2:6], [3, 1], out=cache) is cache
        assert same_bits(cache, expected)
        assert same_bits(numkv.tensor_scatter(past, update, [3, 1]), expected)
        # out overlapping past_cache without being it
        buf = random_values(rng, (2, 3, 10, 4), np.float32)
        before = buf.copy()
        expected = oracle.tensor_scatter(before[:, :, :8], update.copy(), [3, 1])
        got = numkv.tensor_scatter(buf[:, :, :8], update, [3, 1], out=buf[:, :, 2:])
        assert same_bits(got, expected)
        # out the same memory as past_cache through another view object
        cache = past.copy()
        expected = oracle.tensor_scatter(past, update.copy(), [3, 1], mode="circular")
        got = numkv.tensor_scatter(cache, update, [3, 1], mode="circular", out=cache[...])
        assert same_bits(got, expected)
        cache = past.copy()
        got = numkv.tensor_scatter(cache, update, [3, 1], out=cache[::-1])
        assert same_bits(got, oracle.tensor_scatter(past, update.copy(), [3, 1]))
        # update a view of out (out not past_cache)
        out = random_values(rng, past.shape, past.dtype)
        update = out[:, :, 1:5]
        expected = oracle.tensor_scatter(past, update.copy(), [4, 0], mode="circular")
        got = numkv.tensor_scatter(past, update, [4, 0], mode="circular", out=out)
        assert got is out and same_bits(out, expected)


# --------------------------------------------------------------------------- kernel paths

def spy_kernels(monkeypatch):
    """Count scatter kernel runs kept on the calling thread ("serial") and
    spread over numkv's threads ("parallel"), and route calls to the kernel
    even where NUMKV_REFERENCE=1 is set."""
    monkeypatch.setattr(_config, "REFERENCE", False)
    calls = {"serial": 0, "parallel": 0}
    run, real = pool.run, scatter_kernels.scatter_items
    in_pool = []

    def kernel(*args):  # the in-place fast path runs a small write here, not through pool.run
        if not in_pool:
            calls["serial"] += 1
        return real(*args)

    def spy(kernel_, n_items, args, small=False, claimed=False, max_threads=None, release_gil=False):
        if kernel_ is kernel:
            calls["serial" if small else "parallel"] += 1
        in_pool.append(1)
        try:
            return run(kernel_, n_items, args, small, claimed, max_threads, release_gil)
        finally:
            in_pool.pop()

    monkeypatch.setattr(pool, "run", spy)
    monkeypatch.setattr(scatter_kernels, "scatter_items", kernel)
    return calls


def test_default_threshold_picks_the_kernel(rng, monkeypatch):
    """More than PARALLEL_MIN_BYTES moved: parallel kernel; less: serial."""
    assert _config.PARALLEL_MIN_BYTES == 256 * 1024
    calls = spy_kernels(monkeypatch)
    past = random_values(rng, (2, 4, 1024, 32), np.float32)  # 1 MiB
    small = random_values(rng, (2, 4, 64, 32), np.float32)  # 64 KiB
    large = random_values(rng, (2, 4, 600, 32), np.float32)  # 600 KiB
    w = [100, 424]
    cache = past.copy()
    numkv.tensor_scatter(cache, small, w, out=cache)
    assert calls == {"serial": 1, "parallel": 0}
    assert same_bits(cache, oracle.tensor_scatter(past, small, w))
    cache = past.copy()
    numkv.tensor_scatter(cache, large, w, out=cache, mode="circular")
    assert calls == {"serial": 1, "parallel": 1}
    assert same_bits(cache, oracle.tensor_scatter(past, large, w, mode="circular"))
    got = numkv.tensor_scatter(past, small, w)  # the functional form moves the whole cache
    assert calls == {"serial": 1, "parallel": 2}
    assert same_bits(got, oracle.tensor_scatter(past, small, w))


@pytest.mark.parametrize("dtype", by_name("uint8", "float16", "float32", "complex128", "U5", "float8_e4m3fn"))
def test_parallel_equals_serial_any_thread_count(dtype, rng, monkeypatch):
    past = random_values(rng, (3, 4, 37, 5), dtype)
    update = random_values(rng, (3, 4, 20, 5), dtype)
    w = np.array([30, -7, 16])
    expected = oracle.tensor_scatter(past, update, w, mode="circular")
    calls = spy_kernels(monkeypatch)
    results = []
    for threshold in (0, HUGE):
        monkeypatch.setattr(_config, "PARALLEL_MIN_BYTES", threshold)
        for threads in (1, 2, 3, 7):
            monkeypatch.setattr(thread_count, "get_num_threads", lambda n=threads: n)
            results.append(numkv.tensor_scatter(past, update, w, mode="circular"))
            cache = past.copy()
            results.append(numkv.tensor_scatter(cache, update, w, mode="circular", out=cache))
    assert calls["serial"] and calls["parallel"]
    for got in results:
        assert same_bits(got, expected)


# --------------------------------------------------------------------------- edges

@pytest.mark.parametrize("dtype", by_name("float32", "complex128", "U5", "object", "int4"))
def test_zero_length_update(dtype, rng):
    past = random_values(rng, (3, 2, 6, 4), dtype)
    update = random_values(rng, (3, 2, 0, 4), dtype)
    for mode, w in (("linear", None), ("linear", [0, 6, 3]), ("circular", [-1, 13, 6])):
        check_forms(past, update, w, -2, mode, rng)
        assert same_bits(numkv.tensor_scatter(past, update, w, mode=mode), past)


def test_empty_caches():
    for shape, update_shape in (((0, 3, 4), (0, 2, 4)), ((2, 0, 4), (2, 0, 4)), ((2, 3, 0), (2, 1, 0))):
        past = np.zeros(shape, np.float32)
        update = np.zeros(update_shape, np.float32)
        for out_form in ("none", "other", "in-place"):
            out = {"none": None, "other": np.empty(shape, np.float32), "in-place": past}[out_form]
            got = numkv.tensor_scatter(past, update, None, axis=1, out=out)
            assert got.shape == shape and (out is None or got is out)
    # the indices are still checked
    message = "write_indices[1] = 1: 1 + sequence_length 0 > max_sequence_length 0"
    with pytest.raises(ValueError, match=re.escape(message)):
        numkv.tensor_scatter(np.zeros((2, 0, 4)), np.zeros((2, 0, 4)), [0, 1], axis=1)


def test_update_as_long_as_the_cache(rng):
    past = random_values(rng, (2, 3, 5), np.uint16)
    update = random_values(rng, (2, 3, 5), np.uint16)
    check_forms(past, update, None, -1, "linear", rng)
    check_forms(past, update, [3, -11], -1, "circular", rng)


def test_write_indices_forms(rng):
    """int32, int64, lists, tuples and strided index arrays all mean the same; the
    caller's array is not modified (circular mode reduces indices modulo max)."""
    past = random_values(rng, (3, 2, 7, 3), np.int16)
    update = random_values(rng, (3, 2, 4, 3), np.int16)
    for mode, values in (("linear", [3, 0, 2]), ("circular", [-3, 12, 6])):
        expected = oracle.tensor_scatter(past, update, values, mode=mode)
        forms = [np.array(values, np.int32), np.array(values, np.int64), list(values), tuple(values),
                 np.repeat(np.array(values, np.int64), 2)[::2], [np.int32(v) for v in values]]
        for w in forms:
            kept = np.array(w, copy=True)
            check_forms(past, update, w, -2, mode, rng, expected)
            np.testing.assert_array_equal(w, kept)


def test_batch_rows_get_their_own_index():
    """Batch row b uses write_indices[b] for every head (the prefix-to-batch map)."""
    past = np.zeros((3, 4, 6, 1), np.int64)
    update = np.ones((3, 4, 2, 1), np.int64)
    got = numkv.tensor_scatter(past, update, [0, 2, 4])
    for b, w in enumerate([0, 2, 4]):
        expected = np.zeros(6, np.int64)
        expected[w:w + 2] = 1
        for h in range(4):
            np.testing.assert_array_equal(got[b, h, :, 0], expected)


def test_special_bits_survive():
    """NaN payloads, signalling NaNs and -0.0 are copied, never canonicalised."""
    patterns = {np.float16: [0x7C01, 0xFE00, 0x8000], np.float32: [0x7F800001, 0xFFC00123, 0x80000000],
                np.float64: [0x7FF0000000000001, 0xFFF8000000000123, 0x8000000000000000],
                ml_dtypes.bfloat16: [0x7F81, 0xFFC1, 0x8000], ml_dtypes.float8_e5m2: [0x7D, 0xFE, 0x80],
                np.complex64: [0x7F800001FFC00123, 0x8000000080000000, 0x7FC0000100000000]}
    for dtype, bits in patterns.items():
        utype = np.dtype(f"u{np.dtype(dtype).itemsize}")
        update = np.array(bits, utype).view(dtype).reshape(1, 3, 1)
        past = np.zeros((1, 4, 1), dtype)
        for mode in ("linear", "circular"):
            got = numkv.tensor_scatter(past, update, [1], axis=1, mode=mode)
            np.testing.assert_array_equal(got[:, 1:, :].view(utype).ravel(), bits)
        cache = past.copy()
        numkv.tensor_scatter(cache, update, [-3], axis=1, mode="circular", out=cache)
        np.testing.assert_array_equal(cache[:, 1:, :].view(utype).ravel(), bits)


# --------------------------------------------------------------------------- reference path

@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
def test_reference_path_agrees_with_kernels(dtype, rng, monkeypatch):
    shape, update_shape = (3, 2, 6, 3), (3, 2, 4, 3)
    cases = []
    for cache_layout in ("contiguous", "negative"):
        for mode, w in (("linear", None), ("linear", [2, 0, 1]), ("circular", [5, -1, 8])):
            past = make(rng, shape, -2, dtype, cache_layout)[0]
            update = make(rng, update_shape, -2, dtype, "transposed")[0]
            cases.append((past, update, w, mode))
    calls = spy_kernels(monkeypatch)
    for past, update, w, mode in cases:
        monkeypatch.setattr(_config, "REFERENCE", False)
        kernel = numkv.tensor_scatter(past, update, w, mode=mode)
        cache = past.copy()
        numkv.tensor_scatter(cache, update, w, mode=mode, out=cache)
        monkeypatch.setattr(_config, "REFERENCE", True)
        kernel_calls = dict(calls)
        reference = numkv.tensor_scatter(past, update, w, mode=mode)
        ref_cache = past.copy()
        numkv.tensor_scatter(ref_cache, update, w, mode=mode, out=ref_cache)
        out = random_values(rng, shape, dtype)
        numkv.tensor_scatter(past, update, w, mode=mode, out=out)
        assert calls == kernel_calls  # really the reference path
        expected = oracle.tensor_scatter(np.array(past), np.array(update), w, mode=mode)
        for got in (kernel, cache, reference, ref_cache, out):
            assert same_bits(got, expected)


# --------------------------------------------------------------------------- bad input

def _cache():
    # batch 4, max_sequence_length 10 on the default axis -2
    return np.arange(4 * 3 * 10 * 2, dtype=np.float32).reshape(4, 3, 10, 2)


def _update(seq=4, dtype=np.float32, shape=None):
    return np.ones(shape or (4, 3, seq, 2), dtype)


# (id, kwargs overriding the call, exception, exact message fragment); the call is
# tensor_scatter(cache, _update(), None, axis=-2, mode="linear", out=cache).
BAD = [
    ("rank1", dict(past=np.zeros(5, np.float32), update=np.zeros(5, np.float32)), ValueError,
     "past_cache must have rank >= 2 (batch, ..., sequence, ...), got rank 1"),
    ("rank0", dict(past=np.float32(1), update=np.float32(1), out=None), ValueError,
     "past_cache must have rank >= 2 (batch, ..., sequence, ...), got rank 0"),
    ("update-rank3", dict(update=_update(shape=(4, 3, 4))), ValueError,
     "update has rank 3, past_cache has rank 4"),
    ("update-rank5", dict(update=_update(shape=(4, 3, 4, 2, 1))), ValueError,
     "update has rank 5, past_cache has rank 4"),
    ("dtype-float64", dict(update=_update(dtype=np.float64)), TypeError,
     "update has dtype float64, past_cache has dtype float32 (no implicit casting)"),
    ("dtype-int32", dict(update=_update(dtype=np.int32)), TypeError,
     "update has dtype int32, past_cache has dtype float32"),
    ("dtype-byte-order", dict(update=_update(dtype=">f4")), TypeError,
     "update has dtype >f4, past_cache has dtype float32"),
    ("dtype-and-rank", dict(update=_update(shape=(4, 3, 4), dtype=np.float64)), ValueError,
     "update has rank 3, past_cache has rank 4"),
    ("dtype-bfloat16-float16", dict(past=_cache().astype("bfloat16"), update=_update(dtype=np.float16)),
     TypeError, "update has dtype float16, past_cache has dtype bfloat16"),
    ("dtype-U5-U3", dict(past=_cache().astype("U5"), update=_update().astype("U3")), TypeError,
     "update has dtype <U3, past_cache has dtype <U5"),
    ("unsupported-datetime64", dict(past=_cache().astype("M8[s]"), update=_update().astype("M8[s]")),
     TypeError, "past_cache dtype datetime64[s] is not supported"),
    ("unsupported-timedelta64", dict(past=_cache().astype("m8[s]"), update=_update().astype("m8[s]")),
     TypeError, "past_cache dtype timedelta64[s] is not supported"),
    ("unsupported-void2", dict(past=_cache().astype("f2").view("V2"), update=_update().astype("f2").view("V2")),
     TypeError, "past_cache dtype |V2 is not supported"),
    ("unsupported-structured", dict(past=np.zeros((4, 3, 10, 2), [("a", "f4")]),
                                    update=np.zeros((4, 3, 4, 2), [("a", "f4")])),
     TypeError, "past_cache dtype [('a', '<f4')] is not supported"),
    ("axis0", dict(axis=0), ValueError, "axis 0 is the batch axis"),
    ("axis-4", dict(axis=-4), ValueError, "axis -4 is the batch axis"),
    ("axis-rank2", dict(past=np.zeros((4, 10), np.float32), update=np.zeros((4, 4), np.float32)),
     ValueError, "axis -2 is the batch axis"),
    ("axis4", dict(axis=4), ValueError, "axis 4 is out of range for rank 4"),
    ("axis-5", dict(axis=-5), ValueError, "axis -5 is out of range for rank 4"),
    ("axis-float", dict(axis=2.0), TypeError, "axis must be an integer, got 2.0"),
    ("axis-str", dict(axis="2"), TypeError, "axis must be an integer, got '2'"),
    ("axis-None", dict(axis=None), TypeError, "axis must be an integer, got None"),
    ("axis-bool", dict(axis=True), TypeError, "axis must be an integer, got True"),
    ("shape-dim1", dict(update=_update(shape=(4, 2, 4, 2))), ValueError,
     "update.shape[1] = 2 does not match past_cache.shape[1] = 3"),
    ("shape-dim3", dict(update=_update(shape=(4, 3, 4, 5))), ValueError,
     "update.shape[3] = 5 does not match past_cache.shape[3] = 2"),
    ("shape-batch", dict(update=_update(shape=(3, 3, 4, 2))), ValueError,
     "update.shape[0] = 3 does not match past_cache.shape[0] = 4"),
    ("shape-axis1", dict(axis=1, update=_update(shape=(4, 2, 9, 2))), ValueError,
     "update.shape[2] = 9 does not match past_cache.shape[2] = 10 (the sequence axis is axis=1; "),
    ("update-longer", dict(update=_update(seq=11)), ValueError,
     "update sequence_length 11 (axis 2) > max_sequence_length 10"),
    ("mode-wrap", dict(mode="wrap"), ValueError, "mode must be 'linear' or 'circular', got 'wrap'"),
    ("mode-Linear", dict(mode="Linear"), ValueError, "mode must be 'linear' or 'circular', got 'Linear'"),
    ("mode-None", dict(mode=None), ValueError, "mode must be 'linear' or 'circular', got None"),
    ("mode-array", dict(mode=np.array(["circular"])), ValueError,
     "mode must be 'linear' or 'circular', got array(['circular']"),
    ("linear-negative", dict(w=np.array([0, 1, -1, 2])), ValueError,
     "write_indices[2] = -1 is negative (linear mode)"),
    ("linear-overflow", dict(w=np.array([0, 1, 2, 7])), ValueError,
     "write_indices[3] = 7: 7 + sequence_length 4 > max_sequence_length 10"),
    ("linear-overflow-int32", dict(w=np.array([6, 11, 0, 0], np.int32)), ValueError,
     "write_indices[1] = 11: 11 + sequence_length 4 > max_sequence_length 10"),
    ("linear-overflow-list", dict(w=[0, 0, 0, 100]), ValueError,
     "write_indices[3] = 100: 100 + sequence_length 4 > max_sequence_length 10"),
    ("linear-overflow-batch100", dict(past=np.zeros((100, 1, 10, 2), np.float32),
                                      update=np.ones((100, 1, 4, 2), np.float32),
                                      w=np.r_[np.zeros(70, np.int64), 8, np.zeros(29, np.int64)]),
     ValueError, "write_indices[70] = 8: 8 + sequence_length 4 > max_sequence_length 10"),
    ("linear-negative-batch100", dict(past=np.zeros((100, 1, 10, 2), np.float32),
                                      update=np.ones((100, 1, 4, 2), np.float32),
                                      w=np.r_[np.zeros(99, np.int64), -3]),
     ValueError, "write_indices[99] = -3 is negative (linear mode)"),
    ("w-float", dict(w=np.array([0.0, 1.0, 2.0, 3.0])), TypeError,
     "write_indices must be an integer array (int32 or int64), got dtype float64"),
    ("w-float-list", dict(w=[0.0, 1.0, 2.0, 3.0]), TypeError,
     "write_indices must be an integer array (int32 or int64), got dtype float64"),
    ("w-float-circular", dict(w=np.zeros(4, np.float32), mode="circular"), TypeError,
     "write_indices must be an integer array (int32 or int64), got dtype float32"),
    ("w-bool", dict(w=np.zeros(4, bool)), TypeError,
     "write_indices must be an integer array (int32 or int64), got dtype bool"),
    ("w-long", dict(w=np.zeros(5, np.int64)), ValueError,
     "write_indices must have shape (batch_size,) = (4,), got (5,)"),
    ("w-short-list", dict(w=[0, 0]), ValueError, "write_indices must have shape (batch_size,) = (4,), got (2,)"),
    ("w-2d", dict(w=np.zeros((4, 1), np.int64)), ValueError,
     "write_indices must have shape (batch_size,) = (4,), got (4, 1)"),
    ("w-scalar", dict(w=np.int64(0)), ValueError, "write_indices must have shape (batch_size,) = (4,), got ()"),
    ("w-uint64-huge", dict(w=np.array([0, 0, 2**63, 0], np.uint64), mode="circular"), ValueError,
     "write_indices has an entry above the int64 range"),
    ("out-shape", dict(out=np.zeros((4, 3, 9, 2), np.float32)), ValueError,
     "out has shape (4, 3, 9, 2), expected (4, 3, 10, 2)"),
    ("out-dtype", dict(out=np.zeros((4, 3, 10, 2), np.float64)), TypeError,
     "out has dtype float64, expected float32"),
    ("out-list", dict(out=np.zeros((4, 3, 10, 2), np.float32).tolist()), TypeError,
     "out must be a numpy.ndarray or an object with __dlpack__ (written in place), got list"),
    ("out-read-only", dict(out=np.broadcast_to(np.float32(0), (4, 3, 10, 2))), ValueError, "out is read-only"),
    ("out-is-read-only-cache", dict(read_only=True), ValueError, "out (= past_cache) is read-only"),
]


@pytest.mark.parametrize("reference", [False, True], ids=["kernel", "reference"])
@pytest.mark.parametrize("case, exc, message", [pytest.param(k, e, m, id=i) for i, k, e, m in BAD])
def test_bad_input(case, exc, message, reference, monkeypatch):
    """Through the kernel path and the NumPy reference path: the same error,
    nothing written."""
    monkeypatch.setattr(_config, "REFERENCE", reference)
    case = dict(case)
    past = case.pop("past", None)
    past = _cache() if past is None else past.copy()
    update = case.pop("update", _update())
    if case.pop("read_only", False):
        past.flags.writeable = False
    out = case.pop("out", past)  # in place unless the case is about out
    w = case.pop("w", None)
    before = np.array(past, copy=True)
    out_before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
    with pytest.raises(exc, match=re.escape(message)):
        numkv.tensor_scatter(past, update, w, out=out, **case)
    assert before.tobytes() == np.asarray(past).tobytes(), "a failed call modified past_cache"
    if out_before is not None:
        assert out_before.tobytes() == np.asarray(out).tobytes(), "a failed call modified out"


def test_bad_input_on_a_strided_cache_leaves_it_unchanged(rng):
    """Fails after rows 0..2 would have been valid: nothing is written first."""
    buf = random_values(rng, (4, 3, 14, 2), np.float32)
    before = buf.copy()
    cache = buf[:, :, 2:12][:, ::-1]
    for w, message in (([0, 1, 2, 7], "write_indices[3] = 7: 7 + sequence_length 4 > max_sequence_length 10"),
                       ([0, 1, 2, -1], "write_indices[3] = -1 is negative (linear mode)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            numkv.tensor_scatter(cache, _update(), np.array(w), out=cache)
        assert same_bits(buf, before)


@pytest.mark.parametrize("form", ["functional", "out=other", "in place"])
def test_bad_indices_fail_before_the_kernel_runs(form, rng, monkeypatch):
    """A bad row anywhere, the last one too, fails the call before any kernel
    runs: neither the cache nor ``out`` is touched."""
    calls = spy_kernels(monkeypatch)
    past = random_values(rng, (4, 3, 10, 2), np.float32)
    out = {"functional": None, "out=other": random_values(rng, past.shape, past.dtype), "in place": past}[form]
    past_before, out_before = past.copy(), np.copy(out)
    for w, message in (([0, 1, 2, 7], "write_indices[3] = 7: 7 + sequence_length 4 > max_sequence_length 10"),
                       ([0, 1, 2, -1], "write_indices[3] = -1 is negative (linear mode)"),
                       ([0, -5, 9, -1], "write_indices[1] = -5 is negative (linear mode)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            numkv.tensor_scatter(past, _update(), np.array(w, np.int64), out=out)
        assert same_bits(past, past_before)
        if out is not None:
            assert same_bits(out, out_before)
    assert calls == {"serial": 0, "parallel": 0}
    numkv.tensor_scatter(past, _update(), np.array([0, 1, 2, 6], np.int64), out=out)  # the spy works
    assert calls["serial"] + calls["parallel"] == 1


def test_the_kernel_reads_a_private_copy_of_write_indices(rng, monkeypatch):
    """The kernels run without the GIL: what ``scatter_items`` reads must be
    the checked copy, never the caller's array (which another thread could
    change)."""
    seen = []
    kernel = scatter_kernels.scatter_items

    def spy(*args):
        seen.append(args[6])
        return kernel(*args)

    monkeypatch.setattr(_config, "REFERENCE", False)
    monkeypatch.setattr(scatter_kernels, "scatter_items", spy)
    past = random_values(rng, (2, 3, 10, 2), np.float32)
    w = np.array([1, 2], np.int64)
    for seq in (2, 1):  # in place and functional (in place, seq 1 goes to append_token: below)
        numkv.tensor_scatter(past, random_values(rng, (2, 3, seq, 2), np.float32), w, out=past)
        numkv.tensor_scatter(past, random_values(rng, (2, 3, seq, 2), np.float32), w)
    assert len(seen) == 3 and not any(np.shares_memory(s, w) for s in seen)


@pytest.mark.parametrize("circular", [False, True])
def test_the_one_token_kernel_checks_what_it_reads(circular, rng):
    """``append_token`` (the fast path's 1-token append) reads the caller's
    ``write_indices`` itself, once, into a copy of its own, and leaves the
    caller's array as it was: in linear mode a start outside ``0 .. max_seq
    - 1`` returns its batch row and value before anything is written,
    whatever the wrapper checked; circular starts wrap."""
    cache = random_values(rng, (3, 2, 6, 4), np.float32)
    update = random_values(rng, (3, 2, 1, 4), np.float32)
    plan, _, _ = _scatter._make_plan(2, 4, 4, True, cache.shape, update.shape, (cache.strides, update.strides,
                                                                                cache.strides))
    before = cache.copy()
    for w in ([0, 6, 1], [0, 2, -1], [7, 0, 0], [-7, 5, 13]):
        w = np.array(w, np.int64)
        given = w.copy()
        got = scatter_kernels.append_token(cache, update, plan, w, circular)
        assert np.array_equal(w, given)
        if circular:
            expected = oracle.tensor_scatter(before, update, w, mode="circular")
            assert got == (-1, 0) and same_bits(cache, expected)
            cache[...] = before
        else:
            row = int(np.flatnonzero((w < 0) | (w > 5))[0])
            assert got == (row, w[row]) and same_bits(cache, before)


def test_a_bad_start_the_kernel_read_raises_whatever_the_array_holds_now(rng, monkeypatch):
    """The error names what ``append_token`` read, even where another thread
    has changed the caller's array since (the kernel runs without the GIL):
    the call raises, it does not return as if it had written."""
    monkeypatch.setattr(_config, "REFERENCE", False)
    cache = random_values(rng, (2, 3, 10, 2), np.float32)
    update = random_values(rng, (2, 3, 1, 2), np.float32)
    w = np.array([1, 2], np.int64)
    numkv.tensor_scatter(cache, update, w, out=cache)  # caches the layout
    before = cache.copy()
    monkeypatch.setattr(scatter_kernels, "append_token", lambda *args: (1, 10))  # read 10, now 2
    with pytest.raises(ValueError, match=re.escape("write_indices[1] = 10: 10 + sequence_length 1 > "
                                                   "max_sequence_length 10")):
        numkv.tensor_scatter(cache, update, w, out=cache)
    assert same_bits(cache, before)


@pytest.mark.parametrize("form", ["functional", "out=other"])
def test_a_none_cache_is_not_taken_for_an_in_place_call(form):
    """``tensor_scatter(None, u)`` is a functional call (``out is past_cache``
    only because both are None): the error names ``past_cache`` as an input,
    not as a cache "written in place" (nor blames ``out``'s dtype)."""
    update = _update()
    out = None if form == "functional" else _cache()
    out_before = None if out is None else out.copy()
    with pytest.raises(TypeError) as info:
        numkv.tensor_scatter(None, update, out=out)
    message = str(info.value)
    assert message.startswith("past_cache must be an array") and message.endswith("got None"), message
    assert "in place" not in message
    if out is not None:
        assert same_bits(out, out_before)
    with pytest.raises(TypeError, match="^update must be an array .* got None$"):
        numkv.tensor_scatter(_cache(), None)


# --------------------------------------------------------------------------- the in-place fast path
#
# A plain-ndarray in-place call with an int32/int64 write_indices array looks
# its layout up in ``_scatter._appends`` and skips the general path: batch 1
# as one NumPy slice assignment, float32 4-D arrays handed to the kernel
# whole, the rest as unsigned views.  These check it against the oracle, and
# that a layout it has seen still rejects bad input, writing nothing.

FAST_CASES = [  # (id, cache shape, update seq, dtype, axis)
    ("float32-B4-whole", (4, 3, 10, 8), 1, np.float32, -2),
    ("float32-B4-seq3", (4, 3, 10, 8), 3, np.float32, 2),
    ("float32-B1-slice", (1, 3, 10, 8), 1, np.float32, -2),
    ("float32-B1-seq4", (1, 3, 10, 8), 4, np.float32, -2),
    ("bfloat16-B2-views", (2, 3, 10, 8), 1, ml_dtypes.bfloat16, -2),
    ("uint4-B3", (3, 2, 7, 5), 2, ml_dtypes.uint4, 2),
    ("complex128-B2", (2, 3, 6, 2), 1, np.complex128, -2),
    ("float32-rank3-axis1", (2, 9, 12), 1, np.float32, 1),
    ("float64-B1-rank2", (1, 9), 2, np.float64, -1),
]


@pytest.mark.parametrize("shape, seq, dtype, axis", [pytest.param(*c[1:], id=c[0]) for c in FAST_CASES])
@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_fast_path_equals_the_oracle(shape, seq, dtype, axis, mode, rng, monkeypatch):
    """Repeated in-place appends (the layout cached after the first) through
    every branch of the fast path: bit-exact against the oracle, int32 and
    int64 indices, circular writes that wrap, read-only and strided updates."""
    monkeypatch.setattr(_config, "REFERENCE", False)
    ax = axis % len(shape)
    max_seq = shape[ax]
    update_shape = list(shape)
    update_shape[ax] = seq
    cache = random_values(rng, shape, dtype)
    expected = cache.copy()
    for step in range(6):
        batch = shape[0]
        if mode == "linear":
            w = rng.integers(0, max_seq - seq + 1, batch)
        else:
            w = rng.integers(-2 * max_seq, 2 * max_seq, batch)
            if step % 2:
                w[0] = max_seq - 1  # wraps whenever seq > 1
        w = w.astype(np.int32 if step % 2 else np.int64)
        update = random_values(rng, tuple(update_shape), dtype)
        if step == 3:
            update.flags.writeable = False
        if step == 4:  # a strided view of a bigger array (not C-contiguous)
            update = np.repeat(update, 2, axis=-1)[..., ::2] if update.ndim > 2 else update
        expected = oracle.tensor_scatter(expected, np.array(update), w, axis=axis, mode=mode)
        given = w.copy()
        assert numkv.tensor_scatter(cache, update, w, axis=axis, mode=mode, out=cache) is cache
        assert same_bits(cache, expected), f"step {step}, write_indices {w}"
        assert np.array_equal(w, given), "the call changed the caller's write_indices"


@pytest.mark.parametrize("shape, seq, dtype, axis", [pytest.param(*c[1:], id=c[0]) for c in FAST_CASES])
def test_fast_path_rejects_bad_input_on_a_known_layout(shape, seq, dtype, axis, rng, monkeypatch):
    """After a valid call has cached the layout, bad input still raises the
    general path's error and leaves the cache byte-identical."""
    monkeypatch.setattr(_config, "REFERENCE", False)
    ax = axis % len(shape)
    max_seq, batch = shape[ax], shape[0]
    update_shape = list(shape)
    update_shape[ax] = seq
    cache = random_values(rng, shape, dtype)
    update = random_values(rng, tuple(update_shape), dtype)
    numkv.tensor_scatter(cache, update, np.zeros(batch, np.int64), axis=axis, out=cache)  # caches the layout
    last = batch - 1
    over = np.zeros(batch, np.int64)
    over[last] = max_seq - seq + 1
    negative = np.zeros(batch, np.int32)
    negative[last] = -1
    other = np.complex64 if np.dtype(dtype) != np.complex64 else np.complex128
    bad = [
        (dict(w=over), ValueError,
         f"write_indices[{last}] = {max_seq - seq + 1}: {max_seq - seq + 1} + sequence_length {seq} "
         f"> max_sequence_length {max_seq}"),
        (dict(w=negative), ValueError, f"write_indices[{last}] = -1 is negative (linear mode)"),
        (dict(w=negative.astype(np.int64)), ValueError, f"write_indices[{last}] = -1 is negative (linear mode)"),
        (dict(w=np.zeros(batch, np.float64)), TypeError, "write_indices must be an integer array"),
        (dict(w=np.zeros(batch + 1, np.int64)), ValueError, "write_indices must have shape (batch_size,)"),
        (dict(w=np.zeros((batch, 1), np.int64)), ValueError, "write_indices must have shape (batch_size,)"),
        (dict(update=np.zeros(update.shape, other)), TypeError, "(no implicit casting)"),
        (dict(mode="wrap"), ValueError, "mode must be 'linear' or 'circular'"),
        (dict(axis=0), ValueError, "is the batch axis"),
        (dict(axis=float(axis)), TypeError, "axis must be an integer"),
        (dict(read_only=True), ValueError, "out (= past_cache) is read-only"),
    ]
    for case, exc, message in bad:
        case = dict(case)
        w = case.pop("w", np.zeros(batch, np.int64))
        target = cache.copy()
        if case.pop("read_only", False):
            target.flags.writeable = False
        before = target.copy()
        kwargs = {"axis": axis, "mode": "linear", **case}
        with pytest.raises(exc, match=re.escape(message)):
            numkv.tensor_scatter(target, kwargs.pop("update", update), w, out=target, **kwargs)
        assert same_bits(target, before), f"a failed call wrote into the cache: {case}"


def test_fast_path_copies_an_update_that_overlaps_the_cache(rng):
    """An update that is a view of the cache itself goes through a copy (the
    general path), as before: in place equals the oracle on the old values."""
    cache = random_values(rng, (2, 3, 10, 4), np.float32)
    for w in (np.array([5, 0]), np.array([2, 6])):
        update = cache[:, :, 3:5]
        expected = oracle.tensor_scatter(cache.copy(), update.copy(), w)
        assert numkv.tensor_scatter(cache, update, w, out=cache) is cache
        assert same_bits(cache, expected)


def test_whole_float32_arrays_compile_one_variant(rng, monkeypatch):
    """The fast path hands 4-D float32 arrays to the kernel whole (no view
    objects): one more compiled variant of ``scatter_items``, whatever the
    shape, and none for other dtypes or ranks (each costs ~1 s cold)."""
    monkeypatch.setattr(_config, "REFERENCE", False)
    for shape in ((2, 3, 10, 4), (4, 8, 64, 16), (1, 2, 5, 3), (3, 1, 7, 2)):
        for seq in (1, 3):
            cache = random_values(rng, shape, np.float32)
            update = random_values(rng, shape[:2] + (seq,) + shape[3:], np.float32)
            numkv.tensor_scatter(cache, update, np.zeros(shape[0], np.int64), out=cache)
    whole = [s for s in scatter_kernels.scatter_items.signatures if s[2].dtype == numba_types.float32]
    assert {(s[2].ndim, s[3].ndim, s[4].ndim) for s in whole} == {(4, 4, 4)}
    whole = [s for s in scatter_kernels.append_token.signatures if s[0].dtype == numba_types.float32]
    assert {(s[0].ndim, s[1].ndim) for s in whole} == {(4, 4)}
    assert all(s[2].dtype == numba_types.float32 or s[2].ndim == 1 for s in scatter_kernels.scatter_items.signatures)


@pytest.mark.parametrize("case", [
    pytest.param(dict(w=np.array([0, 1, 2, 6])), id="linear-last-fits"),
    pytest.param(dict(update=_update(seq=10)), id="update-as-long"),
    pytest.param(dict(w=np.array([0, 1, -1, 7]), mode="circular"), id="circular-negative-and-overflowing"),
    pytest.param(dict(w=np.array([0, 1, 2, 6], np.int32), mode="linear"), id="int32"),
    pytest.param(dict(update=_update(shape=(4, 3, 10, 1)), axis=-1), id="axis-1"),
    pytest.param(dict(update=_update(shape=(4, 1, 10, 2)), axis=1), id="axis1"),
    pytest.param(dict(past=np.zeros((4, 10), np.float32), update=np.ones((4, 4), np.float32), axis=-1),
                 id="rank2-axis-1"),
])
def test_valid_calls_beside_the_bad_ones(case):
    """Each bad case above differs from one of these valid calls only in its bad part."""
    case = dict(case)
    past = case.pop("past", _cache())
    update = case.pop("update", _update())
    w = case.pop("w", None)
    expected = oracle.tensor_scatter(past, update, w, **case)
    assert numkv.tensor_scatter(past, update, w, out=past, **case) is past
    assert same_bits(past, expected)


# --------------------------------------------------------------------------- properties

LAYOUT_NAMES = ["contiguous", "transposed", "negative", "step"]


@st.composite
def scatter_cases(draw, modes=("linear", "circular")):
    dtype = draw(st.sampled_from(SCATTER_DTYPES))
    rank = draw(st.integers(2, 4))
    shape = [draw(st.integers(1, 3)) for _ in range(rank)]
    axis = draw(st.integers(1, rank - 1))
    max_seq = draw(st.integers(1, 7))
    shape[axis] = max_seq
    seq_len = draw(st.integers(0, max_seq))
    update_shape = list(shape)
    update_shape[axis] = seq_len
    mode = draw(st.sampled_from(modes))
    if mode == "linear":
        w = [draw(st.integers(0, max_seq - seq_len)) for _ in range(shape[0])]
    else:
        w = [draw(st.integers(-3 * max_seq, 3 * max_seq)) for _ in range(shape[0])]
    signed_axis = draw(st.sampled_from([axis, axis - rank]))
    layouts = draw(st.sampled_from(LAYOUT_NAMES)), draw(st.sampled_from(LAYOUT_NAMES))
    seed = draw(st.integers(0, 2**32 - 1))
    past = make(np.random.default_rng(seed), shape, axis, dtype, layouts[0])[0]
    update = make(np.random.default_rng(seed + 1), update_shape, axis, dtype, layouts[1])[0]
    w = np.array(w, draw(st.sampled_from([np.int32, np.int64])))
    if not draw(st.booleans()):
        return past, update, w, signed_axis, mode
    # a twin of past, in the same layout, to be updated in place
    twin = make(np.random.default_rng(seed), shape, axis, dtype, layouts[0])[0]
    return past, update, w, signed_axis, mode, twin


def unpack(case):
    past, update, w, axis, mode = case[:5]
    return past, update, w, axis, mode, (case[5] if len(case) > 5 else past.copy())


@given(scatter_cases())
def test_property_window_reads_back_as_the_update(case):
    past, update, w, axis, mode, _ = unpack(case)
    got = numkv.tensor_scatter(past, update, w, axis=axis, mode=mode)
    ax = axis % past.ndim - 1  # the axis within one batch row
    for b, positions in enumerate(scatter_window(past, update, w, axis % past.ndim, mode)):
        assert same_bits(np.take(got[b], positions, axis=ax), np.ascontiguousarray(update[b]))
        rest = np.setdiff1d(np.arange(past.shape[axis]), positions)
        assert same_bits(np.take(got[b], rest, axis=ax), np.take(past[b], rest, axis=ax))


@given(scatter_cases(modes=("circular",)), st.data())
def test_property_circular_is_linear_on_a_rolled_cache(case, data):
    """Circular at w == roll the row by -(w - t), linear at t, roll back."""
    past, update, w, axis, _, _ = unpack(case)
    ax = axis % past.ndim
    max_seq, seq_len = past.shape[ax], update.shape[ax]
    t = np.array([data.draw(st.integers(0, max_seq - seq_len)) for _ in w])
    shift = w.astype(np.int64) - t
    rolled = np.stack([np.roll(past[b], -shift[b], axis=ax - 1) for b in range(len(w))])
    linear = numkv.tensor_scatter(rolled, update, t, axis=axis, mode="linear")
    back = np.stack([np.roll(linear[b], shift[b], axis=ax - 1) for b in range(len(w))])
    assert same_bits(numkv.tensor_scatter(past, update, w, axis=axis, mode="circular"), back)


@given(scatter_cases())
def test_property_in_place_equals_functional(case):
    past, update, w, axis, mode, cache = unpack(case)  # cache: past's twin, strided as past is
    assert same_bits(cache, past)
    functional = numkv.tensor_scatter(past, update, w, axis=axis, mode=mode)
    assert numkv.tensor_scatter(cache, update, w, axis=axis, mode=mode, out=cache) is cache
    assert same_bits(cache, functional)
    assert same_bits(functional, oracle.tensor_scatter(np.array(past), np.array(update), w, axis=axis, mode=mode))


def test_write_indices_of_any_layout_reuse_the_compiled_kernel(rng, monkeypatch):
    """The kernel gets a contiguous int64 copy of ``write_indices``, whatever
    its layout: read-only, strided, broadcast or byte-swapped ones compile no
    variant of their own (~1.5 s each)."""
    monkeypatch.setattr(_config, "REFERENCE", False)
    past = random_values(rng, (2, 3, 16, 4), np.float32)
    update = random_values(rng, (2, 3, 1, 4), np.float32)
    read_only = np.array([3, 4])
    read_only.flags.writeable = False
    cache = past.copy()
    numkv.tensor_scatter(cache, update, np.array([1, 2]), out=cache)
    signatures = len(scatter_kernels.scatter_items.signatures)
    for w in (read_only, np.arange(4)[::2], np.broadcast_to(np.int64(7), (2,)), np.array([5, 6], ">i8")):
        cache = past.copy()
        assert numkv.tensor_scatter(cache, update, w, out=cache) is cache
        assert same_bits(cache, oracle.tensor_scatter(past, update, np.array(w)))
    assert len(scatter_kernels.scatter_items.signatures) == signatures


# -- a structured array's field as the cache; the update as out --


@pytest.mark.parametrize("field_dtype", ["c8", "U2"])
def test_scatter_field_view_whose_stride_is_not_a_multiple_of_the_itemsize(field_dtype):
    """complex64, 'S4', 'U2' are aligned to less than their size: a structured
    array's field has strides the full-width unit does not divide."""
    rec = np.zeros((2, 4, 1), [("pad", "f4"), ("x", field_dtype)])
    values = np.arange(8).reshape(2, 4, 1)
    rec["x"] = values.astype(field_dtype)
    cache = rec["x"]
    update = np.full((2, 1, 1), 9).astype(field_dtype)
    expected = oracle.tensor_scatter(cache.copy(), update, axis=1)
    assert same_bits(numkv.tensor_scatter(cache, update, axis=1), expected)
    before_pad = rec["pad"].copy()
    numkv.tensor_scatter(cache, update, axis=1, out=cache)
    assert same_bits(np.ascontiguousarray(cache), expected)
    assert same_bits(rec["pad"], before_pad)  # the neighbouring field is untouched


@pytest.mark.parametrize("batch", [1, 8])  # one batch row, several
def test_scatter_update_is_out(batch):
    past = np.zeros((batch, 4, 1))
    update = np.arange(1.0, 4 * batch + 1).reshape(batch, 4, 1).copy()  # owns its memory
    expected = oracle.tensor_scatter(past, update.copy(), np.ones(batch, np.int64), mode="circular", axis=1)
    got = numkv.tensor_scatter(past, update, np.ones(batch, np.int64), mode="circular", axis=1, out=update)
    assert got is update and same_bits(got, expected)
    cache = np.arange(4.0 * batch).reshape(batch, 4, 1).copy()
    expected = oracle.tensor_scatter(cache.copy(), cache.copy(), np.ones(batch, np.int64), mode="circular", axis=1)
    got = numkv.tensor_scatter(cache, cache, np.ones(batch, np.int64), mode="circular", axis=1, out=cache)
    assert same_bits(got, expected)
