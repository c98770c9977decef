"""Packed calls (``varlen_attention``, ``paged_attention``) and calls over
a cache's views (``numkv.attention`` on ``buffer[:, :, :n]`` with
``nonpad_kv_seqlen``, as numkv's caches and transformers' ``KVCache``
make them) against an earlier revision of numkv, interleaved in one
process: decode loops of 4 layers a step, a key more a sequence each step
(no length repeats), float32 Hq16/Hkv4/D64, causal.

    python tools/ab_packed.py REV [THREADS]
    python tools/ab_packed.py 9e9f546 2

As ``tools/ab_decode.py`` (REV's package loaded beside this one as
``numkv_base``); each round times 150 calls of each case on both
revisions, alternating which goes first; prints medians of 7 rounds and
the ratios' median and range, after checking both give the same Y.
"""

import sys
import time

import numpy as np

from ab_decode import ROOT, load_base

ROUNDS, CALLS = 7, 150
LAYERS = 4  # the calls of a decode step (its layers)
STEPS = (ROUNDS * CALLS + 16) // LAYERS + 1  # steps enough that no length repeats
HQ, HKV, D = 16, 4, 64


def decode_steps(rng, lens_k, page=None):
    """``STEPS`` decode steps' arguments, a key more a sequence each (the
    arrays shared): ``(q, k, cu_q, cu_k)``, or with ``page`` ``(q, pool,
    table, seq_lens, cu_q)``."""
    n, lens_k = len(lens_k), np.array(lens_k)
    q = rng.standard_normal((n, HQ, D), dtype=np.float32)
    cu_q = np.arange(n + 1, dtype=np.int32)
    last = lens_k + STEPS
    if page is None:
        k = rng.standard_normal((int(last.sum()), HKV, D), dtype=np.float32)
    else:
        pool = rng.standard_normal((int((-(-last // page)).sum()), page, HKV, D), dtype=np.float32)
    steps = []
    for step in range(STEPS):
        lens = lens_k + step
        cu_k = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        if page is None:
            steps.append((q, k[:cu_k[-1]], cu_q, cu_k))
            continue
        pages = -(-lens // page)
        table = np.full((n, int(pages.max())), -1, np.int32)
        first = np.concatenate([[0], np.cumsum(pages)])
        for i in range(n):
            table[i, :pages[i]] = np.arange(first[i], first[i + 1])
        steps.append((q, pool, table, lens.astype(np.int32), cu_q))
    return steps


def cache_steps(rng, batch, keys, capacity=4096):
    """A cache's buffers and a query: ``(q, k_buffer, v_buffer, keys)``."""
    k_buf, v_buf = (rng.standard_normal((batch, HKV, capacity, D), dtype=np.float32) for _ in "kv")
    return rng.standard_normal((batch, HQ, 1, D), dtype=np.float32), k_buf, v_buf, keys


def caller(module, steps, paged, fmt=None):
    """``f(i)``: call ``i`` of a decode loop over ``steps`` on ``module``."""
    if paged == "views":  # LAYERS calls a decode step, then a key more (never a length seen before)
        q, k_buf, v_buf, keys = steps
        calls = iter(range(LAYERS * (k_buf.shape[2] - keys)))

        def views(i):
            n = keys + next(calls) // LAYERS
            return module.attention(q, k_buf[:, :, :n], v_buf[:, :, :n], nonpad_kv_seqlen=np.full(len(q), n),
                                    is_causal=True)
        return views
    calls = iter(range(LAYERS * STEPS))  # LAYERS calls a decode step, then the next step
    if not paged:
        def varlen(i):
            q, k, cu_q, cu_k = steps[next(calls) // LAYERS]
            return module.varlen_attention(q, k, k, cu_q, cu_k, is_causal=True)
        return varlen
    pool = module.quantize(steps[0][1], fmt) if fmt else steps[0][1]

    def paged_call(i):
        q, _, table, seq_lens, cu_q = steps[next(calls) // LAYERS]
        return module.paged_attention(q, pool, pool, table, seq_lens, cu_q, is_causal=True)
    return paged_call


def median_time(f, n):
    times = []
    for i in range(n):
        start = time.perf_counter()
        f(i)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    rev, threads = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    sys.path.insert(0, str(ROOT))
    import numkv

    base = load_base(rev)
    rng = np.random.default_rng(0)
    short, mid = [10] * 8, list(range(100, 601, 33))[:16]
    cases = {
        "varlen, 8 decodes from 10 keys": (decode_steps(rng, short), False, None),
        "paged (pages of 16), 8 from 10 keys": (decode_steps(rng, short, 16), True, None),
        "varlen, 16 decodes from 100-595 keys": (decode_steps(rng, mid), False, None),
        "paged q8_0 (pages of 16), 16 from 100-595": (decode_steps(rng, mid, 16), True, "q8_0"),
        "varlen, 8 decodes from 264-2,056 keys": (decode_steps(rng, [264, 520, 776, 1032, 1288, 1416, 1032, 2056]),
                                                False, None),
        "cache views, B1, from 16 keys": (cache_steps(rng, 1, 16), "views", None),
        "cache views, B1, from 512 keys": (cache_steps(rng, 1, 512), "views", None),
        "cache views, B4, from 2,048 keys": (cache_steps(rng, 4, 2048), "views", None),
    }
    callers = {}
    for name, (steps, paged, fmt) in cases.items():
        callers[name] = [caller(m, steps, paged, fmt) for m in (numkv, base)]
        for m, f in zip((numkv, base), callers[name]):
            m.set_num_threads(threads)
            for i in range(2 * LAYERS):  # (compiles, keeps its layouts)
                f(i)
        np.testing.assert_allclose(callers[name][0](0), callers[name][1](0), rtol=1e-6, atol=1e-6)
    times = {name: ([], []) for name in cases}
    for r in range(ROUNDS):
        for name, (f_new, f_base) in callers.items():
            order = ((0, f_new), (1, f_base)) if r % 2 else ((1, f_base), (0, f_new))
            for which, f in order:
                times[name][which].append(median_time(f, CALLS))
    print(f"{threads} thread(s); medians of {ROUNDS} rounds of {CALLS} calls, now against {rev}")
    print("| case | now (us) | before (us) | now / before (range) |\n|---|---|---|---|")
    for name, (now, before) in times.items():
        ratios = np.array(now) / np.array(before)
        print(f"| {name} | {np.median(now) * 1e6:.0f} | {np.median(before) * 1e6:.0f} | "
              f"{np.median(ratios):.2f} ({ratios.min():.2f}-{ratios.max():.2f}) |")


if __name__ == "__main__":
    main()
