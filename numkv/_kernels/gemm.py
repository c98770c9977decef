"""Matrix products for prefill's tiles, in LLVM IR: ``S = Q K^T`` and
``acc += P V`` of a work item's query rows against a tile of keys
(``_gemm_scores``, ``_gemm_accumulate``).

Register blocks, as BLAS kernels and ggml's are made: a block of
``BLOCK_ROWS`` rows by a few vectors' columns of the product is held in
registers while the inner dimension runs, each step one broadcast element
of each row times those vectors of the right operand
(``_block_product``).  The left operand's rows are read where they lie (a
broadcast needs no packing); the right one's rows are vectors: V's rows as
they lie in the cache (or in its tile, where they lie further apart than
their width: ``loop_functions.read_in_place``), and K's tile transposed
once (``_transpose``), ``d x n`` (its rows an odd number of cache lines
apart: ``_kt_stride``).
BLAS packs both operands on every call; on a prefill's tile products
(then 512 rows x 256 keys x 128) that packing was 7.5% of a causal
prefill's time, and OpenBLAS' sgemm, packing included, took 335-345 us a
product on one core of a Zen 4 against 293-296 us for these blocks
(2-core EPYC, numpy's OpenBLAS, medians of 7).

Each result is one chain of FMAs along the inner dimension, in order
(then added to ``acc``): its bits depend on its row and column only, not
on the block or the thread that made it.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .._config import jit
from .cpu import has_avx512
from .simd import _BYTES, _broadcast, _emit_loop, _fmuladd, _masked_memory, _max, _min, _register_bytes, _splat

# Rows of a register block; its columns are ``_block_vectors()`` vectors:
# 6 x 64 float32 (24 of AVX-512's 32 registers hold the block), 6 x 16 on
# AVX2 (12 of 16).  Of 6, 8, 12 and 14 rows x 32 columns and 6 x 64 on the
# 2-core EPYC, 6 x 64 was fastest (296 / 293 us the two products above, 8
# x 32 304 / 295 us; the others between); of AVX2 code on the same core
# (``NUMBA_CPU_NAME=haswell``), 6 x 16 (313 / 316 us; 5 x 16 327 / 331, 4 x
# 16 335 / 336, 8 x 8 413 / 417, 3 x 32 spills: 656 / 669).
BLOCK_ROWS = 6

# K^T's rows lie an odd number of cache lines apart (``_kt_stride``), so
# the vectors a block reads, one from each row, fall in every set of the L1
# in turn: ``n`` apart, 512 float32 keys put them 2 KiB apart, in 2 of the
# 64 sets of a 32 KiB L1, and they evicted each other (256 rows x 512 keys x
# 128 ran at 46-58 GFLOP/s on one core of the 2-vCPU Zen 3 with rows 512
# apart, 57-61 with 528: ``tools/tile_products.py``; performance.md,
# "session 26").  A row is then at most two lines longer than ``n``.
CACHE_LINE = 64


def _block_vectors():
    """``(bytes a vector holds, vectors a block row)``: AVX-512's registers
    or AVX2's (what the CPU numba compiles for has, ``cpu.has_avx512``)."""
    register = _register_bytes()
    return register, 4 if register == 64 else 2


def describe():
    """The register block as this CPU gets it, in words (``numkv info``)."""
    vector_bytes, vectors = _block_vectors()
    vectors_of = "AVX-512" if has_avx512() else "32-byte vectors"
    return (f"register blocks of {BLOCK_ROWS} x {vector_bytes // 4 * vectors} float32, "
            f"{BLOCK_ROWS} x {vector_bytes // 8 * vectors} float64 ({vectors_of})")


