"""The plain NumPy path of Attention, for a prepared ``AttentionCall``.

It materialises the ``(Sq, T)`` scores, so numkv uses it only where that is
the point: ONNX's ``qk_matmul_output`` debug output (``numkv.onnx``), and as
the simple path tests can force with ``_config.REFERENCE``.  GQA stays an
index map here too (a reshape, not a repeat).
"""

import numpy as np


def attention_reference(call):
    """``(Y, scores, scores_with_bias, probabilities)``.

    ``scores`` are ``Q K^T * scale`` after the softcap (ONNX applies the
    softcap before the mask); ``probabilities`` have zero rows where every key
    is masked.  Y is in the layout of ``call.new_output()``; the others are
    ``(B, Hq, Sq, T)``, all in the accumulation dtype.
    """
    acc = call.acc_dtype
    b, hq, sq, d = call.q.shape
    hkv = call.k.shape[1]
    group = hq // hkv
    total = call.total
    q = call.q.astype(acc).reshape(b, hkv, group, sq, d)
    k = np.concatenate([call.past_k.astype(acc), call.k.astype(acc)], axis=2)
    v = np.concatenate([call.past_v.astype(acc), call.v.astype(acc)], axis=2)

    scores = np.einsum("bhgsd,bhtd->bhgst", q, k).reshape(b, hq, sq, total) * acc.type(call.scale)
    if call.softcap > 0:
        scores = call.softcap * np.tanh(scores / call.softcap)
    bias = np.where(_allowed(call, sq, total), acc.type(0), acc.type(-np.inf))
    if call.mask is not None:
        length = call.mask.shape[3]
        bias = bias + np.pad(call.mask, [(0, 0)] * 3 + [(0, total - length)],
                             constant_values=-np.inf) if length < total else bias + call.mask
    with_bias = scores + bias

    # A row whose bias is all -inf attends nothing: zeros, not NaN (decided on
    # the bias, as the onnx reference does).
    masked_rows = np.isneginf(bias.max(axis=-1, keepdims=True)) if total else np.ones(
        bias.shape[:3] + (1,), bool)
    row_max = np.where(masked_rows, 0, with_bias.max(axis=-1, keepdims=True) if total else 0)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(with_bias - row_max)
        denom = e.sum(axis=-1, keepdims=True)
        probs = np.where(masked_rows, acc.type(0), e / np.where(denom == 0, 1, denom))

    y4 = np.einsum("bhgst,bhtd->bhgsd", probs.reshape(b, hkv, group, sq, total), v)
    y, y_view = call.new_output()
    y_view[...] = y4.reshape(b, hq, sq, -1)
    return y, scores, with_bias, probs


def _allowed(call, sq, total):
    """``(B, 1, Sq, T)``: the keys each query may attend (causal, windows,
    valid lengths), from the same per-batch integers the kernel uses."""
    pos = call.offset[:, None, None, None] + np.arange(sq)[None, None, :, None]
    j = np.arange(total)[None, None, None, :]
    # Only causal and the windows depend on the query position: a very negative
    # offset (nonpad_kv_seqlen[b] << Sq) masks nothing by itself.
    allowed = (j < call.valid[:, None, None, None]) & np.ones((1, 1, sq, 1), bool)  # (B, 1, Sq, T)
    if call.is_causal:
        allowed &= j <= pos
    if call.left >= 0:
        allowed &= j >= pos - call.left
    if call.right >= 0:
        allowed &= j <= pos + call.right
    return allowed
