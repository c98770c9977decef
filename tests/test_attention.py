"""numkv.attention against the exact answer: onnx.reference evaluated in float64
(``oracle.attention``) and the naive loop of ``naive.py``.

* the feature grid (float32): MHA / GQA (Hkv >= 2, G >= 2) / MQA, Dv != D,
  Sq != Skv, 3-D inputs, bool and float masks of every rank (broadcast, padded,
  all -inf blocks, fully masked rows == 0 exactly), is_causal with a past (also
  empty), with nonpad_kv_seqlen (negative offsets, empty rows), scale, softcap,
  softmax_precision, windows, strided views (transposed, cache slices,
  negative, step and zero strides, unaligned) -- each case also run with small forced tile sizes
  and key-range chunks (``_attention.run``), so the multi-tile and split-K merge
  paths run on tiny shapes;
* every dtype: float16 / bfloat16 / float64, float8 K/V with float32 Q, float8
  Q/K/V (Y float32), float64 accumulation (softmax_precision=11);
* numkv.onnx.attention: presents bit-exact, qk_matmul_output modes 0-3;
* the reference path (``_config.REFERENCE``) equals the kernel path;
* every bad input of API.md: exception type and a message naming the argument.

Tolerances are set by Y's dtype against the float64 answer.  Inputs are cast to
the low precision *before* the oracle sees them, so only numkv's accumulation
and the final rounding of Y differ:

* accumulation error on O(1) data: float32 scores over D <= 16 products and a
  softmax over <= 600 keys stay within ~1e-6 (rel and abs), so ``ACC32 = 1e-5``;
  float64 accumulation within ~1e-14, so ``ACC64 = 1e-12``;
* rounding Y to its dtype adds at most half an ulp: ``rtol >= eps(Y dtype)``
  (float16 9.8e-4 -> 1.95e-3 with a 2x margin; bfloat16 7.8e-3 -> 1.56e-2).

So ``rtol = max(acc, 2 eps)``, ``atol = acc``.  softmax_precision=11 with
float32 inputs is judged at 2 eps(float32) = 2.4e-7 relative: it would fail
if the accumulation were float32.  Measured (this file, onnx 1.23.2): float32
Y within 0.035 of its tolerance; float16, bfloat16 and precision-11 Y within
0.25 (half an ulp, as derived); float64 within 5e-4.

Compile budget: each (Q, K, V bit family, accumulation) combination compiles the
kernel anew; this file uses six: f32, f64, u16 (float16 and bfloat16), f32 Q +
u8 K/V, u8 (float8 Q), f32 with float64 accumulation.  Shapes are tiny.
"""

import re

import ml_dtypes
import numpy as np
import pytest

import naive
import numkv
import numkv.onnx
import oracle
from conftest import same_bits
from numkv import _attention, _config

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
E4M3FNUZ, E5M2FNUZ = np.dtype(ml_dtypes.float8_e4m3fnuz), np.dtype(ml_dtypes.float8_e5m2fnuz)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FLOAT8 = (E4M3, E5M2, E4M3FNUZ, E5M2FNUZ, E8M0)

ACC32, ACC64 = 1e-5, 1e-12

# (block_q, block_k, kv_chunk) forced through _attention.run; None = default.
TILES = [(1, 1, 1), (2, 3, 4), (3, 2, None), (4, 5, 7), (16, 64, 3)]


def out_dtype(q_dtype):
    return F32 if q_dtype in FLOAT8 else q_dtype


def tolerance(y_dtype, acc64=False):
    """``(rtol, atol)`` of Y against the float64 answer (module docstring)."""
    acc = ACC64 if acc64 else ACC32
    eps = float(ml_dtypes.finfo(y_dtype).eps)
    return max(acc, 2 * eps), acc


# --------------------------------------------------------------------------
# building a case


DEFAULTS = dict(B=2, Hq=4, Hkv=2, Sq=5, Skv=7, D=8, Dv=None, past=None, three_d=False,
                mask=None, mask_len=None, causal=False, nonpad=None, scale=None, softcap=0.0,
                precision=None, left=-1, right=-1, dtype=F32, kv_dtype=None, layout=None,
                masked_rows=False)


def case(id_, **spec):
    unknown = set(spec) - set(DEFAULTS)
    assert not unknown, unknown
    return pytest.param({**DEFAULTS, **spec}, id=id_)


def values(rng, shape, dtype):
    """O(1) random values, rounded to ``dtype`` (so the oracle sees exactly them)."""
    x = rng.standard_normal(shape)
    if dtype == E8M0:  # unsigned powers of two: no sign, no zero
        x = np.abs(x) + 0.25
    return x.astype(dtype)


def fill_value(dtype):
    """What the padding around a strided view holds: NaN where the dtype has
    one, so any read outside the view shows up in Y."""
    try:
        return np.array(np.nan).astype(dtype)
    except (ValueError, TypeError):  # pragma: no cover - every float type here has NaN
        return np.array(1e4).astype(dtype)


def restride(x, layout):
    """A view of a new buffer holding ``x``'s values with other strides."""
    if layout is None or x is None:
        return x
    nd = x.ndim
    if nd < 2 and layout != "broadcast":  # a rank-1 mask: only its own stride changes
        return restride(x[None], layout)[0]
    if layout == "transposed":  # heads and sequence swapped in memory
        a, b = (1, 2) if nd == 4 else (0, 1)
        return np.swapaxes(np.swapaxes(x, a, b).copy(), a, b)
    if layout == "negative":  # every axis but the batch read backwards
        rev = (slice(None),) + (slice(None, None, -1),) * (nd - 1)
        return x[rev].copy()[rev]
    if layout == "slice":  # cache slice buf[:, :, :n] of a longer, wider buffer
        pad = [(0, 0)] * nd
        pad[-2], pad[-1] = (0, 3), (0, 2)
        buf = np.full(tuple(n + p for n, (_, p) in zip(x.shape, pad)), fill_value(x.dtype))
        view = buf[tuple(slice(0, n) for n in x.shape)]
        view[...] = x
        return view
    if layout == "broadcast":  # zero batch stride, read-only (np.broadcast_to)
        return np.broadcast_to(x[:1], x.shape)
    if layout == "step":  # every other element of the last axis
        buf = np.full(x.shape[:-1] + (2 * x.shape[-1],), fill_value(x.dtype))
        view = buf[..., 1::2]
        view[...] = x
        return view
    raise AssertionError(layout)


