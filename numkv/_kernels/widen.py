"""Narrow floats widened to the accumulation dtype: bits -> float, exactly
(inf, NaN and subnormals included), for every K/V format.

Two ways in:

* tiles (the ``_rows_*`` loops, ``_kv_tile``): rows of any dtype code, any element
  stride, widened into a float32 / float64 tile the matrix products read
  (prefill, strided caches, float64);
* in place (``FORMATS``, ``_load_widened``): decode's loops
  (``decode_loops``) read unit-stride rows of the formats in ``FORMATS`` as
  they are and widen each vector they load, in IR (``Format.widen``); a
  format may also widen whole blocks at once where the CPU allows it
  (``Format.widen_block``: float8_e4m3fn by a byte table, AVX-512 VBMI).

A new format read in place is one ``FORMATS`` entry (its IR widening, its
bits an element, what it needs of the CPU), its dtype code in ``layout``,
and its ``_rows_*`` loop for the tile path (``format_loops`` picks it).  The
quantised formats (``layout.QUANT_FORMATS``: codes with scales) widen a block of 32 at a time
(``_rows_quantized``).

Widening is written as LLVM IR in 16- and 32-bit lanes with selects: numba's
own integer arithmetic widens to 64 bits (``uint32 - uint32`` is ``int64``),
and the loops around it then ran at 0.7-1.2 ns an element instead of
0.25-0.4.
"""

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .._config import jit
from .cpu import has_f16c, has_vbmi
from .layout import (BASE, BF16, DTYPE, E4M3FN, E5M2, F16, F32, F64, IN_PLACE_ROWS, INFNAN_EM, INT4, INT8, NAN_BITS,
                     NAN_EM, NONE, Q4_0, Q8_0, QUANT_BLOCK, QUANT_FORMATS, SCALE_EXPONENT, SHIFT, STRIDE_B, STRIDE_D,
                     STRIDE_H, STRIDE_S, WIDEN)
from .simd import (_BYTES, PREFETCH_KEYS, _as_flat, _as_i32, _as_rows, _broadcast, _float32_from_bits, _prefetch, _run,
                   _splat, _view)


# -- bits -> float32, in IR --------------------------------------------------------------


def _emit_decode(builder, u, sign, shift, scale, infnan, nan_em, nan_x):
    """LLVM IR of ``_decode_bits`` on 32-bit integers ``u`` (the pattern) and
    its parameters; returns the float32 value."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    em = builder.and_(u, builder.sub(sign, ir.Constant(i32, 1)))
    bits = builder.shl(em, shift)
    value = builder.bitcast(builder.fmul(builder.bitcast(bits, f32), scale), i32)
    special = builder.icmp_unsigned(">=", em, infnan)
    value = builder.select(special, builder.or_(bits, ir.Constant(i32, 0x7F800000)), value)
    negative = builder.icmp_unsigned("!=", builder.and_(u, sign), ir.Constant(i32, 0))
    value = builder.select(negative, builder.or_(value, ir.Constant(i32, 0x80000000)), value)
    nan = builder.or_(builder.icmp_unsigned("==", em, nan_em), builder.icmp_unsigned("==", u, nan_x))
    return builder.bitcast(builder.select(nan, ir.Constant(i32, 0x7FC00000), value), f32)


def _like(bits, elem):
    """``elem``, or a vector of it as long as the vector ``bits``."""
    return ir.VectorType(elem, bits.type.count) if isinstance(bits.type, ir.VectorType) else elem


def _widen_bf16(builder, bits, f16c):
    """IR: bfloat16 is float32's upper half."""
    i32 = _like(bits, ir.IntType(32))
    return builder.bitcast(builder.shl(builder.zext(bits, i32), _splat(i32, 16)), _like(bits, ir.FloatType()))


