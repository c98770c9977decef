"""Decode's loops: a tile's query rows scored against its keys
(``_score_keys``: passes of a few rows against a few keys, sized from the
CPU's registers, each pass one ``_dots``) and its keys' values added to the
rows' accumulators (``_add_values``: runs of keys, each one ``_axpy``).
``_dots`` and ``_axpy`` are LLVM IR: few query rows (``R`` = 1, 2 or 4)
against two, four or eight keys, and a run of keys' values added to one or
four rows' accumulators held in registers.

Both read K/V rows as they lie in the cache -- float32, or a narrow format of
``widen.FORMATS`` widened vector by vector as it is loaded -- for one format,
a constant of the caller (``_per_format``; ``loop_functions`` compiles them a
format at a time, on demand).  A new format read in place is its
``widen.FORMATS`` entry; the loops here take it from there.

Bits: a dot product's sum runs in vector lanes over ``D``'s whole vectors,
the lanes reduced by one fixed tree, then element by element over the rest;
a value update adds one key after another to each element (a chain of
FMAs).  Either way a result's bits depend on ``D`` and its own row and key
only, never on which pass or neighbours took it (GQA equals MHA with K/V
repeated; a masked key at a tile's end changes nothing).
"""

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .. import _formats
from .._config import jit
from .cpu import has_f16c
from .layout import F32, F64, QUANT_BLOCK
from .simd import (_BYTES, PREFETCH_KEYS, _broadcast, _emit_loop, _emit_prefetch, _fmuladd, _load,
                   _masked_memory, _min, _phis, _reduce_lanes, _register_bytes)
from .widen import FORMATS, IN_PLACE, _load_widened, _load_widened_run

# The loops' blocks fit the CPU's vector registers: AVX-512's 32 of 64
# bytes, or AVX2's 16 of 32 (``cpu.has_avx512``).  A vector of the loops is
# one register.  ``_dots`` scores four query rows against ``DOT_KEYS`` keys
# a pass (16 or 8 sums in registers), and a run of ``_axpy`` holds
# ``AXPY_RUN_VECTORS`` vectors of D a row (four rows: 16 or 8 accumulators,
# half the registers; AVX-512's float32 run, 64 elements, is a block of
# ``_blocks``).  AVX2 with AVX-512's blocks (64-byte vectors, two registers
# each) spilled ~33 registers an iteration of the q8_0 scores; the decodes
# took 1.1-1.7x their time now (docs/performance.md, "Decode's blocks on AVX2").
VECTOR_BYTES = _register_bytes()
DOT_KEYS = 4 if VECTOR_BYTES == 64 else 2
AXPY_RUN_VECTORS = 4 if VECTOR_BYTES == 64 else 2
# One row's run on AVX2: eight vectors, eight FMA chains under way (with two,
# MHA's decodes took 1.1-1.3x their time in AVX-512's layout).
AXPY_RUN_VECTORS_ONE_ROW = 4 if VECTOR_BYTES == 64 else 8


@intrinsic(prefer_literal=True)
def _dots(typingctx, out, out_at, count, q, q_at, k, k_at, length, code, ahead):
    """The ``K * R`` dot products of the rows ``q[q_at[r]:][:length]`` and
    ``k[k_at[j]:][:length]`` (``R`` = 1, 2 or 4 offsets in ``q_at``, ``K`` =
    two or four in ``k_at``, or eight for one row), stored by rows:
    ``out[out_at[r] + j]`` for ``j < count``
    (a masked store: the keys past a tile's end, whose ``k_at`` repeats the
    last, are left out).  ``q`` and ``out`` are flat float arrays, ``k``
    raw bytes holding elements of dtype ``code`` (a constant:
    ``_per_format``), and ``k_at`` counts those elements.  ``ahead``
    (elements): each vector of a key row loaded asks for the one that far
    on (``_prefetch``; 0: itself) -- from inside the loop, as ``_axpy``
    does: a loop of prefetches before each pass, compiled for float32
    alone, streamed keys from memory 30% slower (docs/compile-time.md).

    Written as LLVM IR so that the eight sums of a vector loop are reduced
    together (``_reduce_lanes``: ~3 shuffles and adds a sum, against ~9 for
    one reduction after another, which is what LLVM makes of scalar running
    sums), and a row's ``K`` sums leave the reduced lanes as one store
    (against 16 extractions and stores a pass, ~1/3 of the scores' time at
    D = 64).  Each sum runs in vector lanes over ``D``'s whole vectors, the
    lanes reduced by the same tree, then on from there one element at a
    time over the rest: a dot product's bits depend on ``D`` only, not on
    which pass or neighbours it had (a NaN's sign aside: float8_e4m3fn's
    byte table keeps the sign of a NaN pattern, its bit arithmetic does
    not)."""
    if not (isinstance(q_at, types.UniTuple) and isinstance(k_at, types.UniTuple)
            and isinstance(out_at, types.UniTuple) and q_at.count in (1, 2, 4)
            and (k_at.count in (2, 4) or k_at.count == 8 and q_at.count == 1)
            and out_at.count == q_at.count and k.dtype == types.uint8 and out.dtype == q.dtype
            and isinstance(code, types.IntegerLiteral)):
        return None
    return types.void(out, out_at, count, q, q_at, k, k_at, length, code, ahead), _emit_dots


