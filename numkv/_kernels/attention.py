"""Blocked attention with an online softmax (ONNX Attention, opsets 23-25).

Named dims: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads, ``G =
Hq // Hkv`` query heads per kv head, ``Sq`` queries, ``P`` past keys, ``T = P +
Skv`` keys in all, ``D`` Q/K head size, ``Dv`` V head size.

Every tensor arrives as a flat 1-D buffer plus four element strides in the
logical order ``(b, h, s, d)`` and a base offset, so 3-D inputs, transposes and
cache slices are read in place.  Q/K/V buffers are float32, float64, or raw
``uint16`` / ``uint8`` bits widened through a float32 decode table (float16,
bfloat16, float8): one K/V tile at a time, never the whole cache.  Keys ``j <
P`` come from the past buffers, the rest from the new K/V: no concatenation.

``y`` (and the additive ``mask``) have the accumulation dtype: float32, or
float64 for float64 Q or ``softmax_precision`` DOUBLE; scores, softmax and
accumulators use it too.

Which keys a query ``i`` of batch ``b`` sees is one interval per row,
``lo <= j <= hi``, folded by the wrapper from ``is_causal``, the offset
(``P`` or ``nonpad_kv_seqlen[b] - Sq``), the window sizes, the valid length
and the mask's length; the additive mask is applied inside it.  Tiles outside
every row's interval are never loaded.

Parallel strategy: a flat ``prange`` over work items ``(b, kv_head, q_tile,
kv_chunk)``; an item owns all ``G`` query heads that share its kv head, so each
K/V tile is loaded once for them (GQA is an index map).  Long key ranges with
few query tiles (decode) are split into chunks whose length depends on the
shapes only; the partial softmaxes are then merged in chunk order, so results
do not depend on the thread count.

Preconditions (the wrapper checks them): every index the strides produce is in
bounds, ``0 <= valid[b] <= T``, tile sizes >= 1, ``Hq % Hkv == 0``.
"""

import math

import numpy as np
from numba import prange, types
from numba.extending import overload

from .._config import jit

# ints[] layout (see _attention.py, which fills it)
(B_, HQ, HKV, SQ, T_, PAST, D_, DV, CAUSAL, LEFT, RIGHT, HAS_MASK, BQ, BK, CHUNK,
 N_QT, N_CH, Q0, KP0, KN0, VP0, VN0, M0, Y0) = range(24)
# strides[] layout: four (b, h, s, d) strides per tensor, in this order
QS, KPS, KNS, VPS, VNS, MS, YS = (4 * i for i in range(7))


def widen(buf, i, table):
    """``buf[i]`` as a number: decoded through ``table`` when ``buf`` holds bits."""


@overload(widen)
def _widen(buf, i, table):
    if isinstance(buf.dtype, types.Integer):
        return lambda buf, i, table: table[buf[i]]
    return lambda buf, i, table: buf[i]


@jit()
def _row_bounds(i, off, valid, causal, left, right):
    """Inclusive key interval ``[lo, hi]`` of query ``i`` (``hi < lo``: none)."""
    pos = off + i  # the query's absolute position
    hi = valid - 1
    if causal and pos < hi:
        hi = pos
    if right >= 0 and pos + right < hi:
        hi = pos + right
    lo = 0
    if left >= 0 and pos - left > lo:
        lo = pos - left
    return lo, hi


@jit()
def _load_kv_tile(kt, vt, j0, n, b, hk, kp, kn, k_tab, vp, vn, v_tab, ints, st):
    """Widen keys ``j0 .. j0+n`` of kv head ``hk`` into the rows of ``kt`` and
    ``vt`` (contiguous rows: the dot products below vectorise).  Keys before
    ``past`` come from the past buffers, the rest from the new K/V."""
    past = ints[PAST]
    n_past = min(max(past - j0, 0), n)
    if n_past > 0:
        _load_rows(kt, 0, n_past, kp, ints[KP0] + b * st[KPS] + hk * st[KPS + 1] + j0 * st[KPS + 2],
                   st[KPS + 2], st[KPS + 3], k_tab)
        _load_rows(vt, 0, n_past, vp, ints[VP0] + b * st[VPS] + hk * st[VPS + 1] + j0 * st[VPS + 2],
                   st[VPS + 2], st[VPS + 3], v_tab)
    if n_past < n:
        s0 = j0 + n_past - past
        _load_rows(kt, n_past, n, kn, ints[KN0] + b * st[KNS] + hk * st[KNS + 1] + s0 * st[KNS + 2],
                   st[KNS + 2], st[KNS + 3], k_tab)
        _load_rows(vt, n_past, n, vn, ints[VN0] + b * st[VNS] + hk * st[VNS + 1] + s0 * st[VNS + 2],
                   st[VNS + 2], st[VNS + 3], v_tab)


