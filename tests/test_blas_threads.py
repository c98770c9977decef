"""Prefill's products and the BLAS they call (``numkv._runtime.blas``).

numkv never changes another library's thread count (API.md): it loads its own
OpenBLAS (``scipy-openblas32``) privately on one thread and calls it on whole
tiles.  Where a BLAS may start threads of its own (which would fight numkv's),
each product is split to the size OpenBLAS keeps on the calling thread.
"""

import ctypes
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import scipy.linalg.cython_blas  # noqa: F401 - SciPy's BLAS loaded: threadpool_limits reaches loaded libraries only
from threadpoolctl import threadpool_info, threadpool_limits

import numkv
import oracle
from numkv import _attention
from numkv._runtime import blas as numkv_blas, pool
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


def gemm_limits(monkeypatch, functions=None):
    """The ``gemm_limit`` of every attention kernel run (huge: whole tiles),
    and into ``functions`` its ``gemm_fn``."""
    seen, run = [], pool.run

    def watching(kernel, n_items, args, small=False, claimed=False, max_threads=None, joined=False):
        if kernel.__name__ == "attention_items":
            ints = args[7]
            seen.append((int(ints[INT_FIELDS.index("gemm_limit")]), blas_counts()))
            if functions is not None:
                functions.append(int(ints[INT_FIELDS.index("gemm_fn")]))
        return run(kernel, n_items, args, small, claimed, max_threads, joined)

    monkeypatch.setattr(pool, "run", watching)
    return seen


@pytest.mark.parametrize("own", [True, False], ids=["numkv's BLAS", "SciPy's BLAS"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blas", [1, 2])
def test_prefill_products_follow_the_blas_thread_count(monkeypatch, causal, blas, own):
    if not own:
        monkeypatch.setattr(numkv_blas, "OWN", None)
    q, k, v = prefill()
    with threadpool_limits(limits=blas, user_api="blas"):
        assert numkv_blas.single_threaded() == (blas == 1)
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
    monkeypatch.setattr(numkv_blas, "OWN", None)
    monkeypatch.setattr(numkv_blas, "_getters", [None])
    with threadpool_limits(limits=1, user_api="blas"):
        assert not numkv_blas.single_threaded()
    monkeypatch.setattr(numkv_blas, "_getters", [])
    assert not numkv_blas.single_threaded()


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


def test_numkvs_own_blas_is_private_and_on_one_thread(monkeypatch):
    own = numkv_blas.OWN
    assert own is not None, "scipy-openblas32, a dependency, did not load"
    assert own.get_num_threads() == 1 and numkv_blas.single_threaded()
    libraries = {lib["filepath"]: lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}
    assert libraries[own.path] == 1
    # RTLD_LOCAL: no other library's calls can bind to it (SciPy's BLAS has the same names)
    assert not hasattr(ctypes.CDLL(None), "scipy_sgemm_")
    functions = []
    gemm_limits(monkeypatch, functions)
    q, k, v = prefill()
    numkv.attention(q, k, v)
    numkv.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    assert functions == [own.sgemm, own.dgemm]
    monkeypatch.setattr(numkv_blas, "OWN", None)
    assert numkv_blas.gemm_function(4) == 0  # the kernel then calls SciPy's BLAS through numba


def test_a_library_loaded_already_is_not_numkvs():
    scipy_blas = [lib["filepath"] for lib in threadpool_info()
                  if lib["user_api"] == "blas" and "/scipy.libs/" in lib["filepath"]]
    for path in scipy_blas + [numkv_blas.OWN.path, None]:
        assert numkv_blas._load_own(path) is None


def test_own_blas_starts_on_one_thread_whatever_the_environment():
    code = ("import os, numkv; from numkv._runtime import blas as b; "
            "print(b.OWN.get_num_threads(), os.environ['OPENBLAS_NUM_THREADS'], "
            "len(os.listdir('/proc/self/task')) if os.path.isdir('/proc/self/task') else 0)")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    own, env_after, _ = out.stdout.split()
    assert (own, env_after) == ("1", "3")  # numkv's on one thread; the variable as it was
