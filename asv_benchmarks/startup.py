"""Start-up costs in a fresh interpreter (``timeraw_``): ``import numkv``, and
the first call of each op, which compiles its kernels.

``"compile"`` sets ``NUMKV_CACHE=0`` in the child so numba compiles from
scratch; ``"disk cache"`` lets numba load the kernels its on-disk cache holds
(``setup`` fills that cache first).  Only the first call is timed: the imports
(numkv, numpy) happen in the child's setup; numba itself is imported by the
first call, as it is for a user.
"""

import os
import subprocess
import sys
import textwrap

from ._common import numkv_attention

_INPUTS = {
    # A decode step's cache append: one token per row, in place.
    "tensor_scatter": (
        "cache = np.zeros((4, 8, 4096, 128), np.float32)\n"
        "new = np.ones((4, 8, 1, 128), np.float32)\n"
        "rows = np.array([0, 10, 20, 30])\n",
        "numkv.tensor_scatter(cache, new, rows, out=cache)",
    ),
    # A decode step: 32 query heads over 8 K/V heads, 1024 keys.
    "attention": (
        "q = np.ones((1, 32, 1, 128), np.float32)\n"
        "k = np.ones((1, 8, 1024, 128), np.float32)\n",
        "numkv.attention(q, k, k)",
    ),
}


def timeraw_import_numkv():
    """``import numkv`` (numpy already imported): must stay cheap, compiles nothing."""
    return "import numkv", "import numpy"


timeraw_import_numkv.repeat = (3, 10, 20.0)


class FirstCall:
    params = [list(_INPUTS), ["compile", "disk cache"]]
    param_names = ["call", "kernels"]
    number = 1
    repeat = (1, 3, 60.0)  # a sample is a new interpreter and a compile: seconds
    timeout = 600

    def setup(self, call, kernels):
        if call == "attention":
            numkv_attention()  # skip until numkv.attention exists
        if kernels == "disk cache":
            # Fill numba's disk cache with exactly the specialisation timed below.
            stmt, setup = self.timeraw_first_call(call, kernels)
            subprocess.run([sys.executable, "-c", setup + "\n" + stmt], check=True,
                           env=dict(os.environ, NUMKV_CACHE="1"))

    def timeraw_first_call(self, call, kernels):
        inputs, stmt = _INPUTS[call]
        env = "import os\nos.environ['NUMKV_CACHE'] = '%s'\n" % ("0" if kernels == "compile" else "1")
        setup = env + "import numpy as np\nimport numkv\n" + inputs
        return stmt, textwrap.dedent(setup)
