"""numkv inside Hugging Face transformers: an attention function, the mask
function it needs, and a KV cache whose layers are numkv caches.

Three lines::

    import numkv.transformers
    numkv.transformers.register()                      # name "numkv"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="numkv")
    cache = numkv.transformers.KVCache(model.config, batch_size=1, max_cache_len=4096)
    model.generate(**inputs, cache=cache)    # optional; past_key_values=cache works too (and warns)

Shapes, in transformers' names: ``B`` batch, ``Hq`` / ``Hkv`` query / key-value
heads, ``Sq`` queries, ``Skv`` keys, ``D`` / ``Dv`` head sizes.  transformers
hands the attention function ``query (B, Hq, Sq, D)``, ``key`` / ``value``
``(B, Hkv, Skv, D)`` and whatever the registered mask function built; it wants
``(B, Sq, Hq, Dv)`` back.  Every tensor goes to ``numkv.attention`` as a NumPy
view of the tensor's own memory (``Tensor.numpy()``; bfloat16 through an
int16 view, reinterpreted as ``ml_dtypes.bfloat16``) and Y comes back as a
tensor over numkv's output array (``torch.from_numpy``), transposed, not
copied.  GQA is numkv's own head map: K and V are never repeated.

The mask function (``numkv_mask``) does not build the ``(B, 1, Sq, Skv)``
mask when the pattern is one numkv has a rule for -- causal, causal with a
sliding window (recognised by transformers' own mask functions), or
bidirectional -- but a ``MaskSpec``: the query and key offsets, the window,
and the 2-D padding mask as it came.  The attention function turns it into
``is_causal`` plus ``nonpad_kv_seqlen`` (the causal diagonal's offset), a
``left_window_size`` and, only where some key is padding, a ``(B, 1, 1,
Skv)`` bool mask.  Any other pattern (packed sequences, custom ``or`` /
``and`` mask functions) gets transformers' dense bool mask, which numkv
reads as any mask.

``KVCache`` is a ``transformers.Cache`` whose layers hold a
``numkv.StaticKVCache`` each.  Its ``update`` appends in place (O(new
tokens)) and returns tensors over the filled prefix of the buffers, tagged
with their layer; the attention function recognises the tag and calls
``numkv.attention`` on the cache's own buffers with ``nonpad_kv_seqlen`` (no
mask over the capacity).  A float cache also works with transformers' eager
and sdpa attention, as a DynamicCache would.
"""

from __future__ import annotations

import numbers

import ml_dtypes
import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    sdpa_mask,
)

import numkv as _numkv

from .cache import QUANTIZED_DTYPES, StaticKVCache

__all__ = ["KVCache", "MaskSpec", "attention_forward", "continuous_batching", "numkv_mask", "register"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
# The cache formats KVCache takes: float formats store the model's keys as
# they are (cast once on append where the dtype differs); quantised formats
# are StaticKVCache formats that quantise on append.
FLOAT_FORMATS = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": _BF16}
_TORCH_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# ---------------------------------------------------------------------------
# torch <-> NumPy, no copies


def as_numpy(tensor: torch.Tensor, name: str) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory, strides included (no copy).

    bfloat16 has no NumPy dtype of its own: its bits are viewed as int16 and
    reinterpreted as ``ml_dtypes.bfloat16``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; numkv runs on the CPU only")
    tensor = tensor.detach()  # a view: .numpy() refuses tensors that require grad
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_BF16)
    return tensor.numpy()


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over ``array``'s memory (no copy); bfloat16 through int16."""
    if array.dtype == _BF16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


# ---------------------------------------------------------------------------
# the mask function


