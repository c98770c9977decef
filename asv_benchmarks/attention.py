"""numkv.attention: decode, causal prefill, an external cache, GQA ratios, K/V
dtypes and the masking / softcap / window paths, beside onnxruntime's Attention
(a one-node float32 model) and torch's ``scaled_dot_product_attention`` where
they are installed.

Shapes are ONNX's 4D ``(batch, heads, seq, head_size)``.  Decode is one query
token over ``kv_len`` cached keys with Hq = 32 query heads sharing Hkv = 8 K/V
heads (a Llama-style 4:1 GQA) and head_size 128.  The peer classes take the
numkv class's parameters behind a leading ``peer``, so ``asv compare`` lines
them up.
"""

import timeit

import numpy as np

from ._common import (dtype, numkv_attention, onnx_attention_model, ort_session, randn, require,
                      reuse, skip_large, warm_once)

HQ, HKV, D = 32, 8, 128
PEERS = ["onnxruntime", "torch"]


def qkv(batch, q_heads, kv_heads, q_len, kv_len, head_size, kv_dtype="float32", q_dtype="float32"):
    """Q, K, V with the scale that keeps softmax away from one-hot (kept for
    asv's repeated setups in this process)."""
    def make():
        q = randn((batch, q_heads, q_len, head_size), dtype(q_dtype), seed=1)
        k = randn((batch, kv_heads, kv_len, head_size), dtype(kv_dtype), seed=2, scale=head_size ** -0.25)
        v = randn((batch, kv_heads, kv_len, head_size), dtype(kv_dtype), seed=3)
        return q, k, v

    return reuse(("qkv", batch, q_heads, kv_heads, q_len, kv_len, head_size, kv_dtype, q_dtype), make)


def peer_call(peer, q, k, v, *, is_causal=False, attn_mask=None, nonpad_kv_seqlen=None, softcap=0.0,
              left_window_size=-1):
    """A zero-argument callable that runs ``peer`` on float32 inputs with numkv's semantics.

    onnxruntime: ``Attention`` opset 23 (24 for ``nonpad_kv_seqlen``, 25 for a
    window; a missing opset is a skip).  torch: ``scaled_dot_product_attention``
    with ``enable_gqa``; its ``is_causal`` is top-left aligned, so it is used only
    where Sq == Skv, and ``nonpad_kv_seqlen`` becomes the equivalent bool mask.
    """
    if peer == "onnxruntime":
        onnx = require("onnx")
        feed = {"Q": q, "K": k, "V": v}
        attrs = {}
        mask_type = None
        if attn_mask is not None:
            feed["attn_mask"] = attn_mask
            mask_type = onnx.TensorProto.BOOL if attn_mask.dtype == np.bool_ else onnx.TensorProto.FLOAT
        opset = 23
        if nonpad_kv_seqlen is not None:
            feed["nonpad_kv_seqlen"] = np.asarray(nonpad_kv_seqlen, np.int64)
            opset = 24
        if left_window_size >= 0:
            attrs["left_window_size"] = left_window_size
            opset = 25
        model = onnx_attention_model(opset=opset, is_causal=is_causal, mask_type=mask_type,
                                     nonpad=nonpad_kv_seqlen is not None, softcap=softcap, **attrs)
        try:
            session = ort_session(model)
        except Exception as e:  # e.g. an opset this onnxruntime does not implement
            raise NotImplementedError(f"onnxruntime: {type(e).__name__}: {str(e)[:200]}") from None
        return lambda: session.run(None, feed)
    if peer == "torch":
        torch = require("torch")
        if softcap or left_window_size >= 0:
            raise NotImplementedError("torch's scaled_dot_product_attention has no softcap / window")
        if is_causal and q.shape[2] != k.shape[2]:
            raise NotImplementedError("torch's is_causal is top-left aligned (Sq != Skv)")
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
        mask = None
        if nonpad_kv_seqlen is not None:
            keep = np.arange(k.shape[2]) < np.asarray(nonpad_kv_seqlen)[:, None]
            mask = torch.from_numpy(keep[:, None, None, :])
        elif attn_mask is not None:
            if is_causal:  # torch takes a mask or is_causal, not both: fold causal in
                causal = np.tri(q.shape[2], k.shape[2], dtype=bool)
                if attn_mask.dtype == np.bool_:
                    attn_mask = attn_mask & causal
                else:
                    attn_mask = attn_mask + np.where(causal, np.float32(0), np.float32(-np.inf))
                is_causal = False
            mask = torch.from_numpy(np.ascontiguousarray(attn_mask))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        gqa = q.shape[1] != k.shape[1]

        def call():
            with torch.inference_mode():
                return sdpa(tq, tk, tv, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)

        return call
    raise ValueError(peer)


