"""``python -m numkv warmup``: compile every kernel numkv has into numba's
disk cache ahead of time, so that no later process pays for compilation
(a Docker build step, a CI cache, a read-only install).

Through the public API only: each group calls ``numkv.tensor_scatter`` or
``numkv.attention`` over a grid of shapes, layouts and options in one dtype
family, so whatever specialisations the kernels need for that family are the
ones compiled — however many there are and whatever they are called.

Groups run in parallel processes (spawned, not forked: each starts from a
clean interpreter and inherits none of this one's compiler state).  numba's
cache index is not safe
for two processes adding entries at once: each rewrites the whole index and
takes the next free data-file number, so one entry is lost or, worse, one
process's data file is overwritten by another's code under the same number.
The workers therefore serialise numba's cache writes with a file lock; where
that can't be done (no ``fcntl``, another numba) the groups run one by one.
"""

import os
import tempfile
import time

import numpy as np

import numkv
from numkv import _formats
from numkv._runtime import thread_count
from numkv._cli.compile_notice import CompileWatch
from numkv._dtypes import is_object_dtype

FLOAT8 = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")


def _dtype(name):
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, None) or name)


# -- what to compile ----------------------------------------------------------

def _scatter_group():
    """Every element width (1, 2, 4, 8 and 16 bytes, 4-bit types, strings),
    in place / functional / into another buffer, small (serial) and large
    (parallel), linear and circular, another axis, strided and unaligned,
    and a decode step's one-token append."""
    rng = np.random.default_rng(0)
    names = ["bool", "int8", "uint8", "int16", "float16", "bfloat16", "int32", "float32",
             "int64", "float64", "complex64", "complex128", "float4_e2m1fn", "int4", "uint4",
             *FLOAT8, ">f4", "U4", "object"]
    for name in names:
        dtype = _dtype(name)
        for shape in ((2, 2, 16, 4), (4, 8, 256, 64)):  # 512 B and 2 MiB of float32
            cache = np.zeros(shape, dtype)
            update = rng.integers(0, 2, shape[:2] + (3, shape[3])).astype(dtype)
            starts = np.array([0, 5] + [1] * (shape[0] - 2))
            numkv.tensor_scatter(cache, update, starts, out=cache)
            token = np.ascontiguousarray(update[:, :, :1])  # a decode step's append: its own kernel
            numkv.tensor_scatter(cache, token, starts, out=cache)
            numkv.tensor_scatter(cache, token, starts - 6, mode="circular", out=cache)
            numkv.tensor_scatter(cache, update, starts)
            numkv.tensor_scatter(cache, update, starts, out=np.empty_like(cache))
            numkv.tensor_scatter(cache, update, starts - 6, mode="circular", out=cache)
            # (B, S, H, D) buffers: the sequence on axis 1, and as a strided (B, H, S, D) view
            seq_first = np.zeros((shape[0], shape[2], shape[1], shape[3]), dtype)
            numkv.tensor_scatter(seq_first, update.transpose(0, 2, 1, 3), starts, axis=1, out=seq_first)
            strided = seq_first.transpose(0, 2, 1, 3)
            numkv.tensor_scatter(strided, update, starts, out=strided)
        if not is_object_dtype(dtype):  # a view one byte off alignment: elements read byte by byte
            raw = np.zeros(cache.nbytes + 1, np.uint8)[1:].view(dtype).reshape(cache.shape)
            numkv.tensor_scatter(raw, update, starts, out=raw)