class MaskSpec:
    """What numkv's mask function returns for the patterns it has rules for:
    the mask as arguments, not as a ``(B, 1, Sq, Skv)`` tensor.

    Query ``i`` sits at position ``q_offset + i``, key ``j`` at ``kv_offset +
    j`` (transformers' ``get_mask_sizes``); ``causal`` keys at positions up
    to the query's, ``window`` (or None) keeps the last ``window`` of them
    (transformers: ``kv_pos > q_pos - window``), ``padding`` is the 2-D
    ``(B, positions)`` bool mask of real tokens (None: no padding).
    """

    # generate() builds the masks of a compileable cache's step ahead and
    # passes them to the model as its ``attention_mask``, whose mask code
    # asks for ``ndim`` (2-D: a padding mask to expand) and then hands the
    # spec back to ``numkv_mask``, which returns it as it is.
    ndim = 4

    __slots__ = (
        "_dense_kwargs",
        "_rows",
        "batch_size",
        "causal",
        "kv_length",
        "kv_offset",
        "padding",
        "q_length",
        "q_offset",
        "window",
    )

    def __init__(self, batch_size, q_length, kv_length, q_offset, kv_offset, causal, window, padding,
                 dense_kwargs):
        self.batch_size, self.q_length, self.kv_length = batch_size, q_length, kv_length
        self.q_offset, self.kv_offset = q_offset, kv_offset
        self.causal, self.window, self.padding = causal, window, padding
        self._dense_kwargs = dense_kwargs
        self._rows = {}

    def __repr__(self):
        pad = None if self.padding is None else f"{self.padding.shape} bool"
        return (f"MaskSpec(batch_size={self.batch_size}, q_length={self.q_length}, kv_length={self.kv_length}, "
                f"q_offset={self.q_offset}, kv_offset={self.kv_offset}, causal={self.causal}, "
                f"window={self.window}, padding={pad})")

    @property
    def shape(self):
        """The shape of the mask this stands for (what transformers would have built)."""
        return (self.batch_size, 1, self.q_length, self.kv_length)

    def dense(self) -> torch.Tensor:
        """transformers' own ``(B, 1, Sq, Skv)`` bool mask for this pattern."""
        return sdpa_mask(**self._dense_kwargs)

    def key_rows(self, keys: int) -> np.ndarray | None:
        """``(B, 1, 1, keys)`` bool: which of ``keys`` keys (from ``kv_offset``)
        are real tokens; None where all are.  Computed once per key count: the
        layers of one forward share the spec."""
        if self.padding is None:
            return None
        rows = self._rows.get(keys)
        if rows is None:
            pad = self.padding[:, self.kv_offset:self.kv_offset + keys]
            if pad.shape[1] < keys:  # positions past the 2-D mask: not tokens (as transformers pads it)
                pad = np.concatenate([pad, np.zeros((pad.shape[0], keys - pad.shape[1]), bool)], axis=1)
            rows = None if pad.all() else pad[:, None, None, :]
            self._rows[keys] = rows
        return rows


def _closure(fn):
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))


def _sliding_window_of(fn):
    """The window of transformers' ``sliding_window_causal_mask_function(w)``
    (``and_masks(sliding_window_overlay(w), causal_mask_function)``), or None
    for any other function.  Read from the closures, so that only exactly
    that pattern is taken for one (anything else gets the dense mask)."""
    try:
        if fn.__qualname__ != "and_masks.<locals>.and_mask":
            return None
        parts = _closure(fn)["mask_functions"]
        if len(parts) != 2 or parts[1] is not causal_mask_function:
            return None
        if parts[0].__qualname__ != "sliding_window_overlay.<locals>.inner_mask":
            return None
        window = _closure(parts[0])["sliding_window"]
        return int(window) if isinstance(window, numbers.Integral) and window >= 1 else None
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def numkv_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
               mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
               use_vmap: bool = False, **kwargs) -> MaskSpec | torch.Tensor:
    """The mask function numkv registers (transformers' ``AttentionMaskInterface``).

    Returns a ``MaskSpec`` for causal, sliding-window causal and
    bidirectional patterns, and transformers' dense 4-D bool mask
    (``sdpa_mask``) for any other.
    """
    if isinstance(attention_mask, MaskSpec):  # prepared ahead (see MaskSpec.ndim)
        return attention_mask
    dense_kwargs = dict(kwargs, batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=attention_mask, use_vmap=use_vmap, allow_is_causal_skip=False,
                        allow_is_bidirectional_skip=False)
    if mask_function is causal_mask_function:
        causal, window = True, None
    elif mask_function is bidirectional_mask_function:
        causal, window = False, None
    else:
        window = _sliding_window_of(mask_function)
        causal = True
        if window is None:
            return sdpa_mask(**dense_kwargs)
    if use_vmap:
        return sdpa_mask(**dense_kwargs)
    padding = None
    if attention_mask is not None:
        if attention_mask.ndim != 2:
            return sdpa_mask(**dense_kwargs)
        padding = as_numpy(attention_mask.to(torch.bool), "attention_mask")
        if padding.all():
            padding = None
    return MaskSpec(int(batch_size), int(q_length), int(kv_length), int(q_offset), int(kv_offset),
                    causal, window, padding, dense_kwargs)


