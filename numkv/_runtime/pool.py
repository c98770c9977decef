"""numkv's thread pool: how every kernel runs on several cores.

numkv does not use numba's threading layers (``prange``): each kernel is a
serial numba function over a range of independent work items,
``kernel(first, stop, *args, ctrl, role)``, and ``run`` hands it to
resident workers (``protocol``: threads that stay in compiled code between
jobs and run a job by its kernel's address, never taking the GIL).  Why
its own pool:

* compile time: a ``parallel=True`` build of the attention kernel cost ~12 s
  more on a cold cache than the serial one;
* it is safe wherever numkv is embedded: a process forked after a call gets
  fresh workers (GNU OpenMP kills such a child), concurrent calls from Python
  threads never mix (numba's ``workqueue`` layer aborts): the first takes
  the pool, another runs alone on its own thread meanwhile; nothing changes
  the OpenMP or TBB settings that torch shares;
* a small call keeps the GIL from start to end, so beside a busy Python
  thread it never waits for Python's switch interval (5 ms) to get it back;
  a long one (``release_gil``: the caller's estimate that it runs longer
  than the switch interval) lets other Python threads run meanwhile, and
  so does every call on several threads while ``tracemalloc`` traces: a
  worker's allocation (numba's runtime allocates through Python's raw
  allocator) then calls tracemalloc's hook, which takes the GIL -- held by
  the caller, which waits for the worker: a deadlock;
* idle workers sleep on a futex; a worker whose jobs come close together
  (the gap before its last job shorter than ``_config.CLOSE_US``) first
  spins ``_config.SPIN_US`` for the next: waking a sleeping thread costs
  tens of microseconds on a VM, a good part of a small call, while a worker
  called now and then spins not at all.  ``NUMKV_SPIN_US=0`` turns spinning
  off.  (Read as the pool is made, at import and in a fork's child, and as
  it makes its control block, on the first call that needs the workers.)

Work items are independent and each is computed the same way whichever thread
runs it, so results never depend on the thread count.
"""

import ctypes
import os
import threading
import time
from _tracemalloc import is_tracing as _tracing

from .. import _config
from . import thread_count
from .control import CALLER, FAIL_INFO, FAIL_STATUS, MAX_THREADS, SEQ, caller_role, new_ctrl

MAX_WORKERS = MAX_THREADS - 1


def _spin_us():
    """The workers' spin: ``NUMKV_SPIN_US`` where set, else ``_config.SPIN_US``."""
    value = os.environ.get("NUMKV_SPIN_US", "").strip()
    return int(value) if value.isdigit() else _config.SPIN_US


class _Pool:
    """The workers' control block (``protocol``'s ``ctrl``), the workers
    started on it, and the lock the call that uses them holds."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ctrl = None
        self.workers = 0
        self.last_end = 0.0  # when the last call ended (``hot``)
        self.spin_s = _spin_us() * 1e-6

    def control(self, workers):
        """``ctrl`` with at least ``workers`` workers running on it."""
        if self.ctrl is None:
            self.ctrl = _new_ctrl()
        if self.workers < workers:  # compiled (or loaded) here, not first thing in a new thread: a compile
            from .protocol import compile_resident_loop  # notice sees it, and the workers start at once

            resident_loop = compile_resident_loop(self.ctrl)
        while self.workers < workers:
            self.workers += 1
            threading.Thread(target=resident_loop, args=(self.ctrl, self.workers, int(self.ctrl[SEQ])),
                             daemon=True, name=f"numkv-{self.workers}").start()
        return self.ctrl

    def forget(self):
        """After a fork: the child has none of the parent's threads."""
        self.__init__()


def _new_ctrl():
    return new_ctrl(_spin_us() * 1000, _config.CLOSE_US * 1000)


_pool = _Pool()
_own = threading.local()  # a Python thread's own ctrl, for a call made while another has the pool
# A kernel's last two arguments for a call on its calling thread that keeps
# the GIL (a ctrl that is never written).
ALONE = (new_ctrl(), CALLER)
os.register_at_fork(after_in_child=_pool.forget)