def _attention_group(q_name, kv_names, softmax_precision=None):
    """``numkv.attention`` with Q in ``q_name`` and K/V in each of ``kv_names``:
    decode over a short and a long cache (split key range), prefill (many work
    items), tiny calls (one thread), masks (bool, additive in Q's dtype,
    integer), causal with and without a past, an external cache with
    ``nonpad_kv_seqlen``, windows, softcap, 3-D inputs, strided and read-only
    K/V, a V head size different from Q/K's."""
    rng = np.random.default_rng(0)
    q_dtype = _dtype(q_name)
    extra = {} if softmax_precision is None else {"softmax_precision": softmax_precision}

    def arr(shape, dtype):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32).astype(dtype)

    mask_dtype = np.float32 if q_dtype.itemsize == 1 else q_dtype  # ONNX: mask in Q's type
    for kv_name in kv_names:
        kv_dtype = _dtype(kv_name)
        # (batch, q_seq, kv_seq): decode over short and long caches, a few
        # speculative tokens, prefills from tiny (one thread) to many tiles
        for b, sq, skv in ((2, 1, 3), (2, 1, 64), (1, 1, 1500), (1, 1, 5000), (2, 4, 700),
                           (2, 40, 40), (1, 160, 160), (1, 600, 600)):
            q = arr((b, 4, sq, 32), q_dtype)
            k, v = arr((b, 2, skv, 32), kv_dtype), arr((b, 2, skv, 16), kv_dtype)
            call = lambda *a, **kw: numkv.attention(*a, **kw, **extra)  # noqa: E731
            call(q, k, v)
            call(q, k, v, is_causal=True, softcap=30.0, scale=0.2)
            call(q, k, v, attn_mask=rng.random((sq, skv)) < 0.8)
            call(q, k, v, attn_mask=arr((b, 1, sq, skv), mask_dtype))
            call(q, k, v, attn_mask=rng.integers(-1, 1, (sq, skv)))
            call(q, k, v, nonpad_kv_seqlen=np.full(b, max(1, skv - 2)), is_causal=True,
                 left_window_size=7, right_window_size=0)
            call(q, k[:, :, :1], v[:, :, :1], past_key=k[:, :, 1:], past_value=v[:, :, 1:], is_causal=True)
            big_k = arr((b, 2, skv + 8, 32), kv_dtype)
            ro = big_k[:, :, :skv]
            ro.flags.writeable = False
            call(q, ro, big_k[:, :, 8:], is_causal=True)
            k3 = k.transpose(0, 2, 1, 3).reshape(b, skv, 64)
            call(q.transpose(0, 2, 1, 3).reshape(b, sq, 128), k3, k3, q_num_heads=4, kv_num_heads=2)


def _quantized_group():
    """Quantised K/V (``numkv.quantize``'s formats): ``numkv.attention`` over
    K/V of every format of ``numkv._formats`` (the given-scale ones with scales
    per tensor and per channel) with Q
    in every float dtype a model runs in — decode over short and long caches,
    prefill, masks, causal with a past, ``nonpad_kv_seqlen`` and windows,
    sequence slices of the codes — and the appends that fill such caches:
    ``tensor_scatter`` into a ``QuantizedArray`` (float or quantised
    updates, linear and circular) and ``StaticKVCache`` of each block format
    in both modes, read through ``attention_inputs()``.  It
    compiles each format's loops (``loop_functions``' C functions, one set per
    format) and the block quantisation (``_kernels.quantize``); alone
    (``--group``) it warms exactly what a quantised decoder needs."""
    rng = np.random.default_rng(0)

    def arr(shape, dtype=np.float32):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32).astype(dtype)

    per_channel = np.linspace(0.01, 0.04, 2 * 32, dtype=np.float32).reshape(1, 2, 1, 32)
    scales = [(name, None) for name in _formats.BLOCK_FORMATS]
    for name in _formats.GIVEN_FORMATS:  # a scale per tensor, then per channel, for the code range's top
        top = _formats.FORMATS[name].code_range[1]
        scales += [(name, 2.5 / top), (name, per_channel * 127 / top)]
    for fmt, scale in scales:
        for b, sq, skv in ((2, 1, 3), (2, 1, 64), (1, 1, 1500), (1, 1, 5000), (2, 4, 700), (1, 160, 160)):
            k = numkv.quantize(arr((b, 2, skv + 8, 32)), fmt, scale=scale)
            v = numkv.quantize(arr((b, 2, skv + 8, 32)), fmt, scale=scale)
            for q_name in ("float32", "float16", "bfloat16", "float64"):
                q = arr((b, 4, sq, 32), _dtype(q_name))
                kk, vv = k[:, :, :skv], v[:, :, 8:]  # sequence slices: views of the codes
                numkv.attention(q, kk, vv)
                numkv.attention(q, kk, vv, is_causal=True, softcap=30.0, scale=0.2)
                numkv.attention(q, kk, vv, attn_mask=rng.random((sq, skv)) < 0.8)
                numkv.attention(q, kk, vv, attn_mask=arr((b, 1, sq, skv), np.float32 if q_name != "float64"
                                                         else np.float64))
                numkv.attention(q, kk, vv, nonpad_kv_seqlen=np.full(b, max(1, skv - 2)), is_causal=True,
                                left_window_size=7, right_window_size=0)
                numkv.attention(q, kk[:, :, :1], vv[:, :, :1], past_key=kk[:, :, 1:],
                                past_value=vv[:, :, 1:], is_causal=True)
            update = arr((b, 2, 3, 32))
            starts = np.array([0, 5][:b])
            numkv.tensor_scatter(k, update, starts, out=k)
            numkv.tensor_scatter(k, numkv.quantize(update, fmt, scale=scale), starts - 6, mode="circular", out=k)
            numkv.tensor_scatter(k, update, starts)
    for fmt in _formats.BLOCK_FORMATS:
        for mode, window in (("linear", None), ("circular", 24)):
            for b, capacity in ((2, 40), (4, 2048)):
                cache = numkv.StaticKVCache(b, 2, capacity, 64, dtype=fmt, v_head_dim=32, mode=mode,
                                            window=window)
                for new, q_name in ((7, "float32"), (1, "float32"), (1, "bfloat16"), (1, "float16")):
                    cache.append(arr((b, 2, new, 64), _dtype(q_name)), arr((b, 2, new, 32), _dtype(q_name)),
                                 lengths=np.full(b, new) - (np.arange(b) % 2) * (new > 1))
                    numkv.attention(arr((b, 4, new, 64), _dtype(q_name)), **cache.attention_inputs())


