"""Stress numkv the way host programs use it; exits 1 on any difference.

    python tools/stress.py                      # every check, every layer that loads
    python tools/stress.py --calls 200 --layers omp --skip-rss --skip-dask

For each numba threading layer (``NUMBA_THREADING_LAYER``, one subprocess
each; numkv runs on its own pool, so none should matter): ``--threads`` Python threads making ``--calls`` mixed calls each
(attention small and parallel-sized, in-place tensor_scatter small and
parallel-sized, StaticKVCache / DynamicKVCache appends) must give exactly the
results of the same calls made one at a time on one thread
(``numkv.set_num_threads(1)``); then a child forked
after the parallel kernels ran and a fork ``multiprocessing.Pool`` must give
them too.  ``--rss N``: N calls in one process, resident memory sampled every
N/10 calls, must stay flat.  ``--dask``: the calls inside a Dask
``LocalCluster`` (processes, one thread per worker).  The test suite
(tests/test_reliability.py) checks the same on a few calls; this is the long
run.
"""

import argparse
import hashlib
import os
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numkv  # noqa: E402


def calls(seed, n):
    """``n`` mixed calls; returns one digest per call of everything it produced."""
    rng = np.random.default_rng(seed)
    q_big = rng.standard_normal((1, 8, 4, 64), dtype=np.float32)
    k_big = rng.standard_normal((1, 4, 700, 64), dtype=np.float32)
    q_small = rng.standard_normal((1, 2, 3, 16), dtype=np.float32)
    k_small = rng.standard_normal((1, 1, 20, 16), dtype=np.float32)
    big_cache = np.zeros((2, 4, 1024, 64), np.float32)     # 2 MiB
    small_cache = np.zeros((2, 2, 64, 8), np.float32)      # one thread
    update = rng.standard_normal((2, 4, 256, 64), dtype=np.float32)  # 512 KiB: several threads
    static = numkv.StaticKVCache(1, 1, 64, 16, mode="circular")
    dynamic = numkv.DynamicKVCache()
    digests = []
    for i in range(n):
        h = hashlib.sha1()
        kind = i % 4
        if kind == 0:
            y = numkv.attention(q_big, k_big, k_big[:, :, ::-1], nonpad_kv_seqlen=np.array([700 - i % 13]),
                                is_causal=True)
        elif kind == 1:
            y = numkv.attention(q_small, k_small, k_small, softcap=2.0)
        elif kind == 2:
            numkv.tensor_scatter(big_cache, update, np.array([i % 700, 3]), out=big_cache)
            numkv.tensor_scatter(small_cache, small_cache[:, :, :1] + 1, np.array([i % 64, 5]),
                                 mode="circular", out=small_cache)
            y = big_cache[:, :, ::97]
            h.update(small_cache.tobytes())
        else:
            step = k_small[:, :, i % 20][:, :, None]
            keys, _ = static.append(step, step)
            if dynamic.seq_len >= 256:
                dynamic.reset()
            dkeys, _ = dynamic.append(step, step)
            y = keys
            h.update(np.ascontiguousarray(dkeys[:, :, -1]).tobytes())
        h.update(np.ascontiguousarray(y).tobytes())
        digests.append(h.hexdigest())
    return digests


def check_layer(n_calls, n_threads):
    """Run inside a subprocess with NUMBA_THREADING_LAYER set; prints a report."""
    import multiprocessing as mp

    import numba

    seeds = list(range(n_threads))
    calls(0, 8)  # compile, warm
    t0 = time.perf_counter()
    numkv.set_num_threads(1)  # the reference: one Python thread, numkv on one thread
    expected = [calls(s, n_calls) for s in seeds]
    numkv.set_num_threads(None)
    t_serial = time.perf_counter() - t0
    try:
        layer = numba.threading_layer()
    except ValueError:  # numkv never started numba's threads
        layer = os.environ.get("NUMBA_THREADING_LAYER", "default") + " (not started)"
    got = [None] * n_threads

    def work(i):
        got[i] = calls(seeds[i], n_calls)

    t0 = time.perf_counter()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    t_threads = time.perf_counter() - t0
    threads_ok = got == expected

    few = min(n_calls, 40)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if calls(0, few) == expected[0][:few] else 3)
    fork_ok = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    with mp.get_context("fork").Pool(2) as pool:
        pool_ok = pool.starmap_async(calls, [(0, few), (1, few)]).get(timeout=600) == \
            [expected[0][:few], expected[1][:few]]
    ok = threads_ok and fork_ok and pool_ok
    print(f"{layer:20s}  {n_threads} threads x {n_calls} calls: identical={threads_ok} "
          f"(1 thread {t_serial:.1f} s, {n_threads} threads {t_threads:.1f} s)  "
          f"fork child={fork_ok}  fork Pool={pool_ok}")
    return ok


def check_rss(n_calls):
    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    calls(0, 8)  # compile, warm
    samples = []
    step = max(1, n_calls // 10)
    for _ in range(10):
        calls(1, step)
        samples.append(rss_mib())
    growth = samples[-1] - samples[1]
    print(f"RSS over {10 * step} calls, every {step}: " + " ".join(f"{s:.1f}" for s in samples)
          + f" MiB; growth after the first sample {growth:+.1f} MiB")
    return growth < 8  # MiB; a leak of one small array per call would add tens of MiB


def _dask_task(seed, n):
    import numkv

    return os.environ.get("OMP_NUM_THREADS"), numkv.get_num_threads(), calls(seed, n)


def check_dask(n_calls):
    import distributed

    expected = [calls(s, n_calls) for s in range(4)]
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        results = client.gather(client.map(_dask_task, range(4), [n_calls] * 4, pure=False))
    ok = all(r[2] == e for r, e in zip(results, expected))
    limits = sorted({r[:2] for r in results})
    print(f"dask: 2 workers x 1 thread, 4 tasks x {n_calls} calls: identical={ok}; "
          f"(OMP_NUM_THREADS, numkv threads) in workers: {limits}")
    return ok and all(r[1] == 1 for r in results)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--layers", default="omp,tbb,workqueue")
    parser.add_argument("--rss", type=int, default=100_000)
    parser.add_argument("--skip-rss", action="store_true")
    parser.add_argument("--skip-dask", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "layer":
        sys.exit(0 if check_layer(args.calls, args.threads) else 1)
    ok = True
    for layer in args.layers.split(","):
        env = dict(os.environ, NUMBA_THREADING_LAYER=layer)
        done = subprocess.run([sys.executable, __file__, "--child", "layer", "--calls", str(args.calls),
                               "--threads", str(args.threads)], env=env, capture_output=True, text=True)
        out = (done.stdout + done.stderr).strip()
        print(out if done.returncode in (0, 1) else f"{layer:9s}  exit {done.returncode}: {out[-500:]}")
        ok &= done.returncode == 0
    if not args.skip_rss:
        ok &= check_rss(args.rss)
    if not args.skip_dask:
        ok &= check_dask(min(args.calls, 200))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
