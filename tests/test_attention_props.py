"""Metamorphic properties of ``numkv.attention`` (hypothesis).

Each property compares numkv with numkv: two ways of asking the same question
must give the same Y — bit for bit where the arithmetic is the same, within
float32 rounding where only the order of the additions changes (tile sizes,
key chunks).  float32 Q/K/V and masks only, tiny shapes: one compiled
specialisation serves the whole file.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numkv
from numkv import _attention, _config
from numkv._runtime import pool, thread_count
from numkv._reference import attention_reference

EPS32 = float(np.finfo(np.float32).eps)


# --------------------------------------------------------------------------
# problems


@st.composite
def problems(draw, *, past=True, nonpad=True, masks=True):
    """Keyword arguments for ``numkv.attention`` (4-D float32), covering GQA,
    past keys, external-cache lengths, causal, windows, softcap and bool /
    additive masks of every rank (with -inf entries, so whole tiles and whole
    rows get masked)."""
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))
    hq = hkv * group
    sq = draw(st.integers(1, 9))
    skv = draw(st.integers(1, 12))
    p = draw(st.integers(0, 5)) if past else 0
    d = draw(st.integers(1, 8))
    dv = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape, np.float32)

    args = dict(Q=normal(b, hq, sq, d), K=normal(b, hkv, skv, d), V=normal(b, hkv, skv, dv),
                is_causal=draw(st.booleans()),
                softcap=draw(st.sampled_from([0.0, 0.0, 1.5])),
                scale=draw(st.sampled_from([None, 0.7])),
                left_window_size=draw(st.sampled_from([-1, -1, 0, 2, 5])),
                right_window_size=draw(st.sampled_from([-1, -1, 0, 3])))
    if p:
        args.update(past_key=normal(b, hkv, p, d), past_value=normal(b, hkv, p, dv))
    elif nonpad and draw(st.booleans()):
        args["nonpad_kv_seqlen"] = rng.integers(0, skv + 1, b)
    total = p + skv
    if masks:
        kind = draw(st.sampled_from([None, "bool", "float"]))
        if kind is not None:
            args["attn_mask"] = draw(mask_arrays(kind, (b, hq, sq, total), seed))
    return args


@st.composite
def mask_arrays(draw, kind, target, seed, rank=None):
    """A bool or additive float32 mask broadcasting to ``target`` (last
    dimension possibly shorter than ``total_sequence_length``)."""
    rng = np.random.default_rng(seed + 1)
    rank = draw(st.integers(1, 4)) if rank is None else rank
    shape = [n if draw(st.booleans()) else 1 for n in target[4 - rank:3]]
    shape.append(draw(st.integers(max(1, target[3] - 2), target[3])))
    if kind == "bool":
        return rng.random(shape) < 0.75
    mask = rng.standard_normal(shape, np.float32)
    mask[rng.random(shape) < 0.2] = -np.inf
    return mask


def _bits(y):
    return np.ascontiguousarray(y).tobytes()


def assert_same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if _bits(got) != _bits(want):
        diff = np.abs(got.astype(np.float64) - want)
        raise AssertionError(f"not bit-identical: max |diff| {np.nanmax(diff):.3g}, "
                             f"{int((got != want).sum())} of {got.size} elements differ")


def assert_close_f32(got, want, args):
    """Equal up to float32 rounding of a reordered sum.

    Y = sum_j p_j v_j / sum_j p_j.  Changing the tile size or the key chunks
    only changes where the online softmax rescales (by exp(m_old - m_new),
    one rounding each) and the order of the additions, and adds the chunk
    merges; each element goes through at most ~2 (T + tiles + chunks) <= 4 T
    float32 roundings of terms bounded by max|V| (p_j / sum p <= 1).  So the
    error is at most ~4 T eps32 max|V| (T = total_sequence_length <= 17 here,
    i.e. < 1e-5 max|V|): that is the tolerance, a few ulps of Y's scale, far
    below what a dropped, doubled or misplaced key would move Y by.  (Measured
    on this file's examples: the largest difference is ~3% of it, ~2 ulps.)
    """
    total = args["K"].shape[2] + (args["past_key"].shape[2] if "past_key" in args else 0)
    scale = max(1.0, float(np.abs(args["V"]).max()),
                float(np.abs(args["past_value"]).max()) if "past_value" in args else 0.0)
    atol = 4 * (total + 2) * EPS32 * scale
    assert np.isfinite(got).all() and np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def _prepare(args):
    args = dict(args)
    return _attention.prepare(args.pop("Q"), args.pop("K"), args.pop("V"), **args)


tiles = st.tuples(st.integers(1, 10), st.integers(1, 10), st.integers(1, 20))


# --------------------------------------------------------------------------
# tiles, chunks, threads


@given(problems(), tiles)
def test_tile_sizes_and_kv_chunk_do_not_change_y(args, tile):
    block_q, block_k, kv_chunk = tile
    call = _prepare(args)
    want = _attention.run(call)
    got = _attention.run(call, block_q=block_q, block_k=block_k, kv_chunk=kv_chunk)
    assert_close_f32(got, want, args)


@given(problems(), tiles)
def test_kernel_matches_reference_path(args, tile):
    # numkv's plain NumPy path (the one NUMKV_REFERENCE=1 forces) and the kernel
    # on any tiling: same float32 arithmetic up to the order of the additions.
    call = _prepare(args)
    block_q, block_k, kv_chunk = tile
    got = _attention.run(call, block_q=block_q, block_k=block_k, kv_chunk=kv_chunk)
    want = call.finish(attention_reference(call)[0])
    assert_close_f32(got, want, args)


def run_on_threads(call, threads, claim=False, **kwargs):
    """``_attention.run`` with numkv's pool at ``threads`` threads, no call
    treated as small (so the work really is split), and a check that it was.
    Items go in equal contiguous shares to the threads (so each thread really
    computes some), or, ``claim``, one at a time to whichever asks first."""
    shares = []
    run = pool.run

    def spy(kernel, n_items, args, small=False, claimed=False, max_threads=None, release_gil=False):
        assert claimed == (claim and kernel.__name__ == "attention_items")
        shares.append(1 if small else min(threads, n_items))
        return run(kernel, n_items, args, small, claimed, max_threads, release_gil)

    with pytest.MonkeyPatch.context() as mp:
        for threshold in ("SINGLE_THREAD_MACS", "SPLIT_MACS", "THREAD_MACS"):
            mp.setattr(_config, threshold, 0)
        mp.setattr(_config, "CLAIM_ITEMS", claim)
        mp.setattr(thread_count, "get_num_threads", lambda: threads)
        mp.setattr(pool, "run", spy)
        y = _attention.run(call, **kwargs)
    return y, max(shares)


@given(args=problems(), tile=st.one_of(st.none(), tiles))
def test_thread_count_does_not_change_y(args, tile):
    call = _prepare(args)
    kwargs = {} if tile is None else dict(zip(("block_q", "block_k", "kv_chunk"), tile))
    one, _ = run_on_threads(call, 1, **kwargs)
    for threads in (2, 3):
        other, _ = run_on_threads(call, threads, **kwargs)
        assert_same_bits(other, one)


def assert_same_on_threads(call, counts, **kwargs):
    """Y on each of ``counts`` threads (all really used) has the bits of Y on
    one thread; returns that Y."""
    one, _ = run_on_threads(call, 1, **kwargs)
    for threads in counts:
        other, used = run_on_threads(call, threads, **kwargs)
        assert used == threads
        assert_same_bits(other, one)
    return one


def test_claimed_items_give_the_bits_of_one_thread():
    # Threads claiming items one at a time (the default): whichever thread
    # computes an item, and in whatever order, Y has the same bits.
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 4, 70, 16), np.float32)
    k = rng.standard_normal((2, 2, 900, 16), np.float32)
    v = rng.standard_normal((2, 2, 900, 16), np.float32)
    for call in (_attention.prepare(q, k, v, is_causal=True),
                 _attention.prepare(q[:, :, :1], k, v)):  # a split decode: chunks, then the merge
        for tiles in ({}, {"block_q": 4}):
            one, _ = run_on_threads(call, 1, **tiles)
            for threads in (2, 3, 2, 3):
                assert_same_bits(run_on_threads(call, threads, claim=True, **tiles)[0], one)


def test_thread_count_does_not_change_y_prefill():
    # A causal prefill with many work items, split over 2, 3 and 5 threads.
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 70, 16), np.float32)
    k = rng.standard_normal((2, 2, 70, 16), np.float32)
    v = rng.standard_normal((2, 2, 70, 16), np.float32)
    assert_same_on_threads(_attention.prepare(q, k, v, is_causal=True), (2, 3, 5), block_q=4, block_k=8)


def test_thread_count_does_not_change_y_split_decode():
    # Decode shape with the default split of the key range into chunks (few
    # work items, a long cache): the partials are merged in chunk order.
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 1, 16), np.float32)
    k = rng.standard_normal((1, 1, 3000, 16), np.float32)
    v = rng.standard_normal((1, 1, 3000, 16), np.float32)
    call = _attention.prepare(q, k, v, nonpad_kv_seqlen=np.array([2900]), is_causal=True)
    chunk = _attention._kv_chunk(1, call.total, _config.LOOP_BLOCK_K, _config.TARGET_ITEMS)
    assert chunk < call.total  # it splits
    one = assert_same_on_threads(call, (2, 3))
    assert_close_f32(one, _attention.run(call, kv_chunk=call.total), {"K": k, "V": v})


def test_threads_are_capped_by_the_work(monkeypatch):
    """A call uses at most one thread per THREAD_MACS multiply-adds (a share
    handed out costs ~20 us), whatever numkv's thread count, and Y does not
    change with it."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 32, 1, 128), np.float32)
    k = rng.standard_normal((1, 8, 1024, 128), np.float32)      # 8.4M MACs: 2 threads
    used, run = [], pool.run

    def spy(kernel, n_items, args, small=False, claimed=False, max_threads=None, release_gil=False):
        if kernel.__name__ == "attention_items":
            used.append(1 if small else min(16, n_items, max_threads or 16))
        return run(kernel, n_items, args, small, claimed, max_threads, release_gil)

    monkeypatch.setattr(thread_count, "get_num_threads", lambda: 16)
    monkeypatch.setattr(pool, "run", spy)
    y16 = numkv.attention(q, k, k)
    long_k = np.concatenate([k] * 4, axis=2)                      # 33.5M MACs: 8 threads
    numkv.attention(q, long_k, long_k)
    assert used == [2, 8]
    monkeypatch.setattr(thread_count, "get_num_threads", lambda: 1)
    np.testing.assert_array_equal(y16, numkv.attention(q, k, k))


def test_small_calls_keep_the_key_range_whole(monkeypatch):
    # A call below SPLIT_MACS keeps its keys whole (on one thread or two:
    # nothing to merge); a larger one splits them into chunks.  Both match a
    # forced split.
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 1, 16), np.float32)
    k = rng.standard_normal((1, 1, 3000, 16), np.float32)
    v = rng.standard_normal((1, 1, 3000, 16), np.float32)
    call = _attention.prepare(q, k, v)
    macs = 4 * 3000 * 32
    splits, run = [], pool.run

    def spy(kernel, n_items, args, *rest, **options):
        splits.append(args[-1].size > 0)  # chunks_done: counted only where the keys are split
        return run(kernel, n_items, args, *rest, **options)

    monkeypatch.setattr(pool, "run", spy)
    for threshold, split in ((macs + 1, False), (macs, True)):
        splits.clear()
        monkeypatch.setattr(_config, "SPLIT_MACS", threshold)
        y = _attention.run(call)
        assert splits == [split]
        assert_close_f32(y, _attention.run(call, kv_chunk=512), {"K": k, "V": v})


