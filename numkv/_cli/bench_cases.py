"""The bench's cases: workloads, their work (FLOPs, bytes) and the implementations
timed on them.  Shared by ``python -m numkv bench`` and ``bench --plot``.

An attention **workload** is one ``numkv.attention`` call in ONNX's 4-D layout
(``B, Hq, Hkv, Sq, Skv, D, Dv``) with its dtypes and masking (``is_causal``,
``nonpad_kv_seqlen``).  Its work, the same for every implementation:

* ``attended(b, i)``, the keys query row ``i`` of batch row ``b`` attends:
  ``valid_b = nonpad_kv_seqlen[b]`` (``Skv`` without an external cache); with
  ``is_causal`` (bottom-right, ``offset = valid_b - Sq``)
  ``max(0, min(valid_b, i + offset + 1))``, else ``valid_b``.
* FLOPs (the prefill figure) ``= Hq * sum_b sum_i attended(b, i) * 2 * (D + Dv)``:
  a multiply and an add per element of ``Q K^T`` and of ``P V``; softmax's
  exponentials are not counted.  A causal prefill with ``Sq = Skv = S`` does
  ``Hq * S (S + 1) / 2 * 2 * (D + Dv)``.
* bytes (the decode figure) ``= sum_b Hkv * max_i attended(b, i) * (D * size(K) + Dv * size(V))
  + size(Q) * |Q| + size(Y) * |Y|``: the K and V rows the call must read, once,
  plus Q and Y, with the item sizes of the dtypes *that implementation* is given
  (a float32 peer on a bfloat16 case moves twice the bytes).

Implementations (each returns Y; its first call is never timed):

* numkv: ``numkv.attention`` on the workload's dtypes.
* onnxruntime: a one-node ``Attention`` model (opset 23; 24 with
  ``nonpad_kv_seqlen``), 4-D inputs, GQA from the shapes; float32 and, where the
  workload is narrower, the narrow dtype (onnxruntime's Attention takes one type
  for Q and K: all inputs in it; it has no bfloat16 kernel, which shows as
  "failed", and no float8 one: float16 stands in, exact for float8_e4m3fn).
* torch: ``scaled_dot_product_attention(..., enable_gqa=True)``, float32 and the
  narrow dtype (bfloat16 standing in for float8); an external cache as a boolean
  mask and, for decode, as K/V sliced to each row's length.  For decode with
  GQA also "packed": each kv head's ``G`` query heads on the query axis, Q as
  ``(B, Hkv, G * Sq, D)`` against K/V ``(B, Hkv, Skv, D)``, one call without
  ``enable_gqa`` that reads each kv head once (what numkv's decode does); a
  mask is tiled ``G`` times along the query axis (row ``g * Sq + i`` is query
  ``i``), so causal and external-cache masks stay right.
* onnx.reference (the executable spec) and NumPy's materialised
  matmul-softmax-matmul, float32 only: both build the ``(B, Hq, Sq, Skv)`` score
  matrix, so they are skipped (and the line says so) above ``REFERENCE_MAX_SCORES``
  and ``NUMPY_MAX_SCORES`` elements; the reference runs on float32 workloads only.

Narrow inputs are drawn in float32, rounded to the workload's dtype, and the
float32 peers get those values widened back (exactly): every implementation
computes the same function, so ``max|dY|`` shows only rounding.
"""

import importlib.util
import re
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

import numkv
from numkv import _formats

# Score matrices larger than these (elements) are not materialised: the
# reference at 2**23 (32 MiB of float32) already takes about a second.
REFERENCE_MAX_SCORES = 1 << 23
NUMPY_MAX_SCORES = 1 << 25

PEERS = ("numkv", "onnxruntime", "torch", "onnx.reference", "numpy")


# -- cases ----------------------------------------------------------------------

@dataclass
class Impl:
    """One implementation of a case: ``fn()`` runs it (returns Y, or None for a
    scatter); ``work`` is its FLOPs or bytes (see the module docstring).  A
    ``fn`` of None is not run and ``note`` says why."""

    label: str
    peer: str
    fn: Optional[Callable] = None
    work: Optional[float] = None
    note: str = ""


@dataclass
class Case:
    """A named set of implementations of the same work.  ``limit`` is the
    machine limit its "% of limit" column divides by: "gemm" (FLOPs / s over the
    GEMM rate), "read" (bytes / s over the read bandwidth) or None."""

    id: str
    title: str
    build: Callable[[], list]
    limit: Optional[str] = None
    check: bool = True
    min_samples: int = 3
    # Timed call by call: the median of ``calls`` single calls of each
    # implementation (alternating), each after ``gap`` seconds of other work
    # on the caller (0: back to back); None: samples of many calls.
    gap: Optional[float] = None
    calls: int = 0


