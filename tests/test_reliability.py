"""numkv inside other people's programs (issue 12, items 4-6): thread limits,
Python threads, fork, spawn, threadpoolctl, torch's OpenMP, Dask.

In-process tests watch numkv's pool (``numkv._runtime.pool.run``) run probe
kernels (``pool_probes``): how many threads took a share, a worker busy
elsewhere, an exception in a share.  The subprocess tests set
numba's threading layer (``NUMBA_THREADING_LAYER``) to the one that failed
before numkv had its own pool (GNU OpenMP: a forked child killed, a fork Pool
hung; workqueue: concurrent Python threads aborted the process), so that
numkv stays clear of them; kernels come from the suite's numba disk cache
(``NUMBA_CACHE_DIR`` is inherited).  Each subprocess test, and the thread
limit tests, failed on main before these items (5f22775).
"""

import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import numkv
from numkv._runtime import control, pool, thread_count

from pool_probes import block, claim_items, count_items, fail_at, shares_used

ROOT = pathlib.Path(__file__).resolve().parents[1]  # this checkout's numkv


def run_script(script, timeout=240, **env):
    """Run ``script`` in a fresh Python with this checkout's numkv; its stdout."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), NUMKV_REFERENCE="0", **env)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture
def default_threads():
    """Leaves numkv's process-wide setting as the suite found it."""
    yield
    numkv.set_num_threads(None)


def threads_used(n_items=64, small=False):
    """How many threads ran a share of ``n_items`` work items."""
    return shares_used(n_items, small)


# -- the thread count ---------------------------------------------------------

def test_set_and_get_num_threads(default_threads):
    numkv.set_num_threads(1)
    assert numkv.get_num_threads() == 1 and threads_used() == 1
    numkv.set_num_threads(3)
    assert numkv.get_num_threads() == 3 and threads_used() == 3
    assert threads_used(small=True) == 1 and threads_used(n_items=2) == 2
    numkv.set_num_threads(None)
    assert numkv.get_num_threads() == thread_count._DEFAULT
    for bad, exc in ((0, ValueError), (-2, ValueError), (1.5, TypeError), ("2", TypeError),
                     (True, TypeError)):
        with pytest.raises(exc, match="n must be"):
            numkv.set_num_threads(bad)
    assert numkv.get_num_threads() == thread_count._DEFAULT  # a bad call changes nothing


@pytest.mark.parametrize("env, expected", [
    ({"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"}, 1),
    ({"OMP_NUM_THREADS": "1"}, 1),
    ({"OMP_NUM_THREADS": "1,4"}, 1),  # one count per nesting level: the outer one
    ({"OMP_NUM_THREADS": "nonsense"}, None),
    ({"OMP_NUM_THREADS": "0"}, None),
    ({}, None),
], ids=["numba-first", "omp", "omp-nested-list", "omp-invalid", "omp-zero", "none"])
def test_default_from_the_environment(monkeypatch, default_threads, env, expected):
    """Dask and joblib limit their workers through OMP_NUM_THREADS, which
    numba ignores; numkv reads it (NUMBA_NUM_THREADS first) at import."""
    for name in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(thread_count, "_DEFAULT", thread_count._default())  # as at import
    numkv.set_num_threads(None)
    assert numkv.get_num_threads() == (expected or len(os.sched_getaffinity(0)))


def test_count_is_process_wide(default_threads):
    numkv.set_num_threads(2)
    seen = []
    worker = threading.Thread(target=lambda: seen.append((numkv.get_num_threads(), threads_used())))
    worker.start()
    worker.join()
    assert seen == [(2, 2)]


def test_threadpoolctl_limits_numkv(default_threads):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    info = [lib for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "numkv"]
    assert len(info) == 1 and info[0]["version"] == numkv.__version__
    numkv.set_num_threads(2)
    with threadpoolctl.threadpool_limits(limits=1):
        assert numkv.get_num_threads() == 1 and threads_used() == 1
    assert numkv.get_num_threads() == 2 and threads_used() == 2
    with threadpoolctl.threadpool_limits(limits={"numkv": 1}):
        assert numkv.get_num_threads() == 1