def _widen_f16(builder, bits, f16c):
    """IR: float16, by the CPU's conversion (``vcvtph2ps``, many at a time)
    where it has F16C, else by ``_emit_decode`` (a scalar ``bits``)."""
    if f16c:
        return builder.fpext(builder.bitcast(bits, _like(bits, ir.HalfType())), _like(bits, ir.FloatType()))
    c32 = lambda v: ir.Constant(ir.IntType(32), v)  # noqa: E731
    return _emit_decode(builder, builder.zext(bits, ir.IntType(32)), c32(0x8000), c32(13),
                        ir.Constant(ir.FloatType(), 2.0 ** 112), c32(0x7C00), c32(NONE), c32(NONE))


def _widen_e5m2(builder, bits, f16c):
    """IR: float8_e5m2 is float16's upper byte."""
    i16 = _like(bits, ir.IntType(16))
    return _widen_f16(builder, builder.shl(builder.zext(bits, i16), _splat(i16, 8)), f16c)


def _widen_e4m3fn(builder, bits, f16c):
    """IR: float8_e4m3fn is a float16 of bias 15 (not 7), times 2**8;
    S.1111.111 is NaN.  Sign-extended and shifted by 7, the sign lands on
    bits 15 and 14: clearing 14 leaves the float16 (3 operations, against 6
    by masks)."""
    f32, i16 = _like(bits, ir.FloatType()), _like(bits, ir.IntType(16))
    half = builder.and_(builder.shl(builder.sext(bits, i16), _splat(i16, 7)), _splat(i16, 0xBFFF))
    value = builder.fmul(_widen_f16(builder, half, f16c), _splat(f32, 256.0))
    nan = builder.icmp_unsigned("==", builder.and_(half, _splat(i16, 0x3F80)), _splat(i16, 0x3F80))
    return builder.select(nan, _splat(f32, float("nan")), value)


# float8_e4m3fn bytes a block of ``_widen_e4m3fn_block``: one AVX-512
# register, four float32 vectors (fixed by the widening, not a tuning knob).
E4M3FN_BLOCK = 64


@functools.cache
def _e4m3fn_bfloat16_bits():
    """The bfloat16 bits of float8_e4m3fn's 128 magnitudes (each is a
    bfloat16: 3 mantissa bits, exponents 2**-9 .. 2**8); 0x7F is NaN."""
    bits = []
    for em in range(128):
        exponent, mantissa = em >> 3, em & 7
        value = (math.nan if em == 0x7F else mantissa * 2.0 ** -9 if exponent == 0
                 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
        bits.append(int(np.float32(value).view(np.uint32)) >> 16)
    return tuple(bits)


def _widen_e4m3fn_block(builder, x):
    """IR: the 64 float8_e4m3fn bytes ``x`` (``<64 x i8>``) as four ``<16 x
    float>``, in order.  Each byte looks up its bfloat16's two bytes in two
    128-entry tables (``vpermi2b``: a byte's low 7 bits index two
    registers), the sign is or'ed in, and unpacking the byte pairs, then the
    words under zeros, makes the float32s: ~11 instructions for 64
    elements, where bit arithmetic (``_widen_e4m3fn``) takes ~9 for 16.  On a
    streamed cache, one thread, the scores / the value update took 0.126 /
    0.127 ns an element, against 0.151 / 0.139 by bit arithmetic; decode at
    Skv=16384 on 2 threads went from 0.65x float32's time to 0.56-0.60x
    (float8_e5m2: 0.52-0.59x; whole bench runs: 0.53x and 0.615x).  (Moving
    the byte pairs with a shuffle and a mask each instead of the unpacks held
    more constants: LLVM ran out of registers and it was slower than bit
    arithmetic.)"""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    bytes64, words32 = ir.VectorType(i8, 64), ir.VectorType(i16, 32)

    def shuffle(a, b, picks):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(picks)), picks))

    lookup = cgutils.get_or_insert_function(builder.module, ir.FunctionType(bytes64, [bytes64] * 3),
                                            "llvm.x86.avx512.vpermi2var.qi.512")  # (table lo, index, table hi)
    bf16 = _e4m3fn_bfloat16_bits()
    low, high = ([ir.Constant(bytes64, part[:64]), ir.Constant(bytes64, part[64:])]
                 for part in ([b & 0xFF for b in bf16], [b >> 8 for b in bf16]))
    # The unpacks below interleave within 128-bit lanes: byte 16 i + 4 k + j
    # of their input ends up as element 16 k + 4 i + j, so it is put there first.
    x = shuffle(x, x, [16 * k + 4 * i + j for i in range(4) for k in range(4) for j in range(4)])
    low = builder.call(lookup, [low[0], x, low[1]])
    high = builder.or_(builder.call(lookup, [high[0], x, high[1]]), builder.and_(x, _splat(bytes64, 0x80)))
    zero = _splat(words32, 0)
    out = []
    for bytes_at in (0, 8):  # vpunpcklbw, vpunpckhbw: bfloat16 words
        words = builder.bitcast(shuffle(low, high, [b for i in range(4) for t in range(bytes_at, bytes_at + 8)
                                                    for b in (16 * i + t, 64 + 16 * i + t)]), words32)
        for words_at in (0, 4):  # vpunpcklwd, vpunpckhwd under zeros: float32s
            pairs = shuffle(zero, words, [w for i in range(4) for t in range(words_at, words_at + 4)
                                          for w in (8 * i + t, 32 + 8 * i + t)])
            out.append(builder.bitcast(pairs, ir.VectorType(ir.FloatType(), 16)))
    return out


