"""numkv: Numba-compiled CPU kernels for transformer KV caches.

``tensor_scatter`` (ONNX TensorScatter) writes into a fixed-size cache;
``attention`` (ONNX Attention) reads it with a blocked online-softmax kernel.
Importing numkv compiles nothing and does not import numba or onnx: kernels
compile on their first call.
"""

from ._runtime import threadpoolctl_hook  # noqa: F401 - threadpoolctl's threadpool_limits() caps numkv too
from ._attention import attention
from ._varlen import paged_attention, varlen_attention
from ._scatter import tensor_scatter
from ._quantize import QuantizedArray, quantize
from ._version import __version__
from ._runtime.thread_count import get_num_threads, set_num_threads
from .cache import DynamicKVCache, StaticKVCache
from .layers import CachedSelfAttention

__all__ = [
    "attention", "varlen_attention", "paged_attention", "tensor_scatter", "quantize", "QuantizedArray", "DynamicKVCache", "StaticKVCache", "CachedSelfAttention",
    "set_num_threads", "get_num_threads", "__version__",
]
