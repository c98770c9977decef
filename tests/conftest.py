"""Shared fixtures: a seeded rng, the dtype lists, the cache kinds, the hypothesis profile."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import settings

settings.register_profile("numkv", deadline=None, max_examples=40, derandomize=True)
settings.load_profile("numkv")

ML_DTYPES = [
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float4_e2m1fn, ml_dtypes.int4, ml_dtypes.uint4,
]
NUMPY_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
]
# Every dtype tensor_scatter takes; strings as fixed-width 'U' and as objects.
SCATTER_DTYPES = [np.dtype(t) for t in NUMPY_DTYPES + ML_DTYPES] + [np.dtype("U5"), np.dtype(object)]
FLOAT8_DTYPES = [np.dtype(t) for t in ML_DTYPES[1:6]]
# The cache kinds: a DynamicKVCache, a StaticKVCache in each mode.
KINDS = ("dynamic", "static", "circular")


@pytest.fixture
def rng():
    return np.random.default_rng(20261121)


@pytest.fixture(autouse=True)
def _no_kept_plans():
    """Every test starts with nothing kept by attention calls
    (``_attention._plans``, ``_layouts``, ``_checks``, ``_step_plans``): what
    a test leaves could hide what the next one changes."""
    from numkv import _attention

    _attention._plans.clear()
    _attention._layouts.clear()
    _attention._checks.clear()
    _attention._step_plans.clear()


def random_bits(rng, shape, dtype):
    """Random values of any dtype, built from random bits (NaN payloads, -0.0
    and every other pattern included) or random strings."""
    dtype = np.dtype(dtype)
    if dtype.kind == "U":
        return np.array(["".join(rng.choice(list("abcxyz"), 5)) for _ in range(int(np.prod(shape)))],
                        dtype=dtype).reshape(shape)
    if dtype.kind == "O":
        return random_bits(rng, shape, "U5").astype(object)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    arr = raw.view(dtype).reshape(shape)
    if dtype in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4), np.dtype(ml_dtypes.float4_e2m1fn)):
        arr = (raw & 0x0F).view(dtype).reshape(shape)  # 4-bit types keep the high nibble zero
    return arr


def same_bits(a, b):
    """Bit-exact equality (object arrays: element equality)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == "O":
        return bool((a == b).all())
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
