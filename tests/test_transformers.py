"""numkv inside Hugging Face transformers (``numkv.transformers``).

Tiny random-weight decoders built from configs (no downloads): Llama with
GQA, Qwen2 with sliding-window layers, Gemma2 with softcapping and
alternating sliding layers.  Greedy generation of a left-padded batch of two
prompts with numkv's attention -- no cache, DynamicCache, StaticCache,
numkv's KVCache -- against transformers' eager attention: the same tokens,
logits within 1e-3 (float32).  Each comparison is also run against a
deliberately wrong numkv (a window off by one, padding ignored, softcap
dropped) and must then fail.
"""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    Qwen2Config,
    StaticCache,
)

import numkv
import numkv.transformers as nt

NAME = nt.register()
# initializer_range 0.1, not the default 0.02: with 0.02 the scores are ~1e-3,
# attention is near uniform and a softcap of 1 changes nothing (dropping it
# moved gemma2's logits by 1.3e-5; with 0.1, by 2.8).
SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 8,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "initializer_range": 0.1}
CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(num_hidden_layers=2, **SMALL),
    # layers 1 and 2 slide over the last 4 positions; layer 0 does not
    "qwen2-sliding": lambda: Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                                         max_window_layers=1, **SMALL),
    # sliding, full, sliding; softcapping at 1
    "gemma2-softcap": lambda: Gemma2Config(num_hidden_layers=3, head_dim=8, sliding_window=4,
                                           attn_logit_softcapping=1.0, query_pre_attn_scalar=8, **SMALL),
    # attention sinks (s_aux); sliding, full, sliding; a tiny mixture of experts
    "gptoss-sinks": lambda: GptOssConfig(num_hidden_layers=3, head_dim=8, sliding_window=4, num_local_experts=4,
                                         num_experts_per_tok=2, **SMALL),
}
# A model's sinks as trained ones are: of the order of the scores' log-sum (the
# initialiser's ~0.1 would change the logits by less than TOL).
SINK_SCALE = 2.0
# Two prompts of 8 positions, the first left-padded by 3.
IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
NEW = 8
TOL = 1e-3

_models = {}


def model(family, impl, dtype=torch.float32):
    """The family's model with attention ``impl``, the same weights for every
    impl (seed 0).  Each from its own copy of the config: from_config writes
    the implementation into the config it is given."""
    key = (family, impl, dtype)
    if key not in _models:
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[family]()), attn_implementation=impl)
        for layer in m.model.layers:
            if hasattr(layer.self_attn, "sinks"):
                with torch.no_grad():
                    layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * SINK_SCALE)
        _models[key] = m.to(dtype).eval()
    m = _models[key]
    assert m.config._attn_implementation == impl
    return m


def make_cache(kind, m, batch=2, length=32, dtype="float32"):
    if kind == "none":
        return None
    if kind == "dynamic":
        return DynamicCache(config=m.config)
    if kind == "static":
        return StaticCache(config=m.config, max_cache_len=length)
    return nt.KVCache(m.config, batch, length, dtype=dtype)


def generate(m, cache_kind):
    kw = {} if cache_kind == "none" else {"cache": make_cache(cache_kind, m)}
    with torch.no_grad():
        out = m.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, use_cache=cache_kind != "none",
                         pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits)


def mismatch(family, cache_kind):
    """``(tokens differ, max |dlogits|)`` of numkv against eager."""
    tokens_e, logits_e = generate(model(family, "eager"), "dynamic")
    tokens_n, logits_n = generate(model(family, NAME), cache_kind)
    return bool((tokens_e != tokens_n).any()), float((logits_e - logits_n).abs().max())


@pytest.fixture
def calls(monkeypatch):
    """Every numkv.attention call: its arguments and its Y."""
    seen = []
    real = numkv.attention

    def spy(*args, **kwargs):
        y = real(*args, **kwargs)
        seen.append((args, kwargs, y))
        return y

    monkeypatch.setattr(numkv, "attention", spy)
    return seen