def select(cases, pattern):
    """The cases whose id or title matches the regular expression ``pattern``."""
    if not pattern:
        return list(cases)
    regex = re.compile(pattern)
    return [c for c in cases if regex.search(c.id) or regex.search(c.title)]


def have(module):
    return importlib.util.find_spec(module) is not None


def _attempt(label, peer, make, work=None):
    """``Impl(label, peer, make(), work)``, or a failed one if ``make`` raises
    (e.g. onnxruntime has no kernel for a dtype)."""
    try:
        return Impl(label, peer, make(), work)
    except Exception as e:
        return Impl(label, peer, None, work, note=f"failed: {type(e).__name__}: {str(e)[:120]}")


# -- attention workloads ------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """One attention call: shapes, dtypes (names: numpy's or ml_dtypes') and masking."""

    kind: str                      # "causal prefill", "full prefill", "decode", ...
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_size: int
    is_causal: bool = False
    q_dtype: str = "float32"
    kv_dtype: str = "float32"
    nonpad: Optional[tuple] = None  # valid keys per batch row (an external cache)

    @property
    def v_head_size(self):
        return self.head_size

    @property
    def limit(self):
        """Decode (one query row) is bound by reading K/V, prefill by arithmetic."""
        return "read" if self.q_len == 1 else "gemm"

    @property
    def score_elements(self):
        return self.batch * self.q_heads * self.q_len * self.kv_len

    def valid_lengths(self):
        if self.nonpad is None:
            return np.full(self.batch, self.kv_len, np.int64)
        return np.asarray(self.nonpad, np.int64)

    def attended(self):
        """``(batch, q_len)``: the keys each query row attends."""
        valid = self.valid_lengths()[:, None]
        if not self.is_causal:
            return np.broadcast_to(valid, (self.batch, self.q_len)).copy()
        # The causal offset (API.md): nonpad_kv_seqlen[b] - Sq with an external
        # cache, else 0 (top-left).
        offset = valid - self.q_len if self.nonpad is not None else 0
        rows = np.arange(self.q_len)[None, :]
        return np.clip(rows + offset + 1, 0, valid)

    def flops(self):
        return float(self.q_heads * self.attended().sum() * 2 * (self.head_size + self.v_head_size))

    def bytes_moved(self, q_size, kv_size, y_size):
        """Bytes the call must move with these item sizes: the attended K and V
        rows read once, Q read, Y written."""
        keys = self.attended().max(axis=1).sum()
        kv = self.kv_heads * keys * (self.head_size + self.v_head_size) * kv_size
        q = self.batch * self.q_heads * self.q_len * self.head_size * q_size
        y = self.batch * self.q_heads * self.q_len * self.v_head_size * y_size
        return float(kv + q + y)

    def work(self, q_dtype, kv_dtype):
        """FLOPs (prefill) or bytes (decode) for an implementation given these dtypes."""
        if self.limit == "gemm":
            return self.flops()
        q_size, kv_size = _dtype(q_dtype).itemsize, _dtype(kv_dtype).itemsize
        return self.bytes_moved(q_size, kv_size, q_size)

    @property
    def narrow_dtype(self):
        """The workload's narrowest input dtype (None when all float32)."""
        for name in (self.kv_dtype, self.q_dtype):
            if name != "float32":
                return name
        return None

    @property
    def id(self):
        parts = [self.kind.replace(" ", "-")]
        if self.batch != 1:
            parts.append(f"B{self.batch}")
        if (self.q_heads, self.kv_heads, self.head_size) != (32, 8, 128):
            parts.append(f"Hq{self.q_heads}-Hkv{self.kv_heads}-D{self.head_size}")
        parts.append(f"S{self.q_len}" if self.q_len == self.kv_len else f"Skv{self.kv_len}")
        if self.q_dtype == self.kv_dtype:
            parts.append(self.q_dtype)
        elif self.q_dtype == "float32":
            parts.append(f"kv-{self.kv_dtype}")
        else:
            parts.append(f"q-{self.q_dtype}-kv-{self.kv_dtype}")
        return "-".join(parts)

    @property
    def title(self):
        seq = f"S={self.q_len}" if self.q_len == self.kv_len else f"Sq={self.q_len} Skv={self.kv_len}"
        text = (f"attention: {self.kind}, B={self.batch} Hq={self.q_heads} Hkv={self.kv_heads} "
                f"D={self.head_size} {seq}")
        if self.nonpad is not None:
            text += f", nonpad_kv_seqlen={list(self.nonpad)}"
        if self.is_causal and "causal" not in self.kind:
            text += ", is_causal"
        return f"{text}, numkv in {_dtypes_label(self.q_dtype, self.kv_dtype)}"


