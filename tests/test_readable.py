"""What users read: the caches' repr, and Decoder.generate's error for a
cache object where it takes the kind of caches to make."""

import ml_dtypes
import numpy as np
import pytest

import numkv
from numkv.layers import Decoder


def test_static_cache_repr_names_shapes_dtype_mode_and_lengths():
    cache = numkv.StaticKVCache(2, 8, 1024, 64)
    kv = np.zeros((2, 8, 5, 64), np.float32)
    cache.append(kv, kv, lengths=[5, 3])
    assert repr(cache) == ("StaticKVCache(batch_size=2, num_heads=8, max_seq_len=1024, head_dim=64, "
                           "dtype=float32, mode='linear', seq_lens=[5, 3])")


def test_circular_cache_repr_shows_window_and_value_head_size():
    cache = numkv.StaticKVCache(3, 2, 40, 16, v_head_dim=8, dtype=ml_dtypes.bfloat16,
                                mode="circular", window=32)
    assert repr(cache) == ("StaticKVCache(batch_size=3, num_heads=2, max_seq_len=40, head_dim=16, "
                           "v_head_dim=8, dtype=bfloat16, mode='circular', window=32, seq_lens=[0, 0, 0])")


def test_dynamic_cache_repr_before_and_after_the_first_append():
    cache = numkv.DynamicKVCache()
    assert repr(cache).startswith("DynamicKVCache(empty")
    cache.append(np.zeros((1, 2, 20, 4), np.float16), np.zeros((1, 2, 20, 4), np.float16))
    assert repr(cache) == ("DynamicKVCache(batch_size=1, num_heads=2, capacity=20, head_dim=4, "
                           "dtype=float16, mode='linear', seq_lens=[20])")


def test_repr_of_a_large_batch_stays_short():
    assert len(repr(numkv.StaticKVCache(10_000, 1, 4, 2))) < 200


def test_generate_says_it_takes_the_kind_of_cache():
    decoder = Decoder("tiny")
    with pytest.raises(TypeError, match=r"cache names the kind .*'dynamic', 'static', 'circular'"
                                        r".*got DynamicKVCache\(empty"):
        decoder.generate([np.array([1, 2])], 2, cache=numkv.DynamicKVCache())
    with pytest.raises(ValueError, match="cache must be None or one of 'dynamic', 'static', 'circular', got 'Static'"):
        decoder.generate([np.array([1, 2])], 2, cache="Static")
