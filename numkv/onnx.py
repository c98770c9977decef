"""numkv's kernels as ONNX ops: the full four-output ``Attention``, and
``TensorScatter``, as functions and as ``onnx.reference`` ``OpRun`` classes.

    sess = numkv.onnx.evaluator(model)        # ReferenceEvaluator on numkv kernels
    sess.run(None, feeds)

This is the only numkv module that imports ``onnx`` (extra ``numkv[onnx]``).
"""

try:
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun
except ImportError as exc:  # pragma: no cover - exercised without onnx installed
    raise ImportError(
        "numkv.onnx needs the onnx package (>= 1.23.2): pip install 'numkv[onnx]'"
    ) from exc

import numpy as np

from ._attention import prepare, run
from ._quantize import QuantizedArray
from ._reference import attention_reference
from ._scatter import tensor_scatter
from ._validate import as_int

__all__ = ["attention", "tensor_scatter", "Attention", "TensorScatter", "evaluator"]


def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None,
              *, qk_matmul_output_mode=0, **attrs):
    """The full ONNX Attention op: ``(Y, present_key, present_value, qk_matmul_output)``.

    ``attrs`` are those of ``numkv.attention``.  ``qk_matmul_output`` (the
    only place scores are materialised) follows onnx 1.23.2's reference:
    mode 0 and 1 the scaled ``Q K^T`` (after the softcap, when one is set),
    mode 2 with the mask / causal / window bias added, mode 3 the softmax
    probabilities (zero rows where every key is masked).
    """
    return _attention(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen,
                      qk_matmul_output_mode, attrs, wanted=(True, True, True))


def _attention(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, mode, attrs, wanted):
    """``(Y, present_key, present_value, qk_matmul_output)``; ``wanted`` says
    which of the last three to compute (the others are None): a decode step
    that asks for Y only must not copy the whole cache into the presents
    (measured 3-5x a bare ``numkv.attention`` call at a past of 4096)."""
    mode = as_int(mode, "qk_matmul_output_mode")
    if mode not in (0, 1, 2, 3):
        raise ValueError(f"qk_matmul_output_mode must be 0, 1, 2 or 3, got {mode}")
    for name, x in (("K", K), ("V", V), ("past_key", past_key), ("past_value", past_value)):
        if isinstance(x, QuantizedArray):  # the ONNX op's tensors are arrays
            raise TypeError(f"{name} is a QuantizedArray: numkv.onnx takes arrays (numkv.attention "
                            f"reads quantised K/V)")
    call = prepare(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, **attrs)
    y = run(call)
    want_key, want_value, want_scores = wanted
    present_key = np.concatenate([call.past_k, call.k], axis=2) if want_key else None
    present_value = np.concatenate([call.past_v, call.v], axis=2) if want_value else None
    scores = None
    if want_scores:
        _, raw, with_bias, probs = attention_reference(call)
        scores = (raw, raw, with_bias, probs)[mode].astype(call.out_dtype)
    return y, present_key, present_value, scores


class Attention(OpRun):
    """ONNX ``Attention`` (opsets 23-25) on numkv's kernel; the scores output
    is computed only when the node asks for it."""

    op_domain = ""

    def _run(self, Q, K, V, attn_mask=None, past_key=None, past_value=None,
             nonpad_kv_seqlen=None, scale=None, is_causal=None, q_num_heads=None,
             kv_num_heads=None, softmax_precision=None, softcap=None,
             qk_matmul_output_mode=None, left_window_size=None, right_window_size=None):
        # An output is wanted when the node names it (ONNX: a trailing output
        # may be left off, a middle one given the empty name).
        outputs = list(self.onnx_node.output)
        wanted = tuple(len(outputs) > i and bool(outputs[i]) for i in (1, 2, 3))
        attrs = dict(scale=scale, is_causal=0 if is_causal is None else is_causal, q_num_heads=q_num_heads,
                     kv_num_heads=kv_num_heads, softcap=float(softcap or 0.0),
                     softmax_precision=softmax_precision,
                     left_window_size=-1 if left_window_size is None else left_window_size,
                     right_window_size=-1 if right_window_size is None else right_window_size)
        if Q.ndim == 4:  # opset 23/24 models may carry them; they add nothing to 4-D inputs
            attrs["q_num_heads"] = attrs["kv_num_heads"] = None
        results = _attention(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen,
                             qk_matmul_output_mode or 0, attrs, wanted)
        # The evaluator pairs results with node.output positionally (zip), and
        # OpRun rejects None: results stop at the last wanted output, and an
        # unnamed one before it gets an empty placeholder.
        last = max((i + 1 for i, w in enumerate(wanted) if w), default=0)
        y = results[0]
        return tuple(np.empty(0, y.dtype) if r is None else r for r in results[:last + 1])


class TensorScatter(OpRun):
    """ONNX ``TensorScatter`` (opset 24) on numkv's kernel."""

    op_domain = ""

    def _run(self, past_cache, update, write_indices=None, mode=None, axis=None):
        return (tensor_scatter(past_cache, update, write_indices,
                               axis=-2 if axis is None else axis,
                               mode="linear" if mode is None else mode),)


def evaluator(model, **kwargs):
    """``onnx.reference.ReferenceEvaluator`` running Attention and TensorScatter
    on numkv's kernels (``kwargs`` go to the evaluator)."""
    new_ops = list(kwargs.pop("new_ops", [])) + [Attention, TensorScatter]
    return ReferenceEvaluator(model, new_ops=new_ops, **kwargs)
