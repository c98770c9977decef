"""BLAS on one thread while numkv's threads call it.

The prefill kernel calls BLAS ``gemm`` on its tiles from every numkv thread
at once (numba's BLAS binding: SciPy's BLAS).  A BLAS allowed several threads
splits each call over its own thread pool, and those pools fight numkv's: a
64x64x128 product ran at 0.6 GFLOP/s so.  ``one_thread`` sets every OpenBLAS
loaded in the process (SciPy's and NumPy's, found by threadpoolctl) to one
thread for as long as any numkv call is inside it, and then restores what
was set; numkv's own thread count is the parallelism.  A NumPy or SciPy
product that another Python thread runs in the meantime runs on one thread
too.  (numkv calls OpenBLAS's setter itself: threadpoolctl's ignores every
Python thread but the first that used it.)

Where a BLAS library is not OpenBLAS (MKL, BLIS: no hold implemented), or
none is found, ``available()`` is False and the kernel splits each product
to stay within OpenBLAS's single-thread size (M*N*K <= 2**18, where OpenBLAS
never starts its threads): correct, ~1.4x slower on a prefill (measured, see
``numkv/_attention.py``).
"""

import contextlib
import ctypes
import os
import threading

_lock = threading.Lock()
_users = 0          # numkv calls inside ``one_thread`` now
_saved = []         # [(set, thread count before)] while _users > 0
_controllers = None  # [(get, set)] of the OpenBLAS libraries, found once


def _blas_controllers():
    global _controllers
    if _controllers is None:
        import scipy.linalg.cython_blas  # noqa: F401 - load the BLAS numba's gemm calls, to be found
        from threadpoolctl import ThreadpoolController

        libraries = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        found = [_openblas_functions(c) for c in libraries]
        _controllers = found if found and all(found) else []
    return _controllers


def _openblas_functions(library):
    """``(get, set)``: the thread-count functions of an OpenBLAS library (the
    names as threadpoolctl finds them: ``scipy_`` and ``64_`` variants), else
    None."""
    if library.internal_api != "openblas":
        return None
    for prefix in ("", "scipy_"):
        for suffix in ("", "64_", "_64"):
            get = getattr(library.dynlib, f"{prefix}openblas_get_num_threads{suffix}", None)
            put = getattr(library.dynlib, f"{prefix}openblas_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
                return get, put
    return None


def available():
    """Whether the BLAS libraries of this process can be held to one thread."""
    return bool(_blas_controllers())


@contextlib.contextmanager
def one_thread():
    """Hold every OpenBLAS to one thread inside the block (nested and
    concurrent blocks share one hold; nothing where ``available()`` is
    False)."""
    global _users, _saved
    with _lock:
        if _users == 0:
            _saved = [(put, get()) for get, put in _blas_controllers()]
            for put, n in _saved:
                if n != 1:
                    put(1)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                _restore()


def _restore():
    for put, n in _saved:
        if n != 1:
            put(n)
    _saved.clear()


def _after_fork_in_child():
    """A child forked while another thread was inside ``one_thread`` gets the
    thread counts back and a fresh lock (the parent's may be held)."""
    global _lock, _users
    _lock = threading.Lock()
    if _users:
        _users = 0
        _restore()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
