"""numkv's prefill against an earlier revision of itself, interleaved in one
process, for head-major and token-major layouts.

    python tools/ab_prefill.py REV [THREADS [CASE ...]]
    python tools/ab_prefill.py 785892f 2 full causal-2048 full-3d varlen

REV's ``numkv`` is loaded beside this one as ``numkv_base``
(``ab_decode.load_base``); calls alternate, 11 rounds, medians compared.
Cases (float32, Hq32/Hkv8/D128 unless named): ``full`` (1,024 queries over
1,024 keys), ``full-496``, ``causal-512``, ``causal-2048``, ``full-d64`` (Hq16/Hkv4/D64),
``full-3d`` (``full`` as 3-D ``(B, S, H * D)`` inputs: token-major rows),
``varlen`` (4 causal prompts of 256-1,024 tokens packed, ``(T, H, D)``).
"""

import statistics
import sys
import time

import numpy as np

from ab_decode import ROOT, load_base

CASES = {  # name: (Hq, Hkv, D, S, causal, layout)
    "full": (32, 8, 128, 1024, False, "bhsd"),
    "full-496": (32, 8, 128, 496, False, "bhsd"),  # one tile of 496 keys: 1,984 bytes a K^T row
    "causal-512": (32, 8, 128, 512, True, "bhsd"),
    "causal-2048": (32, 8, 128, 2048, True, "bhsd"),
    "full-d64": (16, 4, 64, 1024, False, "bhsd"),
    "full-3d": (32, 8, 128, 1024, False, "3d"),
    "varlen": (32, 8, 128, 0, True, "varlen"),
}
PROMPTS = (256, 512, 768, 1024)


def call_of(mod, name, rng):
    """``(call, multiply-adds)`` of case ``name`` on module ``mod``."""
    hq, hkv, d, s, causal, layout = CASES[name]
    if layout == "varlen":
        total = sum(PROMPTS)
        q, k, v = (rng.standard_normal((total, h, d), dtype=np.float32) for h in (hq, hkv, hkv))
        cu = np.concatenate([[0], np.cumsum(PROMPTS)]).astype(np.int32)
        pairs = sum(n * (n + 1) // 2 for n in PROMPTS)
        return (lambda: mod.varlen_attention(q, k, v, cu, cu, is_causal=True)), \
            hq * pairs * 2 * d
    q, k, v = (rng.standard_normal((1, h, s, d), dtype=np.float32) for h in (hq, hkv, hkv))
    kwargs = {}
    if layout == "3d":
        q, k, v = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(1, s, -1) for x in (q, k, v))
        kwargs = dict(q_num_heads=hq, kv_num_heads=hkv)
    pairs = s * (s + 1) // 2 if causal else s * s
    return (lambda: mod.attention(q, k, v, is_causal=causal, **kwargs)), hq * pairs * 2 * d


def main():
    rev = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    names = sys.argv[3:] or list(CASES)
    sys.path.insert(0, str(ROOT))
    import numkv

    base = load_base(rev)
    for mod in (numkv, base):
        mod.set_num_threads(threads)
    for name in names:
        calls = [call_of(mod, name, np.random.default_rng(0))[0] for mod in (numkv, base)]
        macs = call_of(numkv, name, np.random.default_rng(0))[1]
        now, then = (np.asarray(call(), np.float64) for call in calls)
        differ = "" if np.array_equal(now, then) else f"  (Y differs: max |dY| {np.abs(now - then).max():.3g})"
        times = [[], []]
        for round_ in range(11):
            for i in (round_ % 2, 1 - round_ % 2):
                start = time.perf_counter()
                calls[i]()
                times[i].append(time.perf_counter() - start)
        t_now, t_then = (statistics.median(t) for t in times)
        print(f"{name:12s} {threads} threads: now {t_now * 1e3:8.2f} ms ({2 * macs / t_now / 1e9:5.1f} GFLOP/s), "
              f"{rev} {t_then * 1e3:8.2f} ms, now / {rev} {t_now / t_then:.3f}{differ}", flush=True)


if __name__ == "__main__":
    main()
