"""What numkv takes at its boundary, and how it says no (issue 12, items 2, 3, 7).

* extremes of scalars: window sizes up to int64's maximum mean "unbounded",
  integers beyond int64 are a ``ValueError`` naming the argument, a softcap
  beyond float32's range gives the float64 reference's values;
* any array-like in: ndarray subclasses as their base arrays (or a
  ``TypeError`` naming the argument), DLPack / ``__array__`` objects (torch CPU
  tensors) viewed without copying, for both ops, ``out=`` and the caches;
* one dtype vocabulary: every dtype decision goes through ``_dtypes``'
  predicates (no ``dtype.kind`` in numkv), and a mask or cache dtype that
  cannot be used is a ``TypeError`` naming the argument and the dtype;
* masks: a float64 mask beyond float32's range gives the reference's values,
  either byte order reads alike, a non-native Q says what to do (issue 32);
  read-only inputs reuse the compiled kernel, a batch of 0 takes empty lists.

Every test here failed on main before these items (numba errors, zeroed rows,
``OverflowError``), except the ones marked as guarding what already worked.
"""

import io
import pathlib
import tokenize

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import numkv
import oracle
from numkv._dtypes import byte_operand

INT64_MAX = 2**63 - 1


@pytest.fixture
def qkv(rng):
    q = rng.standard_normal((2, 4, 3, 8), dtype=np.float32)
    k = rng.standard_normal((2, 2, 6, 8), dtype=np.float32)
    v = rng.standard_normal((2, 2, 6, 8), dtype=np.float32)
    return q, k, v


# -- extremes of scalars ------------------------------------------------------

WINDOW_CASES = {
    "right": dict(right_window_size=INT64_MAX),
    "left": dict(left_window_size=INT64_MAX),
    "both-causal": dict(left_window_size=INT64_MAX, right_window_size=INT64_MAX, is_causal=True),
}


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="self"),
    pytest.param(dict(nonpad_kv_seqlen=np.array([1, 6])), id="nonpad-negative-offset"),
    pytest.param("past", id="past"),
])
@pytest.mark.parametrize("windows", WINDOW_CASES.values(), ids=WINDOW_CASES.keys())
def test_int64_max_window_is_unbounded(qkv, rng, windows, extra):
    """``pos + right`` / ``pos - left`` overflowed int64 in the kernel and
    zeroed rows; the reference (and the spec) read such a window as covering
    every key."""
    q, k, v = qkv
    if extra == "past":
        past = rng.standard_normal((2, 2, 4, 8), dtype=np.float32)
        extra = dict(past_key=past, past_value=past)
    causal = dict(is_causal=True) if windows.get("is_causal") else {}
    expected = numkv.attention(q, k, v, **extra, **causal)
    np.testing.assert_array_equal(numkv.attention(q, k, v, **extra, **windows), expected)
    reference = oracle.attention(q, k, v, **extra, **windows)[0]
    np.testing.assert_allclose(expected, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["left_window_size", "right_window_size"])
@pytest.mark.parametrize("value", [2**63, 2**64, -(2**64)])
def test_window_beyond_int64_names_the_argument(qkv, name, value):
    with pytest.raises(ValueError, match=f"{name} = {value}.*int64"):
        numkv.attention(*qkv, **{name: value})


def _big_int_calls():
    cache, update = np.zeros((2, 3, 8, 4), np.float32), np.ones((2, 3, 1, 4), np.float32)
    q = np.ones((2, 2, 3, 4), np.float32)
    dynamic = numkv.DynamicKVCache()
    dynamic.append(update[:1], update[:1])
    return {
        "write_indices": lambda: numkv.tensor_scatter(cache, update, [2**64, 0]),
        "write_indices-circular": lambda: numkv.tensor_scatter(cache, update, [0, -(2**63) - 1],
                                                               mode="circular"),
        "nonpad_kv_seqlen": lambda: numkv.attention(q, q, q, nonpad_kv_seqlen=[2**63, 1]),
        "max_seq_len": lambda: numkv.StaticKVCache(1, 1, 2**64, 1),
        "n": lambda: dynamic.crop(-(2**64)),
        "lengths": lambda: dynamic.append(update[:1], update[:1], lengths=[2**64]),
    }


