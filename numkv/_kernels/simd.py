"""The kernels' LLVM IR toolkit: intrinsics the jitted code calls, and the IR
builders the vector loops (``decode_loops``, ``widen``) are made of.

Why IR at all: numba's own arithmetic on small integers widens them to 64
bits, its reductions keep a scalar running sum scalar, and ``buf.view`` is a
function of its own per call site; written as IR, the loops vectorise as
written, reduce in a fixed order (bits that do not depend on the tile), and
compile in a fraction of the time (numbers beside each).

Two kinds of names:

* intrinsics (``@intrinsic``), called from jitted code: ``_float32_from_bits``, ``_float64_bits``,
  ``_maximum``, ``_min``, ``_max``, ``_prefetch``, ``_view``, ``_array``,
  ``_as_rows``, ``_as_flat``, ``_claim``, ``_count_done``, ``_row_sum``, ``_row_max``,
  ``_half_bits``, ``_run``, ``_full_width_loops``;
* IR builders, called by other generators with an ``llvmlite`` ``builder``:
  ``_broadcast``, ``_splat``, ``_as_i32``, ``_emit_loop``, ``_phis``,
  ``_reduce_lanes``, ``_load``, ``_fmuladd``, ``_emit_prefetch``,
  ``_masked_memory``.

Nothing here knows a K/V format (``widen``) or the attention algorithm.
"""


from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu import has_avx512


# How many keys ahead the loops prefetch key and value rows (~8 KiB of float32
# rows at D = 128: far enough to hide the memory latency; see ``_prefetch``).
# A constant: numba freezes it into the compiled kernel.
PREFETCH_KEYS = 16


def _register_bytes():
    """Bytes a vector register holds on the CPU numba compiles for:
    AVX-512's 64, else AVX2's 32 (``cpu.has_avx512``)."""
    return 64 if has_avx512() else 32


# Bytes an element of an IR type holds, by the type's name (``str(type)``).
_BYTES = {"float": 4, "double": 8, "i16": 2, "i8": 1}


# -- scalars ---------------------------------------------------------------------------


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer ``bits`` (a
    bit cast, no conversion; numba widens integer arithmetic to 64 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, context.get_value_type(types.float32))

    return types.float32(bits), codegen


@intrinsic
def _float64_bits(typingctx, x):
    """The bits of the float64 ``x`` as an int64 (a bit cast, no conversion)."""
    if x != types.float64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(x), codegen


@intrinsic
def _full_width_loops(typingctx):
    """No code: LLVM vectorises the loops of the function that calls it (its
    own, and its ``inline`` helpers') with vectors of the width the IR here
    uses, a whole AVX-512 register where the CPU has one.  LLVM's tuning
    for Intel's AVX-512 CPUs (``skylake-avx512`` to ``graniterapids``, the
    CPU names numba compiles for there) prefers 256-bit vectors for the
    loops it vectorises, so on those CPUs the softmax's exponentials ran in
    halves of a register while the products' IR filled it; AMD's
    ``znver4`` prefers 512 bits already (``tests/test_vector_width.py``).
    The attention kernel, its C functions and the float16 narrowing call
    it; the scatter's copies and the read-bandwidth probe are bound by
    memory, not by the vectors' width."""
    def codegen(context, builder, sig, args):
        if has_avx512():
            # (a string attribute: llvmlite's ``add`` accepts LLVM's keyword attributes only)
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _half_bits(typingctx, x):
    """The float16 bit pattern nearest ``x`` (float32), round to nearest
    even: F16C's ``vcvtps2ph`` where the CPU has it."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def _maximum(typingctx, a, b):
    """``llvm.maximum``: the larger of two floats, NaN if either is NaN.  A
    running maximum of it vectorises (a compare-and-select one stays scalar),
    and a NaN among the values shows in the result."""
    if not (isinstance(a, types.Float) and a == b):
        return None

    def codegen(context, builder, sig, args):
        t = args[0].type
        return builder.call(builder.module.declare_intrinsic("llvm.maximum", [t], ir.FunctionType(t, [t, t])),
                            args)

    return a(a, b), codegen


def _integer_extreme(predicate, doc):
    """An intrinsic: the smaller (``"<"``) or larger (``">"``) of two
    integers, as int64 (signed).  Python's ``min`` / ``max`` would compile
    numba's implementation for each pair of types (~0.1 s of a first call)."""
    def typer(typingctx, a, b):
        if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            x, y = (context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args))
            return builder.select(builder.icmp_signed(predicate, x, y), x, y)
        return types.int64(a, b), codegen
    typer.__name__, typer.__doc__ = ("_min" if predicate == "<" else "_max"), doc
    return intrinsic(typer)


