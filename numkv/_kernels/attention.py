"""Blocked attention with an online softmax (ONNX Attention, opsets 23-25):
the algorithm, top-down, in one kernel (``attention_items``): a work item's
tiles of keys -- scores, the softmax of a tile (``softmax._softmax_tile``),
the value update -- and its output rows (``softmax._write_rows``), after
merging a split key range (``softmax._merge_chunks``).

Named dims: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads, ``G =
Hq // Hkv`` query heads per kv head, ``Sq`` queries, ``P`` past keys, ``T = P +
Skv`` keys in all, ``D`` Q/K head size, ``Dv`` V head size.

The modules beside this one, each imported only by those above it::

    layout        the contract with the wrapper: ints/desc/floats slots, dtype codes
    cpu           what the CPU numba compiles for can do (F16C, AVX-512, AVX-512 VBMI)
    simd          the LLVM IR toolkit: views, prefetches, loops, lane reductions
    gemm          prefill's matrix products: register blocks in LLVM IR
    widen         bits -> float per K/V format; tiles; the formats read in place
    softmax       the online softmax of a tile of scores, and its float32 exp
    decode_loops  decode's fused loops: a few keys' dot products, value runs
    loop_functions  the C functions this kernel calls by address, compiled on
                  demand: each format's loops and widening, the products,
                  the softmax, the merge and output rows

Compilation.  The loops that depend on a K/V format, and the products,
softmax and output steps, are C functions of their own (``loop_functions``),
compiled when a call first needs them and called through ``loops``, a table
of their addresses, once per tile (``simd._run``): this kernel compiles once
per accumulation dtype and a new format adds only its own loops.  A call
that did not finish (an exception in a C function, printed; a table entry
left 0) is counted, and the kernel raises once, at its end: numba lowers
each ``raise`` apart, and one per call site cost ~0.8 s of compilation.  (A
cold float32 decode call: 10.1 CPU s with every format's loops compiled in,
~4 now; see docs/compile-time.md.)

Inputs.  Q, the past and new K and V arrive as flat byte buffers, each with a
row of ``desc`` (``TENSOR_FIELDS``): a base offset and ``(b, h, s, d)``
strides in elements, and a dtype code (``DTYPE_CODES``), so 3-D inputs,
transposes and cache slices are read in place and one compiled kernel serves
every input dtype (one per accumulation dtype; each format's loops apart).
Elements are widened into tiles of the accumulation dtype (float32, or float64 for float64 Q /
``softmax_precision`` DOUBLE), one tile at a time, never the whole cache
(``widen._widen_rows_of``); K/V rows already in the accumulation dtype, unit
stride, are read in place, and so are the rows of ``widen.FORMATS``
(bfloat16, float16, float8_e4m3fn, float8_e5m2) in decode
(``widen._kv_tile``), widened as the loops load them (``decode_loops``: a
half or a quarter of the bytes read, no tile copy; the loop for each dtype
at its address in ``loops``; float8_e4m3fn, in passes of four query rows, 64
elements at a time by a byte table where the CPU has AVX-512 VBMI).  Keys
``j < P`` come from the past buffers, the rest from the new K/V (no
concatenation).  ``mask`` (additive) and ``y`` are flat accumulation-dtype
buffers with rows of ``desc`` too.

Arithmetic in tiles (as PyTorch's and ggml's CPU flash attention): a work
item's ``rows = G * nq`` query rows (head-major: row ``g * nq + i``) are scored
against a tile of ``n`` keys with one matrix product ``S = Q K^T`` and update
their accumulators with another, ``acc = alpha * acc + P V``.  Many rows
(prefill) take register-blocked matrix products (``gemm``), which skip the
blocks past every key their rows attend; few rows (decode) take loops that
score four rows against four keys per pass (two keys on AVX2;
``decode_loops._score_keys``)
and add a run of keys' values to four rows at a time, their accumulators
held in registers over the run (``decode_loops._add_values``).

Online softmax per row, once per tile (``_softmax_tile``): ``m' = max(m,
max_j s_j)``, ``alpha = e^(m - m')``, ``p_j = e^(s_j - m')`` (a float32
``exp`` that vectorises, ``_exp``), ``l' = alpha l + sum p_j``, ``acc' = alpha
acc + sum p_j v_j``; at the end ``y = acc / l``, or zeros when ``l == 0`` (the
row attended nothing).  Which keys query ``i`` of batch row ``b`` sees is one
interval ``[lo, hi]`` folded by the wrapper from ``is_causal``, the offset,
windows and valid lengths; the additive mask applies inside it.  Only tiles
that cross an interval's end, or meet the mask, take the masked path; tiles
outside every row's interval are never loaded.  Masking *sets* ``-inf`` (it
never adds to the score), its weight is ``-0.0``, and ``P V`` leaves such keys
out whenever a tile's V holds a non-finite value (the product hands such a
tile to the loops, which leave them out): an excluded key never
influences Y, whatever its K or V hold.  A NaN or ``+inf`` among the
attended scores makes the row NaN (as the reference's softmax does), wherever
the key sits.

Parallel strategy: ``attention_items(first, stop, ...)`` computes work items
``(b, kv_head, unit, chunk)`` ``first .. stop``; every thread of
``numkv._runtime.pool`` runs it over the whole range, claiming items one at a time
(or, for tests, over a contiguous share).  A unit is a pair of query tiles
``(t, n_tiles - 1 - t)``: causal tiles cost in proportion to their index, so
every pair costs the same.  Few query tiles
(decode) split the key range into chunks instead, of a length set by the
shapes only; the thread that finishes an item's last chunk merges their
partial softmaxes in chunk order, so results do not depend on the thread
count.  Packed sequences (``varlen_attention``, ``paged_attention``) are
the batch rows of one launch: ``b`` is a sequence, its tiles and key range
its own (a unit or chunk past them is empty), so the items of a long prompt
and of many short decodes share the threads.

numba's disk cache notices edits to a kernel's own file only, and the
kernels here compile the helpers of the modules above into themselves:
``HELPERS_SHA256`` is the digest of those modules' sources, and a test
(``tests/test_kernel_layout.py``) fails, printing the new value, when a
helper changes and the digest here does not -- updating it changes this
file, so numba recompiles.

Preconditions (the wrapper checks them): every index the strides produce is in
bounds, ``0 <= valid[b] <= T``, window sizes < T + Sq (larger ones arrive as
-1), tiles >= 1, ``Hq % Hkv == 0``, the partial buffers hold ``n_items *
n_chunks`` entries and ``chunks_done`` ``n_items`` zeros when split; packed
sequences (``layout.SEQUENCES``): no past, no mask, stride_b 0, each
sequence's rows within its tensors, ``Sq`` and ``T`` their longest; paged
keys (``layout.PAGE_SIZE``): a page in the block table for every ``page``
keys of ``valid[b]``, each a batch index of K and V, ``block_k`` a divisor of
``page`` and the key chunk a multiple of ``block_k``.
"""

