"""ONNX's own backend node test cases for Attention and TensorScatter, run
through ``numkv.onnx``; plus the wiring of the ``OpRun`` classes, zero-size
shapes (``numkv.onnx.attention`` and the evaluator, issue 32) and the
``is_causal`` attribute's check.

The cases are generated the way onnx generates them (the ``export_*``
functions of ``onnx.backend.test.case.node.attention`` / ``.tensorscatter``,
``np.random.seed(0)`` before each, as ``onnx.backend.test.case.base`` does),
so every case onnx 1.23.2 ships is run, with onnx's own inputs, expected
outputs and models.  Only the function-expanded (``*_expanded``) variants are
left out: they test onnx's function bodies, not the op.

Outputs are compared as onnx's backend runner does
(``onnx.backend.test.runner.Runner.assert_similar_outputs``: same shape and
dtype, ``assert_allclose`` with the case's rtol=1e-3 / atol=1e-7, bfloat16
widened with rtol >= 2**-6), except ``present_key`` / ``present_value`` and
TensorScatter's output, which are concatenations / copies and must be
bit-exact.
"""

import importlib
import inspect
from copy import deepcopy

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

import numkv.onnx  # noqa: E402
from onnx import helper  # noqa: E402
from onnx.backend.test.case import node as node_cases  # noqa: E402
from onnx.backend.test.case.base import Base  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402


# --------------------------------------------------------------------------
# collecting onnx's cases


def _collect(module_name):
    """``(name, model, inputs, outputs, rtol, atol)`` of every case the
    ``export_*`` functions of ``onnx.backend.test.case.node.<module_name>`` emit.

    ``collect_testcases(op_type)`` would import (and run) every op's exports,
    ~15 s; calling this module's exports directly, with ``expect`` swapped for
    a recorder, takes a fraction of that and does not depend on the global
    state that ``collect_testcases`` leaves behind.  The models are built by
    onnx's own helpers, as ``expect`` builds them.
    """
    module = importlib.import_module(f"onnx.backend.test.case.node.{module_name}")
    cases = []

    def record(node_op, inputs, outputs, name, **kwargs):
        node = deepcopy(node_op)
        present_inputs = [x for x in node.input if x]
        present_outputs = [x for x in node.output if x]
        in_types = kwargs.pop("input_type_protos", [None] * len(inputs))
        out_types = kwargs.pop("output_type_protos", [None] * len(outputs))
        graph = helper.make_graph(
            [node], name,
            [node_cases._extract_value_info(a, n, t)
             for a, n, t in zip(inputs, present_inputs, in_types)],
            [node_cases._extract_value_info(a, n, t)
             for a, n, t in zip(outputs, present_outputs, out_types)])
        kwargs["producer_name"] = "backend-test"
        kwargs.setdefault("opset_imports", [helper.make_operatorsetid(
            node.domain, onnx.defs.get_schema(node.op_type, domain=node.domain).since_version)])
        model = node_cases._make_test_model_gen_version(graph, **kwargs)
        # onnx's TestCase: rtol=1e-3, atol=1e-7 for every node case.
        cases.append((name, model, list(inputs), list(outputs), 1e-3, 1e-7))

    saved_expect, saved_state = module.expect, np.random.get_state()
    module.expect = record
    try:
        for cls in vars(module).values():
            if inspect.isclass(cls) and issubclass(cls, Base) and cls is not Base:
                for attr, value in vars(cls).items():
                    if attr.startswith("export") and isinstance(value, staticmethod):
                        np.random.seed(0)  # as onnx.backend.test.case.base._Exporter
                        getattr(cls, attr)()
    finally:
        module.expect = saved_expect
        np.random.set_state(saved_state)
    return cases


ATTENTION_CASES = _collect("attention")
SCATTER_CASES = _collect("tensorscatter")


def _case_id(case):
    return case[0].removeprefix("test_")


def test_collected_every_case():
    # onnx 1.23.2 ships 93 Attention and 3 TensorScatter node cases; a newer
    # onnx may add some, never fewer (the collector must not silently miss).
    names = [c[0] for c in ATTENTION_CASES]
    assert len(names) == len(set(names)) >= 93
    assert len(SCATTER_CASES) >= 3
    assert all(c[1].graph.node[0].op_type == "Attention" for c in ATTENTION_CASES)
    versions = {c[1].opset_import[0].version for c in ATTENTION_CASES}
    assert {23, 24, 25} <= versions


def _run(model, inputs):
    feeds = {vi.name: x for vi, x in zip(model.graph.input, inputs)}
    return numkv.onnx.evaluator(model).run(None, feeds)