_min = _integer_extreme("<", "The smaller of two integers, as int64 (for ``min``: ``_integer_extreme``).")
_max = _integer_extreme(">", "The larger of two integers, as int64 (for ``max``: ``_integer_extreme``).")


def _as_i32(builder, value, ty):
    """IR: the integer ``value`` of numba type ``ty`` as 32 bits (zero-extended
    or truncated)."""
    i32 = ir.IntType(32)
    if ty.bitwidth < 32:
        return builder.zext(value, i32)
    return builder.trunc(value, i32) if ty.bitwidth > 32 else value


# -- memory: views, prefetches, atomics ------------------------------------------------


@intrinsic
def _view(typingctx, buf, dtype):
    """The bytes of the 1-D contiguous array ``buf`` as a 1-D array of
    ``dtype`` (a NumPy scalar type, or an array whose dtype to take): as
    ``buf.view(dtype)``, which numba compiles as a function of its own per
    call site and dtype (~0.15 s each, ~1 s of a cold float32 call in
    all); this is a few instructions inline."""
    if not (isinstance(buf, types.Array) and buf.ndim == 1 and buf.layout == "C"):
        return None
    elem = dtype.dtype if isinstance(dtype, types.Array) else getattr(dtype, "instance_type", None)
    if not isinstance(elem, types.Number):
        return None
    view = types.Array(elem, 1, "C")

    def codegen(context, builder, sig, args):
        from numba.core.imputils import impl_ret_borrowed
        from numba.np.arrayobj import populate_array

        src = context.make_array(buf)(context, builder, args[0])
        out = context.make_array(view)(context, builder)
        intp = context.get_value_type(types.intp)
        src_size, size = (context.get_abi_sizeof(context.get_data_type(t)) for t in (buf.dtype, elem))
        count = builder.udiv(builder.mul(cgutils.unpack_tuple(builder, src.shape)[0], ir.Constant(intp, src_size)),
                             ir.Constant(intp, size))
        populate_array(out, data=builder.bitcast(src.data, context.get_data_type(elem).as_pointer()),
                       shape=[count], strides=[ir.Constant(intp, size)], itemsize=ir.Constant(intp, size),
                       meminfo=src.meminfo, parent=src.parent)
        return impl_ret_borrowed(context, builder, view, out._getvalue())

    return view(buf, dtype), codegen


@intrinsic
def _array(typingctx, pointer, size):
    """The ``size`` elements at ``pointer`` (a C function's argument) as a
    1-D array: as ``numba.carray(pointer, size)``, which numba compiles as a
    function of its own for each pointer and shape type (~0.15 s of a cold
    call's C functions in all); this is a few instructions inline."""
    if not (isinstance(pointer, types.CPointer) and isinstance(size, types.Integer)):
        return None
    array = types.Array(pointer.dtype, 1, "C")

    def codegen(context, builder, sig, args):
        from numba.np.arrayobj import populate_array

        out = context.make_array(array)(context, builder)
        intp = context.get_value_type(types.intp)
        itemsize = ir.Constant(intp, context.get_abi_sizeof(context.get_data_type(pointer.dtype)))
        populate_array(out, data=args[0], shape=[context.cast(builder, args[1], size, types.intp)],
                       strides=[itemsize], itemsize=itemsize, meminfo=None)
        return out._getvalue()

    return array(pointer, size), codegen


@intrinsic
def _as_rows(typingctx, flat, width):
    """The 1-D contiguous array ``flat`` as a C-contiguous 2-D array of rows
    of ``width`` elements (``len(flat) // width`` of them): as
    ``flat.reshape((-1, width))`` where ``width`` divides the length, and a
    few instructions inline -- numba compiles a function of its own for each
    ``reshape`` (~0.05-0.16 s of a cold call's compilation each)."""
    if not (isinstance(flat, types.Array) and flat.ndim == 1 and flat.layout == "C"
            and isinstance(width, types.Integer)):
        return None
    matrix = types.Array(flat.dtype, 2, "C")

    def codegen(context, builder, sig, args):
        src = context.make_array(flat)(context, builder, args[0])
        cols = context.cast(builder, args[1], width, types.intp)
        rows = builder.sdiv(cgutils.unpack_tuple(builder, src.shape)[0], cols)
        return _reshaped(context, builder, matrix, src, [rows, cols], [builder.mul(cols, src.itemsize), src.itemsize])

    return matrix(flat, width), codegen


