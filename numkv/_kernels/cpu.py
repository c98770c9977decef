"""What the CPU numba compiles for can do: the feature tests the IR
generators consult while they compile (never at run time).

Each answer can be forced for tests (``forcing``), so that both code paths
-- with and without F16C, AVX-512 VBMI, AVX-512 -- compile on any CPU, and
run where the CPU has what the forced path uses.
"""

import contextlib
import functools

_forced = {}


@functools.cache
def _target_features():
    from numba.core.registry import cpu_target

    features = getattr(cpu_target.target_context.codegen(), "_tm_features", "") or ""
    return frozenset(features.split(","))


def has_f16c():
    """Whether numba compiles for a CPU with F16C (``vcvtph2ps``,
    ``vcvtps2ph``: eight float16s converted at a time; elsewhere LLVM would
    call a runtime helper one element at a time)."""
    if "f16c" in _forced:
        return _forced["f16c"]
    return "+f16c" in _target_features()


def has_vbmi():
    """Whether numba compiles for a CPU with AVX-512 VBMI: byte permutes
    across a whole register (``vpermi2b``), a 128-entry byte table a
    lookup (AMD Zen 4 on; Intel's Ice Lake and later server chips)."""
    if "vbmi" in _forced:
        return _forced["vbmi"]
    return {"+avx512f", "+avx512bw", "+avx512vbmi"} <= _target_features()


def has_avx512():
    """Whether numba compiles for a CPU with AVX-512 (32 vector registers of
    64 bytes; else AVX2's 16 of 32 bytes): the register block of the tile
    products (``gemm``)."""
    if "avx512" in _forced:
        return _forced["avx512"]
    return "+avx512f" in _target_features()


@contextlib.contextmanager
def forcing(**features):
    """Within the block, ``has_f16c()`` answers ``features["f16c"]``,
    ``has_vbmi()`` ``features["vbmi"]`` and ``has_avx512()``
    ``features["avx512"]`` (those given).  For tests, around
    the compilation of a *fresh* dispatcher without a disk cache (e.g.
    ``numba.njit(kernel.py_func)``): a cached kernel compiled inside would
    keep the forced choice on disk.  Machine code that uses a feature the CPU
    lacks must not run (nor, for AVX-512, be made into machine code by an
    LLVM that targets the CPU: read its LLVM IR)."""
    unknown = set(features) - {"f16c", "vbmi", "avx512"}
    if unknown:
        raise ValueError(f"unknown CPU features {sorted(unknown)}")
    saved = dict(_forced)
    _forced.update(features)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