def _assert_similar(got, want, rtol, atol, what):
    """onnx.backend.test.runner.Runner.assert_similar_outputs, for one output."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.dtype.name == "bfloat16":
        rtol = max(rtol, 2**-6)  # two bfloat16 ulps, as onnx's runner
        got, want = got.astype(np.float32), want.astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def _assert_same_bits(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.dtype}{got.shape} != {want.dtype}{want.shape}")
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), what


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
def test_attention_backend_case(case):
    name, model, inputs, expected, rtol, atol = case
    got = _run(model, inputs)
    assert len(got) == len(expected)
    node = model.graph.node[0]
    for out_vi, g, e in zip(model.graph.output, got, expected):
        position = list(node.output).index(out_vi.name)
        what = f"{name}: output {position} ({out_vi.name})"
        if position in (1, 2):  # present_key / present_value: a concatenation
            _assert_same_bits(g, e, what)
        else:
            _assert_similar(g, e, rtol, atol, what)


@pytest.mark.parametrize("case", SCATTER_CASES, ids=_case_id)
def test_tensor_scatter_backend_case(case):
    name, model, inputs, expected, _, _ = case
    got = _run(model, inputs)
    assert len(got) == len(expected) == 1
    _assert_same_bits(got[0], expected[0], name)


# --------------------------------------------------------------------------
# the OpRun classes


def _attention_model(outputs, opset=24, **attrs):
    f = onnx.TensorProto.FLOAT
    node = helper.make_node("Attention", ["Q", "K", "V", "attn_mask"], outputs, **attrs)
    graph = helper.make_graph(
        [node], "attention",
        [helper.make_tensor_value_info("Q", f, [2, 4, 3, 8]),
         helper.make_tensor_value_info("K", f, [2, 2, 5, 8]),
         helper.make_tensor_value_info("V", f, [2, 2, 5, 8]),
         helper.make_tensor_value_info("attn_mask", onnx.TensorProto.BOOL, [3, 5])],
        [helper.make_tensor_value_info(o, f, None) for o in outputs if o])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _attention_feeds(rng):
    return {"Q": rng.standard_normal((2, 4, 3, 8), np.float32),
            "K": rng.standard_normal((2, 2, 5, 8), np.float32),
            "V": rng.standard_normal((2, 2, 5, 8), np.float32),
            "attn_mask": rng.random((3, 5)) < 0.7}


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of numkv's attention kernel entry, of the score
    (reference) path and of the scatter wrapper, as numkv.onnx makes them."""
    calls = {"run": 0, "scores": 0, "scatter": 0}

    def counting(key, func):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return func(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(numkv.onnx, "run", counting("run", numkv.onnx.run))
    monkeypatch.setattr(numkv.onnx, "attention_reference",
                        counting("scores", numkv.onnx.attention_reference))
    monkeypatch.setattr(numkv.onnx, "tensor_scatter",
                        counting("scatter", numkv.onnx.tensor_scatter))
    return calls


@pytest.mark.parametrize("opset", [23, 24, 25])
def test_reference_evaluator_uses_numkv(counted, rng, opset):
    model = _attention_model(["Y", "present_key", "present_value"], opset=opset, is_causal=1)
    feeds = _attention_feeds(rng)
    sess = ReferenceEvaluator(model, new_ops=[numkv.onnx.Attention, numkv.onnx.TensorScatter])
    got = sess.run(None, feeds)
    assert counted == {"run": 1, "scores": 0, "scatter": 0}
    want = ReferenceEvaluator(model).run(None, feeds)  # onnx's own Attention
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1:], want[1:]):
        _assert_same_bits(g, w, "present")


