"""Whether BLAS runs on one thread: what decides the size of prefill's products.

The prefill kernel calls BLAS ``gemm`` on its tiles from every numkv thread
at once (numba's BLAS binding: SciPy's BLAS).  A BLAS allowed several threads
splits each large call over its own thread pool, and those pools fight
numkv's (a 64x64x128 product ran at 0.6 GFLOP/s so).  numkv never changes
another library's thread count (API.md), so it adapts instead:

* every BLAS in the process already on one thread (``OPENBLAS_NUM_THREADS=1``,
  ``threadpool_limits(1, "blas")``, a Dask worker): whole tiles, one gemm
  per product (causal prefill S=2048, Hq=32, Hkv=8, D=128, 2 threads: 323 ms);
* otherwise: each product split to stay within OpenBLAS' single-thread size
  (M*N*K <= 2**18, where OpenBLAS never starts its threads) on smaller tiles
  (483 ms).

``single_threaded()`` reads the libraries' counts on every call (two
``ctypes`` calls, ~1 us), so a ``threadpool_limits`` block takes effect at once.
Libraries are found by threadpoolctl; a BLAS that is not OpenBLAS (MKL, BLIS)
counts as multi-threaded.
"""

import ctypes

_getters = None  # one thread-count getter per BLAS library (None: not OpenBLAS), found once


def _blas_getters():
    global _getters
    if _getters is None:
        import scipy.linalg.cython_blas  # noqa: F401 - load the BLAS numba's gemm calls, to be found
        from threadpoolctl import ThreadpoolController

        libraries = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        _getters = [_openblas_getter(c) for c in libraries]
    return _getters


def _openblas_getter(library):
    """OpenBLAS's ``openblas_get_num_threads`` (the names as threadpoolctl
    finds them: ``scipy_`` and ``64_`` variants), else None.  numkv calls it
    itself: threadpoolctl's controller answers only for the first Python
    thread that set a limit through it."""
    if library.internal_api != "openblas":
        return None
    for prefix in ("", "scipy_"):
        for suffix in ("", "64_", "_64"):
            get = getattr(library.dynlib, f"{prefix}openblas_get_num_threads{suffix}", None)
            if get is not None:
                get.restype = ctypes.c_int
                return get
    return None


def single_threaded():
    """Whether every BLAS library of this process runs on one thread now."""
    getters = _blas_getters()
    return bool(getters) and all(get is not None and get() == 1 for get in getters)