MASK_DIMS = {"B": "B", "H": "Hq", "S": "Sq"}


def make_mask(rng, spec, total):
    kind, code = spec["mask"]
    length = spec["mask_len"] or total
    shape = tuple(length if c == "L" else 1 if c == "1" else spec[MASK_DIMS[c]] for c in code)
    mdtype = spec["dtype"] if spec["dtype"] in (F16, BF16, F32, F64) else F32
    if kind.startswith("bool"):
        mask = rng.random(shape) < 0.7
        off = False
    else:
        mask = rng.standard_normal(shape)
        mask[rng.random(shape) < 0.2] = -np.inf
        off = -np.inf
    if kind.endswith("blocks") and len(code) >= 2:
        sq = shape[-2]
        for i in range(sq):
            if i == 1:
                mask[..., i, :] = off  # a fully masked row
            elif i % 2 == 0:
                mask[..., i, : length // 2] = off  # leading -inf block
            else:
                mask[..., i, length // 3: 2 * length // 3] = off  # a block in the middle
    if kind.endswith("allinf"):
        mask[...] = off
    return mask if kind.startswith("bool") else mask.astype(mdtype)


def build(spec, rng):
    """``(inputs, attrs)`` of numkv.attention for ``spec``; arrays already in
    their dtypes and layouts (what both numkv and the oracle receive)."""
    s = spec
    dv = s["Dv"] or s["D"]
    kvd = s["kv_dtype"] or s["dtype"]
    q = values(rng, (s["B"], s["Hq"], s["Sq"], s["D"]), s["dtype"])
    k = values(rng, (s["B"], s["Hkv"], s["Skv"], s["D"]), kvd)
    v = values(rng, (s["B"], s["Hkv"], s["Skv"], dv), kvd)
    past_k = past_v = None
    if s["past"] is not None:
        past_k = values(rng, (s["B"], s["Hkv"], s["past"], s["D"]), kvd)
        past_v = values(rng, (s["B"], s["Hkv"], s["past"], dv), kvd)
    total = s["Skv"] + (s["past"] or 0)
    mask = None if s["mask"] is None else make_mask(rng, s, total)
    if s["three_d"]:
        q, k, v = (x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1) for x in (q, k, v))
    layout = s["layout"]
    inputs = dict(Q=restride(q, layout), K=restride(k, layout), V=restride(v, layout),
                  attn_mask=restride(mask, layout), past_key=restride(past_k, layout),
                  past_value=restride(past_v, layout),
                  nonpad_kv_seqlen=None if s["nonpad"] is None else np.array(s["nonpad"], np.int64))
    attrs = dict(scale=s["scale"], is_causal=s["causal"], softcap=s["softcap"],
                 softmax_precision=s["precision"], left_window_size=s["left"],
                 right_window_size=s["right"])
    if s["three_d"]:
        attrs.update(q_num_heads=s["Hq"], kv_num_heads=s["Hkv"])
    return inputs, attrs


def expected_outputs(inputs, attrs, **oracle_kw):
    """The oracle's four outputs for a numkv call (softmax_precision is not passed:
    numkv meets it with at least that precision, the oracle would round to it)."""
    attrs = dict(attrs)
    attrs.pop("softmax_precision")
    if not attrs["softcap"]:
        attrs.pop("softcap")
    inputs = dict(inputs)
    mask = inputs["attn_mask"]
    if mask is not None and mask.ndim == 1 and attrs["is_causal"]:
        # onnx.reference unpacks a 2-D shape there and crashes on a rank-1 mask;
        # its rank-2 broadcast is the same mask.
        inputs["attn_mask"] = np.broadcast_to(mask, (inputs["Q"].shape[-2], mask.shape[0]))
    return oracle.attention(**inputs, **attrs, **oracle_kw)


def to4d(x, heads):
    """A 3-D ``(b, s, h * d)`` array as 4-D ``(b, h, s, d)``."""
    return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(0, 2, 1, 3)


def naive_y(inputs, attrs):
    """naive.attention on the case, 3-D inputs taken as their 4-D views."""
    q, k, v = inputs["Q"], inputs["K"], inputs["V"]
    if q.ndim == 3:
        q, k, v = to4d(q, attrs["q_num_heads"]), to4d(k, attrs["kv_num_heads"]), to4d(v, attrs["kv_num_heads"])
    return naive.attention(q, k, v, inputs["attn_mask"], inputs["past_key"], inputs["past_value"],
                           inputs["nonpad_kv_seqlen"], scale=attrs["scale"],
                           is_causal=attrs["is_causal"], softcap=attrs["softcap"],
                           left_window_size=attrs["left_window_size"],
                           right_window_size=attrs["right_window_size"])


def assert_close(got, want, rtol, atol, what):
    assert got.shape == want.shape, what
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol, err_msg=what)


def check(spec, rng, tiles=TILES, use_naive=True):
    """numkv vs the float64 oracle (and the naive loop) for one case, with the
    default tiles and every forced tiling in ``tiles``."""
    inputs, attrs = build(spec, rng)
    before = {n: x.copy() for n, x in inputs.items() if x is not None}
    want = expected_outputs(inputs, attrs)[0]
    ydt = out_dtype(spec["dtype"])
    acc64 = ydt == F64 or spec["precision"] == 11
    rtol, atol = tolerance(ydt, acc64)

    y = numkv.attention(**inputs, **attrs)
    assert y.dtype == ydt
    assert np.isfinite(y).all(), "Y has NaN or inf"
    assert_close(y, want, rtol, atol, "default tiles vs oracle")

    # A row of the exact answer that is exactly zero attends no key: numkv's
    # row must be exactly zero too.
    y4, want4 = (y, want) if y.ndim == 4 else (to4d(y, spec["Hq"]), to4d(want, spec["Hq"]))
    empty = np.all(want4 == 0, axis=-1)
    assert (np.asarray(y4[empty], np.float64) == 0).all(), "fully masked rows must be 0"
    if spec["masked_rows"]:
        assert empty.any(), "the case was meant to have fully masked rows"

    if use_naive:
        exact = naive_y(inputs, attrs)
        np.testing.assert_allclose(want4, exact, rtol=1e-12, atol=1e-12, err_msg="oracle vs naive")
        assert_close(y4, exact, rtol, atol, "numkv vs naive")

    call = _attention.prepare(**inputs, **attrs)
    for block_q, block_k, kv_chunk in tiles:
        yt = _attention.run(call, block_q=block_q, block_k=block_k, kv_chunk=kv_chunk)
        what = f"block_q={block_q} block_k={block_k} kv_chunk={kv_chunk}"
        assert yt.dtype == ydt, what
        assert np.isfinite(yt).all(), what
        assert_close(yt, want, rtol, atol, what)

    for name, x in before.items():
        assert same_bits(inputs[name], x), f"{name} was modified"
    return y, want