def _dtype(name):
    if hasattr(np, name):
        return np.dtype(name)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def _dtypes_label(q_dtype, kv_dtype):
    return q_dtype if q_dtype == kv_dtype else f"Q {q_dtype}, K/V {kv_dtype}"


# The workloads of issue 10 (prefill: the compute core) and issue 11 (decode).
HQ, HKV, D = 32, 8, 128
EXTERNAL_CACHE_LENGTHS = (1024, 2048, 3072, 4096)  # rows of a capacity-4096 static cache


def causal_prefill(seq_len, dtype="float32"):
    return Workload("causal prefill", 1, HQ, HKV, seq_len, seq_len, D, True, dtype, dtype)


def decode(kv_len, kv_dtype="float32", batch=1):
    return Workload("decode", batch, HQ, HKV, 1, kv_len, D, False, "float32", kv_dtype)


def prefill_workloads():
    loads = [causal_prefill(s, dt) for s in (512, 2048) for dt in ("float32", "float16", "bfloat16")]
    loads.append(Workload("full prefill", 1, HQ, HKV, 1024, 1024, D, False))
    return loads


def decode_workloads():
    loads = [decode(n) for n in (1024, 4096, 16384)]
    loads += [decode(16384, dt) for dt in ("float16", "bfloat16", "float8_e4m3fn")]
    loads.append(decode(2048, batch=8))
    cap = max(EXTERNAL_CACHE_LENGTHS)
    loads.append(Workload("external-cache decode", len(EXTERNAL_CACHE_LENGTHS), HQ, HKV, 1, cap, D,
                          True, nonpad=EXTERNAL_CACHE_LENGTHS))
    # Decode steps of transformers-sized models: Qwen2.5-0.5B-like heads, and
    # Llama-3.2-1B's (32 query heads, 8 kv heads, head size 64).
    loads.append(Workload("decode", 1, 16, 4, 1, 1088, 64))
    loads.append(Workload("decode", 1, 32, 8, 1, 2048, 64))
    return loads