def _pool_group():
    """The pool's own functions (``_runtime.protocol``): the workers' loop,
    the empty kernel a launch is timed with, the join after an error."""
    from numkv._runtime import control, pool, protocol

    before = numkv.get_num_threads()
    numkv.set_num_threads(2)
    try:
        pool.run(protocol.empty, 2, ())  # (compiles the workers' loop as it starts them)
    finally:
        numkv.set_num_threads(before)
    protocol.join_after_error(control.new_ctrl())  # (a ctrl that ran no job: nothing to join)


LOW = ("float16", "bfloat16", *FLOAT8)

# In the order they start: the groups that compile the most first (float32
# and float64 attention: one kernel per accumulation dtype, which every other
# dtype family reuses), so that parallel workers start on those.
GROUPS = {
    "attention float32": lambda: _attention_group("float32", ["float32"]),
    "attention float64": lambda: _attention_group("float64", ["float64"]),
    "tensor_scatter": _scatter_group,
    "the pool": _pool_group,
    "attention float16": lambda: _attention_group("float16", ["float16"]),
    "attention bfloat16": lambda: _attention_group("bfloat16", ["bfloat16"]),
    "attention float8": lambda: [_attention_group(n, [n]) for n in FLOAT8],
    "attention float32 Q + low-precision K/V": lambda: _attention_group("float32", LOW),
    "attention softmax_precision=11": lambda: [_attention_group(n, [n], softmax_precision=11)
                                               for n in ("float32", "float16", "bfloat16")],
    "attention quantised K/V": _quantized_group,
}


# -- running them -------------------------------------------------------------

def add_parser(subparsers):
    names = "; ".join(GROUPS)
    p = subparsers.add_parser(
        "warmup", help="compile every kernel into numba's disk cache ahead of time",
        description=__doc__.split("\n\n")[0].replace("``", "`")
        + f" Groups: {names}.  The cache is NUMBA_CACHE_DIR if set (and writable), else "
          "__pycache__ beside numkv's kernels, else numba's per-user directory.")
    from numkv._cli.options import MAX_WORKERS, count

    p.add_argument("--jobs", "-j", type=count(1, MAX_WORKERS), default=None, metavar="N",
                   help="processes compiling at once (default: one per CPU, at most one per group; "
                        "1 compiles in this process)")
    p.add_argument("--group", action="append", choices=list(GROUPS), metavar="NAME",
                   help="compile only this group (repeatable); one of: " + names)
    p.add_argument("--verbose", "-v", action="store_true",
                   help="list each kernel compiled, with its argument types")
    p.set_defaults(run=run)
    return p