def test_reference_evaluator_uses_numkv_tensor_scatter(counted, rng):
    f = onnx.TensorProto.FLOAT
    node = helper.make_node("TensorScatter", ["past", "update", "idx"], ["present"],
                            mode="circular")
    graph = helper.make_graph(
        [node], "scatter",
        [helper.make_tensor_value_info("past", f, [2, 3, 6, 4]),
         helper.make_tensor_value_info("update", f, [2, 3, 2, 4]),
         helper.make_tensor_value_info("idx", onnx.TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("present", f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    feeds = {"past": rng.standard_normal((2, 3, 6, 4), np.float32),
             "update": rng.standard_normal((2, 3, 2, 4), np.float32),
             "idx": np.array([5, 1], np.int64)}
    (got,) = numkv.onnx.evaluator(model).run(None, feeds)
    assert counted["scatter"] == 1
    (want,) = ReferenceEvaluator(model).run(None, feeds)
    _assert_same_bits(got, want, "present")


@pytest.mark.parametrize("outputs", [
    ["Y"],
    ["Y", "present_key", "present_value"],
    ["Y", "", "", ""],
    ["Y", "", "", "qk"],
    ["Y", "present_key", "present_value", "qk"],
], ids=lambda o: "-".join(x or "_" for x in o))
def test_scores_only_when_requested(counted, rng, outputs):
    model = _attention_model(outputs, qk_matmul_output_mode=3)
    feeds = _attention_feeds(rng)
    got = numkv.onnx.evaluator(model).run(None, feeds)
    wanted = len(outputs) == 4 and outputs[3] != ""
    assert counted["run"] == 1
    assert counted["scores"] == int(wanted)
    assert len(got) == len([o for o in outputs if o])
    want = ReferenceEvaluator(model).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    if wanted:  # mode 3: probabilities, rows sum to one (no row is fully masked here)
        assert got[-1].shape == (2, 4, 3, 5)
        np.testing.assert_allclose(got[-1].sum(-1), 1, rtol=1e-5)


def _decode_model(outputs):
    f = onnx.TensorProto.FLOAT
    names = ["Q", "K", "V", "", "past_key", "past_value"]
    node = helper.make_node("Attention", names, outputs, is_causal=1)
    graph = helper.make_graph(
        [node], "decode",
        [helper.make_tensor_value_info(n, f, None) for n in names if n],
        [helper.make_tensor_value_info(o, f, None) for o in outputs if o])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])


@pytest.mark.parametrize("outputs", [
    ["Y"], ["Y", "present_key"], ["Y", "", "present_value"], ["Y", "", "", "qk"],
], ids=lambda o: "-".join(x or "_" for x in o))
def test_presents_only_when_requested(rng, outputs):
    """A decode step whose node asks for Y only copied the whole cache into
    present_key / present_value all the same (3-5x a bare numkv.attention
    call at a past of 4096): an unrequested present is never built."""
    import tracemalloc

    past = rng.standard_normal((1, 2, 4096, 64), np.float32)  # 2 MiB each
    feeds = {"Q": rng.standard_normal((1, 4, 1, 64), np.float32),
             "K": rng.standard_normal((1, 2, 1, 64), np.float32),
             "V": rng.standard_normal((1, 2, 1, 64), np.float32),
             "past_key": past, "past_value": past[:, :, ::-1]}
    sess = numkv.onnx.evaluator(_decode_model(outputs))
    sess.run(None, feeds)  # compile, warm
    tracemalloc.start()
    try:
        got = sess.run(None, feeds)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    named = [o for o in outputs if o]
    assert len(got) == len(named)
    want = dict(zip(["Y", "present_key", "present_value"],
                    ReferenceEvaluator(_decode_model(["Y", "present_key", "present_value"]))
                    .run(None, feeds)))
    for name, value in zip(named, got):
        if name in want:
            np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6)
    if "qk" not in named:  # (the scores path materialises K and V: it is the debug output)
        presents = sum(name.startswith("present") for name in named)
        assert peak < (presents + 0.5) * past.nbytes


def test_function_always_returns_four():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 3, 4), np.float32) for _ in range(3))
    out = numkv.onnx.attention(q, k, v)
    assert len(out) == 4 and all(isinstance(x, np.ndarray) for x in out)
    assert out[3].shape == (1, 2, 3, 3)


# -- numkv.onnx on zero-size shapes (issue 32) --

# (Q shape, K/V shape, attributes, whether onnx.reference 1.23.2 answers: it
# fails itself on an empty K and on 3-D inputs with no query, where the
# shapes are still determined)
ZERO_SIZE = {
    "q-seq-0": ((1, 2, 0, 4), (1, 2, 3, 4), {}, True),
    "batch-0": ((0, 2, 3, 4), (0, 2, 3, 4), {}, True),
    "q-heads-0": ((1, 0, 3, 4), (1, 1, 3, 4), {}, True),
    "kv-seq-0": ((1, 2, 3, 4), (1, 2, 0, 4), {"is_causal": 1}, False),
    "3d-q-seq-0": ((1, 0, 8), (1, 3, 8), {"q_num_heads": 2, "kv_num_heads": 2}, False),
}


