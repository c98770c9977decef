"""Peak memory of a long causal prefill, against an empty reference.

``peakmem_`` reports the process's peak RSS, which includes the interpreter,
numba, the compiled kernels and the inputs.  ``peakmem_reference`` does
everything ``peakmem_attention`` does except the call: the same setup (a small
warm-up call, the kernels loaded from numba's disk cache in both) and an
output-sized array written once.  The difference is what attention needs
beyond its inputs and Y: a blocked kernel needs O(threads x block);
materialising the (8, 8192, 8192) float32 score matrix would need 2 GiB.

With ``NUMKV_BENCH_QUICK=1`` (the smoke test) the sequence is 1024, not 8192.
"""

import subprocess
import sys

import numpy as np

from ._common import QUICK, numkv_attention, randn

BATCH, HEADS, HEAD_SIZE = 1, 8, 64
SEQ_LEN = 1024 if QUICK else 8192
_WARM_UP = (
    "import numpy as np, numkv\n"
    f"q = np.ones(({BATCH}, {HEADS}, 64, {HEAD_SIZE}), np.float32)\n"
    "numkv.attention(q, q, q, is_causal=True)\n"
)


class CausalPrefillMemory:
    """Causal self-attention, batch 1, 8 heads of 64, Sq = Skv = 8192, float32."""

    def setup(self):
        attention = numkv_attention()
        # Both benchmarks must start from the same state, but whichever runs
        # first would compile (~70 MB more peak RSS than loading): fill numba's
        # disk cache in a child first, so both load (or, with NUMKV_CACHE=0,
        # both compile).
        subprocess.run([sys.executable, "-c", _WARM_UP], check=True)
        small = np.ones((BATCH, HEADS, 64, HEAD_SIZE), np.float32)
        attention(small, small, small, is_causal=True)  # outside the measurement
        shape = (BATCH, HEADS, SEQ_LEN, HEAD_SIZE)
        self.attention = attention
        self.q = randn(shape, seed=1)
        self.k = randn(shape, seed=2, scale=HEAD_SIZE ** -0.25)
        self.v = randn(shape, seed=3)

    def peakmem_attention(self):
        self.attention(self.q, self.k, self.v, is_causal=True)

    def peakmem_reference(self):
        y = np.empty_like(self.q)
        y.fill(0.0)  # touch every page, as the kernel's output would