@pytest.mark.parametrize("cache_kind", ["none", "dynamic", "static", "kvcache"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_generate_equals_eager(family, cache_kind, calls):
    differ, err = mismatch(family, cache_kind)
    assert not differ
    assert err < TOL
    layers = model(family, NAME).config.num_hidden_layers
    assert len(calls) == layers * NEW  # every layer of every step went through numkv


@pytest.mark.parametrize("family, wrong", [
    ("llama-gqa", "padding ignored"),
    ("qwen2-sliding", "window off by one"),
    ("qwen2-sliding", "window dropped"),
    ("gemma2-softcap", "softcap dropped"),
    ("gemma2-softcap", "window off by one"),
    ("gptoss-sinks", "sinks dropped"),
])
@pytest.mark.parametrize("cache_kind", ["dynamic", "kvcache"])
def test_comparison_can_fail(family, wrong, cache_kind, monkeypatch):
    if wrong == "sinks dropped":
        real = numkv.attention
        monkeypatch.setattr(numkv, "attention", lambda *a, **k: real(*a, **{**k, "sinks": None}))
    elif wrong == "padding ignored":
        monkeypatch.setattr(nt.MaskSpec, "key_rows", lambda self, keys: None)
    elif wrong == "window off by one":
        monkeypatch.setattr(nt, "left_window", lambda window: window)
    elif wrong == "window dropped":
        monkeypatch.setattr(nt, "left_window", lambda window: -1)
    else:
        real = numkv.attention
        monkeypatch.setattr(numkv, "attention", lambda *a, **k: real(*a, **{**k, "softcap": 0.0}))
    _differ, err = mismatch(family, cache_kind)
    assert err > TOL


def _chunked_logits(m, cache_kind, wrong_causal=False):
    """Logits of a left-padded prompt fed in two chunks of 5 and 3 (the
    second chunk's queries attend the first chunk's keys and, causally, each
    other), then one decode step."""
    cache = make_cache(cache_kind, m)
    steps = torch.tensor([[30], [31]])
    mask = torch.cat([MASK, torch.ones(2, 1, dtype=MASK.dtype)], 1)
    with torch.no_grad():
        first = m(input_ids=IDS[:, :5], attention_mask=MASK[:, :5], cache=cache).logits
        second = m(input_ids=IDS[:, 5:], attention_mask=MASK, cache=cache).logits
        step = m(input_ids=steps, attention_mask=mask, cache=cache).logits
    return torch.cat([first, second, step], 1)[mask.bool()]


@pytest.mark.parametrize("cache_kind", ["dynamic", "static", "kvcache"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_chunked_prefill_equals_eager(family, cache_kind, monkeypatch):
    """Several queries after a past (the causal diagonal at an offset): the
    same logits as eager; with numkv's is_causal dropped, not."""
    ref = _chunked_logits(model(family, "eager"), "dynamic")
    assert float((_chunked_logits(model(family, NAME), cache_kind) - ref).abs().max()) < TOL
    real = numkv.attention
    monkeypatch.setattr(numkv, "attention", lambda *a, **k: real(*a, **{**k, "is_causal": False}))
    assert float((_chunked_logits(model(family, NAME), cache_kind) - ref).abs().max()) > TOL


@pytest.mark.parametrize("cache_kind", ["dynamic", "kvcache"])
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-sliding"])
def test_unpadded_batch_equals_eager(family, cache_kind, calls):
    """No padding: decode steps of full layers pass numkv no mask and no
    lengths (one query attends every key)."""
    def run(m, kind):
        with torch.no_grad():
            out = m.generate(input_ids=IDS[1:], max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0,
                             cache=make_cache(kind, m, batch=1))
        return out.sequences, torch.stack(out.logits)

    tokens_e, logits_e = run(model(family, "eager"), "dynamic")
    tokens_n, logits_n = run(model(family, NAME), cache_kind)
    assert (tokens_e == tokens_n).all()
    assert float((logits_e - logits_n).abs().max()) < TOL
    assert all("attn_mask" not in kwargs for _, kwargs, _ in calls)
    if cache_kind == "dynamic":
        bare = [kwargs for _, kwargs, _ in calls if "nonpad_kv_seqlen" not in kwargs]
        assert bare and all(not kwargs.get("is_causal") for kwargs in bare)


MASK_CASES = {
    # name: (q_length, kv_length, q_offset, kv_offset, window, padded)
    "causal-prefill": (6, 6, 0, 0, None, False),
    "causal-padded": (6, 6, 0, 0, None, True),
    "past-padded": (3, 9, 6, 0, None, True),
    "sliding-padded": (6, 6, 0, 0, 3, True),
    "sliding-kv-offset": (2, 5, 6, 3, 4, True),  # a DynamicCache sliding layer past its window
    "static-capacity": (2, 12, 4, 0, None, True),  # a StaticCache: keys past the filled prefix
}


def _mask_form_error(case, form):
    from transformers.masking_utils import (
        causal_mask_function,
        eager_mask,
        sdpa_mask,
        sliding_window_causal_mask_function,
    )
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    sq, skv, q_offset, kv_offset, window, padded = MASK_CASES[case]
    B, Hq, Hkv, D = 2, 8, 2, 16
    torch.manual_seed(1)
    query = torch.randn(B, sq, Hq, D).transpose(1, 2)
    key, value = torch.randn(B, Hkv, skv, D) * 2, torch.randn(B, Hkv, skv, D)
    total = max(q_offset + sq, kv_offset + skv)
    padding = torch.ones(B, total, dtype=torch.bool)
    if padded:
        padding[0, :3] = False
    args = {"batch_size": B, "q_length": sq, "kv_length": skv, "q_offset": q_offset, "kv_offset": kv_offset,
            "attention_mask": padding,
            "mask_function": causal_mask_function if window is None else sliding_window_causal_mask_function(window)}
    dense = sdpa_mask(**args, allow_is_causal_skip=False)
    mask = {"spec": lambda: nt.numkv_mask(**args), "sdpa-bool": lambda: dense,
            "eager-float": lambda: eager_mask(**args)}[form]()
    assert isinstance(mask, nt.MaskSpec) == (form == "spec")
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = Hq // Hkv, True
    expected, _ = eager_attention_forward(module.eval(), query, key, value, eager_mask(**args), scaling=0.3,
                                          softcap=2.0)
    got, _ = nt.attention_forward(module, query, key, value, mask, scaling=0.3, softcap=2.0)
    attended = dense.any(-1)[:, 0]  # (B, Sq)
    assert attended.sum() >= B * sq - 3
    return float((got - expected)[attended].abs().max())


@pytest.mark.parametrize("form", ["spec", "sdpa-bool", "eager-float"])
@pytest.mark.parametrize("case", list(MASK_CASES))
def test_attention_function_equals_eager_for_each_mask_form(case, form, calls):
    """numkv's attention function against Gemma2's eager one (GQA, softcap),
    for the mask numkv's mask function describes and for transformers' own
    dense bool (sdpa) and float (eager) masks of the same pattern.  Rows that
    attend no key are left out (eager averages V there, numkv gives 0)."""
    assert _mask_form_error(case, form) < 1e-5
    kwargs = calls[-1][1]
    if form == "spec":
        assert "attn_mask" not in kwargs or kwargs["attn_mask"].shape == (2, 1, 1, MASK_CASES[case][1])


@pytest.mark.parametrize("case, wrong", [
    ("causal-padded", "padding ignored"), ("past-padded", "padding ignored"),
    ("sliding-padded", "window off by one"), ("sliding-kv-offset", "window off by one"),
    ("static-capacity", "padding ignored"),
])
def test_mask_form_comparison_can_fail(case, wrong, monkeypatch):
    if wrong == "padding ignored":
        monkeypatch.setattr(nt.MaskSpec, "key_rows", lambda self, keys: None)
    else:
        monkeypatch.setattr(nt, "left_window", lambda window: window)
    assert _mask_form_error(case, "spec") > 1e-5


def test_kvcache_serves_eager_attention():
    """A float KVCache is a plain transformers Cache: eager attention over it
    gives what it gives over a DynamicCache."""
    m = model("qwen2-sliding", "eager")
    tokens_d, logits_d = generate(m, "dynamic")
    tokens_k, logits_k = generate(m, "kvcache")
    assert (tokens_d == tokens_k).all()
    assert float((logits_d - logits_k).abs().max()) < 1e-5


def test_contract_spelling_past_key_values():
    """API.md's spelling, model.generate(..., past_key_values=cache) (transformers 5
    calls it ``cache`` and warns about the old name)."""
    m = model("gemma2-softcap", NAME)
    cache = nt.KVCache(m.config, 2, 32)
    with torch.no_grad(), pytest.warns(FutureWarning, match="past_key_values"):
        out = m.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0, past_key_values=cache)
    tokens_e, _ = generate(model("gemma2-softcap", "eager"), "dynamic")
    assert (out == tokens_e).all()
    assert cache.get_seq_length() == IDS.shape[1] + NEW - 1


class _FloatAsQuantised(numkv.StaticKVCache):
    """A stand-in for numkv's quantised cache until it lands: takes "q8_0"
    and stores float32, so that KVCache's quantised path (tensors of NaN
    handed to the model, the buffers read by numkv's attention function)
    runs and its results can be compared with eager's."""

    def __init__(self, *args, dtype, v_dtype=None, **kwargs):
        super().__init__(*args, dtype=np.float32 if dtype == "q8_0" else dtype,
                         v_dtype=np.float32 if v_dtype == "q8_0" else v_dtype, **kwargs)


def test_quantised_path_reads_the_cache_not_the_tensors(monkeypatch):
    monkeypatch.setattr(nt, "StaticKVCache", _FloatAsQuantised)
    tokens_e, logits_e = generate(model("qwen2-sliding", "eager"), "dynamic")
    m = model("qwen2-sliding", NAME)
    cache = nt.KVCache(m.config, 2, 32, dtype="q8_0")
    assert cache.layers[0].quantised
    with torch.no_grad():
        out = m.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, cache=cache)
    assert (out.sequences == tokens_e).all()
    assert float((torch.stack(out.logits) - logits_e).abs().max()) < TOL
    # What update hands the model holds no keys: attention that reads it gets NaN.
    with torch.no_grad():
        eager = model("qwen2-sliding", "eager")
        logits = eager(input_ids=IDS, attention_mask=MASK, cache=nt.KVCache(m.config, 2, 32, dtype="q8_0")).logits
    assert torch.isnan(logits).all()


class _DequantisingStatic(numkv.StaticKVCache):
    """A float32 StaticKVCache holding what a quantised one of ``dtype`` /
    ``v_dtype`` would: each append quantised and dequantised (the oracle)."""

    def __init__(self, *args, dtype, v_dtype=None, **kwargs):
        super().__init__(*args, dtype=np.float32, **kwargs)
        self.formats = dtype, dtype if v_dtype is None else v_dtype

    def append(self, key, value, lengths=None):
        k_fmt, v_fmt = self.formats
        return super().append(numkv.quantize(key, k_fmt).dequantize(), numkv.quantize(value, v_fmt).dequantize(),
                              lengths)


@pytest.mark.parametrize("dtype, v_dtype", [("q8_0", "q4_0"), ("q4_1", None), ("q4_0", "q4_1")])
def test_a_quantised_kvcache_equals_attention_over_its_dequantised_values(dtype, v_dtype, monkeypatch):
    """KVCache(dtype=, v_dtype=) under numkv's attention (keys and values
    read quantised, in place) == the same model over float32 caches of the
    dequantised keys and values, to float tolerance; and the values' format
    is the one asked for (over a cache of ``dtype`` for both, the logits move)."""
    cfg = LlamaConfig(num_hidden_layers=2, **dict(SMALL, hidden_size=256))  # head_dim 32: a block
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    assert m.config._attn_implementation == NAME
    cache = nt.KVCache(m.config, 2, 32, dtype=dtype, v_dtype=v_dtype)
    assert cache.dtype == dtype and cache.v_dtype == (v_dtype or dtype) and cache.layers[0].quantised
    assert cache.nbytes == sum(layer.cache.nbytes for layer in cache.layers)
    with torch.no_grad():
        got = m(input_ids=IDS, attention_mask=MASK, cache=cache).logits
        monkeypatch.setattr(nt, "StaticKVCache", _DequantisingStatic)
        want = m(input_ids=IDS, attention_mask=MASK, cache=nt.KVCache(m.config, 2, 32, dtype=dtype,
                                                                        v_dtype=v_dtype)).logits
        one = m(input_ids=IDS, attention_mask=MASK, cache=nt.KVCache(m.config, 2, 32, dtype=dtype)).logits
    assert float((got - want).abs().max()) < TOL
    if v_dtype not in (None, dtype):
        assert float((got - one).abs().max()) > TOL


def _pointer(array):
    return array.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_no_copy_in_or_out(dtype, calls):
    """numkv.attention reads the tensors' own memory (strides as they are)
    and the result is a view of numkv's Y."""
    torch.manual_seed(0)
    B, Hq, Hkv, Sq, Skv, D = 2, 8, 2, 3, 5, 16
    query = torch.randn(B, Sq, Hq, D).to(dtype).transpose(1, 2)  # transformers' layout: a transposed view
    key = torch.randn(B, Hkv, Skv, D).to(dtype)
    value = torch.randn(B, Hkv, Skv, D).to(dtype)
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = nt.attention_forward(module, query, key, value, None, scaling=0.25)
    assert weights is None
    (q, k, v), kwargs, y = calls[0]
    for arr, tensor in ((q, query), (k, key), (v, value)):
        assert _pointer(arr) == tensor.data_ptr()
        assert arr.shape == tuple(tensor.shape)
        assert arr.strides == tuple(s * tensor.element_size() for s in tensor.stride())
    assert out.data_ptr() == _pointer(y)
    assert out.shape == (B, Sq, Hq, D) and out.dtype == dtype
    assert kwargs["is_causal"] and kwargs["scale"] == 0.25


def test_kvcache_is_read_in_place(calls):
    """With a KVCache numkv.attention gets the cache's own buffers, the
    filled prefix only, with nonpad_kv_seqlen (no mask over the capacity)."""
    m = model("llama-gqa", NAME)
    cache = nt.KVCache(m.config, 2, 64)
    with torch.no_grad():
        m(input_ids=IDS, attention_mask=MASK, cache=cache)
        m(input_ids=IDS[:, :1], attention_mask=torch.cat([MASK, MASK[:, -1:]], 1), cache=cache)
    layers = cache.layers
    assert len(calls) == 2 * len(layers)
    for i, ((q, k, v), kwargs, y) in enumerate(calls):
        layer = layers[i % len(layers)]
        filled = 8 if i < len(layers) else 9
        assert _pointer(k) == _pointer(layer.cache.key_buffer) and k.strides == layer.cache.key_buffer.strides
        assert _pointer(v) == _pointer(layer.cache.value_buffer)
        assert k.shape[2] == filled  # not the capacity of 64
        assert list(kwargs["nonpad_kv_seqlen"]) == [filled, filled] and kwargs["is_causal"]
        mask = kwargs["attn_mask"]  # the left padding of row 0, one row of keys
        assert mask.shape == (2, 1, 1, filled) and not mask[0, 0, 0, :3].any() and mask[:, 0, 0, 3:].all()


def test_decode_without_padding_takes_no_mask(calls):
    m = model("qwen2-sliding", NAME)
    cache = nt.KVCache(m.config, 1, 32)
    with torch.no_grad():
        m(input_ids=IDS[1:], cache=cache)
        m(input_ids=IDS[1:, :1], cache=cache)
    for (q, k, v), kwargs, y in calls:
        assert "attn_mask" not in kwargs
    windows = [kwargs.get("left_window_size", -1) for _, kwargs, _ in calls[-3:]]
    assert windows == [-1, 3, 3]  # qwen2-sliding: layers 1 and 2 see the last 4 positions


def _bf16_logits(m, cache):
    """Logits of a left-padded prefill (real positions) and of one decode step."""
    with torch.no_grad():
        prefill = m(input_ids=IDS, attention_mask=MASK, cache=cache).logits
        step = m(input_ids=IDS[:, -1:], attention_mask=torch.cat([MASK, MASK[:, -1:]], 1), cache=cache).logits
    return torch.cat([prefill[MASK.bool()], step[:, 0]]).float()


@pytest.mark.parametrize("wrong", [False, True], ids=["numkv", "padding-ignored"])
@pytest.mark.parametrize("family", ["llama-gqa", "gemma2-softcap"])
def test_bfloat16(family, wrong, calls, monkeypatch):
    """A bfloat16 model with a bfloat16 KVCache: numkv's logits are about as
    far from float32 eager's as eager's own bfloat16 logits are.  Both errors
    come mostly from bfloat16 rounding outside attention (llama: 0.0347 and
    0.0341), hence "about": within 1.5x.  Padding ignored, numkv's is
    many times that."""
    if wrong:
        monkeypatch.setattr(nt.MaskSpec, "key_rows", lambda self, keys: None)
    eager32, eager16 = model(family, "eager"), model(family, "eager", torch.bfloat16)
    ref = _bf16_logits(eager32, DynamicCache(config=eager32.config))
    err_eager = float((_bf16_logits(eager16, DynamicCache(config=eager16.config)) - ref).abs().max())
    m = model(family, NAME, torch.bfloat16)
    cache = nt.KVCache(m.config, 2, 32, dtype="bfloat16")
    err_numkv = float((_bf16_logits(m, cache) - ref).abs().max())
    assert (err_numkv <= 1.5 * err_eager) != wrong, (err_numkv, err_eager)
    (q, k, _v), _kwargs, y = calls[-1]
    assert q.dtype == k.dtype == y.dtype == np.dtype("bfloat16")
    assert _pointer(k) == _pointer(cache.layers[-1].cache.key_buffer)


def test_crop_and_seq_length():
    """crop(-n) drops the last n tokens in place (no copy of the buffers):
    feeding them again gives the same logits; get_seq_length follows, as a
    DynamicCache's does."""
    m = model("llama-gqa", NAME)
    cache, dynamic = nt.KVCache(m.config, 2, 32), DynamicCache(config=m.config)
    buffer = cache.layers[0].cache.key_buffer
    steps = torch.tensor([[21, 22, 23], [24, 25, 26]])
    mask = torch.cat([MASK, torch.ones(2, 3, dtype=MASK.dtype)], 1)
    with torch.no_grad():
        first = []
        for c in (cache, dynamic):
            m(input_ids=IDS, attention_mask=MASK, cache=c)
            first.append([m(input_ids=steps[:, i:i + 1], attention_mask=mask[:, :9 + i], cache=c).logits
                          for i in range(3)])
        assert cache.get_seq_length() == dynamic.get_seq_length() == 11
        cache.crop(-2)
        dynamic.crop(-2)
        assert cache.get_seq_length() == dynamic.get_seq_length() == 9
        again = [m(input_ids=steps[:, i:i + 1], attention_mask=mask[:, :9 + i], cache=cache).logits
                 for i in (1, 2)]
    assert torch.equal(again[0], first[0][1]) and torch.equal(again[1], first[0][2])
    assert float((first[0][2] - first[1][2]).abs().max()) < TOL  # and the DynamicCache run agrees
    assert cache.layers[0].cache.key_buffer is buffer
    cache.crop(0)  # transformers 5: drops none (assisted generation's call when all were accepted)
    dynamic.crop(0)
    assert (cache.get_seq_length(), dynamic.get_seq_length()) == (11, 9)
    with pytest.raises(ValueError, match="crop"):
        dynamic.crop(3)
    with pytest.raises(ValueError, match=r"to keep the first 3, crop\(3 - cache.get_seq_length\(\)\)"):
        cache.crop(3)
    cache.crop(-12)
    assert cache.get_seq_length() == 0


def test_assisted_generation_over_a_kvcache_equals_greedy():
    """Assisted generation crops the cache by the rejected candidates,
    ``crop(0)`` when all were accepted: numkv's KVCache read that as "keep
    none" and generated other tokens (API.md: crop as transformers')."""
    m = model("llama-gqa", NAME)
    torch.manual_seed(1)
    assistant = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS["llama-gqa"]()), attn_implementation="eager")
    assistant.load_state_dict(m.state_dict())  # it proposes what the model would: every candidate accepted
    ids = IDS[1:]
    with torch.no_grad():
        greedy = m.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assisted = m.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              assistant_model=assistant.eval(), cache=nt.KVCache(m.config, 1, 32))
    assert torch.equal(assisted, greedy)