def inputs(w, seed=1):
    """Q, K, V in the workload's dtypes (K scaled to keep softmax away from one-hot)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((w.batch, w.q_heads, w.q_len, w.head_size), dtype=np.float32)
    k = rng.standard_normal((w.batch, w.kv_heads, w.kv_len, w.head_size), dtype=np.float32)
    k *= np.float32(w.head_size ** -0.25)
    v = rng.standard_normal((w.batch, w.kv_heads, w.kv_len, w.v_head_size), dtype=np.float32)
    return q.astype(_dtype(w.q_dtype)), k.astype(_dtype(w.kv_dtype)), v.astype(_dtype(w.kv_dtype))


def attention_impls(w, threads=None, peers=PEERS):
    """The implementations of workload ``w`` (numkv first) among ``peers``."""
    q, k, v = inputs(w)
    wide = tuple(a.astype(np.float32) for a in (q, k, v))
    impls = [_numkv_impl(w, q, k, v)]
    if "onnxruntime" in peers and have("onnxruntime") and have("onnx"):
        impls += [_ort_impl(w, wide, name, threads) for name in _peer_dtypes(w, "float16")]
    if "torch" in peers and have("torch"):
        for name in _peer_dtypes(w, "bfloat16"):
            impls.append(_torch_impl(w, wide, name, sliced=False))
            if w.nonpad is not None and w.q_len == 1:
                impls.append(_torch_impl(w, wide, name, sliced=True))
            if w.q_len == 1 and w.q_heads > w.kv_heads:  # decode with GQA
                impls.append(_torch_impl(w, wide, name, sliced=False, packed=True))
                if w.nonpad is not None:
                    impls.append(_torch_impl(w, wide, name, sliced=True, packed=True))
    if "onnx.reference" in peers and have("onnx") and w.narrow_dtype is None:
        impls.append(_reference_impl(w, wide))
    if "numpy" in peers:
        impls.append(_numpy_impl(w, wide))
    return impls


def _peer_dtypes(w, float8_stand_in):
    """A peer runs float32 and, for a narrow workload, that dtype (a peer without
    float8 attention gets ``float8_stand_in``, which holds float8_e4m3fn exactly)."""
    narrow = w.narrow_dtype
    if narrow is None:
        return ["float32"]
    return ["float32", float8_stand_in if narrow.startswith("float8") else narrow]


def attention_case(w, threads=None, peers=PEERS, min_samples=5):
    return Case(w.id, w.title, lambda: attention_impls(w, threads, peers), limit=w.limit,
                check=True, min_samples=min_samples)


def _numkv_impl(w, q, k, v):
    kwargs = _numkv_kwargs(w)
    return Impl(f"numkv attention ({_dtypes_label(w.q_dtype, w.kv_dtype)})", "numkv",
                lambda: numkv.attention(q, k, v, **kwargs), w.work(w.q_dtype, w.kv_dtype))


def _numkv_kwargs(w):
    kwargs = {"is_causal": w.is_causal}
    if w.nonpad is not None:
        kwargs["nonpad_kv_seqlen"] = w.valid_lengths()
    return kwargs


# -- onnxruntime and the reference: a one-node Attention model ------------------------

def onnx_model(node, inputs_, outputs, opset):
    """A one-node model; ``inputs_``/``outputs``: (name, TensorProto type) pairs."""
    from onnx import helper

    graph = helper.make_graph([node], node.op_type,
                              [helper.make_tensor_value_info(n, t, None) for n, t in inputs_],
                              [helper.make_tensor_value_info(n, t, None) for n, t in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


_ONNX_TYPES = {"float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}


def attention_model(w, dtype_name="float32"):
    """``w`` as a one-node Attention model (opset 24 with ``nonpad_kv_seqlen``)."""
    from onnx import TensorProto, helper

    elem = getattr(TensorProto, _ONNX_TYPES[dtype_name])
    names = ["Q", "K", "V"]
    typed = [(n, elem) for n in names]
    if w.nonpad is not None:
        names += ["", "", "", "nonpad_kv_seqlen"]
        typed.append(("nonpad_kv_seqlen", TensorProto.INT64))
    node = helper.make_node("Attention", names, ["Y"], is_causal=int(w.is_causal))
    return onnx_model(node, typed, [("Y", elem)], opset=24 if w.nonpad is not None else 23)


def ort_session(model, threads=None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # TensorScatter logs a warning on every copying run
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _ort_impl(w, wide, dtype_name, threads):
    label = f"onnxruntime Attention opset {24 if w.nonpad is not None else 23} ({dtype_name})"

    def make():
        session = ort_session(attention_model(w, dtype_name), threads)
        feed = dict(zip("QKV", (a.astype(_dtype(dtype_name), copy=False) for a in wide)))
        if w.nonpad is not None:
            feed["nonpad_kv_seqlen"] = w.valid_lengths()
        if dtype_name == "bfloat16":  # numpy has no bfloat16: hand over the bits
            return _ort_bits_call(session, feed)
        return lambda: session.run(None, feed)[0]

    return _attempt(label, "onnxruntime", make, w.work(dtype_name, dtype_name))


def _ort_bits_call(session, feed):
    import onnxruntime as ort
    from onnx import TensorProto

    values = {name: (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), TensorProto.BFLOAT16)
                     if a.dtype.itemsize == 2 else ort.OrtValue.ortvalue_from_numpy(a))
              for name, a in feed.items()}
    return lambda: session.run_with_ort_values(["Y"], values)[0]


def _reference_impl(w, wide):
    label = "onnx.reference Attention (float32)"
    if w.score_elements > REFERENCE_MAX_SCORES:
        return Impl(label, "onnx.reference", note=_too_big(w, REFERENCE_MAX_SCORES))

    def make():
        from onnx.reference import ReferenceEvaluator

        ref = ReferenceEvaluator(attention_model(w))
        feed = dict(zip("QKV", wide))
        if w.nonpad is not None:
            feed["nonpad_kv_seqlen"] = w.valid_lengths()
        return lambda: ref.run(None, feed)[0]

    return _attempt(label, "onnx.reference", make, w.work("float32", "float32"))


def _too_big(w, limit):
    mib = w.score_elements * 4 / 2 ** 20
    return f"skipped: would materialise a {mib:,.0f} MiB score matrix (limit {limit * 4 / 2 ** 20:,.0f} MiB)"


# -- torch ------------------------------------------------------------------------

def _torch_tensor(a, dtype_name):
    import torch

    if dtype_name == "bfloat16":  # torch can't read ml_dtypes' bfloat16: reinterpret the bits
        import ml_dtypes

        return torch.from_numpy(a.astype(ml_dtypes.bfloat16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a.astype(_dtype(dtype_name), copy=False)))


def keep_mask(w):
    """``(B, 1, Sq, Skv)`` bool: the keys each query attends (True), or None
    when no mask is needed (no external cache, and causal only with Sq == Skv)."""
    if w.nonpad is None and (not w.is_causal or w.q_len == w.kv_len):
        return None
    keys = np.arange(w.kv_len)[None, None, :]
    first_excluded = w.attended()[:, :, None]  # attended keys form a prefix [0, attended)
    return (keys < first_excluded)[:, None]


def _torch_impl(w, wide, dtype_name, sliced, packed=False):
    """torch's ``scaled_dot_product_attention`` on ``w``: GQA through
    ``enable_gqa``, or ``packed`` (``_packed_queries``); an external cache as
    a boolean mask, or ``sliced``: one call per batch row over its valid keys."""
    import torch

    how = ", K/V sliced per row" if sliced else (", bool mask" if w.nonpad is not None else "")
    gqa = ", GQA packed on the query axis" if packed else ""
    label = f"torch {torch.__version__} sdpa{gqa}{how} ({dtype_name})"

    def make():
        tq, tk, tv = (_torch_tensor(a, dtype_name) for a in wide)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        group = w.q_heads // w.kv_heads
        if packed:
            tq = _packed_queries(tq, w.kv_heads)

            def attend(q, k, v, mask=None):  # one call, each kv head read once
                y = sdpa(q, k, v, attn_mask=mask, scale=w.head_size ** -0.5)
                return _unpacked_heads(y, w.q_heads, w.q_len)
        else:
            def attend(q, k, v, mask=None, is_causal=False):
                return sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        if sliced:  # decode over each row's valid prefix, one call per row
            lengths = w.valid_lengths().tolist()

            def call():
                with torch.inference_mode():
                    return torch.cat([attend(tq[b:b + 1], tk[b:b + 1, :, :n], tv[b:b + 1, :, :n])
                                      for b, n in enumerate(lengths)])
            return call
        keep = keep_mask(w)
        if packed:
            mask = None if keep is None else torch.from_numpy(np.tile(keep, (1, 1, group, 1)))

            def call():
                with torch.inference_mode():
                    return attend(tq, tk, tv, mask)
            return call
        mask = None if keep is None else torch.from_numpy(keep)
        causal = w.is_causal and mask is None  # torch's is_causal is top-left: only with Sq == Skv

        def call():
            with torch.inference_mode():
                return attend(tq, tk, tv, mask, causal)
        return call

    return _attempt(label, "torch", make, w.work(dtype_name, dtype_name))


def _packed_queries(q, kv_heads):
    """``(B, Hq, Sq, D)`` as ``(B, Hkv, G * Sq, D)``: query head ``kv * G + g``
    (ONNX's GQA map, ``kv_head = q_head // G``) at rows ``g * Sq ..`` of kv
    head ``kv`` (a view: Q is contiguous)."""
    b, hq, sq, d = q.shape
    return q.reshape(b, kv_heads, (hq // kv_heads) * sq, d)


def _unpacked_heads(y, q_heads, q_len):
    """``_packed_queries``' inverse on Y: ``(B, Hkv, G * Sq, Dv)`` -> ``(B, Hq, Sq, Dv)``."""
    return y.reshape(y.shape[0], q_heads, q_len, y.shape[-1])


# -- NumPy: the textbook materialised attention ------------------------------------

def numpy_attention(q, k, v, keep=None):
    """softmax(Q K^T / sqrt(D)) V with the score matrix in memory; GQA by grouping
    the query heads of each K/V head; ``keep`` as from ``keep_mask``."""
    b, hq, sq, d = q.shape
    hkv, skv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    scores = q.reshape(b, hkv, g * sq, d) @ k.swapaxes(-1, -2)
    scores *= np.float32(d ** -0.5)
    scores = scores.reshape(b, hkv, g, sq, skv)
    if keep is not None:
        np.copyto(scores, np.float32(-np.inf), where=~keep[:, :, None])
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores.reshape(b, hkv, g * sq, skv) @ v).reshape(b, hq, sq, dv)


