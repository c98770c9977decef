"""A decoder exported by torch's own ONNX exporter runs on numkv's kernels.

``tests/data/tiny_gqa_decoder_{prefill,decode}.onnx`` come from
``torch.onnx.export(..., dynamo=True, opset_version=24)`` (the script beside
them regenerates them; torch is not needed here): GQA ``Attention`` nodes
(4 query / 2 key-value heads), the past concatenated outside the node, a
boolean mask from a left-padded ragged batch.  Prefill, then one decode step
fed with numkv's own present keys and values, through
``numkv.onnx.evaluator``; logits checked against torch's (stored) and
onnxruntime's.
"""

from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
import numkv.onnx  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
# float32 logits of spread ~7 (max ~40), summed in different orders by
# torch, onnxruntime and numkv: measured gaps 4e-6 .. 2e-5.
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def models():
    return {name: onnx.load(DATA / f"tiny_gqa_decoder_{name}.onnx") for name in ("prefill", "decode")}


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(DATA / "tiny_gqa_decoder_reference.npz"))


def _ort(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.fixture
def counted(monkeypatch):
    """Counts the Attention nodes numkv's OpRun ran."""
    calls = []
    run = numkv.onnx.Attention._run

    def counting(self, *args, **kwargs):
        calls.append(self.onnx_node.name)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(numkv.onnx.Attention, "_run", counting)
    return calls


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_the_graph_is_what_torch_writes(models, name):
    """Opset 24 ``Attention`` nodes, GQA by head count, a boolean mask."""
    model = onnx.shape_inference.infer_shapes(models[name])
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 24)}
    types = {v.name: v.type.tensor_type for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    nodes = [n for n in model.graph.node if n.op_type == "Attention"]
    assert len(nodes) == 2
    for node in nodes:
        q, k, v, mask = node.input[:4]
        assert types[mask].elem_type == onnx.TensorProto.BOOL
        heads = [types[x].shape.dim[1].dim_value for x in (q, k, v)]
        assert heads == [4, 2, 2], heads


def test_prefill_and_decode_agree_with_torch_and_onnxruntime(models, reference, counted):
    prefill, decode = models["prefill"], models["decode"]
    feeds = dict(input_ids=reference["input_ids"], attention_mask=reference["attention_mask"])
    ours = numkv.onnx.evaluator(prefill).run(None, feeds)
    theirs = _ort(prefill, feeds)
    assert len(counted) == 2  # both Attention nodes ran on numkv
    np.testing.assert_allclose(ours[0], reference["prefill_logits"], **TOL)
    np.testing.assert_allclose(ours[0], theirs[0], **TOL)
    for present, expected in zip(ours[1:], theirs[1:]):  # the past the decode step reads
        np.testing.assert_allclose(present, expected, **TOL)

    names = [i.name for i in decode.graph.input]
    step = [reference["next_ids"], reference["next_mask"]]
    ours_next = numkv.onnx.evaluator(decode).run(None, dict(zip(names, step + ours[1:])))
    theirs_next = _ort(decode, dict(zip(names, step + theirs[1:])))
    assert len(counted) == 4
    np.testing.assert_allclose(ours_next[0], reference["decode_logits"], **TOL)
    np.testing.assert_allclose(ours_next[0], theirs_next[0], **TOL)
    past = reference["attention_mask"].shape[1]
    assert all(p.shape[2] == past + 1 for p in ours_next[1:])
    # Greedy choices agree too: the tokens a user would see.
    np.testing.assert_array_equal(ours_next[0].argmax(-1), reference["decode_logits"].argmax(-1))
