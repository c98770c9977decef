"""TensorScatter's copy kernel.

Every array is seen through the canonical view ``(P, Smax, R)``: ``P`` prefix
rows (the dims before the sequence axis, batch first, C order), the sequence
axis, and ``R`` trailing units (the dims after the axis, times ``k`` unsigned
units per element).  The three arrays (``dst``, ``upd``, ``src``) arrive as
flat unsigned buffers; one int64 ``plan`` describes all three, so a call costs
six arguments to dispatch (a 1-token append is pure call overhead):

    plan[:HEADER]            P, R, seq_len, max_seq,
                             copy_all, contiguous, dst/upd/src sequence strides,
                             positions per work item
    plan[HEADER:][:3P]       row offsets of dst, upd, src   (units)
    plan[HEADER + 3P:][:P]   batch row of each prefix row
    plan[HEADER + 4P:][:3R]  column offsets of dst, upd, src (units)

so any strides (transposed, sliced, negative) are read in place.  With
``contiguous`` set every array's columns are ``arange(R)`` and runs are copied
with unit stride.  The wrapper's in-place fast path may pass whole
C-contiguous float32 arrays instead of flat buffers: ``_units`` views them
as flat uint32 here.

Preconditions (checked by the wrapper): every offset is in bounds,
``write_indices`` is a private int64 copy with one entry per batch row, in
linear mode ``0 <= write_indices[b] <= max_seq - seq_len``; ``dst`` overlaps
neither ``upd`` nor ``src``.  (``append_token``, the in-place fast path's
1-token append, copies and checks ``write_indices`` itself.)

Parallel strategy: one work item per (prefix row, chunk of written sequence
positions), chunks sized by the wrapper to move ~64 KiB; items are independent
and ``numkv._runtime.pool`` hands contiguous ranges of them to its threads.
Within an item, positions that come from one source without wrapping are
copied as one run.
"""

import numpy as np
from numba import types
from numba.extending import overload

from .._config import jit
from .._runtime.protocol import pool_enter, pool_exit

# sha256 of the sources of the modules this one compiles into its kernels
# (every ``numkv`` module it imports, and theirs): numba's disk cache
# notices edits to a kernel's own file only, and
# ``tests/test_kernel_layout.py`` fails, printing the new value, until this
# is updated after a helper changes (updating it makes numba recompile).
HELPERS_SHA256 = "d94eb70804b94aea36fd47857741d29335cf05a0cf89a8d3f004ae080d3bfccc"

HEADER = 10


@jit()
def scatter_items(first, stop, dst_in, upd_in, src_in, plan, write_indices, circular, ctrl, role):
    """``_scatter_items`` on the pool (``ctrl`` and ``role``: ``_runtime.protocol``)."""
    if not pool_enter(ctrl, role):
        return
    _scatter_items(first, stop, dst_in, upd_in, src_in, plan, write_indices, circular)
    pool_exit(ctrl, role)


@jit()
def _scatter_items(first, stop, dst_in, upd_in, src_in, plan, write_indices, circular):
    """Work items ``first .. stop`` (of ``n_items(plan)``): write ``upd`` into
    ``dst`` at ``(write_indices[b] + i) % max_seq``.

    ``copy_all`` 0: only the ``seq_len`` updated positions of each row are
    written (in place, O(update)).  ``copy_all`` 1: every position is written,
    from ``upd`` where it is updated and from ``src`` elsewhere (the functional
    form in a single pass).

    The arrays are flat unsigned buffers, or (the in-place fast path) whole
    C-contiguous float32 arrays, viewed here as flat uint32 (see ``_units``).
    """
    dst, upd, src = _units(dst_in), _units(upd_in), _units(src_in)
    n_rows, n_cols, seq_len, max_seq = plan[0], plan[1], plan[2], plan[3]
    copy_all, contiguous = plan[4] != 0, plan[5] != 0
    dst_seq, upd_seq, src_seq, chunk = plan[6], plan[7], plan[8], plan[9]
    # Where the plan's tables start (indexing the plan itself, not slices of
    # it, spares a 1-token append ~10% of its time).
    rows = HEADER
    batch_of = rows + 3 * n_rows
    cols = batch_of + n_rows
    if seq_len == 1 and contiguous and not copy_all:
        # A 1-token append (decode): one run of ``n_cols`` units per row, no
        # wrap.  The general loop below spends ~6 ns an item deciding what
        # this branch knows: the kernel's work (its dispatch aside) at 32 rows
        # of 512 bytes, 0.67 -> 0.49 us, a median of interleaved CPU times.
        _token_rows(dst, upd, plan, write_indices, first, stop, circular)
        return
    n_pos = max_seq if copy_all else seq_len
    n_chunks = (n_pos + chunk - 1) // chunk
    for k in range(first, stop):
        # Integer division costs ~30 ns an item, a 1-token append's whole
        # copy: skip it when rows are not chunked, and look the batch row up.
        if n_chunks == 1:
            p, pos = k, 0
        else:
            p = k // n_chunks
            pos = (k - p * n_chunks) * chunk
        stop = min(n_pos, pos + chunk)
        start = write_indices[plan[batch_of + p]]
        if circular:
            start %= max_seq  # Python's modulo: negative indices count from the end
        while pos < stop:
            # The longest run of positions from one source that does not wrap.
            if copy_all:
                out_pos = pos
                i = pos - start
                if i < 0:
                    i += max_seq
                from_update = i < seq_len
                run = min(stop - pos, seq_len - i if from_update else max_seq - i)
            else:
                out_pos = start + pos
                if out_pos >= max_seq:
                    out_pos -= max_seq
                i = pos
                from_update = True
                run = min(stop - pos, max_seq - out_pos)
            d0 = plan[rows + p] + out_pos * dst_seq
            if from_update:
                a0, a_seq, a_cols = plan[rows + n_rows + p] + i * upd_seq, upd_seq, cols + n_cols
            else:
                a0, a_seq, a_cols = plan[rows + 2 * n_rows + p] + out_pos * src_seq, src_seq, cols + 2 * n_cols
            # One long unit-stride copy when both sides hold the run back to
            # back (the functional form then copies at memcpy speed), else
            # position by position.  (The copies are written out per source:
            # an array chosen by a branch, or a helper that branches, costs
            # two atomic reference count updates per call.)
            if contiguous and dst_seq == n_cols and a_seq == n_cols:
                n_runs, run_units = 1, run * n_cols
            else:
                n_runs, run_units = run, n_cols
            for t in range(n_runs):
                d, a = d0 + t * dst_seq, a0 + t * a_seq
                if contiguous:
                    if from_update:
                        _copy_units(dst, d, upd, a, run_units)
                    else:
                        _copy_units(dst, d, src, a, run_units)
                elif from_update:
                    _gather_units(dst, d, upd, a, plan, cols, a_cols, n_cols)
                else:
                    _gather_units(dst, d, src, a, plan, cols, a_cols, n_cols)
            pos += run