@pytest.mark.parametrize("name", list(_big_int_calls()))
def test_integers_beyond_int64_name_the_argument(name):
    """Lists of Python ints beyond int64 became object or float arrays (a
    TypeError about the dtype), cache sizes a numpy error, crop an OverflowError."""
    argument = name.split("-")[0]
    with pytest.raises(ValueError, match=rf"{argument}(\[\d\])? = -?\d+ is outside the int64 range"):
        _big_int_calls()[name]()


def test_absurd_cache_size_names_the_arguments():
    with pytest.raises(ValueError, match="max_seq_len 4611686018427387904 .* is too big"):
        numkv.StaticKVCache(1, 1, 2**62, 1)


@pytest.mark.parametrize("softcap", [1e300, 1e39, 1e-300, 1e-46])
def test_softcap_beyond_float32_gives_the_reference(qkv, softcap):
    """A float32 kernel holds such a softcap as inf (rows of NaN, zeroed) or
    0 (no cap at all); the float64 reference computes the capped scores."""
    y = numkv.attention(*qkv, softcap=softcap)
    assert y.dtype == np.float32 and np.isfinite(y).all()
    np.testing.assert_allclose(y, oracle.attention(*qkv, softcap=softcap)[0], rtol=1e-5, atol=1e-5)


def test_softcap_within_float32_stays_float32(qkv):
    y = numkv.attention(*qkv, softcap=1e38)  # guards what worked: no float64 detour
    np.testing.assert_allclose(y, oracle.attention(*qkv, softcap=1e38)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["softcap", "scale"])
def test_float_attribute_beyond_float64_names_the_argument(qkv, name):
    with pytest.raises(ValueError, match=f"{name} = 1000.*float64"):
        numkv.attention(*qkv, **{name: 10**400})


# -- any array-like in ----------------------------------------------------------

@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_matrix_cache(rng):
    """np.matrix's ravel is a (1, n) matrix: the functional call was a numba
    TypingError, the in-place one a ValueError from inside numba (or, with an
    ndarray update, a wrong result)."""
    base = rng.standard_normal((2, 6))
    update = np.array([[7.0], [8.0]])
    expected = oracle.tensor_scatter(base, update, np.array([1, 4]), axis=1)
    got = numkv.tensor_scatter(np.matrix(base), np.matrix(update), [1, 4], axis=1)
    assert type(got) is np.ndarray and np.array_equal(got, expected)
    cache = np.matrix(base)
    result = numkv.tensor_scatter(cache, np.matrix(update), [1, 4], axis=1, out=cache)
    assert result is cache and np.array_equal(np.asarray(cache), expected)
    cache = np.matrix(base)
    numkv.tensor_scatter(cache, update, [1, 4], axis=1, out=cache)
    assert np.array_equal(np.asarray(cache), expected)


def test_masked_arrays(rng, qkv):
    past = rng.standard_normal((2, 3, 5, 4))
    update = rng.standard_normal((2, 3, 1, 4))
    expected = oracle.tensor_scatter(past, update, np.array([0, 2]))
    got = numkv.tensor_scatter(np.ma.masked_array(past), np.ma.masked_array(update, mask=False), [0, 2])
    assert np.array_equal(got, expected)
    q, k, v = qkv
    assert np.array_equal(numkv.attention(np.ma.masked_array(q), k, v), numkv.attention(q, k, v))
    holes = np.ma.masked_array(past, mask=past > 1)
    with pytest.raises(TypeError, match="past_cache is a masked array with masked elements"):
        numkv.tensor_scatter(holes, update, [0, 2])
    with pytest.raises(TypeError, match="K is a masked array"):
        numkv.attention(q, np.ma.masked_array(k, mask=k > 1), v)


