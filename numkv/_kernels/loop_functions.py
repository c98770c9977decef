"""The kernel's loops as C functions, one per accumulation dtype, K/V
format and loop, compiled when a call first needs one and called by address
(``simd._run``): for each format read in place, decode's scoring of query
rows against keys and adding of keys' values (``decode_loops``); for each
format widened, its rows into tiles (``widen``'s ``_rows_*`` loops); and,
per accumulation dtype, prefill's matrix products (``gemm``), the softmax
of a tile and the output rows (``softmax``).

Why apart from the kernel: compiled into it, every format's loops were
compiled on every first call -- float32's with those of the eight narrow,
float8 and quantised formats, and re-optimised with the kernel: a cold
float32 decode call took 10.1 CPU s, 7.2 with the decode loops alone moved
here (``tools/compile_profile.py``, 2-core EPYC).  Here a call compiles the
loops of the formats it reads, each once, in a module of its own: a C
function (``numba.cfunc``) per accumulation dtype, format and loop, whose
address the wrapper writes into ``TABLES`` (``loop_table``) before the kernel
runs.  The kernel makes one call per tile of keys, so the call costs
nothing measurable; the loops' machine code is what it was inside the
kernel.  Each function returns 1 when done: a numba C function that an
exception stops (an index out of bounds under ``NUMBA_BOUNDSCHECK``) prints
it and returns 0, and the kernel raises then (``simd._run``).  Their arrays
arrive as pointers and sizes, seen as arrays through ``simd._array`` (not
``numba.carray``, which compiles a function per pointer and shape type).
"""

import threading

import numpy as np
from numba import types

from .._config import c_function, jit
from .decode_loops import _add_values, _add_values_heads, _score_keys, _score_keys_heads
from .gemm import _gemm_accumulate, _gemm_scores
from .layout import (BF16, BLOCK_Q, E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ, E8M0, F16, F32, F64, FINISH, FORMAT_FIELDS,
                     GEMM_SCORES, GEMM_SOFTMAX, GEMM_VALUES, HEADS_PER_ITEM, HEADS_SCORES, HEADS_VALUES, KV_HEADS,
                     LOOP_FIELDS, N_CODES,
                     Q_HEADS, SCORES, SOFTMAX, TENSOR_FIELDS, V_HEAD_SIZE, VALUES, WIDEN)
from .simd import _array, _as_rows, _full_width_loops, _max, _min, _run, _view
from .softmax import _merge_chunks, _softmax_tile, _write_rows
from .widen import (IN_PLACE, _prefetch_rows, _rows_bfloat16, _rows_e4m3fn, _rows_e5m2, _rows_e8m0,
                    _rows_float16, _rows_float32, _rows_float64, _rows_fnuz, _rows_quantized)

# sha256 of the sources of the modules this one compiles into its loops
# (every ``numkv`` module it imports, and theirs): numba's disk cache
# notices edits to a kernel's own file only, and
# ``tests/test_kernel_layout.py`` fails, printing the new value, until this
# is updated after a helper changes (updating it makes numba recompile).
HELPERS_SHA256 = "ef068cc9bb86956dd629964cf9efe539f935526140e11d68f9d83d204e5895cb"

# ``TABLES[acc][code, field]`` (``layout.LOOP_FIELDS``): the kernel's
# ``loops`` for float32 (``acc`` 0) and float64 (1) accumulators.
TABLES = np.zeros((2, N_CODES, len(LOOP_FIELDS)), np.int64)

_compiled = {}  # (acc, code, field) -> its C function (kept alive: TABLES holds its address)
_tables = {}  # loop_table's keys whose functions are compiled
_lock = threading.Lock()


def loop_table(acc, q_code, kv, gemm, heads=False):
    """``TABLES[acc]`` with every function a call may make compiled
    (``addresses``), for its Q's dtype code, ``(dtype code, read in place)``
    of each K / V tensor that has keys (``kv``, a tuple; ``read_in_place``),
    whether its tiles take the matrix products and whether its items take
    every kv head (``heads``); remembered per layout, so a call whose plan
    is not kept pays one lookup (computing it cost 1.8 us)."""
    key = (acc, q_code, kv, gemm, heads)
    table = _tables.get(key)
    if table is None:
        acc_code = F64 if acc else F32
        read = {code for code, in_place in kv if in_place}
        widened = {code for code, in_place in kv if not in_place}
        if q_code != acc_code:  # (the kernel copies Q of the accumulation dtype)
            widened.add(q_code)
        table = addresses(acc, sorted(read), sorted(widened), gemm, heads)
        if len(_tables) >= 1024:
            _tables.clear()
        _tables[key] = table
    return table


