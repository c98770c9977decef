"""Matrix products by BLAS for the kernels: many query rows (prefill) score
their keys and update their accumulators with ``sgemm``/``dgemm`` called
from jitted code (``_gemm``), on rows read in place wherever they lie.

A matrix product written as a numba loop reaches a quarter of what BLAS
reaches on the same tile (measured: 94 vs 231 GFLOP/s on 2 cores, 218 vs
872-955 on 16).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numpy.lib.stride_tricks import as_strided

from .._config import jit



@jit(inline=True)
def _rows_view(flat, at, ld, n, width):
    """``(n, width)`` view of rows ``ld`` apart from ``flat[at]`` (for BLAS)."""
    item = flat.itemsize
    return as_strided(flat[at:], (n, width), (ld * item, item))


@intrinsic
def _gemm(typingctx, a, b, c, beta, trans_b, fn):
    """``c = a @ (b.T if trans_b else b) + beta * c`` for 2-D float arrays with
    unit-stride rows (any distance apart), by BLAS ``sgemm``/``dgemm``: the
    Fortran-ABI function at address ``fn`` (numkv's own OpenBLAS,
    ``numkv._runtime.blas``), or where ``fn`` is 0 the ``numba_xxgemm``
    helper numba's own ``np.dot`` calls (SciPy's BLAS).  Both are found at
    run time, so the kernel stays in numba's disk cache.  Unlike ``np.dot``
    it accumulates (``beta``) and reads strided rows in place."""
    if not all(isinstance(x, types.Array) and x.ndim == 2 and x.dtype == c.dtype for x in (a, b, c)):
        return None
    if not isinstance(fn, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        from numba.np.linalg import ensure_blas

        dtype = sig.args[2].dtype
        char, int32, intp = ir.IntType(8), ir.IntType(32), context.get_value_type(types.intp)
        voidp = char.as_pointer()
        a_, b_, c_ = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args[:3], args[:3]))
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_value_type(dtype)))

        def ld(ary):  # the distance between rows, in elements
            return builder.sdiv(cgutils.unpack_tuple(builder, ary.strides)[0], itemsize)

        m, k = cgutils.unpack_tuple(builder, a_.shape)
        n = cgutils.unpack_tuple(builder, c_.shape)[1]
        one = cgutils.alloca_once_value(builder, context.get_constant(dtype, 1.0))
        beta_ = cgutils.alloca_once_value(builder, context.cast(builder, args[3], sig.args[3], dtype))
        transpose = context.cast(builder, args[4], sig.args[4], types.boolean)
        op_b = builder.select(transpose, ir.Constant(char, ord("t")), ir.Constant(char, ord("n")))
        address = context.cast(builder, args[5], sig.args[5], types.intp)
        # BLAS is column-major: there the product is c^T = op(b)^T a^T.
        ldb, lda, ldc = ld(b_), ld(a_), ld(c_)
        one_p, b_p, a_p, beta_p, c_p = (builder.bitcast(x, voidp) for x in (one, b_.data, a_.data, beta_, c_.data))
        with builder.if_else(builder.icmp_signed("==", address, ir.Constant(intp, 0))) as (helper, own):
            with helper:
                ensure_blas()
                fnty = ir.FunctionType(int32, [char, char, char, intp, intp, intp, voidp, voidp, intp,
                                               voidp, intp, voidp, voidp, intp])
                xxgemm = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
                kind = ir.Constant(char, ord("s" if dtype == types.float32 else "d"))
                builder.call(xxgemm, (kind, op_b, ir.Constant(char, ord("n")), n, m, k,
                                      one_p, b_p, ldb, a_p, lda, beta_p, c_p, ldc))
            with own:  # Fortran ABI: every argument by pointer, LP64 integers
                def ref(value):
                    return cgutils.alloca_once_value(builder, value)

                int_p = int32.as_pointer()
                fnty = ir.FunctionType(ir.VoidType(), [voidp, voidp, int_p, int_p, int_p, voidp, voidp, int_p,
                                                       voidp, int_p, voidp, voidp, int_p])
                gemm = builder.inttoptr(address, fnty.as_pointer())
                nn, mm, kk, ldb_, lda_, ldc_ = (ref(builder.trunc(x, int32)) for x in (n, m, k, ldb, lda, ldc))
                builder.call(gemm, (ref(op_b), ref(ir.Constant(char, ord("n"))), nn, mm, kk,
                                    one_p, b_p, ldb_, a_p, lda_, beta_p, c_p, ldc_))
        return context.get_dummy_value()

    return types.void(a, b, c, beta, trans_b, fn), codegen


@jit(inline=True)
def _gemm_scores(qt, kf, ko, kld, s, rows, n, gemm_limit, gemm_fn):
    """``s = qt K^T`` by BLAS, split along d so that each product stays within
    ``gemm_limit``."""
    d_k = qt.shape[1]
    kt = _rows_view(kf, ko, kld, n, d_k)
    part = max(1, min(d_k, gemm_limit // (rows * n)))
    for d0 in range(0, d_k, part):
        _gemm(qt[:, d0:d0 + part], kt[:, d0:d0 + part], s, 0.0 if d0 == 0 else 1.0, True, gemm_fn)


@jit(inline=True)
def _gemm_accumulate(p, vf, vo, vld, acc, rows, n, gemm_limit, gemm_fn):
    """``acc += p V`` by BLAS, split as ``_gemm_scores``."""
    d_v = acc.shape[1]
    vt = _rows_view(vf, vo, vld, n, d_v)
    part = max(1, min(d_v, gemm_limit // (rows * n)))
    for d0 in range(0, d_v, part):
        _gemm(p, vt[:, d0:d0 + part], acc[:, d0:d0 + part], 1.0, False, gemm_fn)
