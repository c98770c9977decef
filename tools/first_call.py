"""Wall time of a fresh process's first ``numkv.attention`` call, per input kind.

    for kind in float32 bfloat16 q8_0 float64 prefill; do
        NUMBA_CACHE_DIR=$(mktemp -d) python tools/first_call.py $kind
    done

Run each kind in a fresh process with an empty numba cache (else nothing
compiles).  Q ``(1, 32, 1, 128)`` over 1024 keys (``prefill``: 512 causal
queries); ``KIND`` is a K/V dtype (ml_dtypes names too), a quantised format
(``q8_0``, ``q4_0``, ``int8``, ``int4``), ``float64`` (Q too) or ``prefill``.
The figures are in docs/compile-time.md.
"""

import sys
import time

start = time.time()
import numpy as np  # noqa: E402

import numkv  # noqa: E402

kind = sys.argv[1] if len(sys.argv) > 1 else "float32"
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 32, 1, 128), dtype=np.float32)
k = rng.standard_normal((1, 8, 1024, 128), dtype=np.float32)
kwargs = {}
if kind == "prefill":
    q, k, kwargs = rng.standard_normal((1, 32, 512, 128), dtype=np.float32), k[:, :, :512], {"is_causal": True}
elif kind == "float64":
    q, k = q.astype(np.float64), k.astype(np.float64)
elif kind in ("q8_0", "q4_0"):
    k = numkv.quantize(k, kind)
elif kind in ("int8", "int4"):
    k = numkv.quantize(k, kind, scale=np.full(128, 0.05, np.float32))
elif kind != "float32":
    import ml_dtypes

    k = k.astype(getattr(ml_dtypes, kind, kind))
ready = time.time()
numkv.attention(q, k, k, **kwargs)
print(f"{kind:14s} first call {time.time() - ready:5.2f} s (import and inputs {ready - start:.2f} s)")
