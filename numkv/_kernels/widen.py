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
and its ``_rows_*`` loop for the tile path (``loop_functions`` picks it).  The
quantised formats (``numkv._formats``' records: codes with scales) are read
by IR built from their record's fields (``_load_quantized``, and 32 at a
time ``_emit_quant_block``): a new one is its record, nothing here.

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

from .. import _formats
from .._config import jit
from .cpu import has_f16c, has_vbmi
from .layout import (BASE, BF16, DTYPE, E4M3FN, E5M2, F16, F32, F64, FIRST_QUANT, IN_PLACE_ROWS, INFNAN_EM, NAN_BITS,
                     NAN_EM, NONE, Q_BLOCK, Q_BLOCK_BYTES, Q_RUN_BYTES, QUANT_BLOCK, QUANT_TABLE, SCALE_EXPONENT,
                     SHIFT, STRIDE_B, STRIDE_D, STRIDE_H, STRIDE_S, WIDEN)
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
    elements, where bit arithmetic (``_widen_e4m3fn``) takes ~9 for 16
    (decode at Skv=16384 on 2 threads: 0.56-0.60x float32's time, against
    0.65x; the log: docs/performance.md, "Figures moved out of the code")."""
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


def _nibbles(builder, packed, order, high=None):
    """IR: the 4-bit codes (still biased) in the bytes ``packed`` (``i8`` or
    a vector of them) -- the one nibble decoder of the kernels (NumPy's:
    ``_formats.unpack_nibbles``).  With ``high`` (an ``i1``, or a vector of
    them): each byte's high nibble where it is set, else its low one (the
    elements of one half of a block, or one element of a pair).  Without:
    every nibble of the vector, in element order -- ``order`` ``"halves"``
    (all low nibbles, then all high: llama.cpp's blocks) or ``"pairs"``
    (each byte's low, then its high: onnxruntime's int4).  Both nibbles by
    constant shifts, then a select or a shuffle: x86 has no byte shift by a
    variable amount (LLVM widens it)."""
    ty = packed.type
    low, upper = builder.and_(packed, _splat(ty, 15)), builder.lshr(packed, _splat(ty, 4))
    if high is not None:
        return builder.select(high, upper, low)
    n = ty.count
    picks = list(range(2 * n)) if order == "halves" else [i // 2 + n * (i % 2) for i in range(2 * n)]
    return builder.shuffle_vector(low, upper, ir.Constant(ir.VectorType(ir.IntType(32), 2 * n), picks))


def _block_header(builder, src, f, width, convert_vector=True):
    """IR: ``(scale, minimum)`` of the block of format ``f`` whose first byte
    is ``src`` (the float16s heading it, as float32 -- vectors of ``width``
    lanes for ``width > 1`` -- ``minimum`` None without one); ``(None,
    None)`` for a given-scale format (its scale is folded into Q / Y).
    ``convert_vector``: with F16C, the bits are broadcast and converted as
    a vector (decode's loads: one instruction); else converted, then
    broadcast (a block of 32 lanes: one conversion, not two)."""
    if not f.derived:
        return None, None
    i16 = ir.IntType(16)
    parts = []
    for offset in range(0, f.header, 2):
        bits = builder.load(builder.bitcast(builder.gep(src, [ir.Constant(ir.IntType(64), offset)]),
                                            i16.as_pointer()), align=1)
        if width > 1 and convert_vector and has_f16c():  # the bits in every lane, then F16C's conversion
            bits = _broadcast(builder, bits, width)
        value = _widen_ir(builder, bits, "f16", has_f16c())
        if width > 1 and not isinstance(value.type, ir.VectorType):
            value = _broadcast(builder, value, width)
        parts.append(value)
    return parts[0], parts[1] if f.minimum else None


def _scaled(builder, codes, f, scale, minimum):
    """IR: the integer ``codes`` (stored, ``i8``) of format ``f`` as float32:
    less the bias, times ``scale``, plus ``minimum`` (where given)."""
    if f.bias:
        codes = builder.sub(codes, _splat(codes.type, f.bias))
    values = builder.sitofp(codes, _like(codes, ir.FloatType()))
    if scale is not None:
        values = builder.fmul(values, scale)
    if minimum is not None:
        values = builder.fadd(values, minimum)
    return values


def _load_quantized(builder, row, at, width, f, header=None):
    """IR: elements ``at .. at + width`` of the quantised row of bytes ``row``
    (format ``f``, a ``_formats.Format``) as float32: a block format's codes
    times their block's float16 scale (plus its minimum; the block of 32
    holding them: ``at`` is a multiple of ``width``, which divides 16), a
    given-scale format's codes.  ``header``: the block's ``(first code
    byte, element within it, scale, minimum)``, loaded already
    (``_load_quantized_run``)."""
    i8, i64 = ir.IntType(8), ir.IntType(64)
    c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
    vec = (lambda elem: ir.VectorType(elem, width)) if width > 1 else (lambda elem: elem)

    def load(offset, n):
        ty = ir.VectorType(i8, n) if n > 1 else i8
        return builder.load(builder.bitcast(builder.gep(row, [offset]), ty.as_pointer()), align=1)

    def split(selector):  # an i1, set where the elements are high nibbles (one select for the vector)
        return builder.icmp_unsigned("!=", selector, c64(0))

    scale = minimum = None
    if f.derived:
        if header is None:
            block = builder.mul(builder.lshr(at, c64(5)), c64(f.block_bytes))
            scale, minimum = _block_header(builder, builder.gep(row, [block]), f, width)
            within, first = builder.and_(at, c64(QUANT_BLOCK - 1)), builder.add(block, c64(f.header))
        else:
            first, within, scale, minimum = header
        if f.bits == 8:
            codes = load(builder.add(first, within), width)
        else:  # "halves": byte j holds elements j (low nibble) and j + 16 (high)
            packed = load(builder.add(first, builder.and_(within, c64(QUANT_BLOCK // 2 - 1))), width)
            codes = _nibbles(builder, packed, f.nibbles, split(builder.and_(within, c64(QUANT_BLOCK // 2))))
    elif f.bits == 8:
        codes = load(at, width)
    elif width == 1:  # "pairs": byte at // 2, the even element low
        codes = _nibbles(builder, load(builder.lshr(at, c64(1)), 1), f.nibbles, split(builder.and_(at, c64(1))))
    else:
        codes = _nibbles(builder, load(builder.lshr(at, c64(1)), width // 2), f.nibbles)
    return _scaled(builder, codes, f, scale, minimum)


def _load_quantized_run(builder, row, at, width, parts, f):
    """IR: ``parts`` vectors of ``width`` elements from element ``at`` on of
    the quantised row ``row`` (``_load_quantized`` each), a block's scale
    (and minimum) loaded once for the vectors it covers, not once a vector:
    ``at`` is a multiple of ``min(QUANT_BLOCK, parts * width)``.  The values
    are the same."""
    c64 = lambda v: ir.Constant(ir.IntType(64), v)  # noqa: E731
    if not f.derived or width == 1:
        return [_load_quantized(builder, row, builder.add(at, c64(c * width)), width, f) for c in range(parts)]
    out = []
    for c in range(parts):
        element = builder.add(at, c64(c * width))
        if c * width % QUANT_BLOCK == 0:  # the run's first vector, or the first of its next block
            block = builder.mul(builder.lshr(element, c64(5)), c64(f.block_bytes))
            scale, minimum = _block_header(builder, builder.gep(row, [block]), f, width)
            first, within, header_at = builder.add(block, c64(f.header)), builder.and_(element, c64(QUANT_BLOCK - 1)), c
        header = (first, builder.add(within, c64((c - header_at) * width)), scale, minimum)
        out.append(_load_quantized(builder, row, element, width, f, header=header))
    return out


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
    then hand it the row's start and the element index (``widen`` unused);
    ``load_run(builder, row, at, width, parts)``: ``parts`` such vectors on
    from ``at`` (a multiple of ``min(32, parts * width)``), a block's scale
    loaded once (``_load_quantized_run``)."""

    code: int
    bits: int
    widen: Callable
    needs_f16c: bool = False
    block: int = 0
    widen_block: Callable = None
    block_cpu: Callable = None
    load: Callable = None
    load_run: Callable = None


FORMATS = {  # in this order in every loop's switch (``decode_loops._per_format``)
    "bf16": Format(BF16, 16, _widen_bf16),
    "f16": Format(F16, 16, _widen_f16, needs_f16c=True),
    "e4m3fn": Format(E4M3FN, 8, _widen_e4m3fn, needs_f16c=True,
                     block=E4M3FN_BLOCK, widen_block=_widen_e4m3fn_block, block_cpu=has_vbmi),
    "e5m2": Format(E5M2, 8, _widen_e5m2, needs_f16c=True),
    # The quantised formats (``numkv._formats``' records), read by ``_load_quantized``.
    **{name: Format(f.code, 8, None, load=functools.partial(_load_quantized, f=f),
                    load_run=functools.partial(_load_quantized_run, f=f))
       for name, f in _formats.FORMATS.items()},
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


def _load_widened_run(builder, row, at, width, parts, narrow):
    """IR: ``parts`` vectors of ``width`` elements on from ``row[at]``
    (``_load_widened`` each); a quantised format's from its ``load_run``
    (``at``: a multiple of ``min(32, parts * width)``)."""
    if narrow is not None and FORMATS[narrow].load_run is not None:
        return FORMATS[narrow].load_run(builder, row, at, width, parts)
    return [_load_widened(builder, row, builder.add(at, ir.Constant(ir.IntType(64), c * width)), width, narrow)
            for c in range(parts)]


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
    if code >= FIRST_QUANT:
        return width // QUANT_TABLE[code - FIRST_QUANT, Q_BLOCK] * QUANT_TABLE[code - FIRST_QUANT, Q_BLOCK_BYTES]
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
    dtype, by that format's C function (``loop_functions``: ``_prefetch_rows``,
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


def _emit_quant_block(builder, src, f):
    """IR: the ``QUANT_BLOCK`` (32) values of format ``f`` from the ``i8*``
    ``src`` (a block format's block, its scale -- and minimum -- leading
    it; a given-scale format's 32 codes) as a ``<32 x float>``."""
    i8, lanes = ir.IntType(8), QUANT_BLOCK
    scale, minimum = _block_header(builder, src, f, lanes, convert_vector=False)
    src = builder.gep(src, [ir.Constant(ir.IntType(64), f.header)])
    n = lanes * f.bits // 8
    codes = builder.load(builder.bitcast(src, ir.VectorType(i8, n).as_pointer()), align=1)
    if f.bits == 4:
        codes = _nibbles(builder, codes, f.nibbles)
    return _scaled(builder, codes, f, scale, minimum)


@intrinsic(prefer_literal=True)
def _widen_quant_block(typingctx, out, out_at, buf, at, code):
    """``out[out_at:out_at + 32]`` = the 32 elements of format ``code`` (a
    constant) at byte ``at`` of ``buf`` (``_emit_quant_block``), in
    ``out``'s dtype (float32 or float64).  No loop: a vector load, convert
    and store, which a numba loop over a block did not become."""
    if not (isinstance(out, types.Array) and out.dtype in (types.float32, types.float64)
            and isinstance(code, types.IntegerLiteral)):
        return None
    f = _QUANT_BY_CODE[code.literal_value]

    def codegen(context, builder, sig, args):
        dst = context.make_array(sig.args[0])(context, builder, args[0])
        raw = context.make_array(sig.args[2])(context, builder, args[2])
        values = _emit_quant_block(builder, builder.gep(raw.data, [args[3]]), f)
        elem = context.get_value_type(sig.args[0].dtype)
        if elem != ir.FloatType():
            values = builder.fpext(values, ir.VectorType(elem, QUANT_BLOCK))
        ptr = builder.bitcast(builder.gep(dst.data, [args[1]]), ir.VectorType(elem, QUANT_BLOCK).as_pointer())
        builder.store(values, ptr, align=4)
        return context.get_dummy_value()
    return types.void(out, out_at, buf, at, code), codegen


@intrinsic(prefer_literal=True)
def _widen_quant_element(typingctx, buf, at, c, code):
    """The float32 value of element ``c`` of the row of format ``code`` (a
    constant) that starts at byte ``at`` of ``buf`` (``_load_quantized``)."""
    if not isinstance(code, types.IntegerLiteral):
        return None
    f = _QUANT_BY_CODE[code.literal_value]

    def codegen(context, builder, sig, args):
        raw = context.make_array(sig.args[0])(context, builder, args[0])
        as64 = [context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2)]
        return _load_quantized(builder, builder.gep(raw.data, [as64[0]]), as64[1], 1, f)
    return types.float32(buf, at, c, code), codegen


_QUANT_BY_CODE = {f.code: f for f in _formats.FORMATS.values()}


@jit(inline=True)  # (inlined: its IR is made when its caller compiles, for the CPU then in force)
def _rows_quantized(dst, r0, n, width, buf, code, base, seq_stride, stride, table, formats):
    """The tile loop of the quantised formats (``_formats.FORMATS``; unit
    stride, ``stride`` unused; ``code`` a constant): row ``t`` starts at
    byte ``base + t * seq_stride``.  Runs of 32 elements widen at once
    (``_widen_quant_block``: a block format's to ``d * code (+ m)``, exact
    in float32 without a minimum -- 8 bits times float16's 11; a
    given-scale format's to the code itself), the rest of a row (a
    given-scale format's head size that 32 does not divide) one by one.
    (A numba loop over a block with unsigned indices: 13 ns a row of 128
    8-bit codes; with the literal 32 LLVM unrolled it and left it scalar, 57
    ns.)"""
    out = _as_flat(dst)
    w = np.uint64(width)
    runs = width // QUANT_BLOCK
    run_bytes = np.uint64(QUANT_TABLE[code - FIRST_QUANT, Q_RUN_BYTES])
    lanes = np.uint64(QUANT_BLOCK)
    for t in range(n):
        at = np.uint64(base + t * seq_stride)
        row = np.uint64(r0 + t) * w
        for k in range(runs):
            _widen_quant_block(out, row + np.uint64(k) * lanes, buf, at + np.uint64(k) * run_bytes, code)
        for c in range(runs * QUANT_BLOCK, width):
            out[row + np.uint64(c)] = _widen_quant_element(buf, at, c, code)


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
    place (``desc``'s ``IN_PLACE_ROWS``: ``loop_functions.read_in_place``);
    else ``scratch``, whose accumulation-dtype view ``tile`` is filled by
    widening (``failed``: 1 where that failed, ``simd._run``)."""
    base, seq_stride = _tile_origin(j0, b, hk, desc, t)
    if desc[t, IN_PLACE_ROWS]:
        return buf, base, seq_stride, desc[t, DTYPE], True, 0
    first_row = j0 - j0  # an int64, not the literal 0
    failed = _widen_rows_of(loops, _as_rows(tile[:n * width], width), first_row, n, width, buf, desc[t, DTYPE],
                            base, seq_stride, desc[t, STRIDE_D], table, formats)
    return scratch, first_row, width, acc_code, False, failed
