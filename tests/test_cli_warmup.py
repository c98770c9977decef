"""``python -m numkv warmup``: after it, a new process compiles nothing.

The check that can fail: warm up in a subprocess, then run, in a fresh
subprocess sharing the cache, a workload the warmup's own grid does not
contain (the demo with every K/V dtype, quantised ones included, other
shapes, dtypes, masks and layouts, quantised K/V and caches) while counting
numba's compiles of numkv kernels: any count above zero is a kernel the
warmup missed, named in the failure.  It shares the suite's disk cache, so
the kernels earlier tests compiled are loaded, not compiled again; the
quantised group is also run alone into an empty cache.
"""

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from numkv._cli import warmup as warmup_command

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.environ.get("NUMKV_CACHE") == "0", reason="disk cache off")

PRELUDE = r"""
import numpy as np, ml_dtypes, numkv
from numkv.__main__ import main
from numkv._cli.compile_notice import CompileWatch
from numkv.layers import Decoder

def dt(name):
    return np.dtype(getattr(ml_dtypes, name, None) or name)

def quantised(rng):
    # Quantised K/V: a decoder over q8_0 / q4_0 static and circular caches
    # (appends that quantise, chunked prefill, decode reading the blocks in
    # place), attention over every format with Q in the dtypes a model runs
    # in, and the appends a cache or a caller makes.
    decoder = Decoder("tiny", num_heads=2, num_kv_heads=1)  # head size 32: whole blocks
    prompts = [rng.integers(0, 256, n) for n in (9, 4)]
    for fmt in ("q8_0", "q4_0"):
        decoder.generate(prompts, 3, cache="static", dtype=fmt, prefill_chunk=4)
        decoder.generate(prompts, 3, cache="circular", window=5, dtype=fmt)
    per_channel = np.linspace(0.1, 0.4, 3 * 48, dtype=np.float32).reshape(1, 3, 1, 48)
    for fmt, scale in (("q8_0", None), ("q4_0", None), ("int8", 0.03), ("int4", per_channel)):
        d, dv = (64, 32) if scale is None else (48, 48)  # int8 / int4 take the scale per tensor or channel
        k = numkv.quantize(rng.standard_normal((3, 3, 77, d)), fmt, scale=scale)
        v = numkv.quantize(rng.standard_normal((3, 3, 77, dv)), fmt, scale=scale)
        for q_name in ("float32", "bfloat16", "float16"):
            q = rng.standard_normal((3, 6, 5, k.shape[3])).astype(dt(q_name))
            numkv.attention(q, k, v, attn_mask=rng.random((3, 1, 5, 77)) < 0.7)
            numkv.attention(q, k[:, :, :5], v[:, :, :5], past_key=k[:, :, 5:], past_value=v[:, :, 5:],
                            is_causal=True)
            numkv.attention(q[:, :, :1], k, v, nonpad_kv_seqlen=np.array([77, 3, 40]), is_causal=True)
        update = rng.standard_normal((3, 3, 2, v.shape[3])).astype(np.float32)
        numkv.tensor_scatter(v, update, np.array([0, 7, 75]), out=v)
        numkv.tensor_scatter(v, numkv.quantize(update, fmt, scale=scale), np.array([76, -1, 3]), mode="circular")
    for fmt in ("q8_0", "q4_0"):
        for mode in ("linear", "circular"):
            cache = numkv.StaticKVCache(2, 3, 40, 64, dtype=fmt, v_head_dim=32, mode=mode,
                                        window=20 if mode == "circular" else None)
            cache.append(rng.standard_normal((2, 3, 7, 64)).astype(np.float32),
                         rng.standard_normal((2, 3, 7, 32)).astype(np.float32), lengths=np.array([7, 4]))
            cache.append(rng.standard_normal((2, 3, 1, 64)).astype(dt("bfloat16")),
                         rng.standard_normal((2, 3, 1, 32)).astype(dt("bfloat16")))
            numkv.attention(rng.standard_normal((2, 6, 1, 64)).astype(np.float32), **cache.attention_inputs())

watch = CompileWatch()
"""

WORKLOAD = PRELUDE + r"""
with watch.installed():
    for kv in ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
        main(["demo", "--size", "tiny", "--batch", "3", "--prompt-len", "9", "--new-tokens", "3",
              "--kv-dtype", kv])
    rng = np.random.default_rng(1)
    for q_name, kv_name, precision in [
        ("float32", "float32", None), ("float64", "float64", None), ("float16", "float16", None),
        ("bfloat16", "bfloat16", None), ("float8_e4m3fnuz", "float8_e4m3fnuz", None),
        ("float8_e5m2fnuz", "float8_e5m2fnuz", None), ("float8_e8m0fnu", "float8_e8m0fnu", None),
        ("float32", "float8_e5m2fnuz", None), ("float32", "float16", None),
        ("float32", "float32", 11), ("bfloat16", "bfloat16", 11), ("float32", "float32", 1),
    ]:
        q = rng.standard_normal((3, 6, 5, 24)).astype(dt(q_name))
        k = rng.standard_normal((3, 3, 77, 24)).astype(dt(kv_name))
        v = rng.standard_normal((3, 3, 77, 40)).astype(dt(kv_name))
        numkv.attention(q, k, v, attn_mask=rng.random((3, 1, 5, 77)) < 0.7, softmax_precision=precision)
        numkv.attention(q, k[:, :, :5], v[:, :, :5], past_key=k[:, :, 5:], past_value=v[:, :, 5:],
                        is_causal=True, softmax_precision=precision)
        numkv.attention(q[:, :, :1], k, v, nonpad_kv_seqlen=np.array([77, 3, 40]), is_causal=True,
                        softmax_precision=precision)
    for name in ("int16", "complex128", "U7", "float4_e2m1fn", "float8_e5m2", "uint64"):
        cache = np.zeros((3, 4, 50, 8), dt(name))
        update = np.ones((3, 4, 2, 8), dt(name))
        numkv.tensor_scatter(cache, update, np.array([0, 7, 48]), out=cache)
        numkv.tensor_scatter(cache, update, np.array([49, -1, 3]), mode="circular")
    for fmt in ("q8_0", "q4_0"):  # the demo's quantised caches need a head size of 32: size base
        main(["demo", "--size", "base", "--batch", "2", "--prompt-len", "5", "--new-tokens", "2",
              "--kv-dtype", fmt])
    quantised(rng)
print("COMPILED", watch.kernels)
"""

