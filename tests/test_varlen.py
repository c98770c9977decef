"""``numkv.varlen_attention`` and ``numkv.paged_attention``: each sequence's
rows equal ``numkv.attention`` on that sequence alone (API.md), over random
lengths 0..n, page sizes, block tables in any order, GQA, windows, softcap,
sinks and K/V dtypes (float32, bfloat16, q8_0, q4_0, int8 and int4 pages); the float64
loop on one case; the reference path; bad input."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import naive
import numkv
from conftest import same_bits
from numkv import _config

BF16 = np.dtype(ml_dtypes.bfloat16)
D = 32  # a block of q8_0 / q4_0


def _pack(rng, lens_q, lens_k, hq, hkv, dtype=np.float32, dv=D):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    q = rng.standard_normal((cu_q[-1], hq, D)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], hkv, D)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], hkv, dv)).astype(dtype)
    return q, k, v, cu_q, cu_k


def _paginate(rng, k, v, cu_k, block_size, spare=3):
    """A page pool holding each sequence's keys, in pages of a random order,
    and its block table (-1 past each sequence's last page; spare pages of
    garbage in the pool)."""
    n = len(cu_k) - 1
    lens = np.diff(cu_k)
    needed = -(-lens // block_size)
    blocks = int(needed.sum()) + spare
    order = rng.permutation(blocks)
    pool_k = np.full((blocks, block_size) + k.shape[1:], np.nan, k.dtype)
    pool_v = np.full((blocks, block_size) + v.shape[1:], np.nan, v.dtype)
    table = np.full((n, int(needed.max(initial=0)) + 1), -1, np.int64)
    c = 0
    for i in range(n):
        for p in range(needed[i]):
            page = order[c]
            c += 1
            table[i, p] = page
            start, stop = cu_k[i] + p * block_size, cu_k[i] + min(lens[i], (p + 1) * block_size)
            pool_k[page, :stop - start] = k[start:stop]
            pool_v[page, :stop - start] = v[start:stop]
    return pool_k, pool_v, table


def _alone(q, k, v, cu_q, cu_k, i, **attrs):
    """``numkv.attention`` on sequence ``i`` alone, ``(sq, Hq, Dv)``."""
    q4 = q[cu_q[i]:cu_q[i + 1]].transpose(1, 0, 2)[None]
    k4 = k[cu_k[i]:cu_k[i + 1]].transpose(1, 0, 2)[None]
    v4 = v[cu_k[i]:cu_k[i + 1]].transpose(1, 0, 2)[None]
    y = numkv.attention(q4, k4, v4, nonpad_kv_seqlen=np.array([cu_k[i + 1] - cu_k[i]]), **attrs)
    return y[0].transpose(1, 0, 2)


HEADS = [(4, 2), (4, 1), (2, 2), (8, 2)]


@st.composite
def batches(draw):
    n = draw(st.integers(0, 5))
    lens_q = draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    lens_k = draw(st.lists(st.integers(0, 24), min_size=n, max_size=n))
    hq, hkv = draw(st.sampled_from(HEADS))
    attrs = dict(is_causal=draw(st.booleans()), left_window_size=draw(st.integers(-1, 6)),
                 right_window_size=draw(st.sampled_from([-1, -1, 0, 2])),
                 softcap=draw(st.sampled_from([0.0, 0.0, 3.0])))
    return lens_q, lens_k, hq, hkv, attrs, draw(st.booleans()), draw(st.integers(1, 9)), draw(st.integers(0, 2 ** 31))


def _check_each_sequence(y, q, k, v, cu_q, cu_k, attrs, rtol=1e-5, atol=1e-6):
    assert y.shape == (q.shape[0], q.shape[1], v.shape[2])
    for i in range(len(cu_q) - 1):
        if cu_q[i + 1] == cu_q[i]:
            continue
        want = _alone(q, k, v, cu_q, cu_k, i, **attrs)
        np.testing.assert_allclose(np.asarray(y[cu_q[i]:cu_q[i + 1]], np.float64), np.asarray(want, np.float64),
                                   rtol=rtol, atol=atol, err_msg=f"sequence {i}")


@given(batches())
def test_varlen_and_paged_equal_attention_on_each_sequence(batch):
    lens_q, lens_k, hq, hkv, attrs, with_sinks, block_size, seed = batch
    rng = np.random.default_rng(seed)
    q, k, v, cu_q, cu_k = _pack(rng, lens_q, lens_k, hq, hkv)
    if with_sinks:
        attrs["sinks"] = rng.standard_normal(hq) * 2
    y = numkv.varlen_attention(q, k, v, cu_q, cu_k, **attrs)
    _check_each_sequence(y, q, k, v, cu_q, cu_k, attrs)
    pool_k, pool_v, table = _paginate(rng, k, v, cu_k, block_size)
    yp = numkv.paged_attention(q, pool_k, pool_v, table, np.diff(cu_k), cu_q, **attrs)
    _check_each_sequence(yp, q, k, v, cu_q, cu_k, attrs)


@pytest.mark.parametrize("split", [False, True])
def test_one_launch_on_any_thread_count(split, rng, monkeypatch):
    """Every sequence in one launch of the kernel, whatever its threads: a
    long prompt (matrix-product tiles in pairs) beside one-token decodes and
    empty sequences, or decodes whose keys split into chunks; items claimed or in
    shares; each sequence's rows as ``numkv.attention`` on it alone, and Y
    the same bits on 1, 2 and 3 threads (varlen's and paged's each)."""
    from numkv import _attention
    from numkv._runtime import pool, thread_count

    # (a long prompt makes enough items: no split)
    lens_q, lens_k = [1 if split else 70, 1, 0, 1, 3, 0, 1], [90, 300, 5, 1, 40, 0, 0]
    q, k, v, cu_q, cu_k = _pack(rng, lens_q, lens_k, 8, 2)
    pool_k, pool_v, table = _paginate(rng, k, v, cu_k, 16)
    attrs = dict(is_causal=True, left_window_size=50, sinks=rng.standard_normal(8))
    for threshold in ("SINGLE_THREAD_MACS", "THREAD_MACS"):
        monkeypatch.setattr(_config, threshold, 0)
    monkeypatch.setattr(_config, "SPLIT_MACS", 0 if split else 1 << 40)
    monkeypatch.setattr(_config, "MIN_CHUNK", 8)
    launches, chunks, run = [], [], pool.run

    def spy(kernel, n_items, args, *rest, **kwargs):
        launches.append(kernel.__name__)
        chunks.append(args[7][_attention._attention_kernels().N_CHUNKS])  # ints
        return run(kernel, n_items, args, *rest, **kwargs)

    monkeypatch.setattr(pool, "run", spy)
    results = []
    for threads, claim in ((1, False), (2, False), (3, True), (2, True)):
        monkeypatch.setattr(_config, "CLAIM_ITEMS", claim)
        monkeypatch.setattr(thread_count, "get_num_threads", lambda threads=threads: threads)
        y = numkv.varlen_attention(q, k, v, cu_q, cu_k, **attrs)
        yp = numkv.paged_attention(q, pool_k, pool_v, table, np.diff(cu_k), cu_q, **attrs)
        results += [y, yp]
    assert launches == ["attention_items"] * 8  # one launch a call
    assert (min(chunks) > 1) == split
    for first in results[:2]:  # (paged: tiles within a page, not the same bits as varlen's)
        _check_each_sequence(first, q, k, v, cu_q, cu_k, attrs)
    for i, other in enumerate(results[2:]):
        np.testing.assert_array_equal(other, results[i % 2])


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16", "q8_0"])
def test_an_item_of_every_kv_head_gives_the_same_bits(fmt, rng, monkeypatch):
    """Keys that lie token-major, read by decode's loops: an item covers
    every kv head, each tile of every head in turn
    (``_attention._heads_per_item``).  Y has the same bits as with an item a
    kv head and the same tiles, on 1-3 threads: varlen (GQA, MHA; causal,
    windows, softcap, sinks), paged (pages of 5 and 16 keys; q8_0 pages), and
    ``numkv.attention`` over token-major views with a past and a mask."""
    from numkv import _attention
    from numkv._runtime import thread_count

    dtype = {"float16": np.float16, "bfloat16": BF16}.get(fmt, np.float32)
    heads_seen = []

    real = _attention._heads_per_item

    def forced(on):
        def heads(kv, token_major, hkv, uses_gemm):
            heads_seen.append(real(kv, token_major, hkv, uses_gemm) if on else 1)
            return heads_seen[-1]
        return heads

    def both(fn):
        results = []
        for on in (False, True):
            monkeypatch.setattr(_attention, "_heads_per_item", forced(on))
            for threads in (1, 2, 3):
                monkeypatch.setattr(thread_count, "_threads", threads)
                _attention._layouts.clear()  # (a kept layout or plan would keep its items' heads)
                _attention._step_plans.clear()
                results.append(fn())
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0])
        return results[0]

    for hq, hkv in ((8, 2), (4, 4)):
        lens_q, lens_k = [1, 1, 0, 1, 3, 1], [150, 7, 3, 0, 300, 64]
        q, k, v, cu_q, cu_k = _pack(rng, lens_q, lens_k, hq, hkv, dtype)
        attrs = dict(is_causal=True, left_window_size=100, softcap=4.0, sinks=rng.standard_normal(hq))
        if fmt != "q8_0":
            y = both(lambda: numkv.varlen_attention(q, k, v, cu_q, cu_k, **attrs))
            _check_each_sequence(y, q, k, v, cu_q, cu_k, attrs, rtol=1e-2 if dtype != np.float32 else 1e-5)
        for block_size in (5, 16):
            pool_k, pool_v, table = _paginate(rng, k, v, cu_k, block_size)
            if fmt == "q8_0":
                pool_k, pool_v = (numkv.quantize(np.nan_to_num(p), fmt) for p in (pool_k, pool_v))
            both(lambda: numkv.paged_attention(q, pool_k, pool_v, table, np.diff(cu_k), cu_q, **attrs))
        if fmt != "q8_0":  # token-major views of (B, S, H, D) buffers, a past, a boolean mask
            kb, vb = (rng.standard_normal((3, 200, hkv, D)).astype(dtype) for _ in range(2))
            pk, pv = (rng.standard_normal((3, 40, hkv, D)).astype(dtype) for _ in range(2))
            q4 = rng.standard_normal((3, hq, 1, D)).astype(np.float32)
            mask = rng.random((3, hq, 1, 240)) < 0.8
            both(lambda: numkv.attention(q4, kb.transpose(0, 2, 1, 3), vb.transpose(0, 2, 1, 3), mask,
                                         pk.transpose(0, 2, 1, 3), pv.transpose(0, 2, 1, 3)))
    assert hkv in heads_seen and 2 in heads_seen  # (the items of every kv head did run)


def test_a_serving_loop_keeps_its_layout(rng, monkeypatch):
    """Decode steps of one layout (the same heads, dtypes, attributes and
    sequence count; a key more each step) derive the kernel's layout once
    (``_attention._layouts``) and check their arguments once
    (``_attention._checks``); each step's Y has the bits of a call that kept
    nothing.  A change of sinks, softcap or scale, of the pages' format, or
    keys that appear, is another layout; what is kept holds no caller's
    buffer."""
    import weakref

    from numkv import _attention

    made = []
    real = _attention._layout
    monkeypatch.setattr(_attention, "_layout", lambda *args: made.append(1) or real(*args))
    sinks = rng.standard_normal(8)
    calls = []
    for step, attrs in enumerate([{}, {}, {}, dict(sinks=sinks), dict(sinks=-sinks), dict(softcap=3.0),
                                  dict(scale=0.5), {}]):
        lens_q = [1, 3, 1, 1] if step == 7 else [1, 1, 1, 1]  # (then 3 query rows: other tiles)
        q, k, v, cu_q, cu_k = _pack(rng, lens_q, [0, 0, 0, 0] if step == 0 else [30 + step, 7, 0, 64], 8, 2)
        pool_k, pool_v, table = _paginate(rng, k, v, cu_k, 16)
        pages = [(pool_k, pool_v)] if step == 0 else [(pool_k, pool_v), (numkv.quantize(np.nan_to_num(pool_k), "q8_0"),
                                                                          numkv.quantize(np.nan_to_num(pool_v), "q8_0"))]
        attrs = dict(is_causal=True, **attrs)
        calls.append(lambda q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, attrs=attrs:
                     numkv.varlen_attention(q, k, v, cu_q, cu_k, **attrs))
        for pk, pv in pages:
            calls.append(lambda q=q, pk=pk, pv=pv, table=table, lens=np.diff(cu_k), cu_q=cu_q, attrs=attrs:
                         numkv.paged_attention(q, pk, pv, table, lens, cu_q, **attrs))
    kept = [call() for call in calls]
    # layouts: varlen without keys, float32 pages; varlen with keys, q8_0 pages; 4 other attribute sets and
    # 3 query rows x (varlen, float32 pages, q8_0 pages).  (Not in a layout: the pool's page count, the table's
    # width.)
    assert len(made) == 2 + 2 + 5 * 3, len(made)
    for call, y in zip(calls, kept):
        _attention._layouts.clear()
        _attention._checks.clear()
        _attention._step_plans.clear()
        np.testing.assert_array_equal(y, call())
    q, k, v, cu_q, cu_k = _pack(rng, [1, 2], [100_000, 10], 8, 2)
    numkv.varlen_attention(q, k, v, cu_q, cu_k)
    gone = weakref.ref(k)
    del k, v
    assert gone() is None


def test_a_decode_step_s_layers_share_its_plan(rng, monkeypatch):
    """The layers of a decode step call with the same sequences (the same
    ``cu_seqlens``, block table and lengths) and other values: the first
    derives the plan, the others take it (``_attention._step_plans``);
    another block table is another plan.  Each Y has the bits of a call
    that kept nothing."""
    from numkv import _attention

    runs = []
    real = _attention.run
    monkeypatch.setattr(_attention, "run", lambda *args, **kwargs: runs.append(1) or real(*args, **kwargs))
    calls = []
    for step in range(3):
        for layer in range(3):
            q, k, v, cu_q, cu_k = _pack(rng, [1, 1, 1], [5 + step, 0, 17 + step], 8, 2)
            pool_k, pool_v, table = _paginate(np.random.default_rng(step if layer < 2 else 99), k, v, cu_k, 4)
            calls.append(lambda q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k:
                         numkv.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True))
            calls.append(lambda q=q, pk=pool_k, pv=pool_v, table=table, lens=np.diff(cu_k), cu_q=cu_q:
                         numkv.paged_attention(q, pk, pv, table, lens, cu_q, is_causal=True))
    kept = [call() for call in calls]
    assert len(calls) - len(runs) == 3 * (2 + 1)  # a step: varlen's layers 2 and 3, paged's layer 2
    for call, y in zip(calls, kept):
        _attention._layouts.clear()
        _attention._checks.clear()
        _attention._step_plans.clear()
        assert same_bits(y, call())


def test_a_kept_layout_serves_only_its_strides(rng):
    """What a packed call keeps is keyed by its operands' strides, not only
    their shapes: a one-row Q or K given as ``row[None]`` (stride 0), a pool
    of one page, then the usual arrays of the same heads; read-only arrays
    then take no second compiled kernel.  Each Y has the bits of a call
    that kept nothing."""
    from numkv import _attention
    from numkv._kernels.attention import attention_items

    def kept_and_fresh(call):
        y = call()
        _attention._layouts.clear()
        _attention._checks.clear()
        _attention._step_plans.clear()
        return y, call()

    q, k, v, cu_q, cu_k = _pack(rng, [1, 1], [3, 4], 4, 2)
    numkv.varlen_attention(q, k[:1][0][None], v[:1][0][None], np.array([0, 1, 2]), np.array([0, 1, 1]))
    numkv.varlen_attention(q[:1][0][None], k, v, np.array([0, 1, 1]), cu_k)
    y, fresh = kept_and_fresh(lambda: numkv.varlen_attention(q, k, v, cu_q, cu_k))
    assert same_bits(y, fresh)
    pool_k, pool_v, table = _paginate(rng, k, v, cu_k, 4)
    for first in (pool_k[:1], pool_k[0][None]):
        numkv.paged_attention(q, first, first, np.zeros((2, 1), np.int64), np.array([2, 3]), cu_q)
        y, fresh = kept_and_fresh(lambda: numkv.paged_attention(q, pool_k, pool_v, table, np.diff(cu_k), cu_q))
        assert same_bits(y, fresh)
    numkv.varlen_attention(q, k, v, cu_q, cu_k)  # (kept again)
    compiled = len(attention_items.signatures)
    frozen = [x.copy() for x in (q, k, v)]
    for x in frozen:
        x.flags.writeable = False
    numkv.varlen_attention(*frozen, cu_q, cu_k)
    assert len(attention_items.signatures) == compiled


@pytest.mark.parametrize("fmt", ["bfloat16", "q8_0", "q4_0", "int8", "int4"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_pages_of_every_format(fmt, block_size, rng):
    lens_q, lens_k = [1, 7, 0, 1, 3], [40, 7, 3, 1, 300]
    q, k, v, cu_q, cu_k = _pack(rng, lens_q, lens_k, 8, 2, BF16 if fmt == "bfloat16" else np.float32)
    pool_k, pool_v, table = _paginate(rng, k, v, cu_k, block_size)
    attrs = dict(is_causal=True, left_window_size=20, sinks=rng.standard_normal(8))
    if fmt != "bfloat16":
        pool_k, pool_v = np.nan_to_num(pool_k), np.nan_to_num(pool_v)  # quantised garbage pages: zeros
        # (int8 / int4: a scale per tensor, which Y takes at the end: ``_attention._packed_scale``)
        scale = {"int8": 0.03, "int4": 0.4}.get(fmt)
        pool_k, pool_v = numkv.quantize(pool_k, fmt, scale=scale), numkv.quantize(pool_v, fmt, scale=scale)
        # what the pages hold, dequantised, packed back: the keys attention sees
        k_deq, v_deq = (np.concatenate([p.dequantize()[table[i, :-(-lens_k[i] // block_size)]].reshape(-1, 2, D)
                                        [:lens_k[i]] for i in range(5)]) for p in (pool_k, pool_v))
        k, v = k_deq, v_deq
    y = numkv.paged_attention(q, pool_k, pool_v, table, np.diff(cu_k), cu_q, **attrs)
    assert y.dtype == q.dtype
    rtol = 2 ** -7 if fmt == "bfloat16" else 1e-5
    _check_each_sequence(y, q, k, v, cu_q, cu_k, attrs, rtol=rtol, atol=rtol / 10)


def test_varlen_equals_the_float64_loop(rng):
    lens_q, lens_k = [3, 1, 4], [9, 30, 4]
    q, k, v, cu_q, cu_k = _pack(rng, lens_q, lens_k, 4, 2)
    sinks = rng.standard_normal(4)
    y = numkv.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, left_window_size=5, sinks=sinks)
    for i in range(3):
        q4 = q[cu_q[i]:cu_q[i + 1]].transpose(1, 0, 2)[None]
        k4 = k[cu_k[i]:cu_k[i + 1]].transpose(1, 0, 2)[None]
        v4 = v[cu_k[i]:cu_k[i + 1]].transpose(1, 0, 2)[None]
        # bottom-right: the last query attends every key
        want = naive.attention(q4, k4, v4, nonpad_kv_seqlen=[lens_k[i]], is_causal=True, left_window_size=5,
                               sinks=sinks)
        np.testing.assert_allclose(y[cu_q[i]:cu_q[i + 1]], want[0].transpose(1, 0, 2), rtol=1e-5, atol=1e-6)


def test_reference_path(rng, monkeypatch):
    q, k, v, cu_q, cu_k = _pack(rng, [2, 0, 3], [5, 4, 11], 4, 2)
    pool_k, pool_v, table = _paginate(rng, k, v, cu_k, 3)
    attrs = dict(is_causal=True, sinks=rng.standard_normal(4))
    y = numkv.varlen_attention(q, k, v, cu_q, cu_k, **attrs)
    yp = numkv.paged_attention(q, pool_k, pool_v, table, np.diff(cu_k), cu_q, **attrs)
    monkeypatch.setattr(_config, "REFERENCE", True)
    np.testing.assert_allclose(numkv.varlen_attention(q, k, v, cu_q, cu_k, **attrs), y, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(numkv.paged_attention(q, pool_k, pool_v, table, np.diff(cu_k), cu_q, **attrs), yp,
                               rtol=2e-5, atol=2e-6)


def test_a_page_not_in_the_table_is_never_read(rng):
    """The pool's other pages hold NaN (``_paginate``): a wrong page or a
    tile that crossed into the next page would make rows NaN."""
    q, k, v, cu_q, cu_k = _pack(rng, [4, 1], [13, 50], 4, 2)
    pool_k, pool_v, table = _paginate(rng, k, v, cu_k, 4, spare=10)
    y = numkv.paged_attention(q, pool_k, pool_v, table, np.diff(cu_k), cu_q)
    assert np.isfinite(y).all()


# --------------------------------------------------------------------------
# bad input: a ValueError naming the argument, before any work


def _paged_args(rng):
    q, k, v, cu_q, cu_k = _pack(rng, [2, 1], [5, 9], 4, 2)
    pool_k, pool_v, table = _paginate(rng, k, v, cu_k, 4)
    return dict(Q=q, key_cache=pool_k, value_cache=pool_v, block_table=table, seq_lens=np.diff(cu_k),
                cu_seqlens_q=cu_q)


@pytest.mark.parametrize("change, match", [
    (lambda a: a["block_table"].__setitem__((1, 0), 99), r"block_table\[1, 0\] = 99 is outside the pool"),
    (lambda a: a["block_table"].__setitem__((0, 1), -1), r"block_table\[0, 1\] = -1 is outside the pool"),
    (lambda a: a.__setitem__("block_table", a["block_table"][:, :2]), "block_table is too short: seq_lens"),
    (lambda a: a.__setitem__("seq_lens", np.array([5, 9, 1])), r"seq_lens must have shape \(num_sequences,\)"),
    (lambda a: a.__setitem__("seq_lens", np.array([5, -1])), r"seq_lens\[1\] = -1 is negative"),
    (lambda a: a.__setitem__("cu_seqlens_q", np.array([0, 4, 3])), "cu_seqlens_q must be non-decreasing"),
    (lambda a: a.__setitem__("cu_seqlens_q", np.array([0, 2, 4])), r"cu_seqlens_q\[-1\] = 4 does not match"),
    (lambda a: a.__setitem__("cu_seqlens_q", np.array([1, 2, 3])), r"cu_seqlens_q\[0\] must be 0"),
    (lambda a: a.__setitem__("cu_seqlens_q", np.array([0, 3])), r"cu_seqlens_q must have shape \(3,\)"),
    (lambda a: a.__setitem__("value_cache", a["value_cache"][:, :2]), "key_cache has"),
    (lambda a: a.__setitem__("sinks", np.zeros(3)), r"sinks must have shape \(q_num_heads,\) = \(4,\)"),
    (lambda a: a.update(key_cache=a["key_cache"][:0], value_cache=a["value_cache"][:0]), "key_cache holds no"),
], ids=["page-beyond-pool", "page-negative", "table-too-short", "seq-lens-shape", "seq-len-negative",
        "cu-decreasing", "cu-total", "cu-start", "cu-length", "pools-differ", "sinks-shape", "no-blocks"])
def test_bad_paged_arguments(change, match, rng, monkeypatch):
    args = _paged_args(rng)
    numkv.paged_attention(**args)  # (a good call first: its checks and layout are kept)
    change(args)
    ran = []
    monkeypatch.setattr(numkv._attention, "run", lambda *a, **k: ran.append(1))
    with pytest.raises(ValueError, match=match):
        numkv.paged_attention(**args)
    assert not ran  # before any work


@pytest.mark.parametrize("change, match", [
    (lambda a: a.__setitem__(3, np.array([0, 4, 3])), "cu_seqlens_q must be non-decreasing"),
    (lambda a: a.__setitem__(4, np.array([0, 5, 15])), r"cu_seqlens_k\[-1\] = 15 does not match K's total_k 14"),
    (lambda a: a.__setitem__(4, np.array([0, 14])), "cu_seqlens_q has 3 entries but cu_seqlens_k has 2"),
    (lambda a: a.__setitem__(2, a[2][:5]), "K has 14 rows but V has 5"),
    (lambda a: a.__setitem__(1, a[1][:, :, :8]), "K head size 8 differs from Q head size 32"),
    (lambda a: a.__setitem__(0, a[0][:, :3]), "q_num_heads 3 must be a multiple of kv_num_heads 2"),
], ids=["cu-decreasing", "cu-k-total", "cu-lengths-differ", "kv-rows", "head-size", "heads"])
def test_bad_varlen_arguments(change, match, rng, monkeypatch):
    args = list(_pack(rng, [2, 1], [5, 9], 4, 2))
    numkv.varlen_attention(*args)  # (a good call first: its checks and layout are kept)
    change(args)
    ran = []
    monkeypatch.setattr(numkv._attention, "run", lambda *a, **k: ran.append(1))
    with pytest.raises(ValueError, match=match):
        numkv.varlen_attention(*args)
    assert not ran
