"""The attention kernel's widening of narrow floats, for every bit pattern.

The kernel widens float16, bfloat16 and the float8s with bit arithmetic (and
F16C's conversion where the CPU has it; float8_e4m3fn in decode's passes of
four query rows by a byte table, where the CPU has AVX-512 VBMI); the
decode tables built from
ml_dtypes itself (``_dtypes.decode_table``) are the exact reference.  Every
pattern must give the same float32 bits (any NaN for a NaN).

Which code the IR generators emit depends on the CPU (``numkv._kernels.cpu``);
the tests force each choice (``cpu.forcing``) around a fresh dispatcher, so
that both paths compile on any CPU and run where the CPU can run them: the
paths without F16C or VBMI run everywhere, VBMI's only where the CPU has it
(elsewhere its code is only compiled, for a CPU that has it, and read).
"""

import ml_dtypes
import numpy as np
import pytest

import numkv
from numkv import _attention, _config
from numkv._dtypes import decode_table, e8m0_table, kernel_dtype_codes
from numkv._kernels import attention as kernels
from numkv._kernels import cpu, decode_loops, widen

NARROW = ["float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
          "float8_e8m0fnu"]


# CPU feature choices the tests force: name -> ``cpu.forcing`` arguments.
FORCED = {"no-f16c": {"f16c": False}, "no-vbmi": {"vbmi": False}, "vbmi": {"vbmi": True}}


def runnable(forced):
    """Skip a forced choice the CPU cannot run (a feature it lacks, forced on)."""
    for feature, on in forced.items():
        if on and not {"f16c": cpu.has_f16c, "vbmi": cpu.has_vbmi}[feature]():
            pytest.skip(f"this CPU lacks {feature}: its code cannot run here (test_forced_features_compile_anywhere "
                        "compiles it for a CPU that has it)")


# The tile loop of each narrow dtype (``loop_functions`` compiles it into the
# C function that widens that dtype's rows).
TILE_LOOPS = {"float16": widen._rows_float16, "bfloat16": widen._rows_bfloat16, "float8_e4m3fn": widen._rows_e4m3fn,
              "float8_e4m3fnuz": widen._rows_fnuz, "float8_e5m2": widen._rows_e5m2,
              "float8_e5m2fnuz": widen._rows_fnuz, "float8_e8m0fnu": widen._rows_e8m0}


def widened(dtype, patterns, stride=1, kernel=None):
    """``patterns`` (unsigned bits of ``dtype``) through the tile loop of
    ``dtype`` (``TILE_LOOPS``; or ``kernel``, a dispatcher of the same
    function), as a (1, n) row read with element ``stride``."""
    codes = kernel_dtype_codes(kernels.DTYPE_CODES)
    n = patterns.size
    spread = np.zeros(n * stride, patterns.dtype)
    spread[::stride] = patterns
    out = np.full((1, n), -1.0, np.float32)
    (kernel or TILE_LOOPS[dtype.name])(out, np.int64(0), np.int64(1), np.int64(n), spread.view(np.uint8),
                                              codes[dtype], np.int64(0), np.int64(n * stride), np.int64(stride),
                                              e8m0_table(), kernels.FORMAT_TABLE)
    return out[0]


def assert_same_floats(got, want):
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), f"NaN differs at patterns {np.flatnonzero(np.isnan(got) != nan)[:8]}"
    bad = np.flatnonzero(got[~nan].view(np.uint32) != want[~nan].view(np.uint32))
    assert bad.size == 0, f"{bad.size} patterns differ, e.g. {np.flatnonzero(~nan)[bad[:8]]}"