# Only quantised K/V: what a decoder over a q8_0 / q4_0 cache runs.
QUANTISED_WORKLOAD = PRELUDE + r"""
with watch.installed():
    quantised(np.random.default_rng(2))
print("COMPILED", watch.kernels)
"""


def _env(env=None):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {}))


def _run(args, env=None, **kwargs):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(env), cwd=ROOT,
                          timeout=900, **kwargs)


@pytest.fixture(scope="module")
def quantised_warmup(tmp_path_factory):
    """``warmup --group "attention quantised K/V"`` into an empty cache, started
    before the module's whole warmup so that the two compile at once (on two
    cores the module took ~100 s with them one after the other); its test
    waits for it."""
    cache = {"NUMBA_CACHE_DIR": str(tmp_path_factory.mktemp("quantised-cache"))}  # empty: nothing the suite compiled
    process = subprocess.Popen([sys.executable, "-m", "numkv", "warmup", "--jobs", "1", "--group",
                                "attention quantised K/V"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=_env(cache), cwd=ROOT)
    yield cache, process
    process.kill()
    process.communicate()


@pytest.fixture(scope="module")
def warmup(quantised_warmup):
    start = time.perf_counter()
    done = _run(["-m", "numkv", "warmup"])
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, time.perf_counter() - start


def test_warmup_reports_every_group(warmup):
    out, _ = warmup
    for name in warmup_command.GROUPS:
        line = next(line for line in out.splitlines() if f"] {name} " in line)
        assert "compiled" in line or "already cached" in line, line
    assert "done in" in out and f"{len(warmup_command.GROUPS)} of {len(warmup_command.GROUPS)} groups ready" in out


def test_after_warmup_a_new_process_compiles_nothing(warmup):
    done = _run(["-c", WORKLOAD])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "COMPILED []", (
        "kernels the warmup missed: " + done.stdout.strip().splitlines()[-1])
    assert "compiling numkv's kernels" not in done.stderr  # the demo had nothing to announce


def test_the_quantised_group_alone_warms_a_quantised_decoder(quantised_warmup):
    """``warmup --group "attention quantised K/V"`` into an empty cache, then
    a new process's quantised decode and appends (the decoder over q8_0 /
    q4_0 caches, attention over every format, scatters into a
    QuantizedArray) compile nothing.  The whole warmup can't show the group
    is needed (its float groups compile the kernels the formats are read by
    today), so this runs the group alone: it fails without the group, or
    with one that misses any of them."""
    cache, process = quantised_warmup
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, out + err
    assert cache["NUMBA_CACHE_DIR"] in out and "1 of 1 groups ready" in out
    done = _run(["-c", QUANTISED_WORKLOAD], env=cache)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "COMPILED []", (
        "kernels the quantised group missed: " + done.stdout.strip().splitlines()[-1])


def test_a_second_warmup_compiles_nothing(warmup):
    done = _run(["-m", "numkv", "warmup", "--jobs", "1", "--group", "attention float32",
                 "--group", "tensor_scatter"])
    assert done.returncode == 0, done.stderr
    assert "0 kernels compiled" in done.stdout and done.stdout.count("already cached (") == 2


def test_cache_writes_wait_for_the_lock(tmp_path, monkeypatch):
    """Two processes adding entries to one numba index at once lose one (each
    rewrites the whole index); the warmup's workers take a file lock first."""
    from numba.core import caching

    monkeypatch.setattr(caching.IndexDataCacheFile, "save", caching.IndexDataCacheFile.save)
    lock_path = tmp_path / "lock"
    assert warmup_command._serialise_cache_writes(str(lock_path))
    index = caching.IndexDataCacheFile(str(tmp_path), "kernel", source_stamp="stamp")
    other = caching.IndexDataCacheFile(str(tmp_path), "kernel", source_stamp="stamp")  # "another process"

    with open(lock_path, "a") as held:  # another process holds the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        writer = threading.Thread(target=index.save, args=(("sig-a",), b"code a"))
        writer.start()
        writer.join(0.3)
        assert writer.is_alive(), "save did not wait for the lock"
        assert not (tmp_path / "kernel.nbi").exists()
    writer.join(10)
    other.save(("sig-b",), b"code b")
    assert index.load(("sig-a",)) == b"code a" and index.load(("sig-b",)) == b"code b"