def _numpy_impl(w, wide):
    label = "numpy matmul-softmax-matmul (float32)"
    if w.score_elements > NUMPY_MAX_SCORES:
        return Impl(label, "numpy", note=_too_big(w, NUMPY_MAX_SCORES))
    keep = keep_mask(w)
    if keep is None and w.is_causal:
        keep = np.tri(w.q_len, w.kv_len, dtype=bool)[None, None]
    return Impl(label, "numpy", lambda: numpy_attention(*wide, keep), w.work("float32", "float32"))


# -- tensor_scatter -----------------------------------------------------------------

CACHE_SHAPE = (4, 8, 4096, 128)  # (batch, kv heads, max_seq, head_dim)
WRITE_INDICES = np.array([0, 1000, 2048, 4095], np.int64)  # each row at its own length


def _scatter_model():
    from onnx import TensorProto as tp, helper

    node = helper.make_node("TensorScatter", ["past", "update", "write_indices"], ["present"],
                            axis=-2, mode="linear")
    return onnx_model(node, [("past", tp.FLOAT), ("update", tp.FLOAT), ("write_indices", tp.INT64)],
                      [("present", tp.FLOAT)], opset=24)


def _numpy_assign(dst, update, starts):
    for b, w in enumerate(starts):
        dst[b, :, w:w + update.shape[2]] = update[b]
    return dst