@pytest.mark.parametrize("case", ZERO_SIZE)
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_onnx_attention_on_zero_size_shapes(case, mode):
    """Issue 32.3: numkv.onnx.attention failed with 'cannot reshape array of
    size 0' where numkv.attention (and onnx.reference, where it answers) do."""
    pytest.importorskip("onnx")
    import numkv.onnx
    import oracle

    q_shape, kv_shape, attrs, reference_answers = ZERO_SIZE[case]
    Q, K = np.zeros(q_shape, np.float32), np.ones(kv_shape, np.float32)
    got = numkv.onnx.attention(Q, K, K, qk_matmul_output_mode=mode, **attrs)
    y = numkv.attention(Q, K, K, **attrs)
    assert got[0].shape == y.shape and got[0].dtype == np.float32
    np.testing.assert_array_equal(got[0], y)
    if reference_answers:
        want = oracle.attention(Q, K, K, qk_matmul_output_mode=mode, float64=False, **attrs)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == np.float32
            np.testing.assert_array_equal(g, w)
    else:
        b = q_shape[0]
        hq, hkv = (q_shape[1], kv_shape[1]) if len(q_shape) == 4 else (attrs["q_num_heads"], attrs["kv_num_heads"])
        sq, skv = q_shape[-2], kv_shape[-2]
        d = (kv_shape[3] if len(kv_shape) == 4 else kv_shape[2] // hkv)
        assert got[1].shape == got[2].shape == (b, hkv, skv, d)
        assert got[3].shape == (b, hq, sq, skv)


@pytest.mark.parametrize("case", ["q-seq-0", "batch-0", "kv-seq-0"])
def test_onnx_evaluator_on_zero_size_shapes_with_every_output(case):
    onnx = pytest.importorskip("onnx")
    from onnx import helper

    import numkv.onnx

    q_shape, kv_shape, attrs, _ = ZERO_SIZE[case]
    f = onnx.TensorProto.FLOAT
    outputs = ["Y", "present_key", "present_value", "qk"]
    node = helper.make_node("Attention", ["Q", "K", "V"], outputs, **attrs)
    graph = helper.make_graph([node], "zero", [helper.make_tensor_value_info(n, f, None) for n in "QKV"],
                              [helper.make_tensor_value_info(o, f, None) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    feeds = {"Q": np.zeros(q_shape, np.float32), "K": np.ones(kv_shape, np.float32),
             "V": np.ones(kv_shape, np.float32)}
    got = numkv.onnx.evaluator(model).run(None, feeds)
    assert [g.shape for g in got] == [r.shape for r in numkv.onnx.attention(*feeds.values(), **attrs)]
    if case != "kv-seq-0":  # onnx.reference cannot take an empty K
        want = onnx.reference.ReferenceEvaluator(model).run(None, feeds)
        assert [g.shape for g in got] == [w.shape for w in want]


def _zeros(*shape):
    return np.zeros(shape, np.float32)


ZERO_SIZE_WITH_INPUTS = {
    "q-seq-0-mask": dict(Q=_zeros(1, 2, 0, 4), K=_zeros(1, 2, 3, 4), V=_zeros(1, 2, 3, 4), attn_mask=_zeros(0, 3)),
    "empty-past-and-k": dict(Q=_zeros(1, 2, 2, 4), K=_zeros(1, 2, 0, 4), V=_zeros(1, 2, 0, 4),
                             past_key=_zeros(1, 2, 0, 4), past_value=_zeros(1, 2, 0, 4)),
    "batch-0-nonpad": dict(Q=_zeros(0, 2, 2, 4), K=_zeros(0, 2, 3, 4), V=_zeros(0, 2, 3, 4),
                           nonpad_kv_seqlen=np.zeros(0, np.int64)),
    "v-head-0": dict(Q=_zeros(1, 2, 2, 4), K=_zeros(1, 2, 3, 4), V=_zeros(1, 2, 3, 0)),
    "empty-k-empty-mask": dict(Q=_zeros(1, 2, 2, 4), K=_zeros(1, 2, 0, 4), V=_zeros(1, 2, 0, 4),
                               attn_mask=np.zeros((2, 0), bool)),
}


@pytest.mark.parametrize("case", ZERO_SIZE_WITH_INPUTS)
@pytest.mark.parametrize("mode", [0, 3])
def test_onnx_attention_on_zero_size_shapes_with_masks_and_pasts(case, mode):
    pytest.importorskip("onnx")
    import numkv.onnx

    inputs = ZERO_SIZE_WITH_INPUTS[case]
    y, present_key, present_value, scores = numkv.onnx.attention(**inputs, qk_matmul_output_mode=mode)
    np.testing.assert_array_equal(y, numkv.attention(**inputs))
    b, hq, sq, _ = inputs["Q"].shape
    past = inputs.get("past_key", _zeros(b, 2, 0, 4)).shape[2]
    total = past + inputs["K"].shape[2]
    assert present_key.shape == (b, 2, total, 4) and present_value.shape == (b, 2, total, inputs["V"].shape[3])
    assert scores.shape == (b, hq, sq, total)


# -- numkv.onnx's is_causal attribute --


def test_onnx_is_causal_must_be_0_or_1():
    q = np.zeros((1, 1, 2, 4), np.float32)
    attention = numkv.onnx.Attention.__new__(numkv.onnx.Attention)

    class Node:
        output = ["Y"]

    attention.onnx_node = Node()
    with pytest.raises(ValueError, match="is_causal"):
        attention._run(q, q, q, is_causal=2)