# --------------------------------------------------------------------------
# the feature grid, float32


GRID = [
    # heads and shapes
    case("mha-H3", Hq=3, Hkv=3),
    case("gqa-Hq8-Hkv2", Hq=8, Hkv=2),
    case("gqa-Hq6-Hkv3-causal", Hq=6, Hkv=3, causal=True),
    case("gqa-Hq8-Hkv2-causal-past", Hq=8, Hkv=2, causal=True, past=4),
    case("mqa-Hq4-Hkv1", Hq=4, Hkv=1),
    case("mqa-Hq4-Hkv1-causal-past", Hq=4, Hkv=1, causal=True, past=6),
    case("gqa-D8-Dv12", Dv=12),
    case("gqa-D16-Dv3-causal", D=16, Dv=3, causal=True),
    case("cross-Sq3-Skv11", Sq=3, Skv=11),
    case("cross-Sq9-Skv2", Sq=9, Skv=2),
    case("causal-Sq9-Skv4", Sq=9, Skv=4, causal=True),
    case("decode-Sq1-past20-causal", Sq=1, Skv=1, past=20, causal=True),
    case("batch3-gqa-Hq4-Hkv2", B=3),
    case("multitile-Sq20-Skv70-causal", B=1, Sq=20, Skv=70, causal=True),
    case("decode-split-T600", B=1, Hq=2, Hkv=1, Sq=1, Skv=600),
    case("decode-split-T600-causal-past", B=1, Hq=2, Hkv=1, Sq=2, Skv=2, past=598, causal=True),
    # 3-D inputs (strided 4-D views inside numkv)
    case("3d-mha-H2", Hq=2, Hkv=2, three_d=True),
    case("3d-gqa-Hq8-Hkv2-causal-past", Hq=8, Hkv=2, causal=True, past=3, three_d=True),
    case("3d-mqa-Dv6-mask-float", Hq=4, Hkv=1, Dv=6, mask=("float", "BHSL"), three_d=True),
    case("3d-gqa-causal-nonpad", B=3, Sq=3, causal=True, nonpad=[7, 4, 1], three_d=True,
         masked_rows=True),
    case("3d-gqa-window-left2", three_d=True, left=2),
    # masks: kinds x ranks x broadcasting
    case("mask-bool-rank1", mask=("bool", "L")),
    case("mask-bool-rank2", mask=("bool", "SL")),
    case("mask-bool-rank3-1SL", mask=("bool", "1SL")),
    case("mask-bool-rank3-HSL", mask=("bool", "HSL")),
    case("mask-bool-rank4-B1SL", mask=("bool", "B1SL")),
    case("mask-float-rank1", mask=("float", "L")),
    case("mask-float-rank2-1L", mask=("float", "1L")),
    case("mask-float-rank3-HSL", mask=("float", "HSL")),
    case("mask-float-rank4-BHSL", mask=("float", "BHSL")),
    case("mask-float-rank4-B11L", mask=("float", "B11L")),
    case("mask-float-rank4-1HSL", mask=("float", "1HSL")),
    case("mask-bool-rank1-causal", mask=("bool", "L"), causal=True),
    case("mask-float-rank1-causal-past", mask=("float", "L"), causal=True, past=3),
    case("mask-float-short-past", mask=("float", "HSL"), mask_len=6, past=3),
    case("mask-bool-short-causal", mask=("bool", "SL"), mask_len=4, causal=True),
    case("mask-float-short-rank1-causal-past", mask=("float", "L"), mask_len=8, past=4,
         causal=True),
    case("mask-float-blocks", mask=("float-blocks", "BHSL"), Skv=12, masked_rows=True),
    case("mask-bool-blocks-rank2", mask=("bool-blocks", "SL"), Skv=12, masked_rows=True),
    case("mask-float-blocks-causal-past", mask=("float-blocks", "B1SL"), Sq=6, Skv=6, past=6,
         causal=True, masked_rows=True),
    case("mask-float-blocks-gqa-Hq8-Hkv2-short", Hq=8, mask=("float-blocks", "HSL"), Skv=12,
         mask_len=9, masked_rows=True),
    case("mask-float-allinf", mask=("float-allinf", "SL"), masked_rows=True),
    case("mask-bool-allfalse-rank1", mask=("bool-allinf", "L"), masked_rows=True),
    # causal, past, external cache
    case("causal-self", Sq=7, causal=True),
    case("causal-past", causal=True, past=5),
    case("causal-past-empty", causal=True, past=0),
    case("past-empty", past=0),
    case("past", past=4),
    case("causal-nonpad", B=4, Sq=4, Skv=7, causal=True, nonpad=[7, 5, 2, 0], masked_rows=True),
    case("nonpad", B=4, Sq=4, Skv=7, nonpad=[7, 3, 0, 1], masked_rows=True),
    case("nonpad-Sq9-Skv3", B=2, Sq=9, Skv=3, nonpad=[1, 3]),
    case("decode-nonpad-causal-Sq1", B=3, Sq=1, Skv=9, causal=True, nonpad=[9, 4, 1]),
    case("causal-nonpad-mask-bool", B=3, Sq=3, Skv=8, causal=True, nonpad=[8, 5, 1],
         mask=("bool", "B1SL"), masked_rows=True),
    case("causal-nonpad-mask-float-short", B=3, Sq=3, Skv=8, causal=True, nonpad=[8, 5, 2],
         mask=("float", "HSL"), mask_len=6),
    # scale, softcap, softmax_precision
    case("scale-0.3", scale=0.3),
    case("scale-2.5-causal", scale=2.5, causal=True),
    case("softcap-2", softcap=2.0),
    case("softcap-1.5-mask-float-causal-past", softcap=1.5, mask=("float", "BHSL"), causal=True,
         past=2),
    case("softcap-0.5-scale-3-mask-bool", softcap=0.5, scale=3.0, mask=("bool", "HSL")),
    case("precision-1", precision=1),
    case("precision-10-causal", precision=10, causal=True),
    case("precision-16-mask-float", precision=16, mask=("float", "SL")),
    # windows
    case("window-left2", left=2),
    case("window-right1", right=1),
    case("window-left2-right1", Sq=4, Skv=6, left=2, right=1),
    case("window-left0-right0", left=0, right=0),
    case("window-left1-causal", left=1, causal=True),
    case("window-left3-causal-past", left=3, causal=True, past=6),
    case("window-right2-past", right=2, past=3),
    case("window-left2-right0-past-mask-bool", left=2, right=0, past=4, mask=("bool", "SL")),
    case("window-left1-causal-nonpad", B=3, Sq=3, Skv=7, left=1, causal=True, nonpad=[7, 3, 0],
         masked_rows=True),
    case("window-right0-nonpad-Sq9", B=2, Sq=9, Skv=4, right=0, nonpad=[4, 2], masked_rows=True),
    case("window-left4-causal-multitile", B=1, Sq=20, Skv=70, left=4, causal=True),
    # strided views
    case("strided-transposed-gqa-causal-past", layout="transposed", causal=True, past=3,
         mask=("float", "BHSL")),
    case("strided-slice-cache-causal-past", layout="slice", causal=True, past=5, Sq=2, Skv=2,
         mask=("bool", "B1SL")),
    case("strided-negative-gqa-causal-past", layout="negative", causal=True, past=3,
         mask=("float", "HSL")),
    case("strided-step-mqa-Dv5", layout="step", Hkv=1, Dv=5, past=2),
    case("strided-3d-slice-gqa", layout="slice", three_d=True, causal=True),
    case("strided-3d-negative-gqa-mask", layout="negative", three_d=True, mask=("float", "SL")),
    case("strided-3d-transposed", layout="transposed", three_d=True, past=2),
    case("strided-broadcast-batch-causal-past", layout="broadcast", causal=True, past=3,
         mask=("float", "B1SL")),
]