def _emit_dots(context, builder, sig, args):
    out_ty, _, count_ty, q_ty, q_at_ty, k_ty, _, length_ty, _, ahead_ty = sig.args
    ahead = context.cast(builder, args[9], ahead_ty, types.int64)
    out_arr = context.make_array(out_ty)(context, builder, args[0])
    q_arr = context.make_array(q_ty)(context, builder, args[3])
    k_arr = context.make_array(k_ty)(context, builder, args[5])
    length = context.cast(builder, args[7], length_ty, types.int64)
    q_rows = [builder.gep(q_arr.data, [builder.extract_value(args[4], r)]) for r in range(q_at_ty.count)]
    real = context.get_value_type(q_ty.dtype)

    def rows(elem, narrow):
        keys = builder.bitcast(k_arr.data, elem.as_pointer())
        k_rows = [builder.gep(keys, [builder.extract_value(args[6], j)]) for j in range(sig.args[6].count)]
        return _dot_sums(builder, q_rows, k_rows, length, real, narrow, ahead)

    width = max(4, sig.args[6].count)  # a row's stored sums (those past ``count`` masked)
    row_ty = ir.VectorType(real, width)
    i32 = ir.IntType(32)
    count = builder.trunc(context.cast(builder, args[2], count_ty, types.int64), i32)
    mask = builder.icmp_unsigned("<", ir.Constant(ir.VectorType(i32, width), list(range(width))),
                                 _broadcast(builder, count, width))
    store = _masked_memory(builder, "store", row_ty)
    for r, row in enumerate(_per_format(sig.args[8], real, rows)):
        at = builder.gep(out_arr.data, [builder.extract_value(args[1], r)])
        builder.call(store, [row, builder.bitcast(at, row_ty.as_pointer()), ir.Constant(i32, _BYTES[str(real)]), mask])
    return context.get_dummy_value()