def addresses(acc, read, widened, gemm, heads=False):
    """``TABLES[acc]``, with every C function a call of accumulation dtype
    ``acc`` (0: float32, 1: float64) may make compiled: from numba's disk
    cache, else now (~0.2-0.8 s each, CPU).  The softmax, the output rows
    and decode's loops for rows of the accumulation dtype, and the loops of
    the dtype codes ``read`` in place (and over every kv head at once, where
    ``heads``); the widening of the dtype codes ``widened``; the matrix
    products and their softmax where ``gemm`` (the call's tiles have enough
    query rows).  Two threads may compile at once:
    each entry is written whole, under a lock."""
    acc_code = F64 if acc else F32
    wanted = [(code, WIDEN) for code in widened] + [(acc_code, field) for field in (SOFTMAX, SCORES, VALUES, FINISH)]
    products = (HEADS_SCORES, HEADS_VALUES) if heads else (SCORES, VALUES)
    wanted += [(code, field) for code in read for field in products]
    if gemm:
        wanted += [(acc_code, GEMM_SCORES), (acc_code, GEMM_VALUES), (acc_code, GEMM_SOFTMAX)]
    table = TABLES[acc]
    for code, field in wanted:
        if not table[code, field]:
            with _lock:
                if not table[code, field]:
                    function = _compile(acc, code, field)
                    _compiled[acc, code, field] = function
                    table[code, field] = function.address
    return table


def read_in_place(acc, code, stride, row_stride, width, gemm, values=False):
    """Whether the kernel reads a K or V tensor's rows where they lie
    (``widen._kv_tile``) -- unit-stride rows of the accumulation dtype that
    do not overlap, or of an ``IN_PLACE`` format in decode's loops (float32
    accumulators, no matrix products) -- rather than widen them into tiles.
    The matrix products read V (``values``) in place only where its rows lie
    one after another: a token-major V's, ``Hkv * D`` apart, are copied into
    the tile first (the product's column vectors, one from each row, 4 KiB
    apart fell in one L1 set: a full prefill of 1,024 queries, Hq32/Hkv8/D128,
    one thread of the 2-vCPU Zen 3, took 1.17x a head-major V's time)."""
    acc_code = F64 if acc else F32
    if code == acc_code:
        return stride == 1 and (row_stride == width if gemm and values else row_stride >= width)
    return stride == 1 and acc == 0 and not gemm and code in IN_PLACE