def test_a_call_made_while_another_has_the_pool_runs_alone(default_threads):
    """A Python thread's call that finds the workers busy with another
    thread's call (here: a share that waits) does not wait for them: it runs
    on its own thread, and Y is one thread's."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 8, 1, 64), np.float32)
    k, v = (rng.standard_normal((1, 4, 2048, 64), np.float32) for _ in range(2))  # 2.1M MACs: 2 threads
    numkv.set_num_threads(1)
    want = numkv.attention(q, k, v)
    numkv.set_num_threads(2)
    flags = np.zeros(3, np.int64)
    other = threading.Thread(target=pool.run, args=(block, 2, (flags,)), kwargs=dict(release_gil=True))
    other.start()
    try:
        deadline = time.monotonic() + 60
        while not flags[0] and time.monotonic() < deadline:
            time.sleep(1e-3)
        assert flags[0]
        y = numkv.attention(q, k, v)
        assert not flags[2]  # it came back while the worker was busy
    finally:
        flags[1] = 1
        other.join()
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(numkv.attention(q, k, v), want)  # the workers serve the next call


@pytest.mark.parametrize("release_gil", [False, True])
def test_every_item_runs_once_and_before_the_call_returns(default_threads, release_gil):
    """More threads than cores, so that workers start late (their shares
    are taken back and run by the caller) or are still running when the
    caller is done (it waits): each item runs exactly once, by the time the
    call returns."""
    numkv.set_num_threads(6)
    hits, shares = np.zeros(40, np.int64), np.zeros(1024, np.int64)
    for call in range(300):
        hits[:] = 0
        pool.run(count_items, hits.size, (hits, shares, call % 3 * 200), release_gil=release_gil)
        assert (hits == 1).all(), (call, hits)
    assert shares[1:6].any()


@pytest.mark.parametrize("claimed", [False, True])
@pytest.mark.parametrize("release_gil", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_each_way_to_call(monkeypatch, default_threads, threads, release_gil, claimed):
    """A call on 1-3 threads, keeping the GIL or not, its items in shares or
    claimed (all packed into the kernel's ``role``, ``control.caller_role``):
    every item runs once, and no share past the call's threads runs.  On
    one thread, the first call of a process (a pool with no control block
    yet), which makes one only to let go of the GIL."""
    if threads == 1:
        monkeypatch.setattr(pool, "_pool", pool._Pool())
    numkv.set_num_threads(threads)
    n_items = 1000 if claimed else 30
    hits, shares = np.zeros(n_items, np.int64), np.zeros(1024, np.int64)
    kernel, args = ((claim_items, (hits, shares, np.zeros(1, np.int64))) if claimed
                    else (count_items, (hits, shares, 0)))
    pool.run(kernel, n_items, args, claimed=claimed, release_gil=release_gil)
    assert (hits == 1).all(), hits
    assert shares[max(threads, 1):].sum() == 0, np.flatnonzero(shares)
    if threads == 1:
        assert (pool._pool.ctrl is not None) == release_gil


def test_a_call_that_fails_before_its_kernel_runs_after_a_share_was_taken_back():
    """A call whose arguments numba refuses, after a call whose worker's
    share the caller took back (the worker slept through it: its ``done``
    stays behind; set here, as the caller leaves it): numba's error, at
    once (``join_after_error`` waited for that ``done`` forever, holding
    the GIL)."""
    out = run_script("""
        import sys
        sys.path.insert(0, "tests")
        import numpy as np, numkv
        from numkv._runtime import control, pool
        from pool_probes import count_items
        numkv.set_num_threads(2)
        hits, shares = np.zeros(2, np.int64), np.zeros(1024, np.int64)
        pool.run(count_items, 2, (hits, shares, 0))
        ctrl, line = pool._pool.ctrl, control.WORKERS + control.LINE
        ctrl[line + control.STATE], ctrl[line + control.DONE] = control.CALLED_OFF, ctrl[control.SEQ] - 1
        try:
            pool.run(count_items, 2, (hits, "not an array", 0))
        except Exception as e:  # (numba's TypingError)
            print("raised", type(e).__name__)
        pool.run(count_items, 2, (hits, shares, 0))  # the pool serves the next call
        print("served")
    """, timeout=120)
    assert "raised TypingError" in out and "served" in out, out


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("release_gil", [False, True])
def test_an_exception_in_any_share_reaches_the_caller(default_threads, threads, release_gil):
    """Whichever share raises -- the caller's or a worker's -- the call
    raises it (the class and message numba raised) once every share has
    stopped, and the pool serves the next call."""
    numkv.set_num_threads(threads)
    for bad in (0, 5, 9):
        out = np.zeros(10, np.int64)
        with pytest.raises(ValueError, match="item is bad"):
            pool.run(fail_at, out.size, (bad, out), release_gil=release_gil)
        assert pool._pool.ctrl is None or pool._pool.ctrl[control.FAIL_STATUS] == 0
    out = np.zeros(10, np.int64)
    pool.run(fail_at, out.size, (-1, out), release_gil=release_gil)
    assert (out == 1).all()


# -- Python threads -------------------------------------------------------------

CALLS = """
import numpy as np, numkv

def inputs(seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 8, 4, 64), dtype=np.float32)
    k = rng.standard_normal((1, 4, 600, 64), dtype=np.float32)
    return q, k, rng.standard_normal((1, 4, 600, 64), dtype=np.float32)

