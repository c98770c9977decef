"""The online softmax of one tile of scores (``_softmax_tile``), and the
float32 ``exp`` it takes (``_exp``), and its end: the merge of a split key
range's partial softmaxes (``_merge_chunks``) and the output rows ``y = acc
/ l`` (``_write_rows``).  Compiled per accumulation dtype into C functions
of their own (``loop_functions``) -- the softmax one for decode's loops and
one for the matrix products' tiles (``fast_sum``) -- each when a call first
needs it.

Per row, once per tile: ``m' = max(m, max_j s_j)``, ``alpha = e^(m -
m')``, ``p_j = e^(s_j - m')``, ``l' = alpha l + sum p_j``; masking *sets*
``-inf`` (it never adds to the score), and a masked key's weight is
``-0.0`` (``_exp``), which decode's value loops leave out.
"""

import math

import numpy as np
from numba import types
from numba.extending import overload

from .._config import jit
from .layout import (BASE, BLOCK_Q, FLOAT_FIELDS, HEADS_PER_ITEM, KV_HEADS, Q_HEADS, STRIDE_B, STRIDE_D, STRIDE_H,
                     STRIDE_S, T_Y, V_HEAD_SIZE)
from .simd import _as_flat, _float32_from_bits, _full_width_loops, _max, _maximum, _min, _row_max, _row_sum

# sha256 of the sources of the modules this one compiles into its kernels
# (every ``numkv`` module it imports, and theirs): numba's disk cache
# notices edits to a kernel's own file only, and
# ``tests/test_kernel_layout.py`` fails, printing the new value, until this
# is updated after a helper changes (updating it makes numba recompile).
HELPERS_SHA256 = "f43068966658d98a3f0eb9af1e2623b7e998a58bcbf5cb4f19caecdcca6b45b7"

# ``floats[SINKS + h]``, where ``floats`` holds more than ``FLOAT_FIELDS``:
# query head ``h``'s sink (``numkv.attention``'s ``sinks``), a logit in its
# softmax's denominator (``_write_rows``).
SINKS = len(FLOAT_FIELDS)

