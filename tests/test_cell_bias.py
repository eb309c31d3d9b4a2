"""The shapes model's learned attention bias between image cells by offset (flowgrpo/shapes/cell_bias.py).

Checked against a float64 attention written out from its definition (softmax(q k^T / sqrt(d) + bias) v
over image tokens then text tokens, the bias on image-image pairs only), and for the property it exists
for: a model built with it and a zero table is the model without it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowgrpo.shapes.cell_bias import CellOffsetAttnProcessor, cell_offsets
from flowgrpo.shapes.model import ShapesFlowModel, ShapesModelConfig


def test_cell_offsets_index_the_row_and_column_difference():
    g = 4
    idx = cell_offsets(g)
    assert idx.shape == (16, 16) and idx.min() == 0 and idx.max() == (2 * g - 1) ** 2 - 1
    for i in range(16):
        for j in range(16):
            (ri, ci), (rj, cj) = divmod(i, g), divmod(j, g)
            assert divmod(int(idx[i, j]), 2 * g - 1) == (ri - rj + g - 1, ci - cj + g - 1)
    assert torch.all(idx.diagonal() == (g - 1) * (2 * g - 1) + g - 1)  # a cell and itself: the centre


def _joint_attention_f64(attn, x, ctx, bias):
    """Reference: SD3 joint attention in float64 with ``bias`` [H, N_img, N_img] on image-image logits."""
    d = {n: p.double() for n, p in attn.named_parameters()}
    lin = lambda t, name: t.double() @ d[f"{name}.weight"].T + d[f"{name}.bias"]  # noqa: E731
    h = attn.heads

    def split(t):
        return t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2)

    def rms(t, name):  # SD3's optional qk norm (RMSNorm); the shapes model has none
        if getattr(attn, name) is None:
            return t
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + getattr(attn, name).eps)
        w = d.get(f"{name}.weight")
        return t * w if w is not None else t

    q = torch.cat([rms(split(lin(x, "to_q")), "norm_q"), rms(split(lin(ctx, "add_q_proj")), "norm_added_q")], 2)
    k = torch.cat([rms(split(lin(x, "to_k")), "norm_k"), rms(split(lin(ctx, "add_k_proj")), "norm_added_k")], 2)
    v = torch.cat([split(lin(x, "to_v")), split(lin(ctx, "add_v_proj"))], 2)
    n = x.shape[1]
    full = torch.zeros(h, q.shape[2], q.shape[2], dtype=torch.float64)
    full[:, :n, :n] = bias.double()
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + full, -1)
    out = (w @ v).transpose(1, 2).reshape(x.shape[0], -1, h * q.shape[-1])
    return lin(out[:, :n], "to_out.0"), lin(out[:, n:], "to_add_out")


def test_processor_matches_a_float64_attention_with_the_bias():
    torch.manual_seed(0)
    model = ShapesFlowModel(ShapesModelConfig(num_layers=2, cell_offset_bias=True))
    attn = model.transformer.transformer_blocks[0].attn
    proc = attn.processor
    assert isinstance(proc, CellOffsetAttnProcessor)
    with torch.no_grad():
        proc.offset_bias.normal_(0, 2.0)
    x, ctx = torch.randn(2, 16, 128), torch.randn(2, 3, 128)
    img, txt = attn(hidden_states=x, encoder_hidden_states=ctx)
    ref_img, ref_txt = _joint_attention_f64(attn, x, ctx, proc.image_bias().detach())
    assert torch.allclose(img.double(), ref_img, atol=1e-4) and torch.allclose(txt.double(), ref_txt, atol=1e-4)
    # the bias is the same for every pair of cells one offset apart (translation invariance)
    b = proc.image_bias()
    assert torch.equal(b[:, 0, 5], b[:, 10, 15]) and torch.equal(b[:, 1, 0], b[:, 15, 14])
    assert not torch.equal(b[:, 0, 1], b[:, 0, 4])  # one column right is not one row down
    with pytest.raises(ValueError, match="4x4 = 16 image tokens, got 9"):
        attn(hidden_states=torch.randn(1, 9, 128), encoder_hidden_states=ctx)


def test_zero_bias_model_is_the_model_without_it_and_the_table_trains_and_round_trips(tmp_path):
    torch.manual_seed(0)
    plain = ShapesFlowModel(ShapesModelConfig(num_layers=2)).eval()
    biased = ShapesFlowModel(ShapesModelConfig(num_layers=2, cell_offset_bias=True)).eval()
    missing, unexpected = biased.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and sorted(missing) == [f"transformer.transformer_blocks.{i}.attn.processor.offset_bias"
                                                    for i in range(2)]
    x, sigma = torch.randn(3, 3, 32, 32), torch.tensor([0.2, 0.6, 0.95])
    hidden, pooled = plain.encode(["a red circle left of a blue square", "two green triangles", ""])
    with torch.no_grad():
        assert torch.allclose(plain(x, sigma, hidden, pooled), biased(x, sigma, hidden, pooled), atol=1e-5)
    # the table is a transformer parameter: the gradient reaches it (full fine-tuning trains it)
    table = biased.transformer.transformer_blocks[0].attn.processor.offset_bias
    assert table.requires_grad and any(p is table for p in biased.transformer.parameters())
    biased(x, sigma, hidden, pooled).square().mean().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    with torch.no_grad():
        table.normal_()
    biased.save(tmp_path)
    loaded = ShapesFlowModel.load(tmp_path)
    assert loaded.cfg.cell_offset_bias is True
    assert torch.equal(loaded.transformer.transformer_blocks[0].attn.processor.offset_bias, table)
    # weights written before the option existed (no key in config.json) are built without it
    plain.save(tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "config.json").read_text())
    del meta["config"]["cell_offset_bias"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(meta))
    assert ShapesFlowModel.load(tmp_path / "old").cfg.cell_offset_bias is False