def calls(seed, n):
    \"\"\"n mixed calls: attention and an in-place scatter big enough for
    several threads, a cache append; returns a digest of every result.\"\"\"
    q, k, v = inputs(seed)
    cache = np.zeros((2, 4, 4096, 64), np.float32)
    update = np.resize(k, (2, 4, 2048, 64))  # 4 MiB: above _config.PARALLEL_MIN_BYTES (parallel)
    kv = numkv.StaticKVCache(1, 4, n + 1, 64)
    out = []
    for i in range(n):
        y = numkv.attention(q, k, v, nonpad_kv_seqlen=np.array([600 - i % 7]))
        numkv.tensor_scatter(cache, update, np.array([i % 2000, 7]), out=cache)
        keys, _ = kv.append(k[:, :, i % 600][:, :, None], v[:, :, i % 600][:, :, None])
        out.append(float(y.sum()) + float(cache.sum()) + float(keys[..., -1, :].sum()))
    return out
"""


def test_python_threads_in_process(default_threads):
    """Under whatever layer this process has: four threads at once give what
    one thread gives."""
    namespace = {}
    exec(CALLS, namespace)
    numkv.set_num_threads(None)
    expected = [namespace["calls"](seed, 3) for seed in range(4)]
    results = [None] * 4

    def work(seed):
        results[seed] = namespace["calls"](seed, 3)

    workers = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert results == expected


def test_python_threads_under_workqueue():
    """numba's workqueue layer aborted the process (SIGABRT) when two Python
    threads were in numkv's parallel kernels at once."""
    out = run_script(CALLS + """
import threading, numba
expected = [calls(seed, 4) for seed in range(4)]
results = [None] * 4
def work(seed):
    results[seed] = calls(seed, 4)
workers = [threading.Thread(target=work, args=(s,)) for s in range(4)]
for w in workers: w.start()
for w in workers: w.join()
assert results == expected, 'threads differ from one thread'
print("ok")
""", NUMBA_THREADING_LAYER="workqueue", NUMBA_NUM_THREADS="2")
    assert out.split() == ["ok"]


# -- fork, spawn and OpenMP neighbours -------------------------------------------