def _copy_into(dst, src):
    np.copyto(dst, src)
    return dst


def _scatter_impls(form, threads):
    """The implementations of a 1-token update in ``form``: "in place",
    "functional" or "out=other"."""
    rng = np.random.default_rng(0)
    past = rng.standard_normal(CACHE_SHAPE, dtype=np.float32)
    update = rng.standard_normal(CACHE_SHAPE[:2] + (1,) + CACHE_SHAPE[3:], dtype=np.float32)
    other = np.zeros_like(past)
    idx, starts = WRITE_INDICES, WRITE_INDICES.tolist()
    feed = {"past": past, "update": update, "write_indices": idx}
    scatter = numkv.tensor_scatter
    impls = {
        "in place": [
            Impl("numkv tensor_scatter(out=cache)", "numkv", lambda: scatter(past, update, idx, out=past)),
            Impl("numpy per-row slice assignment", "numpy", lambda: _numpy_assign(past, update, starts)),
        ],
        "functional": [
            Impl("numkv tensor_scatter()", "numkv", lambda: scatter(past, update, idx)),
            Impl("numpy past.copy() + assignment", "numpy", lambda: _numpy_assign(past.copy(), update, starts)),
        ],
        "out=other": [
            Impl("numkv tensor_scatter(out=other)", "numkv", lambda: scatter(past, update, idx, out=other)),
            Impl("numpy np.copyto + assignment", "numpy",
                 lambda: _numpy_assign(_copy_into(other, past), update, starts)),
        ],
    }[form]
    if have("onnxruntime") and have("onnx"):
        impls.append(_ort_scatter_impl(form, threads, feed, {"in place": past, "out=other": other}.get(form)))
    if have("onnx"):  # the reference has one form: it returns a new array
        def make():
            from onnx.reference import ReferenceEvaluator

            ref = ReferenceEvaluator(_scatter_model())
            return lambda: ref.run(None, feed)
        impls.append(_attempt("onnx.reference TensorScatter (new array)", "onnx.reference", make))
    return impls


def _ort_scatter_impl(form, threads, feed, out):
    if out is None:
        label = "onnxruntime TensorScatter (run)"
    else:
        label = f"onnxruntime TensorScatter (IOBinding, {'in place' if form == 'in place' else 'out=other'})"

    def make():
        import onnxruntime

        session = ort_session(_scatter_model(), threads)
        if out is None:
            return lambda: session.run(None, feed)
        io = session.io_binding()
        io.bind_cpu_input("past", feed["past"])
        io.bind_cpu_input("write_indices", feed["write_indices"])
        # Bound to the cache's own buffer, onnxruntime skips its copy (in place).
        io.bind_output("present", "cpu", 0, np.float32, out.shape, out.ctypes.data)

        def call():  # a new update every step, as in a decode loop
            io.bind_ortvalue_input("update", onnxruntime.OrtValue.ortvalue_from_numpy(feed["update"]))
            session.run_with_iobinding(io)
        return call

    return _attempt(label, "onnxruntime", make)


