"""The plain NumPy path of Attention, for a prepared ``AttentionCall``.

It materialises the ``(Sq, T)`` scores, so numkv uses it only where that is
the point: ONNX's ``qk_matmul_output`` debug output (``numkv.onnx``), and as
the simple path tests can force with ``_config.REFERENCE``.  GQA stays an
index map here too (a reshape, not a repeat).
"""

import numpy as np

from ._quantize import dequantized


def attention_reference(call):
    """``(Y, scores, scores_with_bias, probabilities)``.

    ``scores`` are ``Q K^T * scale`` after the softcap (ONNX applies the
    softcap before the mask); ``probabilities`` have zero rows where every key
    is masked (and, with ``sinks``, sum to less than 1: the sink's share).  Y is in the layout of ``call.new_output()``; the others are
    ``(B, Hq, Sq, T)``, all in the accumulation dtype.
    """
    acc = call.acc_dtype
    b, hq, sq, d = call.q.shape
    hkv = call.k.shape[1]
    group = hq // hkv
    total = call.total
    q = call.q.astype(acc).reshape(b, hkv, group, sq, d)
    k = np.concatenate([dequantized(call.past_k, acc), dequantized(call.k, acc)], axis=2)
    v = np.concatenate([dequantized(call.past_v, acc), dequantized(call.v, acc)], axis=2)

    scores = np.einsum("bhgsd,bhtd->bhgst", q, k).reshape(b, hq, sq, total) * acc.type(call.scale)
    if call.softcap > 0:
        scores = call.softcap * np.tanh(scores / call.softcap)
    bias = np.where(_allowed(call, sq, total), acc.type(0), acc.type(-np.inf))
    if call.mask is not None:
        length = call.mask.shape[3]
        bias = bias + np.pad(call.mask, [(0, 0)] * 3 + [(0, total - length)],
                             constant_values=-np.inf) if length < total else bias + call.mask
    with np.errstate(invalid="ignore"):
        with_bias = scores + bias  # the reference's qk_matmul_output (mode 2): NaN where 0 * inf is
    # API.md: a key excluded by the mask, the causal rule, a window or the
    # valid length never influences Y, even where its K holds inf or NaN
    # (the reference's ``-inf + nan`` is NaN): excluded scores are -inf.
    excluded = np.isneginf(bias)
    attended = np.where(excluded, acc.type(-np.inf), with_bias)

    # A row whose bias is all -inf attends nothing: zeros, not NaN (decided on
    # the bias, as the onnx reference does).
    masked_rows = np.isneginf(bias.max(axis=-1, keepdims=True)) if total else np.ones(
        bias.shape[:3] + (1,), bool)
    row_max = np.where(masked_rows, 0, attended.max(axis=-1, keepdims=True) if total else 0)
    sink = None
    if call.sinks is not None:  # one more logit per head in the denominator (API.md's formula)
        sink = call.sinks.astype(acc).reshape(1, hq, 1, 1)
        with np.errstate(invalid="ignore"):
            row_max = np.where(masked_rows, 0, np.maximum(row_max, sink))
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(attended - row_max)
        denom = e.sum(axis=-1, keepdims=True)
        if sink is not None:
            denom = denom + np.exp(sink - row_max)
        probs = np.where(masked_rows, acc.type(0), e / np.where(denom == 0, 1, denom))

    attends = ~excluded  # (B, Hq, Sq, T), or (B, 1, Sq, T) without a mask
    attends = attends.reshape(b, hkv, group, sq, total) if attends.shape[1] == hq else attends[:, :, None]
    y4 = _weighted_values(probs.reshape(b, hkv, group, sq, total), attends, v, acc)
    y, y_view = call.new_output()
    y_view[...] = y4.reshape(b, hq, sq, v.shape[3])
    return y, scores, with_bias, probs


def _weighted_values(probs, attended, v, acc):
    """``sum_t probs[..., t] * v[t]`` over the keys a query attends only (as
    the kernel does): a key excluded by the mask, the causal rule, a window
    or the valid length never reaches Y, even with an inf or NaN in its V
    (where ``0 * inf`` would be NaN).  ``attended`` broadcasts to ``probs``
    (one row per kv head when the bias does not depend on the query head).
    An attended key multiplies its V whatever its weight, as in the
    reference: NaN for a NaN, for an infinity of weight 0 (underflowed) and
    for +inf beside -inf; else that infinity."""
    finite = np.isfinite(v)
    y = np.einsum("bhgst,bhtd->bhgsd", probs, np.where(finite, v, acc.type(0)))
    if finite.all():
        return y
    attended = np.broadcast_to(attended, probs.shape)
    weighted = attended & (probs > 0)

    def count(keys, values):
        return np.einsum("bhgst,bhtd->bhgsd", keys.astype(acc), values.astype(acc))

    infinite = np.isinf(v)
    nan = count(attended, np.isnan(v)) + count(attended & (probs == 0), infinite)
    pos, neg = count(weighted, np.isposinf(v)), count(weighted, np.isneginf(v))
    y = np.where(pos > 0, acc.type(np.inf), y)
    y = np.where(neg > 0, acc.type(-np.inf), y)
    return np.where((nan > 0) | ((pos > 0) & (neg > 0)), acc.type(np.nan), y)


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
