"""``python -m numkv bench``: numkv's speed beside the reference and the peers.

Times the public API (``numkv.tensor_scatter``, ``numkv.attention``) on a few
fixed cases next to NumPy, ``onnx.reference`` (the executable ONNX spec) and,
when installed, onnxruntime and torch.  Each figure is the median over
repeated samples of the time per call, the implementations of a case sampled
in turn; the first call of each implementation (numba's compilation,
onnxruntime's session warm-up) is made before timing.
The ratio column is each time divided by numkv's (above 1: slower than numkv).

This is a quick side-by-side; the asv suite (``asv_benchmarks/``) is the
tracked, parameterised one.
"""

import importlib.util
import os
import platform
import statistics
import sys
import time

import numpy as np

import numkv
from numkv._config import runtime_info, set_threads

CACHE_SHAPE = (4, 8, 4096, 128)  # (batch, kv heads, max_seq, head_dim)
WRITE_INDICES = np.array([0, 1000, 2048, 4095], np.int64)  # each row at its own length
DECODE = dict(batch=1, q_heads=32, kv_heads=8, q_len=1, kv_len=4096, head_size=128)
PREFILL = dict(batch=1, q_heads=8, kv_heads=8, q_len=2048, kv_len=2048, head_size=128)


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "bench", help="numkv's speed beside onnx.reference and the installed peers",
        description="numkv's speed beside NumPy, onnx.reference and the installed peers "
                    "(onnxruntime, torch): medians of repeated runs, ratios to numkv.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="fewer, shorter samples (a rough figure in seconds)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="threads for numkv (numba), onnxruntime and torch (default: their own, "
                             "usually one per core)")
    parser.set_defaults(run=run)
    return parser


# -- timing -------------------------------------------------------------------

def measure(fns, repeats, min_sample=0.02, budget=10.0):
    """Median seconds per call of each of ``fns``, over ``repeats`` samples each;
    a sample runs its ``fn`` enough times to last ``min_sample`` seconds, and a
    slow ``fn`` (one call longer than ``budget / repeats``) gets fewer samples,
    at least 3.  The samples are taken in turn, one of each ``fn`` per round,
    so a slow spell of a shared machine falls on every implementation alike."""
    counts = []
    for fn in fns:
        fn()  # the first call compiles / warms up: never timed
        number = 1
        while True:  # size the samples (as timeit.Timer.autorange does)
            elapsed = _sample(fn, number) * number
            if elapsed >= min_sample:
                break
            number *= 10 if elapsed < min_sample / 10 else 2
        counts.append((number, max(3, min(repeats, int(budget / max(elapsed, 1e-9))))))
    samples = [[] for _ in fns]
    for round_ in range(max(n for _, n in counts)):
        for fn, (number, n), got in zip(fns, counts, samples):
            if round_ < n:
                got.append(_sample(fn, number))
    return [statistics.median(got) for got in samples]


def _sample(fn, number):
    """Seconds per call of ``fn`` over ``number`` calls."""
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def _fmt_time(seconds):
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:8.2f} {unit:<2}"
    return f"{seconds / 1e-9:8.1f} ns"


def _have(module):
    return importlib.util.find_spec(module) is not None


def _set_threads(n):
    """Thread counts for the three runtimes.  numkv's kernels are numba's:
    NUMBA_NUM_THREADS before numba is imported, ``set_num_threads`` after."""
    if n is None:
        return
    if n < 1:
        raise SystemExit("--threads must be >= 1")
    set_threads(n)
    if "torch" in sys.modules or _have("torch"):
        import torch

        torch.set_num_threads(n)


# -- the implementations --------------------------------------------------------