def test_float16_cache_of_a_float32_model_stores_the_rounded_keys():
    """Keys are cast to the cache's dtype once, on append: layer 0's keys
    (which no attention precedes) are a DynamicCache's, rounded to float16."""
    m = model("llama-gqa", NAME)
    cache, dynamic = nt.KVCache(m.config, 2, 32, dtype="float16"), DynamicCache(config=m.config)
    with torch.no_grad():
        for c in (cache, dynamic):
            m(input_ids=IDS, attention_mask=MASK, cache=c)
    stored = cache.layers[0].cache.key_buffer[:, :, :8]
    assert stored.dtype == np.float16
    assert np.array_equal(stored, dynamic.layers[0].keys.numpy().astype(np.float16))


def test_nbytes_and_repr():
    m = model("llama-gqa", NAME)
    cache = nt.KVCache(m.config, 2, 32, dtype="float16")
    # 2 layers x (K and V) x batch 2 x 2 kv heads x 32 positions x head size 8 x 2 bytes
    assert cache.nbytes == 2 * 2 * 2 * 2 * 32 * 8 * 2
    assert "KVCache(layers=2" in repr(cache)
    assert isinstance(cache, transformers.Cache)


def test_backward_raises():
    m = model("llama-gqa", NAME)
    logits = m(input_ids=IDS[1:]).logits
    with pytest.raises(NotImplementedError, match="no backward"):
        logits.sum().backward()


