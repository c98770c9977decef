"""NaN and Inf in ``numkv.attention``, as API.md states them.

* A NaN (or +inf) that enters an attended score -- from Q, K, a float mask or
  ``scale`` -- makes that query's row NaN, as in the reference, wherever the
  key sits, whatever the tiling, key split, product kernel or thread count.
* Keys that the mask, the causal rule, a window or ``nonpad_kv_seqlen``
  exclude never influence Y, even when their K or V hold inf or NaN (the one
  deliberate difference from the reference, whose ``0 * inf`` gives NaN).
* ``scale`` beyond float32's range gives the reference's float32 values.
* The plain NumPy reference path (``_config.REFERENCE``) keeps the same rules
  as the kernel (issue 27).
"""

import warnings

import ml_dtypes
import numpy as np
import pytest

import numkv
import oracle
from numkv import _attention, _config
from numkv._runtime import thread_count

B, HQ, HKV, D = 1, 4, 2, 16

# (block_q, block_k, kv_chunk, gemm_rows): the default; small tiles with the
# loop kernel; small tiles with the matrix products; a split key range
# (partials merged).
RUNS = {
    "default": {},
    "loop-tiles": dict(block_q=3, block_k=7, gemm_rows=1 << 30),
    "gemm-tiles": dict(block_q=3, block_k=7, gemm_rows=1),
    "split-keys": dict(block_k=8, kv_chunk=24),
}


def inputs(rng, sq=5, skv=96):
    q = rng.standard_normal((B, HQ, sq, D), np.float32)
    k = rng.standard_normal((B, HKV, skv, D), np.float32)
    v = rng.standard_normal((B, HKV, skv, D), np.float32)
    return q, k, v


def attention(q, k, v, run=None, **attrs):
    """numkv's Y, through ``_attention.run`` with the ``RUNS`` settings."""
    call = _attention.prepare(q, k, v, **attrs)
    return _attention.run(call, **RUNS[run or "default"])


def nan_rows(y):
    """``(B, Hq, Sq)``: which rows are NaN (a row is all NaN or all finite)."""
    bad = np.isnan(y)
    assert (bad.all(axis=-1) == bad.any(axis=-1)).all(), "a row is partly NaN"
    return bad.any(axis=-1)