@intrinsic
def _block_columns(typingctx, flat):
    """The columns of a register block of ``flat``'s dtype (a constant)."""
    if not (isinstance(flat, types.Array) and isinstance(flat.dtype, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        vector_bytes, vectors = _block_vectors()
        lanes = vector_bytes // context.get_abi_sizeof(context.get_value_type(sig.args[0].dtype))
        return context.get_constant(types.int64, lanes * vectors)

    return types.int64(flat), codegen


def _block_product(add):
    """An intrinsic: ``c[c_at + r * ldc + j] (+)= sum over t < k of
    a[a_at + r * lda + t] * b[b_at + t * ldb + j]`` for ``r < rows <=
    BLOCK_ROWS``, ``j < cols <= _block_columns`` (flat float arrays of one
    dtype; ``add``: accumulate into ``c``, else overwrite it).  The block
    lives in registers while ``t`` runs; a block of fewer rows repeats its
    last row's (not stored), one of fewer columns masks its loads and
    stores (no element past ``cols`` is read or written)."""
    def typer(typingctx, c, c_at, ldc, a, a_at, lda, b, b_at, ldb, k, rows, cols):
        arrays, ints = (c, a, b), (c_at, ldc, a_at, lda, b_at, ldb, k, rows, cols)
        if not (all(isinstance(x, types.Array) and x.ndim == 1 and x.dtype == c.dtype for x in arrays)
                and isinstance(c.dtype, types.Float) and all(isinstance(x, types.Integer) for x in ints)):
            return None

        def codegen(context, builder, sig, args):
            real = context.get_value_type(sig.args[0].dtype)
            vector_bytes, n_vectors = _block_vectors()
            lanes = vector_bytes // _BYTES[str(real)]
            i64, i32 = ir.IntType(64), ir.IntType(32)
            vec = ir.VectorType(real, lanes)
            align = ir.Constant(i32, _BYTES[str(real)])
            c_, a_, b_ = (context.make_array(sig.args[i])(context, builder, args[i]).data for i in (0, 3, 6))
            c_at, ldc, a_at, lda, b_at, ldb, k, rows, cols = (
                context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 4, 5, 7, 8, 9, 10, 11))
            fma = _fmuladd(builder, vec)
            last = builder.sub(rows, ir.Constant(i64, 1))
            a_rows = []
            for r in range(BLOCK_ROWS):  # rows past the block's repeat its last
                row = ir.Constant(i64, r)
                row = builder.select(builder.icmp_signed("<", row, rows), row, last)
                a_rows.append(builder.gep(a_, [builder.add(a_at, builder.mul(row, lda))]))
            b_row = builder.gep(b_, [b_at])
            columns = [ir.Constant(ir.VectorType(i64, lanes), [v * lanes + t for t in range(lanes)])
                       for v in range(n_vectors)]
            masks = [builder.icmp_signed("<", at, _broadcast(builder, cols, lanes)) for at in columns]
            masked_load, masked_store = _masked_memory(builder, "load", vec), _masked_memory(builder, "store", vec)
            zero = _splat(vec, 0.0)

            def vector_at(row, v):
                return builder.bitcast(builder.gep(row, [ir.Constant(i64, v * lanes)]), vec.as_pointer())

            def load(ptr, v, masked):
                if masked:
                    return builder.call(masked_load, [ptr, align, masks[v], zero])
                return builder.load(ptr, align=align.constant)

            def product(width, masked):
                """The block's loop over ``width`` vectors of columns, then
                its stores; masked only where the block has fewer columns
                (AVX2's masked moves are slow on some CPUs)."""
                def step(t, accs):
                    b_t = builder.gep(b_row, [builder.mul(t, ldb)])
                    bv = [load(vector_at(b_t, v), v, masked) for v in range(width)]
                    out = []
                    for r in range(BLOCK_ROWS):
                        x = _broadcast(builder, builder.load(builder.gep(a_rows[r], [t])), lanes)
                        out += [builder.call(fma, [x, bv[v], accs[r * width + v]]) for v in range(width)]
                    return out

                accs = _emit_loop(builder, ir.Constant(i64, 0), k, 1, [zero] * (BLOCK_ROWS * width), step)
                for r in range(BLOCK_ROWS):
                    def store(r=r):
                        row = builder.gep(c_, [builder.add(c_at, builder.mul(ir.Constant(i64, r), ldc))])
                        for v in range(width):
                            value, ptr = accs[r * width + v], vector_at(row, v)
                            if add:
                                value = builder.fadd(load(ptr, v, masked), value)
                            if masked:
                                builder.call(masked_store, [value, ptr, align, masks[v]])
                            else:
                                builder.store(value, ptr, align=align.constant)
                    if r == 0:
                        store()
                    else:
                        with builder.if_then(builder.icmp_signed("<", ir.Constant(i64, r), rows)):
                            store()

            # A block of fewer columns computes only the vectors that hold
            # some (a head size of 80: 64 + 16 columns, not 64 + 64).
            vectors = builder.sdiv(builder.add(cols, ir.Constant(i64, lanes - 1)), ir.Constant(i64, lanes))

            def partial(width):
                if width == n_vectors:
                    product(width, True)
                    return
                with builder.if_else(builder.icmp_signed("==", vectors, ir.Constant(i64, width))) as (this, wider):
                    with this:
                        product(width, True)
                    with wider:
                        partial(width + 1)

            full = builder.icmp_signed("==", cols, ir.Constant(i64, lanes * n_vectors))
            with builder.if_else(full, likely=True) as (whole, part):
                with whole:
                    product(n_vectors, False)
                with part:
                    partial(1)
            return context.get_dummy_value()

        return types.none(c, c_at, ldc, a, a_at, lda, b, b_at, ldb, k, rows, cols), codegen

    return intrinsic(typer)


_block_set = _block_product(add=False)
_block_add = _block_product(add=True)


@intrinsic
def _transpose_blocks(typingctx, src, at, ld, n, width, dst, ldt):
    """``dst[d * ldt + j] = src[at + j * ld + d]`` for ``j < n - n % L``, ``d <
    width - width % L`` (``L`` lanes of a vector: 16 float32): blocks of ``L``
    rows loaded as vectors, transposed in registers by ``log2(L)`` rounds of
    two-vector shuffles (each round swaps one bit of the row index with
    that bit of the lane index), stored as vectors.  (A loop of elements
    took 20 us a 256 x 128 float32 tile, 7% of its product.)"""
    if not (isinstance(src, types.Array) and isinstance(dst, types.Array) and src.dtype == dst.dtype
            and isinstance(src.dtype, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        real = context.get_value_type(sig.args[0].dtype)
        lanes = _block_vectors()[0] // _BYTES[str(real)]
        i64, i32, vec = ir.IntType(64), ir.IntType(32), ir.VectorType(real, lanes)
        src_, dst_ = (context.make_array(sig.args[i])(context, builder, args[i]).data for i in (0, 5))
        at, ld, n, width, ldt = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 3, 4, 6))
        whole = ir.Constant(i64, -lanes)
        n_whole, width_whole = builder.and_(n, whole), builder.and_(width, whole)

        def block(j, _):
            def inner(d, __):
                rows = []
                for r in range(lanes):
                    row = builder.add(at, builder.add(builder.mul(builder.add(j, ir.Constant(i64, r)), ld), d))
                    rows.append(builder.load(builder.bitcast(builder.gep(src_, [row]), vec.as_pointer()),
                                             align=_BYTES[str(real)]))
                h = lanes // 2
                while h:
                    low = [t if t & h == 0 else lanes + t - h for t in range(lanes)]
                    high = [t + h if t & h == 0 else lanes + t for t in range(lanes)]
                    for i in range(lanes):
                        if i & h == 0:
                            a, b = rows[i], rows[i | h]
                            rows[i] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, lanes), low))
                            rows[i | h] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, lanes), high))
                    h //= 2
                for r in range(lanes):
                    out = builder.add(builder.mul(builder.add(d, ir.Constant(i64, r)), ldt), j)
                    builder.store(rows[r], builder.bitcast(builder.gep(dst_, [out]), vec.as_pointer()),
                                  align=_BYTES[str(real)])
                return []

            _emit_loop(builder, ir.Constant(i64, 0), width_whole, lanes, [], inner)
            return []

        _emit_loop(builder, ir.Constant(i64, 0), n_whole, lanes, [], block)
        return context.get_constant(types.int64, lanes)

    return types.int64(src, at, ld, n, width, dst, ldt), codegen