# ---------------------------------------------------------------------------
# the attention function


def left_window(window: int) -> int:
    """numkv's ``left_window_size`` for transformers' ``sliding_window``:
    transformers keeps key positions ``> q - window`` (the query and the
    ``window - 1`` before it), numkv those ``>= q - left_window_size``."""
    return window - 1


class _NoBackward(torch.autograd.Function):
    """Y as computed, in a graph whose backward raises: numkv's attention
    has no gradient, and a silent zero would train the wrong model."""

    @staticmethod
    def forward(ctx, y, *inputs):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("numkv's attention has no backward pass: train with "
                                  "attn_implementation='sdpa' or 'eager'")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """The attention function numkv registers (transformers' ``AttentionInterface``).

    ``query (B, Hq, Sq, D)``, ``key`` / ``value (B, Hkv, Skv, D)`` (GQA by
    the head counts), ``attention_mask`` a ``MaskSpec``, a bool or additive
    float mask broadcasting to ``(B, Hq, Sq, Skv)``, or None (then causal as
    in sdpa: ``is_causal``, else ``module.is_causal``, top-left, for more
    than one query).  ``scaling`` and ``softcap`` as in transformers' eager
    attention (softcap before the mask).  Returns ``(Y, None)``, ``Y (B, Sq, Hq, Dv)`` a transposed view of
    numkv's output.  The sliding window comes from the mask, as in eager and
    sdpa (the ``sliding_window`` keyword is what flash attention reads).
    """
    if dropout:
        raise ValueError(f"dropout = {dropout}: numkv's attention has no dropout (call model.eval())")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("numkv's attention does not take position_bias (attention biases)")
    q = as_numpy(query, "query")
    args = {"scale": scaling, "softcap": 0.0 if softcap is None else softcap}
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None:  # gpt-oss' attention sinks: numkv's ``sinks``
        args["sinks"] = sink_array(sinks)
    if isinstance(kwargs.get("cu_seq_lens_q"), torch.Tensor) and isinstance(kwargs.get("cu_seq_lens_k"), torch.Tensor):
        return _packed_forward(module, q, key, value, query, attention_mask, is_causal, args, kwargs)
    layer = getattr(key, "_numkv_layer", None)
    if layer is not None and not layer.holds(key) and layer.quantised:
        raise ValueError("key is a stale view of a quantised KVCache layer (the cache changed since)")
    if layer is not None and layer.holds(key):
        inputs = layer.cache.attention_inputs()
        k, v = inputs.pop("K"), inputs.pop("V")
        if layer.qk_precision is not None:
            args["qk_precision"] = layer.qk_precision
        _cached_mask(attention_mask, q.shape[2], k.shape[2], inputs, args)
    else:
        k, v = as_numpy(key, "key"), as_numpy(value, "value")
        inputs = {}
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        _plain_mask(attention_mask, q.shape[2], k.shape[2], causal, inputs, args)
    y = _numkv.attention(q, k, v, **inputs, **args)
    out = as_tensor(y).transpose(1, 2)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        out = _NoBackward.apply(out, query, key, value)
    return out, None