@pytest.mark.parametrize("spec", GRID)
def test_grid_float32(spec, rng):
    check(spec, rng)


# --------------------------------------------------------------------------
# dtypes

DTYPE_CASES = [
    case("gqa-Hq8-Hkv2-causal-past-mask-float", Hq=8, causal=True, past=3, mask=("float", "B1SL")),
    case("3d-mqa-Dv6-softcap", Hkv=1, Dv=6, three_d=True, softcap=2.0),
    case("causal-nonpad", B=4, Sq=4, causal=True, nonpad=[7, 5, 2, 0], masked_rows=True),
    case("window-left2-right1-mask-bool-blocks", left=2, right=1, mask=("bool-blocks", "SL"),
         Skv=9, masked_rows=True),
    case("strided-negative-causal-past", layout="negative", causal=True, past=4),
    case("decode-split-T600", B=1, Hq=2, Hkv=1, Sq=1, Skv=600),
]


def with_dtype(cases, dtype, kv_dtype=None):
    tag = dtype.name if kv_dtype is None else f"q-{dtype.name}-kv-{kv_dtype.name}"
    return [pytest.param({**p.values[0], "dtype": dtype, "kv_dtype": kv_dtype}, id=f"{tag}-{p.id}")
            for p in cases]


@pytest.mark.parametrize("spec", with_dtype(DTYPE_CASES, F64) + with_dtype(DTYPE_CASES, F16)
                         + with_dtype(DTYPE_CASES, BF16))
def test_dtypes(spec, rng):
    check(spec, rng, tiles=TILES[:3])


FLOAT8_KV_CASES = [
    case("gqa-causal-past", causal=True, past=3),
    case("3d-mask-float-nonpad", three_d=True, mask=("float", "SL"), nonpad=[7, 2]),
]


@pytest.mark.parametrize("spec", [p for kv in FLOAT8 for p in with_dtype(FLOAT8_KV_CASES, F32, kv)])
def test_float8_kv_float32_q(spec, rng):
    """A quantised KV cache: K/V float8, Q float32 (one compilation for all)."""
    check(spec, rng, tiles=TILES[:2])


@pytest.mark.parametrize("spec", with_dtype(FLOAT8_KV_CASES, E4M3) + with_dtype(FLOAT8_KV_CASES, E5M2))
def test_float8_q_gives_float32(spec, rng):
    check(spec, rng, tiles=TILES[:2])


ACC64_CASES = [
    case("gqa-Hq8-Hkv2-causal-past-mask-float", Hq=8, causal=True, past=3, mask=("float", "BHSL")),
    case("3d-causal-nonpad", B=3, Sq=3, three_d=True, causal=True, nonpad=[7, 2, 0], masked_rows=True),
    case("window-left1-softcap", left=1, softcap=3.0),
    case("decode-split-T600-causal-past", B=1, Hq=2, Hkv=1, Sq=2, Skv=2, past=598, causal=True),
]


@pytest.mark.parametrize("spec", [pytest.param({**p.values[0], "precision": 11}, id=f"precision-11-{p.id}")
                                  for p in ACC64_CASES])
def test_softmax_precision_double_accumulates_in_float64(spec, rng):
    """softmax_precision=11 with float32 inputs: float64 accumulation, so Y is
    the exact answer rounded to float32 (tolerance 2 eps(float32))."""
    check(spec, rng, tiles=TILES[:3])


# --------------------------------------------------------------------------
# edge shapes


def test_rank1_mask_with_causal(rng):
    """API.md: a rank-1 mask broadcasts like any other, also with is_causal
    (onnx.reference crashes there, so the naive loop is the judge)."""
    q, k, v = (values(rng, (1, 2, 3, 4), F32) for _ in range(3))
    mask = np.array([True, False, True])
    y = numkv.attention(q, k, v, mask, is_causal=True)
    assert np.isfinite(y).all()
    want = naive.attention(q, k, v, mask, is_causal=True)
    np.testing.assert_allclose(y, want, rtol=ACC32, atol=ACC32)
    np.testing.assert_allclose(y, numkv.attention(q, k, v, np.broadcast_to(mask, (3, 3)), is_causal=True),
                               rtol=0, atol=0)
    assert (y[:, :, 1] == y[:, :, 0]).all()  # query 1 sees keys {0}, key 1 masked