def _onnx_model(node, inputs, outputs, opset):
    from onnx import helper

    graph = helper.make_graph([node], node.op_type, [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _scatter_model():
    from onnx import TensorProto as tp, helper

    node = helper.make_node("TensorScatter", ["past", "update", "write_indices"], ["present"],
                            axis=-2, mode="linear")
    return _onnx_model(node, [("past", tp.FLOAT), ("update", tp.FLOAT), ("write_indices", tp.INT64)],
                       [("present", tp.FLOAT)], opset=24)


def _attention_model(is_causal):
    from onnx import TensorProto as tp, helper

    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=int(is_causal))
    return _onnx_model(node, [("Q", tp.FLOAT), ("K", tp.FLOAT), ("V", tp.FLOAT)], [("Y", tp.FLOAT)], opset=23)


def _ort_session(model, threads):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # TensorScatter logs a warning on every copying run
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _numpy_assign(dst, update, starts):
    for b, w in enumerate(starts):
        dst[b, :, w:w + update.shape[2]] = update[b]
    return dst


def _copy_into(dst, src):
    np.copyto(dst, src)
    return dst


def scatter_cases(threads):
    """(title, [(label, fn)]) for the three forms of a 1-token update."""
    rng = np.random.default_rng(0)
    past = rng.standard_normal(CACHE_SHAPE, dtype=np.float32)
    update = rng.standard_normal(CACHE_SHAPE[:2] + (1,) + CACHE_SHAPE[3:], dtype=np.float32)
    other = np.zeros_like(past)
    idx, starts = WRITE_INDICES, WRITE_INDICES.tolist()
    shape = "x".join(map(str, CACHE_SHAPE))

    ref = ort = None
    if _have("onnx"):
        from onnx.reference import ReferenceEvaluator

        ref = ReferenceEvaluator(_scatter_model())
    if _have("onnxruntime") and _have("onnx"):
        import onnxruntime

        ort = _ort_session(_scatter_model(), threads)

        def bound(out):
            io = ort.io_binding()
            io.bind_cpu_input("past", past)
            io.bind_cpu_input("write_indices", idx)
            # Bound to the cache's own buffer, onnxruntime skips its copy (in place).
            io.bind_output("present", "cpu", 0, np.float32, out.shape, out.ctypes.data)

            def call():  # a new update every step, as in a decode loop
                io.bind_ortvalue_input("update", onnxruntime.OrtValue.ortvalue_from_numpy(update))
                ort.run_with_iobinding(io)

            return call

    feed = {"past": past, "update": update, "write_indices": idx}
    in_place = [
        ("numkv tensor_scatter(out=cache)", lambda: numkv.tensor_scatter(past, update, idx, out=past)),
        ("numpy per-row slice assignment", lambda: _numpy_assign(past, update, starts)),
    ]
    functional = [
        ("numkv tensor_scatter()", lambda: numkv.tensor_scatter(past, update, idx)),
        ("numpy past.copy() + assignment", lambda: _numpy_assign(past.copy(), update, starts)),
    ]
    out_other = [
        ("numkv tensor_scatter(out=other)", lambda: numkv.tensor_scatter(past, update, idx, out=other)),
        ("numpy np.copyto + assignment", lambda: _numpy_assign(_copy_into(other, past), update, starts)),
    ]
    if ort is not None:
        in_place.append(("onnxruntime TensorScatter (IOBinding, in place)", bound(past)))
        functional.append(("onnxruntime TensorScatter (run)", lambda: ort.run(None, feed)))
        out_other.append(("onnxruntime TensorScatter (IOBinding, out=other)", bound(other)))
    if ref is not None:  # the reference has one form: it returns a new array
        for impls in (in_place, functional, out_other):
            impls.append(("onnx.reference TensorScatter (new array)", lambda: ref.run(None, feed)))
    return [
        (f"tensor_scatter: 1-token append, in place, {shape} float32, per-row write_indices", in_place),
        (f"tensor_scatter: 1-token update, functional (new array), {shape} float32", functional),
        (f"tensor_scatter: 1-token update into another buffer (out=other), {shape} float32", out_other),
    ]


def attention_case(name, dims, is_causal, threads):
    """(title, [(label, fn)]) for one attention shape; each ``fn`` returns Y."""
    rng = np.random.default_rng(1)
    b, hq, hkv, sq, skv, d = (dims[k] for k in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_size"))
    q = rng.standard_normal((b, hq, sq, d), dtype=np.float32)
    k = rng.standard_normal((b, hkv, skv, d), dtype=np.float32) * np.float32(d ** -0.25)
    v = rng.standard_normal((b, hkv, skv, d), dtype=np.float32)
    feed = {"Q": q, "K": k, "V": v}
    impls = [("numkv attention", lambda: numkv.attention(q, k, v, is_causal=is_causal))]
    if _have("onnxruntime") and _have("onnx"):
        session = _ort_session(_attention_model(is_causal), threads)
        impls.append(("onnxruntime Attention (opset 23)", lambda: session.run(None, feed)[0]))
    if _have("torch"):
        import torch

        tq, tk, tv = map(torch.from_numpy, (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def torch_call():
            with torch.inference_mode():
                return sdpa(tq, tk, tv, is_causal=is_causal, enable_gqa=hq != hkv).numpy()

        impls.append((f"torch {torch.__version__} scaled_dot_product_attention", torch_call))
    if _have("onnx"):
        from onnx.reference import ReferenceEvaluator

        ref = ReferenceEvaluator(_attention_model(is_causal))
        impls.append(("onnx.reference Attention", lambda: ref.run(None, feed)[0]))
    title = (f"attention: {name}, B={b} Hq={hq} Hkv={hkv} D={d} Sq={sq} Skv={skv}"
             f"{' causal' if is_causal else ''}, float32")
    return title, impls


# -- the report --------------------------------------------------------------------

def _report(title, impls, repeats, budget, check):
    print(f"\n{title}")
    runnable = []
    for label, fn in impls:
        try:
            fn()
        except Exception as e:  # a peer that can't run this case: say so, go on
            print(f"  {label:<52} failed: {type(e).__name__}: {str(e)[:120]}")
        else:
            runnable.append((label, fn))
    if not runnable:
        return
    times = measure([fn for _, fn in runnable], repeats, budget=budget)
    expected = np.asarray(runnable[0][1]()) if check else None
    for (label, fn), seconds in zip(runnable, times):
        note = ""
        if check and fn is not runnable[0][1]:
            note = f"  max|dY| {float(np.max(np.abs(np.asarray(fn()) - expected))):.1e}"
        print(f"  {label:<52} {_fmt_time(seconds)}  {seconds / times[0]:7.2f}x{note}")
    sys.stdout.flush()


def _versions():
    parts = [f"numpy {np.__version__}", f"numba {runtime_info()[0]}"]
    for module in ("onnx", "onnxruntime", "torch"):
        if _have(module):
            parts.append(f"{module} {__import__(module).__version__}")
        else:
            parts.append(f"{module}: not installed")
    return ", ".join(parts)


def run(args):
    threads = args.threads
    _set_threads(threads)
    repeats, budget = (3, 2.0) if args.quick else (15, 10.0)

    print(f"numkv {numkv.__version__} bench on {platform.machine()} ({os.cpu_count()} CPUs), "
          f"Python {platform.python_version()}")
    print(f"  {_versions()}")
    print(f"  numkv threads: {runtime_info()[1]}"
          + (f" (--threads {threads} for every runtime)" if threads else " (each runtime's default)"))
    print(f"  median time per call over up to {repeats} samples; ratio = time / numkv's time")

    for title, impls in scatter_cases(threads):
        _report(title, impls, repeats, budget, check=False)
    if hasattr(numkv, "attention"):
        for name, dims, causal in (("decode", DECODE, False), ("causal prefill", PREFILL, True)):
            title, impls = attention_case(name, dims, causal, threads)
            _report(title, impls, repeats, budget, check=True)
    else:
        print("\nattention: not in this numkv")
    return 0
