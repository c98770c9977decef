"""Regenerate the tiny GQA decoder ``test_exported_model.py`` runs.

Needs torch and onnxscript (the dynamo exporter's dependency); the test needs
neither.  From the repository root::

    pip install torch onnxscript
    python tests/data/export_tiny_gqa_decoder.py

writes, beside this script:

* ``tiny_gqa_decoder_prefill.onnx``: ``input_ids`` (B, S) int64 and a boolean
  ``attention_mask`` (B, S) (True = a real token; prompts are left-padded) ->
  ``logits`` (B, S, vocab) and each layer's ``present_key_i`` /
  ``present_value_i`` (B, kv_heads, S, head_dim);
* ``tiny_gqa_decoder_decode.onnx``: one new token per row, ``attention_mask``
  (B, past + 1) and each layer's ``past_key_i`` / ``past_value_i`` -> the
  next logits and presents (past + 1 positions);
* ``tiny_gqa_decoder_reference.npz``: the inputs of one prefill and one decode
  step, and torch's logits for both.

Both graphs come from ``torch.onnx.export(..., dynamo=True,
opset_version=24)``, which writes ONNX ``Attention`` nodes for
``scaled_dot_product_attention`` (GQA through ``enable_gqa``), the past
concatenated outside the node and the mask boolean.  The model is a
Llama-style decoder, small enough that the three files stay under ~200 KB together.
"""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
VOCAB, EMBED, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 64, 32, 2, 4, 2, 8, 48
PROMPT_LENS = (7, 4)  # a ragged batch, left-padded to 7


def rope(x, positions):
    """Rotary embedding ("rotate half"), per-row positions ``(B, S)``."""
    half = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = positions[:, None, :, None].float() * inv_freq
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(EMBED), nn.RMSNorm(EMBED)
        self.q = nn.Linear(EMBED, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(EMBED, KV_HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(EMBED, KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, EMBED, bias=False)
        self.gate = nn.Linear(EMBED, MLP, bias=False)
        self.up = nn.Linear(EMBED, MLP, bias=False)
        self.down = nn.Linear(MLP, EMBED, bias=False)

    def forward(self, x, positions, mask, past_k=None, past_v=None):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(h).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v(h).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = rope(q, positions), rope(k, positions)
        if past_k is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h)), k, v


class TinyDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(EMBED)

    def forward(self, input_ids, attention_mask, *past):
        b, s = input_ids.shape
        total = attention_mask.shape[1]
        # Positions count real tokens only (left padding), as in Hugging Face models.
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, total - s:]
        # Query i (absolute index total - s + i) sees real keys j <= it, and
        # always itself, so a padding query's row is never fully masked
        # (torch's SDPA would give it NaN, which would then reach V).
        i = torch.arange(s)[:, None] + (total - s)
        j = torch.arange(total)[None, :]
        mask = (j <= i) & (attention_mask[:, None, None, :] | (j == i))
        x = self.embed(input_ids)
        presents = []
        for n, block in enumerate(self.blocks):
            past_k, past_v = (past[2 * n], past[2 * n + 1]) if past else (None, None)
            x, k, v = block(x, positions, mask, past_k, past_v)
            presents += [k, v]
        return (self.norm(x) @ self.embed.weight.T, *presents)


def _strip_node_metadata(path):
    """Drop the exporter's per-node metadata (the Python stack trace and FX
    node of each op): half of each file, and nothing ONNX runs on."""
    import onnx

    model = onnx.load(path)
    for node in model.graph.node:
        del node.metadata_props[:]
    onnx.save(model, path)


def main():
    torch.manual_seed(0)
    model = TinyDecoder().eval()
    rng = np.random.default_rng(0)
    batch, longest = len(PROMPT_LENS), max(PROMPT_LENS)
    input_ids = rng.integers(0, VOCAB, (batch, longest))
    mask = np.zeros((batch, longest), bool)
    for b, n in enumerate(PROMPT_LENS):
        mask[b, longest - n:] = True
    input_ids[~mask] = 0
    next_ids = rng.integers(0, VOCAB, (batch, 1))
    next_mask = np.concatenate([mask, np.ones((batch, 1), bool)], axis=1)

    names = [f"{kind}_{n}" for n in range(LAYERS) for kind in ("key", "value")]
    with torch.no_grad():
        prefill = model(torch.from_numpy(input_ids), torch.from_numpy(mask))
        decode = model(torch.from_numpy(next_ids), torch.from_numpy(next_mask), *prefill[1:])

    ids, am = torch.from_numpy(input_ids), torch.from_numpy(mask)
    batch_dim, seq, past_len = (torch.export.Dim(n) for n in ("batch", "seq", "past"))
    torch.onnx.export(
        model, (ids, am), HERE / "tiny_gqa_decoder_prefill.onnx", dynamo=True, opset_version=24,
        input_names=["input_ids", "attention_mask"],
        output_names=["logits", *(f"present_{n}" for n in names)],
        dynamic_shapes=({0: batch_dim, 1: seq}, {0: batch_dim, 1: seq}), optimize=True,
        external_data=False)
    past = tuple(prefill[1:])
    torch.onnx.export(
        model, (torch.from_numpy(next_ids), torch.from_numpy(next_mask), *past),
        HERE / "tiny_gqa_decoder_decode.onnx", dynamo=True, opset_version=24,
        input_names=["input_ids", "attention_mask", *(f"past_{n}" for n in names)],
        output_names=["logits", *(f"present_{n}" for n in names)],
        dynamic_shapes=({0: batch_dim}, {0: batch_dim, 1: past_len + 1},
                        tuple({0: batch_dim, 2: past_len} for _ in names)),  # *past: one tuple
        optimize=True, external_data=False)
    for name in ("prefill", "decode"):
        _strip_node_metadata(HERE / f"tiny_gqa_decoder_{name}.onnx")
    np.savez_compressed(
        HERE / "tiny_gqa_decoder_reference.npz",
        input_ids=input_ids, attention_mask=mask, next_ids=next_ids, next_mask=next_mask,
        prefill_logits=prefill[0].numpy(), decode_logits=decode[0].numpy(),
        torch_version=np.array(torch.__version__))
    for path in sorted(HERE.glob("tiny_gqa_decoder_*")):
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
