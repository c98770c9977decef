"""Layers in NumPy with numkv's attention and caches: ``CachedSelfAttention``
(``attention.py``) and the demo's small Llama-style ``Decoder``
(``decoder.py``: ``python -m numkv demo``)."""

from .attention import CachedSelfAttention, rope
from .decoder import CACHE_KINDS, PRESETS, Decoder

__all__ = ["CACHE_KINDS", "PRESETS", "CachedSelfAttention", "Decoder", "rope"]
