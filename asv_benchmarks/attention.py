"""numkv.attention on the workloads of issues 10 (prefill: the compute core) and
11 (decode), plus GQA ratios and the masking / softcap / window paths, beside
onnxruntime's Attention (a one-node model) and torch's
``scaled_dot_product_attention`` where they are installed.

Shapes are ONNX's 4D ``(batch, heads, seq, head_size)``, Hq = 32 query heads
sharing Hkv = 8 K/V heads (a Llama-style 4:1 GQA), head_size 128 unless said:

* ``Prefill``: causal self-attention over 512 or 2048 tokens in float32,
  float16 or bfloat16; ``FullPrefill``: 1024 tokens, no mask, float32.
* ``Decode``: one query over 1024 ... 16384 cached float32 keys, batch 1 or 8;
  ``KVDtype``: the same over a float16 / bfloat16 / float8_e4m3fn K/V cache
  (float32 queries); ``QuantizedDecode``: the same over a cache quantised by
  ``numkv.quantize`` (q8_0, q4_0, int8 / int4 per channel: issue 28);
  ``ExternalCacheDecode``: a capacity-4096 cache whose rows
  hold ``nonpad_kv_seqlen`` tokens, ``is_causal``; ``TransformersDecode``: a
  transformers-sized step (Hq 16, Hkv 4, head_size 64, 1088 keys).

The peer classes take the numkv class's parameters behind a leading ``peer``,
so ``asv compare`` lines them up.  A peer runs the case's dtype where it can
(torch bfloat16 / onnxruntime float16 stand in for float8, holding its values
exactly); one that can't (onnxruntime has no bfloat16 Attention) is skipped.
``python -m numkv bench`` times the same workloads in one run; this module keeps
its own copies of them, since asv runs it against older numkv builds.
"""

import timeit

import numpy as np

from ._common import (dtype, kv_format_scale, kv_formats, numkv_attention, onnx_attention_model, ort_session, randn,
                      require, require_attr, reuse, skip_large, warm_once)

HQ, HKV, D = 32, 8, 128
PEERS = ["onnxruntime", "torch"]
_ONNX_TYPES = {"float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}


def qkv(batch, q_heads, kv_heads, q_len, kv_len, head_size, kv_dtype="float32", q_dtype="float32"):
    """Q, K, V with the scale that keeps softmax away from one-hot (kept for
    asv's repeated setups in this process)."""
    def make():
        q = randn((batch, q_heads, q_len, head_size), dtype(q_dtype), seed=1)
        k = randn((batch, kv_heads, kv_len, head_size), dtype(kv_dtype), seed=2, scale=head_size ** -0.25)
        v = randn((batch, kv_heads, kv_len, head_size), dtype(kv_dtype), seed=3)
        return q, k, v

    return reuse(("qkv", batch, q_heads, kv_heads, q_len, kv_len, head_size, kv_dtype, q_dtype), make)


def peer_dtype(peer, name):
    """The dtype ``peer`` runs a case of dtype ``name`` in: the same, or for
    float8 the 16-bit type it has (both hold float8_e4m3fn exactly)."""
    if name.startswith("float8"):
        return {"torch": "bfloat16", "onnxruntime": "float16"}[peer]
    return name


def peer_call(peer, q, k, v, *, is_causal=False, attn_mask=None, nonpad_kv_seqlen=None, softcap=0.0,
              left_window_size=-1, dtype_name="float32"):
    """A zero-argument callable that runs ``peer`` with numkv's semantics, with
    Q, K and V converted to ``dtype_name`` (the peers take one dtype for all three).

    onnxruntime: ``Attention`` opset 23 (24 for ``nonpad_kv_seqlen``, 25 for a
    window; a missing opset or dtype is a skip).  torch: ``scaled_dot_product_attention``
    with ``enable_gqa``; its ``is_causal`` is top-left aligned, so it is used only
    where Sq == Skv (with one query, causal masks nothing: it is dropped), and
    ``nonpad_kv_seqlen`` becomes the equivalent bool mask.
    """
    q, k, v = (a.astype(dtype(dtype_name), copy=False) for a in (q, k, v))
    if peer == "onnxruntime":
        return _ort_call(q, k, v, is_causal, attn_mask, nonpad_kv_seqlen, softcap, left_window_size, dtype_name)
    if peer == "torch":
        return _torch_call(q, k, v, is_causal, attn_mask, nonpad_kv_seqlen, softcap, left_window_size, dtype_name)
    raise ValueError(peer)


def _ort_call(q, k, v, is_causal, attn_mask, nonpad_kv_seqlen, softcap, left_window_size, dtype_name):
    onnx = require("onnx")
    ort = require("onnxruntime")
    elem = getattr(onnx.TensorProto, _ONNX_TYPES[dtype_name])
    feed = {"Q": q, "K": k, "V": v}
    attrs = {}
    mask_type = None
    if attn_mask is not None:
        feed["attn_mask"] = attn_mask
        mask_type = onnx.TensorProto.BOOL if attn_mask.dtype == np.bool_ else elem
    opset = 23
    if nonpad_kv_seqlen is not None:
        feed["nonpad_kv_seqlen"] = np.asarray(nonpad_kv_seqlen, np.int64)
        opset = 24
    if left_window_size >= 0:
        attrs["left_window_size"] = left_window_size
        opset = 25
    model = onnx_attention_model(opset=opset, is_causal=is_causal, mask_type=mask_type,
                                 nonpad=nonpad_kv_seqlen is not None, softcap=softcap, elem_type=elem, **attrs)
    try:
        session = ort_session(model)
    except Exception as e:  # e.g. an opset or dtype this onnxruntime does not implement
        raise NotImplementedError(f"onnxruntime: {type(e).__name__}: {str(e)[:200]}") from None
    if dtype_name == "bfloat16":  # NumPy has no bfloat16: hand onnxruntime the bits
        values = {n: (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), elem)
                      if a.dtype == q.dtype else ort.OrtValue.ortvalue_from_numpy(a)) for n, a in feed.items()}
        return lambda: session.run_with_ort_values(["Y"], values)
    return lambda: session.run(None, feed)