class DLPackOnly:
    """A foreign tensor that only speaks DLPack."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


class ArrayOnly:
    """A foreign array that only has ``__array__`` (which may copy)."""

    def __init__(self, array):
        self._array = array

    def __array__(self, dtype=None, copy=None):
        return self._array


def test_dlpack_and_array_objects(rng, qkv):
    q, k, v = qkv
    expected = numkv.attention(q, k, v)
    assert np.array_equal(numkv.attention(DLPackOnly(q), ArrayOnly(k), DLPackOnly(v)), expected)
    past = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    update = np.ones((2, 3, 1, 4), np.float32)
    expected = oracle.tensor_scatter(past, update, np.array([0, 2]))
    out = np.zeros_like(past)
    assert numkv.tensor_scatter(past, update, [0, 2], out=DLPackOnly(out)).__class__ is DLPackOnly
    assert np.array_equal(out, expected)  # written through the DLPack view
    with pytest.raises(TypeError, match="out must be a numpy.ndarray or an object with __dlpack__"):
        numkv.tensor_scatter(past, update, [0, 2], out=ArrayOnly(np.zeros_like(past)))
    assert np.array_equal(numkv.tensor_scatter(ArrayOnly(past), DLPackOnly(update), [0, 2]), expected)


def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    q = rng.standard_normal((1, 4, 2, 8), dtype=np.float32)
    kv = rng.standard_normal((1, 2, 5, 8), dtype=np.float32)
    y = numkv.attention(torch.from_numpy(q), torch.from_numpy(kv), torch.from_numpy(kv),
                        attn_mask=torch.ones(5, dtype=torch.bool), nonpad_kv_seqlen=torch.tensor([4]))
    assert np.array_equal(y, numkv.attention(q, kv, kv, nonpad_kv_seqlen=np.array([4])))

    cache = torch.zeros(2, 3, 6, 4)
    update = torch.ones(2, 3, 1, 4)
    result = numkv.tensor_scatter(cache, update, torch.tensor([1, 5]), out=cache)
    assert result is cache  # written in place: the tensor is the cache
    assert cache[0, :, 1].eq(1).all() and cache[1, :, 5].eq(1).all() and cache.sum() == 2 * 3 * 4

    layer_cache = numkv.StaticKVCache(1, 2, 8, 8)
    keys, _ = layer_cache.append(torch.from_numpy(kv[:, :, :2]), torch.from_numpy(kv[:, :, :2]))
    assert np.array_equal(keys, kv[:, :, :2])
    assert numkv.DynamicKVCache().append(torch.from_numpy(kv), torch.from_numpy(kv))[0].shape == kv.shape


def test_torch_low_precision_floats_say_what_to_pass():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"Q is a torch.bfloat16 tensor.*Q.view\(torch.int16\)"
                                        r".numpy\(\).view\(ml_dtypes.bfloat16\)"):
        numkv.attention(q, q, q)
    recipe = q.view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # ... and the recipe works
    assert numkv.attention(recipe, recipe, recipe).dtype == ml_dtypes.bfloat16
    cache = torch.zeros(1, 2, 4, 3, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"past_cache is a torch.float8_e4m3fn tensor.*torch.uint8"):
        numkv.tensor_scatter(cache, cache[:, :, :1], out=cache)
    with pytest.raises(TypeError, match="Q cannot be viewed.*detach"):
        numkv.attention(torch.zeros(1, 1, 1, 2, requires_grad=True), q, q)


def test_caches_take_arrays_not_lists():
    """Guards what worked: a list would be guessed float64, a cast nobody asked for."""
    with pytest.raises(TypeError, match="key must be an array"):
        numkv.DynamicKVCache().append([[[[1.0]]]], [[[[1.0]]]])


@pytest.mark.parametrize("name", ["Q", "K", "V", "attn_mask", "past_key", "past_value"])
def test_attention_takes_arrays_not_lists(name):
    """API.md: inputs NumPy can view without copying, or a TypeError naming
    the argument; a list was a float64 copy (the float64 kernel, Y float64).
    ``nonpad_kv_seqlen`` is a vector of ints, taken as ``write_indices`` is."""
    q = np.zeros((1, 1, 2, 4), np.float32)
    args = dict(Q=q, K=q, V=q, attn_mask=None, past_key=None, past_value=None)
    if name.startswith("past"):
        args.update(past_key=q, past_value=q)
    args[name] = (np.ones((2, 4), bool) if name == "attn_mask" else args[name]).tolist()
    with pytest.raises(TypeError, match=f"{name} must be an array"):
        numkv.attention(**args)


# -- one dtype vocabulary ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz,
                                   ml_dtypes.bfloat16, np.float16, np.int8])
def test_mask_dtypes_are_one_family(qkv, dtype):
    """float8_e5m2 (numpy kind 'f') was accepted and float8_e4m3fn (kind 'V')
    refused: the same additive mask in every float type Attention takes."""
    mask = np.array([0, -1, -2, 0, -1, 0]).astype(dtype)
    expected = numkv.attention(*qkv, attn_mask=mask.astype(np.float32))
    np.testing.assert_array_equal(numkv.attention(*qkv, attn_mask=mask), expected)


@pytest.mark.parametrize("dtype", [ml_dtypes.int4, np.complex64, "U3", object])
def test_unusable_mask_dtype_names_argument_and_dtype(qkv, dtype):
    mask = np.zeros(6).astype(dtype)
    with pytest.raises(TypeError, match=f"attn_mask has dtype {np.dtype(dtype)}"):
        numkv.attention(*qkv, attn_mask=mask)


def test_unusable_cache_dtype_in_the_layer():
    """An int4 cache failed inside the layer with NumPy's 'data type ... not
    inexact'; now a TypeError naming the cache's dtype, before any write."""
    layer = numkv.CachedSelfAttention(16, 2)
    cache = numkv.StaticKVCache(1, 2, 8, 8, dtype=ml_dtypes.int4)
    with pytest.raises(TypeError, match="cache has dtype int4"):
        layer(np.ones((1, 2, 16), np.float32), cache, use_cache=True)
    assert cache.seq_len == 0


def test_cache_dtype_that_is_not_a_dtype():
    with pytest.raises(TypeError, match="dtype 'float33' is not a NumPy dtype"):
        numkv.StaticKVCache(1, 1, 4, 4, dtype="float33")
    with pytest.raises(TypeError, match="dtype <U3 is not supported for a KV cache"):
        numkv.StaticKVCache(1, 1, 4, 4, dtype="U3")


def test_no_dtype_kind_in_numkv():
    """Every dtype decision goes through _dtypes' identity predicates:
    ``.kind`` mixes ml_dtypes types ('V', but float8_e5m2 'f') with others."""
    offenders = []
    for path in sorted((pathlib.Path(numkv.__file__).parent).rglob("*.py")):
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        for owner, dot, name in zip(tokens, tokens[1:], tokens[2:]):
            # (an object's own attribute named kind, e.g. a bench case's, is no dtype's)
            if dot.string == "." and name.string == "kind" and owner.string != "self":
                offenders.append(f"{path.name}:{name.start[0]}")
    assert not offenders


# -- masks wider than the computation, byte order (issue 32) --


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("value", [1e39, -1e39, 1e300, -1e300])
def test_a_float64_mask_beyond_float32_gives_the_references_values(dtype, value):
    """Issue 32.4: a finite float64 mask value beyond float32's range became
    inf in the float32 computation, and the row NaN (``inf - inf``)."""
    import warnings

    import ml_dtypes
    import oracle

    dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 3, 8)).astype(dtype)
    k = rng.standard_normal((1, 1, 4, 8)).astype(dtype)
    v = rng.standard_normal((1, 1, 4, 8)).astype(dtype)
    mask = np.zeros((3, 4))
    mask[1, 2] = value      # one key of row 1
    mask[2, :] = value      # every key of row 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow in a cast either
        y = numkv.attention(q, k, v, attn_mask=mask)
    reference = oracle.attention(q, k, v, attn_mask=mask)[0]
    assert np.isfinite(y.astype(np.float32)).all()
    tol = 2e-5 if dtype.itemsize >= 4 or dtype.itemsize == 1 else 4e-3
    np.testing.assert_allclose(y.astype(np.float64), reference, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["f2", "f4", "f8", "i4", "i8", "u2"])
def test_masks_of_either_byte_order_read_alike(dtype):
    """Issue 32.6: a big-endian float mask was refused with a message listing
    float32 as allowed, while big-endian integer masks were accepted."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 4, 8)).astype(np.float32)
    mask = rng.integers(-3, 3, (3, 4)).astype("<" + dtype)
    if dtype[0] == "f":
        mask[0, 1] = -np.inf
    big = mask.astype(">" + dtype)
    np.testing.assert_array_equal(numkv.attention(q, k, k, attn_mask=big),
                                  numkv.attention(q, k, k, attn_mask=mask))