def _compile(acc, code, field):
    """The C function of loop ``field`` for format ``code`` into ``acc``
    rows.  ``code`` is a constant of it (numba keys its disk cache on it):
    the loops emit that format's code only."""
    real = types.float64 if acc else types.float32
    rows_ptr, bytes_ptr, i64 = types.CPointer(real), types.CPointer(types.uint8), types.int64
    # The products' arguments: the left operand (Q, or the weights P), the
    # scores or the accumulators, the K or V bytes, where the rows start and
    # lie apart, the rows, the keys, the row width, whether to prefetch
    # (the cache itself), scratch for K transposed (the tile products'),
    # each query's last key, the queries, the tile's first key, whether some
    # key of the tile is masked (``edge``: 1, or 2 where only keys past some
    # rows' last are), the loops' C function of the accumulation dtype, and
    # the kv heads the loops take at once and how many elements apart they
    # lie in a key's row (decode's loops: ``decode_loops._score_keys``).
    PRODUCT_ARGS = (rows_ptr, i64, rows_ptr, i64, bytes_ptr, i64, *[i64] * 6, rows_ptr, i64,  # noqa: N806
                    types.CPointer(i64), i64, i64, i64, i64, i64, i64, i64)
    # Decode's loops, a kv head at a time or every kv head of an item at once
    # (``HEADS_PER_ITEM``): functions of their own, compiled for the calls that
    # take them (``_attention._heads_per_item``; numba prunes the branch not
    # taken, ``every_head`` being a constant here).
    every_head = field in (HEADS_SCORES, HEADS_VALUES)
    if field in (SCORES, HEADS_SCORES):
        @c_function(types.int64(*PRODUCT_ARGS))
        def scores(q, q_size, s, s_size, k, k_size, ko, kld, rows, n, d_k, prefetch,
                   scratch, scratch_size, hi, hi_size, nq, j0, edge, loop, heads, hld):
            _full_width_loops()
            qf, sf, kf = _array(q, q_size), _array(s, s_size), _array(k, k_size)
            if every_head:
                _score_keys_heads(qf, sf, kf, ko, kld, rows, n, d_k, prefetch != 0, code, heads, hld)
            else:
                _score_keys(qf, sf, kf, ko, kld, rows, n, d_k, prefetch != 0, code)
            return 1
        return scores
    if field in (VALUES, HEADS_VALUES):
        @c_function(types.int64(*PRODUCT_ARGS))
        def values(p, p_size, acc, acc_size, v, v_size, vo, vld, rows, n, d_v, prefetch,
                   scratch, scratch_size, hi, hi_size, nq, j0, edge, loop, heads, hld):
            _full_width_loops()
            pf, accf, vf = _array(p, p_size), _array(acc, acc_size), _array(v, v_size)
            if every_head:
                _add_values_heads(pf, accf, vf, vo, vld, rows, n, d_v, prefetch != 0, code, heads, hld)
            else:
                _add_values(pf, accf, vf, vo, vld, rows, n, d_v, prefetch != 0, code)
            return 1
        return values
    if field == GEMM_SCORES:
        @c_function(types.int64(*PRODUCT_ARGS))
        def gemm_scores(q, q_size, s, s_size, k, k_size, ko, kld, rows, n, d_k, prefetch,
                        scratch, scratch_size, hi, hi_size, nq, j0, edge, loop, heads, hld):
            _full_width_loops()
            queries = _array(q, q_size)
            _gemm_scores(queries, _view(_array(k, k_size), queries), ko, kld, _array(s, s_size), rows, n, d_k,
                         _array(scratch, scratch_size), _array(hi, hi_size), nq, j0)
            return 1
        return gemm_scores
    if field == GEMM_VALUES:
        @c_function(types.int64(*PRODUCT_ARGS))
        def gemm_values(p, p_size, acc, acc_size, v, v_size, vo, vld, rows, n, d_v, prefetch,
                        scratch, scratch_size, hi, hi_size, nq, j0, edge, loop, heads, hld):
            _full_width_loops()
            weights, sums, raw = _array(p, p_size), _array(acc, acc_size), _array(v, v_size)
            values = _view(raw, weights)
            # The tile product cannot leave masked keys out (0 * inf is NaN):
            # where the tile has some and their V is not all finite, the loops
            # (at ``loop``) take it.  (``edge`` 2: the masked keys are those
            # past the earliest last key of the rows, ``_first_masked``.)
            first = _first_masked(_array(hi, hi_size), nq, j0, n) if edge == 2 else 0
            if edge and not _all_finite(values, vo + first * vld, vld, n - first, d_v):
                return 1 - _run(loop, (weights, sums, raw, vo, vld, rows, n, d_v, prefetch,
                                       _array(scratch, scratch_size), _array(hi, hi_size), nq, j0, edge, loop,
                                       heads, hld))
            _gemm_accumulate(weights, values, vo, vld, sums, rows, n, d_v, _array(hi, hi_size), nq, j0)
            return 1
        return gemm_values
    if field in (SOFTMAX, GEMM_SOFTMAX):
        fast_sum = field == GEMM_SOFTMAX
        ints_ptr, flags_ptr, f64 = types.CPointer(i64), types.CPointer(types.uint8), types.float64
        as_real = np.float64 if acc else np.float32  # (the C call passes floats as float64)

        @c_function(types.int64(rows_ptr, i64, ints_ptr, i64, ints_ptr, i64, rows_ptr, i64, rows_ptr, i64, rows_ptr,
                                i64, rows_ptr, i64, flags_ptr, i64, i64, i64, i64, i64, i64, i64, i64, i64, i64, f64,
                                f64), contract=True)
        def softmax(s, s_size, lo, lo_size, hi, hi_size, mask, mask_size, m, m_size, l, l_size, alpha, alpha_size,
                    bad, bad_size, rows, n, nq, j0, edge, mask_base, stride_i, stride_j, stride_g, softcap,
                    score_scale):
            _full_width_loops()
            _softmax_tile(_as_rows(_array(s, s_size), n), rows, n, nq, j0, _array(lo, lo_size), _array(hi, hi_size),
                          edge != 0, _array(mask, mask_size), mask_base, stride_i, stride_j, stride_g, as_real(softcap),
                          as_real(score_scale), _array(m, m_size), _array(l, l_size), _array(alpha, alpha_size),
                          _array(bad, bad_size), fast_sum)
            return 1
        return softmax
    if field == FINISH:
        ints_ptr, flags_ptr, columns = types.CPointer(i64), types.CPointer(types.uint8), len(TENSOR_FIELDS)

        @c_function(types.int64(rows_ptr, i64, ints_ptr, i64, ints_ptr, i64, rows_ptr, i64, rows_ptr, i64, rows_ptr,
                                i64, rows_ptr, i64, flags_ptr, i64, rows_ptr, i64, rows_ptr, i64, rows_ptr, i64, i64, i64,
                                i64, i64, i64, i64))
        def finish(y, y_size, ints, ints_size, desc, desc_size, floats, floats_size, acc, acc_size, m, m_size, l,
                   l_size, bad, bad_size, part_m, part_m_size, part_l, part_l_size, part_acc, part_acc_size, b, hk,
                   qt_index, rows, at, chunks):
            _full_width_loops()
            layout = _array(ints, ints_size)
            d_v = layout[V_HEAD_SIZE]
            rows_max = layout[HEADS_PER_ITEM] * layout[Q_HEADS] // layout[KV_HEADS] * layout[BLOCK_Q]
            tile, sums, nan = _as_rows(_array(acc, acc_size), d_v), _array(l, l_size), _array(bad, bad_size)
            maxima = _array(m, m_size)
            if chunks:
                _merge_chunks(_array(part_m, part_m_size), _array(part_l, part_l_size), _array(part_acc, part_acc_size),
                              rows_max, at, chunks, rows, tile, maxima, sums, nan)
            _write_rows(_array(y, y_size), layout, _as_rows(_array(desc, desc_size), columns), _array(floats, floats_size),
                        b, hk, qt_index, rows, tile, maxima, sums, nan)
            return 1
        return finish
    fields = len(FORMAT_FIELDS)

    @c_function(types.int64(rows_ptr, i64, bytes_ptr, i64, types.CPointer(types.float32), i64,
                            types.CPointer(types.int64), i64, i64, i64, i64, i64, i64, i64))
    def widen(dst, dst_size, buf, buf_size, table, table_size, formats, formats_size, r0, n, width, base,
              seq_stride, stride):
        _full_width_loops()
        raw = _array(buf, buf_size)
        _prefetch_rows(raw, code, n, width, base, seq_stride, stride)
        out, lut = _as_rows(_array(dst, dst_size), width), _array(table, table_size)
        fmt = _as_rows(_array(formats, formats_size), fields)
        # The tile loop of the format: numba prunes the other branches (``code``
        # is a constant here) before it inlines their loops, so one is compiled
        # (one branch chosen inside an inlined function compiled all nine:
        # ~1.2 s against ~0.3).
        if code == F32:
            _rows_float32(out, r0, n, width, raw, code, base, seq_stride, stride, lut, fmt)
        elif code == F64:
            _rows_float64(out, r0, n, width, raw, code, base, seq_stride, stride, lut, fmt)
        elif code == BF16:
            _rows_bfloat16(out, r0, n, width, raw, code, base, seq_stride, stride, lut, fmt)
        elif code == F16:
            _rows_float16(out, r0, n, width, raw, code, base, seq_stride, stride, lut, fmt)
        elif code == E5M2:
            _rows_e5m2(out, r0, n, width, raw, code, base, seq_stride, stride, lut, fmt)
        elif code == E4M3FN:
            _rows_e4m3fn(out, r0, n, width, raw, code, base, seq_stride, stride, lut, fmt)
        elif code == E8M0:
            _rows_e8m0(out, r0, n, width, raw, code, base, seq_stride, stride, lut, fmt)
        elif code == E4M3FNUZ or code == E5M2FNUZ:
            _rows_fnuz(out, r0, n, width, raw, code, base, seq_stride, stride, lut, fmt)
        else:
            _rows_quantized(out, r0, n, width, raw, code, base, seq_stride, stride, lut, fmt)
        return 1
    return widen


@jit(inline=True)
def _first_masked(hi, nq, j0, n):
    """The first key of the tile ``j0 .. j0 + n`` past some query's last
    (``hi``), or ``n``."""
    first = n
    for i in range(nq):
        first = _min(first, _max(hi[i] - j0 + 1, 0))
    return first


@jit(inline=True)
def _all_finite(flat, at, ld, n, width):
    """Whether the ``n`` rows ``flat[at + j * ld:][:width]`` are all finite
    (``x - x`` is 0 only then)."""
    total = flat.dtype.type(0.0)
    for j in range(n):
        row = np.uint64(at + j * ld)
        for c in range(width):
            x = flat[row + np.uint64(c)]
            total += x - x
    return total == 0
