"""The BLAS prefill's products call, and whether it runs on one thread.

The prefill kernel calls BLAS ``gemm`` on its tiles from every numkv thread
at once.  A BLAS allowed several threads splits each large call over its own
thread pool, and those pools fight numkv's (a 64x64x128 product ran at
0.6 GFLOP/s so).  numkv never changes another library's thread count
(API.md), so it brings its own BLAS:

* **numkv's OpenBLAS**: the ``scipy-openblas32`` wheel (the OpenBLAS NumPy
  and SciPy build with), loaded privately (``RTLD_LOCAL``: nothing else binds
  to it) with ``OPENBLAS_NUM_THREADS=1`` while it loads, so it starts no
  threads.  Prefill calls it on whole tiles (causal S=2048, Hq=32, Hkv=8,
  D=128, 2 threads, interleaved calls: 254-301 against 296-395 ms with
  split products; ``tools/prefill_paths.py``).
* where that library cannot be loaded (not installed, or already loaded by
  someone else: then it is theirs), SciPy's BLAS through numba, as
  ``np.dot`` in numba does; whole tiles only where every BLAS in the process
  already runs on one thread (``OPENBLAS_NUM_THREADS=1``, a Dask worker).

Either way ``single_threaded()`` reads the thread count of the library in
use on every call (a ``ctypes`` call, < 1 us): ``threadpool_limits(2)``
reaches numkv's OpenBLAS too, and inside it prefill splits each product to
the size OpenBLAS keeps on the calling thread (M*N*K <= 2**18).
"""

import ctypes
import importlib.util
import os
import threading

_getters = None  # one thread-count getter per BLAS library (None: not OpenBLAS), found once
_load_lock = threading.Lock()


class _OwnBLAS:
    """numkv's private OpenBLAS: its file, ``sgemm_`` / ``dgemm_`` addresses
    and its thread-count getter."""

    def __init__(self, path, dll):
        self.path = path
        self.dll = dll  # kept: the addresses live as long as the handle
        self.sgemm = ctypes.cast(dll.scipy_sgemm_, ctypes.c_void_p).value
        self.dgemm = ctypes.cast(dll.scipy_dgemm_, ctypes.c_void_p).value
        self.get_num_threads = dll.scipy_openblas_get_num_threads
        self.get_num_threads.restype = ctypes.c_int


def _wheel_library():
    """The path of ``scipy-openblas32``'s library, found without importing the
    package (its ``__init__`` loads the library into the global namespace,
    where SciPy's own BLAS calls could bind to it), or None."""
    try:
        spec = importlib.util.find_spec("scipy_openblas32")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = os.path.join(list(spec.submodule_search_locations)[0], "lib")
    names = sorted(os.listdir(lib_dir)) if os.path.isdir(lib_dir) else []
    names = [f for f in names if f.startswith("libscipy_openblas") and f.endswith((".so", ".dylib", ".dll"))]
    return os.path.join(lib_dir, names[0]) if names else None


def _load_own(path):
    """Load ``path`` privately on one thread, or None where that cannot be
    done (already loaded: another library's, whose count is not numkv's)."""
    if path is None:
        return None
    if hasattr(os, "RTLD_NOLOAD"):
        try:
            ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOLOAD)
            return None  # loaded already: somebody else's
        except OSError:
            pass  # not loaded yet
    with _load_lock:  # OpenBLAS reads the variable as it loads
        saved = os.environ.get("OPENBLAS_NUM_THREADS")
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        try:
            return _OwnBLAS(path, ctypes.CDLL(path, mode=getattr(os, "RTLD_LOCAL", 0)))
        except (OSError, AttributeError):
            return None
        finally:
            if saved is None:
                del os.environ["OPENBLAS_NUM_THREADS"]
            else:
                os.environ["OPENBLAS_NUM_THREADS"] = saved


OWN = _load_own(_wheel_library())  # loaded at import: ~1 ms


def own_path():
    """The file of numkv's own OpenBLAS, or None where it is not loaded."""
    return OWN.path if OWN is not None else None


def gemm_function(itemsize):
    """The address of numkv's own ``sgemm_`` (itemsize 4) or ``dgemm_`` (8),
    or 0: the kernel then calls SciPy's BLAS through numba."""
    if OWN is None:
        return 0
    return OWN.sgemm if itemsize == 4 else OWN.dgemm


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
    """Whether the BLAS prefill calls runs on one thread now: numkv's own,
    else every BLAS library of this process (SciPy's is among them)."""
    if OWN is not None:
        return OWN.get_num_threads() == 1
    getters = _blas_getters()
    return bool(getters) and all(get is not None and get() == 1 for get in getters)
