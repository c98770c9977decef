"""TensorScatter's copy kernel.

Every array is seen through the canonical view ``(P, Smax, R)``: ``P`` prefix
rows (the dims before the sequence axis, batch first, C order), the sequence
axis, and ``R`` trailing units (the dims after the axis, times ``k`` unsigned
units per element).  The three arrays (``dst``, ``upd``, ``src``) arrive as
flat unsigned buffers; one int64 ``plan`` describes all three, so a call costs
five arguments to dispatch (a 1-token append is pure call overhead):

    plan[:HEADER]            P, R, seq_len, max_seq,
                             copy_all, contiguous, dst/upd/src sequence strides,
                             positions per work item
    plan[HEADER:][:3P]       row offsets of dst, upd, src   (units)
    plan[HEADER + 3P:][:P]   batch row of each prefix row
    plan[HEADER + 4P:][:3R]  column offsets of dst, upd, src (units)

so any strides (transposed, sliced, negative) are read in place.  With
``contiguous`` set every array's columns are ``arange(R)`` and runs are copied
with unit stride.

Preconditions (checked by the wrapper): every offset is in bounds, ``0 <=
write_at[b] < max_seq``, linear writes do not run past ``max_seq``, ``dst``
overlaps neither ``upd`` nor ``src``.

Parallel strategy: one work item per (prefix row, chunk of written sequence
positions), chunks sized by the wrapper to move ~64 KiB; items are independent.
Within an item, positions that come from one source without wrapping are
copied as one run.
"""

import numpy as np
from numba import prange

from .._config import jit

HEADER = 10


def _scatter_body(dst, upd, src, plan, write_at):
    """Write ``upd`` into ``dst`` at ``(write_at[b] + i) % max_seq``.

    ``copy_all`` 0: only the ``seq_len`` updated positions of each row are
    written (in place, O(update)).  ``copy_all`` 1: every position is written,
    from ``upd`` where it is updated and from ``src`` elsewhere (the functional
    form in a single pass).
    """
    n_rows, n_cols, seq_len, max_seq = plan[0], plan[1], plan[2], plan[3]
    copy_all, contiguous = plan[4] != 0, plan[5] != 0
    dst_seq, upd_seq, src_seq, chunk = plan[6], plan[7], plan[8], plan[9]
    rows = plan[HEADER:HEADER + 3 * n_rows]
    batch_of = plan[HEADER + 3 * n_rows:HEADER + 4 * n_rows]
    cols = plan[HEADER + 4 * n_rows:HEADER + 4 * n_rows + 3 * n_cols]
    n_pos = max_seq if copy_all else seq_len
    n_chunks = (n_pos + chunk - 1) // chunk
    for item in prange(n_rows * n_chunks):
        # Integer division costs ~30 ns an item, a 1-token append's whole
        # copy: skip it when rows are not chunked, and look the batch row up.
        # int64: the prange index is unsigned, and unified with the int64
        # branch below it would become float64.
        k = np.int64(item)
        if n_chunks == 1:
            p, pos = k, 0
        else:
            p = k // n_chunks
            pos = (k - p * n_chunks) * chunk
        stop = min(n_pos, pos + chunk)
        start = write_at[batch_of[p]]
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
            d0 = rows[p] + out_pos * dst_seq
            if from_update:
                _copy_positions(dst, d0, dst_seq, upd, rows[n_rows + p] + i * upd_seq, upd_seq,
                                run, cols, n_cols, contiguous)
            else:
                _copy_positions(dst, d0, dst_seq, src, rows[2 * n_rows + p] + out_pos * src_seq,
                                src_seq, run, cols, 2 * n_cols, contiguous)
            pos += run


@jit()
def _copy_positions(dst, d0, dst_seq, a, a0, a_seq, run, cols, c0, contiguous):
    """Copy ``run`` consecutive sequence positions; one long unit-stride loop
    when both sides hold them back to back (the functional form then copies at
    memcpy speed instead of 512-byte rows at a time)."""
    n_cols = cols.shape[0] // 3
    if contiguous and dst_seq == n_cols and a_seq == n_cols:
        _copy_run(dst, d0, a, a0, cols, c0, True, run * n_cols)
    else:
        for t in range(run):
            _copy_run(dst, d0 + t * dst_seq, a, a0 + t * a_seq, cols, c0, contiguous, n_cols)


@jit()
def _copy_run(dst, d0, a, a0, cols, c0, contiguous, n_units):
    """Copy ``n_units`` units: unit stride when ``contiguous`` (a loop LLVM
    vectorises), else one row through the column offset tables."""
    if contiguous:
        # Slices indexed by a range variable from 0: numba then drops its
        # negative-index wraparound and LLVM vectorises the copy (measured 7x
        # faster than indexing dst[d0 + r]).
        out = dst[d0:d0 + n_units]
        run = a[a0:a0 + n_units]
        for r in range(n_units):
            out[r] = run[r]
    else:
        for r in range(n_units):
            dst[d0 + cols[r]] = a[a0 + cols[c0 + r]]


scatter_serial = jit()(_scatter_body)
scatter_parallel = jit(parallel=True)(_scatter_body)
