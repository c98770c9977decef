"""numkv.tensor_scatter on a (batch 4, heads 8, max_seq 4096, head_dim 128) cache,
beside its peers: NumPy slice assignment and onnxruntime's TensorScatter.

Every class takes the same parameters, so ``asv compare`` lines them up:

* ``dtype``: float32, bfloat16, float8_e4m3fn, int4, complex64;
* ``mode``: linear or circular (the circular write indices wrap, one is negative);
* ``form``: "in place" (``out=past_cache``, O(update): a KV cache append),
  "functional" (``out=None``: a new cache), "out=other" (a copy into another
  preallocated buffer);
* ``update_len``: 1 (a decode step) or 512 (a prefill chunk).

Each batch row writes at its own position (``write_indices``).
"""

import timeit

import numpy as np

from ._common import filled, require, reuse, dtype, ort_session, onnx_tensor_scatter_model

SHAPE = (4, 8, 4096, 128)
DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int4", "complex64"]
MODES = ["linear", "circular"]
FORMS = ["in place", "functional", "out=other"]
UPDATE_LENS = [1, 512]
PARAMS = [DTYPES, MODES, FORMS, UPDATE_LENS]
PARAM_NAMES = ["dtype", "mode", "form", "update_len"]


def write_indices(mode, update_len, max_seq=SHAPE[2]):
    """Per-row start positions: spread over the cache; in circular mode two
    rows wrap around the end and one index is negative."""
    if mode == "linear":
        return np.array([0, 1000, 2048, max_seq - update_len], np.int64)
    return np.array([max_seq - 1, 1000, -3, 2 * max_seq - update_len // 2], np.int64)


class _ScatterCase:
    """Shared setup: the cache (reused across asv's repeated setups), the update,
    the indices and the output buffer for the form."""

    params = PARAMS
    param_names = PARAM_NAMES
    timer = timeit.default_timer

    def _arrays(self, dtype_name, mode, form, update_len):
        dt = dtype(dtype_name)
        self.past, self.other = reuse(
            ("scatter", dtype_name, form),
            lambda: (filled(SHAPE, dt, 1), filled(SHAPE, dt, 0) if form == "out=other" else None),
        )
        self.update = filled(SHAPE[:2] + (update_len,) + SHAPE[3:], dt, 2)
        self.write_indices = write_indices(mode, update_len)
        self.out = {"in place": self.past, "functional": None, "out=other": self.other}[form]


class TensorScatter(_ScatterCase):
    """numkv.tensor_scatter."""

    def setup(self, dtype_name, mode, form, update_len):
        import numkv

        self._arrays(dtype_name, mode, form, update_len)
        self.scatter = numkv.tensor_scatter
        self.mode = mode
        self.time_tensor_scatter(dtype_name, mode, form, update_len)  # compile outside the timing

    def time_tensor_scatter(self, dtype_name, mode, form, update_len):
        self.scatter(self.past, self.update, self.write_indices, mode=self.mode, out=self.out)


def numpy_assign(dst, update, starts, max_seq):
    """Per-row slice assignment along axis 2, a wrapping write as two slices.
    ``starts`` are Python ints already taken modulo ``max_seq`` where needed."""
    n = update.shape[2]
    for b, w in enumerate(starts):
        head = min(n, max_seq - w)
        dst[b, :, w:w + head] = update[b, :, :head]
        if head < n:
            dst[b, :, :n - head] = update[b, :, head:]
    return dst


class NumpyScatter(_ScatterCase):
    """Peer: NumPy.  In place: per-row slice assignment; functional:
    ``past.copy()`` + slice assignment; out=other: ``np.copyto`` + slice assignment."""

    def setup(self, dtype_name, mode, form, update_len):
        self._arrays(dtype_name, mode, form, update_len)
        starts = self.write_indices % SHAPE[2] if mode == "circular" else self.write_indices
        self.starts = starts.tolist()
        self.form = form
        self.time_numpy(dtype_name, mode, form, update_len)

    def time_numpy(self, dtype_name, mode, form, update_len):
        if self.form == "in place":
            dst = self.past
        elif self.form == "functional":
            dst = self.past.copy()
        else:
            dst = self.other
            np.copyto(dst, self.past)
        numpy_assign(dst, self.update, self.starts, SHAPE[2])


_ONNX_TYPES = {"float32": "FLOAT", "bfloat16": "BFLOAT16"}


class OnnxruntimeScatter(_ScatterCase):
    """Peer: onnxruntime's TensorScatter (a one-node opset-24 model), through
    IOBinding so that no array is converted: in place binds the output to the
    cache's own buffer (onnxruntime then skips its copy), out=other to the other
    buffer, functional lets onnxruntime allocate the output.  The update is
    wrapped and bound on every call, as in a decode loop.  onnxruntime has no
    TensorScatter kernel for float8 / int4 and no complex64 type: skipped."""

    def setup(self, dtype_name, mode, form, update_len):
        ort = require("onnxruntime")
        onnx = require("onnx")
        if dtype_name not in _ONNX_TYPES:
            raise NotImplementedError(f"onnxruntime's TensorScatter does not take {dtype_name}")
        self._arrays(dtype_name, mode, form, update_len)
        elem = getattr(onnx.TensorProto, _ONNX_TYPES[dtype_name])
        self.session = ort_session(onnx_tensor_scatter_model(elem, mode=mode))
        self.wrap = self._wrapper(ort, elem)
        self.io = self.session.io_binding()
        self.io.bind_ortvalue_input("past", self.wrap(self.past))
        # onnxruntime rejects negative (and >= max_seq) circular indices, which
        # the ONNX reference and numkv wrap: give it the same positions, wrapped.
        self.ort_indices = self.write_indices % SHAPE[2]
        self.io.bind_ortvalue_input("write_indices", ort.OrtValue.ortvalue_from_numpy(self.ort_indices))
        if self.out is None:
            self.io.bind_output("present", "cpu")
        else:
            self.io.bind_ortvalue_output("present", self.wrap(self.out))
        self.time_onnxruntime(dtype_name, mode, form, update_len)

    @staticmethod
    def _wrapper(ort, elem):
        """numpy array -> OrtValue over the same memory (bfloat16 as its bits)."""
        def wrap(a):
            if a.dtype == np.float32:
                return ort.OrtValue.ortvalue_from_numpy(a)
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), elem)
        return wrap

    def time_onnxruntime(self, dtype_name, mode, form, update_len):
        self.io.bind_ortvalue_input("update", self.wrap(self.update))
        self.session.run_with_iobinding(self.io)