def _packed_forward(module, q, key, value, query, attention_mask, is_causal, args, kwargs):
    """transformers' continuous batching (``generate_batch``): the sequences
    of a batch packed along one axis, ``query (1, Hq, Tq, D)``, ``key`` /
    ``value (1, Hkv, Tk, D)`` (the paged cache's keys of each sequence, read
    out in order) and ``cu_seq_lens_q`` / ``cu_seq_lens_k``, no mask (as for
    flash attention): ``numkv.varlen_attention``, causal bottom-right, the
    layer's ``sliding_window`` as flash attention reads it.  Rows past
    ``cu_seq_lens_q[-1]`` (padding, where transformers pads the batch) are
    zeros."""
    if attention_mask is not None:
        raise ValueError("a packed batch (cu_seq_lens_q) comes with no attention_mask: numkv's attention "
                         "reads the sequences' bounds from cu_seq_lens_q / cu_seq_lens_k")
    if q.shape[0] != 1:
        raise ValueError(f"a packed batch (cu_seq_lens_q) has batch size 1, got query {tuple(q.shape)}")
    cu_q = as_numpy(kwargs["cu_seq_lens_q"], "cu_seq_lens_q")
    cu_k = as_numpy(kwargs["cu_seq_lens_k"], "cu_seq_lens_k")
    k, v = as_numpy(key, "key"), as_numpy(value, "value")
    n_q, n_k = int(cu_q[-1]), int(cu_k[-1])
    window = kwargs.get("sliding_window")
    if window is not None and window > 0:
        args["left_window_size"] = left_window(int(window))
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    packed = (x[0].transpose(1, 0, 2) for x in (q, k, v))  # (T, H, D) views
    q3, k3, v3 = packed
    y = _numkv.varlen_attention(q3[:n_q], k3[:n_k], v3[:n_k], cu_q, cu_k, is_causal=bool(causal), **args)
    if n_q < q3.shape[0]:
        y = np.concatenate([y, np.zeros((q3.shape[0] - n_q,) + y.shape[1:], y.dtype)])
    out = as_tensor(y)[None]  # (1, Tq, Hq, Dv)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        out = _NoBackward.apply(out, query, key, value)
    return out, None


def sink_array(sinks: torch.Tensor) -> np.ndarray:
    """A model's sinks (``s_aux``: one logit per query head, a parameter of
    the model's dtype) as the float64 array ``numkv.attention`` takes (and
    keys its kept plans on): a copy of a few numbers per layer and call."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"s_aux must be a torch.Tensor, got {type(sinks).__name__}")
    return sinks.detach().to(torch.float64).numpy()


def _mask_array(mask, name="attention_mask"):
    if isinstance(mask, torch.Tensor):
        return as_numpy(mask, name)
    raise TypeError(f"{name} must be a numkv MaskSpec, a torch.Tensor or None, got {type(mask).__name__}")


def _spec_args(spec, keys, inputs, args):
    """Window and padding of a spec, for ``keys`` keys from its ``kv_offset``."""
    if spec.window is not None:
        args["left_window_size"] = left_window(spec.window)
    rows = spec.key_rows(keys)
    if rows is not None:
        inputs["attn_mask"] = rows


def _plain_mask(mask, sq, keys, module_causal, inputs, args):
    """Key / value tensors of any cache (or none): the mask's arguments."""
    if mask is None:
        # As sdpa: causal (top-left, which numkv's is without an offset) for
        # more than one query, none for one.
        args["is_causal"] = bool(module_causal) and sq > 1
        return
    if not isinstance(mask, MaskSpec):
        inputs["attn_mask"] = _mask_array(mask)
        return
    if not mask.causal:
        _spec_args(mask, keys, inputs, args)
        return
    # Query i at q_offset + i attends key j at kv_offset + j iff j <= i +
    # (q_offset - kv_offset): numkv's causal rule with nonpad_kv_seqlen = n,
    # whose offset is n - Sq.  Keys past n are future ones (or a static
    # cache's empty slots): excluded either way.
    n = mask.q_offset - mask.kv_offset + sq
    if not 0 <= n <= keys:
        inputs["attn_mask"] = _mask_array(mask.dense())
        return
    _spec_args(mask, keys, inputs, args)
    if n == keys and sq == 1 and "left_window_size" not in args and "attn_mask" not in inputs:
        return  # one query that attends every key: no rule at all (numkv then keeps a plan per shape)
    inputs["nonpad_kv_seqlen"] = np.full(mask.batch_size, n, np.int64)
    args["is_causal"] = True


def _cached_mask(mask, sq, keys, inputs, args):
    """Keys of a ``KVCache`` layer: ``inputs`` (from ``attention_inputs()``)
    already holds ``nonpad_kv_seqlen`` and ``is_causal``; add the mask's
    window and padding."""
    if mask is None:
        return
    if not isinstance(mask, MaskSpec):  # a dense mask over the filled prefix, causal rule included
        inputs["attn_mask"] = _mask_array(mask)
        inputs["is_causal"] = False
        return
    if mask.kv_offset != 0 or mask.kv_length != keys or mask.q_length != sq:
        raise ValueError(f"the mask was built for {mask.kv_length} keys from position {mask.kv_offset} and "
                         f"{mask.q_length} queries, the KVCache layer holds {keys} keys for {sq} queries")
    inputs["is_causal"] = mask.causal
    _spec_args(mask, keys, inputs, args)