@intrinsic
def _as_flat(typingctx, matrix):
    """The C-contiguous 2-D array ``matrix`` as a 1-D array of its elements
    (``matrix.reshape(-1)``, a few instructions inline: see ``_as_rows``)."""
    if not (isinstance(matrix, types.Array) and matrix.ndim == 2 and matrix.layout == "C"):
        return None
    flat = types.Array(matrix.dtype, 1, "C")

    def codegen(context, builder, sig, args):
        src = context.make_array(matrix)(context, builder, args[0])
        rows, cols = cgutils.unpack_tuple(builder, src.shape)
        return _reshaped(context, builder, flat, src, [builder.mul(rows, cols)], [src.itemsize])

    return flat(matrix), codegen


def _reshaped(context, builder, ty, src, shape, strides):
    """IR: an array of type ``ty`` over ``src``'s data, of ``shape`` and ``strides``."""
    from numba.core.imputils import impl_ret_borrowed
    from numba.np.arrayobj import populate_array

    out = context.make_array(ty)(context, builder)
    populate_array(out, data=src.data, shape=shape, strides=strides, itemsize=src.itemsize, meminfo=src.meminfo,
                   parent=src.parent)
    return impl_ret_borrowed(context, builder, ty, out._getvalue())


@intrinsic
def _prefetch(typingctx, flat, index):
    """Ask the CPU to start loading ``flat[index]``'s cache line into L2 (a
    hint: it never faults, wherever ``index`` points).  L2, not L1
    (``prefetcht1``, locality 2): L1 has few slots for lines in flight, L2
    many more (2 cores, decode Skv=16384 float32: 4.3-5.6 ms against 7.8-9.3
    ms into L1; B=8 Skv=2048 4.7-6.0 against 8.2-9.9; ``PREFETCH_KEYS``
    8 / 16 / 24 / 32 / 64 ahead: 16 best or level)."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        _emit_prefetch(builder, builder.gep(ary.data, [args[1]]))
        return context.get_dummy_value()

    return types.void(flat, index), codegen


def _emit_prefetch(builder, ptr):
    """IR of ``_prefetch``: the cache line at ``ptr`` into L2."""
    ptr = builder.bitcast(ptr, ir.IntType(8).as_pointer())
    i32 = ir.IntType(32)
    fn = builder.module.declare_intrinsic("llvm.prefetch", [ptr.type],
                                          ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]))
    builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])


@intrinsic
def _claim(typingctx, counter):
    """``counter[0]``, atomically incremented: the next item for whichever
    thread asks first."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), codegen