def test_bad_arguments():
    cfg = model("llama-gqa", NAME).config
    with pytest.raises(TypeError, match="name"):
        nt.register(3)
    with pytest.raises(ValueError, match="name"):
        nt.register("sdpa")
    with pytest.raises(TypeError, match="batch_size"):
        nt.KVCache(cfg, 2.0, 32)
    with pytest.raises(ValueError, match="max_cache_len"):
        nt.KVCache(cfg, 2, 0)
    with pytest.raises(TypeError, match="dtype"):
        nt.KVCache(cfg, 2, 32, dtype="int8")
    with pytest.raises(TypeError, match="config"):
        nt.KVCache({"num_hidden_layers": 2}, 2, 32)
    module = torch.nn.Module()
    x = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match="dropout"):
        nt.attention_forward(module, x, x, x, None, dropout=0.1)
    with pytest.raises(TypeError, match="attention_mask"):
        nt.attention_forward(module, x, x, x, "causal")


def test_quantised_dtype_is_passed_through_or_refused():
    """"q8_0" / "q4_0" go to StaticKVCache as they are: until it takes them,
    a TypeError that says so."""
    cfg = model("llama-gqa", NAME).config
    try:
        numkv.StaticKVCache(1, 1, 32, 32, dtype="q8_0")
    except TypeError:
        with pytest.raises(TypeError, match="quantised StaticKVCache"):
            nt.KVCache(cfg, 2, 32, dtype="q8_0")
    else:
        wide = LlamaConfig(num_hidden_layers=1, **dict(SMALL, hidden_size=256))  # head_dim 32: q8_0's block
        assert nt.KVCache(wide, 2, 32, dtype="q8_0").dtype == "q8_0"
        with pytest.raises(ValueError, match="head_dim"):  # this model's head_dim 8: no block of 32
            nt.KVCache(cfg, 2, 32, dtype="q8_0")