def scatter_cases(threads=None):
    shape = "x".join(map(str, CACHE_SHAPE))
    titles = {
        "in place": f"tensor_scatter: 1-token append, in place, {shape} float32, per-row write_indices",
        "functional": f"tensor_scatter: 1-token update, functional (new array), {shape} float32",
        "out=other": f"tensor_scatter: 1-token update into another buffer (out=other), {shape} float32",
    }
    ids = {"in place": "scatter-in-place", "functional": "scatter-functional", "out=other": "scatter-out-other"}
    return [Case(ids[form], titles[form], (lambda form=form: _scatter_impls(form, threads)), check=False)
            for form in titles]


# -- quantised K/V (issue 28): decode over QuantizedArray K and V ----------------------------
#
# The decode workload ``decode(QUANTIZED_DECODE_LEN)`` with K and V quantised
# (``numkv.quantize``, every format of ``numkv._formats``): the block
# formats' blocks, the given-scale formats with a per-channel scale
# (``|x|.max`` over batch and sequence per head and channel / the code range's top).
# Its work is the bytes actually read: codes and scales (``nbytes``), Q and
# Y.  Beside numkv: numkv's float32 call over the dequantised values (the
# same function: ``max|dY|`` is rounding) and, for the formats of its layout,
# onnxruntime's ``GroupQueryAttention`` (com.microsoft) with its quantised
# cache in the same codes and scales: a decode step appending the last
# token (which it quantises to numkv's very codes) to a cache of
# ``QUANTIZED_DECODE_LEN - 1`` whose buffers are bound as both past and
# present (no copy of the cache a step).

QUANTIZED_DECODE_LEN = 16384
QUANTIZED_FORMATS = _formats.NAMES


def quantized_decode_cases(threads=None, peers=PEERS, kv_len=QUANTIZED_DECODE_LEN):
    cases = []
    for fmt in QUANTIZED_FORMATS:
        w = decode(kv_len)
        kind = "" if _formats.FORMATS[fmt].derived else " per channel"
        title = (f"attention: decode, B={w.batch} Hq={w.q_heads} Hkv={w.kv_heads} D={w.head_size} "
                 f"Skv={w.kv_len}, numkv in Q float32, K/V {fmt}{kind} (numkv.quantize)")
        cases.append(Case(f"decode-Skv{w.kv_len}-kv-{fmt}", title,
                          (lambda fmt=fmt, w=w: _quantized_impls(w, fmt, threads, peers)), limit="read"))
    return cases


def _quantized_inputs(w, fmt):
    q, k, v = inputs(w)
    if _formats.FORMATS[fmt].derived:
        return q, numkv.quantize(k, fmt), numkv.quantize(v, fmt), None, None
    qmax = _formats.FORMATS[fmt].code_range[1]
    k_scale = (np.abs(k).max(axis=(0, 2), keepdims=True) / qmax).astype(np.float32)
    v_scale = (np.abs(v).max(axis=(0, 2), keepdims=True) / qmax).astype(np.float32)
    return q, numkv.quantize(k, fmt, scale=k_scale), numkv.quantize(v, fmt, scale=v_scale), (k, v), (k_scale, v_scale)


def _quantized_impls(w, fmt, threads, peers):
    q, qk, qv, floats, scales = _quantized_inputs(w, fmt)
    y_bytes = q.nbytes  # (Y: float32, Q's shape at Dv = D)
    impls = [Impl(f"numkv attention (K/V {fmt})", "numkv", lambda: numkv.attention(q, qk, qv),
                  float(qk.nbytes + qv.nbytes + q.nbytes + y_bytes))]
    k32, v32 = qk.dequantize(), qv.dequantize()
    impls.append(Impl("numkv attention (float32, the dequantised K/V)", "numkv",
                      lambda: numkv.attention(q, k32, v32), w.work("float32", "float32")))
    if _formats.FORMATS[fmt].onnxruntime_bits and "onnxruntime" in peers and have("onnxruntime") and have("onnx"):
        impls.append(_ort_gqa_impl(w, fmt, q, qk, qv, floats, scales, threads,
                                   float(qk.nbytes + qv.nbytes + q.nbytes + y_bytes)))
    return impls