@intrinsic
def _count_done(typingctx, counts, index):
    """``counts[index]``, atomically incremented (acquire and release: what
    the threads that counted before wrote is visible to the one after them,
    and what this one wrote to those that count next): of the threads that
    each finish a part of a job, the one that gets ``parts - 1`` is the last."""
    if not (isinstance(counts, types.Array) and counts.dtype == types.int64 and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        at = builder.gep(ary.data, [context.cast(builder, args[1], index, types.intp)])
        return builder.atomic_rmw("add", at, ir.Constant(ir.IntType(64), 1), "acq_rel")

    return types.int64(counts, index), codegen


# -- calls by address ---------------------------------------------------------------


@intrinsic
def _run(typingctx, address, args):
    """Call the C function at ``address`` (an integer: a ``numba.cfunc``'s
    ``.address``) with ``args``, a tuple of arrays and numbers: an array
    passes as two arguments, its data pointer and its element count, an
    integer (or a bool) as an int64, a float as a float64.  The function is
    compiled on its own and linked at run time, so the caller's compilation
    neither includes nor re-optimises it.

    Returns 1 where the call failed, else 0: ``loop_functions``' functions
    return 1 when done, and numba's C functions return 0 where an exception
    stopped them (it is printed, not propagated: an index out of bounds under
    ``NUMBA_BOUNDSCHECK``); an address of 0 (a table entry the wrapper left
    uncompiled) is not called, and fails.  The caller adds up the failures
    and raises once (``LOOP_FAILED``): a ``raise`` at every call site cost
    ~0.8 CPU s of the kernel's compilation (numba lowers each raise apart)."""
    if not (isinstance(address, types.Integer) and isinstance(args, types.BaseTuple)
            and all(isinstance(t, (types.Array, types.Integer, types.Boolean, types.Float)) for t in args)):
        return None

    def codegen(context, builder, sig, llargs):
        values = []
        for i, ty in enumerate(args):
            value = builder.extract_value(llargs[1], i)
            if isinstance(ty, types.Array):
                arr = context.make_array(ty)(context, builder, value)
                values += [arr.data, arr.nitems]
            else:
                target = types.float64 if isinstance(ty, types.Float) else types.int64
                values.append(context.get_constant(target, ty.literal_value) if isinstance(ty, types.Literal)
                              else context.cast(builder, value, ty, target))
        i64 = ir.IntType(64)
        fn_type = ir.FunctionType(i64, [v.type for v in values])
        address_64 = context.cast(builder, llargs[0], address, types.int64)
        before = builder.basic_block
        with builder.if_then(builder.icmp_unsigned("!=", address_64, ir.Constant(i64, 0)), likely=True):
            done = builder.call(builder.inttoptr(address_64, fn_type.as_pointer()), values)
            called = builder.basic_block
        result = builder.phi(i64)
        result.add_incoming(ir.Constant(i64, 0), before)
        result.add_incoming(done, called)
        return builder.zext(builder.icmp_unsigned("!=", result, ir.Constant(i64, 1)), i64)

    return types.int64(address, args), codegen


LOOP_FAILED = ("a numkv loop stopped on an exception (printed above: an index out of bounds?), "
               "or one this call needs was not compiled (loop_functions.addresses)")


# -- vectors ----------------------------------------------------------------------------


def _broadcast(builder, value, lanes):
    """IR: a vector of ``lanes`` copies of the run-time scalar ``value``."""
    ty = ir.VectorType(value.type, lanes)
    one = builder.insert_element(ir.Constant(ty, None), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def _splat(ty, value):
    """A constant of ``ty`` (a scalar or vector type) with every lane ``value``."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def _load(builder, row, at, width):
    """IR: ``width`` elements (a vector, or a scalar for 1) from ``row[at]``."""
    elem = row.type.pointee
    ty = ir.VectorType(elem, width) if width > 1 else elem
    return builder.load(builder.bitcast(builder.gep(row, [at]), ty.as_pointer()), align=_BYTES[str(elem)])


def _masked_memory(builder, op, ty):
    """``llvm.masked.load`` or ``llvm.masked.store`` (``op``) of the float or
    double vector type ``ty``: ``load(ptr, align, mask, passthru)``,
    ``store(value, ptr, align, mask)``."""
    i32 = ir.IntType(32)
    mask = ir.VectorType(ir.IntType(1), ty.count)
    if op == "load":
        fnty = ir.FunctionType(ty, [ty.as_pointer(), i32, mask, ty])
    else:
        fnty = ir.FunctionType(ir.VoidType(), [ty, ty.as_pointer(), i32, mask])
    scalar = "f32" if ty.element == ir.FloatType() else "f64"
    return cgutils.get_or_insert_function(builder.module, fnty, f"llvm.masked.{op}.v{ty.count}{scalar}.p0")


def _fmuladd(builder, ty):
    """``llvm.fmuladd`` for ``ty`` (a float or double scalar or vector): an FMA."""
    scalar = ty.element if isinstance(ty, ir.VectorType) else ty
    name = (f"llvm.fmuladd.{'v%d' % ty.count if isinstance(ty, ir.VectorType) else ''}"
            f"{'f32' if scalar == ir.FloatType() else 'f64'}")
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]), name)


def _reduce_lanes(builder, vectors):
    """IR: eight vectors -> one vector of their eight lane sums, in order.
    Pairs of vectors are merged keeping each one's lower and upper halves
    (``lo + hi``), until one vector holds every sum in blocks; then each
    block is halved in place.  Every sum gets the same tree: lane ``t`` plus
    lane ``t + w/2`` at each width ``w``."""
    i32 = ir.IntType(32)

    def shuffle(a, b, picks):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(picks)), picks))

    lanes = vectors[0].type.count
    width = lanes  # lanes per sum
    while len(vectors) > 1:
        half, merged = width // 2, []
        for a, b in zip(vectors[0::2], vectors[1::2]):
            blocks = [(0, k * width) for k in range(lanes // width)] + [(lanes, k * width) for k in range(lanes // width)]
            lo = shuffle(a, b, [src + at + t for src, at in blocks for t in range(half)])
            hi = shuffle(a, b, [src + at + half + t for src, at in blocks for t in range(half)])
            merged.append(builder.fadd(lo, hi))
        vectors, width = merged, half
    vector = vectors[0]
    while width > 1:
        half, count = width // 2, vector.type.count
        lo = shuffle(vector, vector, [at + t for at in range(0, count, width) for t in range(half)])
        hi = shuffle(vector, vector, [at + half + t for at in range(0, count, width) for t in range(half)])
        vector, width = builder.fadd(lo, hi), half
    return vector


@intrinsic
def _row_sum(typingctx, flat, at, n):
    """``sum(flat[at:at + n])`` in eight lanes added in a fixed order (lane
    ``t`` sums the entries ``j = t mod 8`` one after another; then ``((l0 +
    l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))``): the bits do not depend on
    ``n`` when the extra entries are zeros (a masked key at the end of a tile
    changes nothing), and a chain of float adds does not run at a quarter
    of their rate.  LLVM IR, eight lanes a vector add (LLVM kept eight
    scalar sums scalar: 0.17 ns an entry)."""
    if not (isinstance(flat, types.Array) and flat.ndim == 1 and flat.layout == "C"
            and isinstance(flat.dtype, types.Float) and isinstance(at, types.Integer) and isinstance(n, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        real = context.get_value_type(sig.args[0].dtype)
        i64, i32, vec = ir.IntType(64), ir.IntType(32), ir.VectorType(real, 8)
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        at, n = (context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], sig.args[1:]))
        row = builder.gep(ary.data, [at])

        def add(j, lanes):
            ptr = builder.bitcast(builder.gep(row, [j]), vec.as_pointer())
            return [builder.fadd(lanes[0], builder.load(ptr, align=_BYTES[str(real)]))]

        whole = builder.and_(n, ir.Constant(i64, -8))
        lanes = _emit_loop(builder, ir.Constant(i64, 0), whole, 8, [_splat(vec, 0.0)], add)[0]
        # The tail's entries to the lanes they would have had in a longer row (+0.0 to the others).
        tail = builder.trunc(builder.sub(n, whole), i32)
        lane_index = ir.Constant(ir.VectorType(i32, 8), list(range(8)))
        mask = builder.icmp_unsigned("<", lane_index, _broadcast(builder, tail, 8))
        load = _masked_memory(builder, "load", vec)
        ptr = builder.bitcast(builder.gep(row, [whole]), vec.as_pointer())
        tail_lanes = builder.call(load, [ptr, ir.Constant(i32, _BYTES[str(real)]), mask, _splat(vec, 0.0)])
        lanes = builder.fadd(lanes, tail_lanes)
        lane = [builder.extract_element(lanes, ir.Constant(i32, t)) for t in range(8)]
        pairs = [builder.fadd(lane[t], lane[t + 1]) for t in range(0, 8, 2)]
        return builder.fadd(builder.fadd(pairs[0], pairs[1]), builder.fadd(pairs[2], pairs[3]))

    return flat.dtype(flat, at, n), codegen


@intrinsic
def _row_max(typingctx, flat, at, n):
    """``max(flat[at:at + n])`` (``n >= 0``, ``at + n`` within ``flat``),
    NaN if one of them is NaN, ``-inf`` for none; the sign of a zero
    maximum is either.  A register's lanes a vector (AVX-512's or AVX2's),
    a plain ``max`` and a running "NaN seen" mask.  (A loop of
    ``llvm.maximum``, whose NaN and signed-zero order took a chain of seven
    instructions a vector: a 256 x 512 tile's softmax ~53 us with it, ~45
    with this.)"""
    if not (isinstance(flat, types.Array) and flat.ndim == 1 and flat.layout == "C"
            and isinstance(flat.dtype, types.Float) and isinstance(at, types.Integer) and isinstance(n, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        real = context.get_value_type(sig.args[0].dtype)
        lanes, unroll = _register_bytes() // _BYTES[str(real)], 4
        i64, i32, vec = ir.IntType(64), ir.IntType(32), ir.VectorType(real, lanes)
        flags = ir.VectorType(ir.IntType(1), lanes)
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        at, n = (context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], sig.args[1:]))
        row = builder.gep(ary.data, [at])
        low = _splat(vec, float("-inf"))

        def fold(best, nan, x):
            larger = builder.select(builder.fcmp_ordered(">", x, best), x, best)
            return larger, builder.or_(nan, builder.fcmp_unordered("uno", x, x))

        def step(j, values):
            out = []
            for u in range(unroll):
                x = _load(builder, row, builder.add(j, ir.Constant(i64, u * lanes)), lanes)
                out += fold(values[2 * u], values[2 * u + 1], x)
            return out

        whole = builder.and_(n, ir.Constant(i64, -lanes * unroll))
        values = _emit_loop(builder, ir.Constant(i64, 0), whole, lanes * unroll, [low, _splat(flags, 0)] * unroll, step)
        best, nan = values[0], values[1]
        for u in range(1, unroll):
            best, nan = fold(best, nan, values[2 * u])
            nan = builder.or_(nan, values[2 * u + 1])
        # The rest: whole vectors, then one masked load (-inf in the lanes past n).
        rest = builder.and_(n, ir.Constant(i64, -lanes))
        best, nan = _emit_loop(builder, whole, rest, lanes, [best, nan],
                               lambda j, v: fold(v[0], v[1], _load(builder, row, j, lanes)))
        tail = builder.trunc(builder.sub(n, rest), i32)
        mask = builder.icmp_unsigned("<", ir.Constant(ir.VectorType(i32, lanes), list(range(lanes))),
                                     _broadcast(builder, tail, lanes))
        ptr = builder.bitcast(builder.gep(row, [rest]), vec.as_pointer())
        x = builder.call(_masked_memory(builder, "load", vec), [ptr, ir.Constant(i32, _BYTES[str(real)]), mask, low])
        best, nan = fold(best, nan, x)
        width = lanes
        while width > 1:  # halve the lanes
            width //= 2
            picks = ir.Constant(ir.VectorType(i32, lanes), [t + width if t < width else t for t in range(lanes)])
            best = builder.select(builder.fcmp_ordered(">", best, builder.shuffle_vector(best, best, picks)),
                                  best, builder.shuffle_vector(best, best, picks))
        top = builder.extract_element(best, ir.Constant(i32, 0))
        seen = builder.icmp_unsigned("!=", builder.bitcast(nan, ir.IntType(lanes)), ir.Constant(ir.IntType(lanes), 0))
        return builder.select(seen, ir.Constant(real, float("nan")), top)

    return flat.dtype(flat, at, n), codegen


# -- control flow ---------------------------------------------------------------------


def _emit_loop(builder, start, stop, stride, init, body):
    """IR of ``for at in range(start, stop, stride): values = body(at, values)``;
    returns the values after it (``init`` if it never runs)."""
    i64 = ir.IntType(64)
    before = builder.block
    loop = builder.append_basic_block("loop")
    after = builder.append_basic_block("loop.after")
    builder.cbranch(builder.icmp_signed("<", start, stop), loop, after)
    builder.position_at_end(loop)
    at = builder.phi(i64)
    values = [builder.phi(v.type) for v in init]
    new = body(at, values)
    end = builder.block  # the body's last block (it may hold loops of its own)
    following = builder.add(at, ir.Constant(i64, stride))
    at.add_incoming(start, before)
    at.add_incoming(following, end)
    for phi, first, updated in zip(values, init, new):
        phi.add_incoming(first, before)
        phi.add_incoming(updated, end)
    backedge = builder.cbranch(builder.icmp_signed("<", following, stop), loop, after)
    backedge.set_metadata("llvm.loop", _as_written(builder.module))
    builder.position_at_end(after)
    return _phis(builder, [(init, before), (new, end)])


def _phis(builder, incoming):
    """IR: one phi a value, merging ``incoming``, ``(values, block)`` pairs
    (each block's values in the same order)."""
    merged = []
    for i, first in enumerate(incoming[0][0]):
        phi = builder.phi(first.type)
        for values, block in incoming:
            phi.add_incoming(values[i], block)
        merged.append(phi)
    return merged


def _as_written(module):
    """Loop metadata: LLVM is to neither vectorise nor unroll the loop (its
    vector loops are written so; its scalar ones run a few times)."""
    props = [module.add_metadata([ir.MetaDataString(module, name), ir.Constant(ir.IntType(1), 0)])
             for name in ("llvm.loop.vectorize.enable",)] + [module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")])]
    loop_id = ir.values.MDValue(module, [], name=str(len(module.metadata)))  # a node of its own
    loop_id.operands = (loop_id, *props)
    return loop_id