@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("stride", [1, 3], ids=["contiguous", "strided"])
def test_every_bit_pattern_widens_exactly(name, stride):
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    patterns = np.arange(1 << (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}")
    assert_same_floats(widened(dtype, patterns, stride), decode_table(dtype))


@pytest.mark.parametrize("name", ["float16", "float8_e4m3fn", "float8_e5m2"])
def test_every_bit_pattern_widens_exactly_without_f16c(name):
    """The tiles' loops as compiled for a CPU without F16C (float16-based
    formats then widen by bit arithmetic, ``widen._emit_decode``): a fresh
    dispatcher, compiled with F16C forced off, runs on any CPU."""
    from numba import njit

    dtype = np.dtype(getattr(ml_dtypes, name, name))
    patterns = np.arange(1 << (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}")
    kernel = njit(TILE_LOOPS[dtype.name].py_func)
    with cpu.forcing(f16c=False):
        got = widened(dtype, patterns, 1, kernel)
    assert_same_floats(got, decode_table(dtype))
    llvm = kernel.inspect_llvm(kernel.signatures[0])
    assert "fpext" not in llvm and " half" not in llvm, "F16C's conversion compiled in where it was forced off"


@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_the_arithmetic_decode_matches_the_tables(name):
    """``_decode_bits`` with each row of ``FORMAT_TABLE``: the fnuz float8s'
    loop (the other formats have loops of their own, and no row)."""
    from numba import njit

    dtype = np.dtype(getattr(ml_dtypes, name, name))
    code = kernel_dtype_codes(kernels.DTYPE_CODES)[dtype]
    sign = np.uint32(0x8000 if dtype.itemsize == 2 else 0x80)

    @njit
    def decode_all(patterns, formats, out):
        shift, scale, infnan, nan_em, nan_x = widen._format(formats, code)
        for i in range(patterns.size):
            out[i] = widen._decode_bits(patterns[i], sign, shift, scale, infnan, nan_em, nan_x)

    patterns = np.arange(1 << (8 * dtype.itemsize), dtype=np.uint32)
    out = np.empty(patterns.size, np.float32)
    decode_all(patterns, kernels.FORMAT_TABLE, out)
    assert_same_floats(out, decode_table(dtype))


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("length", [64, 16, 3], ids=["blocks", "vectors", "tail"])
@pytest.mark.parametrize("forced", FORCED, ids=list(FORCED))
def test_decode_loops_widen_every_pattern_exactly(name, length, forced):
    """Decode reads these caches in place, widening each element as it is
    used: ``_axpy`` (the value update) and ``_dots`` (the scores), both in
    vector lanes over whole vectors (float8_e4m3fn in blocks of 64 before,
    in passes of four rows, where the CPU has byte permutes), then element
    by element.  Each loop runs as one row and as four rows, with four
    keys.  The value update adds each pattern with weight 1 to zeros (four
    keys: the pattern's row, then three rows of zeros); for the scores key
    ``j`` holds pattern ``j`` first and zeros after, and every query row is
    ``(1, 0, ...)``: either way each result is the pattern's value (plus
    zeros: -0.0 becomes 0.0).  Compiled with each CPU choice forced
    (``FORCED``): without F16C the float16-based formats go element by
    element; with VBMI float8_e4m3fn takes blocks of 64 by a byte table."""
    from numba import njit

    runnable(FORCED[forced])

    dtype = np.dtype(getattr(ml_dtypes, name, name))
    code = kernel_dtype_codes(kernels.DTYPE_CODES)[dtype]
    patterns = np.arange(1 << (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}")

    @njit  # ``code`` a constant of it, as in loop_functions' functions: the loops of that format only
    def widen_all(v_rows, keys, q, values, scores, ones, q_rows):
        width = np.uint64(q.size)
        whole = values.shape[1] // 4
        zero = np.uint64(0)
        for j in range(0, whole, q.size):  # four rows of V from element 4 j: the patterns, then zeros
            at, stride = np.uint64(j), np.uint64(whole)
            decode_loops._axpy(values[0], (at,), ones, (zero,), v_rows, 4 * at, width, zero, 4, q.size, code)
            decode_loops._axpy(values[1], (at, at + stride, at + stride + stride, at + stride + stride + stride), ones,
                          (zero, zero, zero, zero), v_rows, 4 * at, width, zero, 4, q.size, code)
        n = np.uint64(scores.shape[1] // 4)  # scores[1]: four rows of n
        for j in range(0, scores.shape[1] // 4, 4):
            k_at = (np.uint64(j) * width, np.uint64(j + 1) * width, np.uint64(j + 2) * width,
                    np.uint64(j + 3) * width)
            at = np.uint64(j)
            decode_loops._dots(scores[0], (at,), 4, q, (np.uint64(0),), keys, k_at, q.size, code, zero)
            decode_loops._dots(scores[1], (at, at + n, at + n + n, at + n + n + n), 4, q, q_rows, keys, k_at, q.size,
                          code, zero)

    keys = np.zeros((patterns.size, length), patterns.dtype)
    keys[:, 0] = patterns
    q = np.zeros(length, np.float32)
    q[0] = 1.0
    whole = patterns.size - patterns.size % length  # values: in rows of ``length``
    values = np.zeros((2, 4 * whole), np.float32)  # one row; four rows
    scores = np.full((2, 4 * patterns.size), -1.0, np.float32)  # one row; four rows
    v_rows = np.zeros((whole // length, 4, length), patterns.dtype)  # each row of patterns, three of zeros
    v_rows[:, 0] = patterns[:whole].reshape(-1, length)
    with cpu.forcing(**FORCED[forced]):  # compiles widen_all, a fresh dispatcher
        widen_all(v_rows.reshape(-1).view(np.uint8), keys.reshape(-1).view(np.uint8), q, values, scores,
                  np.ones(4, np.float32), (np.uint64(0),) * 4)
    llvm = widen_all.inspect_llvm(widen_all.signatures[0])
    # the choice forced is the code compiled: the blocks' byte table, F16C's conversion
    assert ("vpermi2var" in llvm) == (forced == "vbmi" and name == "float8_e4m3fn")
    if forced == "no-f16c":
        assert "fpext" not in llvm
    elif name != "bfloat16" and cpu.has_f16c():  # (a vector of the loops: one register, ``decode_loops``)
        assert f"fpext <{decode_loops.VECTOR_BYTES // 4} x half>" in llvm
    with np.errstate(invalid="ignore"):  # signalling NaNs
        want = decode_table(dtype) + np.float32(0.0)
    assert_same_floats(values[0, :whole], want[:whole])
    for r in range(4):
        assert_same_floats(values[1, r * whole:(r + 1) * whole], want[:whole])
    assert_same_floats(scores[0, :patterns.size], want)
    for r in range(4):
        assert_same_floats(scores[1, r * patterns.size:(r + 1) * patterns.size], want)


def test_forced_features_compile_anywhere():
    """The IR of the paths a CPU may lack -- float8_e4m3fn's blocks by
    ``vpermi2b`` (AVX-512 VBMI), float16 vectors by ``vcvtph2ps`` (F16C) --
    compiled, on any x86-64 host, for a CPU that has them: the code the
    generators emit selects those instructions.  (Running it needs the CPU:
    test_decode_loops_widen_every_pattern_exactly[vbmi-...] does where it can.)"""
    import platform

    import llvmlite.binding as llvm
    import numba  # noqa: F401  (initialises llvmlite's targets)
    from llvmlite import ir

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 instructions")
    module = ir.Module("forced")
    module.triple = llvm.get_process_triple()
    i8, i16, f32 = ir.IntType(8), ir.IntType(16), ir.FloatType()
    for name, arg, widen_ir in (
            ("e4m3fn_block", ir.VectorType(i8, 64), widen._widen_e4m3fn_block),
            ("f16_vector", ir.VectorType(i16, 16), lambda b, x: [widen._widen_ir(b, x, "f16", True)])):
        out = ir.VectorType(f32, 16)
        fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [arg.as_pointer(), out.as_pointer()]), name)
        builder = ir.IRBuilder(fn.append_basic_block())
        for t, value in enumerate(widen_ir(builder, builder.load(fn.args[0]))):
            builder.store(value, builder.gep(fn.args[1], [ir.Constant(ir.IntType(64), t)]))
        builder.ret_void()
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    machine = llvm.Target.from_triple(module.triple).create_target_machine(
        cpu="x86-64", features="+avx512f,+avx512bw,+avx512vbmi,+f16c", opt=2)
    asm = machine.emit_assembly(parsed)
    assert "vpermi2b" in asm or "vpermt2b" in asm
    assert "vcvtph2ps" in asm


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                                  "float8_e5m2fnuz"])
def test_decode_on_a_narrow_cache_equals_its_float32_copy(name, rng):
    """Decode reads a narrow cache in place (the fnuz float8s through float32
    tiles); its output must be bit-identical to the same cache widened to
    float32 first, which decode reads in place."""
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    q = rng.standard_normal((2, 8, 1, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 300, 64)).astype(dtype)
    v = (4 * rng.standard_normal((2, 2, 300, 64))).astype(dtype)
    mask = np.ones((2, 1, 1, 300), bool)
    mask[0, ..., 100:140] = mask[1, ..., ::7] = False  # masked keys inside tiles
    for kwargs in ({}, {"is_causal": True}, {"nonpad_kv_seqlen": np.array([300, 77])}, {"attn_mask": mask}):
        got = numkv.attention(q, k, v, **kwargs)
        want = numkv.attention(q, k.astype(np.float32), v.astype(np.float32), **kwargs)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_a_narrow_cache_read_in_place_equals_its_tiles(name, rng):
    """Decode reads unit-stride narrow rows in place; rows whose elements lie
    apart are widened into float32 tiles first.  The bits must not differ."""
    dtype = np.dtype(getattr(ml_dtypes, name, name))
    q = rng.standard_normal((1, 8, 1, 80)).astype(np.float32)  # 80: a block of 64, a vector of 16
    k, v = (rng.standard_normal((1, 2, 300, 80)).astype(dtype) for _ in range(2))
    mask = np.ones((1, 1, 1, 300), bool)
    mask[..., 100:140] = False
    k_apart, v_apart = (np.repeat(x, 2, axis=-1)[..., ::2] for x in (k, v))  # d stride 2
    for kwargs in ({}, {"attn_mask": mask}):
        np.testing.assert_array_equal(numkv.attention(q, k_apart, v_apart, **kwargs),
                                      numkv.attention(q, k, v, **kwargs))


# -- and back: a float16 Y -----------------------------------------------------------


def test_float16_y_narrowing_equals_numpys_cast(monkeypatch):
    # Every float16 result: all float32 patterns whose top 19 bits vary, with
    # low bits at the rounding boundaries (ties, just below, just above), and
    # the quiet NaNs (a signalling NaN never comes out of the kernel).
    top = np.arange(1 << 19, dtype=np.uint32) << 13
    x = np.concatenate([top | low for low in (0, 0xFFF, 0x1000, 0x1001, 0x1FFF)]).view(np.float32)
    x = x[~np.isnan(x) | ((x.view(np.uint32) & 0x00400000) != 0)]
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    ran = spy_on_kernels(monkeypatch)
    got = _attention._to_float16(x)
    # where the CPU lacks F16C the wrapper casts with NumPy, and this test compares NumPy with itself
    assert ran == (["to_float16"] if cpu.has_f16c() else [])
    assert got.dtype == np.float16 and got.shape == x.shape
    bad = np.flatnonzero(got.view(np.uint16) != want.view(np.uint16))
    assert bad.size == 0, f"{bad.size} differ, e.g. float32 bits {x[bad[:4]].view(np.uint32)}"


def test_float16_prefill_takes_the_narrowing_kernel(monkeypatch):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 160, 128)).astype(np.float16)
    k = rng.standard_normal((1, 2, 160, 128)).astype(np.float16)
    v = rng.standard_normal((1, 2, 160, 128)).astype(np.float16)
    assert q.size >= _config.NARROW_MIN
    ran = spy_on_kernels(monkeypatch)
    narrowed = numkv.attention(q, k, v, is_causal=True)
    assert ran.count("to_float16") == (1 if cpu.has_f16c() else 0), ran
    ran.clear()
    monkeypatch.setattr(_config, "NARROW_MIN", q.size + 1)
    assert np.array_equal(numkv.attention(q, k, v, is_causal=True).view(np.uint16), narrowed.view(np.uint16))
    assert "to_float16" not in ran, ran


def spy_on_kernels(monkeypatch):
    """The names of the kernels the wrapper runs on its pool, as they run."""
    ran, run = [], _attention.pool.run
    monkeypatch.setattr(_attention.pool, "run", lambda kernel, *a, **kw: ran.append(kernel.__name__) or run(kernel, *a, **kw))
    return ran
