"""``python -m numkv info``: what numkv runs on.

Versions (numkv, Python, NumPy, numba, llvmlite, ml_dtypes), the register
blocks of prefill's matrix products, NumPy's BLAS, threads and how they are
run, what handing a kernel to them costs (the pool's launch, timed), and
where numba keeps numkv's compiled kernels (and whether it could use the
directory asked for).  Compiles nothing but the pool's few small functions
(~1 s on a cold cache), to time the launch.
"""

import importlib
import importlib.metadata
import os
import pkgutil
import platform
import sys

import numpy as np

import numkv
from numkv._cli.compile_notice import is_numkv_kernel


def runtime_info():
    """``(numba version, threads, threading)``: numkv runs its kernels on its
    own thread pool, never numba's threading layer."""
    from numkv._runtime import pool

    return (_version("numba"), numkv.get_num_threads(),
            f"numkv pool (resident workers; they spin {pool._spin_us()} us after calls that come close together, "
            f"NUMKV_SPIN_US)")


def add_parser(subparsers):
    p = subparsers.add_parser(
        "info", help="versions, prefill products, BLAS, threads, the pool's launch, kernel cache directory",
        description=__doc__.split("\n\n")[0] + " Compiles only the pool's small functions, to time a launch.")
    p.set_defaults(run=run)
    return p


def _version(distribution):
    """An installed distribution's version, read from its metadata (imports nothing)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def numpy_blas_info():
    """NumPy's BLAS as a short string (the bench's GEMM rate and
    ``numkv.layers``' projections run on it; numkv's kernels do not):
    threadpoolctl's name, version and thread count of the library NumPy
    loaded, else NumPy's build configuration, else "unknown"."""
    from threadpoolctl import threadpool_info

    for lib in threadpool_info():
        path = (lib.get("filepath") or "").replace("\\", "/")
        if lib.get("user_api") == "blas" and "/numpy" in path:
            return (f"{lib.get('internal_api')} {lib.get('version') or ''}".rstrip()
                    + f", {lib.get('num_threads')} thread(s) ({lib.get('filepath')})")
    try:
        config = np.show_config(mode="dicts")
        blas = config["Build Dependencies"]["blas"]
        return f"{blas['name']} {blas.get('version', '')}".rstrip() + " (build configuration)"
    except Exception:  # old NumPy has no mode="dicts"; any shape change: unknown
        return "unknown"


def products_info():
    """Prefill's matrix products: numkv's register blocks, as this CPU gets
    them (``numkv._kernels.gemm``; compiles nothing)."""
    from numkv._kernels import gemm

    return gemm.describe()


def threading_info():
    """``(threads, how)``: numkv's thread count and how its kernels use the
    threads, as numkv's own configuration says (compiles nothing)."""

    _, threads, how = runtime_info()
    return threads, how


def launch_info(calls=2000):
    """What handing a kernel to numkv's threads costs here: the median of
    ``calls`` back-to-back calls of an empty kernel on every thread
    (``python -m numkv bench --only launch`` times it after a gap too)."""
    import statistics
    import time

    from numkv._runtime import pool, protocol

    threads = numkv.get_num_threads()
    pool.run(protocol.empty, threads, ())  # (compiles, or loads from the cache, and starts the workers)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        pool.run(protocol.empty, threads, ())
        times.append(time.perf_counter() - start)
    return f"{statistics.median(times) * 1e6:.1f} us on {threads} thread(s) (an empty kernel, median of {calls} calls)"


def kernel_dispatchers():
    """numba dispatchers of every module in ``numkv._kernels`` (importing
    them compiles nothing: the kernels are lazy)."""
    from numkv import _kernels

    found = []
    for module_info in pkgutil.iter_modules(_kernels.__path__):
        module = importlib.import_module(f"{_kernels.__name__}.{module_info.name}")
        found += [obj for obj in vars(module).values()
                  if hasattr(obj, "stats") and hasattr(obj, "py_func") and is_numkv_kernel(obj)]
    return found


def cache_location():
    """``(path or None, note)``: the directory numba's own cache locator
    chose for numkv's kernels, and a sentence about it.

    numba takes ``NUMBA_CACHE_DIR`` if set, else ``__pycache__`` beside the
    kernels, else a per-user directory, skipping any it cannot write to (it
    tests by writing a file there): a read-only ``NUMBA_CACHE_DIR`` is
    silently passed over, so say so.
    """
    from numkv import _config

    if not _config.CACHE:
        return None, "off (NUMKV_CACHE=0): kernels compile in every new process"
    paths = sorted({d.stats.cache_path for d in kernel_dispatchers()} - {None})
    wanted = os.environ.get("NUMBA_CACHE_DIR")
    ignored = (f"; NUMBA_CACHE_DIR={wanted} is not writable by this user, so numba ignores it"
               if wanted and not any(_inside(p, wanted) for p in paths)
               else "")
    if not paths:
        return None, ("none: no cache directory is writable, kernels compile in every new process"
                      + (ignored or " (set NUMBA_CACHE_DIR to a directory this user can write)"))
    path = paths[0]
    files = [f for f in os.listdir(path) if f.endswith(".nbc")] if os.path.isdir(path) else []
    return path, f"{len(files)} compiled kernel files, writable" + ignored


def _inside(path, directory):
    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return os.path.commonpath([path, directory]) == directory


def run(args=None):
    print(f"numkv {numkv.__version__}  ({os.path.dirname(numkv.__file__)})")
    print(f"python {platform.python_version()} on {platform.machine()} ({os.cpu_count()} CPUs), "
          f"{platform.system()}")
    print(f"numpy {np.__version__}, numba {_version('numba')}, llvmlite {_version('llvmlite')}, "
          f"ml_dtypes {_version('ml_dtypes')}")
    print(f"prefill products: {products_info()}")
    print(f"NumPy's BLAS: {numpy_blas_info()}")
    threads, how = threading_info()
    env = ", ".join(f"{k}={os.environ[k]}" for k in
                    ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_THREADING_LAYER") if k in os.environ)
    print(f"threads: {threads}, threading: {how}" + (f"  ({env})" if env else ""))
    print(f"launch: {launch_info()}")
    path, note = cache_location()
    print(f"kernel cache: {path or '-'}  ({note})")
    sys.stdout.flush()