# --------------------------------------------------------------------------
# equivalent inputs


@given(st.data(), problems(masks=False), st.sampled_from(["bool", "float"]),
       st.integers(1, 3))
def test_low_rank_mask_equals_its_rank4_broadcast(data, args, kind, rank):
    b, hq, sq, _ = args["Q"].shape
    total = args["K"].shape[2] + (args["past_key"].shape[2] if "past_key" in args else 0)
    mask = data.draw(mask_arrays(kind, (b, hq, sq, total), 7, rank=rank))
    full = np.broadcast_to(mask, (b, hq, sq, mask.shape[-1])).copy()
    assert_same_bits(numkv.attention(**args, attn_mask=mask),
                     numkv.attention(**args, attn_mask=full))


@st.composite
def layouts(draw, arr):
    """A strided view holding values like ``arr``'s: a slice of a larger
    buffer (a cache), a ``(b, s, h, d)`` transpose, reversed axes, Fortran
    order, or a zero-stride broadcast of the first batch row."""
    kind = draw(st.sampled_from(["slice", "transpose", "reversed", "fortran", "broadcast"]))
    if kind == "broadcast":
        return np.broadcast_to(arr[:1], arr.shape)  # read-only, batch stride 0
    if kind == "slice":
        lead = [draw(st.integers(0, 2)) for _ in range(arr.ndim)]
        tail = [draw(st.integers(0, 3)) for _ in range(arr.ndim)]
        big = np.zeros([n + lo + hi for n, lo, hi in zip(arr.shape, lead, tail)], arr.dtype)
        view = big[tuple(slice(lo, lo + n) for lo, n in zip(lead, arr.shape))]
    elif kind == "transpose" and arr.ndim == 4:
        view = np.empty((arr.shape[0], arr.shape[2], arr.shape[1], arr.shape[3]),
                        arr.dtype).transpose(0, 2, 1, 3)
    elif kind == "reversed":
        view = np.flip(np.empty_like(arr), tuple(i for i in range(arr.ndim) if draw(st.booleans())))
    else:
        view = np.asfortranarray(np.empty_like(arr))
    view[...] = arr
    return view


