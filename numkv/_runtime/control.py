"""The pool's control block, ``ctrl``: the int64 words the caller, its
kernel and the resident workers share (``protocol``), and that ``pool``
fills in Python.  Plain Python: no numba."""

import numpy as np

# Hot fields a cache line apart.
LINE = 8
SEQ = 0  # the last job posted (the workers' futex word)
SLEEPERS = 1 * LINE  # workers asleep on SEQ
ENTRY, THREADS, N_ITEMS, CLAIMED, RELEASE, SPIN_NS, CLOSE_NS = range(2 * LINE, 2 * LINE + 7)
FAIL_STATUS, FAIL_INFO = 3 * LINE, 3 * LINE + 1
JOINER = 4 * LINE  # 1 while the caller sleeps on a worker's ``done``
WORKERS = 5 * LINE  # worker r's line: its share's state, then the last job it finished
STATE, DONE = 0, 1
MAX_THREADS = 1024
RECORD = WORKERS + MAX_THREADS * LINE  # the kernel's arguments
RECORD_WORDS = 2048
CTRL_WORDS = RECORD + RECORD_WORDS
CALLER = -1  # the role Python passes
CALLED_OFF = -1  # a share's state once the caller took it back
STATUS_OK, STATUS_NONE = 0, -2  # numba's return codes of a function that returned



def new_ctrl(spin_ns=0, close_ns=0):
    """A control block for a call on one thread that keeps the GIL (never
    written), or for a pool with these spinning rules."""
    ctrl = np.zeros(CTRL_WORDS, np.int64)
    ctrl[THREADS], ctrl[SPIN_NS], ctrl[CLOSE_NS] = 1, spin_ns, close_ns
    return ctrl