def test_a_quantised_cache_refuses_a_model_that_would_read_its_placeholders():
    """update() hands the model placeholder tensors (the keys live quantised in
    numkv's buffers): a model whose attention is eager or sdpa would read NaN
    without a word, so a q8_0 KVCache for its config is refused."""
    wide = dict(SMALL, hidden_size=256)  # head_dim 32: q8_0's block
    for implementation in ("eager", "sdpa"):
        cfg = LlamaConfig(num_hidden_layers=1, **wide)
        m = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=implementation)
        assert m.config._attn_implementation == implementation
        with pytest.raises(ValueError, match="attn_implementation='numkv'"):
            nt.KVCache(m.config, 1, 32, dtype="q8_0")
        nt.KVCache(m.config, 1, 32)  # a float cache serves them


def test_import_numkv_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, numkv; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={"PYTHONPATH": str(root)})


def test_a_float_kvcache_of_another_dtype_tells_eager_what_to_do():
    """Eager attention reads the cache's buffers, of the cache's dtype: a
    bfloat16 model over a float32 KVCache failed inside torch ("expected
    scalar type Float but found BFloat16").  numkv's attention reads any."""
    m = model("llama-gqa", "eager", torch.bfloat16)
    cache = nt.KVCache(m.config, 2, 32)  # float32
    with torch.no_grad(), pytest.raises(ValueError, match=r"float32 KVCache serves 'eager'.*dtype=torch.bfloat16"):
        m(input_ids=IDS, attention_mask=MASK, past_key_values=cache)
    assert cache.get_seq_length() == 0  # refused before anything was written
    m = model("llama-gqa", NAME, torch.bfloat16)
    with torch.no_grad():
        m(input_ids=IDS, attention_mask=MASK, past_key_values=nt.KVCache(m.config, 2, 32))


