"""Independent float64 loop references (no numkv, no onnx).

Written straight from API.md and the Attention-25 schema, one query row and one
key at a time, so that it is obviously right rather than fast.  Use it on tiny
shapes only.
"""

import math

import numpy as np


def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None,
              *, scale=None, is_causal=False, softcap=0.0, left_window_size=-1,
              right_window_size=-1, sinks=None):
    """Y of ONNX Attention for 4-D inputs ``(batch, heads, seq, head_size)``, in float64.

    * GQA / MQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``.
    * keys are ``past_key`` followed by ``K`` (``T = P + Skv`` in all).
    * ``offset`` is ``P`` with a past, ``nonpad_kv_seqlen[b] - Sq`` with an
      external cache, else 0; query ``i`` sits at absolute position ``offset + i``.
    * key ``j`` is visible iff ``j < nonpad_kv_seqlen[b]`` (when given),
      ``j <= pos`` (causal), ``pos - left <= j`` and ``j <= pos + right``
      (windows, each when >= 0), and the mask allows it: a bool mask's True, a
      float mask's finite value (added to the score); keys past the mask's last
      dimension are masked.
    * score = ``scale * q.k``, then softcap ``c * tanh(score / c)``, then the mask.
    * a query row with no visible key is a row of zeros.
    * ``sinks[h]``: one more logit in head ``h``'s softmax, with no value
      (``exp(sink - top)`` added to the denominator).
    """
    Q, K, V = (np.asarray(x, np.float64) for x in (Q, K, V))
    B, Hq, Sq, D = Q.shape
    Hkv = K.shape[1]
    group = Hq // Hkv
    if past_key is not None:
        K = np.concatenate([np.asarray(past_key, np.float64), K], axis=2)
        V = np.concatenate([np.asarray(past_value, np.float64), V], axis=2)
        past = past_key.shape[2]
    else:
        past = 0
    T = K.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    mask = None
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mask_len = mask.shape[3]

    Y = np.zeros((B, Hq, Sq, V.shape[3]))
    for b in range(B):
        if nonpad_kv_seqlen is not None:
            valid = int(nonpad_kv_seqlen[b])
            offset = valid - Sq
        else:
            valid = T
            offset = past
        for h in range(Hq):
            hk = h // group
            for i in range(Sq):
                pos = offset + i
                scores, values = [], []
                for j in range(T):
                    if j >= valid:
                        continue
                    if is_causal and j > pos:
                        continue
                    if left_window_size >= 0 and j < pos - left_window_size:
                        continue
                    if right_window_size >= 0 and j > pos + right_window_size:
                        continue
                    s = scale * float(np.dot(Q[b, h, i], K[b, hk, j]))
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if mask is not None:
                        if j >= mask_len:
                            continue
                        m = mask[min(b, mask.shape[0] - 1), min(h, mask.shape[1] - 1),
                                 min(i, mask.shape[2] - 1), j]
                        if mask.dtype == np.bool_:
                            if not m:
                                continue
                        else:
                            m = float(m)
                            if m == -math.inf:
                                continue
                            s += m
                    scores.append(s)
                    values.append(V[b, hk, j])
                if not scores:
                    continue  # fully masked: a zero row
                top = max(scores)
                if sinks is not None:
                    top = max(top, float(sinks[h]))
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                if sinks is not None:
                    total += math.exp(float(sinks[h]) - top)
                Y[b, h, i] = sum(w * v for w, v in zip(weights, values)) / total
    return Y