@jit(inline=True)
def _softmax_tile(s, rows, n, nq, j0, lo, hi, edge, mask, mask_base, mask_stride_i,
                  mask_stride_j, mask_stride_g, softcap, score_scale, m, l, alpha, bad, fast_sum):
    """Turn scores ``s[:rows, :n]`` of keys ``j0 ..`` into weights ``p`` (in
    place) and fold them into each row's running max ``m`` and sum ``l``;
    ``alpha[r]`` is the factor the row's accumulator must be rescaled by;
    ``bad[r]`` becomes 1 where a NaN or +inf entered an attended score.
    ``fast_sum`` (the matrix products' tiles): the weights and their sum in
    one reassociated pass.

    ``edge``: some row's interval ends inside the tile, or a mask applies --
    the scores outside ``[lo, hi]`` and where the mask is -inf become -inf.
    """
    inf = np.inf
    flat = _as_flat(s)
    if score_scale != 1.0:  # a scale beyond the dtype's range: its other square-root factor
        for t in range(rows * n):
            flat[t] *= score_scale
    if softcap > 0.0:  # ONNX: the softcap comes before the mask
        for t in range(rows * n):
            flat[t] = softcap * math.tanh(flat[t] / softcap)
    for r in range(rows):
        i = r % nq
        if edge:
            first, stop = _max(lo[i] - j0, 0), _min(hi[i] - j0 + 1, n)
            for j in range(_min(first, n)):
                s[r, j] = -inf
            for j in range(_max(stop, 0), n):
                s[r, j] = -inf
            if mask_base >= 0:
                at = mask_base + (r // nq) * mask_stride_g + i * mask_stride_i + j0 * mask_stride_j
                for j in range(first, stop):
                    bias = mask[at + j * mask_stride_j]
                    s[r, j] = -inf if bias == -inf else s[r, j] + bias
        m_old = m[r]
        m_new = _maximum(m_old, _row_max(flat, r * n, n))
        # NaN or +inf among the attended scores (masked ones are -inf) makes
        # the row NaN; nothing attended yet: no weights, nothing to rescale.
        if not m_new < inf or m_new == -inf:
            if m_new != -inf:
                bad[r] = 1
            for j in range(n):
                s[r, j] = -0.0  # no weight, masked: see _exp
            alpha[r] = 1.0
            continue
        if fast_sum:
            total = _exp_row_sum(s, r, n, m_new)
        else:
            for j in range(n):
                s[r, j] = _exp(s[r, j] - m_new)
            total = _row_sum(flat, r * n, n)
        a = _exp(m_old - m_new)  # 0 on the first keys (m_old = -inf)
        alpha[r] = a
        l[r] = l[r] * a + total
        m[r] = m_new


@jit(inline=True)
def _merge_chunks(part_m, part_l, part_acc, width, at, chunks, rows, acc, m, l, bad):
    """``acc``, ``m``, ``l`` and ``bad`` of the ``rows`` rows from the partial
    softmaxes ``at .. at + chunks`` of a split key range, in chunk order --
    ``m = max m_c``, ``l = sum l_c e^(m_c - m)``, ``acc = sum acc_c e^(m_c -
    m)``; a chunk that saw a NaN (``m_c`` NaN) makes the row NaN.  Partial
    ``p`` holds row ``r``'s ``m`` and ``l`` at ``p * width + r`` of the flat
    ``part_m`` and ``part_l``, and its accumulator from ``(p * width + r) *
    d_v`` of ``part_acc``."""
    d_v = acc.shape[1]
    for r in range(rows):
        l[r], bad[r] = 0.0, 0
        for d in range(d_v):
            acc[r, d] = 0.0
        m_all = -np.inf
        for c in range(chunks):
            mc = part_m[(at + c) * width + r]
            if mc != mc:
                bad[r] = 1
            elif mc > m_all:
                m_all = mc
        m[r] = m_all
        if bad[r] or m_all == -np.inf:
            continue
        for c in range(chunks):
            at_row = (at + c) * width + r
            mc = part_m[at_row]
            if mc == -np.inf:
                continue
            w = _exp(mc - m_all)
            l[r] += part_l[at_row] * w
            for d in range(d_v):
                acc[r, d] += part_acc[at_row * d_v + d] * w


@jit(inline=True)
def _write_rows(y, ints, desc, floats, b, hk, qt_index, rows, acc, m, l, bad):
    """``y = acc / l`` for the tile's rows: zeros where ``l == 0`` (nothing
    attended), NaN where a NaN or +inf entered an attended score: rows ``g *
    nq + i`` of query tile ``qt_index`` of kv head ``hk`` (and the next
    ``HEADS_PER_ITEM - 1``: query head ``hk * group + g``), batch row ``b``,
    in the output ``y`` that ``desc``'s row ``T_Y`` lays out.

    With sinks (``floats`` longer than ``SINKS``), head ``h``'s sink ``s`` is one more
    term of the denominator, a key with no value: ``y = acc / (l + e^(s -
    m))``, ``m`` the row's running max (``acc`` and ``l`` are relative to
    it); where ``s > m``, relative to ``s`` so nothing overflows: ``y = acc
    e^(m - s) / (l e^(m - s) + 1)``."""
    group = ints[Q_HEADS] // ints[KV_HEADS]
    nq = rows // (group * ints[HEADS_PER_ITEM])
    i0 = qt_index * ints[BLOCK_Q]
    d_v, step = ints[V_HEAD_SIZE], np.uint64(desc[T_Y, STRIDE_D])
    sinks = floats.size > SINKS
    for r in range(rows):
        g, i = r // nq, r % nq
        at = np.uint64(desc[T_Y, BASE] + b * desc[T_Y, STRIDE_B] + (hk * group + g) * desc[T_Y, STRIDE_H]
                       + (i0 + i) * desc[T_Y, STRIDE_S])
        inv = np.nan if bad[r] else 0.0 if l[r] == 0.0 else 1.0 / l[r]
        if sinks and not bad[r] and l[r] != 0.0:
            sink = floats[SINKS + hk * group + g]
            if sink <= m[r]:  # (a -inf sink: 1 / l, the bits of no sink)
                inv = 1.0 / (l[r] + _exp(sink - m[r]))
            else:
                a = _exp(m[r] - sink)
                inv = a / (l[r] * a + 1.0)
        for d in range(d_v):  # (LLVM vectorises it, checking step == 1 at run time)
            y[at + np.uint64(d) * step] = acc[r, d] * inv


@jit(reassociate=True)
def _exp_row_sum(s, r, n, m):
    """``s[r, j] = e^(s[r, j] - m)`` and their sum, in one vectorised pass in
    whatever order LLVM picks (for the matrix products' tiles: decode's
    loops keep a sum's bits across tile lengths).  A 128 x 64 tile: 11.9 us
    with a separate ``_row_sum``, 7.9 with this."""
    _full_width_loops()
    total = s.dtype.type(0.0)
    for j in range(n):
        p = _exp(s[r, j] - m)
        s[r, j] = p
        total += p
    return total


def _exp(x):
    """``e**x`` for ``x <= 0``; NaN gives 0, and ``-inf`` gives ``-0.0``: the
    weight of a masked key, which the loop kernel leaves out of ``P V`` (a
    weight that underflowed is ``+0.0`` and counts, as in a matrix product)."""


@overload(_exp)
def _exp_impl(x):
    if x == types.float64:
        def exp64(x):
            if x >= -745.2:
                return math.exp(x)
            return -0.0 if x == -np.inf else 0.0  # NaN -> 0 as well
        return exp64

    def exp32(x):
        # Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, e**r by a degree-7
        # polynomial, 2**n from its bits.  No libm call, so LLVM vectorises
        # the loops around it (measured 0.67 vs 4.6 ns a score with math.exp);
        # within ~1 ulp of e**x (0.99-1.02 at worst, 0.27 on average over 5.6
        # million values in (-87, 0], with or without FMA contraction).
        inside = x > np.float32(-87.0)  # below, e**x is under float32's normal range
        xc = x if inside else np.float32(-87.0)
        n = np.floor(xc * np.float32(1.44269504088896341) + np.float32(0.5))
        r = xc - n * np.float32(0.693359375)
        r = r + n * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = p * r * r + r + np.float32(1.0)
        pow2n = _float32_from_bits(np.uint32((np.int32(n) + np.int32(127)) << np.int32(23)))
        underflow = np.float32(-0.0) if x == -np.inf else np.float32(0.0)
        return p * pow2n if inside else underflow
    return exp32