# --------------------------------------------------------------------------
# continuous batching: model.generate_batch (transformers' paged cache)


def _cb_model(family, impl):
    """A fresh model (generate_batch switches implementations on the model it runs)."""
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[family]()), attn_implementation=impl).eval()
    for layer in m.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            with torch.no_grad():
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape) * SINK_SCALE)
    return m


def _generate_batch(m, prompts, new=6):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # A small paged cache: by default transformers sizes it from the free memory (~14 GB here).
    cache = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64)
    with torch.no_grad():
        out = m.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cache,
                               progress_bar=False)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


# Prompt mixes: lengths on both sides of the sliding window (4), one-token prompts, and a
# mix other than the one the implementation was tried on.
PROMPT_MIXES = {"mix-a": (5, 9, 1, 13), "mix-b": (17, 2, 6, 3, 11)}
# The reference: sdpa's generate_batch; gpt-oss has no sdpa, eager's (transformers' paged|eager) then.
CB_REFERENCE = {"llama-gqa": "sdpa", "qwen2-sliding": "sdpa", "gptoss-sinks": "eager"}


def _prompts(mix):
    g = torch.Generator().manual_seed(sum(PROMPT_MIXES[mix]))
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in PROMPT_MIXES[mix]]


_cb_reference = {}


def _reference_tokens(family, mix):
    if (family, mix) not in _cb_reference:
        _cb_reference[family, mix] = _generate_batch(_cb_model(family, CB_REFERENCE[family]), _prompts(mix))
    return _cb_reference[family, mix]