# -- the formats decode's loops read in place ----------------------------------------------


def _load_quantized(builder, row, at, width, fmt):
    """IR: elements ``at .. at + width`` of the quantised row of bytes ``row``
    (``fmt``, ``QUANT_FORMATS``) as float32: q8_0 / q4_0 times their block's
    float16 scale (the block of 32 holding them: ``at`` is a multiple of
    ``width``, which divides 32), int8 / int4 the codes."""
    i8, i16, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(64)
    c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
    vec = (lambda elem: ir.VectorType(elem, width)) if width > 1 else (lambda elem: elem)

    def load(offset, n):
        ty = ir.VectorType(i8, n) if n > 1 else i8
        return builder.load(builder.bitcast(builder.gep(row, [offset]), ty.as_pointer()), align=1)

    scale = None
    if fmt in ("q8_0", "q4_0"):
        block = builder.mul(builder.lshr(at, c64(5)), c64(2 + QUANT_BLOCK if fmt == "q8_0" else 2 + QUANT_BLOCK // 2))
        bits = builder.load(builder.bitcast(builder.gep(row, [block]), i16.as_pointer()), align=1)
        if width > 1 and has_f16c():  # the bits in every lane, then F16C's conversion: a scale vector
            bits = _broadcast(builder, bits, width)
        scale = _widen_ir(builder, bits, "f16", has_f16c())
        within = builder.and_(at, c64(QUANT_BLOCK - 1))
        if fmt == "q8_0":
            codes = load(builder.add(block, builder.add(within, c64(2))), width)
        else:  # byte j holds elements j (low nibble) and j + 16 (high)
            packed = load(builder.add(block, builder.add(builder.and_(within, c64(15)), c64(2))), width)
            # Both nibbles by constant shifts, then a select: x86 has no byte
            # shift by a variable amount (LLVM widens it).
            high = builder.icmp_unsigned("!=", builder.and_(within, c64(16)), c64(0))
            nibbles = builder.select(high, builder.lshr(packed, _splat(vec(i8), 4)),
                                     builder.and_(packed, _splat(vec(i8), 15)))
            codes = builder.sub(nibbles, _splat(vec(i8), 8))
    elif fmt == "int8":
        codes = load(at, width)
    else:  # int4: byte at // 2, the even element low
        if width == 1:
            byte = load(builder.lshr(at, c64(1)), 1)
            shift = builder.trunc(builder.shl(builder.and_(at, c64(1)), c64(2)), i8)
            codes = builder.sub(builder.and_(builder.lshr(byte, shift), ir.Constant(i8, 15)), ir.Constant(i8, 8))
        else:
            packed = load(builder.lshr(at, c64(1)), width // 2)
            half_ty = ir.VectorType(i8, width // 2)
            low, high = builder.and_(packed, _splat(half_ty, 15)), builder.lshr(packed, _splat(half_ty, 4))
            order = [i // 2 + (width // 2) * (i % 2) for i in range(width)]
            codes = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(ir.IntType(32), width), order))
            codes = builder.sub(codes, _splat(vec(i8), 8))
    values = builder.sitofp(codes, vec(ir.FloatType()))
    if scale is not None:
        if width > 1 and not isinstance(scale.type, ir.VectorType):
            scale = _broadcast(builder, scale, width)
        values = builder.fmul(values, scale)
    return values


@dataclass(frozen=True)
class Format:
    """A K/V format the decode loops read in place, widening as they load.

    ``code``: its dtype code (``layout``); ``bits``: bits an element;
    ``widen(builder, bits, f16c)``: IR, its integer bits (a scalar or a
    vector) -> float32 values; ``needs_f16c``: vector loads of it widen by
    F16C, so where the CPU lacks it the loops go element by element;
    ``block``, ``widen_block(builder, <block x iN>) -> [<16 x float>, ...]``
    and ``block_cpu()``: a wider widening of ``block`` elements (one run of
    ``decode_loops.AXPY_RUN_VECTORS`` float32 vectors) that the loops over
    four query rows take where ``block_cpu()`` says the CPU can.
    ``load(builder, row, at, width)``: for a format whose element ``at`` is
    not ``at * bits / 8`` bytes into its row (the quantised ones, whose
    blocks hold a scale beside their codes), the IR of its elements ``at ..
    at + width`` as float32 from the row's first byte ``row``: the loops
    then hand it the row's start and the element index (``widen`` unused)."""

    code: int
    bits: int
    widen: Callable
    needs_f16c: bool = False
    block: int = 0
    widen_block: Callable = None
    block_cpu: Callable = None
    load: Callable = None


FORMATS = {  # in this order in every loop's switch (``decode_loops._per_format``)
    "bf16": Format(BF16, 16, _widen_bf16),
    "f16": Format(F16, 16, _widen_f16, needs_f16c=True),
    "e4m3fn": Format(E4M3FN, 8, _widen_e4m3fn, needs_f16c=True,
                     block=E4M3FN_BLOCK, widen_block=_widen_e4m3fn_block, block_cpu=has_vbmi),
    "e5m2": Format(E5M2, 8, _widen_e5m2, needs_f16c=True),
    # The quantised formats (``layout.QUANT_FORMATS``), read by ``_load_quantized``.
    **{name: Format(Q8_0 + i, 8, None, load=functools.partial(_load_quantized, fmt=name))
       for i, name in enumerate(QUANT_FORMATS)},
}
# The narrow K/V dtypes float32 decode's loops read in place (``_kv_tile``,
# ``decode_loops._per_format``): code -> (format, bits an element).
IN_PLACE = {fmt.code: (name, fmt.bits) for name, fmt in FORMATS.items()}


def _widen_ir(builder, bits, narrow, f16c):
    """IR: the float32 values of narrow float ``bits`` (integers, a scalar
    or a vector -- a scalar where the target lacks F16C) of format
    ``narrow`` (a key of ``FORMATS``).  Exact, inf and NaN included."""
    return FORMATS[narrow].widen(builder, bits, f16c)


def _load_widened(builder, row, at, width, narrow):
    """IR: ``width`` elements (a vector, or a scalar for 1) from ``row[at]``,
    widened from format ``narrow`` (None: as they are); a format with a
    ``load`` of its own: elements ``at ..`` of the row that starts at ``row``."""
    if narrow is not None and FORMATS[narrow].load is not None:
        return FORMATS[narrow].load(builder, row, at, width)
    elem = row.type.pointee
    ty = ir.VectorType(elem, width) if width > 1 else elem
    value = builder.load(builder.bitcast(builder.gep(row, [at]), ty.as_pointer()), align=_BYTES[str(elem)])
    return _widen_ir(builder, value, narrow, has_f16c()) if narrow else value


def _narrow_intrinsic(narrow, bits, doc):
    """An intrinsic: the float32 value of ``narrow`` float bits (``_widen_ir``)
    held in an integer's low ``bits`` bits."""
    def typer(typingctx, x):
        if not isinstance(x, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            value, ty = args[0], ir.IntType(bits)
            if x.bitwidth > bits:
                value = builder.trunc(value, ty)
            elif x.bitwidth < bits:
                value = builder.zext(value, ty)
            return _widen_ir(builder, value, narrow, has_f16c())
        return types.float32(x), codegen
    typer.__name__, typer.__doc__ = f"_{narrow}_to_float32", doc
    return intrinsic(typer)


_half_to_float32 = _narrow_intrinsic("f16", 16, "float32 value of float16 bits (F16C where the CPU has it).")
_e5m2_to_float32 = _narrow_intrinsic("e5m2", 8, "float32 value of float8_e5m2 bits: float16's upper byte.")
_e4m3fn_to_float32 = _narrow_intrinsic("e4m3fn", 8, "float32 value of float8_e4m3fn bits.")


# -- the fnuz float8s: one parametrised decode (``layout.FORMAT_TABLE``) ---------------------


@intrinsic
def _decode_bits(typingctx, x, sign_bit, shift, scale, infnan, nan_em, nan_x):
    """float32 value of the narrow-float bit pattern ``x`` (see
    ``layout.FORMAT_ROWS``): ``x``'s magnitude bits shifted into float32's
    place, times ``scale``; all-ones exponents (``em >= infnan``) keep their
    inf/NaN payload; ``em == nan_em`` or ``x == nan_x`` is NaN; then the
    sign."""
    sig = types.float32(x, sign_bit, shift, scale, infnan, nan_em, nan_x)

    def codegen(context, builder, sig, args):
        ints = [_as_i32(builder, v, t) for v, t in zip(args, sig.args) if isinstance(t, types.Integer)]
        u, sign, shift_, infnan_, nan_em_, nan_x_ = ints
        return _emit_decode(builder, u, sign, shift_, args[3], infnan_, nan_em_, nan_x_)

    return sig, codegen


@jit(inline=True)
def _format(formats, code):
    """``(shift, scale, infnan_em, nan_em, nan_bits)`` of format ``code``."""
    row = formats[code]
    scale = _float32_from_bits(np.uint32((row[SCALE_EXPONENT] + 127) << 23))
    return (np.uint32(row[SHIFT]), scale, np.uint32(row[INFNAN_EM]), np.uint32(row[NAN_EM]),
            np.uint32(row[NAN_BITS]))


# -- tiles -----------------------------------------------------------------------------------


@jit(inline=True)
def _itemsize(code):
    """Bytes an element of dtype ``code`` holds (a quantised format's ``desc``
    counts bytes: 1)."""
    return 4 if code == F32 else 8 if code == F64 else 2 if code <= BF16 else 1


@jit(inline=True)
def _row_bytes(code, width):
    """Bytes a row of ``width`` elements of dtype ``code`` spans (quantised
    formats: their blocks, or packed codes)."""
    if code == Q8_0:
        return width // QUANT_BLOCK * (2 + QUANT_BLOCK)
    if code == Q4_0:
        return width // QUANT_BLOCK * (2 + QUANT_BLOCK // 2)
    if code == INT4:
        return width // 2
    return width * _itemsize(code)


@jit(inline=True)
def _copy_rows(dst, r0, n, width, src, base, seq_stride, step):
    """``dst[r0 + t, c] = src[base + t * seq_stride + c * step]`` (a float32 or
    float64 source: numba converts)."""
    for t in range(n):
        at = np.uint64(base + t * seq_stride)
        for c in range(width):
            dst[r0 + t, c] = src[at + np.uint64(c) * step]


@jit(inline=True)
def _widen_rows_of(loops, dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    """``dst[r0 + t, c] = value(buf, base + t * seq_stride + c * stride)`` for
    ``t < n``, ``c < width``: elements of dtype ``code`` widened to ``dst``'s
    dtype, by that format's C function (``format_loops``: ``_prefetch_rows``,
    then its ``_rows_*`` loop), at ``loops[code, WIDEN]``; 1 where that
    failed (``simd._run``), else 0."""
    return _run(loops[code, WIDEN], (dst, buf, table, formats, r0, n, width, base, seq_stride, stride))


@jit(inline=True)
def _prefetch_rows(buf, code, n, width, base, seq_stride, stride):
    """Ask for the unit-stride rows ``PREFETCH_KEYS`` on, a cache line at a time."""
    if stride == 1:
        row_bytes, unit = _row_bytes(code, width), _itemsize(code)
        for t in range(n):
            ahead = (base + (t + PREFETCH_KEYS) * seq_stride) * unit
            for line in range(0, row_bytes, 64):
                _prefetch(buf, np.uint64(ahead + line))


# The tile loops, one per dtype and each simple enough for LLVM to
# vectorise, with one signature: ``dst[r0 + t, c] = value(buf, base + t *
# seq_stride + c * stride)`` for ``t < n``, ``c < width``.  Unsigned element
# indices spare numba's negative-index wraparound (which kept these loops
# scalar: 1.1-2 ns an element, against ~0.1 vectorised).


@jit(inline=True)
def _rows_float32(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    _copy_rows(dst, r0, n, width, _view(buf, np.float32), base, seq_stride, np.uint64(stride))


@jit(inline=True)
def _rows_float64(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    _copy_rows(dst, r0, n, width, _view(buf, np.float64), base, seq_stride, np.uint64(stride))


@jit(inline=True)
def _rows_bfloat16(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    src16, step = _view(buf, np.uint16), np.uint64(stride)
    for t in range(n):
        at = np.uint64(base + t * seq_stride)
        for c in range(width):  # bfloat16 is float32's upper half
            dst[r0 + t, c] = _float32_from_bits(np.uint32(src16[at + np.uint64(c) * step]) << 16)


@jit(inline=True)
def _rows_float16(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    src16, step = _view(buf, np.uint16), np.uint64(stride)
    for t in range(n):
        at = np.uint64(base + t * seq_stride)
        for c in range(width):
            dst[r0 + t, c] = _half_to_float32(src16[at + np.uint64(c) * step])


@jit(inline=True)
def _rows_e5m2(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    step = np.uint64(stride)
    for t in range(n):
        at = np.uint64(base + t * seq_stride)
        for c in range(width):
            dst[r0 + t, c] = _e5m2_to_float32(buf[at + np.uint64(c) * step])


@jit(inline=True)
def _rows_e4m3fn(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    step = np.uint64(stride)
    for t in range(n):
        at = np.uint64(base + t * seq_stride)
        for c in range(width):
            dst[r0 + t, c] = _e4m3fn_to_float32(buf[at + np.uint64(c) * step])


@jit(inline=True)
def _rows_e8m0(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    step = np.uint64(stride)
    for t in range(n):
        at = np.uint64(base + t * seq_stride)
        for c in range(width):  # a power of two per byte, no sign: a 256-entry table (in L1)
            dst[r0 + t, c] = table[buf[at + np.uint64(c) * step]]


@jit(inline=True)
def _rows_fnuz(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    """The fnuz float8s: one loop, parametrised by ``FORMAT_TABLE``'s row."""
    shift, scale, infnan, nan_em, nan_x = _format(formats, code)
    step = np.uint64(stride)
    for t in range(n):
        at = np.uint64(base + t * seq_stride)
        for c in range(width):
            dst[r0 + t, c] = _decode_bits(buf[at + np.uint64(c) * step], np.uint32(0x80), shift, scale,
                                          infnan, nan_em, nan_x)


def _emit_quant_block(builder, src, fmt):
    """IR: the ``QUANT_BLOCK`` (32) values of one block of ``fmt`` at the
    ``i8*`` ``src`` as a ``<32 x float>`` (q8_0 / q4_0: times their float16
    scale, which leads the block; int8 / int4: the codes)."""
    i8, i16, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(64)
    lanes = QUANT_BLOCK
    scale = None
    if fmt in ("q8_0", "q4_0"):
        bits = builder.load(builder.bitcast(src, i16.as_pointer()), align=1)
        scale = _widen_ir(builder, bits, "f16", has_f16c())
        src = builder.gep(src, [ir.Constant(i64, 2)])
    if fmt in ("q8_0", "int8"):
        codes = builder.load(builder.bitcast(src, ir.VectorType(i8, lanes).as_pointer()), align=1)
    else:  # nibbles, biased by 8: q4_0 element j low, j + 16 high; int4 the even element low
        packed = builder.load(builder.bitcast(src, ir.VectorType(i8, lanes // 2).as_pointer()), align=1)
        low = builder.and_(packed, _splat(ir.VectorType(i8, lanes // 2), 15))
        high = builder.lshr(packed, _splat(ir.VectorType(i8, lanes // 2), 4))
        order = (list(range(lanes)) if fmt == "q4_0"
                 else [i // 2 + (lanes // 2) * (i % 2) for i in range(lanes)])
        codes = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(ir.IntType(32), lanes), order))
        codes = builder.sub(codes, _splat(ir.VectorType(i8, lanes), 8))
    values = builder.sitofp(codes, ir.VectorType(ir.FloatType(), lanes))
    if scale is not None:
        values = builder.fmul(values, _broadcast(builder, scale, lanes))
    return values


def _quant_block_intrinsic(fmt):
    """``_widen_<fmt>_block(out, out_at, buf, at)``: ``out[out_at:out_at + 32]``
    = the block of ``fmt`` at byte ``at`` of ``buf`` (``_emit_quant_block``),
    in ``out``'s dtype (float32 or float64).  No loop: a vector load, convert
    and store, which a numba loop over a block did not become."""
    def typer(typingctx, out, out_at, buf, at):
        if not (isinstance(out, types.Array) and out.dtype in (types.float32, types.float64)):
            return None

        def codegen(context, builder, sig, args):
            dst = context.make_array(sig.args[0])(context, builder, args[0])
            raw = context.make_array(sig.args[2])(context, builder, args[2])
            values = _emit_quant_block(builder, builder.gep(raw.data, [args[3]]), fmt)
            elem = context.get_value_type(sig.args[0].dtype)
            if elem != ir.FloatType():
                values = builder.fpext(values, ir.VectorType(elem, QUANT_BLOCK))
            ptr = builder.bitcast(builder.gep(dst.data, [args[1]]), ir.VectorType(elem, QUANT_BLOCK).as_pointer())
            builder.store(values, ptr, align=4)
            return context.get_dummy_value()
        return types.void(out, out_at, buf, at), codegen
    typer.__name__ = f"_widen_{fmt}_block"
    return intrinsic(typer)


_widen_q8_0_block, _widen_q4_0_block, _widen_int8_block, _widen_int4_block = map(
    _quant_block_intrinsic, QUANT_FORMATS)


@jit(inline=True)  # (inlined: its IR is made when its caller compiles, for the CPU then in force)
def _rows_quantized(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    """The tile loop of the quantised formats (``QUANT_FORMATS``; unit
    stride, ``stride`` unused): row ``t`` starts at byte ``base + t *
    seq_stride``.  q8_0 / q4_0 blocks widen to
    ``d * code`` (exact in float32: 8 bits times float16's 11); int8 / int4
    to the code itself, 32 at a time by the block intrinsics, the rest of a
    row one by one.  (A numba loop over a block with unsigned indices: 13
    ns a row of 128 q8_0 codes; with the literal 32 LLVM unrolled it and
    left it scalar, 57 ns.)"""
    out = _as_flat(dst)
    codes = _view(buf, np.int8)  # (out of the loops: a view made in them cost a reference count a row)
    w = np.uint64(width)
    blocks = width // QUANT_BLOCK
    block_bytes = np.uint64(2 + QUANT_BLOCK if code == Q8_0 else 2 + QUANT_BLOCK // 2 if code == Q4_0
                            else QUANT_BLOCK if code == INT8 else QUANT_BLOCK // 2)
    lanes = np.uint64(QUANT_BLOCK)
    for t in range(n):
        at = np.uint64(base + t * seq_stride)
        row = np.uint64(r0 + t) * w
        for k in range(blocks):
            o, first = at + np.uint64(k) * block_bytes, row + np.uint64(k) * lanes
            if code == Q8_0:
                _widen_q8_0_block(out, first, buf, o)
            elif code == Q4_0:
                _widen_q4_0_block(out, first, buf, o)
            elif code == INT8:
                _widen_int8_block(out, first, buf, o)
            else:
                _widen_int4_block(out, first, buf, o)
        done = blocks * QUANT_BLOCK
        if done < width:  # int8 / int4 rows of a head size 32 does not divide
            for c in range(done, width):
                if code == INT8:
                    out[row + np.uint64(c)] = codes[at + np.uint64(c)]
                else:
                    byte = np.int32(buf[at + np.uint64(c // 2)])
                    out[row + np.uint64(c)] = ((byte >> 4) if c % 2 else (byte & 15)) - 8


@jit(inline=True)
def _tile_origin(j0, b, hk, desc, t):
    """``(at, ld)``: key ``j0 + j``'s row of tensor ``t`` starts at element
    ``at + j * ld`` of its buffer."""
    at = desc[t, BASE] + b * desc[t, STRIDE_B] + hk * desc[t, STRIDE_H] + j0 * desc[t, STRIDE_S]
    return at, desc[t, STRIDE_S]


@jit(inline=True)
def _kv_tile(scratch, tile, j0, n, width, b, hk, buf, desc, t, table, formats, loops, acc_code):
    """Keys ``j0 .. j0 + n`` of kv head ``hk`` from tensor ``t`` as ``(bytes,
    at, ld, code, in_place, failed)``: key ``j``'s row is the ``width``
    elements of dtype ``code`` from element ``at + j * ld`` of ``bytes``.
    The buffer itself where the wrapper says the kernel reads its rows in
    place (``desc``'s ``IN_PLACE_ROWS``: ``format_loops.read_in_place``);
    else ``scratch``, whose accumulation-dtype view ``tile`` is filled by
    widening (``failed``: 1 where that failed, ``simd._run``)."""
    base, seq_stride = _tile_origin(j0, b, hk, desc, t)
    if desc[t, IN_PLACE_ROWS]:
        return buf, base, seq_stride, desc[t, DTYPE], True, 0
    first_row = j0 - j0  # an int64, not the literal 0
    failed = _widen_rows_of(loops, _as_rows(tile[:n * width], width), first_row, n, width, buf, desc[t, DTYPE],
                            base, seq_stride, desc[t, STRIDE_D], table, formats)
    return scratch, first_row, width, acc_code, False, failed