def test_unaligned_inputs(rng):
    """Q, K, V, past and mask at odd byte addresses: same Y as aligned copies."""
    inputs, attrs = build({**DEFAULTS, "causal": True, "past": 3, "mask": ("float", "HSL")}, rng)

    def unaligned(x):
        raw = np.zeros(x.nbytes + 1, np.uint8)
        view = raw[1:].view(x.dtype).reshape(x.shape)
        view[...] = x
        assert not view.flags.aligned
        return view

    odd = {n: None if x is None else unaligned(x) for n, x in inputs.items()}
    y = numkv.attention(**odd, **attrs)
    assert same_bits(y, numkv.attention(**inputs, **attrs))
    for tiles in TILES[:2]:
        assert same_bits(_attention.run(_attention.prepare(**odd, **attrs), *tiles),
                         _attention.run(_attention.prepare(**inputs, **attrs), *tiles))


def test_no_keys_at_all_gives_zeros(rng):
    """kv_sequence_length 0 and no past: every row attends nothing."""
    q = values(rng, (2, 2, 3, 4), F32)
    k = np.zeros((2, 1, 0, 4), np.float32)
    v = np.zeros((2, 1, 0, 5), np.float32)
    y = numkv.attention(q, k, v)
    assert y.shape == (2, 2, 3, 5) and (y == 0).all()
    for tiles in TILES[:2]:
        assert (_attention.run(_attention.prepare(q, k, v), *tiles) == 0).all()


def test_no_queries(rng):
    q = np.zeros((2, 2, 0, 4), np.float32)
    k, v = (values(rng, (2, 1, 3, 4), F32) for _ in range(2))
    assert numkv.attention(q, k, v, is_causal=True).shape == (2, 2, 0, 4)


# --------------------------------------------------------------------------
# numkv.onnx.attention: four outputs


ONNX_CASES = [
    case("gqa-causal-past-mask-float-softcap", causal=True, past=3, mask=("float", "B1SL"),
         softcap=1.5),
    case("gqa-causal-past-empty", causal=True, past=0),
    case("3d-gqa-Hq8-Hkv2-past-mask-bool", Hq=8, three_d=True, past=2, mask=("bool", "HSL")),
    case("causal-nonpad-mask-bool", B=3, Sq=3, Skv=8, causal=True, nonpad=[8, 5, 1],
         mask=("bool", "SL"), masked_rows=True),
    case("window-left1-right1-past-softcap", left=1, right=1, past=3, softcap=2.0),
    case("strided-negative-causal-past", layout="negative", causal=True, past=4),
]
ONNX_DTYPES = [F32, F16, BF16, F64]


@pytest.mark.parametrize("spec", [p for dt in ONNX_DTYPES for p in with_dtype(ONNX_CASES, dt)])
def test_onnx_presents_bit_exact(spec, rng):
    inputs, attrs = build(spec, rng)
    y, present_k, present_v, _ = numkv.onnx.attention(**inputs, **attrs)
    _, want_k, want_v, _ = expected_outputs(inputs, attrs, float64=False)
    assert present_k.dtype == inputs["K"].dtype and present_v.dtype == inputs["V"].dtype
    assert same_bits(present_k, want_k)
    assert same_bits(present_v, want_v)
    # Y is numkv.attention's Y, bit for bit.
    assert same_bits(y, numkv.attention(**inputs, **attrs))


@pytest.mark.parametrize("spec", [p for kv in (E4M3, E5M2) for p in with_dtype(ONNX_CASES[:1], F32, kv)])
def test_onnx_presents_float8_kv(spec, rng):
    inputs, attrs = build(spec, rng)
    _, present_k, present_v, qk = numkv.onnx.attention(**inputs, **attrs)
    assert same_bits(present_k, np.concatenate([inputs["past_key"], inputs["K"]], axis=2))
    assert same_bits(present_v, np.concatenate([inputs["past_value"], inputs["V"]], axis=2))
    assert qk.dtype == F32


@pytest.mark.parametrize("mode", [0, 1, 2, 3], ids=lambda m: f"mode{m}")
@pytest.mark.parametrize("spec", with_dtype(ONNX_CASES, F32) + with_dtype(ONNX_CASES[:2], F16))
def test_onnx_qk_matmul_output_modes(spec, mode, rng):
    inputs, attrs = build(spec, rng)
    y, _, _, qk = numkv.onnx.attention(**inputs, **attrs, qk_matmul_output_mode=mode)
    want_y, _, _, want_qk = expected_outputs(inputs, attrs, qk_matmul_output_mode=mode)
    ydt = out_dtype(spec["dtype"])
    rtol, atol = tolerance(ydt)
    assert y.dtype == ydt and qk.dtype == ydt
    b, hq, sq = spec["B"], spec["Hq"], spec["Sq"]
    assert qk.shape == (b, hq, sq, spec["Skv"] + (spec["past"] or 0))
    assert_close(y, want_y, rtol, atol, "Y")
    assert_close(qk, want_qk, rtol, atol, f"qk_matmul_output mode {mode}")
    if mode == 2:  # every disallowed key is exactly -inf
        assert (np.isneginf(qk) == np.isneginf(want_qk)).all()
    if mode == 3:
        empty = np.all(want_qk == 0, axis=-1)
        assert (qk[empty] == 0).all()
        np.testing.assert_allclose(qk.sum(axis=-1)[~empty], 1, rtol=rtol)
        if spec["masked_rows"]:
            assert empty.any()


# --------------------------------------------------------------------------
# the reference path equals the kernel path


REFERENCE_CASES = [p for p in GRID if p.id in (
    "gqa-Hq8-Hkv2-causal-past", "mqa-Hq4-Hkv1", "gqa-D8-Dv12", "3d-gqa-Hq8-Hkv2-causal-past",
    "3d-gqa-causal-nonpad", "mask-float-blocks", "mask-bool-short-causal",
    "mask-float-short-rank1-causal-past", "causal-nonpad", "nonpad", "nonpad-Sq9-Skv3",
    "causal-nonpad-mask-float-short", "softcap-1.5-mask-float-causal-past",
    "window-left2-right1", "window-left1-causal-nonpad", "window-right0-nonpad-Sq9",
    "strided-negative-gqa-causal-past", "strided-3d-slice-gqa", "mask-float-allinf",
)] + with_dtype(DTYPE_CASES[:3], F16) + with_dtype(DTYPE_CASES[:3], F64)