@jit(inline=True)
def _transpose(src, at, ld, n, width, dst, ldt):
    """``dst[d * ldt + j] = src[at + j * ld + d]``: ``n`` rows of ``width``
    into ``width`` rows of ``n``, ``ldt >= n`` apart."""
    lanes = _transpose_blocks(src, at, ld, n, width, dst, ldt)
    n_whole, width_whole = n - n % lanes, width - width % lanes
    for d in range(width):  # what the blocks left: the last rows, the last columns
        for j in range(n_whole if d < width_whole else 0, n):
            dst[d * ldt + j] = src[at + j * ld + d]


@jit(inline=True)
def _last_key(hi, i, rows, nq):
    """The last key any of rows ``i .. i + BLOCK_ROWS`` (of ``rows``)
    attends: row ``r`` is query ``r % nq``, whose last key is ``hi[r % nq]``."""
    last = hi[i % nq]
    for r in range(i + 1, _min(i + BLOCK_ROWS, rows)):
        last = _max(last, hi[r % nq])
    return last


@jit(inline=True)
def _kt_stride(n, itemsize):
    """Elements from one row of K^T to the next: ``n`` rounded up to whole
    cache lines, and to an odd number of them (``CACHE_LINE``)."""
    lines = (n * itemsize + CACHE_LINE - 1) // CACHE_LINE
    return (lines | 1) * (CACHE_LINE // itemsize)


@jit(inline=True)
def _gemm_scores(q, kf, ko, kld, s, rows, n, d_k, kt, hi, nq, j0):
    """``s = q K^T`` (``rows`` rows of ``n`` in ``s``, of ``d_k`` in ``q``),
    K the ``n`` rows of ``kf`` from ``ko``, ``kld`` apart, keys ``j0 ..``;
    ``kt`` (at least ``d_k * (n + 2 * CACHE_LINE // kt.itemsize)``
    elements) takes K transposed, its rows ``_kt_stride`` apart.  A block of keys past
    every one its rows attend (``hi``, ``_last_key``: the causal triangle)
    is left as it was: the softmax masks those scores."""
    ldt = _kt_stride(n, kt.itemsize)
    _transpose(kf, ko, kld, n, d_k, kt, ldt)
    columns = _block_columns(kt)
    for j in range(0, n, columns):
        for i in range(0, rows, BLOCK_ROWS):
            if j0 + j <= _last_key(hi, i, rows, nq):
                _block_set(s, i * n + j, n, q, i * d_k, d_k, kt, j, ldt, d_k, _min(BLOCK_ROWS, rows - i),
                           _min(columns, n - j))


@jit(inline=True)
def _gemm_accumulate(p, vf, vo, vld, acc, rows, n, d_v, hi, nq, j0):
    """``acc += p V`` (``rows`` rows of ``d_v`` in ``acc``, of ``n`` in
    ``p``), V the ``n`` rows of ``vf`` from ``vo``, ``vld`` apart, keys
    ``j0 ..``.  A block of rows stops at the last key any of them attends
    (past it their weights are 0, and those keys are not read); a key that
    only some of its rows attend is read with weight 0 for the others
    (``loop_functions`` hands a tile whose such keys' V is not finite to the
    loops)."""
    columns = _block_columns(vf)
    for i in range(0, rows, BLOCK_ROWS):
        keys = _min(n, _last_key(hi, i, rows, nq) - j0 + 1)
        if keys > 0:
            for j in range(0, d_v, columns):
                _block_add(acc, i * d_v + j, d_v, p, i * n, n, vf, vo + j, vld, keys, _min(BLOCK_ROWS, rows - i),
                           _min(columns, d_v - j))