def _ort_gqa_impl(w, fmt, q, qk, qv, floats, scales, threads, work):
    """onnxruntime's GroupQueryAttention over the codes of ``qk`` / ``qv``
    (a cache of ``Skv``: the first ``Skv - 1`` tokens held, the last one
    appended by the call), past and present bound to the same buffers."""
    label = f"onnxruntime GroupQueryAttention ({fmt} per-channel cache)"

    def make():
        import onnxruntime as ort
        from onnx import TensorProto, helper

        b, hq, hkv, skv, d = w.batch, w.q_heads, w.kv_heads, w.kv_len, w.head_size
        bits = _formats.FORMATS[fmt].onnxruntime_bits
        code_type = TensorProto.INT8 if bits == 8 else TensorProto.UINT8
        names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
                 "", "", "", "", "", "k_scale", "v_scale"]
        node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                                domain="com.microsoft", num_heads=hq, kv_num_heads=hkv,
                                k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
                                kv_cache_bit_width=bits)
        typed = [("query", TensorProto.FLOAT), ("key", TensorProto.FLOAT), ("value", TensorProto.FLOAT),
                 ("past_key", code_type), ("past_value", code_type), ("seqlens_k", TensorProto.INT32),
                 ("total_sequence_length", TensorProto.INT32), ("k_scale", TensorProto.FLOAT),
                 ("v_scale", TensorProto.FLOAT)]
        graph = helper.make_graph([node], "gqa", [helper.make_tensor_value_info(n, t, None) for n, t in typed],
                                  [helper.make_tensor_value_info(n, t, None) for n, t in
                                   (("output", TensorProto.FLOAT), ("present_key", code_type),
                                    ("present_value", code_type))])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                       helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        session = ort_session(model, threads)
        k, v = floats
        new_token = lambda x: np.ascontiguousarray(x[:, :, skv - 1:].transpose(0, 2, 1, 3).reshape(b, 1, -1))  # noqa: E731
        feed = dict(query=np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(b, 1, hq * d)),
                    key=new_token(k), value=new_token(v), seqlens_k=np.full(b, skv - 1, np.int32),
                    total_sequence_length=np.array(skv, np.int32), k_scale=scales[0], v_scale=scales[1])
        binding = session.io_binding()
        binding.bind_output("output")  # (first: get_outputs() lists outputs in binding order)
        for name, array in feed.items():
            binding.bind_cpu_input(name, array)
        for past, present, cache in (("past_key", "present_key", qk), ("past_value", "present_value", qv)):
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(cache.codes))
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)

        def call():
            session.run_with_iobinding(binding)
            return binding.get_outputs()[0].numpy().reshape(b, 1, hq, d).transpose(0, 2, 1, 3)
        return call

    return _attempt(label, "onnxruntime", make, work)


# -- small calls the way users make them (issue 44) -------------------------------------------
#
# ``launch``: what handing a kernel to numkv's threads costs, an empty kernel
# on every thread (``_runtime.protocol.empty``), beside the same call on the
# calling thread alone; back to back and after a gap.  And the small decodes
# after a gap: a model's other work between two attention calls leaves
# threads asleep and caches cold, which back-to-back samples never see.

GAP = 1e-3  # seconds of other work on the caller before each call
LAUNCH_CALLS, GAP_CALLS = 5000, 1000


def _launch_impls(threads):
    from numkv._runtime import pool, protocol, thread_count

    n = threads or thread_count.get_num_threads()
    return [Impl(f"numkv pool: an empty kernel on {n} threads", "numkv", lambda: pool.run(protocol.empty, n, ())),
            Impl("numkv: an empty kernel on the calling thread", "numkv",
                 lambda: pool.run(protocol.empty, n, (), small=True))]


def launch_cases(threads=None):
    return [Case("launch", "the pool's launch: an empty kernel on every thread, back to back",
                 lambda: _launch_impls(threads), check=False, gap=0.0, calls=LAUNCH_CALLS),
            Case("launch-after-gap", f"the pool's launch after {GAP * 1e3:g} ms of other work on the caller",
                 lambda: _launch_impls(threads), check=False, gap=GAP, calls=LAUNCH_CALLS)]


def after_gap_cases(threads=None):
    loads = [decode(1024), Workload("decode", 1, 16, 4, 1, 1088, 64), Workload("decode", 1, 32, 8, 1, 2048, 64)]
    return [Case(f"{w.id}-after-gap", f"{w.title}, each call after {GAP * 1e3:g} ms of other work on the caller",
                 (lambda w=w: attention_impls(w, threads, peers=("numkv", "torch"))), limit=w.limit,
                 gap=GAP, calls=GAP_CALLS) for w in loads]


def default_cases(threads=None):
    """Every case of ``python -m numkv bench``, in the order they run."""
    loads = prefill_workloads() + decode_workloads()
    return ([attention_case(w, threads) for w in loads] + after_gap_cases(threads) + quantized_decode_cases(threads)
            + scatter_cases(threads) + launch_cases(threads))

