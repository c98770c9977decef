"""numkv's thread pool: how every kernel runs on several cores.

numkv does not use numba's threading layers (``prange``).  Each kernel is a
serial, ``nogil`` numba function over a range of independent work items,
``kernel(first, stop, *args)``; ``run`` cuts ``[0, n_items)`` into contiguous
shares, one per thread, hands all but the first to persistent worker threads
and runs the first on the calling thread.  Why:

* compile time: a ``parallel=True`` build of the attention kernel cost ~12 s
  more on a cold cache (numba's parfor passes and two more LLVM passes over the
  linked code) than the serial one;
* it is safe wherever numkv is embedded: a process forked after a call gets
  fresh workers (GNU OpenMP kills such a child), concurrent calls from Python
  threads just queue (numba's ``workqueue`` layer aborts), nothing changes the
  OpenMP or TBB settings that torch shares, and idle workers block on a queue
  rather than spin, so a busy machine loses no time to them;
* the thread count is numkv's own (``numkv.set_num_threads``), process-wide.

Work items are independent and each is computed the same way whichever thread
runs it, so results never depend on the thread count.
"""

import os
import queue
import threading

from . import _thread_limits


class _Pool:
    """Persistent daemon worker threads, each with its own job queue."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inboxes = []

    def inboxes(self, n):
        """The queues of ``n`` workers (started on first need)."""
        with self._lock:
            while len(self._inboxes) < n:
                inbox = queue.SimpleQueue()
                threading.Thread(target=_work, args=(inbox,), daemon=True,
                                 name=f"numkv-{len(self._inboxes) + 1}").start()
                self._inboxes.append(inbox)
            return self._inboxes[:n]

    def forget(self):
        """After a fork: the child has none of the parent's threads."""
        self._lock = threading.Lock()
        self._inboxes = []


def _work(inbox):
    while True:
        kernel, first, stop, args, done = inbox.get()
        try:
            kernel(first, stop, *args)
        except BaseException as exc:  # handed to the caller, which re-raises it
            done.put(exc)
        else:
            done.put(None)


_pool = _Pool()
os.register_at_fork(after_in_child=_pool.forget)


def run(kernel, n_items, args, small=False):
    """``kernel(first, stop, *args)`` over the items ``[0, n_items)``, split
    into contiguous shares over numkv's threads; ``small`` work (below the
    point where handing out shares costs more than it saves) runs on the
    calling thread alone."""
    threads = 1 if small else min(_thread_limits.current(), n_items)
    if threads <= 1:
        kernel(0, n_items, *args)
        return
    bounds = [n_items * t // threads for t in range(threads + 1)]
    done = queue.SimpleQueue()
    for inbox, first, stop in zip(_pool.inboxes(threads - 1), bounds[1:], bounds[2:]):
        inbox.put((kernel, first, stop, args, done))
    error = None
    try:
        kernel(bounds[0], bounds[1], *args)
    except BaseException as exc:
        error = exc
    for _ in range(threads - 1):  # every share must finish before the arrays are released
        failed = done.get()
        error = error or failed
    if error is not None:
        raise error
