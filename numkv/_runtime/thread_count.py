"""How many threads numkv's kernels use: ``numkv.set_num_threads`` / ``get_num_threads``.

One count, process-wide: ``numkv._runtime.pool`` reads it on every call (``current``).
The default is ``NUMBA_NUM_THREADS`` when set, else ``OMP_NUM_THREADS`` when
set (what Dask, joblib and batch schedulers set in their workers: numba
ignores it), else the CPUs this process may run on.  It is read when numkv is
imported, as OpenMP and BLAS runtimes read theirs when they load: a Dask
``LocalCluster`` sets ``OMP_NUM_THREADS=1`` in the client's own process too
(measured, distributed 2026.8), which must not throttle the numkv already
running there.  ``threadpoolctl.threadpool_limits`` sets the count through
``threadpoolctl_hook``.  numkv's threads are its own (``numkv._runtime.pool``), so no
other library's thread count (numba's, OpenMP's, torch's) is ever changed.
"""

import os

from .._validate import as_int


def _env_threads(name):
    """A thread count from the environment, or None (``OMP_NUM_THREADS`` may
    list one per nesting level: the first is the outer one)."""
    value = os.environ.get(name, "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def cores():
    """The CPUs this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1  # pragma: no cover - not Linux


def _default():
    return _env_threads("NUMBA_NUM_THREADS") or _env_threads("OMP_NUM_THREADS") or cores()


_DEFAULT = _default()
_threads = _DEFAULT


def set_num_threads(n):
    """Set the number of threads numkv's kernels use, process-wide; ``None``
    restores the default (``NUMBA_NUM_THREADS``, else ``OMP_NUM_THREADS``, else
    every core the process may use, as read at ``import numkv``).

    The threads are numkv's own, started on the first call that needs them
    and kept, asleep, between calls.  Where calls come close together (less
    than 2 ms apart), a thread spins ~100 us after one before it sleeps, so
    that the next finds it awake (waking a sleeping thread costs tens of
    microseconds); calls further apart never spin.  To turn spinning off
    (a machine shared with other busy processes, power), set the
    environment variable ``NUMKV_SPIN_US=0`` before numkv's first
    multi-threaded call; another value sets the spin in microseconds."""
    global _threads
    if n is None:
        _threads = _DEFAULT
        return
    n = as_int(n, "n")
    if n < 1:
        raise ValueError(f"n must be >= 1 (or None for the default), got {n}")
    _threads = n


def get_num_threads():
    """The number of threads numkv's kernels use (see ``set_num_threads``)."""
    return _threads