def _torch_tensor(torch, a):
    if a.dtype == dtype("bfloat16"):  # torch can't read ml_dtypes' bfloat16: reinterpret the bits
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _torch_call(q, k, v, is_causal, attn_mask, nonpad_kv_seqlen, softcap, left_window_size, dtype_name):
    torch = require("torch")
    if softcap or left_window_size >= 0:
        raise NotImplementedError("torch's scaled_dot_product_attention has no softcap / window")
    if is_causal and q.shape[2] == 1:
        is_causal = False  # bottom-right causal with one query masks no key
    if is_causal and q.shape[2] != k.shape[2]:
        raise NotImplementedError("torch's is_causal is top-left aligned (Sq != Skv)")
    tq, tk, tv = (_torch_tensor(torch, a) for a in (q, k, v))
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
        if mask.dtype != torch.bool:
            mask = mask.to(tq.dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = q.shape[1] != k.shape[1]

    def call():
        with torch.inference_mode():
            return sdpa(tq, tk, tv, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)

    return call


def torch_sliced_call(q, k, v, lengths):
    """torch over each batch row's valid prefix of an external cache, one call per row."""
    torch = require("torch")
    tq, tk, tv = (_torch_tensor(torch, a) for a in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    lengths = [int(n) for n in lengths]

    def call():
        with torch.inference_mode():
            return torch.cat([sdpa(tq[b:b + 1], tk[b:b + 1, :, :n], tv[b:b + 1, :, :n], enable_gqa=True)
                              for b, n in enumerate(lengths)])

    return call


class _Timed:
    """numkv's side of a case: ``_inputs`` sets ``self.q, self.k, self.v`` and
    ``self.kwargs``; setup makes the untimed first call once per process."""

    timer = timeit.default_timer

    def setup(self, *params):
        self.attention = numkv_attention()
        self._inputs(*params)
        warm_once((type(self).__name__,) + params, lambda: self.time_attention(*params))

    def time_attention(self, *params):
        self.attention(self.q, self.k, self.v, **self.kwargs)


class _PeerTimed:
    """A peer's side: the same ``_inputs`` behind a leading ``peer`` parameter;
    ``_peer_dtype`` picks the dtype the peer runs in."""

    timer = timeit.default_timer

    def _peer_dtype(self, peer, *params):
        return "float32"

    def setup(self, peer, *params):
        self._inputs(*params)
        self.call = peer_call(peer, self.q, self.k, self.v, dtype_name=self._peer_dtype(peer, *params),
                              **self.kwargs)
        self.call()  # untimed first run (a new onnxruntime session warms up)

    def time_attention(self, peer, *params):
        self.call()


class Prefill(_Timed):
    """Causal self-attention over a whole prompt: Sq = Skv, batch 1, Hq 32, Hkv 8, all
    inputs in ``dtype``."""

    params = [[512, 2048], ["float32", "float16", "bfloat16"]]
    param_names = ["seq_len", "dtype"]

    def _inputs(self, seq_len, dtype_name):
        skip_large(seq_len > 512, "seq_len 2048")
        self.q, self.k, self.v = qkv(1, HQ, HKV, seq_len, seq_len, D, kv_dtype=dtype_name, q_dtype=dtype_name)
        self.kwargs = {"is_causal": True}


class PrefillPeers(_PeerTimed, Prefill):
    params = [PEERS] + Prefill.params
    param_names = ["peer"] + Prefill.param_names

    def _peer_dtype(self, peer, seq_len, dtype_name):
        return dtype_name


class FullPrefill(_Timed):
    """Self-attention without a mask (every query attends every key), float32."""

    params = [1024]
    param_names = ["seq_len"]

    def _inputs(self, seq_len):
        self.q, self.k, self.v = qkv(1, HQ, HKV, seq_len, seq_len, D)
        self.kwargs = {}


class FullPrefillPeers(_PeerTimed, FullPrefill):
    params = [PEERS, FullPrefill.params]
    param_names = ["peer"] + FullPrefill.param_names


class Decode(_Timed):
    """One query token over ``kv_len`` cached float32 keys (a decode step, no mask).
    Batch 8 stops at 4096 keys (16384 would be 1 GiB of K/V)."""

    params = [[1, 8], [1024, 2048, 4096, 16384]]
    param_names = ["batch", "kv_len"]

    def _inputs(self, batch, kv_len):
        skip_large(kv_len > 4096, "kv_len 16384")
        if batch * kv_len > 8 * 4096:
            raise NotImplementedError("batch 8 x kv_len 16384: 1 GiB of K/V, not benchmarked")
        self.q, self.k, self.v = qkv(batch, HQ, HKV, 1, kv_len, D)
        self.kwargs = {}


class DecodePeers(_PeerTimed, Decode):
    params = [PEERS] + Decode.params
    param_names = ["peer"] + Decode.param_names


class KVDtype(_Timed):
    """Decode (batch 1, 32:8 heads) with float32 queries over a K/V cache stored
    as float32, float16, bfloat16 or float8_e4m3fn (widened inside the kernel;
    Y is float32)."""

    params = [["float32", "float16", "bfloat16", "float8_e4m3fn"], [4096, 16384]]
    param_names = ["kv_dtype", "kv_len"]

    def _inputs(self, kv_dtype, kv_len):
        skip_large(kv_len > 4096, "kv_len 16384")
        self.q, self.k, self.v = qkv(1, HQ, HKV, 1, kv_len, D, kv_dtype=kv_dtype)
        self.kwargs = {}


class KVDtypePeers(_PeerTimed, KVDtype):
    """The peers in the cache's dtype, all inputs (torch bfloat16 and onnxruntime
    float16 for float8); the float32 row is the reference."""

    params = [PEERS] + KVDtype.params
    param_names = ["peer"] + KVDtype.param_names

    def _peer_dtype(self, peer, kv_dtype, kv_len):
        return peer_dtype(peer, kv_dtype)


class QuantizedDecode(_Timed):
    """Decode (batch 1, 32:8 heads) with float32 queries over a K/V cache
    quantised by ``numkv.quantize``, every format of its registry: llama.cpp's
    blocks, or onnxruntime's GroupQueryAttention codes with a per-channel
    scale, read inside the kernel.  Skipped where numkv has no
    ``quantize`` (before issue 28)."""

    params = [kv_formats(), [4096, 16384]]
    param_names = ["kv_format", "kv_len"]

    def _inputs(self, kv_format, kv_len):
        import numkv

        skip_large(kv_len > 4096, "kv_len 16384")
        quantize = require_attr(numkv, "quantize")
        self.q, k, v = qkv(1, HQ, HKV, 1, kv_len, D)

        self.k, self.v = (quantize(x, kv_format, scale=kv_format_scale(kv_format, x)) for x in (k, v))
        self.kwargs = {}


EXTERNAL_LENGTHS = {"ragged": [1024, 2048, 3072, 4096], "full": [4096] * 4}


class ExternalCacheDecode(_Timed):
    """Decode over a preallocated (4, 8, 4096, 128) cache whose rows hold
    ``nonpad_kv_seqlen`` valid tokens ("ragged": 1024 ... 4096, or "full"),
    ``is_causal`` (bottom-right: with one query, every valid key)."""

    params = list(EXTERNAL_LENGTHS)
    param_names = ["lengths"]
    max_seq = 4096

    def _inputs(self, lengths):
        self.lengths = np.array(EXTERNAL_LENGTHS[lengths], np.int64)
        self.q, self.k, self.v = qkv(len(self.lengths), HQ, HKV, 1, self.max_seq, D)
        self.kwargs = {"nonpad_kv_seqlen": self.lengths, "is_causal": True}


class ExternalCacheDecodePeers(_PeerTimed, ExternalCacheDecode):
    """onnxruntime with ``nonpad_kv_seqlen`` (opset 24), torch with the equivalent
    bool mask, and torch over K/V sliced to each row's length ("torch sliced")."""

    params = [PEERS + ["torch sliced"], ExternalCacheDecode.params]
    param_names = ["peer"] + ExternalCacheDecode.param_names

    def setup(self, peer, lengths):
        if peer != "torch sliced":
            return super().setup(peer, lengths)
        self._inputs(lengths)
        self.call = torch_sliced_call(self.q, self.k, self.v, self.lengths)
        self.call()


class TransformersDecode(_Timed):
    """A decode step of a transformers-sized model: batch 1, Hq 16, Hkv 4,
    head_size 64, 1088 cached keys, float32."""

    def _inputs(self):
        self.q, self.k, self.v = qkv(1, 16, 4, 1, 1088, 64)
        self.kwargs = {}


class TransformersDecodePeers(_PeerTimed, TransformersDecode):
    params = [PEERS]
    param_names = ["peer"]


GQA = {"MHA 32:32": 32, "GQA 32:8": 8, "MQA 32:1": 1}


class GroupedQuery(_Timed):
    """Decode (batch 1, kv_len 4096) with 32 query heads over 32, 8 or 1 K/V heads."""

    params = list(GQA)
    param_names = ["q_heads:kv_heads"]

    def _inputs(self, ratio):
        self.q, self.k, self.v = qkv(1, HQ, GQA[ratio], 1, 4096, D)
        self.kwargs = {}


class GroupedQueryPeers(_PeerTimed, GroupedQuery):
    params = [PEERS, GroupedQuery.params]
    param_names = ["peer"] + GroupedQuery.param_names


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


class Features(_Timed):
    """Causal prefill (batch 1, Sq = Skv = 1024, 8 heads of 64) plus a bool
    mask, an additive float mask, softcap, or a 256-token sliding window."""

    params = FEATURES
    param_names = ["feature"]
    seq_len, heads, head_size = 1024, 8, 64

    def _inputs(self, feature):
        self.q, self.k, self.v = qkv(1, self.heads, self.heads, self.seq_len, self.seq_len, self.head_size)
        self.kwargs = feature_kwargs(feature, self.seq_len)


class FeaturesPeers(_PeerTimed, Features):
    params = [PEERS, Features.params]
    param_names = ["peer"] + Features.param_names