@jit()
def append_token(dst_in, upd_in, plan, write_indices, circular):
    """The wrapper's in-place fast path for a 1-token append of unit-stride
    rows (``plan``'s ``seq_len`` 1, ``contiguous``, not ``copy_all``): every
    row of ``upd`` to ``write_indices[b]`` (modulo ``max_seq`` where
    ``circular``), on the calling thread.  ``write_indices`` is the caller's
    int64 array, read once into a copy of the kernel's own and checked here
    -- the one kernel that checks what it is given, for its time: it runs
    without the GIL, and a private copy and its check made in Python took
    the call (its dispatch included, batch 4) from 0.99 to 1.58 us, of a
    ~2.2 us append.  Returns ``(-1, 0)`` when done; in linear mode,
    for a start outside ``0 .. max_seq - 1``, the first such batch row and
    the start it read, with nothing written (the wrapper raises, naming
    them)."""
    dst, upd = _units(dst_in), _units(upd_in)
    starts = write_indices.copy()
    if not circular:
        last = plan[3] - 1
        for b in range(starts.size):
            if not 0 <= starts[b] <= last:
                return b, starts[b]
    _token_rows(dst, upd, plan, starts, 0, plan[0], circular)
    return -1, 0


@jit(inline=True)
def _token_rows(dst, upd, plan, starts, first, stop, circular):
    """Prefix rows ``first .. stop`` of a 1-token append (one run of
    ``n_cols`` units a row): ``upd``'s row to position ``starts[b]`` of
    ``dst``'s (modulo ``max_seq`` where ``circular``)."""
    n_rows, n_cols, max_seq, dst_seq = plan[0], plan[1], plan[3], plan[6]
    rows = HEADER
    upd_rows, batch_of = rows + n_rows, rows + 3 * n_rows
    for p in range(first, stop):
        start = starts[plan[batch_of + p]]
        if circular:
            start %= max_seq  # Python's modulo: negative indices count from the end
        _copy_units(dst, plan[rows + p] + start * dst_seq, upd, plan[upd_rows + p], n_cols)


@jit(inline=True)
def _copy_units(dst, d0, a, a0, n_units):
    """``dst[d0:d0 + n_units] = a[a0:a0 + n_units]``.  Unsigned indices: numba
    then drops its negative-index wraparound, so LLVM vectorises the loop
    (int64 indices measured 4x slower on a 1-token append), and no slice
    objects (reference counted) are made."""
    d, s = np.uint64(d0), np.uint64(a0)
    for r in range(np.uint64(n_units)):
        dst[d + r] = a[s + r]


@jit(inline=True)
def _gather_units(dst, d0, a, a0, plan, dst_cols, a_cols, n_cols):
    """One position's ``n_cols`` units through the plan's column offset tables."""
    for r in range(n_cols):
        dst[d0 + plan[dst_cols + r]] = a[a0 + plan[a_cols + r]]


def _units(a):
    """``a`` as the flat unsigned units the kernel moves (numba: the overload)."""
    raise NotImplementedError("numba only")


@overload(_units, inline="always")
def _units_overload(a):
    """A C-contiguous float32 array of any rank as flat uint32 (a view), what
    the wrapper's in-place fast path passes: NumPy's ``ravel().view()`` of the
    cache and the update cost that path ~0.6 us of its ~3.5 (two new arrays,
    each also unboxed fresh by numba's dispatcher).  Anything else arrives
    flat and unsigned already."""
    if isinstance(a.dtype, types.Float) and a.dtype.bitwidth == 32 and a.layout == "C" and a.ndim > 1:
        return lambda a: a.reshape(-1).view(np.uint32)
    return lambda a: a