@pytest.mark.parametrize("spec", REFERENCE_CASES)
def test_reference_path_equals_kernel(spec, rng, monkeypatch):
    inputs, attrs = build(spec, rng)
    kernel = numkv.attention(**inputs, **attrs)
    monkeypatch.setattr(_config, "REFERENCE", True)
    reference = numkv.attention(**inputs, **attrs)
    ydt = out_dtype(spec["dtype"])
    assert reference.dtype == kernel.dtype == ydt
    assert reference.shape == kernel.shape
    # Both are within tolerance of the exact answer, so within twice of each other;
    # fully masked rows are zero in both.
    rtol, atol = tolerance(ydt, ydt == F64)
    assert_close(reference, expected_outputs(inputs, attrs)[0], rtol, atol, "reference vs oracle")
    assert_close(reference, np.asarray(kernel, np.float64), 2 * rtol, 2 * atol, "reference vs kernel")
    assert (np.all(reference == 0, axis=-1) == np.all(kernel == 0, axis=-1)).all()


# --------------------------------------------------------------------------
# bad inputs


def _qkv(b=2, hq=4, hkv=2, sq=3, skv=5, d=4, dv=4, dtype=np.float32):
    return (np.ones((b, hq, sq, d), dtype), np.ones((b, hkv, skv, d), dtype),
            np.ones((b, hkv, skv, dv), dtype))


def _past(b=2, hkv=2, p=2, d=4, dtype=np.float32):
    return np.ones((b, hkv, p, d), dtype)


Q, K, V = _qkv()
Q3, K3, V3 = (x.transpose(0, 2, 1, 3).reshape(2, x.shape[2], -1) for x in (Q, K, V))

BAD = [
    ("softmax-precision-2", dict(softmax_precision=2), ValueError, "softmax_precision.*got 2"),
    ("softmax-precision-0", dict(softmax_precision=0), ValueError, "softmax_precision.*got 0"),
    ("softmax-precision-float", dict(softmax_precision=1.5), TypeError, "softmax_precision"),
    ("left-window--2", dict(left_window_size=-2), ValueError, "left_window_size.*-2"),
    ("right-window--5", dict(right_window_size=-5), ValueError, "right_window_size.*-5"),
    ("nonpad-above-kv-seq", dict(nonpad_kv_seqlen=np.array([5, 6])), ValueError,
     re.escape("nonpad_kv_seqlen[1] = 6") + ".*kv_sequence_length 5"),
    ("nonpad-negative", dict(nonpad_kv_seqlen=np.array([-1, 2])), ValueError,
     re.escape("nonpad_kv_seqlen[0] = -1")),
    ("nonpad-float", dict(nonpad_kv_seqlen=np.array([1.0, 2.0])), TypeError,
     "nonpad_kv_seqlen.*integer"),
    ("nonpad-shape", dict(nonpad_kv_seqlen=np.array([1, 2, 3])), ValueError,
     re.escape("nonpad_kv_seqlen must have shape (batch_size,) = (2,)")),
    ("nonpad-with-past", dict(nonpad_kv_seqlen=np.array([5, 5]), past_key=_past(), past_value=_past()),
     ValueError, "nonpad_kv_seqlen.*past_key"),
    ("mask-longer-than-total", dict(attn_mask=np.ones((3, 6), bool)), ValueError,
     "attn_mask.*last dimension 6 exceeds total_sequence_length 5"),
    ("mask-longer-than-total-past", dict(attn_mask=np.ones(8, np.float32), past_key=_past(),
                                         past_value=_past()), ValueError,
     "attn_mask.*last dimension 8 exceeds total_sequence_length 7"),
    ("mask-not-broadcastable", dict(attn_mask=np.ones((3, 3, 5), bool)), ValueError,
     "attn_mask shape .*dimension -3 is 3, expected 1 or q_num_heads 4"),
    ("mask-rank5", dict(attn_mask=np.ones((1, 1, 1, 1, 5), bool)), ValueError, "attn_mask.*rank 5"),
    ("mask-string", dict(attn_mask=np.array(["a"] * 5)), TypeError, "attn_mask"),
    ("past-key-without-value", dict(past_key=_past()), ValueError, "past_key and past_value"),
    ("past-value-without-key", dict(past_value=_past()), ValueError, "past_key and past_value"),
    ("past-key-dtype", dict(past_key=_past(dtype=np.float64), past_value=_past()), TypeError,
     "past_key has dtype float64"),
    ("past-value-shape", dict(past_key=_past(), past_value=_past(hkv=1)), ValueError,
     "past_value must have shape"),
    ("past-lengths-differ", dict(past_key=_past(p=2), past_value=_past(p=3)), ValueError,
     "past_key has length 2 but past_value has 3"),
    ("causal-3", dict(is_causal=3), ValueError, "is_causal.*3"),
    ("scale-string", dict(scale="x"), TypeError, "scale"),
    ("q-num-heads-contradicts-4d", dict(q_num_heads=2), ValueError, "q_num_heads = 2"),
]

BAD_QKV = [
    ("hq-not-multiple-of-hkv", _qkv(hq=6, hkv=4), {}, ValueError,
     "q_num_heads 6 must be a multiple of kv_num_heads 4.*transpose"),
    ("k-head-size", (Q, np.ones((2, 2, 5, 6), np.float32), V), {}, ValueError,
     "K head size 6 differs from Q head size 4"),
    ("batch-mismatch", (Q, np.ones((3, 2, 5, 4), np.float32), np.ones((3, 2, 5, 4), np.float32)), {},
     ValueError, "batch sizes differ: Q 2, K 3, V 3"),
    ("v-heads", (Q, K, np.ones((2, 1, 5, 4), np.float32)), {}, ValueError, "K has 2 heads but V has 1"),
    ("v-seq", (Q, K, np.ones((2, 2, 4, 4), np.float32)), {}, ValueError,
     "K has kv_sequence_length 5 but V has 4"),
    ("ranks-differ", (Q3, K, V), {}, ValueError, "Q, K and V must all be 3-D or all 4-D"),
    ("rank-2", (Q[0, 0], K[0, 0], V[0, 0]), {}, ValueError, "3-D or all 4-D"),
    ("3d-without-num-heads", (Q3, K3, V3), {}, ValueError, "q_num_heads and kv_num_heads"),
    ("3d-without-kv-num-heads", (Q3, K3, V3), dict(q_num_heads=4), ValueError,
     "q_num_heads and kv_num_heads"),
    ("3d-hidden-not-multiple", (Q3, K3, V3), dict(q_num_heads=3, kv_num_heads=2), ValueError,
     "Q's hidden size 16 is not a multiple of q_num_heads 3"),
    ("3d-zero-heads", (Q3, K3, V3), dict(q_num_heads=0, kv_num_heads=2), ValueError,
     "q_num_heads 0 .*must be positive"),
    ("q-int32", (Q.astype(np.int32), K, V), {}, TypeError, "Q has dtype int32"),
    ("k-int64", (Q, K.astype(np.int64), V), {}, TypeError, "K has dtype int64"),
    ("v-bool", (Q, K, V.astype(bool)), {}, TypeError, "V has dtype bool"),
    ("q-complex", (Q.astype(np.complex64), K, V), {}, TypeError, "Q has dtype complex64"),
    ("q-none", (None, K, V), {}, TypeError, "Q is required"),
    ("head-size-0", _qkv(d=0), {}, ValueError, "head size must be >= 1, got 0"),
]