def hot():
    """Whether calls come back to back: the last one ended within the
    workers' spin (``_config.SPIN_US``), so that a share handed out now finds its
    worker awake (or woken once for a run of such calls), where after a
    longer gap it waits tens of microseconds for the worker to wake."""
    return time.perf_counter() - _pool.last_end < _pool.spin_s


def run(kernel, n_items, args, small=False, claimed=False, max_threads=None, release_gil=False):
    """``kernel(first, stop, *args, ctrl, role)`` over the items ``[0,
    n_items)``, split into contiguous shares over numkv's threads, or,
    ``claimed``, the whole range to every thread (the kernel claims items
    one at a time from a counter among ``args``); ``small`` work runs on
    the calling thread alone, and no more than ``max_threads`` threads
    share the rest.  ``release_gil``: the call lets other Python threads
    run while it computes (see the module docstring).  An exception in any
    share is raised here, once every share has stopped."""
    # (Every 0.1 us counts in a launch of ~3 us: comparisons, not ``min()``,
    # and the lock's argument by position, ~0.5 us less on a Zen 3 VM.)
    threads = 1 if small else thread_count._threads
    if n_items < threads:
        threads = max(n_items, 1)
    if max_threads and max_threads < threads:
        threads = max_threads
    if threads > MAX_THREADS:
        threads = MAX_THREADS
    if threads <= 1 and not release_gil:
        kernel(0, n_items, *args, *ALONE)
        _pool.last_end = time.perf_counter()
        return
    release_gil = release_gil or _tracing()  # (see the module docstring)
    locked = _pool.lock.acquire(False)
    try:
        if locked:
            ctrl = _pool.ctrl
            if ctrl is None or _pool.workers < threads - 1:
                ctrl = _pool.control(threads - 1)
        else:  # another Python thread's call has the workers: this one runs alone
            threads, ctrl = 1, getattr(_own, "ctrl", None)
            if ctrl is None:
                ctrl = _own.ctrl = _new_ctrl()
        try:
            kernel(0, n_items if claimed else n_items // threads, *args, ctrl,
                   caller_role(threads, n_items, claimed, release_gil))
        except BaseException:
            if threads > 1:  # the caller's share raised: the others must stop before the arrays go
                from .protocol import join_after_error

                join_after_error(ctrl)
            raise
        if ctrl[FAIL_STATUS]:
            raise _share_error(ctrl)
    finally:
        if locked:
            _pool.lock.release()
        _pool.last_end = time.perf_counter()


class _ExceptionInfo(ctypes.Structure):
    """numba's ``excinfo_t`` (``numba.core.callconv``): a static exception's
    pickled ``(class, args, location)``, its size, then fields a dynamic
    exception uses (``alloc_flag`` non-zero)."""

    _fields_ = [("pickled", ctypes.c_void_p), ("size", ctypes.c_int32), ("hashed", ctypes.c_void_p),
                ("unwrap", ctypes.c_void_p), ("alloc_flag", ctypes.c_int32)]


def _share_error(ctrl):
    """The exception a share that ran through its entry stopped on (then
    forgotten: the next call starts clean)."""
    import pickle

    status, info = int(ctrl[FAIL_STATUS]), int(ctrl[FAIL_INFO])
    ctrl[FAIL_STATUS] = ctrl[FAIL_INFO] = 0
    if status >= 1 and info:
        exc = _ExceptionInfo.from_address(info)
        if exc.alloc_flag == 0 and exc.pickled:
            try:
                kind, exc_args, _ = pickle.loads(ctypes.string_at(exc.pickled, exc.size))
                return kind(*exc_args)
            except Exception:  # pragma: no cover - numba's layout changed
                pass
    return RuntimeError(f"a numkv kernel stopped on an exception in another thread (numba status {status})")