import numpy as np
from numba import types
from numba.extending import overload

from .._config import jit
from .._runtime.protocol import pool_enter, pool_exit
from .gemm import CACHE_LINE
from .layout import (BASE, BLOCK_K, BLOCK_Q, CAUSAL, CHUNK, DTYPE, F32, F64, FINISH, FIRST_KEY, FIRST_QUERY, GEMM_ROWS,
                     GEMM_SCORES, GEMM_SOFTMAX, GEMM_VALUES, HAS_MASK, HEAD_SIZE, HEADS_PER_ITEM, HEADS_SCORES,
                     HEADS_VALUES, KV_HEADS, LEFT, N_CHUNKS, N_UNITS, PAGES, PAGES_PER_ROW, PAGE_SIZE, PAST, QUERIES,
                     Q_HEADS, Q_LEN, Q_SCALE, RIGHT, SCORES, SCORE_SCALE, SEQUENCES, SEQUENCE_FIELDS, SOFTCAP, SOFTMAX,
                     STRIDE_B, STRIDE_D, STRIDE_H, STRIDE_S, TOTAL, T_K, T_MASK, T_PAST_K, T_PAST_V, T_Q, T_V, T_Y,
                     VALUES, V_HEAD_SIZE)
from .simd import LOOP_FAILED, _as_rows, _claim, _count_done, _full_width_loops, _max, _min, _run, _view
from .widen import _kv_tile, _widen_rows_of

# The contract with the wrapper, read here by ``_attention.run`` (``kernels.NAME``).
from .layout import DTYPE_CODES, FLOAT_FIELDS, FORMAT_TABLE, INT_FIELDS, TENSOR_FIELDS, TENSORS  # noqa: F401
from .loop_functions import loop_table, read_in_place  # noqa: F401

