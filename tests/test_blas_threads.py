"""Prefill's products and the BLAS thread count (``numkv._blas_threads``).

numkv never changes another library's thread count (API.md).  Where every
BLAS already runs on one thread, prefill calls it on whole tiles; where a
BLAS may start threads of its own (which would fight numkv's), each product
is split to the size OpenBLAS keeps on the calling thread.
"""

import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import numkv
import oracle
from numkv import _attention, _blas_threads, _threads
from numkv._kernels.attention import INT_FIELDS
from test_attention import tolerance


def prefill(seed=0, sq=200, hq=4, hkv=2, d=96):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, hq, sq, d), np.float32)
    k = rng.standard_normal((1, hkv, sq, d), np.float32)
    v = rng.standard_normal((1, hkv, sq, d), np.float32)
    return q, k, v


def blas_counts():
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def gemm_limits(monkeypatch):
    """The ``gemm_limit`` of every attention kernel run (huge: whole tiles)."""
    seen, run = [], _threads.run

    def watching(kernel, n_items, args, small=False, claimed=False):
        if kernel.__name__ == "attention_items":
            ints = args[7]
            seen.append((int(ints[INT_FIELDS.index("gemm_limit")]), blas_counts()))
        return run(kernel, n_items, args, small, claimed)

    monkeypatch.setattr(_threads, "run", watching)
    return seen


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blas", [1, 2])
def test_prefill_products_follow_the_blas_thread_count(monkeypatch, causal, blas):
    q, k, v = prefill()
    _blas_threads.single_threaded()  # loads SciPy's BLAS: threadpool_limits reaches loaded libraries only
    with threadpool_limits(limits=blas, user_api="blas"):
        assert _blas_threads.single_threaded() == (blas == 1)
        limits = gemm_limits(monkeypatch)
        y = numkv.attention(q, k, v, is_causal=causal)
        # whole tiles on one BLAS thread, else products within OpenBLAS' single-thread size
        assert [limit for limit, _ in limits] == [1 << 62 if blas == 1 else _attention.GEMM_MNK_LIMIT]
        assert all(counts == [blas] * len(counts) for _, counts in limits)  # never changed
        assert blas_counts() == [blas] * len(blas_counts())
    expected = oracle.attention(q, k, v, is_causal=causal)[0]
    rtol, atol = tolerance(np.float32)
    np.testing.assert_allclose(y, expected, rtol=rtol, atol=atol)


def test_a_blas_that_is_not_openblas_counts_as_multithreaded(monkeypatch):
    _blas_threads.single_threaded()
    monkeypatch.setattr(_blas_threads, "_getters", [None])
    with threadpool_limits(limits=1, user_api="blas"):
        assert not _blas_threads.single_threaded()
    monkeypatch.setattr(_blas_threads, "_getters", [])
    assert not _blas_threads.single_threaded()


def test_concurrent_prefills_leave_blas_alone():
    q, k, v = prefill(sq=160)
    before = blas_counts()
    expected = numkv.attention(q, k, v, is_causal=True)
    seen, errors = [], []

    def worker():
        try:
            for _ in range(5):
                seen.append(blas_counts())
                assert np.array_equal(numkv.attention(q, k, v, is_causal=True), expected)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    workers = [threading.Thread(target=worker) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    assert all(counts == before for counts in seen) and blas_counts() == before
