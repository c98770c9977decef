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
  threads just queue (numba's ``workqueue`` layer aborts), and nothing changes
  the OpenMP or TBB settings that torch shares;
* idle workers block on a queue.  Only a worker whose jobs come close
  together (one within ``IDLE_SPIN_SECONDS`` of the last) watches for the
  next a while before it sleeps: waking a sleeping thread costs 25-50 us on
  a VM, a good part of a small call, while a worker called now and then spins
  not at all, so a machine busy with other work (torch's own threads
  between two attention calls) loses no time to it;
* a kernel run ``joined`` (the attention kernel) takes part: it posts its
  workers' jobs and waits for them without the GIL (``_kernels.spin_wait``:
  a thread that waits for the GIL sleeps), and where it claims its items,
  its caller calls off the workers that have not started by the time every
  item is taken: a worker that wakes late costs the call nothing;
* the thread count is numkv's own (``numkv.set_num_threads``), process-wide.

Work items are independent and each is computed the same way whichever thread
runs it, so results never depend on the thread count.
"""

import os
import queue
import threading
import time

import numpy as np

from .._kernels.layout import CALLED_OFF, FLAG_SLOT
from . import thread_count

MAX_WORKERS = 1023
# How long a caller that has done its own share spins for the workers' shares
# before it sleeps: 20,000 polls of ~30 ns (why: ``_kernels/spin_wait.py``).
SPIN_POLLS = 20_000
# How long a worker whose jobs come close together watches for the next one
# before it sleeps: ~100 us (4,000 polls of ~26 ns, 2-core EPYC).
IDLE_SPIN_POLLS = 4_000
IDLE_SPIN_SECONDS = 100e-6
_NO_FLAGS, _ALONE = np.zeros(2 * FLAG_SLOT, np.int64), np.zeros(1, np.int64)  # a joined kernel on one thread


class _Pool:
    """Persistent daemon worker threads, each with its own job queue, and
    ``flags`` (``layout.FLAG_SLOT``): a slot per worker holding the
    sequence number of the last job posted to it (what an idle worker
    watches), then one holding that of the last job it finished (what a
    caller spins on)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inboxes = []
        self._sequence = 0
        self.flags = np.zeros(2 * (MAX_WORKERS + 1) * FLAG_SLOT, np.int64)
        self.finished = self.flags[self.flags.size // 2:]

    def submit(self, jobs, post=True):
        """Hand ``jobs[i] = (kernel, first, stop, args, done, state)`` to
        worker ``i`` (``state``: a joined call's ``(call, role)``, else
        None) and, ``post``, tell it so (a joined kernel does that itself);
        returns the sequence number the workers write when each is done."""
        with self._lock:  # sequence numbers reach each worker in order
            while len(self._inboxes) < len(jobs):
                from .._kernels.spin_wait import signal_then_wait

                inbox = queue.SimpleQueue()
                index = len(self._inboxes)
                # Compiled here, not first in the new thread: a compile notice
                # and ``warmup`` see it, and the first jobs need not wait for it.
                signal_then_wait(self.flags, -1, 0, index * FLAG_SLOT, 0, 0)
                threading.Thread(target=_work, args=(inbox, index * FLAG_SLOT, self.flags), daemon=True,
                                 name=f"numkv-{index + 1}").start()
                self._inboxes.append(inbox)
            self._sequence += 1
            for inbox, job in zip(self._inboxes, jobs):
                inbox.put((*job, self._sequence))
            for index in range(len(jobs) if post else 0):  # after the put: a worker that sees it finds the job
                self.flags[index * FLAG_SLOT] = self._sequence
            return self._sequence

    def forget(self):
        """After a fork: the child has none of the parent's threads."""
        self._lock = threading.Lock()
        self._inboxes = []


def _work(inbox, slot, flags):
    from .._kernels.spin_wait import signal_then_wait

    sequence, close, last, finished = 0, False, -1.0, flags.size // 2 + slot
    while True:
        # Writes that job ``sequence`` is finished after the put below (a
        # caller that sees it finds the result) and without the GIL (a caller
        # that sees it does not wait for it); then, where jobs come close
        # together, watches for the next.
        signal_then_wait(flags, finished, sequence, slot, sequence + 1, IDLE_SPIN_POLLS if close else 0)
        kernel, first, stop, args, done, state, sequence = inbox.get()
        close = time.perf_counter() - last < IDLE_SPIN_SECONDS
        try:
            kernel(first, stop, *args)
        except BaseException as exc:  # handed to the caller, which re-raises it
            done.put(exc)
        else:
            # A share the caller called off (a joined kernel returns at once)
            # puts nothing: the caller waits for one put per share it did not
            # call off, and another's would stand in for a share still running.
            if state is None or state[0][state[1]] != CALLED_OFF:
                done.put(None)
        last = time.perf_counter()


_pool = _Pool()
os.register_at_fork(after_in_child=_pool.forget)


def run(kernel, n_items, args, small=False, claimed=False, max_threads=None, joined=False):
    """``kernel(first, stop, *args)`` over the items ``[0, n_items)``, split
    into contiguous shares over numkv's threads, or, ``claimed``, the whole
    range to every thread (the kernel claims items one at a time from a
    counter among ``args``); ``small`` work (below the point where handing
    out shares costs more than it saves) runs on the calling thread alone,
    and no more than ``max_threads`` threads share the rest: each share
    handed out costs the caller ~20 us (16 Intel cores: an empty kernel
    on 2 / 4 / 8 / 16 threads came back in 21 / 75 / 151 / 310 us).

    ``joined``: the kernel takes three more arguments, ``flags``, ``call``
    and its role (0 for the caller, ``i`` for worker ``i``); the caller's
    share begins with ``spin_wait._post_jobs`` and ends with
    ``_join_workers``, a worker's begins by taking its share (``call[i]``:
    ``NOT_STARTED`` -> ``STARTED``, atomically) or returns."""
    threads = 1 if small else min(thread_count.get_num_threads(), n_items, MAX_WORKERS + 1,
                                  max_threads or MAX_WORKERS + 1)
    if threads <= 1:
        kernel(0, n_items, *args, *((_NO_FLAGS, _ALONE, 0) if joined else ()))
        return
    if claimed:
        shares = [(0, n_items)] * threads
    else:
        bounds = [n_items * t // threads for t in range(threads + 1)]
        shares = list(zip(bounds, bounds[1:]))
    from .._kernels.spin_wait import signal_then_wait

    done = queue.SimpleQueue()
    call = np.zeros(threads, np.int64)  # (joined) the sequence number, then each worker's state
    jobs = [(kernel, first, stop, (*args, _pool.flags, call, worker) if joined else args, done,
             (call, worker) if joined else None) for worker, (first, stop) in enumerate(shares[1:], 1)]
    error = sequence = None
    try:  # (from the hand-out on: a Ctrl-C after it still waits for the shares below)
        sequence = call[0] = _pool.submit(jobs, post=not joined)
        kernel(*shares[0], *args, *((_pool.flags, call, 0) if joined else ()))
    except BaseException as exc:
        error = exc
    if sequence is None:  # nothing handed out
        raise error
    try:
        for worker in range(threads - 1):
            # Called off by the kernel's end (a kernel that raised before it
            # called none off).  A joined kernel has spun for the others already.
            if joined and call[worker + 1] == CALLED_OFF:
                continue
            signal_then_wait(_pool.flags, -1, 0, _pool.flags.size // 2 + worker * FLAG_SLOT, sequence,
                             0 if joined else SPIN_POLLS)
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
    while any(_pool.finished[w * FLAG_SLOT] < sequence for w in range(workers)):
        try:
            time.sleep(1e-4)
        except BaseException:  # another Ctrl-C: still wait
            continue
