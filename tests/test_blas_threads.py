"""BLAS held to one thread while prefill tiles call it (``numkv._blas_threads``).

A BLAS allowed several threads, called from every numkv thread at once,
splits each product over a pool of its own that fights numkv's; numkv holds
every BLAS library to one thread for the call and gives the count back after.
"""

import os
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import numkv
from numkv import _attention, _blas_threads, _threads
import oracle
from test_attention import tolerance


def prefill(seed=0, sq=96, hq=4, hkv=2, d=32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, hq, sq, d), np.float32)
    k = rng.standard_normal((1, hkv, sq, d), np.float32)
    v = rng.standard_normal((1, hkv, sq, d), np.float32)
    return q, k, v


def blas_counts():
    return [get() for get, _ in _blas_threads._blas_controllers()]


@pytest.fixture
def two_blas_threads():
    """BLAS allowed two threads, as a host with two cores sets it."""
    assert _blas_threads.available(), "no BLAS library found: the held path is untested"
    with threadpool_limits(limits=2, user_api="blas"):
        yield


def test_prefill_holds_blas_to_one_thread_and_gives_it_back(monkeypatch, two_blas_threads):
    seen, run = [], _threads.run

    def watching(kernel, n_items, args, small=False, claimed=False):
        seen.append((kernel.__name__, blas_counts()))
        return run(kernel, n_items, args, small, claimed)

    monkeypatch.setattr(_threads, "run", watching)
    q, k, v = prefill()
    numkv.attention(q, k, v, is_causal=True)
    assert seen and all(counts == [1] * len(counts) for _, counts in seen), seen
    assert blas_counts() == [2] * len(blas_counts())


def test_decode_leaves_blas_alone(monkeypatch, two_blas_threads):
    def refuse():
        raise AssertionError("a decode step took the BLAS hold")

    monkeypatch.setattr(_blas_threads, "one_thread", refuse)
    q, k, v = prefill(sq=64)
    numkv.attention(q[:, :, :1], k, v)  # 2 query rows a kv head: the loop kernel


def test_concurrent_calls_share_one_hold(two_blas_threads):
    q, k, v = prefill(sq=160)
    expected = numkv.attention(q, k, v, is_causal=True)
    results, errors = [], []

    def worker():
        try:
            for _ in range(6):
                results.append(numkv.attention(q, k, v, is_causal=True))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    workers = [threading.Thread(target=worker) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    assert len(results) == 18 and all(np.array_equal(r, expected) for r in results)
    assert _blas_threads._users == 0
    assert blas_counts() == [2] * len(blas_counts())


@pytest.mark.parametrize("causal", [False, True])
def test_split_products_where_blas_cannot_be_held(monkeypatch, causal):
    # No BLAS library found: each product is split along the head size to
    # stay within OpenBLAS's single-thread size, on smaller tiles.
    q, k, v = prefill(sq=200, d=96)
    held = numkv.attention(q, k, v, is_causal=causal)
    monkeypatch.setattr(_blas_threads, "_controllers", [])
    assert not _blas_threads.available()
    split = numkv.attention(q, k, v, is_causal=causal)
    assert _attention._tiles(2, 2, 200, 16, False) == (64, _attention.SPLIT_BLOCK_K)
    expected = oracle.attention(q, k, v, is_causal=causal)[0]
    rtol, atol = tolerance(np.float32)
    np.testing.assert_allclose(split, expected, rtol=rtol, atol=atol)
    np.testing.assert_allclose(held, expected, rtol=rtol, atol=atol)
    assert not np.array_equal(split, held)  # really another path: split products, other tiles


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_child_forked_inside_a_hold_gets_the_counts_back(two_blas_threads):
    with _blas_threads.one_thread():
        assert blas_counts() == [1] * len(blas_counts())
        pid = os.fork()
        if pid == 0:  # the child: no call of its own is inside the hold
            os._exit(0 if _blas_threads._users == 0 and blas_counts() == [2] * len(blas_counts()) else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert blas_counts() == [2] * len(blas_counts())
