"""float32 -> float16, for a float16 Y: the CPU's F16C conversion
(``vcvtps2ph``, eight at a time), round to nearest even as NumPy's ``astype``
(which converts one element at a time in software here: 5 ns an element,
11 ms of a 40 ms float16 causal prefill at S=512; this: ~0.1 ns).
"""

import functools

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .._config import jit

CHUNK = 1 << 16  # elements a work item


@functools.cache
def _target_features():
    from numba.core.registry import cpu_target

    features = getattr(cpu_target.target_context.codegen(), "_tm_features", "") or ""
    return frozenset(features.split(","))


def has_f16c():
    """Whether numba compiles for a CPU with F16C (the only target
    ``to_float16`` is for: elsewhere LLVM would call a runtime helper)."""
    return "+f16c" in _target_features()


def has_vbmi():
    """Whether numba compiles for a CPU with AVX-512 VBMI: byte permutes
    across a whole register (``vpermi2b``), a 128-entry byte table a
    lookup (AMD Zen 4 on; Intel's Ice Lake and later server chips)."""
    return {"+avx512f", "+avx512bw", "+avx512vbmi"} <= _target_features()


@intrinsic
def _half_bits(typingctx, x):
    """The float16 bit pattern nearest ``x`` (float32)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@jit()
def to_float16(first, stop, src, dst):
    """``dst = float16 bits of src`` (both flat), chunks ``first .. stop``."""
    for c in range(first, stop):
        for i in range(np.uint64(c * CHUNK), np.uint64(min(src.size, (c + 1) * CHUNK))):
            dst[i] = _half_bits(src[i])
