"""numkv's thread pool: how every kernel runs on several cores.

numkv does not use numba's threading layers (``prange``).  Each kernel is a
serial, ``nogil`` numba function over a range of independent work items,
``kernel(first, stop, *args)``; ``run`` cuts ``[0, n_items)`` into contiguous
shares, one per thread (or hands every thread the whole range, for a kernel
that claims items from a shared counter), hands all but the first to
persistent worker threads and runs the first on the calling thread.  Why:

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
import time

import numpy as np

from . import thread_count

MAX_WORKERS = 1023
# How long a caller that has done its own share spins for the workers' shares
# before it sleeps: 20,000 polls of ~30 ns (why: ``_kernels/spin_wait.py``).
SPIN_POLLS = 20_000
_SLOT = 8  # int64s per worker in the finished-flags array: one cache line each


class _Pool:
    """Persistent daemon worker threads, each with its own job queue, and an
    array where each worker writes the sequence number of the last job it
    finished (what a caller spins on)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inboxes = []
        self._sequence = 0
        self.finished = np.zeros((MAX_WORKERS + 1) * _SLOT, np.int64)

    def submit(self, jobs):
        """Hand ``jobs[i] = (kernel, first, stop, args, done)`` to worker ``i``;
        returns the sequence number the workers write when each is done."""
        with self._lock:  # sequence numbers reach each worker in order
            while len(self._inboxes) < len(jobs):
                inbox = queue.SimpleQueue()
                index = len(self._inboxes)
                threading.Thread(target=_work, args=(inbox, index * _SLOT, self.finished), daemon=True,
                                 name=f"numkv-{index + 1}").start()
                self._inboxes.append(inbox)
            self._sequence += 1
            for inbox, job in zip(self._inboxes, jobs):
                inbox.put((*job, self._sequence))
            return self._sequence

    def forget(self):
        """After a fork: the child has none of the parent's threads."""
        self._lock = threading.Lock()
        self._inboxes = []


def _work(inbox, slot, finished):
    while True:
        kernel, first, stop, args, done, sequence = inbox.get()
        try:
            kernel(first, stop, *args)
        except BaseException as exc:  # handed to the caller, which re-raises it
            done.put(exc)
        else:
            done.put(None)
        finished[slot] = sequence  # after the put: a caller that sees it finds the result


_pool = _Pool()
os.register_at_fork(after_in_child=_pool.forget)


def run(kernel, n_items, args, small=False, claimed=False, max_threads=None):
    """``kernel(first, stop, *args)`` over the items ``[0, n_items)``, split
    into contiguous shares over numkv's threads, or, ``claimed``, the whole
    range to every thread (the kernel claims items one at a time from a
    counter among ``args``); ``small`` work (below the point where handing
    out shares costs more than it saves) runs on the calling thread alone,
    and no more than ``max_threads`` threads share the rest: each share
    handed out costs the caller ~20 us (16 Intel cores: an empty kernel
    on 2 / 4 / 8 / 16 threads came back in 21 / 75 / 151 / 310 us)."""
    threads = 1 if small else min(thread_count.get_num_threads(), n_items, MAX_WORKERS + 1,
                                  max_threads or MAX_WORKERS + 1)
    if threads <= 1:
        kernel(0, n_items, *args)
        return
    if claimed:
        shares = [(0, n_items)] * threads
    else:
        bounds = [n_items * t // threads for t in range(threads + 1)]
        shares = list(zip(bounds, bounds[1:]))
    done = queue.SimpleQueue()
    sequence = _pool.submit([(kernel, first, stop, args, done) for first, stop in shares[1:]])
    error = None
    try:
        kernel(*shares[0], *args)
    except BaseException as exc:
        error = exc
    from .._kernels.spin_wait import wait_at_least

    try:
        for worker in range(threads - 1):
            wait_at_least(_pool.finished, worker * _SLOT, sequence, SPIN_POLLS)
            failed = done.get()  # at once after a successful spin
            error = error or failed
    except BaseException as exc:  # Ctrl-C while waiting
        error = error or exc
        _wait_for_every_share(sequence, threads - 1)
        while not done.empty():
            error = error or done.get_nowait()
    if error is not None:
        raise error


def _wait_for_every_share(sequence, workers):
    """Return only once every worker has finished job ``sequence``, whatever
    interrupts come meanwhile: the caller's arrays (an in-place cache) must
    not change after the call has raised."""
    while any(_pool.finished[w * _SLOT] < sequence for w in range(workers)):
        try:
            time.sleep(1e-4)
        except BaseException:  # another Ctrl-C: still wait
            continue