class Decode:
    """One query token over ``kv_len`` keys (a decode step, no mask), float32."""

    params = [[1, 8], [1024, 4096, 16384]]
    param_names = ["batch", "kv_len"]
    timer = timeit.default_timer

    def _inputs(self, batch, kv_len):
        skip_large(kv_len > 4096, "kv_len 16384")
        self.q, self.k, self.v = qkv(batch, HQ, HKV, 1, kv_len, D)

    def setup(self, batch, kv_len):
        self.attention = numkv_attention()
        self._inputs(batch, kv_len)
        warm_once((type(self).__name__, batch, kv_len), lambda: self.time_attention(batch, kv_len))

    def time_attention(self, batch, kv_len):
        self.attention(self.q, self.k, self.v)


class DecodePeers(Decode):
    params = [PEERS] + Decode.params
    param_names = ["peer"] + Decode.param_names

    def setup(self, peer, batch, kv_len):
        self._inputs(batch, kv_len)
        self.call = peer_call(peer, self.q, self.k, self.v)
        self.call()  # untimed first run (a new onnxruntime session warms up)

    def time_attention(self, peer, batch, kv_len):
        self.call()


class Prefill:
    """Causal self-attention over a whole prompt: Sq = Skv, batch 1, 8 heads of 128."""

    params = [512, 2048]
    param_names = ["seq_len"]
    timer = timeit.default_timer
    heads = 8

    def _inputs(self, seq_len):
        skip_large(seq_len > 512, "seq_len 2048")
        self.q, self.k, self.v = qkv(1, self.heads, self.heads, seq_len, seq_len, D)

    def setup(self, seq_len):
        self.attention = numkv_attention()
        self._inputs(seq_len)
        warm_once((type(self).__name__, seq_len), lambda: self.time_attention(seq_len))

    def time_attention(self, seq_len):
        self.attention(self.q, self.k, self.v, is_causal=True)


class PrefillPeers(Prefill):
    params = [PEERS, Prefill.params]
    param_names = ["peer"] + Prefill.param_names

    def setup(self, peer, seq_len):
        self._inputs(seq_len)
        self.call = peer_call(peer, self.q, self.k, self.v, is_causal=True)
        self.call()  # untimed first run (a new onnxruntime session warms up)

    def time_attention(self, peer, seq_len):
        self.call()


class ExternalCacheDecode:
    """Decode over a preallocated (8, 8, 4096, 128) cache whose rows hold
    ``nonpad_kv_seqlen`` valid tokens: "ragged" (256 ... 4096) or "full"."""

    params = ["ragged", "full"]
    param_names = ["lengths"]
    timer = timeit.default_timer
    batch, max_seq = 8, 4096

    def _inputs(self, lengths):
        self.q, self.k, self.v = qkv(self.batch, HQ, HKV, 1, self.max_seq, D)
        if lengths == "ragged":
            self.lengths = np.linspace(256, self.max_seq, self.batch).astype(np.int64)
        else:
            self.lengths = np.full(self.batch, self.max_seq, np.int64)

    def setup(self, lengths):
        self.attention = numkv_attention()
        self._inputs(lengths)
        warm_once((type(self).__name__, lengths), lambda: self.time_attention(lengths))

    def time_attention(self, lengths):
        self.attention(self.q, self.k, self.v, nonpad_kv_seqlen=self.lengths)


class ExternalCacheDecodePeers(ExternalCacheDecode):
    params = [PEERS, ExternalCacheDecode.params]
    param_names = ["peer"] + ExternalCacheDecode.param_names

    def setup(self, peer, lengths):
        self._inputs(lengths)
        self.call = peer_call(peer, self.q, self.k, self.v, nonpad_kv_seqlen=self.lengths)
        self.call()  # untimed first run (a new onnxruntime session warms up)

    def time_attention(self, peer, lengths):
        self.call()