def register(name: str = "numkv") -> str:
    """Register numkv's attention function and mask function with
    transformers under ``name`` (and ``name + "_flash"``, for continuous
    batching); returns ``name``.

    Then ``AutoModelForCausalLM.from_config(config, attn_implementation=name)``
    (or ``from_pretrained``) runs every attention layer on ``numkv.attention``.

    Continuous batching (``model.generate_batch``, ``init_continuous_batching``):
    transformers 5.24 runs it for ``"sdpa"``, ``"paged|eager"`` and any
    implementation whose name contains ``"flash"``
    (``ContinuousBatchingManager.switch_to_cb_friendly_attn``,
    ``utils.generic.is_flash_attention_requested``); to a "flash" one it hands
    the batch's sequences packed along one axis with ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` and no mask, which numkv's function runs on
    ``numkv.varlen_attention`` (each sequence attends its own keys: no
    ``(Tq, Tk)`` mask).  A model cannot be *loaded* under a "flash" name
    (transformers then looks for a flash-attention package or hub kernel),
    so load it under ``name`` and switch its config before ``generate_batch``:
    ``numkv.transformers.continuous_batching(model)`` (which sets
    ``model.config._attn_implementation = name + "_flash"``).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not name or name in ("eager", "sdpa") or name.startswith(("flash_attention", "flex_attention", "paged")):
        raise ValueError(f"name {name!r} is empty or one of transformers' own implementations")
    for registered in (name, name + CONTINUOUS_BATCHING_SUFFIX):
        AttentionInterface.register(registered, attention_forward)
        AttentionMaskInterface.register(registered, numkv_mask)
        _REGISTERED.add(registered)
    return name


# What makes transformers' continuous batching take an implementation: "flash" in its name.
CONTINUOUS_BATCHING_SUFFIX = "_flash"


def continuous_batching(model, *, cache_tokens: int | None = 65536) -> str:
    """Let ``model`` (loaded with numkv's implementation, ``register()``'s
    name) run transformers' continuous batching (``model.generate_batch``)
    on numkv: its config's attention implementation becomes the name
    ``register()`` gave with ``"_flash"`` appended, which transformers
    accepts for continuous batching (see ``register``); returns that name.
    Plain ``generate`` and forward calls keep working under it (the same
    functions are registered).

    ``cache_tokens``: the paged cache's capacity, in tokens of every layer,
    when ``generate_batch`` / ``init_continuous_batching`` are given no
    ``ContinuousBatchingConfig``: at least the model's longest request
    (``max_position_embeddings``) and two pages, but never more than half
    the memory available at that call (which wins: a request longer than
    such a cache then fails in transformers).  transformers itself would take 90% of the free
    memory -- on a CPU, the machine's RAM -- and zero it on every
    ``generate_batch`` (8 s of a 39 s batch in docs/transformers.md).
    Requests beyond the capacity wait for pages.  ``None`` keeps
    transformers' sizing; a config passed explicitly always wins.  65,536
    tokens are ~1 GiB for that benchmark's model; Llama-3.2-1B's 131,072
    positions in float32 take 8 GiB.
    """
    current = model.config._attn_implementation
    if current not in _REGISTERED:
        raise ValueError(f"the model's attention implementation is {current!r}, not one numkv registered "
                         f"({sorted(_REGISTERED)}): load it with attn_implementation=numkv.transformers.register()")
    if cache_tokens is not None and (not isinstance(cache_tokens, numbers.Integral) or isinstance(cache_tokens, bool)
                                     or cache_tokens < 1):
        raise ValueError(f"cache_tokens must be a positive int or None, got {cache_tokens!r}")
    _size_paged_cache(model, cache_tokens)
    name = current if current.endswith(CONTINUOUS_BATCHING_SUFFIX) else current + CONTINUOUS_BATCHING_SUFFIX
    model.config._attn_implementation = name  # (the config's setter: no flash package is looked for)
    return name


def _size_paged_cache(model, cache_tokens):
    """Give ``model.init_continuous_batching`` (which ``generate_batch`` calls)
    a ``ContinuousBatchingConfig`` of ``cache_tokens`` when it gets none."""
    model.__dict__.pop("init_continuous_batching", None)  # (a second call replaces the first)
    if cache_tokens is None:
        return
    from transformers import ContinuousBatchingConfig

    init = model.init_continuous_batching

    def init_continuous_batching(generation_config=None, continuous_batching_config=None, **kwargs):
        configured = getattr(generation_config or model.generation_config, "continuous_batching_config", None)
        if continuous_batching_config is None and configured is None:
            page = ContinuousBatchingConfig().page_size
            blocks = -(-_cache_tokens(model, cache_tokens, page) // page)
            continuous_batching_config = ContinuousBatchingConfig(num_blocks=blocks)
        return init(generation_config, continuous_batching_config, **kwargs)

    model.init_continuous_batching = init_continuous_batching


def _cache_tokens(model, asked, page):
    """The paged cache's tokens: ``asked``, but room for the longest request
    the model takes (transformers fails the requests of a batch when one
    cannot fit: "No requests can be scheduled"), and at most half the memory
    free now."""
    text = model.config.get_text_config(decoder=True)
    longest = getattr(text, "max_position_embeddings", None) or 0
    q_heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or q_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // q_heads
    per_token = text.num_hidden_layers * 2 * kv_heads * head_dim * model.dtype.itemsize
    return max(page, min(max(asked, longest + 2 * page), _free_bytes() // 2 // per_token))


def _free_bytes():
    """The memory a new allocation can take now: Linux's ``MemAvailable``
    (free pages and the page cache it can drop -- on a server, where model
    files fill the cache, often many times ``MemFree``), else psutil's
    (which transformers reads on a CPU too)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return psutil.virtual_memory().available


