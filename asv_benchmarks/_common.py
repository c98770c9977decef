"""Helpers shared by the benchmark modules (no benchmarks here).

Conventions (the house style's "asv" rules, as scikit-image's and xarray's suites keep them):

* Every ``setup`` calls the benchmarked function once, so numba compilation (or
  loading from numba's disk cache) is never timed.
* ``timer = timeit.default_timer``: wall clock, since the kernels run on
  several threads (asv's process-time timers would count every thread).
* ``NUMKV_BENCH_QUICK=1`` skips the large cases (setup raises
  ``NotImplementedError``, which asv reports as skipped); the smoke test sets it.
* Peers (onnxruntime, torch) are optional: a missing one is a skip, never an
  error.  Nothing here imports numba, onnxruntime or torch at module import,
  so asv's forkserver parent never starts a thread pool before it forks.
"""

import importlib
import importlib.util
import os

import numpy as np

QUICK = os.environ.get("NUMKV_BENCH_QUICK", "0") not in ("", "0")

SEED = 20261121


def skip_large(is_large, what="large case"):
    """Raise ``NotImplementedError`` (asv: skipped) for a large case in quick mode."""
    if QUICK and is_large:
        raise NotImplementedError(f"{what} skipped (NUMKV_BENCH_QUICK=1)")


def require(module):
    """Import an optional peer, or skip the benchmark when it is missing."""
    if importlib.util.find_spec(module) is None:
        raise NotImplementedError(f"{module} is not installed")
    return importlib.import_module(module)


def kv_formats(which="NAMES"):
    """numkv's quantised K/V formats, from its registry (``numkv._formats``):
    every one (``"NAMES"``), or the block formats a cache quantises into
    (``"BLOCK_FORMATS"``); a numkv before the registry (issue 41): the
    formats it had.  (Importing numkv imports no numba.)"""
    try:
        from numkv import _formats
    except ImportError:
        return ["q8_0", "q4_0", "int8", "int4"] if which == "NAMES" else ["q8_0", "q4_0"]
    return list(getattr(_formats, which))


def kv_format_scale(fmt, x):
    """A per-channel scale for ``x`` in a given-scale format (``|x|.max`` over
    batch and sequence / the code range's top), None for a block format."""
    try:
        from numkv._formats import FORMATS
        record = FORMATS[fmt]
        derived, top = record.derived, record.code_range[1]
    except ImportError:
        derived, top = fmt not in ("int8", "int4"), 127 if fmt == "int8" else 7
    if derived:
        return None
    return (np.abs(x).max(axis=(0, 2), keepdims=True) / top).astype(np.float32)


def require_attr(obj, name):
    """``getattr(obj, name)``, or skip when numkv does not have it yet."""
    value = getattr(obj, name, None)
    if value is None:
        raise NotImplementedError(f"{getattr(obj, '__name__', obj)}.{name} does not exist (yet)")
    return value


def numkv_attention():
    import numkv

    return require_attr(numkv, "attention")


def dtype(name):
    """A dtype from its name: NumPy's own or an ``ml_dtypes`` type."""
    if hasattr(np, name):
        return np.dtype(name)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


# Arrays reused across asv's repeated setups within one benchmark process
# (asv re-runs setup before each timed call): filling a 64 MiB cache costs more
# than most of the calls it feeds.  One entry at a time bounds the memory.
_reuse = {}


def reuse(key, make):
    if key not in _reuse:
        _reuse.clear()
        _reuse[key] = make()
    return _reuse[key]


_warmed = set()


def warm_once(key, call):
    """Run ``call`` (the setup's untimed first call) unless this process already
    ran it for ``key``: asv re-runs ``setup`` before every sample, and a second
    untimed 2-second prefill would only double the run time."""
    if key not in _warmed:
        call()
        _warmed.add(key)


def filled(shape, dt, value=1):
    """A fully touched array (every page faulted in) of any dtype."""
    return np.full(shape, value, dtype=dt)


def randn(shape, dt=np.float32, seed=SEED, scale=1.0):
    """Standard-normal values cast to ``dt``.  Beyond 16 Mi elements a random
    block is tiled: the timings don't depend on the values, and drawing 1 GiB
    of normals would dominate setup."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    block = rng.standard_normal(min(size, 1 << 24), dtype=np.float32)
    if scale != 1.0:
        block *= scale
    if block.size < size:
        block = np.resize(block, size)
    return block.reshape(shape).astype(dt, copy=False)


def ort_session(model, threads=None):
    """An onnxruntime CPU session for an ``onnx.ModelProto`` (warnings off)."""
    ort = require("onnxruntime")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # TensorScatter warns on every non-in-place run
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def onnx_tensor_scatter_model(elem_type, mode="linear", axis=-2):
    """A one-node opset-24 TensorScatter model: (past, update, write_indices) -> present."""
    onnx = require("onnx")
    helper, tp = onnx.helper, onnx.TensorProto
    node = helper.make_node("TensorScatter", ["past", "update", "write_indices"], ["present"],
                            axis=axis, mode=mode)
    graph = helper.make_graph(
        [node], "tensor_scatter",
        [helper.make_tensor_value_info("past", elem_type, None),
         helper.make_tensor_value_info("update", elem_type, None),
         helper.make_tensor_value_info("write_indices", tp.INT64, None)],
        [helper.make_tensor_value_info("present", elem_type, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    model.ir_version = 10
    return model


def onnx_attention_model(*, opset=23, is_causal=0, mask_type=None, nonpad=False, softcap=0.0, elem_type=None,
                         **attrs):
    """A one-node Attention model, float32 unless ``elem_type`` (an onnx
    TensorProto code) says otherwise.  Inputs by name: Q, K, V, then
    ``attn_mask`` (``mask_type``: an onnx TensorProto code) and ``nonpad_kv_seqlen``
    (opset >= 24) when asked for."""
    onnx = require("onnx")
    helper, tp = onnx.helper, onnx.TensorProto
    elem_type = tp.FLOAT if elem_type is None else elem_type
    names = ["Q", "K", "V"]
    infos = [helper.make_tensor_value_info(n, elem_type, None) for n in names]
    if mask_type is not None:
        names.append("attn_mask")
        infos.append(helper.make_tensor_value_info("attn_mask", mask_type, None))
    if nonpad:
        names += [""] * (6 - len(names)) + ["nonpad_kv_seqlen"]
        infos.append(helper.make_tensor_value_info("nonpad_kv_seqlen", tp.INT64, None))
    if softcap:
        attrs["softcap"] = float(softcap)
    node = helper.make_node("Attention", names, ["Y"], is_causal=int(is_causal), **attrs)
    graph = helper.make_graph([node], "attention", infos,
                              [helper.make_tensor_value_info("Y", elem_type, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model