GQA = {"MHA 32:32": 32, "GQA 32:8": 8, "MQA 32:1": 1}


class GroupedQuery:
    """Decode (batch 1, kv_len 4096) with 32 query heads over 32, 8 or 1 K/V heads."""

    params = list(GQA)
    param_names = ["q_heads:kv_heads"]
    timer = timeit.default_timer

    def _inputs(self, ratio):
        self.q, self.k, self.v = qkv(1, HQ, GQA[ratio], 1, 4096, D)

    def setup(self, ratio):
        self.attention = numkv_attention()
        self._inputs(ratio)
        warm_once((type(self).__name__, ratio), lambda: self.time_attention(ratio))

    def time_attention(self, ratio):
        self.attention(self.q, self.k, self.v)


class GroupedQueryPeers(GroupedQuery):
    params = [PEERS, GroupedQuery.params]
    param_names = ["peer"] + GroupedQuery.param_names

    def setup(self, peer, ratio):
        self._inputs(ratio)
        self.call = peer_call(peer, self.q, self.k, self.v)
        self.call()  # untimed first run (a new onnxruntime session warms up)

    def time_attention(self, peer, ratio):
        self.call()


class KVDtype:
    """Decode (batch 1, kv_len 4096, 32:8 heads) with float32 queries over a
    K/V cache stored as float32, float16, bfloat16 or float8_e4m3fn (widened
    inside the kernel; Y is float32)."""

    params = ["float32", "float16", "bfloat16", "float8_e4m3fn"]
    param_names = ["kv_dtype"]
    timer = timeit.default_timer

    def setup(self, kv_dtype):
        self.attention = numkv_attention()
        self.q, self.k, self.v = qkv(1, HQ, HKV, 1, 4096, D, kv_dtype=kv_dtype)
        warm_once((type(self).__name__, kv_dtype), lambda: self.time_attention(kv_dtype))

    def time_attention(self, kv_dtype):
        self.attention(self.q, self.k, self.v)


FEATURES = ["causal", "bool mask", "float mask", "softcap", "sliding window"]


def feature_kwargs(feature, seq_len, seed=4):
    """Keyword arguments for a causal prefill with one extra feature.  The
    masks are (1, 1, Sq, Skv) with about 10 % of the keys masked out."""
    kwargs = {"is_causal": True}
    if feature in ("bool mask", "float mask"):
        keep = np.random.default_rng(seed).random((1, 1, seq_len, seq_len)) >= 0.1
        if feature == "bool mask":
            kwargs["attn_mask"] = keep
        else:
            kwargs["attn_mask"] = np.where(keep, np.float32(0), np.float32(-np.inf))
    elif feature == "softcap":
        kwargs["softcap"] = 50.0
    elif feature == "sliding window":
        kwargs["left_window_size"] = 256
    return kwargs


class Features:
    """Causal prefill (batch 1, Sq = Skv = 1024, 8 heads of 64) plus a bool
    mask, an additive float mask, softcap, or a 256-token sliding window."""

    params = FEATURES
    param_names = ["feature"]
    timer = timeit.default_timer
    seq_len, heads, head_size = 1024, 8, 64

    def _inputs(self, feature):
        self.q, self.k, self.v = qkv(1, self.heads, self.heads, self.seq_len, self.seq_len, self.head_size)
        self.kwargs = feature_kwargs(feature, self.seq_len)

    def setup(self, feature):
        self.attention = numkv_attention()
        self._inputs(feature)
        warm_once((type(self).__name__, feature), lambda: self.time_attention(feature))

    def time_attention(self, feature):
        self.attention(self.q, self.k, self.v, **self.kwargs)


class FeaturesPeers(Features):
    params = [PEERS, Features.params]
    param_names = ["peer"] + Features.param_names

    def setup(self, peer, feature):
        self._inputs(feature)
        self.call = peer_call(peer, self.q, self.k, self.v, **self.kwargs)
        self.call()  # untimed first run (a new onnxruntime session warms up)

    def time_attention(self, peer, feature):
        self.call()
