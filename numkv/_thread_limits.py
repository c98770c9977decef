"""How many threads numkv's kernels use (placeholder: the process default)."""

import os


def _default():
    for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").split(",")[0].strip()
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_threads = _default()


def current():
    return _threads


def set_current(n):
    global _threads
    _threads = _default() if n is None else n