@pytest.mark.parametrize("kwargs, exc, match", [pytest.param(*b[1:], id=b[0]) for b in BAD])
def test_bad_arguments(kwargs, exc, match):
    kwargs = dict(kwargs)
    args = [kwargs.pop(n, None) for n in ("attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")]
    with pytest.raises(exc, match=match):
        numkv.attention(Q, K, V, *args, **kwargs)
    with pytest.raises(exc, match=match):  # the ONNX op checks the same way
        numkv.onnx.attention(Q, K, V, *args, **kwargs)


# -- kept plans: a call repeated with the same shapes skips the checks and the set-up


def _random_qkv(rng, q_shape, kv_shape, q_dtype=np.float32, kv_dtype=np.float32):
    return (rng.standard_normal(q_shape).astype(q_dtype), rng.standard_normal(kv_shape).astype(kv_dtype),
            rng.standard_normal(kv_shape).astype(kv_dtype))


KEPT_PLAN_CALLS = [
    ("gqa-decode", ((1, 8, 1, 16), (1, 2, 40, 16)), {}, {}),
    ("3d-causal", ((2, 3, 8 * 16), (2, 50, 2 * 16)), {}, dict(q_num_heads=8, kv_num_heads=2, is_causal=True)),
    ("scale-softcap-window", ((1, 4, 5, 8), (1, 4, 300, 8)), {}, dict(scale=0.3, softcap=2.0, left_window_size=7)),
    ("float16", ((1, 4, 3, 8), (1, 2, 70, 8)), dict(q_dtype=F16, kv_dtype=F16), {}),
    ("bfloat16-cache", ((1, 8, 1, 64), (1, 2, 200, 64)), dict(kv_dtype=BF16), {}),
    ("float64-accumulation", ((1, 4, 2, 8), (1, 4, 30, 8)), {}, dict(softmax_precision=11)),
    ("split-keys-threads", ((1, 8, 1, 64), (1, 2, 20000, 64)), {}, {}),  # chunks merged, on every thread
]


@pytest.mark.parametrize("shapes, dtypes, kwargs", [pytest.param(*c[1:], id=c[0]) for c in KEPT_PLAN_CALLS])
def test_a_repeated_call_takes_its_kept_plan_and_the_same_bits(shapes, dtypes, kwargs, rng, monkeypatch):
    """The second call with the same shapes, dtypes and attributes (new
    values) must not go through ``prepare`` -- its plan is kept -- and must
    give the bits of a call that does."""
    numkv.attention(*_random_qkv(rng, *shapes, **dtypes), **kwargs)
    q, k, v = _random_qkv(rng, *shapes, **dtypes)
    want = _attention.run(_attention.prepare(q, k, v, **kwargs))

    def no_prepare(*args, **kw):
        raise AssertionError("prepare ran: no plan was kept")

    monkeypatch.setattr(_attention, "prepare", no_prepare)
    got = numkv.attention(q, k, v, **kwargs)
    assert same_bits(got, want)


def test_a_kept_plan_skips_no_check():
    """Attributes equal to a kept plan's but of another type (``True == 1 ==
    1.0``) are checked anew, and inputs that are not C-contiguous writeable
    ndarrays never take a plan."""
    numkv.attention(Q, K, V, scale=1.0)
    with pytest.raises(TypeError, match="scale"):
        numkv.attention(Q, K, V, scale=True)
    numkv.attention(Q3, K3, V3, q_num_heads=4, kv_num_heads=2)
    with pytest.raises(TypeError, match="q_num_heads"):
        numkv.attention(Q3, K3, V3, q_num_heads=4.0, kv_num_heads=2)
    read_only = Q.copy()
    read_only.flags.writeable = False
    assert _attention._signature(read_only, K, V, ()) is None
    assert _attention._signature(Q[:, :, ::-1], K, V, ()) is None
    assert _attention._signature(Q.tolist(), K, V, ()) is None
    unhashable = np.array(0.5)  # a scale NumPy holds: accepted, never kept
    assert same_bits(numkv.attention(Q, K, V, scale=unhashable), numkv.attention(Q, K, V, scale=0.5))
    assert _attention._signature(Q, K, V, (unhashable,)) is None


def test_a_misaligned_call_keeps_no_plan_that_misleads_an_aligned_one(rng):
    """A misaligned 3-D Q is copied to be read; a plan made from that copy's
    layout must not serve the aligned call after it."""
    q = rng.standard_normal((1, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 5, 8)).astype(np.float32)
    raw = np.zeros(q.nbytes + 1, np.uint8)
    misaligned = raw[1:].view(np.float32).reshape(q.shape)
    misaligned[...] = q
    kwargs = dict(q_num_heads=2, kv_num_heads=2)
    assert same_bits(numkv.attention(misaligned, k, k, **kwargs), numkv.attention(q, k, k, **kwargs))
    q2 = rng.standard_normal(q.shape).astype(np.float32)
    assert same_bits(numkv.attention(q2, k, k, **kwargs), _attention.run(_attention.prepare(q2, k, k, **kwargs)))


def test_kept_plans_are_bounded(rng):
    q = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    for length in range(1, _config.PLANS_KEPT + 10):
        kv = np.ones((1, 2, length, 4), np.float32)
        numkv.attention(q, kv, kv)
    assert len(_attention._plans) <= _config.PLANS_KEPT