# The names register() gave numkv's attention (a quantised KVCache needs one).
_REGISTERED = set()


# ---------------------------------------------------------------------------
# the cache


class KVCacheLayer(CacheLayerMixin):
    """One attention layer of a ``KVCache``: a ``numkv.StaticKVCache`` of
    ``(B, Hkv, max_cache_len, D)`` buffers, allocated up front.

    A sliding-window layer stores every position (linear mode) and the
    window is applied by ``left_window_size``: a ring buffer would need its
    chunks no longer than ``max_cache_len - window + 1`` (``StaticKVCache``'s
    ``max_chunk``) and a mask over slots for prefill.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, batch_size, num_heads, max_cache_len, head_dim, v_head_dim, dtype, sliding_window=None,
                 config=None, v_dtype=None):
        super().__init__()
        v_dtype = dtype if v_dtype is None else v_dtype
        self.dtype, self.v_dtype = dtype, v_dtype
        # keys or values quantised: both are read from the cache by numkv's attention only
        self.quantised = isinstance(dtype, str) or isinstance(v_dtype, str)
        self.qk_precision = None  # (``KVCache``'s)
        self.cache = StaticKVCache(batch_size, num_heads, max_cache_len, head_dim, v_head_dim=v_head_dim,
                                   dtype=dtype, v_dtype=v_dtype)
        self.batch_size, self.max_cache_len = batch_size, max_cache_len
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.device = torch.device("cpu")
        self.config = config  # the model's (text) config: whose attention reads the keys
        if not self.quantised:
            self.keys = as_tensor(self.cache.key_buffer)
            self.values = as_tensor(self.cache.value_buffer)
        self.is_initialized = True

    def __repr__(self):
        return f"KVCacheLayer({self.cache!r})"

    def lazy_initialization(self, key_states, value_states):
        """Nothing to do: the buffers exist from the start."""

    def holds(self, tensor):
        """Whether ``tensor`` is this layer's latest ``update`` result (a
        view from the start of its buffer, as long as the filled prefix)."""
        if tensor.shape[2] != self.cache.seq_len:
            return False
        return self.quantised or tensor.data_ptr() == self.keys.data_ptr()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new keys and values at each row's length (in place,
        O(new tokens)); return tensors over the filled prefix, tagged for
        numkv's attention function."""
        k, v = as_numpy(key_states, "key_states"), as_numpy(value_states, "value_states")
        if not self.quantised and k.dtype != self.cache.dtype:  # the cache's format: one cast of the new tokens
            implementation = getattr(self.config, "_attn_implementation", None)
            if implementation is not None and implementation not in _REGISTERED:
                # The keys returned are the buffers, of the cache's dtype: eager
                # and sdpa take only the model's (torch's error names neither).
                raise ValueError(
                    f"a {self.cache.dtype} KVCache serves {implementation!r} attention only at the model's "
                    f"dtype, and the model's keys are {key_states.dtype}: make it with dtype={key_states.dtype}, "
                    f"or build the model with attn_implementation='numkv' (numkv.transformers.register()), "
                    f"which reads any")
            k, v = k.astype(self.cache.dtype), v.astype(self.cache.dtype)
        elif self.quantised:  # a float half of a mixed cache: cast to its dtype
            if not isinstance(self.dtype, str) and k.dtype != self.dtype:
                k = k.astype(self.dtype)
            if not isinstance(self.v_dtype, str) and v.dtype != self.v_dtype:
                v = v.astype(self.v_dtype)
        self.cache.append(k, v)
        n = self.cache.seq_len
        if self.quantised:
            # Nothing float to show: a tensor of NaN (no memory) that only
            # numkv's attention function looks through.
            shape = (self.batch_size, k.shape[1], n)
            keys = torch.full((1, 1, 1, 1), float("nan"), dtype=key_states.dtype).expand(*shape, k.shape[3])
            values = torch.full((1, 1, 1, 1), float("nan"), dtype=value_states.dtype).expand(*shape, v.shape[3])
        else:
            keys, values = self.keys[:, :, :n], self.values[:, :, :n]
        keys._numkv_layer = values._numkv_layer = self
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the filled prefix after this step's keys."""
        return self.cache.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.seq_len

    def get_max_length(self) -> int:
        return self.max_cache_len

    def crop(self, n: int) -> None:
        """Drop the last ``-n`` tokens (``n <= 0``; 0 drops none), as
        transformers' ``DynamicLayer.crop``: a positive ``n`` is a ``ValueError``."""
        if n > 0:
            raise ValueError(f"crop({n}): n is the number of tokens to drop, negated (as transformers' "
                             f"Cache.crop); to keep the first {n}, crop({n} - cache.get_seq_length())")
        if n:
            self.cache.crop(n)

    def reset(self) -> None:
        self.cache.reset()

    def offload(self):
        """CPU only: nothing to move."""

    def prefetch(self):
        """CPU only: nothing to move."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``b`` becomes row ``beam_idx[b]`` (a copy of the buffers)."""
        if self.quantised:
            raise NotImplementedError("reorder_cache (beam search) on a quantised KVCache")
        index = np.asarray(beam_idx.cpu() if isinstance(beam_idx, torch.Tensor) else beam_idx)
        for buf in (self.cache.key_buffer, self.cache.value_buffer):
            buf[...] = buf[index]

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("a KVCache has a fixed batch_size: build one with the batch you need")

    def batch_select_indices(self, indices: torch.Tensor):
        raise NotImplementedError("a KVCache has a fixed batch_size: build one with the batch you need")

    @property
    def nbytes(self) -> int:
        return int(self.cache.nbytes)