@pytest.mark.parametrize("run", RUNS)
def test_nan_in_a_query_row_makes_that_row_nan(rng, run):
    q, k, v = inputs(rng)
    q[0, 1, 2, 5] = np.nan
    y = attention(q, k, v, run)
    expected = np.zeros((B, HQ, 5), bool)
    expected[0, 1, 2] = True
    assert (nan_rows(y) == expected).all()
    reference = oracle.attention(q, k, v)[0]
    assert (np.isnan(reference) == np.isnan(y)).all()
    np.testing.assert_allclose(y[~np.isnan(y)], reference[~np.isnan(y)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("where", [0, 40, 95], ids=["first-key", "middle-key", "last-key"])
def test_nan_in_an_attended_key_makes_the_rows_that_see_it_nan(rng, run, where):
    q, k, v = inputs(rng)
    k[0, 1, where, 3] = np.nan  # kv head 1: query heads 2 and 3
    y = attention(q, k, v, run)
    expected = np.zeros((B, HQ, 5), bool)
    expected[0, 2:] = True
    assert (nan_rows(y) == expected).all()


@pytest.mark.parametrize("run", RUNS)
def test_nan_in_a_causal_key_only_reaches_the_queries_after_it(rng, run):
    q, k, v = inputs(rng, sq=96)
    k[0, 0, 50, 0] = np.nan
    y = attention(q, k, v, run, is_causal=True)
    rows = nan_rows(y)
    assert not rows[0, 2:].any()          # the other kv head
    assert not rows[0, :2, :50].any()     # queries before key 50 never see it
    assert rows[0, :2, 50:].all()
    # The deliberate difference: the reference adds the causal -inf to the NaN
    # score (still NaN), so every query of the head comes out NaN there.
    reference = oracle.attention(q, k, v, is_causal=True)[0]
    assert np.isnan(reference[0, :2]).all()


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("rule", ["nonpad", "causal", "window", "bool-mask", "float-mask"])
def test_excluded_keys_never_influence_y(rng, run, rule, value):
    """Garbage in the K and V of keys no query may attend changes nothing."""
    q, k, v = inputs(rng, sq=96 if rule == "causal" else 6)
    attrs, excluded, rows = {}, np.zeros(96, bool), slice(None)
    if rule == "nonpad":
        attrs["nonpad_kv_seqlen"] = np.array([70])
        excluded[70:] = True  # a cache's unwritten capacity
    elif rule == "causal":
        attrs["is_causal"] = True
        excluded[50:] = True  # the future of queries 0..49
        rows = slice(0, 50)
    elif rule == "window":
        attrs.update(left_window_size=2, right_window_size=0)
        excluded[6:] = True  # queries sit at 0..5 and see at most themselves
    else:
        excluded[10:30] = True
        mask = ~excluded[None, None, None, :]
        attrs["attn_mask"] = mask if rule == "bool-mask" else np.where(mask, 0.0, -np.inf).astype(np.float32)
    clean = attention(q, k, v, run, **attrs)[:, :, rows]
    k[:, :, excluded] = value
    v[:, :, excluded] = value
    y = attention(q, k, v, run, **attrs)[:, :, rows]
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, clean, rtol=1e-6, atol=1e-6)
    if run == "loop-tiles":  # same tiles, same arithmetic: bit for bit
        assert np.array_equal(y, clean)


def test_nan_in_an_attended_float_mask_entry_makes_the_row_nan(rng):
    q, k, v = inputs(rng, sq=3)
    mask = np.zeros((1, 1, 3, 96), np.float32)
    mask[0, 0, 1, 60] = np.nan
    mask[0, 0, 2, 10:20] = -np.inf
    y = attention(q, k, v, attn_mask=mask)
    assert (nan_rows(y) == np.array([False, True, False])[None, None]).all()
    reference = oracle.attention(q, k, v, attn_mask=mask)[0]
    assert (np.isnan(reference) == np.isnan(y)).all()


def test_plus_inf_in_a_mask_makes_the_row_nan_like_the_reference(rng):
    q, k, v = inputs(rng, sq=2)
    mask = np.zeros((1, 1, 2, 96), np.float32)
    mask[0, 0, 0, 5] = np.inf
    y = attention(q, k, v, attn_mask=mask)
    reference = oracle.attention(q, k, v, attn_mask=mask)[0]
    assert (np.isnan(reference) == np.isnan(y)).all() and np.isnan(y[0, :, 0]).all()


def test_nan_scale_gives_nan_rows(rng):
    q, k, v = inputs(rng, sq=2)
    assert np.isnan(attention(q, k, v, scale=float("nan"))).all()
    assert np.isnan(oracle.attention(q, k, v, scale=float("nan"))[0]).all()


def test_nan_with_split_keys_on_several_threads(rng, monkeypatch):
    """Decode over a long cache, the key range split into chunks and run on 3
    threads: a NaN in any chunk makes the row NaN, bit-identical to 1 thread."""
    q = rng.standard_normal((1, 4, 1, 16), np.float32)
    k = rng.standard_normal((1, 1, 3000, 16), np.float32)
    v = rng.standard_normal((1, 1, 3000, 16), np.float32)
    k[0, 0, 2222, 0] = np.nan
    for threshold in ("SINGLE_THREAD_MACS", "SPLIT_MACS", "THREAD_MACS"):
        monkeypatch.setattr(_config, threshold, 0)
    results = []
    for threads in (1, 3):
        monkeypatch.setattr(thread_count, "get_num_threads", lambda n=threads: n)
        results.append(numkv.attention(q, k, v))
    assert np.isnan(results[0]).all()
    assert np.array_equal(results[0], results[1], equal_nan=True)


@pytest.mark.parametrize("scale", [1e39, 1e-46, 3e38, 1e300])
def test_scale_beyond_float32_gives_the_references_float32_values(rng, scale):
    """The reference multiplies Q and K by ``sqrt(scale)`` each (in the input
    dtype): a scale that float32 cannot hold still gives finite scores where
    they fit, and overflowing ones (+inf: a NaN row) where they do not --
    without a warning from numkv (1e300's root overflowed a cast, which
    ``-W error`` turned into an exception)."""
    q, k, v = inputs(rng, sq=4, skv=8)
    q *= np.float32(1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = numkv.attention(q, k, v, scale=scale)
    reference = oracle.attention(q, k, v, scale=scale, float64=False)[0]
    assert (np.isnan(y) == np.isnan(reference)).all()
    finite = ~np.isnan(y)
    np.testing.assert_allclose(y[finite], reference[finite], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("run", RUNS)
def test_an_attended_key_whose_weight_underflows_still_multiplies_its_v(rng, run):
    """``0 * inf`` is NaN in the reference's ``P V``: an attended key whose
    weight underflowed to 0 and whose V is inf makes that output NaN, on
    every path (the loop kernel leaves out masked keys only, not zero weights)."""
    q = np.abs(rng.standard_normal((B, HQ, 3, D), np.float32))
    k = rng.standard_normal((B, HKV, 40, D), np.float32)
    v = rng.standard_normal((B, HKV, 40, D), np.float32)
    k[:, :, 3] = -1000.0  # its score is ~-1e4 below the others: e**score is 0
    v[:, :, 3, 0] = np.inf
    y = attention(q, k, v, run)
    reference = oracle.attention(q, k, v)[0]
    assert np.isnan(reference[..., 0]).all() and not np.isnan(reference[..., 1:]).any()
    assert (np.isnan(y) == np.isnan(reference)).all()


@pytest.mark.parametrize("scale", [-0.5, -1e39, -1e-46, float("-inf")])
def test_a_negative_scale_gives_nan_rows_as_the_reference(rng, scale):
    """The reference scales Q and K by ``sqrt(scale)``: NaN for a negative one."""
    q, k, v = inputs(rng, sq=3, skv=8)
    mask = np.ones((1, 1, 3, 8), bool)
    mask[0, 0, 1] = False  # a row that attends nothing stays zeros
    y = numkv.attention(q, k, v, attn_mask=mask, scale=scale)
    reference = oracle.attention(q, k, v, attn_mask=mask, scale=scale, float64=False)[0]
    assert (np.isnan(y) == np.isnan(reference)).all()
    assert np.isnan(y[:, :, [0, 2]]).all() and (y[:, :, 1] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_float_mask_with_misaligned_strides_is_read_correctly(rng, dtype):
    """A mask viewed through strides that are no multiple of its itemsize
    (here 6 or 12 bytes) is copied first: the kernel reads elements, not bytes."""
    q, k, v = inputs(rng, sq=3, skv=5)
    values = rng.standard_normal((3, 5)).astype(dtype)
    raw = np.zeros(values.size * values.itemsize * 3 // 2 + 8, np.uint8)
    step = values.itemsize * 3 // 2
    odd = np.ndarray((3, 5), dtype, raw, offset=1, strides=(5 * step, step))
    odd[...] = values
    assert not odd.flags.aligned
    acc = np.float64 if dtype == np.float64 else np.float32
    expected = numkv.attention(q.astype(acc), k.astype(acc), v.astype(acc), attn_mask=values.copy())
    got = numkv.attention(q.astype(acc), k.astype(acc), v.astype(acc), attn_mask=odd)
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_narrow_cache_read_in_place_keeps_the_rules(rng, kv_dtype, value):
    """Decode reads a bfloat16 / float16 K and V as they are, widening while
    it computes (no tile copy): the same rules hold there."""
    dtype = np.dtype(getattr(ml_dtypes, kv_dtype, None) or kv_dtype)
    q, k, v = inputs(rng, sq=1)
    k, v = k.astype(dtype), v.astype(dtype)
    mask = np.ones(96, bool)
    mask[10:30] = False
    for attrs in (dict(nonpad_kv_seqlen=np.array([70])), dict(attn_mask=mask)):
        clean = numkv.attention(q, k, v, **attrs)
        np.testing.assert_allclose(clean, numkv.attention(q, k.astype(np.float32), v.astype(np.float32),
                                                          **attrs), rtol=1e-5, atol=1e-6)
        dirty_k, dirty_v = k.copy(), v.copy()
        excluded = slice(70, None) if "nonpad_kv_seqlen" in attrs else slice(10, 30)
        dirty_k[:, :, excluded] = value
        dirty_v[:, :, excluded] = value
        assert np.array_equal(numkv.attention(q, dirty_k, dirty_v, **attrs), clean)
    k[0, 1, 40, 3] = np.nan  # an attended key of kv head 1: query heads 2 and 3
    expected = np.zeros((B, HQ, 1), bool)
    expected[0, 2:] = True
    assert (nan_rows(numkv.attention(q, k, v)) == expected).all()


# -- the plain NumPy reference path keeps these rules (issue 27) --


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("rule", ["nonpad", "causal", "window", "bool-mask", "float-mask"])
def test_reference_path_ignores_excluded_non_finite_keys(monkeypatch, rule, value):
    """Issue 27: with NUMKV_REFERENCE=1, a key excluded by nonpad_kv_seqlen
    (or mask / causal / window) holding inf or NaN turned every row NaN."""
    monkeypatch.setattr(_config, "REFERENCE", True)
    rng = np.random.default_rng(3)
    sq = 40 if rule == "causal" else 5
    q = rng.standard_normal((1, 4, sq, 8), np.float32)
    k = rng.standard_normal((1, 2, 40, 8), np.float32)
    v = rng.standard_normal((1, 2, 40, 8), np.float32)
    attrs, excluded, rows = {}, np.zeros(40, bool), slice(None)
    if rule == "nonpad":
        attrs["nonpad_kv_seqlen"] = np.array([30])
        excluded[30:] = True
    elif rule == "causal":
        attrs["is_causal"] = True
        excluded[20:] = True
        rows = slice(0, 20)
    elif rule == "window":
        attrs.update(left_window_size=2, right_window_size=0)
        excluded[5:] = True
    else:
        excluded[10:30] = True
        mask = ~excluded[None, None, None, :]
        attrs["attn_mask"] = mask if rule == "bool-mask" else np.where(mask, 0.0, -np.inf).astype(np.float32)
    clean = numkv.attention(q, k, v, **attrs)[:, :, rows]
    k[:, :, excluded] = value
    v[:, :, excluded] = value
    y = numkv.attention(q, k, v, **attrs)[:, :, rows]
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, clean, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(_config, "REFERENCE", False)  # the kernel agrees
    np.testing.assert_allclose(numkv.attention(q, k, v, **attrs)[:, :, rows], y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["q", "k-attended", "v-attended", "v-underflowed"])
def test_reference_path_keeps_the_nan_of_attended_keys(monkeypatch, where):
    """...while NaN / inf in what a query does attend still reaches its row,
    as on the kernel's path (an attended key multiplies its V even when its
    weight underflowed to 0: ``0 * inf``)."""
    rng = np.random.default_rng(4)
    q = np.abs(rng.standard_normal((1, 2, 3, 8), np.float32))
    k = rng.standard_normal((1, 1, 12, 8), np.float32)
    v = rng.standard_normal((1, 1, 12, 8), np.float32)
    if where == "q":
        q[0, 1, 2, 0] = np.nan
    elif where == "k-attended":
        k[0, 0, 4, 1] = np.nan
    elif where == "v-attended":
        v[0, 0, 4, 1] = np.inf
    else:
        k[0, 0, 4] = -1000.0
        v[0, 0, 4, 1] = np.inf
    got = {}
    for reference in (True, False):
        monkeypatch.setattr(_config, "REFERENCE", reference)
        got[reference] = numkv.attention(q, k, v)
    assert np.array_equal(np.isnan(got[True]), np.isnan(got[False]))
    assert not np.isfinite(got[True]).all()
    np.testing.assert_allclose(got[True], got[False], rtol=1e-5, atol=1e-5)  # inf == inf, nan == nan