def test_a_non_native_query_says_what_to_do():
    q = np.zeros((1, 1, 1, 4), ">f4")
    k = np.zeros((1, 1, 2, 4), np.float32)
    with pytest.raises(TypeError, match=r"Q has dtype >f4 in non-native byte order; pass Q.astype"):
        numkv.attention(q, k, k)


# -- read-only arrays, empty lists --


@pytest.mark.parametrize("sq", [1, 64])  # decode's loops; the matrix products' tiles
def test_one_array_as_q_k_and_v(sq):
    """Q, K and V may be the very same array (the wrapper tells them apart by
    position, not identity): Y equals that of three copies."""
    x = np.random.default_rng(7).standard_normal((1, 8, sq, 64), dtype=np.float32)
    np.testing.assert_array_equal(numkv.attention(x, x, x, is_causal=True),
                                  numkv.attention(x.copy(), x.copy(), x.copy(), is_causal=True))


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


@given(st.data())
def test_flat_views_address_every_element(data):
    """``byte_operand`` / ``flat_view`` (the kernels' view of an input):
    ``flat[base + sum(idx * strides)]`` is ``arr[idx]`` for slices, axis
    permutations, new axes (stride 0), reversed axes and size-1 axes; the
    flat view starts at ``arr``'s lowest address (``base`` is what the
    negative strides span: ``_scatter`` relies on it)."""
    shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    arr = np.arange(int(np.prod(shape)) * 2, dtype=np.float32)
    arr.flags.writeable = data.draw(st.booleans())
    arr = arr[::data.draw(st.sampled_from([1, 2]))][:int(np.prod(shape))].reshape(shape)
    arr = arr.transpose(data.draw(st.permutations(range(arr.ndim))))
    for axis in range(arr.ndim):
        arr = arr[(slice(None),) * axis + (data.draw(st.sampled_from([slice(None), slice(None, None, -1),
                                                                       slice(1, None)])),)]
    if data.draw(st.booleans()):
        arr = arr[None]
    flat, base, strides = byte_operand(arr)
    if arr.size:
        items = flat.view(np.float32)
        index = np.indices(arr.shape).reshape(arr.ndim, -1)
        np.testing.assert_array_equal(items[base + (index * np.array(strides)[:, None]).sum(0)], arr.reshape(-1))
        assert base == -sum((n - 1) * s for n, s in zip(arr.shape, strides) if s < 0)


def test_a_field_of_a_record_array_with_objects(rng):
    """A float field of a structured array that also holds Python objects,
    as K and V: read through the field's own view (its base's bytes cannot
    be viewed as numbers)."""
    records = np.zeros(8, [("o", object), ("x", np.float32), ("pad", np.float32)])
    records["x"] = rng.standard_normal(8)
    k = records["x"].reshape(1, 1, 8, 1)
    q = np.ones((1, 1, 1, 1), np.float32)
    np.testing.assert_array_equal(numkv.attention(q, k, k), numkv.attention(q, k.copy(), k.copy()))