@pytest.mark.parametrize("mix", list(PROMPT_MIXES))
@pytest.mark.parametrize("family", list(CB_REFERENCE))
def test_generate_batch_equals_sdpa(family, mix, monkeypatch):
    seen = []
    real = numkv.varlen_attention

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(numkv, "varlen_attention", spy)
    m = _cb_model(family, NAME)
    assert nt.continuous_batching(m) == NAME + "_flash"
    assert _generate_batch(m, _prompts(mix)) == _reference_tokens(family, mix)
    assert seen  # every layer of every step on varlen_attention
    assert all(k["is_causal"] for k in seen)
    assert any("sinks" in k for k in seen) == (family == "gptoss-sinks")


@pytest.mark.parametrize("family, wrong", [
    ("llama-gqa", "one sequence"), ("qwen2-sliding", "window dropped"), ("gptoss-sinks", "sinks dropped"),
])
def test_generate_batch_comparison_can_fail(family, wrong, monkeypatch):
    real = numkv.varlen_attention

    def wrong_varlen(q, k, v, cu_q, cu_k, **kwargs):
        if wrong == "one sequence":  # the packed batch attended as one sequence (what a dense causal mask would be)
            cu_q, cu_k = np.array([0, cu_q[-1]]), np.array([0, cu_k[-1]])
        elif wrong == "window dropped":
            kwargs.pop("left_window_size", None)
        else:
            kwargs.pop("sinks", None)
        return real(q, k, v, cu_q, cu_k, **kwargs)

    monkeypatch.setattr(numkv, "varlen_attention", wrong_varlen)
    m = _cb_model(family, NAME)
    nt.continuous_batching(m)
    assert any(_generate_batch(m, _prompts(mix)) != _reference_tokens(family, mix) for mix in PROMPT_MIXES)


