"""Kernels on numkv's pool for the tests: they record which share ran each
item, block until told, or raise, as a kernel would (``_runtime.protocol``)."""

import numba
import numpy as np

from numkv._kernels.simd import _claim
from numkv._runtime.protocol import _add, _load, _pause, _store, pool_enter, pool_exit


@numba.njit
def count_items(first, stop, hits, shares, work, ctrl, role):
    """``hits[i] += 1`` (atomically) for each item of the share, after
    ``work`` spins; ``shares[max(role, 0)] = 1`` (the caller's share has a
    negative role, or 0 when it runs without the GIL)."""
    if not pool_enter(ctrl, role):
        return
    _store(shares, max(role, 0), 1)
    for i in range(first, stop):
        for _ in range(work):
            _pause()
        _add(hits, i, 1)
    pool_exit(ctrl, role)


@numba.njit
def claim_items(first, stop, hits, shares, counter, ctrl, role):
    """``hits[i] += 1`` for each item of ``[first, stop)`` this share
    claims from ``counter`` (a ``claimed`` call: every share gets the whole
    range); ``shares[max(role, 0)] = 1``."""
    if not pool_enter(ctrl, role):
        return
    _store(shares, max(role, 0), 1)
    while True:
        i = first + _claim(counter)
        if i >= stop:
            break
        _add(hits, i, 1)
    pool_exit(ctrl, role)


@numba.njit
def block(first, stop, flags, ctrl, role):
    """A share that does not start at item 0 says so (``flags[0] = 1``) and
    waits for ``flags[1]`` before it returns (``flags[2] = 1``)."""
    if not pool_enter(ctrl, role):
        return
    if first > 0:
        _store(flags, 0, 1)
        while _load(flags, 1) == 0:
            _pause()
        _store(flags, 2, 1)
    pool_exit(ctrl, role)


@numba.njit
def fail_at(first, stop, bad, out, ctrl, role):
    """``out[i] = 1`` for the share's items; item ``bad`` raises."""
    if not pool_enter(ctrl, role):
        return
    for i in range(first, stop):
        if i == bad:
            raise ValueError("item is bad")
        out[i] = 1
    pool_exit(ctrl, role)


def shares_used(n_items=64, small=False, **options):
    """How many shares of ``n_items`` items ran (on as many threads)."""
    from numkv._runtime import pool

    hits, shares = np.zeros(n_items, np.int64), np.zeros(1024, np.int64)
    pool.run(count_items, n_items, (hits, shares, 0), small, **options)
    assert (hits == 1).all(), hits
    return int(shares.sum())