def _format(dtype, name="dtype"):
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_NAMES:
            raise TypeError(f"{name} {dtype} is not a KVCache format ({', '.join(FLOAT_FORMATS)}, "
                            f"{', '.join(QUANTIZED_DTYPES)})")
        return FLOAT_FORMATS[_TORCH_NAMES[dtype]]
    if isinstance(dtype, str) and dtype in QUANTIZED_DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype in FLOAT_FORMATS:
        return FLOAT_FORMATS[dtype]
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    if np_dtype is None or np_dtype not in FLOAT_FORMATS.values():
        raise TypeError(f"{name} {dtype!r} is not a KVCache format ({', '.join(FLOAT_FORMATS)}, "
                        f"{', '.join(QUANTIZED_DTYPES)})")
    return np_dtype


def _positive(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


class KVCache(Cache):
    """A ``transformers.Cache`` whose layers are numkv ``StaticKVCache``\\ s.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (its text config for multimodal models): layer
        types, key/value heads and head size come from it.
    batch_size : int
        Rows of the batches it will serve (left-padded prompts share one length).
    max_cache_len : int
        Positions each row can hold, prompt and generated tokens together.
    dtype : str, numpy or torch dtype, default "float32"
        ``"float32"``, ``"float16"``, ``"bfloat16"`` (keys cast once on append
        where the model's dtype differs), or a block format of
        ``numkv.quantize`` (quantised on append, read in place by numkv's
        attention only: a model of another ``attn_implementation`` is
        refused).
    v_dtype : str, numpy or torch dtype, optional
        The values' own format, as ``dtype`` (default: ``dtype``): e.g.
        ``dtype="q8_0", v_dtype="q4_0"``, llama.cpp's ``-ctk q8_0 -ctv q4_0``.
    qk_precision : None or "int8", optional
        With a quantised ``dtype``: numkv's attention over this cache
        quantises each query to int8 per block of 32 first
        (``numkv.attention``'s ``qk_precision``); None: exact.

    Notes
    -----
    With ``attn_implementation="numkv"`` attention reads each row's filled
    prefix of the buffers in place through ``nonpad_kv_seqlen``.  A float
    cache of the model's dtype also serves transformers' eager / sdpa
    attention (its ``update`` returns the filled prefix, as a DynamicCache
    does); one of another dtype, or a quantised one, only numkv's.  Sliding-window layers keep every position and apply the
    window in attention.  ``crop(n)`` as transformers' 5.x (``n < 0`` drops
    the last ``-n`` tokens, 0 none, a positive ``n`` is a ``ValueError``),
    lengths only.
    """

    def __init__(self, config, batch_size: int, max_cache_len: int, *, dtype="float32", v_dtype=None,
                 qk_precision=None):
        batch_size = _positive(batch_size, "batch_size")
        max_cache_len = _positive(max_cache_len, "max_cache_len")
        fmt = _format(dtype)
        v_fmt = fmt if v_dtype is None else _format(v_dtype, "v_dtype")
        if qk_precision not in (None, "int8"):
            raise ValueError(f"qk_precision must be None or 'int8', got {qk_precision!r}")
        if qk_precision is not None and not isinstance(fmt, str):
            raise ValueError(f"qk_precision='int8' needs quantised keys (dtype='q8_0', say), got dtype={dtype!r}")
        get_text = getattr(config, "get_text_config", None)
        if get_text is None:
            raise TypeError(f"config must be a transformers PretrainedConfig, got {type(config).__name__}")
        text = get_text(decoder=True)
        implementation = getattr(text, "_attn_implementation", None)
        quantised = fmt if isinstance(fmt, str) else v_fmt if isinstance(v_fmt, str) else None
        if quantised and implementation is not None and implementation not in _REGISTERED:
            # update() hands the model placeholder tensors (the keys live
            # quantised in numkv's buffers): eager / sdpa would read NaN.
            raise ValueError(f"a {quantised} KVCache is read by numkv's attention only: build the model with "
                             f"attn_implementation='numkv' (numkv.transformers.register()), got "
                             f"{implementation!r}")
        layer_types, per_layer = get_layer_types_and_kwargs(text)
        q_heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or q_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // q_heads
        layers = []
        for i, (kind, extra) in enumerate(zip(layer_types, per_layer)):
            if kind == "full_attention":
                window = None
            elif kind == "sliding_attention":
                window = extra["sliding_window"]
            else:
                raise NotImplementedError(f"layer {i} is of type {kind!r}: KVCache holds full and "
                                          f"sliding-window attention layers only")
            layers.append(KVCacheLayer(batch_size, kv_heads, max_cache_len, head_dim, head_dim, fmt, window, text,
                                       v_fmt))
        for layer in layers:
            layer.qk_precision = qk_precision
        super().__init__(layers=layers)
        self.max_cache_len = max_cache_len
        self.dtype, self.v_dtype, self.qk_precision = fmt, v_fmt, qk_precision

    def __repr__(self):
        name, v_name = (d if isinstance(d, str) else d.name for d in (self.dtype, self.v_dtype))
        v_part = f", v_dtype={v_name!r}" if v_name != name else ""
        return (f"KVCache(layers={len(self.layers)}, batch_size={self.layers[0].batch_size if self.layers else 0}, "
                f"max_cache_len={self.max_cache_len}, dtype={name!r}{v_part}, seq_length={self.get_seq_length()})")

    def crop(self, n: int) -> None:
        """Drop the last ``-n`` tokens of every row and layer (``n <= 0``), as
        transformers' ``Cache.crop`` (5.x): ``crop(0)`` drops none -- assisted
        generation calls it so when every candidate token was accepted --
        and a positive ``n`` is a ``ValueError``.  In place, lengths only
        (the dropped positions are overwritten by later appends)."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        for layer in self.layers:  # (a positive n: the first layer raises, before any is cropped)
            layer.crop(int(n))

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer the cache holds (its whole capacity, scales included)."""
        return sum(layer.nbytes for layer in self.layers)
