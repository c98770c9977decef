"""Adapters to the executable truth: the ops of ``onnx.reference`` (onnx >= 1.23).

The reference functions are called directly (no model building), so a test can
sweep thousands of cases quickly.  ``attention`` evaluates the reference in
float64 unless told otherwise: the differential tests compare numkv's float32
accumulation against the exact answer, with tolerances by output dtype.
"""

import numpy as np
from onnx.reference.ops.op_attention import _compute_attention
from onnx.reference.ops.op_tensor_scatter import TensorScatter


def tensor_scatter(past_cache, update, write_indices=None, *, axis=-2, mode="linear"):
    """onnx.reference's TensorScatter (returns a new array)."""
    if write_indices is not None:
        write_indices = np.asarray(write_indices, dtype=np.int64)
    (present,) = TensorScatter._run(None, past_cache, update, write_indices, mode=mode, axis=axis)
    return present


def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None,
              *, opset=25, float64=True, **attrs):
    """onnx.reference's Attention: ``(Y, present_key, present_value, qk_matmul_output)``.

    With ``float64`` every float input is widened to float64 first (a bool mask
    stays bool), so the result is the exact answer numkv is judged against.
    """
    if float64:
        def widen(x):
            return None if x is None or x.dtype == np.bool_ else np.asarray(x, np.float64)

        Q, K, V, past_key, past_value = map(widen, (Q, K, V, past_key, past_value))
        if attn_mask is not None and attn_mask.dtype != np.bool_:
            attn_mask = np.asarray(attn_mask, np.float64)
    attrs.setdefault("left_window_size", -1)
    attrs.setdefault("right_window_size", -1)
    return _compute_attention(
        Q, K, V, attn_mask=attn_mask, past_key=past_key, past_value=past_value,
        nonpad_kv_seqlen=nonpad_kv_seqlen, _validate_attention25=opset >= 25, **attrs,
    )