FORK = CALLS + """
import ctypes, multiprocessing as mp, os

def digest(seed):
    return calls(seed, 2)

if __name__ == "__main__":  # (spawned children import this file: only what is above)
    ctypes.CDLL("libgomp.so.1")  # the runtime numba's OpenMP layer links, loaded first ...
    import torch                 # ... so torch shares it
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1  # (torch in use before numkv: its count is settled)
    numkv.set_num_threads(2)
    expected = digest(0)  # numba's OpenMP layer started here before numkv had its own pool
    assert torch.get_num_threads() == 1, f"torch's count changed to {torch.get_num_threads()}"
    pid = os.fork()
    if pid == 0:  # a forked child used to be killed here (SIGTERM from numba)
        os._exit(0 if digest(0) == expected else 3)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "forked child"
    for method in ("fork", "spawn"):
        with mp.get_context(method).Pool(2) as pool:  # a fork Pool used to hang
            assert pool.map_async(digest, [0, 0]).get(timeout=120) == [expected] * 2, method
    print("ok")
"""


def test_fork_and_pools_after_gnu_openmp(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "fork_script.py"  # spawn re-imports __main__ from a file
    script.write_text(FORK)
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMKV_REFERENCE="0", NUMBA_THREADING_LAYER="omp",
               NUMBA_NUM_THREADS="2")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stderr


# -- Dask -----------------------------------------------------------------------------