# Paged keys (``layout.PAGE_SIZE``): the wrapper makes ``block_k`` divide
# the page and the key chunk a multiple of it; tiles then start at
# multiples of ``block_k`` (a ``while`` loop that cut tiles at page ends
# instead cost decode ~10-25%, Hq=16 Hkv=4 D=64 Skv=1088, 2 threads,
# ``tools/ab_decode.py``).

# sha256 of the sources of the modules this one compiles into its kernels
# (every ``numkv`` module it imports, and theirs): see the module docstring;
# ``tests/test_kernel_layout.py`` prints the value to set.
HELPERS_SHA256 = "dda94cb59aa5d1a6b0f0c8037c0351155185e17d8ddd1307b275e97214033c99"


# -- work items --------------------------------------------------------------------------


@jit()
def attention_items(first, stop, q, kp, kn, vp, vn, mask, y, ints, desc, floats, offset, valid,
                    table, formats, loops, part_m, part_l, part_acc, counter, chunks_done, ctrl, role):
    """Work items ``first .. stop``, in order; or, where ``counter`` has an
    element, claimed one at a time (``first + counter[0]``, atomically) by
    every thread running this call over the same range, so that a thread
    that starts late (a sleeping worker takes ~50 us to wake on a VM) or runs
    slow takes fewer.  An item ``(b, kv_head, unit, chunk)``
    covers all ``G`` heads of the kv head for a pair of query tiles over every
    key, or for one query tile over one chunk of keys: its partial softmax
    then goes to ``part_*``, and the thread that finishes an item's last
    chunk (``chunks_done[item]``, counted atomically) merges them in chunk
    order, so the result depends neither on the thread count nor on which
    thread came last (``softmax._merge_chunks``; merged here, not in a
    second pass over the items, a split call hands out work to the threads
    once).  (One function, not a loop calling an item function: each level
    of calls re-optimises all the code below it, and this one cost ~4 s of
    compile time.)  ``ctrl`` and ``role`` are the pool's (``_runtime.protocol``)."""
    _full_width_loops()
    if not pool_enter(ctrl, role):  # (a long call: every share ran without the GIL)
        return
    n_units, n_ch = ints[N_UNITS], ints[N_CHUNKS]
    group = ints[Q_HEADS] // ints[KV_HEADS]
    heads = ints[HEADS_PER_ITEM]  # kv heads an item covers (``layout.HEADS_PER_ITEM``), and their loops
    scores, values = (SCORES, VALUES) if heads == 1 else (HEADS_SCORES, HEADS_VALUES)
    n_head_sets = ints[KV_HEADS] // heads
    bq, bk, d_k, d_v, past = ints[BLOCK_Q], ints[BLOCK_K], ints[HEAD_SIZE], ints[V_HEAD_SIZE], ints[PAST]
    q_scale, score_scale, softcap = floats[Q_SCALE], floats[SCORE_SCALE], floats[SOFTCAP]
    has_mask = ints[HAS_MASK] != 0
    # Packed sequences and paged keys (``layout.SEQUENCES``, ``layout.PAGE_SIZE``):
    # each item offsets its own copy of ``desc`` by its sequence's first rows.
    packed, paged = ints[SEQUENCES] != 0, ints[PAGE_SIZE] != 0
    page = ints[PAGE_SIZE] if paged else 1
    seq_desc = desc.copy() if packed else desc
    acc_code = _code_of(y)
    dt = y.dtype
    q_code, q_acc, q_step = desc[T_Q, DTYPE], _view(q, y), np.uint64(desc[T_Q, STRIDE_D])
    # Scratch for one item at a time, allocated once per call of this function.
    rows_max = heads * group * bq
    qbuf, sbuf = np.empty(rows_max * d_k, dt), np.empty(rows_max * bk, dt)
    # K and V tiles: raw bytes as the loops read them, and their float views.
    kbuf, vbuf = np.empty(bk * d_k * y.itemsize, np.uint8), np.empty(bk * d_v * y.itemsize, np.uint8)
    ktile, vtile = _view(kbuf, y), _view(vbuf, y)
    # K transposed, for the tile products: rows up to two cache lines longer than a tile (``gemm._kt_stride``)
    kt = np.empty((bk + 2 * CACHE_LINE // y.itemsize) * d_k if group * bq >= ints[GEMM_ROWS] else 0, dt)
    lo, hi = np.empty(bq, np.int64), np.empty(bq, np.int64)
    m, l, alpha = np.empty(rows_max, dt), np.empty(rows_max, dt), np.empty(rows_max, dt)
    # (a 2-D np.empty would compile a function of its own: 0.05 s)
    acc_all, bad = _as_rows(np.empty(rows_max * d_v, dt), d_v), np.empty(rows_max, np.uint8)  # bad: 1 where NaN
    claiming = counter.size > 0
    failures = 0  # C function calls that did not finish (``simd._run``)
    for index in range(first, stop):
        if failures:
            break
        work = first + _claim(counter) if claiming else index
        if work >= stop:  # every item is taken
            break
        item, c = work // n_ch, work % n_ch
        b, rest = item // (n_head_sets * n_units), item % (n_head_sets * n_units)
        first_head, unit = rest // n_units * heads, rest % n_units
        q_len = ints[Q_LEN]
        if packed:  # sequence b's rows: Q's and Y's from its first query, K's and V's from its first key
            seq = ints[SEQUENCES] + len(SEQUENCE_FIELDS) * b
            q_len, q_row, k_row = ints[seq + QUERIES], ints[seq + FIRST_QUERY], ints[seq + FIRST_KEY]
            seq_desc[T_Q, BASE] = desc[T_Q, BASE] + q_row * desc[T_Q, STRIDE_S]
            seq_desc[T_Y, BASE] = desc[T_Y, BASE] + q_row * desc[T_Y, STRIDE_S]
            seq_desc[T_K, BASE] = desc[T_K, BASE] + k_row * desc[T_K, STRIDE_S]
            seq_desc[T_V, BASE] = desc[T_V, BASE] + k_row * desc[T_V, STRIDE_S]
        n_qt = (q_len + bq - 1) // bq  # (a packed sequence may have fewer tiles than the longest: no pair)
        split = n_ch > 1
        # A pair of tiles (t, n_qt - 1 - t), == t for the middle tile of an odd count; a unit
        # past the sequence's tiles has none (an empty range below).
        partner = (unit if unit < n_qt else unit - 1) if split else n_qt - 1 - unit
        k_start = c * ints[CHUNK] if split else 0
        k_stop = _min(k_start + ints[CHUNK], ints[TOTAL]) if split else ints[TOTAL]
        for qt_index in range(unit, partner + 1, _max(partner - unit, 1)):
            i0 = qt_index * bq
            nq = _min(bq, q_len - i0)
            rows = group * nq  # a head's rows
            span = heads * rows  # every head's (head h's: from row h * rows; a row's head is row // nq)
            acc = acc_all[:span]
            # Each query's key interval; their union bounds the tiles loaded.
            t_lo, t_hi = k_stop, k_start - 1
            for i in range(nq):
                lo[i], hi[i] = _row_bounds(i0 + i, offset[b], valid[b], ints[CAUSAL] != 0,
                                           ints[LEFT], ints[RIGHT])
                t_lo = _min(t_lo, _max(lo[i], k_start))
                t_hi = _max(t_hi, _min(hi[i], k_stop - 1))
            if paged:  # tiles from a multiple of bk, which divides the page: none crosses a page
                t_lo = _max(t_lo - t_lo % bk, k_start)  # (the keys before lo are masked)
            for r in range(span):
                m[r] = -np.inf
                l[r] = 0.0
                bad[r] = 0
                for d in range(d_v):
                    acc[r, d] = 0.0

            if t_lo <= t_hi:
                qt = _as_rows(qbuf[:span * d_k], d_k)
                for g in range(heads * group):
                    base = (seq_desc[T_Q, BASE] + b * desc[T_Q, STRIDE_B]
                            + (first_head * group + g) * desc[T_Q, STRIDE_H] + i0 * desc[T_Q, STRIDE_S])
                    if q_code == acc_code:  # copied here: no widening function to compile
                        for i in range(nq):
                            at = np.uint64(base + i * desc[T_Q, STRIDE_S])
                            for d in range(d_k):
                                qt[g * nq + i, d] = q_acc[at + np.uint64(d) * q_step]
                    else:
                        failures += _widen_rows_of(loops, qt, g * nq, nq, d_k, q, q_code, base,
                                                   desc[T_Q, STRIDE_S], desc[T_Q, STRIDE_D], table, formats)
                for r in range(span):
                    for d in range(d_k):
                        qt[r, d] *= q_scale
                mask_base = -1
                if has_mask:  # (the first head's: a row's head is its row // nq)
                    mask_base = (desc[T_MASK, BASE] + b * desc[T_MASK, STRIDE_B]
                                 + first_head * group * desc[T_MASK, STRIDE_H] + i0 * desc[T_MASK, STRIDE_S])
                use_gemm = rows >= ints[GEMM_ROWS]
                # Two segments: past keys, then new keys (a tile never straddles them).
                for seg in range(2):
                    seg_lo, seg_hi = (t_lo, _min(t_hi, past - 1)) if seg == 0 else (_max(t_lo, past), t_hi)
                    kb, vb, tk, tv, shift = (kp, vp, T_PAST_K, T_PAST_V, 0) if seg == 0 else (kn, vn, T_K, T_V, past)
                    for j0 in range(seg_lo, seg_hi + 1, bk):
                        n = _min(bk, seg_hi + 1 - j0)
                        kv_b, kv_j = b, j0 - shift
                        if paged:  # the tile lies in one page: key j is row j % page of its page
                            kv_b, kv_j = ints[ints[PAGES] + b * ints[PAGES_PER_ROW] + j0 // page], j0 % page
                        s = _as_rows(sbuf[:span * n], n)
                        kr, ko, kld, kcode, k_in_place, failed = _kv_tile(
                            kbuf, ktile, kv_j, n, d_k, kv_b, first_head, kb, seq_desc, tk, table, formats, loops,
                            acc_code)
                        # Some key of the tile is masked for some row: 1, or 2 where only
                        # keys past some rows' last (causal, valid lengths) are.
                        front, back = has_mask, False
                        for i in range(nq):
                            front |= lo[i] > j0
                            back |= hi[i] < j0 + n - 1
                        edge = 1 if front else 2 if back else 0
                        # s = Q K^T: the matrix product for many rows, else the loops of K's format
                        # (for every head of the item at once: a key row's heads read together).
                        failures += failed + _run(
                            loops[acc_code, GEMM_SCORES] if use_gemm else loops[kcode, scores],
                            (qt, s, kr, ko, kld, rows, n, d_k, k_in_place, kt, hi, nq, j0, edge, 0, heads,
                             desc[tk, STRIDE_H]))
                        failures += _run(  # softmax._softmax_tile (a row's head: its row // nq)
                            loops[acc_code, GEMM_SOFTMAX if use_gemm else SOFTMAX],
                            (s, lo, hi, mask, m, l, alpha, bad, span, n, nq, j0, edge, mask_base,
                             desc[T_MASK, STRIDE_S], desc[T_MASK, STRIDE_D], desc[T_MASK, STRIDE_H], softcap,
                             score_scale))
                        vr, vo, vld, vcode, v_in_place, failed = _kv_tile(
                            vbuf, vtile, kv_j, n, d_v, kv_b, first_head, vb, seq_desc, tv, table, formats, loops,
                            acc_code)
                        for r in range(span):
                            a = alpha[r]
                            if a != 1.0:
                                for d in range(d_v):
                                    acc[r, d] *= a
                        # acc += P V: the product (which hands a tile whose masked keys' V is not
                        # finite to the loops), else the loops of V's format.
                        failures += failed + _run(
                            loops[acc_code, GEMM_VALUES] if use_gemm else loops[vcode, values],
                            (s, acc, vr, vo, vld, rows, n, d_v, v_in_place, kt, hi, nq, j0, edge,
                             loops[acc_code, VALUES], heads, desc[tv, STRIDE_H]))

            chunks = 0  # unsplit: Y's rows from acc and l
            if split:
                for r in range(span):
                    part_m[work, r] = np.nan if bad[r] else m[r]
                    part_l[work, r] = l[r]
                    for d in range(d_v):
                        part_acc[work, r, d] = acc[r, d]
                if _count_done(chunks_done, item) < n_ch - 1:  # other chunks of the item are still running
                    continue
                chunks = n_ch  # the last to finish: Y's rows from every chunk's partial softmax
            failures += _run(loops[acc_code, FINISH], (y, ints, seq_desc, floats, acc, m, l, bad, part_m, part_l,
                                                       part_acc, b, first_head, qt_index, span, item * n_ch, chunks))
    pool_exit(ctrl, role)
    if failures:
        raise RuntimeError(LOOP_FAILED)


@jit(inline=True)
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


# -- compile-time facts ------------------------------------------------------------------


def _code_of(arr):
    """The dtype code of a float32 or float64 array (a compile-time constant)."""


@overload(_code_of)
def _code_of_impl(arr):
    code = F64 if arr.dtype == types.float64 else F32
    return lambda arr: code
