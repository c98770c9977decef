"""numkv's decode against an earlier revision of itself, interleaved in one
process (the machines here are shared: separate runs differ by more than
the changes measured).

    python tools/ab_decode.py REV [THREADS SKV D HQ,HKV DTYPE SQ]
    python tools/ab_decode.py 71ca7e5 2 16384 128 32,8 float32
    python tools/ab_decode.py cfc22cf 2 2048 128 32,8 float32 2048   # causal prefill

REV's ``numkv`` package is copied (``git archive``) into a temporary
directory as ``numkv_base`` (its imports renamed), so both load side by
side, each with its own kernels and disk cache; calls alternate, medians
are compared.  ``DTYPE``: float32, an ml_dtypes name, q8_0 or q4_0 (K/V;
a prefill's Q too, but for the quantised formats).  ``SQ`` > 1: a causal
prefill of ``SQ`` queries over the ``SKV`` keys.
"""

import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_base(rev):
    """REV's numkv as the module ``numkv_base``."""
    where = pathlib.Path(tempfile.mkdtemp(prefix="numkv_ab_"))
    archive = subprocess.run(["git", "archive", rev, "numkv"], cwd=ROOT, check=True, capture_output=True).stdout
    tar_path = where / "numkv.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(where, filter="data")
    (where / "numkv").rename(where / "numkv_base")
    for path in (where / "numkv_base").rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\b(from|import) numkv\b", r"\1 numkv_base", text))
    sys.path.insert(0, str(where))
    import numkv_base

    return numkv_base


def main():
    rev = sys.argv[1]
    threads, skv, d = (int(x) for x in (sys.argv[2:5] + ["2", "16384", "128"][len(sys.argv[2:5]):]))
    hq, hkv = (int(x) for x in (sys.argv[5] if len(sys.argv) > 5 else "32,8").split(","))
    fmt = sys.argv[6] if len(sys.argv) > 6 else "float32"
    sq = int(sys.argv[7]) if len(sys.argv) > 7 else 1
    sys.path.insert(0, str(ROOT))
    import numkv

    base = load_base(rev)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, hq, sq, d), dtype=np.float32)
    k, v = (rng.standard_normal((1, hkv, skv, d), dtype=np.float32) for _ in "kv")
    runs = []
    for mod in (numkv, base):
        mod.set_num_threads(threads)
        if fmt in ("q8_0", "q4_0"):
            kk, vv = mod.quantize(k, fmt), mod.quantize(v, fmt)
        elif fmt != "float32":
            import ml_dtypes

            kk, vv = (x.astype(getattr(ml_dtypes, fmt, fmt)) for x in (k, v))
        else:
            kk, vv = k, v
        runs.append((mod, kk, vv))
    if sq > 1 and fmt not in ("float32", "q8_0", "q4_0"):
        import ml_dtypes

        q = q.astype(getattr(ml_dtypes, fmt, fmt))
    causal = sq > 1
    now, then = (mod.attention(q, kk, vv, is_causal=causal).astype(np.float64) for mod, kk, vv in runs)
    if not np.array_equal(now, then):  # a change of summation order (say), never of the result
        print(f"Y's bits differ from {rev}'s: max |dY| {np.abs(now - then).max():.3g}, max |Y| {np.abs(then).max():.3g}")
        assert np.allclose(now, then, rtol=1e-4, atol=1e-5)
    times = ([], [])
    for _ in range(max(5, int(3e5 / (skv * sq)))):
        for (mod, kk, vv), out in zip(runs, times):
            start = time.perf_counter()
            mod.attention(q, kk, vv, is_causal=causal)
            out.append(time.perf_counter() - start)
    now, before = (sorted(t)[len(t) // 2] for t in times)
    kind = f"causal prefill Sq={sq}" if causal else "decode"
    print(f"{fmt} {kind} Hq={hq} Hkv={hkv} D={d} Skv={skv}, {threads} threads: now {now * 1e6:.0f} us, "
          f"{rev} {before * 1e6:.0f} us, now / before {now / before:.3f}")


if __name__ == "__main__":
    main()