def _in_worker(seed):
    """In a Dask worker: its OMP_NUM_THREADS, numkv's count, how many threads
    an attention call ran on, and Y."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 8, 4, 64), dtype=np.float32)
    k = rng.standard_normal((1, 4, 600, 64), dtype=np.float32)
    y = numkv.attention(q, k, k)
    return os.environ.get("OMP_NUM_THREADS"), numkv.get_num_threads(), shares_used(), y


def test_dask_workers_take_the_worker_thread_limit():
    """Dask limits each worker through OMP_NUM_THREADS=1; numkv used every core
    in each worker all the same."""
    distributed = pytest.importorskip("distributed")
    environ = dict(os.environ)  # LocalCluster sets OMP_NUM_THREADS=1 & co. here too
    numkv.set_num_threads(None)
    before = numkv.get_num_threads()
    try:
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                      dashboard_address=None) as cluster, \
                distributed.Client(cluster) as client:
            results = client.gather(client.map(_in_worker, [0, 1, 0], pure=False))
            assert os.environ.get("OMP_NUM_THREADS") == "1"
            numkv.set_num_threads(None)
            assert numkv.get_num_threads() == before  # the client's default was read at import
    finally:
        os.environ.clear()
        os.environ.update(environ)
    for seed, (omp, threads, used, y) in zip([0, 1, 0], results):
        assert (omp, threads, used) == ("1", 1, 1)
        *_, expected = _in_worker(seed)
        np.testing.assert_array_equal(y, expected)


# -- Ctrl-C, spinning, the GIL ----------------------------------------------------------

def test_ctrl_c_in_a_long_call_raises_once_every_share_stopped():
    """A long call (it lets go of the GIL) interrupted by SIGINT: the
    KeyboardInterrupt comes when it returns, never while a worker still
    writes its Y, and the next call gives the same Y."""
    out = run_script("""
        import os, signal, threading
        import numpy as np, numkv
        numkv.set_num_threads(2)
        rng = np.random.default_rng(0)
        q = rng.standard_normal((1, 8, 512, 64), np.float32)
        k, v = (rng.standard_normal((1, 2, 512, 64), np.float32) for _ in range(2))
        want = numkv.attention(q, k, v)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        calls = 0
        try:
            while calls < 100000:
                y = numkv.attention(q, k, v)
                assert np.array_equal(y, want)
                calls += 1
        except KeyboardInterrupt:
            print("interrupted", calls > 0)
        assert np.array_equal(numkv.attention(q, k, v), want)
        print("ok")
    """, NUMKV_SPIN_US="0")
    assert out.split() == ["interrupted", "True", "ok"]


def test_spinning_off_and_on_give_the_same_results(default_threads):
    """``NUMKV_SPIN_US=0`` (documented in ``set_num_threads``) and the default:
    the same Y, calls back to back and apart."""
    script = """
        import time
        import numpy as np, numkv
        numkv.set_num_threads(2)
        rng = np.random.default_rng(1)
        q = rng.standard_normal((1, 32, 1, 128), np.float32)
        k, v = (rng.standard_normal((1, 8, 1024, 128), np.float32) for _ in range(2))
        ys = []
        for i in range(50):
            ys.append(numkv.attention(q, k, v))
            if i % 10 == 0:
                time.sleep(0.01)
        print(all(np.array_equal(y, ys[0]) for y in ys), float(ys[0].sum()))
    """
    off, on = run_script(script, NUMKV_SPIN_US="0"), run_script(script)
    assert off == on and off.split()[0] == "True"


def test_the_spin_comes_from_config_unless_the_environment_sets_it(monkeypatch):
    """``_config.SPIN_US`` / ``CLOSE_US`` reach a control block made after
    they change; ``NUMKV_SPIN_US`` overrides the spin."""
    from numkv import _config

    monkeypatch.delenv("NUMKV_SPIN_US", raising=False)
    monkeypatch.setattr(_config, "SPIN_US", 7)
    monkeypatch.setattr(_config, "CLOSE_US", 30)
    ctrl = pool._new_ctrl()
    assert (ctrl[control.SPIN_NS], ctrl[control.CLOSE_NS]) == (7000, 30000)
    monkeypatch.setenv("NUMKV_SPIN_US", "0")
    assert pool._new_ctrl()[control.SPIN_NS] == 0


def test_a_small_call_keeps_the_gil_and_a_long_one_lets_go(default_threads):
    """Beside a Python thread that counts while it holds the GIL, a small
    call (below the switch interval) leaves it nothing to count meanwhile;
    a long one lets it run."""
    from numkv import _attention

    numkv.set_num_threads(2)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 8, 1, 64), np.float32)
    k = rng.standard_normal((1, 2, 64, 64), np.float32)
    assert not _attention._releases_gil(8 * 64 * 128, 1)
    qp = rng.standard_normal((1, 8, 1024, 64), np.float32)
    kp = rng.standard_normal((1, 2, 1024, 64), np.float32)
    assert _attention._releases_gil(8 * 1024 * 1024 * 128, 2)
    numkv.attention(q, k, k), numkv.attention(qp, kp, kp)
    count, stop = [0], threading.Event()

    def counter():
        while not stop.is_set():
            count[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)  # (no forced switch during the test: only a released GIL lets it count)
    other = threading.Thread(target=counter)
    other.start()
    try:
        time.sleep(0.05)
        small = []
        for _ in range(20):
            before = count[0]
            numkv.attention(q, k, k)
            small.append(count[0] - before)
        before = count[0]
        numkv.attention(qp, kp, kp)
        long_ = count[0] - before
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)
    assert max(small) == 0 and long_ > 0, (small, long_)


_TRACED_CALLS = """
import sys, tracemalloc
import numpy as np
import numkv
from numkv._runtime import pool
if sys.argv[1:] == ["unguarded"]:
    pool._tracing = lambda: False
numkv.set_num_threads(2)
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 16, 1, 128), dtype=np.float32)
k, v = (rng.standard_normal((1, 4, 4096, 128), dtype=np.float32) for _ in "kv")
numkv.attention(q, k, v)  # compiled; two threads that keep the GIL (2**24 multiply-adds)
tracemalloc.start()
for _ in range(200):
    numkv.attention(q, k, v)
tracemalloc.stop()
print("done")
"""


def test_calls_on_two_threads_while_tracemalloc_traces():
    """A worker's allocation goes through tracemalloc's hook, which takes
    the GIL: a call that kept it while its workers ran deadlocked (the
    suite's tracemalloc test hung once in ~10 runs); under tracing every
    call on several threads lets go of the GIL."""
    assert run_script(_TRACED_CALLS, timeout=120).strip() == "done"
