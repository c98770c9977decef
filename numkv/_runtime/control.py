"""The pool's control block, ``ctrl``: the int64 words the caller's kernel
and the resident workers share (``protocol``; ``pool`` makes it and reads
a failure from it), and how Python tells a kernel its call (``caller_role``).
Plain Python: no numba."""

import numpy as np

# Hot fields a cache line apart.
LINE = 8
SEQ = 0  # the last job posted (the workers' futex word)
SLEEPERS = 1 * LINE  # workers asleep on SEQ
# The posted job, written by the caller's kernel just before SEQ (``pool_enter``)
ENTRY, THREADS, N_ITEMS, CLAIMED = range(2 * LINE, 2 * LINE + 4)
FAIL_STATUS, FAIL_INFO = 3 * LINE, 3 * LINE + 1
JOINER = 4 * LINE  # 1 while the caller sleeps on a worker's ``done``
SPIN_NS, CLOSE_NS = 5 * LINE, 5 * LINE + 1  # the spinning rules: never written after ``new_ctrl``
WORKERS = 6 * LINE  # worker r's line: its share's state, then the last job it finished
STATE, DONE = 0, 1
MAX_THREADS = 1024
RECORD = WORKERS + MAX_THREADS * LINE  # the kernel's arguments
RECORD_WORDS = 2048
CTRL_WORDS = RECORD + RECORD_WORDS
CALLER = -1  # the role Python passes for a call on its own thread that keeps the GIL (``caller_role``)
CALLED_OFF = -1  # a share's state once the caller took it back
STATUS_OK, STATUS_NONE = 0, -2  # numba's return codes of a function that returned
# A caller's role packs its call (``caller_role``): -1 - (threads - 1 | claimed << 10 | release << 11 | items << 12)
THREAD_BITS, CLAIMED_BIT, RELEASE_BIT, ITEMS_SHIFT = 10, 10, 11, 12
CLAIMED_FLAG, RELEASE_FLAG = 1 << CLAIMED_BIT, 1 << RELEASE_BIT
assert MAX_THREADS <= 1 << THREAD_BITS


def caller_role(threads, n_items, claimed, release):
    """The ``role`` Python passes a kernel for a call on ``threads`` threads
    over ``n_items`` items (``claimed``: every thread claims items from a
    counter; ``release``: the call lets go of the GIL):
    negative, and the kernel's ``pool_enter`` writes the job from it, so
    that Python writes nothing into ``ctrl`` (a worker spinning on it would
    see every store)."""
    flags = (CLAIMED_FLAG if claimed else 0) | (RELEASE_FLAG if release else 0)
    return -1 - ((threads - 1) | flags | n_items << ITEMS_SHIFT)


def new_ctrl(spin_ns=0, close_ns=0):
    """A control block for a call on one thread that keeps the GIL (never
    written), or for a pool with these spinning rules."""
    ctrl = np.zeros(CTRL_WORDS, np.int64)
    ctrl[SPIN_NS], ctrl[CLOSE_NS] = spin_ns, close_ns
    return ctrl
