"""``numkv.attention``: the ONNX Attention op (opsets 23, 24, 25), Y only.

coerce -> validate everything -> 4-D ``(b, h, s, d)`` views (3-D inputs are
reshaped, not copied) -> masks as broadcast views -> causal / offset / windows
/ valid lengths folded into per-batch integers -> raw-byte operands and the
kernel's named layout -> the kernel, on numkv's threads -> cast Y once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import _config
from ._runtime import pool, thread_count
from ._dtypes import (NO_BYTES, block_bytes, byte_operand, e8m0_table, flat_view, is_attention_dtype,
                      is_float8_dtype, is_integer_dtype, is_mask_dtype, kernel_dtype_codes)
from ._formats import FORMATS as _QUANT_FORMATS
from ._quantize import (QuantizedArray, check_attention_operand, check_same_scales, folded_query, kernel_array,
                        kind, output_scale)
from ._validate import as_array, as_float, as_int, as_int64, index_vector

if TYPE_CHECKING:  # only for the annotations: numpy.typing is not imported at run time
    from numpy.typing import ArrayLike

# ONNX TensorProto codes: FLOAT, FLOAT16, DOUBLE, BFLOAT16.  DOUBLE makes the
# kernel accumulate in float64; the others are met by float32 accumulation.
SOFTMAX_PRECISIONS = (1, 10, 11, 16)

# The tile and thread policy (``GEMM_MIN_ROWS`` ... ``THREAD_MACS``, with the
# figures that set them) is ``_config``'s tunables, read at call time.

_kernels = None


def _attention_kernels():
    global _kernels
    if _kernels is None:
        from ._kernels import attention as kernels

        _kernels = kernels
    return _kernels


def attention(Q: ArrayLike, K: ArrayLike, V: ArrayLike, attn_mask: ArrayLike | None = None,
              past_key: ArrayLike | None = None, past_value: ArrayLike | None = None,
              nonpad_kv_seqlen: ArrayLike | None = None, *, scale: float | None = None,
              is_causal: bool = False, q_num_heads: int | None = None, kv_num_heads: int | None = None,
              softcap: float = 0.0, softmax_precision: int | None = None, left_window_size: int = -1,
              right_window_size: int = -1, sinks: ArrayLike | None = None,
              qk_precision: str | None = None) -> np.ndarray:
    """Scaled dot-product attention as the ONNX ``Attention`` op; returns ``Y``.

    ``softmax(Q K^T * scale + bias) V`` with MHA, GQA and MQA (query head
    ``h`` reads kv head ``h // (q_num_heads // kv_num_heads)``), a V head
    size that may differ from Q/K's, self and cross attention.  Never
    materialises the score matrix: a blocked kernel with an online softmax,
    float32 accumulation (float64 for float64 Q, ``softmax_precision=11``, or
    a softcap or float64 mask beyond float32's range).

    Parameters
    ----------
    Q : array, shape ``(B, Hq, Sq, D)``, or ``(B, Sq, Hq * D)`` with ``q_num_heads``
        Queries: float16, bfloat16, float32, float64 or an ``ml_dtypes`` float8
        type.  Strided views are read in place (anything NumPy can view
        without copying: ndarray subclasses, ``__array__``, ``__dlpack__``;
        a list is a ``TypeError``, as for every array argument but
        ``nonpad_kv_seqlen``).
    K : array or QuantizedArray, shape ``(B, Hkv, Skv, D)``, or ``(B, Skv, Hkv * D)`` with ``kv_num_heads``
        Keys; ``Hq`` must be a multiple of ``Hkv``.  A ``QuantizedArray``
        (``numkv.quantize``, any of its formats) is read as codes and
        scales inside the kernel, never dequantised whole.
    V : array or QuantizedArray, shape ``(B, Hkv, Skv, Dv)``, or ``(B, Skv, Hkv * Dv)``
        Values.
    attn_mask : array, optional
        bool (True attends) or additive (integer or float), of any rank 1-4
        that broadcasts to ``(B, Hq, Sq, T)`` with ``T = P + Skv`` the total
        sequence length; a last dimension shorter than ``T`` is padded with
        -inf / False.  Byte order does not matter.
    past_key, past_value : array or QuantizedArray, shape ``(B, Hkv, P, D)`` / ``(B, Hkv, P, Dv)``, optional
        A past to attend before ``K`` / ``V`` (given together; ``P`` may be 0).
    nonpad_kv_seqlen : int array, shape ``(B,)``, optional
        An external cache: row ``b`` attends keys ``j < nonpad_kv_seqlen[b]``
        only (each in ``[0, Skv]``).  Not with ``past_key``.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    is_causal : bool
        Query ``i`` attends key ``j`` iff ``j <= i + offset``, where
        ``offset`` is ``P`` (the length of ``past_key``) with a past,
        ``nonpad_kv_seqlen[b] - Sq`` with ``nonpad_kv_seqlen``, and **0**
        otherwise: without a past or ``nonpad_kv_seqlen`` the diagonal is
        top-left, as in ONNX and ``torch``, also when ``Skv > Sq``.  So a
        decode step that passes all its keys as a plain ``K`` (``Sq=1``)
        attends key 0 only; give the cache's length through
        ``nonpad_kv_seqlen`` (or the keys before the new ones as
        ``past_key``) for the bottom-right diagonal of a cache.
    q_num_heads, kv_num_heads : int, optional
        Required for 3-D inputs; for 4-D ones they must match the shapes.
    softcap : float
        ``softcap * tanh(score / softcap)`` before the mask when > 0.
    softmax_precision : int, optional
        An ONNX TensorProto code: 1 (FLOAT), 10 (FLOAT16), 11 (DOUBLE), 16
        (BFLOAT16); at least that precision in the softmax.
    left_window_size, right_window_size : int
        Keys more than this many positions before / after a query's
        absolute position (``i + offset``) are excluded; -1: unbounded.
    sinks : array, shape ``(Hq,)``, optional
        numkv's extension (gpt-oss, transformers' ``s_aux``): a logit per
        query head that takes part in its softmax as a key with no value,
        ``Y = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j e^(s_j - m))``.
        Real numbers, finite or -inf (no sink); a query that attends no key
        still gets a zero row.
    qk_precision : None or "int8"
        None (default): ``Q K^T`` in the accumulation dtype, exact.
        ``"int8"``, only with a quantised K (and past): each query row is
        first quantised to int8 per block of 32 along the head dimension
        (scale ``amax / 127`` in float32, codes rounded half to even,
        clipped to +-127), as llama.cpp quantises its query for integer
        dot products; Y is attention over that dequantised query (and the
        dequantised K/V), to float32 rounding.  (Today it is computed so,
        in float32: the integer dot products that make it faster are not
        built yet.)

    Returns
    -------
    Y : ndarray, shape ``(B, Hq, Sq, Dv)`` (``(B, Sq, Hq * Dv)`` for 3-D inputs)
        In Q's dtype (float32 for a float8 Q).  A query that attends no key
        gets a zero row.  NaN in an attended score makes the row NaN; keys
        excluded by the mask, the causal rule, a window or
        ``nonpad_kv_seqlen`` never influence Y, even holding inf or NaN.

    Raises
    ------
    TypeError
        An argument of the wrong type or dtype (named in the message).
    ValueError
        Shapes that do not fit, values out of range (named in the message).

    Examples
    --------
    >>> import numpy as np, numkv
    >>> rng = np.random.default_rng(0)
    >>> Q = rng.standard_normal((1, 8, 1, 64), dtype=np.float32)       # one new token, 8 heads
    >>> K = rng.standard_normal((1, 2, 100, 64), dtype=np.float32)     # a cache of 2 kv heads
    >>> V = rng.standard_normal((1, 2, 100, 64), dtype=np.float32)
    >>> numkv.attention(Q, K, V, nonpad_kv_seqlen=np.array([100]), is_causal=True).shape
    (1, 8, 1, 64)
    """
    if qk_precision is not None:  # attention over the dequantised int8 query, in Q's dtype
        q = _int8_query(Q, K, past_key, qk_precision)
        y = attention(q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, scale=scale,
                      is_causal=is_causal, q_num_heads=q_num_heads, kv_num_heads=kv_num_heads, softcap=softcap,
                      softmax_precision=softmax_precision, left_window_size=left_window_size,
                      right_window_size=right_window_size, sinks=sinks)
        dtype = as_array(Q, "Q").dtype
        return y if is_float8_dtype(dtype) or y.dtype == dtype else y.astype(dtype)
    key = layout_key = None
    if attn_mask is None and past_key is None and past_value is None and not _config.REFERENCE:
        attributes = (scale, is_causal, q_num_heads, kv_num_heads, softcap, softmax_precision, left_window_size,
                      right_window_size)
        if nonpad_kv_seqlen is None:
            key = _signature(Q, K, V, attributes, sinks)
            plan = _plans.get(key) if key is not None else None
            if plan is not None:  # the same shapes, dtypes and attributes as a call before
                return plan.run_qkv(Q, K, V)
        else:  # a cache's views (``numkv.cache``, ``numkv.transformers.KVCache``): a key more each step
            layout_key = _views_key(Q, K, V, attributes, sinks)
            if layout_key is not None:
                key = _step_key(layout_key, K, V, nonpad_kv_seqlen)
                plan = _step_plans.get(key) if key is not None else None
                if plan is not None:  # the layers of a decode step after the first
                    return plan.run([_operand_bytes(kernel_array(x)) for x in (Q, NO_BYTES, K, NO_BYTES, V)])
            first = _checks.get(layout_key) if layout_key is not None else None
            if first is not None and K.shape[2] == V.shape[2]:  # (else prepare says what is wrong)
                return run(_with_keys(first, Q, K, V, nonpad_kv_seqlen, left_window_size, right_window_size),
                           key=key, layout_key=layout_key)
    call = prepare(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen,
                   scale=scale, is_causal=is_causal, q_num_heads=q_num_heads,
                   kv_num_heads=kv_num_heads, softcap=softcap,
                   softmax_precision=softmax_precision,
                   left_window_size=left_window_size, right_window_size=right_window_size, sinks=sinks)
    if _config.REFERENCE:
        from ._reference import attention_reference

        return call.finish(attention_reference(call)[0])
    if layout_key is not None:
        keep_checks(layout_key, call)
    return run(call, key=key, layout_key=layout_key)


QK_PRECISIONS = (None, "int8")
QUERY_BLOCK = 32  # elements of Q that share an int8 scale (``qk_precision="int8"``)


def _int8_query(Q, K, past_key, qk_precision):
    """Q quantised to int8 per block of ``QUERY_BLOCK`` along its last axis
    and dequantised, in float32 (``qk_precision="int8"``; the head size is a
    multiple of the block, so blocks never straddle heads, 3-D or 4-D)."""
    if qk_precision not in QK_PRECISIONS:
        raise ValueError(f"qk_precision must be None or 'int8', got {qk_precision!r}")
    if type(K) is not QuantizedArray or (past_key is not None and type(past_key) is not QuantizedArray):
        raise ValueError("qk_precision='int8' needs a quantised K (and past_key): a numkv.QuantizedArray, "
                         f"got K of type {type(K).__name__}")
    q = as_array(Q, "Q")
    if not is_attention_dtype(q.dtype):
        return q  # (the wrapper names Q's dtype)
    if q.ndim < 1 or q.shape[-1] % QUERY_BLOCK:
        raise ValueError(f"qk_precision='int8' quantises Q in blocks of {QUERY_BLOCK} along the head: "
                         f"its last dimension {q.shape[-1] if q.ndim else 0} is not a multiple of {QUERY_BLOCK}")
    blocks = q.astype(np.float32).reshape(*q.shape[:-1], -1, QUERY_BLOCK)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.clip(np.rint(blocks / scale), -127, 127)
    codes[np.broadcast_to(scale == 0, codes.shape)] = 0
    return (codes * scale).reshape(q.shape)


# Calls with the same shapes, dtypes and attributes repeat: the layers of a
# model within one decode step (a new step brings a longer K, a new
# signature), a benchmark's loop.  What the wrapper derives from those alone
# -- the checks passed, the tile sizes, the kernel's layout arrays -- is kept
# per signature (``_Plan``), so that a repeat call only views its buffers
# and runs the kernel: ~10 us of Python at one key against ~30, Hq=16 Hkv=4
# D=64 Skv=1088 on one thread 0.8x the time (a 2-vCPU Zen 3: 14 us against
# 60-110).  Only calls with no mask, past
# or ``nonpad_kv_seqlen`` (whose values change from call to call) and
# aligned, C-contiguous, writeable ndarrays as Q, K and V take it.  What
# else ``run`` reads that may change at run time is part of the signature
# too: the thread thresholds (``_config``; tests change them).  The tile
# tunables are not (tests pass tile sizes to ``run``, or empty ``_plans``
# after changing one).
_plans = {}
# Packed sequences (``numkv.varlen_attention``, ``paged_attention``) keep
# their ``_Layout`` instead: their sequences' tables and key counts change
# from call to call (each decode step), their layout does not.  The key:
# ``numkv._varlen``'s ``_layout_key``.
_layouts = {}
# ... and their argument checks (an ``AttentionCall`` without its arrays),
# as calls over a cache's views (``_views_key``) do too; those also keep
# the plan the later layers of a decode step repeat (``_step_key``).
_checks = {}
_step_plans = {}
# Attribute types a signature may hold: immutable, hashed by value.
_PLAIN = frozenset([type(None), bool, int, float, np.bool_, np.int32, np.int64, np.float32, np.float64])


def _signature(Q, K, V, attributes, sinks=None):
    """The key of a call's plan, or None where the call cannot take one
    (Q, K and V aligned, C-contiguous, writeable ndarrays; the attributes
    as ``_attributes_key``)."""
    for x in (Q, K, V):
        if type(x) is not np.ndarray:
            return None
        flags = x.flags
        if not (flags.c_contiguous and flags.writeable and flags.aligned):
            return None
    attributes = _attributes_key(attributes, sinks)
    if attributes is None:
        return None
    return Q.shape, K.shape, V.shape, Q.dtype, K.dtype, V.dtype, attributes, _thresholds()


def _attributes_key(attributes, sinks):
    """The attributes' part of a kept call's key, or None where they cannot
    be part of one.  Their types are in it: ``True == 1`` and ``1 == 1.0``,
    but a bool scale must still fail its check.  ``sinks`` are part of it
    by value (a plain float64 ndarray only: its bytes)."""
    if sinks is not None:
        if type(sinks) is not np.ndarray or sinks.dtype != _FLOAT64 or sinks.ndim != 1:
            return None
        sinks = sinks.tobytes()
    types_ = tuple(map(type, attributes))
    if not _PLAIN.issuperset(types_):  # a 0-d array or a tensor as the scale, say: checked and run, not kept
        return None
    return attributes, types_, sinks


def _views_key(Q, K, V, attributes, sinks):
    """The key of a call's kept checks (``_checks``) and layout
    (``_layouts``) where K and V are views of a cache that grow a key a
    step (4-D, ``nonpad_kv_seqlen``, no mask or past), or None where it
    takes none: Q an aligned ndarray, K and V aligned ndarrays or
    QuantizedArrays of a format with no separate scale (whose storage is),
    none with a negative stride (a view read backwards starts its bytes past
    its first key, by the key count: ``flat_view``'s ``base``);
    everything in the key but K's and V's key count, and whether there are
    keys at all (none: no loops compiled).  Strides are in it: a view's
    buffer is its own elements' span, read by ``byte_operand``."""
    parts = []
    for x in (Q, K, V):
        form, x = kept_operand(x)
        if x is None or x.ndim != 4 or not x.flags.aligned or min(x.strides) < 0:  # (read backwards: see above)
            return None
        parts.append((form, x.shape[:2], x.shape[3], x.strides, x.dtype))
    attributes = _attributes_key(attributes, sinks)
    return None if attributes is None else ("views", tuple(parts), Q.shape[2], K.shape[2] > 0, attributes)


def _step_key(layout_key, K, V, nonpad_kv_seqlen):
    """The key of the plan of a call over a cache's views (``_views_key``)
    that the other layers of its decode step repeat: the same key counts
    and ``nonpad_kv_seqlen`` (an ndarray, by value: its checks passed
    before), and the thread thresholds (as ``_signature``); or None."""
    if type(nonpad_kv_seqlen) is not np.ndarray:
        return None
    return (layout_key, K.shape[2], V.shape[2], nonpad_kv_seqlen.dtype, nonpad_kv_seqlen.shape,
            nonpad_kv_seqlen.tobytes(), _thresholds())


def kept_operand(x):
    """``(format, array read)`` of a Q, K or V whose call may be kept: an
    ndarray ``(None, x)``, or a QuantizedArray of a format with no separate
    scale (its storage: a scale would be folded into Q or Y by value);
    ``(None, None)`` for anything else."""
    if type(x) is QuantizedArray:
        return (x.format, x.storage) if _QUANT_FORMATS[x.format].derived else (None, None)
    return None, (x if type(x) is np.ndarray else None)


def _thresholds():
    """The thread thresholds a kept plan's thread count follows (tests change them)."""
    return _config.SINGLE_THREAD_MACS, _config.SPLIT_MACS, _config.THREAD_MACS, _config.CLAIM_ITEMS


def keep_checks(key, call):
    """Keep ``call``'s checks (an ``AttentionCall`` whose Q, K, V and key
    counts a later call replaces, ``_with_keys``) under ``key``, without
    its arrays: they would keep the caller's buffers alive."""
    _keep(_checks, key, dataclasses.replace(call, q=None, k=None, v=None, offset=None, valid=None))


def _with_keys(first, Q, K, V, nonpad_kv_seqlen, left_window_size, right_window_size):
    """``prepare``'s call for Q, K and V of the layout of ``first`` (a kept
    call, ``_views_key``): what depends on the key count checked and derived
    again, as ``prepare`` does."""
    b, sq, skv = Q.shape[0], Q.shape[2], K.shape[2]
    nonpad = index_vector(nonpad_kv_seqlen, "nonpad_kv_seqlen", b, skv, "kv_sequence_length ")
    return dataclasses.replace(first, q=Q, k=K, v=V, offset=nonpad - sq, valid=nonpad.copy(),
                               left=_window(left_window_size, "left_window_size", skv + sq),
                               right=_window(right_window_size, "right_window_size", skv + sq))


def _keep(kept, key, plan):
    """Keep ``plan`` in ``kept`` (``_plans``, ``_step_plans``; a ``_Layout``
    in ``_layouts``, a call's checks in ``_checks``), dropping the oldest
    beyond ``PLANS_KEPT``.  No lock (a fork could inherit it held): each
    dict operation is atomic, and a race only drops a plan too many or too
    few."""
    kept[key] = plan
    while len(kept) > _config.PLANS_KEPT:
        try:
            del kept[next(iter(kept))]
        except (KeyError, RuntimeError, StopIteration):  # another thread got there first
            break


@dataclass(slots=True)
class AttentionCall:
    """A validated Attention call in the kernel's terms (all 4-D views)."""

    q: np.ndarray          # (B, Hq, Sq, D)
    k: np.ndarray          # (B, Hkv, Skv, D)   new keys
    v: np.ndarray          # (B, Hkv, Skv, Dv)
    past_k: np.ndarray     # (B, Hkv, P, D)     P may be 0
    past_v: np.ndarray     # (B, Hkv, P, Dv)
    mask: np.ndarray       # additive, acc dtype, broadcast view (B, Hq, Sq, L) or None
    offset: np.ndarray     # (B,) int64: causal / window offset per batch row
    valid: np.ndarray      # (B,) int64: keys j < valid[b] may be attended
    scale: float
    softcap: float
    is_causal: bool
    left: int
    right: int
    acc_dtype: np.dtype
    out_dtype: np.dtype
    three_d: bool
    sinks: np.ndarray = None  # (Hq,) float64, or None
    # Packed sequences (``numkv.varlen_attention``, ``numkv.paged_attention``;
    # no past, no mask): Q ``(1, Hq, Tq, D)`` and K / V ``(1, Hkv, Tk, D)``
    # hold every sequence's rows, and sequence ``b`` -- batch row ``b`` of
    # ``offset`` and ``valid`` -- is row ``b`` of ``sequences``: its first
    # query row, its query count, its first key row (``SEQUENCE_FIELDS``);
    # ``keys`` is the longest sequence's key count.  Paged keys: K and V are
    # the page pool ``(pages, Hkv, page_size, D)``, key ``t`` of sequence
    # ``b`` in row ``t % page_size`` of page ``pages[b, t // page_size]``.
    sequences: np.ndarray = None
    pages: np.ndarray = None
    keys: int = 0

    @property
    def total(self):
        if self.sequences is not None:
            return self.keys
        return self.past_k.shape[2] + self.k.shape[2]

    def new_output(self):
        """Y in the accumulation dtype, and its 4-D ``(b, h, s, d)`` view
        (packed sequences: ``(Tq, Hq, Dv)``, viewed as ``(1, Hq, Tq, Dv)``)."""
        b, hq, sq, _ = self.q.shape
        dv = self.v.shape[3]
        if self.sequences is not None:
            y = np.empty((sq, hq, dv), self.acc_dtype)
            return y, y.transpose(1, 0, 2)[None]
        if self.three_d:
            y = np.empty((b, sq, hq * dv), self.acc_dtype)
            return y, y.reshape(b, sq, hq, dv).transpose(0, 2, 1, 3)
        y = np.empty((b, hq, sq, dv), self.acc_dtype)
        return y, y

    def finish(self, y):
        return _finish(y, self.out_dtype)


def _finish(y, out_dtype):
    """Cast Y to the output dtype once, at the end."""
    if y.dtype == out_dtype:
        return y
    if out_dtype == np.float16 and y.dtype == np.float32 and y.size >= _config.NARROW_MIN:
        return _to_float16(y)
    return y.astype(out_dtype)


def _to_float16(y):
    """``y.astype(float16)``, on numkv's threads by the CPU's F16C where it
    has it (NumPy's cast: 5 ns an element on this host, ~50x slower)."""
    from ._kernels import narrow

    if not narrow.has_f16c():
        return y.astype(np.float16)
    out = np.empty(y.shape, np.float16)
    pool.run(narrow.to_float16, -(-y.size // narrow.CHUNK),
                 (y.reshape(-1), out.view(np.uint16).reshape(-1)), y.size < 4 * narrow.CHUNK)
    return out


def run(call, block_q=None, block_k=None, kv_chunk=None, gemm_rows=None, key=None, layout_key=None):
    """Run the kernel on a prepared call, and keep its plan under ``key``
    (``_plans``; with a ``layout_key``, ``_step_plans``) and, for packed
    sequences and calls over a cache's views, its layout under
    ``layout_key`` (``_layouts``).  Tests may force the tile sizes, the key
    chunk, and the rows from which tiles take the matrix products
    (``gemm``)."""
    y, y4 = call.new_output()
    if y.size == 0:
        return call.finish(y)
    kernels = _attention_kernels()
    b, hq, sq, d = call.q.shape
    hkv, dv, total = call.k.shape[1], call.v.shape[3], call.total
    packed = call.sequences is not None
    if packed:  # a batch row a sequence, as many query rows as the longest
        queries = call.sequences[:, kernels.QUERIES]
        b, sq = len(queries), int(queries.max())
    if layout_key is not None:
        layout_key = layout_key, b, sq
    layout = _layouts.get(layout_key) if layout_key is not None else None
    if layout is None:
        layout, inputs = _layout(call, y4, b, sq, block_q, block_k, gemm_rows)
        if layout_key is not None and not layout.based:
            _keep(_layouts, layout_key, layout)
    else:  # the buffers alone (a kept layout's calls: no mask, no past, no scale folded into Q)
        # (packed calls keep one only where their operands are whole C-contiguous blocks: ``_varlen._layout_key``)
        operand = block_bytes if packed else _operand_bytes
        inputs = [operand(kernel_array(arr)) for arr in (call.q, call.past_k, call.k, call.past_v, call.v)]
        inputs.append(_NO_MASK[call.acc_dtype.itemsize])
    block_q, block_k, uses_gemm, n_q_tiles = layout.block_q, layout.block_k, layout.uses_gemm, layout.n_q_tiles
    heads_per_item = layout.heads_per_item
    pairs = int(queries @ call.valid) if packed else b * sq * total  # (query, key) pairs a query head
    macs = hq * pairs * (d + dv)
    threads = _useful_threads(macs)
    if kv_chunk is None:
        # Chunks exist to feed many threads; on one or two they add a merge
        # (Hq=16 Hkv=4 D=64 Skv=1088, one thread: 140 us a call unsplit, 147
        # in 3 chunks).
        kv_chunk = total if macs < _config.SPLIT_MACS else _kv_chunk(
            b * hkv // heads_per_item * n_q_tiles, total, block_k,
            _config.TARGET_GEMM_ITEMS if uses_gemm else _config.TARGET_ITEMS)
    kv_chunk = max(1, min(kv_chunk, max(total, 1)))
    if call.pages is not None:  # chunks start where tiles do
        kv_chunk = -(-kv_chunk // block_k) * block_k
    n_chunks = max(1, -(-total // kv_chunk))
    # Unsplit, a unit is a pair of query tiles (t, n - 1 - t): equal cost under causal.
    n_units = n_q_tiles if n_chunks > 1 else -(-n_q_tiles // 2)

    ints = _fields(kernels.INT_FIELDS,
                   batch=b, q_heads=hq, kv_heads=hkv, q_len=sq, total=total,
                   past=call.past_k.shape[2], head_size=d, v_head_size=dv,
                   causal=int(call.is_causal), left=call.left, right=call.right,
                   has_mask=int(call.mask is not None), block_q=block_q, block_k=block_k,
                   n_q_tiles=n_q_tiles, n_units=n_units, chunk=kv_chunk, n_chunks=n_chunks,
                   gemm_rows=layout.gemm_rows, heads_per_item=heads_per_item,
                   **_tables(call, len(kernels.INT_FIELDS)))
    if packed:  # the sequences' table, then the pages' (``kernels.SEQUENCES``, ``kernels.PAGES``)
        tables = [ints, call.sequences.ravel()] + ([] if call.pages is None else [call.pages.ravel()])
        ints = np.concatenate(tables).astype(np.int64, copy=False)
    plan = _Plan(
        ints=ints,
        desc=layout.desc,
        floats=layout.floats,
        offset=call.offset, valid=call.valid, y_shape=y.shape, acc_dtype=call.acc_dtype,
        out_dtype=call.out_dtype, n_items=b * hkv // heads_per_item * n_units, n_chunks=n_chunks,
        rows=heads_per_item * (hq // hkv) * block_q, v_head_size=dv,
        threads=threads,
        macs=macs,
        y_scale=layout.y_scale, loops=layout.loops)
    # A kept plan serves calls whose Q, K and V are viewed as their whole memory, from its start.
    if key is not None and not layout.based:  # (a decode step's plan apart: a step a plan, not to push out the rest)
        _keep(_plans if layout_key is None else _step_plans, key, plan)
    return plan.run(inputs[:5], inputs[5], y)


def _operand_bytes(arr):
    return byte_operand(arr)[0]


@dataclass(slots=True)
class _Layout:
    """What ``run`` derives from a call's layout -- its operands' dtypes and
    strides, its attributes, its batch rows and query rows -- but not from
    its key counts: the tiles, the kernel's ``desc`` and ``floats`` rows,
    the loops.  Packed sequences and calls over a cache's views keep it
    (``_layouts``): from one decode step to the next their sequences grow a
    key each and keep their layout."""

    block_q: int
    block_k: int
    gemm_rows: int
    uses_gemm: bool
    n_q_tiles: int
    heads_per_item: int
    desc: np.ndarray
    floats: np.ndarray
    loops: np.ndarray
    y_scale: np.ndarray  # an int8 / int4 V's scale for each query head and channel, or None
    based: bool  # an operand starts past its buffer's start (a view into it): never kept


def _layout(call, y4, b, sq, block_q, block_k, gemm_rows):
    """``(layout, inputs)``: the call's ``_Layout``, and its operands' buffers
    (Q, past K, K, past V, V, mask: ``TENSORS`` order)."""
    kernels = _attention_kernels()
    hq, d = call.q.shape[1], call.q.shape[3]
    hkv, dv = call.k.shape[1], call.v.shape[3]
    packed = call.sequences is not None
    group = hq // hkv
    gemm_rows = _config.GEMM_MIN_ROWS if gemm_rows is None else gemm_rows
    auto_q, auto_k = _tiles(b * hkv, group, sq, gemm_rows)
    block_q = min(block_q or auto_q, sq)
    block_k = block_k or auto_k
    if call.pages is not None:  # paged keys: a divisor of the page size (no tile crosses a page)
        page = call.k.shape[2]
        block_k = max(n for n in range(1, min(block_k, page) + 1) if page % n == 0)
    uses_gemm = group * block_q >= gemm_rows
    # Every tensor as flat bytes (Q, K, V: their own dtype, read by code) or
    # flat accumulation-dtype items (mask, Y), and its row of ``desc``:
    # ``TENSOR_FIELDS``, in ``TENSORS`` order.
    codes = kernel_dtype_codes(kernels.DTYPE_CODES)
    inputs, desc, bases, kv, token_major = [], [], [], [], []
    # A QuantizedArray is read as its storage's bytes (its record's code, ``numkv._formats``);
    # an int8 / int4 K's scale is folded into Q, a V's into Y (``_Plan.y_scale``).
    q = folded_query(call.q, call.k, call.acc_dtype)
    size = call.acc_dtype.itemsize
    for t, (arr, width) in enumerate(((q, d), (call.past_k, d), (call.k, d), (call.past_v, dv), (call.v, dv))):
        flat, base, strides = byte_operand(kernel_array(arr))
        if packed and arr.shape[0] == 1 and (t == kernels.T_Q or call.pages is None):
            strides[0] = 0  # sequences lie along s (``kernels.SEQUENCES``); a page pool's axis 0 is its pages
        inputs.append(flat)
        bases.append(base)
        code = codes[arr.dtype] if type(arr) is not QuantizedArray else _QUANT_FORMATS[arr.format].code
        in_place = t != kernels.T_Q and kernels.read_in_place(size // 8, code, strides[3], strides[2], width, uses_gemm,
                                                              values=t in (kernels.T_V, kernels.T_PAST_V))
        desc += (base, *strides, code, int(in_place))
        if t == kernels.T_Q:
            q_code = code
        elif arr.shape[2]:  # (K / V without keys: never read, no loops)
            kv.append((code, in_place))
            token_major.append(strides[1] < strides[2])
    if call.mask is None:
        inputs.append(_NO_MASK[size])
        desc += _NO_MASK_ROW
    else:
        flat, base, strides = flat_view(call.mask, call.acc_dtype)
        inputs.append(flat)
        desc += (base, *strides, 0, 0)
    y_strides = [s // size for s in y4.strides]
    if packed:
        y_strides[0] = 0
    desc += (0, *y_strides, 0, 0)  # Y: new and contiguous, y4 starts where y does
    desc = np.fromiter(desc, np.int64, len(desc)).reshape(len(kernels.TENSORS), len(kernels.TENSOR_FIELDS))
    heads_per_item = _heads_per_item(kv, token_major, hkv, uses_gemm)
    # The C functions it may call (the loops of the formats it reads), compiled before the kernel runs.
    loops = kernels.loop_table(size // 8, q_code, tuple(kv), uses_gemm, heads_per_item > 1)
    with np.errstate(over="ignore"):  # a scale's root beyond the dtype's range is inf, as in the reference
        q_scale, score_scale = _scale_factors(call.scale, call.acc_dtype)
        named = {"q_scale": q_scale, "score_scale": score_scale, "softcap": call.softcap}
        # (the sinks after the FLOAT_FIELDS: ``softmax.SINKS``)
        floats = np.array([*(named[field] for field in kernels.FLOAT_FIELDS),
                           *(() if call.sinks is None else call.sinks)], call.acc_dtype)
    y_scale = output_scale(call.v, hq, call.acc_dtype)
    if packed:
        y_scale = _packed_scale(y_scale, hq, dv)
    layout = _Layout(block_q=block_q, block_k=block_k, gemm_rows=gemm_rows, uses_gemm=uses_gemm,
                     n_q_tiles=-(-sq // block_q), heads_per_item=heads_per_item, desc=desc, floats=floats,
                     loops=loops, y_scale=y_scale, based=any(bases))
    return layout, inputs


def _heads_per_item(kv, token_major, hkv, uses_gemm):
    """The kv heads a work item covers: every one where decode's loops read
    each K and V with keys in place (``kv``: their codes and whether in
    place) and token-major (``(T, Hkv, D)``: transformers' read-out, the
    pages); else 1.  The loops then take a key's row for every head at once
    (``decode_loops._score_keys_heads``): one head's keys after another
    took 1.6-1.8x head-major keys' time, every head's together 0.94-1.46x
    (8 decodes of 2,048 keys, Hq16/Hkv4/D64, 1-2 threads, Zen 3;
    ``tools/token_major_reads.py`` for the reads alone).  By the layout
    only: Y's bits never depend on the thread count."""
    if uses_gemm or hkv == 1 or not all(token_major) or not all(in_place for _, in_place in kv):
        return 1
    return hkv


def _tables(call, end):
    """The ``ints`` fields of packed sequences and pages: where their tables
    start past the ``INT_FIELDS`` (0: none), the page size and the pages a
    sequence's row of the block table holds."""
    if call.sequences is None:
        return dict(sequences=0, page_size=0, pages=0, pages_per_row=0)
    paged = call.pages is not None
    return dict(sequences=end, page_size=call.k.shape[2] if paged else 0,
                pages=end + call.sequences.size if paged else 0, pages_per_row=call.pages.shape[1] if paged else 0)


def _packed_scale(scale, hq, dv):
    """An int8 / int4 V's output scale (broadcasting to ``(B, Hq, Sq, Dv)``)
    for packed rows ``(Tq, Hq, Dv)``."""
    if scale is None:
        return None
    return np.broadcast_to(scale, (1, hq, 1, dv))[0].transpose(1, 0, 2)


def _useful_threads(macs):
    """How many threads a call of ``macs`` multiply-adds is worth: one below
    ``SINGLE_THREAD_MACS``, else one per ``THREAD_MACS``, and at least two
    (the measurements: ``_config``'s comment above ``SINGLE_THREAD_MACS``)."""
    if macs < _config.SINGLE_THREAD_MACS:
        return 1
    per_thread = _config.THREAD_MACS
    return max(2, int(macs // per_thread)) if per_thread else pool.MAX_WORKERS + 1  # (tests set 0: no limit)


def _releases_gil(macs, threads):
    """Whether a call lets other Python threads run while it computes: where
    it is expected to take longer than Python's switch interval (5 ms),
    after which a thread waiting for the GIL takes it anyway; a shorter
    one keeps it, and so never waits up to 5 ms to get it back beside a
    busy Python thread (``pool``).  ``GIL_MACS`` multiply-adds a thread
    take ~4.5 ms at a float32 decode's ~15 G/s a thread on a Zen 4, ~7 ms
    at ~9 G/s on a Zen 3 (prefill runs 3-5x faster, so a prefill lets go
    from ~1-2 ms: sooner than it must, at the cost of a wake)."""
    return macs >= _config.GIL_MACS * min(threads, thread_count._threads)


@dataclass(slots=True)
class _Plan:
    """The kernel's arguments for a call, but for its buffers: what ``run``
    derives from the call's shapes, dtypes and attributes alone."""

    ints: np.ndarray
    desc: np.ndarray
    floats: np.ndarray
    offset: np.ndarray
    valid: np.ndarray
    y_shape: tuple
    acc_dtype: np.dtype
    out_dtype: np.dtype
    n_items: int
    n_chunks: int
    rows: int
    v_head_size: int
    threads: int  # at most this many share the kernel (``_useful_threads``; 1: small, ``HOT_THREAD_MACS``)
    macs: int  # the multiply-adds of a call (``_releases_gil``)
    y_scale: np.ndarray = None  # an int8 / int4 V's scale for each query head and channel, or None
    loops: np.ndarray = None  # the addresses of its formats' loops (``loop_functions``)

    def run_qkv(self, Q, K, V):
        """Y for the aligned, C-contiguous Q, K and V of a call with no past
        and no mask."""
        return self.run([Q.reshape(-1).view(np.uint8), NO_BYTES, K.reshape(-1).view(np.uint8), NO_BYTES,
                         V.reshape(-1).view(np.uint8)])

    def run(self, inputs, mask=None, y=None):
        """Y for the raw bytes of Q, the past K, K, the past V and V
        (``inputs``, in ``TENSORS`` order), and the mask's flat buffer (None:
        no mask); into ``y`` where given (of ``y_shape``)."""
        kernels = _attention_kernels()
        size = self.acc_dtype.itemsize
        if y is None:
            y = np.empty(self.y_shape, self.acc_dtype)
        if self.n_chunks > 1:  # each call its own: calls may run at once
            parts = self.n_items * self.n_chunks
            part_m = np.empty((parts, self.rows), self.acc_dtype)
            part_l = np.empty((parts, self.rows), self.acc_dtype)
            part_acc = np.empty((parts, self.rows, self.v_head_size), self.acc_dtype)
            chunks_done = np.zeros(self.n_items, np.int64)  # the last thread to finish an item's chunk merges them
        else:  # never touched
            part_m, part_acc = _NO_PARTS[size]
            part_l, chunks_done = part_m, _NO_COUNTER
        threads = self.threads
        if threads == 1 and self.macs >= _config.HOT_THREAD_MACS and pool.hot():  # back to back: two threads pay
            threads = 2
        claimed = _config.CLAIM_ITEMS and threads > 1
        counter = np.zeros(1, np.int64) if claimed else _NO_COUNTER
        flat_y = y.reshape(-1)
        pool.run(kernels.attention_items, self.n_items * self.n_chunks, (
            *inputs, _NO_MASK[size] if mask is None else mask, flat_y, self.ints, self.desc, self.floats,
            self.offset, self.valid, e8m0_table(), kernels.FORMAT_TABLE, self.loops, part_m, part_l, part_acc,
            counter, chunks_done),
            threads == 1, claimed, max_threads=threads, release_gil=_releases_gil(self.macs, threads))
        if self.y_scale is not None:  # y_d = s_d sum_j p_j c_jd / l (a QuantizedArray V: Y is 4-D)
            y *= self.y_scale
        return _finish(y, self.out_dtype)


# The normal range of each accumulation dtype (by size: float32, float64).
_RANGE = {n: (float(np.finfo(f"f{n}").tiny), float(np.finfo(f"f{n}").max)) for n in (4, 8)}


def _scale_factors(scale, dtype):
    """``(q_scale, score_scale)``: Q is multiplied by the first, the scores by
    the second.  The reference multiplies Q and K by ``sqrt(scale)`` each; one
    factor on Q does the same where ``scale`` itself is a normal number of the
    accumulation dtype, and costs no pass over the scores.  A negative (or
    NaN) scale has no square root: every attended score is NaN, as there."""
    if not scale >= 0:
        return math.nan, 1.0
    tiny, huge = _RANGE[dtype.itemsize]
    if scale == 0 or tiny <= scale <= huge:
        return scale, 1.0
    root = math.sqrt(scale)
    return root, root


# Operands the kernel is handed but never reads or writes, per accumulation
# dtype size: the mask when there is none (and its ``desc`` row), the partial
# softmaxes of a call whose keys are not split, the counter of a call whose
# items are not claimed.
_NO_MASK = {4: np.zeros(1, np.float32), 8: np.zeros(1, np.float64)}
_NO_MASK_ROW = (0, 0, 0, 0, 0, 0, 0)
_NO_PARTS = {n: (np.zeros((1, 1), dtype), np.zeros((1, 1, 1), dtype))
             for n, dtype in ((4, np.float32), (8, np.float64))}
_NO_COUNTER = np.zeros(0, np.int64)


def _fields(names, **values):
    """An int64 array holding ``values`` in the order of ``names`` (all of
    them, and nothing else: a KeyError or an AssertionError otherwise)."""
    assert len(values) == len(names), sorted(set(values) ^ set(names))
    return np.fromiter(map(values.__getitem__, names), np.int64, len(names))  # (np.array: ~2x the cost)


def _tiles(heads, group, sq, gemm_rows):
    """Default ``(block_q, block_k)`` for ``heads`` (batch x kv heads) of
    ``group`` query heads each."""
    rows, keys, min_rows = _config.ROWS_PER_TILE, _config.GEMM_BLOCK_K, _config.MIN_ROWS_PER_TILE
    while rows > min_rows and heads * -(-sq // max(1, rows // group)) < _config.TARGET_GEMM_ITEMS:
        rows //= 2  # smaller tiles, for enough work items
    block_q = max(1, min(sq, rows // group))
    return block_q, keys if group * block_q >= gemm_rows else _config.LOOP_BLOCK_K


def _kv_chunk(n_items, total, block_k, target):
    """Key-range chunk length: split only when there are fewer than
    ``target`` work items."""
    if n_items >= target or total <= _config.MIN_CHUNK:
        return max(total, 1)
    splits = -(-target // n_items)
    chunk = max(_config.MIN_CHUNK, -(-total // splits))
    return -(-chunk // block_k) * block_k


# --------------------------------------------------------------------------
# validation and normalisation


def prepare(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None,
            *, scale=None, is_causal=False, q_num_heads=None, kv_num_heads=None,
            softcap=0.0, softmax_precision=None, left_window_size=-1, right_window_size=-1, sinks=None):
    """Check every argument and express the call as an ``AttentionCall``."""
    Q, K, V = (_float_input(x, name) for x, name in ((Q, "Q"), (K, "K"), (V, "V")))
    if not Q.ndim == K.ndim == V.ndim or Q.ndim not in (3, 4):
        raise ValueError(
            f"Q, K and V must all be 3-D or all 4-D, got ranks {Q.ndim}, {K.ndim}, {V.ndim}")
    three_d = Q.ndim == 3
    q, k, v = _heads_views(Q, K, V, q_num_heads, kv_num_heads)
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: Q {b}, K {k.shape[0]}, V {v.shape[0]}")
    if v.shape[1] != hkv:
        raise ValueError(f"K has {hkv} heads but V has {v.shape[1]}")
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"q_num_heads {hq} must be a multiple of kv_num_heads {hkv} (MHA, GQA or MQA); 4-D Q, K "
            f"and V are (batch, heads, sequence, head_size) (torch's (batch, sequence, heads, head_size): "
            f".transpose(1, 2))")
    if k.shape[3] != d:
        raise ValueError(f"K head size {k.shape[3]} differs from Q head size {d}")
    if d == 0:
        raise ValueError("Q and K head size must be >= 1, got 0")
    if v.shape[2] != skv:
        raise ValueError(f"K has kv_sequence_length {skv} but V has {v.shape[2]}")
    dv = v.shape[3]

    past_k, past_v = _past(past_key, past_value, K, V, (b, hkv, d, dv))
    past_len = past_k.shape[2]
    total = past_len + skv

    is_causal = _flag(is_causal, "is_causal")
    left = _window(left_window_size, "left_window_size", total + sq)
    right = _window(right_window_size, "right_window_size", total + sq)
    softcap = as_float(softcap, "softcap")
    if not math.isfinite(softcap):
        raise ValueError(f"softcap must be finite, got {softcap}")
    softcap = max(softcap, 0.0)  # ONNX (and its reference): softcap <= 0 means none
    if softmax_precision is not None:
        softmax_precision = as_int(softmax_precision, "softmax_precision")
        if softmax_precision not in SOFTMAX_PRECISIONS:
            raise ValueError(
                f"softmax_precision must be one of 1 (FLOAT), 10 (FLOAT16), 11 (DOUBLE), "
                f"16 (BFLOAT16), got {softmax_precision}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        scale = as_float(scale, "scale")
    sinks = sink_logits(sinks, hq)

    if nonpad_kv_seqlen is not None:
        if past_key is not None:
            raise ValueError("nonpad_kv_seqlen cannot be combined with past_key/past_value")
        nonpad = index_vector(nonpad_kv_seqlen, "nonpad_kv_seqlen", b, skv, "kv_sequence_length ")
        offset, valid = nonpad - sq, nonpad.copy()
    else:
        offset, valid = np.array([[past_len] * b, [total] * b], np.int64)  # (np.full: twice the cost)

    acc_dtype = _accumulation_dtype(Q.dtype, softmax_precision, softcap)
    mask = None
    if attn_mask is not None:
        attn_mask = _mask_array(attn_mask)
        if acc_dtype == _FLOAT32 and _beyond_float32(attn_mask):
            acc_dtype = _FLOAT64
        mask, mask_len = _mask_view(attn_mask, (b, hq, sq, total), acc_dtype)
        np.minimum(valid, mask_len, out=valid)  # keys past the mask's end are -inf

    out_dtype = _FLOAT32 if is_float8_dtype(Q.dtype) else Q.dtype
    return AttentionCall(q, k, v, past_k, past_v, mask, offset, valid, scale, softcap,
                         is_causal, left, right, acc_dtype, out_dtype, three_d, sinks)


def sink_logits(sinks, q_heads):
    """``sinks`` as a float64 ``(q_heads,)`` array (a copy: it is small), or
    None.  Any real dtype; NaN or +inf is a ``ValueError`` (a +inf sink
    would take every weight, a NaN make every row NaN: neither is a logit a
    model learns), -inf means no sink."""
    if sinks is None:
        return None
    arr = as_array(sinks, "sinks")
    if not (is_integer_dtype(arr.dtype) or is_attention_dtype(arr.dtype)):
        raise TypeError(f"sinks has dtype {arr.dtype}; it must hold real numbers (one logit per query head)")
    if arr.shape != (q_heads,):
        raise ValueError(f"sinks must have shape (q_num_heads,) = ({q_heads},), got {arr.shape}")
    values = arr.astype(np.float64)
    if np.isnan(values).any() or np.isposinf(values).any():
        raise ValueError(f"sinks must be finite or -inf, got {values[np.isnan(values) | np.isposinf(values)][0]}")
    return values


def _accumulation_dtype(q_dtype, softmax_precision, softcap):
    """float32, or float64 for float64 Q, ``softmax_precision`` DOUBLE, or a
    ``softcap`` that float32 cannot hold: the kernel computes
    ``softcap * tanh(x / softcap)`` in the accumulation dtype, where a softcap
    above float32's max (or below its smallest subnormal) would become inf (or
    0) and the row NaN (or uncapped).  The reference in float64 gives the
    capped scores (``x`` itself, to rounding, for a huge softcap), and so does
    a float64 kernel; such calls are rare enough that its cost does not matter."""
    if q_dtype == _FLOAT64 or softmax_precision == 11:
        return _FLOAT64
    if softcap > 0 and not _F32_TINY <= softcap <= _F32_MAX:
        return _FLOAT64
    return _FLOAT32


# (A dtype against a scalar type costs ~0.15 us a comparison; against a dtype, a tenth.)
_FLOAT32, _FLOAT64 = np.dtype(np.float32), np.dtype(np.float64)


_F32_MAX = float(np.finfo(np.float32).max)
# Half the smallest float32 subnormal rounds to 0; just above it, to the subnormal.
_F32_TINY = float(np.finfo(np.float32).smallest_subnormal) / 2 * (1 + 2 ** -52)


def _float_input(x, name):
    if x is None:
        raise TypeError(f"{name} is required")
    if type(x) is QuantizedArray:  # K or V: codes and scales, read in the kernel
        return check_attention_operand(x, name)
    x = as_array(x, name, sequences=False)  # (a list would be a float64 copy)
    if not x.dtype.isnative:  # read in place, never copied: say how to make it native
        raise TypeError(
            f"{name} has dtype {x.dtype.str} in non-native byte order; pass "
            f"{name}.astype({name}.dtype.newbyteorder('=')) (numkv reads Q, K and V in place)")
    if not is_attention_dtype(x.dtype):
        raise TypeError(
            f"{name} has dtype {x.dtype}; Attention takes float16, bfloat16, float32, float64 "
            f"or an ml_dtypes float8 type")
    return x


def _heads_views(Q, K, V, q_num_heads, kv_num_heads):
    """4-D ``(b, h, s, d)`` views of Q, K, V (3-D inputs are split, not copied)."""
    if Q.ndim == 4:
        for value, name, actual in ((q_num_heads, "q_num_heads", Q.shape[1]),
                                    (kv_num_heads, "kv_num_heads", K.shape[1])):
            if value is not None and as_int(value, name) != actual:
                raise ValueError(f"{name} = {value} contradicts the 4-D input's {actual} heads")
        return Q, K, V
    if q_num_heads is None or kv_num_heads is None:
        raise ValueError("3-D inputs need q_num_heads and kv_num_heads")
    hq = as_int(q_num_heads, "q_num_heads")
    hkv = as_int(kv_num_heads, "kv_num_heads")
    if hq <= 0 or hkv <= 0:
        raise ValueError(f"q_num_heads {hq} and kv_num_heads {hkv} must be positive")
    views = []
    for x, name, heads, heads_name in ((Q, "Q", hq, "q_num_heads"), (K, "K", hkv, "kv_num_heads"),
                                       (V, "V", hkv, "kv_num_heads")):
        if x.shape[2] % heads:
            raise ValueError(
                f"{name}'s hidden size {x.shape[2]} is not a multiple of {heads_name} {heads}")
        views.append(x.reshape(x.shape[0], x.shape[1], heads, x.shape[2] // heads)
                     .transpose(0, 2, 1, 3))
    return views


def _past(past_key, past_value, K, V, dims):
    b, hkv, d, dv = dims
    if (past_key is None) != (past_value is None):
        raise ValueError("past_key and past_value must be given together")
    if past_key is None:  # (a QuantizedArray's empty past: float32, never read)
        return (_no_past(b, hkv, d, _FLOAT32 if type(K) is QuantizedArray else K.dtype),
                _no_past(b, hkv, dv, _FLOAT32 if type(V) is QuantizedArray else V.dtype))
    past_k, past_v = _past_input(past_key, "past_key"), _past_input(past_value, "past_value")
    for arr, name, new, new_name, size in ((past_k, "past_key", K, "K", d), (past_v, "past_value", V, "V", dv)):
        if (type(arr) is QuantizedArray) != (type(new) is QuantizedArray) or kind(arr) != kind(new):
            what = "format" if type(new) is QuantizedArray else "dtype"
            raise TypeError(f"{name} has {'format' if type(arr) is QuantizedArray else 'dtype'} {kind(arr)}, "
                            f"expected {new_name}'s {what} {kind(new)} (no implicit casting)")
        check_same_scales(arr, new, name, new_name)
        if arr.ndim != 4 or arr.shape[0] != b or arr.shape[1] != hkv or arr.shape[3] != size:
            raise ValueError(
                f"{name} must have shape ({b}, {hkv}, past_sequence_length, {size}), got {arr.shape}")
    if past_k.shape[2] != past_v.shape[2]:
        raise ValueError(
            f"past_key has length {past_k.shape[2]} but past_value has {past_v.shape[2]}")
    return past_k, past_v


def _past_input(x, name):
    return check_attention_operand(x, name) if type(x) is QuantizedArray else as_array(x, name, sequences=False)


@functools.lru_cache(maxsize=256)
def _no_past(b, hkv, d, dtype):
    """An empty past of this shape and dtype, shared (it holds nothing): a
    new one cost ~0.45 us, a sizeable part of a small decode call."""
    empty = np.zeros((b, hkv, 0, d), dtype)
    empty.flags.writeable = False
    return empty


def _flag(value, name):
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    value = as_int(value, name)
    if value not in (0, 1):
        raise ValueError(f"{name} must be 0 or 1, got {value}")
    return bool(value)


def _window(value, name, unbounded):
    """A window size; one of ``unbounded`` (``total_sequence_length +
    q_sequence_length``) or more excludes no key, so it becomes -1: a query
    sits at ``offset + i`` in ``[-Sq, T + Sq)`` and keys in ``[0, T)``, so
    ``pos +- window`` could otherwise overflow int64 in the kernel."""
    value = as_int64(value, name)
    if value < -1:
        raise ValueError(f"{name} must be -1 (unbounded) or >= 0, got {value}")
    return -1 if value >= unbounded else value


def _mask_array(attn_mask):
    """``attn_mask`` as an ndarray of a mask dtype in native byte order (every
    dtype alike: a big-endian float mask is read like a big-endian integer
    one, through a native copy -- the mask is converted anyway)."""
    mask = as_array(attn_mask, "attn_mask", sequences=False)
    if not mask.dtype.isnative:
        mask = mask.astype(mask.dtype.newbyteorder("="))
    if not is_mask_dtype(mask.dtype):
        raise TypeError(
            f"attn_mask has dtype {mask.dtype}; it must be bool, an integer, or a float type "
            f"Attention takes (float16, bfloat16, float32, float64, float8)")
    return mask


def _beyond_float32(mask):
    """Whether a float64 mask holds finite values float32 cannot (|x| above
    its max): cast, they would become inf and an attended +inf a NaN row
    (``inf - inf``), where the reference, adding them in float64, gives
    finite values.  Such a mask makes the call accumulate in float64, which
    gives the reference's values (as a softcap beyond float32 does)."""
    if mask.dtype != _FLOAT64 or not mask.size:
        return False
    with np.errstate(invalid="ignore"):
        return bool(((np.abs(mask) > _F32_MAX) & np.isfinite(mask)).any())


def _mask_view(mask, target, acc_dtype):
    """The mask (from ``_mask_array``) as an additive ``acc_dtype`` broadcast
    view of shape ``(B, Hq, Sq, L)`` (zero strides where it broadcasts), and ``L``."""
    if not 1 <= mask.ndim <= 4:
        raise ValueError(f"attn_mask must have rank 1 to 4, got rank {mask.ndim}")
    b, hq, sq, total = target
    length = mask.shape[-1]
    if length > total:
        raise ValueError(
            f"attn_mask's last dimension {length} exceeds total_sequence_length {total}")
    shape = (1,) * (4 - mask.ndim) + mask.shape
    for dim, (n, want, what) in enumerate(zip(shape[:3], target[:3], ("batch_size", "q_num_heads", "q_sequence_length"))):
        if n not in (1, want):
            raise ValueError(
                f"attn_mask shape {mask.shape} does not broadcast to ({b}, {hq}, {sq}, {total}): "
                f"dimension {dim - 4} is {n}, expected 1 or {what} {want}")
    if mask.dtype == np.bool_:
        additive = np.where(mask, acc_dtype.type(0), acc_dtype.type(-np.inf))
    else:
        additive = mask.astype(acc_dtype, copy=False)
    if not additive.flags.aligned:  # strides that are no multiple of the itemsize: the kernel needs them
        additive = np.ascontiguousarray(additive)
    return np.broadcast_to(additive.reshape(shape), (b, hq, sq, length)), length