@given(st.data(), problems())
def test_strided_views_equal_contiguous_copies(data, args):
    views = {name: data.draw(layouts(x), label=name) if isinstance(x, np.ndarray) else x
             for name, x in args.items()}
    copies = {name: np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x
              for name, x in views.items()}
    assert_same_bits(numkv.attention(**views), numkv.attention(**copies))


@given(problems(masks=False))
def test_3d_inputs_equal_4d(args):
    q, k, v = args.pop("Q"), args.pop("K"), args.pop("V")
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]

    def three_d(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(x.shape[0], x.shape[2], -1)

    y4 = numkv.attention(q, k, v, **args)
    y3 = numkv.attention(three_d(q), three_d(k), three_d(v), q_num_heads=hq,
                         kv_num_heads=hkv, **args)
    assert y3.shape == (b, sq, hq * v.shape[3])
    assert_same_bits(y3, three_d(y4))


@given(problems())
def test_gqa_equals_mha_with_repeated_kv(args):
    group = args["Q"].shape[1] // args["K"].shape[1]
    repeated = dict(args)
    for name in ("K", "V", "past_key", "past_value"):
        if name in args:
            repeated[name] = np.repeat(args[name], group, axis=1)
    # A kv head is an index map: with the loop kernel each query row does the
    # same arithmetic whether its K/V tile is shared with other heads or not
    # (bit-identical).  The matrix products' tiles hold G heads' rows, so
    # their query tiles, and with them the key tiles a window starts and the
    # sums' vectorised order (``_exp_row_sum``), follow G: only float32
    # rounding may differ.
    loop, gemm = 1 << 30, 1
    assert_same_bits(_attention.run(_prepare(args), gemm_rows=loop),
                     _attention.run(_prepare(repeated), gemm_rows=loop))
    assert_close_f32(_attention.run(_prepare(args), gemm_rows=gemm),
                     _attention.run(_prepare(repeated), gemm_rows=gemm), args)


@given(problems(past=False, nonpad=False, masks=False), st.data())
def test_causal_nonpad_equals_explicit_mask(args, data):
    b, _, sq, _ = args["Q"].shape
    skv = args["K"].shape[2]
    nonpad = np.array(data.draw(st.lists(st.integers(0, skv), min_size=b, max_size=b)))
    args["is_causal"] = True
    args["left_window_size"] = args["right_window_size"] = -1
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    n = nonpad[:, None, None, None]
    # bottom-right causal for an external cache: offset nonpad[b] - Sq
    mask = (j < n) & (j <= i + n - sq)          # (B, 1, Sq, Skv)
    explicit = dict(args, is_causal=False, attn_mask=mask)
    # Bit-identical with the loop kernel; the matrix products' softmax sums a
    # tile in an order that depends on its length (the mask's keys make the
    # tiles longer), so there only float32 rounding may differ.
    loop, gemm = 1 << 30, 1
    got = _attention.run(_prepare(dict(args, nonpad_kv_seqlen=nonpad)), gemm_rows=loop)
    assert_same_bits(got, _attention.run(_prepare(explicit), gemm_rows=loop))
    assert_close_f32(_attention.run(_prepare(dict(args, nonpad_kv_seqlen=nonpad)), gemm_rows=gemm),
                     _attention.run(_prepare(explicit), gemm_rows=gemm), args)
    empty = ~mask.any(axis=-1)                  # queries that see no key: zero rows
    assert (got[np.broadcast_to(empty, got.shape[:3])] == 0).all()
