"""Regression tests for bugs found in review (each failed before its fix)."""

import numpy as np
import pytest

import numkv
import numkv.onnx
import oracle
from conftest import same_bits
from numkv import CachedSelfAttention


@pytest.mark.parametrize("field_dtype", ["c8", "U2"])
def test_scatter_field_view_whose_stride_is_not_a_multiple_of_the_itemsize(field_dtype):
    """complex64, 'S4', 'U2' are aligned to less than their size: a structured
    array's field has strides the full-width unit does not divide."""
    rec = np.zeros((2, 4, 1), [("pad", "f4"), ("x", field_dtype)])
    values = np.arange(8).reshape(2, 4, 1)
    rec["x"] = values.astype(field_dtype)
    cache = rec["x"]
    update = np.full((2, 1, 1), 9).astype(field_dtype)
    expected = oracle.tensor_scatter(cache.copy(), update, axis=1)
    assert same_bits(numkv.tensor_scatter(cache, update, axis=1), expected)
    before_pad = rec["pad"].copy()
    numkv.tensor_scatter(cache, update, axis=1, out=cache)
    assert same_bits(np.ascontiguousarray(cache), expected)
    assert same_bits(rec["pad"], before_pad)  # the neighbouring field is untouched


@pytest.mark.parametrize("batch", [1, 8])  # one batch row, several
def test_scatter_update_is_out(batch):
    past = np.zeros((batch, 4, 1))
    update = np.arange(1.0, 4 * batch + 1).reshape(batch, 4, 1).copy()  # owns its memory
    expected = oracle.tensor_scatter(past, update.copy(), np.ones(batch, np.int64), mode="circular", axis=1)
    got = numkv.tensor_scatter(past, update, np.ones(batch, np.int64), mode="circular", axis=1, out=update)
    assert got is update and same_bits(got, expected)
    cache = np.arange(4.0 * batch).reshape(batch, 4, 1).copy()
    expected = oracle.tensor_scatter(cache.copy(), cache.copy(), np.ones(batch, np.int64), mode="circular", axis=1)
    got = numkv.tensor_scatter(cache, cache, np.ones(batch, np.int64), mode="circular", axis=1, out=cache)
    assert same_bits(got, expected)


def test_layer_zero_length_input():
    y = CachedSelfAttention(16, 2)(np.zeros((2, 0, 16), np.float32))
    assert y.shape == (2, 0, 16)


def test_read_only_inputs_reuse_the_compiled_kernel():
    from numkv._kernels.attention import attention_items as attention_kernel

    q = np.random.default_rng(0).standard_normal((1, 2, 3, 4), dtype=np.float32)
    numkv.attention(q, q, q)
    compiled = len(attention_kernel.signatures)
    frozen = q.copy()
    frozen.flags.writeable = False
    assert np.array_equal(numkv.attention(frozen, frozen, frozen), numkv.attention(q, q, q))
    assert len(attention_kernel.signatures) == compiled


def test_batch_zero_accepts_empty_lists():
    cache = np.zeros((0, 2, 4, 3), np.float32)
    assert numkv.tensor_scatter(cache, np.zeros((0, 2, 1, 3), np.float32), []).shape == cache.shape
    q = np.zeros((0, 2, 1, 4), np.float32)
    assert numkv.attention(q, q, q, nonpad_kv_seqlen=[]).shape == (0, 2, 1, 4)


def test_onnx_is_causal_must_be_0_or_1():
    q = np.zeros((1, 1, 2, 4), np.float32)
    attention = numkv.onnx.Attention.__new__(numkv.onnx.Attention)

    class Node:
        output = ["Y"]

    attention.onnx_node = Node()
    with pytest.raises(ValueError, match="is_causal"):
        attention._run(q, q, q, is_causal=2)