def _dot_sums(builder, q_rows, k_rows, length, real, narrow, ahead):
    """IR: the sums of ``_dots`` as one ``<max(4, K) x real>`` a query row,
    its ``K`` keys' (``narrow``: the keys' format, ``_widen_ir``; None: ``real``);
    each vector of a key row loaded asks for the one ``ahead`` elements on
    (``_axpy``'s ``ahead``)."""
    i64 = ir.IntType(64)
    # (at least eight lanes: ``_reduce_lanes`` gathers eight sums a vector)
    lanes = max(8, VECTOR_BYTES // _BYTES[str(real)])
    vec = ir.VectorType(real, lanes)
    whole = _whole_vectors(builder, length, lanes, narrow)

    def step(width, ty):
        fn = _fmuladd(builder, ty)

        def body(at, accs):
            qs = [_load(builder, row, at, width) for row in q_rows]
            ks = [_load_widened(builder, row, at, width, narrow) for row in k_rows]
            if width > 1:
                for row in k_rows:
                    _emit_prefetch(builder, builder.gep(row, [builder.add(at, ahead)]))
            return [builder.call(fn, [qv, kv, accs[nk * r + j]]) for r, qv in enumerate(qs) for j, kv in enumerate(ks)]
        return body

    def block(at, accs):  # four vector steps, each sum's FMAs in the same order
        fn, accs = _fmuladd(builder, vec), list(accs)
        qs = [[_load(builder, row, builder.add(at, ir.Constant(i64, s)), lanes)
               for s in range(0, fmt.block, lanes)] for row in q_rows]
        for j, row in enumerate(k_rows):
            ks = fmt.widen_block(builder, _load(builder, row, at, fmt.block))
            _emit_prefetch(builder, builder.gep(row, [builder.add(at, ahead)]))
            for r, q_parts in enumerate(qs):
                for qv, kv in zip(q_parts, ks):
                    accs[nk * r + j] = builder.call(fn, [qv, kv, accs[nk * r + j]])
        return accs

    nk = len(k_rows)
    def quant_block(at, accs):  # a block of a quantised format: each key's scale loaded once
        fn, accs, parts = _fmuladd(builder, vec), list(accs), QUANT_BLOCK // lanes
        qs = [[_load(builder, row, builder.add(at, ir.Constant(i64, c * lanes)), lanes) for c in range(parts)]
              for row in q_rows]
        for j, row in enumerate(k_rows):
            ks = _load_widened_run(builder, row, at, lanes, parts, narrow)
            _emit_prefetch(builder, builder.gep(row, [builder.add(at, ahead)]))
            for r, q_parts in enumerate(qs):
                for qv, kv in zip(q_parts, ks):
                    accs[nk * r + j] = builder.call(fn, [qv, kv, accs[nk * r + j]])
        return accs

    n_sums, i32 = nk * len(q_rows), ir.IntType(32)
    if isinstance(whole, ir.Constant):  # no vector loop
        sums = _emit_loop(builder, whole, length, 1, [ir.Constant(real, 0.0)] * n_sums, step(1, real))
        return _as_rows(builder, sums, nk)
    start, vectors = ir.Constant(i64, 0), [ir.Constant(vec, None)] * n_sums
    if _blocks(narrow, real, len(q_rows)):
        fmt = FORMATS[narrow]
        blocks = builder.and_(length, ir.Constant(i64, -fmt.block))
        start, vectors = blocks, _emit_loop(builder, start, blocks, fmt.block, vectors, block)
    by_blocks = narrow in _formats.FORMATS and _formats.FORMATS[narrow].derived and QUANT_BLOCK % lanes == 0
    if by_blocks:
        # (each key's block scale once a block, not once a vector: MHA's q8_0
        # scores on AVX2, 8 lanes, took ~1.16x their time with one a vector;
        # no vector loop after it: such rows are whole blocks, and the
        # element loop would take any rest)
        whole = builder.and_(length, ir.Constant(i64, -QUANT_BLOCK))
        vectors = _emit_loop(builder, start, whole, QUANT_BLOCK, vectors, quant_block)
    else:
        vectors = _emit_loop(builder, start, whole, lanes, vectors, step(lanes, vec))
    reduced = [_reduce_lanes(builder, vectors[first:first + 8]) for first in range(0, n_sums, 8)]
    # The rows straight from the reduced lanes (eight sums a vector: two or
    # four rows; lanes past a row's keys repeat its last, never stored);
    # where D has a tail, one element at a time on from them.
    row_lanes = max(4, nk)
    whole_rows = [builder.shuffle_vector(reduced[nk * r // 8], reduced[nk * r // 8],
                                         ir.Constant(ir.VectorType(i32, row_lanes), [nk * r % 8 + min(t, nk - 1)
                                                                                     for t in range(row_lanes)]))
                  for r in range(len(q_rows))]
    before = builder.block
    tail, after = builder.append_basic_block("tail"), builder.append_basic_block("tail.after")
    builder.cbranch(builder.icmp_signed("<", whole, length), tail, after)
    builder.position_at_end(tail)
    sums = [builder.extract_element(reduced[i // 8], ir.Constant(i32, i % 8)) for i in range(n_sums)]
    tail_rows = _as_rows(builder, _emit_loop(builder, whole, length, 1, sums, step(1, real)), nk)
    tail_end = builder.block
    builder.branch(after)
    builder.position_at_end(after)
    return _phis(builder, [(whole_rows, before), (tail_rows, tail_end)])


def _as_rows(builder, sums, nk):
    """IR: sums ``nk r + j`` as one ``<max(4, nk) x real>`` a row ``r``
    (lanes past ``nk`` repeat the last)."""
    lanes = max(4, nk)
    row = ir.Constant(ir.VectorType(sums[0].type, lanes), None)
    rows = []
    for first in range(0, len(sums), nk):
        vector = row
        for j in range(lanes):
            vector = builder.insert_element(vector, sums[first + min(j, nk - 1)], ir.Constant(ir.IntType(32), j))
        rows.append(vector)
    return rows


@intrinsic(prefer_literal=True)
def _axpy(typingctx, acc, acc_at, p, p_at, v, v_at, ld, ahead, keys, length, code):
    """``acc[acc_at[r] + d] += p[p_at[r] + j] * v_j[d]`` for keys ``j <
    keys`` and ``d < length``, the keys added one after another to each
    element (a chain of FMAs, in key order); ``v_j`` is the row at element
    ``v_at + j * ld`` of the raw bytes ``v``, of dtype ``code`` (a
    constant: ``_per_format``).  ``R`` rows (1 or 4, ``acc_at`` and ``p_at``): each
    loaded V vector feeds them all.  ``ahead`` (elements): each vector
    loaded asks for the one that far on (``_prefetch``; 0: itself, at hand
    already -- a branch around the request made LLVM compile every loop
    twice, and measured no faster).

    LLVM IR.  ``D`` is taken in runs of ``AXPY_RUN_VECTORS`` vectors (one
    row: ``AXPY_RUN_VECTORS_ONE_ROW``), then
    of one, then of one element; in each run the rows' accumulators are loaded once, take
    every key's FMAs in registers, and are stored once (``AXPY_KEYS``).
    Each element takes the same chain whichever run holds it."""
    if not (isinstance(acc_at, types.UniTuple) and isinstance(p_at, types.UniTuple)
            and acc_at.count in (1, 4) and p_at.count == acc_at.count and v.dtype == types.uint8
            and p.dtype == acc.dtype and isinstance(code, types.IntegerLiteral)):
        return None
    return types.void(acc, acc_at, p, p_at, v, v_at, ld, ahead, keys, length, code), _emit_axpy


def _emit_axpy(context, builder, sig, args):
    acc_ty, acc_at_ty, p_ty, _, v_ty = sig.args[:5]
    acc_arr = context.make_array(acc_ty)(context, builder, args[0])
    p_arr = context.make_array(p_ty)(context, builder, args[2])
    v_arr = context.make_array(v_ty)(context, builder, args[4])
    v_at, ld, ahead, keys, length = (context.cast(builder, args[i], sig.args[i], types.int64) for i in range(5, 10))
    real = context.get_value_type(acc_ty.dtype)
    n_rows = acc_at_ty.count
    acc_rows = [builder.gep(acc_arr.data, [builder.extract_value(args[1], r)]) for r in range(n_rows)]
    p_rows = [builder.gep(p_arr.data, [builder.extract_value(args[3], r)]) for r in range(n_rows)]
    lanes, align = VECTOR_BYTES // _BYTES[str(real)], _BYTES[str(real)]
    i64 = ir.IntType(64)

    def loops(elem, narrow):
        first = builder.gep(builder.bitcast(v_arr.data, elem.as_pointer()), [v_at])
        addressed = narrow is not None and FORMATS[narrow].load is not None

        def run(width, parts, block):  # the keys over ``parts`` runs of ``width`` elements from ``d0``
            ty = ir.VectorType(real, width) if width > 1 else real
            fma = _fmuladd(builder, ty)

            def body(d0, _):
                ptrs = [builder.bitcast(builder.gep(row, [builder.add(d0, ir.Constant(i64, c * width))]),
                                        ty.as_pointer()) for row in acc_rows for c in range(parts)]

                def key(j, accs):
                    if addressed:  # the row's first byte; its elements at d0 + ... (``Format.load``)
                        row, d_at = builder.gep(first, [builder.mul(j, ld)]), d0
                    else:
                        row, d_at = builder.gep(first, [builder.add(builder.mul(j, ld), d0)]), ir.Constant(i64, 0)
                    if width > 1:
                        for c in range(parts):
                            at = builder.add(ahead, builder.add(d_at, ir.Constant(i64, c * width)))
                            _emit_prefetch(builder, builder.gep(row, [at]))
                    if block:  # parts * width elements, one block of ``narrow``
                        fmt = FORMATS[narrow]
                        vs = fmt.widen_block(builder, _load(builder, row, ir.Constant(i64, 0), fmt.block))
                    else:  # (a quantised format's block scale once a run: ``_load_widened_run``)
                        vs = _load_widened_run(builder, row, d_at, width, parts, narrow)
                    ws = [builder.load(builder.gep(p_row, [j])) for p_row in p_rows]
                    if width > 1:
                        ws = [_broadcast(builder, w, width) for w in ws]
                    return [builder.call(fma, [ws[r], vs[c], accs[r * parts + c]])
                            for r in range(n_rows) for c in range(parts)]

                accs = [builder.load(ptr, align=align) for ptr in ptrs]
                accs = _emit_loop(builder, ir.Constant(i64, 0), keys, 1, accs, key)
                for ptr, a in zip(ptrs, accs):
                    builder.store(a, ptr, align=align)
                return []
            return body

        whole, start = _whole_vectors(builder, length, lanes, narrow), ir.Constant(i64, 0)
        if not isinstance(whole, ir.Constant):
            run_vectors = AXPY_RUN_VECTORS if n_rows > 1 else AXPY_RUN_VECTORS_ONE_ROW
            start = builder.and_(length, ir.Constant(i64, -run_vectors * lanes))
            blocks = _blocks(narrow, real, n_rows)
            _emit_loop(builder, ir.Constant(i64, 0), start, run_vectors * lanes, [],
                       run(lanes, run_vectors, blocks))
            _emit_loop(builder, start, whole, lanes, [], run(lanes, 1, False))
        _emit_loop(builder, whole, length, 1, [], run(1, 1, False))
        return []

    _per_format(sig.args[10], real, loops)
    return context.get_dummy_value()


def _per_format(code, real, emit):
    """IR: ``emit(element type, narrow format)`` for the K/V dtype ``code``
    (an ``IntegerLiteral`` type: the caller's constant): float32 (``real``
    float) or float64 (``real`` double) rows, or the ``IN_PLACE`` ones of a
    narrow format (float32 ``real`` only: read as they are,
    ``_widen_ir``)."""
    value = code.literal_value
    if value in IN_PLACE and real == ir.FloatType():
        narrow, bits = IN_PLACE[value]
        return emit(ir.IntType(bits), narrow)
    if (value, real) not in ((F32, ir.FloatType()), (F64, ir.DoubleType())):
        raise TypeError(f"no loop reads dtype code {value} into {real} rows")
    return emit(real, None)


def _whole_vectors(builder, length, lanes, narrow):
    """IR: the elements of ``length`` that vector loops take (whole vectors;
    none for the formats that widen by F16C where the CPU lacks it: those go
    one at a time)."""
    if narrow is not None and FORMATS[narrow].needs_f16c and not has_f16c():
        return ir.Constant(ir.IntType(64), 0)
    return builder.and_(length, ir.Constant(ir.IntType(64), -lanes))


def _blocks(narrow, real, rows):
    """Whether the loops over ``narrow`` rows into ``real`` take whole
    blocks (``Format.widen_block``; float8_e4m3fn: 64 elements by a byte
    table, where the CPU has AVX-512 VBMI): float32 rows, in the passes of
    four query rows only, the ones decode spends its time in (each loop of
    blocks costs ~0.1-0.2 s of a cold call's compilation).  A block is one
    run of ``_axpy`` (``AXPY_RUN_VECTORS`` vectors)."""
    fmt = FORMATS.get(narrow)
    if fmt is None or not fmt.block or real != ir.FloatType() or rows != 4 or not fmt.block_cpu():
        return False
    assert fmt.block == AXPY_RUN_VECTORS * VECTOR_BYTES // _BYTES[str(real)], narrow
    return True


# -- scores: s = Q K^T -------------------------------------------------------------------


@jit(inline=True)
def _score_keys_wide(qf, sf, kb, ko, kld, rows, n, d_k, prefetch, code):
    """``s[r * n + j] = q_r . k_j`` for the ``rows`` query rows of ``qf``
    (``d_k`` apart) and the ``n`` key rows at elements ``ko + j * kld`` of
    the raw bytes ``kb``, of format ``code``: four keys a pass, scored
    against four query rows (then two, then one; ``_dots``); ``prefetch``:
    the keys ahead, where ``kb`` is the cache itself.  A pass past the last
    key repeats it (and stores only the tile's scores): every score comes
    from the same sum, so its bits depend neither on the number of rows
    (GQA equals MHA with K/V repeated) nor on the tile's length (a masked
    key at its end changes nothing).  ``_score_keys`` where the CPU has
    AVX-512's 32 registers."""
    at, ld, width, stride = np.uint64(ko), np.uint64(kld), np.uint64(d_k), np.uint64(n)
    ahead = np.uint64(PREFETCH_KEYS) * ld if prefetch else np.uint64(0)
    for j in range(0, n, 4):
        k_at, count, s0 = _key_offsets(at, ld, j, n - 1, 4), _min(4, n - j), np.uint64(j)
        r = 0
        while r + 4 <= rows:
            q_at = (np.uint64(r) * width, np.uint64(r + 1) * width, np.uint64(r + 2) * width,
                    np.uint64(r + 3) * width)
            s_at = (s0 + np.uint64(r) * stride, s0 + np.uint64(r + 1) * stride, s0 + np.uint64(r + 2) * stride,
                    s0 + np.uint64(r + 3) * stride)
            _dots(sf, s_at, count, qf, q_at, kb, k_at, d_k, code, ahead)
            r += 4
        if r + 2 <= rows:
            q_at = (np.uint64(r) * width, np.uint64(r + 1) * width)
            _dots(sf, (s0 + np.uint64(r) * stride, s0 + np.uint64(r + 1) * stride), count, qf, q_at, kb, k_at,
                  d_k, code, ahead)
            r += 2
        if r < rows:
            _dots(sf, (s0 + np.uint64(r) * stride,), count, qf, (np.uint64(r) * width,), kb, k_at, d_k, code, ahead)


@jit(inline=True)
def _score_keys_avx2(qf, sf, kb, ko, kld, rows, n, d_k, prefetch, code):
    """``_score_keys_wide``'s scores where the CPU has AVX2's 16 registers:
    eight sums under way a pass, so the rows in fours meet two keys a pass,
    a pair of rows left four keys, a last row eight (MHA's: with four, its
    q8_0 scores took 1.16x the time).  Three kinds of pass, as there: each
    more is more to compile on a cold call."""
    at, ld, width, stride = np.uint64(ko), np.uint64(kld), np.uint64(d_k), np.uint64(n)
    ahead = np.uint64(PREFETCH_KEYS) * ld if prefetch else np.uint64(0)
    fours = rows - rows % 4
    if fours:
        for j in range(0, n, 2):
            k_at, count, s0 = _key_offsets(at, ld, j, n - 1, 2), _min(2, n - j), np.uint64(j)
            for r in range(0, fours, 4):
                q_at = (np.uint64(r) * width, np.uint64(r + 1) * width, np.uint64(r + 2) * width,
                        np.uint64(r + 3) * width)
                s_at = (s0 + np.uint64(r) * stride, s0 + np.uint64(r + 1) * stride,
                        s0 + np.uint64(r + 2) * stride, s0 + np.uint64(r + 3) * stride)
                _dots(sf, s_at, count, qf, q_at, kb, k_at, d_k, code, ahead)
    if rows % 4 >= 2:
        r = np.uint64(fours)
        for j in range(0, n, 4):
            s0 = np.uint64(j)
            _dots(sf, (s0 + r * stride, s0 + (r + np.uint64(1)) * stride), _min(4, n - j), qf,
                  (r * width, (r + np.uint64(1)) * width), kb, _key_offsets(at, ld, j, n - 1, 4), d_k, code, ahead)
    if rows % 2:
        r = np.uint64(rows - 1)
        for j in range(0, n, 8):
            _dots(sf, (np.uint64(j) + r * stride,), _min(8, n - j), qf, (r * width,), kb,
                  _key_offsets(at, ld, j, n - 1, 8), d_k, code, ahead)


@jit(inline=True)
def _score_keys_heads_wide(qf, sf, kb, ko, kld, rows, n, d_k, prefetch, code, heads, hld):
    """``_score_keys_wide``'s scores for ``heads`` kv heads at once, ``hld``
    elements apart in a key's row (token-major keys): head ``h``'s rows
    follow head ``h - 1``'s in ``qf`` and ``sf``, and each pass of keys
    takes every head's before the next, so a key row's heads are read
    together (the same sums: the same bits as a head at a time)."""
    at, ld, width, stride, h_ld = np.uint64(ko), np.uint64(kld), np.uint64(d_k), np.uint64(n), np.uint64(hld)
    ahead = np.uint64(PREFETCH_KEYS) * ld if prefetch else np.uint64(0)
    for j in range(0, n, 4):
        count, s0 = _min(4, n - j), np.uint64(j)
        for h in range(heads):
            k_at = _key_offsets(at + np.uint64(h) * h_ld, ld, j, n - 1, 4)
            r, end = h * rows, (h + 1) * rows
            while r + 4 <= end:
                q_at = (np.uint64(r) * width, np.uint64(r + 1) * width, np.uint64(r + 2) * width,
                        np.uint64(r + 3) * width)
                s_at = (s0 + np.uint64(r) * stride, s0 + np.uint64(r + 1) * stride, s0 + np.uint64(r + 2) * stride,
                        s0 + np.uint64(r + 3) * stride)
                _dots(sf, s_at, count, qf, q_at, kb, k_at, d_k, code, ahead)
                r += 4
            if r + 2 <= end:
                q_at = (np.uint64(r) * width, np.uint64(r + 1) * width)
                _dots(sf, (s0 + np.uint64(r) * stride, s0 + np.uint64(r + 1) * stride), count, qf, q_at, kb, k_at,
                      d_k, code, ahead)
                r += 2
            if r < end:
                _dots(sf, (s0 + np.uint64(r) * stride,), count, qf, (np.uint64(r) * width,), kb, k_at, d_k, code,
                      ahead)


@jit(inline=True)
def _score_keys_heads_avx2(qf, sf, kb, ko, kld, rows, n, d_k, prefetch, code, heads, hld):
    """``_score_keys_heads_wide``'s, in ``_score_keys_avx2``'s passes."""
    at, ld, width, stride, h_ld = np.uint64(ko), np.uint64(kld), np.uint64(d_k), np.uint64(n), np.uint64(hld)
    ahead = np.uint64(PREFETCH_KEYS) * ld if prefetch else np.uint64(0)
    fours = rows - rows % 4
    if fours:
        for j in range(0, n, 2):
            count, s0 = _min(2, n - j), np.uint64(j)
            for h in range(heads):
                k_at = _key_offsets(at + np.uint64(h) * h_ld, ld, j, n - 1, 2)
                for r in range(h * rows, h * rows + fours, 4):
                    q_at = (np.uint64(r) * width, np.uint64(r + 1) * width, np.uint64(r + 2) * width,
                            np.uint64(r + 3) * width)
                    s_at = (s0 + np.uint64(r) * stride, s0 + np.uint64(r + 1) * stride,
                            s0 + np.uint64(r + 2) * stride, s0 + np.uint64(r + 3) * stride)
                    _dots(sf, s_at, count, qf, q_at, kb, k_at, d_k, code, ahead)
    if rows % 4 >= 2:
        for j in range(0, n, 4):
            s0 = np.uint64(j)
            for h in range(heads):
                r = np.uint64(h * rows + fours)
                _dots(sf, (s0 + r * stride, s0 + (r + np.uint64(1)) * stride), _min(4, n - j), qf,
                      (r * width, (r + np.uint64(1)) * width), kb,
                      _key_offsets(at + np.uint64(h) * h_ld, ld, j, n - 1, 4), d_k, code, ahead)
    if rows % 2:
        for j in range(0, n, 8):
            for h in range(heads):
                r = np.uint64((h + 1) * rows - 1)
                _dots(sf, (np.uint64(j) + r * stride,), _min(8, n - j), qf, (r * width,), kb,
                      _key_offsets(at + np.uint64(h) * h_ld, ld, j, n - 1, 8), d_k, code, ahead)


# The scores of a tile (``_score_keys_wide``'s docstring), in the passes that
# fit the CPU's registers; of every kv head of an item at once.
_score_keys = _score_keys_wide if DOT_KEYS == 4 else _score_keys_avx2
_score_keys_heads = _score_keys_heads_wide if DOT_KEYS == 4 else _score_keys_heads_avx2


def _key_offsets(at, ld, j, last_key, keys):
    """The elements where keys ``j .. j + keys - 1`` start (``at + key *
    ld``), a tuple; keys past ``last_key`` repeat it.  ``keys``: 2, 4 or 8, a
    constant."""


@overload(_key_offsets, inline="always", prefer_literal=True)
def _key_offsets_of(at, ld, j, last_key, keys):  # (the tuple's length is chosen here, in Python)
    def two(at, ld, j, last_key, keys):
        return at + np.uint64(j) * ld, at + np.uint64(_min(j + 1, last_key)) * ld

    def four(at, ld, j, last_key, keys):
        return (at + np.uint64(j) * ld, at + np.uint64(_min(j + 1, last_key)) * ld,
                at + np.uint64(_min(j + 2, last_key)) * ld, at + np.uint64(_min(j + 3, last_key)) * ld)

    def eight(at, ld, j, last_key, keys):
        return (at + np.uint64(j) * ld, at + np.uint64(_min(j + 1, last_key)) * ld,
                at + np.uint64(_min(j + 2, last_key)) * ld, at + np.uint64(_min(j + 3, last_key)) * ld,
                at + np.uint64(_min(j + 4, last_key)) * ld, at + np.uint64(_min(j + 5, last_key)) * ld,
                at + np.uint64(_min(j + 6, last_key)) * ld, at + np.uint64(_min(j + 7, last_key)) * ld)
    return {2: two, 4: four, 8: eight}[keys.literal_value]


# -- values: acc += p V --------------------------------------------------------------------


# Keys one call of ``_axpy`` adds to the rows of a tile with no masked key:
# the longer the run, the longer the accumulators stay in registers (runs
# of 16: 0.80x the value update's time of runs of 4 at D = 64), except
# float32 rows longer than a run of vectors, streamed (16 took 1.09-1.27x
# there).  The log: docs/performance.md, "Figures moved out of the code".
AXPY_KEYS, AXPY_KEYS_LONG_FLOAT32 = 16, 4


@jit(inline=True)
def _add_values(pf, accf, vb, vo, vld, rows, n, d_v, prefetch, code):
    """``acc_r += sum_j p[r * n + j] v_j`` for the ``rows`` accumulators of
    ``accf`` (``d_v`` apart) and the ``n`` value rows at elements ``vo + j *
    vld`` of the raw bytes ``vb``, of format ``code``, leaving masked keys
    out (weight ``-0.0``: a masked key's V may hold inf or NaN, and 0 * inf
    is NaN).  An attended key whose weight underflowed to ``+0.0`` counts,
    as in the reference.

    One key after another is added to each element (an FMA chain, no
    reassociation, ``_axpy``), whichever keys and rows a pass groups: a
    row's bits do not depend on its neighbours, nor on which pass took it.
    Where no weight of the tile is zero, rows go four at a time (each
    loaded V vector feeds four rows); the others one at a time, in runs of
    unmasked keys.  A run holds at most ``AXPY_KEYS`` keys
    (``AXPY_KEYS_LONG_FLOAT32`` for float32 rows longer than a run of
    ``AXPY_RUN_VECTORS`` vectors)."""
    at, ld, stride = np.uint64(vo), np.uint64(vld), np.uint64(n)
    ahead = np.uint64(PREFETCH_KEYS) * ld
    zeros = 0
    for t in range(rows * n):
        zeros += pf[t] == 0
    rows4 = rows - rows % 4 if zeros == 0 else 0
    run = AXPY_KEYS_LONG_FLOAT32 if code == F32 and d_v * 4 > AXPY_RUN_VECTORS * VECTOR_BYTES else AXPY_KEYS
    # Blocks of four rows outer, keys inner: the first block reads V from
    # memory, later ones from L2 (4 rows x 256 keys, D = 64 / 128: 5.9 / 10.6
    # ns a key, against 10.4 / 15.5 with keys outer; 2 threads, Skv=16384,
    # Hq=32: Hkv=8 float32 4.6-4.8 ms against 4.8-4.9, Hkv=4 2.9-3.3 against
    # 7.0-7.1).
    for r in range(0, rows4, 4):
        block = (np.uint64(r * d_v), np.uint64((r + 1) * d_v), np.uint64((r + 2) * d_v), np.uint64((r + 3) * d_v))
        for j in range(0, n, run):
            w = np.uint64(r * n + j)
            _axpy(accf, block, pf, (w, w + stride, w + stride + stride, w + stride + stride + stride), vb,
                  at + np.uint64(j) * ld, ld, ahead if prefetch and r == 0 else np.uint64(0), _min(run, n - j),
                  d_v, code)
    for r in range(rows4, rows):
        j = 0
        while j < n:
            stop = j + 1
            if not _masked(pf[r * n + j]):
                while stop < _min(j + run, n) and not _masked(pf[r * n + stop]):
                    stop += 1
                _axpy(accf, (np.uint64(r * d_v),), pf, (np.uint64(r * n + j),), vb, at + np.uint64(j) * ld, ld,
                      ahead if prefetch and r == 0 else np.uint64(0), stop - j, d_v, code)
            j = stop


@jit(inline=True)
def _add_values_heads(pf, accf, vb, vo, vld, rows, n, d_v, prefetch, code, heads, hld):
    """``_add_values`` for ``heads`` kv heads at once, ``hld`` elements
    apart in a value's row (token-major values): head ``h``'s rows follow
    head ``h - 1``'s in ``pf`` and ``accf``; each run of keys of every head
    in turn, so a value row's heads are read together (each element's FMA
    chain as a head at a time: the same bits)."""
    at, ld, stride, h_ld = np.uint64(vo), np.uint64(vld), np.uint64(n), np.uint64(hld)
    ahead = np.uint64(PREFETCH_KEYS) * ld
    zeros = 0
    for t in range(heads * rows * n):
        zeros += pf[t] == 0
    rows4 = rows - rows % 4 if zeros == 0 else 0
    run = AXPY_KEYS_LONG_FLOAT32 if code == F32 and d_v * 4 > AXPY_RUN_VECTORS * VECTOR_BYTES else AXPY_KEYS
    for j in range(0, n, run):
        for h in range(heads):
            for r in range(h * rows, h * rows + rows4, 4):
                block = (np.uint64(r * d_v), np.uint64((r + 1) * d_v), np.uint64((r + 2) * d_v),
                         np.uint64((r + 3) * d_v))
                w = np.uint64(r * n + j)
                _axpy(accf, block, pf, (w, w + stride, w + stride + stride, w + stride + stride + stride), vb,
                      at + np.uint64(h) * h_ld + np.uint64(j) * ld, ld,
                      ahead if prefetch and r == h * rows else np.uint64(0), _min(run, n - j), d_v, code)
    for h in range(heads):
        for r in range(h * rows + rows4, (h + 1) * rows):
            j = 0
            while j < n:
                stop = j + 1
                if not _masked(pf[r * n + j]):
                    while stop < _min(j + run, n) and not _masked(pf[r * n + stop]):
                        stop += 1
                    _axpy(accf, (np.uint64(r * d_v),), pf, (np.uint64(r * n + j),), vb,
                          at + np.uint64(h) * h_ld + np.uint64(j) * ld, ld,
                          ahead if prefetch and r == h * rows else np.uint64(0), stop - j, d_v, code)
                j = stop


@jit(inline=True)
def _masked(weight):
    """Whether a weight is a masked key's ``-0.0`` (``attention._exp``)."""
    return weight == 0 and math.copysign(1.0, weight) < 0