def test_a_cache_s_views_keep_their_layout(rng, monkeypatch):
    """Decode steps over a cache's views (``K = buffer[:, :, :n]``,
    ``nonpad_kv_seqlen``; numkv's caches, transformers' ``KVCache``) check
    their arguments and derive the kernel's layout once (``_checks``,
    ``_layouts``), and the layers of a step after the first take its plan
    (``_step_plans``); each call's Y has the bits of a call that kept nothing.
    Other attributes, q8_0 views, keys that appear are other layouts; a view
    read backwards (its bytes start past its first key) keeps none; a kept
    layout still says what is wrong with a call."""
    import weakref

    made = []
    real = _attention._layout
    monkeypatch.setattr(_attention, "_layout", lambda *args: made.append(1) or real(*args))
    buffers = {fmt: [rng.standard_normal((2, 2, 64, 32)).astype(np.float32) for _ in "kv"] for fmt in ("f", "q")}
    buffers["q"] = [numkv.quantize(b, "q8_0") for b in buffers["q"]]
    sinks = rng.standard_normal(8)
    calls = []
    # each layout twice or more (the second call takes the kept one); the window is unbounded at the first
    # of its steps (30 keys, a query: 31 positions) and excludes key 0 at the fourth (33 keys)
    steps = [({}, 1)] * 3 + [(dict(sinks=sinks), 1)] * 2 + [(dict(sinks=-sinks), 1)] * 2 \
        + [(dict(softcap=3.0), 1)] * 2 + [(dict(scale=0.5), 1)] * 2 + [(dict(left_window_size=31), 1)] * 4 \
        + [({}, 3)] * 2
    for step, (attrs, sq) in enumerate(steps):
        n = 0 if step == 0 else 19 + step
        q = rng.standard_normal((2, 8, sq, 32)).astype(np.float32)
        nonpad = np.array([n, max(n - 3, sq)]) if n else np.array([0, 0])
        # three layers: the second over other buffers (the step's plan), the third another nonpad_kv_seqlen
        other = np.array([n, max(n - 5, sq)]) if n else nonpad
        for layer, (buffer_q, lengths) in enumerate(((q, nonpad), (-q, nonpad), (q, other))):
            for k, v in buffers.values():
                k, v = (k, v) if layer != 1 else (v, k)
                calls.append(lambda q=buffer_q, k=k[:, :, :n], v=v[:, :, :n], nonpad=lengths, attrs=attrs:
                             numkv.attention(q, k, v, nonpad_kv_seqlen=nonpad, is_causal=True, **attrs))
    runs = []
    real_run = _attention.run
    monkeypatch.setattr(_attention, "run", lambda *args, **kwargs: runs.append(1) or real_run(*args, **kwargs))
    kept = [call() for call in calls]
    # the step's plan: the second layer of each step and format; the third too without keys (the same nonpad)
    assert len(calls) - len(runs) == 2 * len(steps) + 2, (len(calls), len(runs))
    # no keys; keys; 5 other attribute sets; 3 queries: each for float32 and q8_0 views
    assert len(made) == 2 * (2 + 5 + 1), len(made)
    for call, y in zip(calls, kept):
        _attention._layouts.clear()
        _attention._checks.clear()
        _attention._step_plans.clear()
        assert same_bits(y, call())
    assert not _attention._plans  # (a step's plan is kept apart from the plans of whole arrays)
    k, v = buffers["f"]
    q = rng.standard_normal((2, 8, 1, 32)).astype(np.float32)
    for start, n in ((1, 1), (2, 2), (1, 10), (2, 11)):  # views past the buffer's start, and read backwards
        for keys in (k[:, :, start:start + n], k[:, :, start + n:start:-1]):
            values = v[:, :, start:start + n]
            assert same_bits(numkv.attention(q, keys, values, nonpad_kv_seqlen=np.array([n, n])),
                             numkv.attention(q, np.ascontiguousarray(keys), np.ascontiguousarray(values)))
    numkv.attention(q, k[:, :, :10], v[:, :, :10], nonpad_kv_seqlen=np.array([10, 10]))
    with pytest.raises(ValueError, match=r"nonpad_kv_seqlen\[1\] = 11 is outside \[0, kv_sequence_length 10\]"):
        numkv.attention(q, k[:, :, :10], v[:, :, :10], nonpad_kv_seqlen=np.array([10, 11]))
    with pytest.raises(ValueError, match="K has kv_sequence_length 10 but V has 11"):
        numkv.attention(q, k[:, :, :10], v[:, :, :11], nonpad_kv_seqlen=np.array([10, 10]))
    with pytest.raises(ValueError, match="K has kv_sequence_length 9 but V has 10"):  # (not the step's plan)
        numkv.attention(q, k[:, :, :9], v[:, :, :10], nonpad_kv_seqlen=np.array([10, 10]))
    big = np.zeros((2, 2, 100_000, 32), np.float32)
    numkv.attention(q, big[:, :, :10], big[:, :, :10], nonpad_kv_seqlen=np.array([10, 10]))
    gone = weakref.ref(big)
    del big
    assert gone() is None


@pytest.mark.parametrize("qkv, kwargs, exc, match", [pytest.param(*b[1:], id=b[0]) for b in BAD_QKV])
def test_bad_qkv(qkv, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        numkv.attention(*qkv, **kwargs)


def test_bad_qk_matmul_output_mode():
    with pytest.raises(ValueError, match="qk_matmul_output_mode must be 0, 1, 2 or 3, got 4"):
        numkv.onnx.attention(Q, K, V, qk_matmul_output_mode=4)


def test_accepted_edge_inputs(rng):
    """What API.md says is accepted: an empty past (length 0), a rank-1 mask
    with is_causal, nonpad entries 0 and kv_sequence_length, window sizes -1 and 0."""
    q, k, v = (values(rng, s, F32) for s in ((2, 4, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4)))
    empty = np.zeros((2, 2, 0, 4), np.float32)
    np.testing.assert_array_equal(numkv.attention(q, k, v, past_key=empty, past_value=empty),
                                  numkv.attention(q, k, v))
    numkv.attention(q, k, v, np.ones(5, bool), is_causal=True)
    y = numkv.attention(q, k, v, nonpad_kv_seqlen=np.array([0, 5], np.int32))
    assert (y[0] == 0).all() and np.isfinite(y).all()
    numkv.attention(q, k, v, left_window_size=0, right_window_size=-1)


def test_negative_softcap_is_no_softcap():
    """ONNX applies the softcap only when it is > 0 (onnx.reference's _softcap);
    a negative one is accepted and ignored, not an error."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 3, 4), dtype=np.float32) for _ in range(3))
    expected = oracle.attention(q, k, v, softcap=-1.0)[0]
    np.testing.assert_allclose(numkv.attention(q, k, v, softcap=-1.0), expected, rtol=1e-5, atol=1e-6)
    assert np.array_equal(numkv.attention(q, k, v, softcap=-1.0), numkv.attention(q, k, v))
