"""The loops LLVM vectorises in numkv's kernels use whole AVX-512 registers
on Intel's CPUs too (``simd._full_width_loops``).

LLVM's tuning for Intel's AVX-512 CPUs prefers 256-bit vectors for the loops
it vectorises; AMD's Zen 4 prefers 512.  numba compiles for the host's CPU
name, so the code an Intel server gets is compiled here by naming its CPU
(``NUMBA_CPU_NAME``; the features stay the host's, so it runs here) in a
fresh process and cache, and its machine code is read.
"""

import os
import re
import subprocess
import sys
import tempfile

import pytest

from numkv._kernels.cpu import has_avx512

pytestmark = pytest.mark.skipif(not has_avx512(), reason="the host has no AVX-512: numba compiles no 512-bit code")

_PROGRAM = """
from numkv._kernels import loop_functions, narrow
from numkv._kernels.layout import F32, GEMM_SOFTMAX, SOFTMAX
import numpy as np
for field in (GEMM_SOFTMAX, SOFTMAX):
    print(loop_functions._compile(0, F32, field)._library.get_asm_str())
narrow.to_float16(0, 1, np.zeros(64, np.float32), np.zeros(64, np.uint16))
print(next(iter(narrow.to_float16.inspect_asm().values())))
"""


@pytest.mark.parametrize("cpu", ["sapphirerapids", "znver4"])
def test_the_softmax_and_the_narrowing_use_whole_avx512_registers(cpu):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CACHE_DIR=cache)
        env.pop("NUMBA_CPU_FEATURES", None)
        asm = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, check=True, capture_output=True,
                             text=True).stdout
    # The exponentials' floor (``vrndscaleps``) in the vectorised loops of
    # both softmaxes, and float16's conversion: on zmm registers, 16 lanes.
    # (With LLVM's Intel tuning and no attribute: only on ymm.)
    assert re.search(r"vrndscaleps\s+\$9, %zmm", asm), "the softmax's exponentials are not on zmm registers"
    assert re.search(r"vcvtps2ph\s+\$\d+, %zmm", asm), "the float16 narrowing is not on zmm registers"