@jit()
def _load_rows(tile, first, stop, buf, base, seq_stride, stride, table):
    """``tile[first + t, d] = buf[base + t * seq_stride + d * stride]``, widened.

    Offsets are >= 0 by construction; indexing with unsigned integers spares
    numba's negative-index wraparound, so the unit-stride copy vectorises.
    Indexing the 2-D tile directly (no row views) keeps NRT reference counting
    out of the per-key loop (it cost ~100 ns a key).
    """
    width = tile.shape[1]
    for t in range(stop - first):
        row_base = np.uint64(base + t * seq_stride)
        if stride == 1:
            for d in range(width):
                tile[first + t, d] = widen(buf, row_base + np.uint64(d), table)
        else:
            for d in range(width):
                tile[first + t, d] = widen(buf, np.uint64(base + t * seq_stride + d * stride), table)


@jit(inline=True)
def _attention_body(q, q_tab, kp, kn, k_tab, vp, vn, v_tab, mask, y,
                    ints, st, floats, offset, valid):
    # Only the work-item loops are parallel: numba's parfor passes then see a
    # small body, which cut the compile time several-fold.
    n_items = ints[B_] * ints[HKV] * ints[N_QT]
    n_ch = ints[N_CH]
    rows = (ints[HQ] // ints[HKV]) * ints[BQ]
    # Partial softmaxes of split key ranges, merged below (empty when unsplit).
    n_part = n_items * n_ch if n_ch > 1 else 0
    part_m = np.empty((n_part, rows), y.dtype)
    part_l = np.empty((n_part, rows), y.dtype)
    part_acc = np.empty((n_part, rows, ints[DV]), y.dtype)
    for work in prange(n_items * n_ch):
        # int64: numba's prange index is unsigned, and a uint64 argument would
        # compile _work_item a second time.
        _work_item(np.int64(work), q, q_tab, kp, kn, k_tab, vp, vn, v_tab, mask, y,
                   ints, st, floats, offset, valid, part_m, part_l, part_acc)
    if n_ch > 1:
        # Serial: splitting happens only below TARGET_ITEMS items, so the merge
        # is tiny, and a second parallel region cost ~2 s of compile time.
        for item in range(n_items):
            _merge_item(item, y, ints, st, part_m, part_l, part_acc)


@jit()
def _work_item(work, q, q_tab, kp, kn, k_tab, vp, vn, v_tab, mask, y,
               ints, st, floats, offset, valid, part_m, part_l, part_acc):
    """Attention of one ``(b, kv_head, q_tile, kv_chunk)`` item: all ``G``
    query heads of the kv head, ``BQ`` queries, the chunk's keys."""
    hq, hkv, sq = ints[HQ], ints[HKV], ints[SQ]
    d_k, d_v = ints[D_], ints[DV]
    causal, left, right, has_mask = ints[CAUSAL] != 0, ints[LEFT], ints[RIGHT], ints[HAS_MASK] != 0
    bq, bk, chunk, n_qt, n_ch = ints[BQ], ints[BK], ints[CHUNK], ints[N_QT], ints[N_CH]
    scale, softcap = floats[0], floats[1]
    group = hq // hkv
    rows = group * bq
    item, c = work // n_ch, work % n_ch
    b, rest = item // (hkv * n_qt), item % (hkv * n_qt)
    hk, qt = rest // n_qt, rest % n_qt
    i0 = qt * bq
    nq = min(bq, sq - i0)
    off, nvalid = offset[b], valid[b]
    k_start, k_stop = c * chunk, min((c + 1) * chunk, ints[T_])

    # Key interval of every row; the item's union bounds the tiles loaded.
    lo = np.empty(nq, np.int64)
    hi = np.empty(nq, np.int64)
    t_lo, t_hi = k_stop, k_start - 1
    for ii in range(nq):
        lo[ii], hi[ii] = _row_bounds(i0 + ii, off, nvalid, causal, left, right)
        t_lo = min(t_lo, max(lo[ii], k_start))
        t_hi = max(t_hi, min(hi[ii], k_stop - 1))

    m = np.full(rows, -np.inf, y.dtype)
    l = np.zeros(rows, y.dtype)
    acc = np.zeros((rows, d_v), y.dtype)
    if t_lo <= t_hi:
        qs = np.empty((rows, d_k), y.dtype)
        for g in range(group):
            h = hk * group + g
            for ii in range(nq):
                base = ints[Q0] + b * st[QS] + h * st[QS + 1] + (i0 + ii) * st[QS + 2]
                r = g * bq + ii
                _load_rows(qs, r, r + 1, q, base, 0, st[QS + 3], q_tab)
                for d in range(d_k):
                    qs[r, d] *= scale
        kt = np.empty((bk, d_k), y.dtype)
        vt = np.empty((bk, d_v), y.dtype)
        s = np.empty(bk, y.dtype)
        for j0 in range(t_lo, t_hi + 1, bk):
            n = min(bk, t_hi + 1 - j0)
            _load_kv_tile(kt, vt, j0, n, b, hk, kp, kn, k_tab, vp, vn, v_tab, ints, st)
            for g in range(group):
                h = hk * group + g
                for ii in range(nq):
                    jl = max(lo[ii], j0) - j0
                    jh = min(hi[ii], j0 + n - 1) - j0 + 1
                    if jl >= jh:
                        continue
                    r = g * bq + ii
                    _online_softmax_step(
                        r, jl, jh, j0, s, qs[r], kt, vt, m, l, acc[r], softcap,
                        has_mask, mask, ints[M0] + b * st[MS] + h * st[MS + 1]
                        + (i0 + ii) * st[MS + 2], st[MS + 3])

    if n_ch == 1:
        for g in range(group):
            for ii in range(nq):
                r = g * bq + ii
                _write_row(y, ints[Y0] + b * st[YS] + (hk * group + g) * st[YS + 1]
                           + (i0 + ii) * st[YS + 2], st[YS + 3], acc[r], l[r])
    else:
        for r in range(rows):
            part_m[work, r] = m[r]
            part_l[work, r] = l[r]
            for d in range(d_v):
                part_acc[work, r, d] = acc[r, d]


@jit()
def _merge_item(item, y, ints, st, part_m, part_l, part_acc):
    """Combine the chunks' partial softmaxes of one item, in chunk order:
    ``m = max m_c``, ``l = sum l_c e^(m_c - m)``, ``acc = sum acc_c e^(m_c - m)``."""
    hq, hkv, sq, d_v = ints[HQ], ints[HKV], ints[SQ], ints[DV]
    bq, n_qt, n_ch = ints[BQ], ints[N_QT], ints[N_CH]
    group = hq // hkv
    b, rest = item // (hkv * n_qt), item % (hkv * n_qt)
    hk, qt = rest // n_qt, rest % n_qt
    i0 = qt * bq
    nq = min(bq, sq - i0)
    total = np.empty(d_v, y.dtype)
    for g in range(group):
        for ii in range(nq):
            r = g * bq + ii
            m_all = -np.inf
            for c in range(n_ch):
                m_all = max(m_all, part_m[item * n_ch + c, r])
            for d in range(d_v):
                total[d] = 0.0
            l_all = 0.0
            if m_all > -np.inf:
                for c in range(n_ch):
                    w = part_m[item * n_ch + c, r]
                    if w == -np.inf:
                        continue
                    alpha = math.exp(w - m_all)
                    l_all += part_l[item * n_ch + c, r] * alpha
                    pacc = part_acc[item * n_ch + c, r]
                    for d in range(d_v):
                        total[d] += pacc[d] * alpha
            _write_row(y, ints[Y0] + b * st[YS] + (hk * group + g) * st[YS + 1]
                       + (i0 + ii) * st[YS + 2], st[YS + 3], total, l_all)


@jit(reassociate=True)
def _online_softmax_step(r, jl, jh, j0, s, qrow, kt, vt, m, l, acc_row, softcap,
                         has_mask, mask, mask_base, mask_stride):
    """Fold keys ``jl .. jh`` of the loaded tile into row ``r``'s running
    max ``m``, sum ``l`` and accumulator (the flash-attention recurrence)."""
    n = jh - jl
    sr = s[:n]
    d_k = qrow.shape[0]
    # Scores four keys at a time: each q load feeds four vectorised dot
    # products (one q load per four FMAs instead of one per FMA).
    j = 0
    while j + 4 <= n:
        jj = jl + j
        q0 = qrow[0]  # typed like the scores (a 0.0 literal is float64)
        a0, a1, a2, a3 = q0 * kt[jj, 0], q0 * kt[jj + 1, 0], q0 * kt[jj + 2, 0], q0 * kt[jj + 3, 0]
        for d in range(1, d_k):  # reassociated: vectorised reductions
            qd = qrow[d]
            a0 += qd * kt[jj, d]
            a1 += qd * kt[jj + 1, d]
            a2 += qd * kt[jj + 2, d]
            a3 += qd * kt[jj + 3, d]
        sr[j], sr[j + 1], sr[j + 2], sr[j + 3] = a0, a1, a2, a3
        j += 4
    while j < n:
        jj = jl + j
        dot = qrow[0] * kt[jj, 0]
        for d in range(1, d_k):
            dot += qrow[d] * kt[jj, d]
        sr[j] = dot
        j += 1
    m_new = m[r]
    for j in range(n):
        x = sr[j]
        if softcap > 0.0:  # ONNX: softcap before the mask
            x = softcap * math.tanh(x / softcap)
        if has_mask:
            x += mask[mask_base + (j0 + jl + j) * mask_stride]
        sr[j] = x
        if x > m_new:
            m_new = x
    if m_new == -np.inf:  # every key of this span is masked: nothing to add
        return
    # Rescale what was accumulated under the old max: e^(m_old - m_new) (0 at start).
    alpha = math.exp(m[r] - m_new)
    total = l[r] * alpha
    d_v = acc_row.shape[0]
    for d in range(d_v):
        acc_row[d] *= alpha
    for j in range(n):
        x = sr[j]
        # A masked key (-inf) gets weight 0 without an exp, and is skipped below.
        p = 0.0 if x == -np.inf else math.exp(x - m_new)
        total += p
        sr[j] = p
    # acc += p_j v_j, four keys per pass over acc (one load/store of acc per
    # four FMAs); a key of weight 0 adds exactly nothing, so it is skipped
    # (its V may be anything, inf included).
    j = 0
    while j < n:
        jj = jl + j
        if j + 4 <= n and sr[j] != 0 and sr[j + 1] != 0 and sr[j + 2] != 0 and sr[j + 3] != 0:
            p0, p1, p2, p3 = sr[j], sr[j + 1], sr[j + 2], sr[j + 3]
            for d in range(d_v):
                acc_row[d] += (p0 * vt[jj, d] + p1 * vt[jj + 1, d]
                               + p2 * vt[jj + 2, d] + p3 * vt[jj + 3, d])
            j += 4
        else:
            p = sr[j]
            if p != 0:
                for d in range(d_v):
                    acc_row[d] += p * vt[jj, d]
            j += 1
    l[r] = total
    m[r] = m_new


@jit()
def _write_row(y, base, stride, acc_row, total):
    """``y = acc / l``; a row that attended no key (``l == 0``) is zeros."""
    inv = 0.0 if total == 0.0 else 1.0 / total
    for d in range(acc_row.shape[0]):
        y[base + d * stride] = acc_row[d] * inv


# Two entry points (a parallel build and its serial twin) rather than
# ``jit(...)(_attention_body)`` twice: numba's disk cache keys a kernel by its
# Python function and signature, not by its flags (see _kernels/scatter.py).
@jit(parallel=True)
def attention_parallel(q, q_tab, kp, kn, k_tab, vp, vn, v_tab, mask, y, ints, st, floats, offset, valid):
    _attention_body(q, q_tab, kp, kn, k_tab, vp, vn, v_tab, mask, y, ints, st, floats, offset, valid)


@jit()
def attention_serial(q, q_tab, kp, kn, k_tab, vp, vn, v_tab, mask, y, ints, st, floats, offset, valid):
    _attention_body(q, q_tab, kp, kn, k_tab, vp, vn, v_tab, mask, y, ints, st, floats, offset, valid)