def test_continuous_batching_refuses_a_model_not_on_numkv():
    with pytest.raises(ValueError, match="not one numkv registered"):
        nt.continuous_batching(_cb_model("llama-gqa", "sdpa"))


def test_continuous_batching_sizes_the_paged_cache_unless_told(monkeypatch):
    """With no ContinuousBatchingConfig, generate_batch's manager gets numkv's
    capacity (transformers' own would zero 90% of the RAM): at least the
    longest request the model takes, at most half the free memory; an
    explicit config wins, ``cache_tokens=None`` gives transformers' sizing
    back."""
    from transformers import ContinuousBatchingConfig

    m = _cb_model("llama-gqa", NAME)
    longest = m.config.max_position_embeddings
    assert longest < 60000

    def blocks(**kwargs):
        return m.init_continuous_batching(**kwargs).continuous_batching_config.num_blocks

    nt.continuous_batching(m)
    assert blocks() == 65536 // 256  # the default: 65,536 tokens in pages of 256
    assert blocks(continuous_batching_config=ContinuousBatchingConfig(num_blocks=3)) == 3
    nt.continuous_batching(m, cache_tokens=1)
    assert blocks() == -(-longest // 256) + 2  # room for the longest request
    nt.continuous_batching(m, cache_tokens=longest + 5000)
    assert blocks() == -(-(longest + 5000) // 256)
    per_token = m.config.num_hidden_layers * 2 * m.config.num_key_value_heads * m.config.head_dim * 4
    monkeypatch.setattr(nt, "_free_bytes", lambda: 2 * 700 * per_token)
    assert blocks() == 3  # 700 tokens: half the free memory
    nt.continuous_batching(m, cache_tokens=None)
    assert blocks() is None
    for bad in (0, -5, 2.5, True, "many"):
        with pytest.raises(ValueError, match="cache_tokens"):
            nt.continuous_batching(m, cache_tokens=bad)


def test_generate_batch_with_a_small_cache_equals_a_large_one():
    """Requests that do not all fit wait for pages: the same tokens as
    transformers' own (large) cache, and none failed."""
    m = _cb_model("llama-gqa", NAME)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (40, 23, 51, 30, 9)]
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    runs = []
    for cache in (ContinuousBatchingConfig(page_size=16, num_blocks=6, max_batch_tokens=64),
                  ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64)):
        nt.continuous_batching(m)
        with torch.no_grad():
            out = m.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cache,
                                   progress_bar=False)
        runs.append([list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))])
    assert all(len(tokens) == 5 for tokens in runs[0])
    assert runs[0] == runs[1]


def test_kvcache_qk_precision_reaches_numkvs_attention(monkeypatch):
    """``KVCache(..., qk_precision="int8")`` makes numkv's attention over the
    cache quantise the query (API.md): every call over its layers passes it,
    the logits stay close to the exact q8_0 cache's and differ from them;
    without quantised keys it is a ValueError naming it."""
    cfg = LlamaConfig(num_hidden_layers=2, **dict(SMALL, hidden_size=256))  # head_dim 32: a block
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    seen, real = [], numkv.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("qk_precision"))
        return real(*args, **kwargs)

    monkeypatch.setattr(nt._numkv, "attention", spy)
    with torch.no_grad():
        exact = m(input_ids=IDS, attention_mask=MASK, cache=nt.KVCache(m.config, 2, 32, dtype="q8_0")).logits
        assert set(seen) == {None}
        seen.clear()
        int8 = m(input_ids=IDS, attention_mask=MASK,
                 cache=nt.KVCache(m.config, 2, 32, dtype="q8_0", qk_precision="int8")).logits
    assert seen and set(seen) == {"int8"}
    assert not torch.equal(exact, int8) and float((exact - int8).abs().max()) < 0.05 * float(exact.abs().max())
    with pytest.raises(ValueError, match="qk_precision='int8' needs quantised keys"):
        nt.KVCache(m.config, 2, 32, qk_precision="int8")
    with pytest.raises(ValueError, match="qk_precision must be None or 'int8'"):
        nt.KVCache(m.config, 2, 32, dtype="q8_0", qk_precision="int4")