def _cache_save():
    """``(fcntl, numba's cache index class, its save)``, or None where one
    is missing (not Unix, another numba)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not Unix
        return None
    from numkv._kernels.compiler import cache_index_file

    index = cache_index_file()
    return None if index is None else (fcntl, index, index.save)


def _serialise_cache_writes(lock_path):
    """Make numba's cache writes in this process take ``lock_path``'s lock
    (see the module docstring).  Returns whether it could."""
    found = _cache_save()
    if found is None:
        return False
    fcntl, index, save = found

    def locked_save(self, key, data):
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            # save() re-reads the index under the lock: entries written by
            # other processes meanwhile are kept, and data numbers are unique.
            return save(self, key, data)

    index.save = locked_save
    return True


def _can_serialise():
    return _cache_save() is not None


def _init_worker(lock_path):
    if not _serialise_cache_writes(lock_path):
        raise RuntimeError("cannot serialise numba's cache writes in this process")


def run_group(name):
    """Run one group (in this process): ``(name, kernels compiled, seconds)``,
    each kernel as ``"name(argument types)"``."""
    watch = CompileWatch()
    start = time.perf_counter()
    with watch.installed():
        GROUPS[name]()
    return name, watch.kernels, time.perf_counter() - start


def run(args):
    from numkv._cli.info import cache_location

    names = [n for n in GROUPS if n in (args.group or GROUPS)]
    path, note = cache_location()
    print(f"numkv {numkv.__version__} warmup: compiling numkv's kernels into numba's disk cache")
    print(f"  cache: {path or '-'}  ({note})")
    if path is None:
        raise SystemExit("warmup: no disk cache to fill (see above)")
    # More processes than groups would only start idle interpreters.
    jobs = min(args.jobs or thread_count.cores(), len(names))
    if jobs > 1 and not _can_serialise():
        print("  (numba's cache writes can't be serialised here: one group at a time)")
        jobs = 1
    print(f"  {len(names)} groups, {jobs} process{'es' if jobs > 1 else ''} (measured on 2 shared cores: "
          f"25-65 s from a cold cache, about 5 s when already cached)", flush=True)
    start = time.perf_counter()
    results = _run_in_process(names) if jobs == 1 else _run_in_pool(names, jobs)
    failed, total = [], 0
    for i, (name, result) in enumerate(results, 1):
        if isinstance(result, BaseException):
            failed.append(name)
            line = f"FAILED: {type(result).__name__}: {result}"
        else:
            _, kernels, seconds = result
            compiled = len(kernels)
            total += compiled
            line = (f"compiled {compiled} kernel{'s' if compiled != 1 else ''} in {seconds:.1f} s" if compiled
                    else f"already cached ({seconds:.1f} s)")
        print(f"  [{i}/{len(names)}] {name:<40} {line}  "
              f"[{time.perf_counter() - start:.0f} s]", flush=True)
        if args.verbose and not isinstance(result, BaseException):
            for kernel in result[1]:
                print(f"        {kernel}")
    elapsed = time.perf_counter() - start
    print(f"done in {elapsed:.1f} s: {total} kernels compiled, "
          f"{len(names) - len(failed)} of {len(names)} groups ready in {path}")
    if failed:
        raise SystemExit(f"warmup: {len(failed)} group(s) failed: {', '.join(failed)}")


def _run_in_process(names):
    for name in names:
        try:
            yield name, run_group(name)
        except Exception as exc:
            yield name, exc


def _run_in_pool(names, jobs):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with tempfile.TemporaryDirectory(prefix="numkv-warmup-") as tmp:
        lock_path = os.path.join(tmp, "numba-cache.lock")
        context = multiprocessing.get_context("spawn")
        # Each worker wraps numba's cache writes once, before its first group.
        with ProcessPoolExecutor(jobs, mp_context=context, initializer=_init_worker,
                                 initargs=(lock_path,)) as pool:
            futures = {pool.submit(run_group, name): name for name in names}
            for future in as_completed(futures):
                try:
                    yield futures[future], future.result()
                except Exception as exc:
                    yield futures[future], exc

