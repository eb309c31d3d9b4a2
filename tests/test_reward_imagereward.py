"""ImageReward on a tiny random BLIP, checked against a plain-torch forward of the authors' architecture.

The test writes a checkpoint in ImageReward's own layout (``blip.visual_encoder.*`` as BLIP's timm-style
ViT names them, ``blip.text_encoder.*`` as BLIP's med.py BERT, ``mlp.layers.*``, plus the unused
contrastive projections) with random weights, builds the reward through its real loading path, and
recomputes every score by hand from that state dict: patch conv, [CLS] + positions, pre-norm blocks
with fused qkv, final LayerNorm; BERT embeddings, self-attention with the padding mask, cross-attention
to all image tokens, feed-forward, post-norms; the MLP; ``(raw - mean) / std``. Nothing downloads.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from flowgrpo.errors import ConfigError, UserError
from flowgrpo.rewards import build_reward
from flowgrpo.rewards.imagereward import MAX_TEXT_TOKENS, SCORE_MEAN, SCORE_STD

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

PROMPTS = ["a red cube", "two dogs in snow", "an astronaut riding a horse", "a bowl of fruit"]
DV, DT, PATCH, SIZE, HEADS = 32, 24, 16, 64, 2  # vision width, text width, patch, image size, heads
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz",
         *("##" + c for c in "abcdefghijklmnopqrstuvwxyz"), "a", "red", "cube", "two", "dogs", "in", "snow"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny ImageReward checkpoint in the authors' key layout, its configs and a WordPiece tokenizer."""
    d = tmp_path_factory.mktemp("tiny_imagereward")
    (d / "tok").mkdir()
    (d / "tok" / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    vocab = len(WORDS) + 2  # + [DEC], [ENC]
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    n = (SIZE // PATCH) ** 2
    v = {"cls_token": r(1, 1, DV), "pos_embed": r(1, n + 1, DV), "patch_embed.proj.weight": r(DV, 3, PATCH, PATCH, scale=0.05),
         "patch_embed.proj.bias": r(DV), "norm.weight": 1 + r(DV), "norm.bias": r(DV)}
    for i in range(2):
        for name, shape in {"norm1.weight": (DV,), "norm1.bias": (DV,), "attn.qkv.weight": (3 * DV, DV),
                            "attn.qkv.bias": (3 * DV,), "attn.proj.weight": (DV, DV), "attn.proj.bias": (DV,),
                            "norm2.weight": (DV,), "norm2.bias": (DV,), "mlp.fc1.weight": (4 * DV, DV),
                            "mlp.fc1.bias": (4 * DV,), "mlp.fc2.weight": (DV, 4 * DV), "mlp.fc2.bias": (DV,)}.items():
            v[f"blocks.{i}.{name}"] = (1 + r(*shape)) if name.endswith("norm1.weight") or name.endswith("norm2.weight") else r(*shape)
    t = {"embeddings.word_embeddings.weight": r(vocab, DT), "embeddings.position_embeddings.weight": r(40, DT),
         "embeddings.LayerNorm.weight": 1 + r(DT), "embeddings.LayerNorm.bias": r(DT),
         "embeddings.position_ids": torch.arange(40).view(1, -1)}
    for i in range(2):
        for part, kv_width in (("attention", DT), ("crossattention", DV)):
            p = f"encoder.layer.{i}.{part}"
            t.update({f"{p}.self.query.weight": r(DT, DT), f"{p}.self.query.bias": r(DT),
                      f"{p}.self.key.weight": r(DT, kv_width), f"{p}.self.key.bias": r(DT),
                      f"{p}.self.value.weight": r(DT, kv_width), f"{p}.self.value.bias": r(DT),
                      f"{p}.output.dense.weight": r(DT, DT), f"{p}.output.dense.bias": r(DT),
                      f"{p}.output.LayerNorm.weight": 1 + r(DT), f"{p}.output.LayerNorm.bias": r(DT)})
        t.update({f"encoder.layer.{i}.intermediate.dense.weight": r(48, DT), f"encoder.layer.{i}.intermediate.dense.bias": r(48),
                  f"encoder.layer.{i}.output.dense.weight": r(DT, 48), f"encoder.layer.{i}.output.dense.bias": r(DT),
                  f"encoder.layer.{i}.output.LayerNorm.weight": 1 + r(DT), f"encoder.layer.{i}.output.LayerNorm.bias": r(DT)})
    mlp = {}
    for idx, (o, i_) in zip((0, 2, 4, 6, 7), ((1024, DT), (128, 1024), (64, 128), (16, 64), (1, 16))):
        mlp[f"layers.{idx}.weight"], mlp[f"layers.{idx}.bias"] = r(o, i_, scale=1 / (i_ ** 0.5)), r(o)
    sd = {**{f"blip.visual_encoder.{k}": x for k, x in v.items()}, **{f"blip.text_encoder.{k}": x for k, x in t.items()},
          **{f"mlp.{k}": x for k, x in mlp.items()}, "blip.vision_proj.weight": r(256, DV), "blip.vision_proj.bias": r(256),
          "blip.text_proj.weight": r(256, DT), "blip.text_proj.bias": r(256)}
    torch.save(sd, d / "ImageReward.pt")
    (d / "med_config.json").write_text(json.dumps({
        "architectures": ["BertModel"], "hidden_size": DT, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "intermediate_size": 48, "vocab_size": vocab, "max_position_embeddings": 40, "encoder_width": 768,
        "add_cross_attention": True}))
    (d / "vision.json").write_text(json.dumps({"hidden_size": DV, "intermediate_size": 4 * DV, "num_hidden_layers": 2,
                                               "num_attention_heads": HEADS, "image_size": SIZE, "patch_size": PATCH}))
    return d, sd


def build(tiny, **kw):
    d, _ = tiny
    opts = dict(checkpoint=str(d / "ImageReward.pt"), med_config=str(d / "med_config.json"),
                vision_config=str(d / "vision.json"), tokenizer=str(d / "tok"), device="cpu")
    return build_reward("imagereward", **{**opts, **kw})


def attention(q, k, v, heads, mask=None):
    b, n, d = q.shape
    q, k, v = (x.reshape(b, -1, heads, d // heads).transpose(1, 2) for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / (d // heads) ** 0.5
    if mask is not None:
        s = s + (1.0 - mask[:, None, None, :].float()) * -10000.0
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


def authors_forward(sd, pixels, ids, mask):
    """ImageReward's score recomputed from its own state dict with plain torch ops."""
    def p(name):
        return sd[name]

    def lin(x, name):
        return F.linear(x, p(f"{name}.weight"), p(f"{name}.bias"))

    def ln(x, name, eps):
        return F.layer_norm(x, x.shape[-1:], p(f"{name}.weight"), p(f"{name}.bias"), eps)

    vp = "blip.visual_encoder"
    x = F.conv2d(pixels, p(f"{vp}.patch_embed.proj.weight"), p(f"{vp}.patch_embed.proj.bias"), stride=PATCH)
    x = torch.cat([p(f"{vp}.cls_token").expand(x.shape[0], -1, -1), x.flatten(2).transpose(1, 2)], 1) + p(f"{vp}.pos_embed")
    for i in range(2):
        b = f"{vp}.blocks.{i}"
        h = ln(x, f"{b}.norm1", 1e-6)
        q, k, v = lin(h, f"{b}.attn.qkv").chunk(3, dim=-1)
        x = x + lin(attention(q, k, v, HEADS), f"{b}.attn.proj")
        x = x + lin(F.gelu(lin(ln(x, f"{b}.norm2", 1e-6), f"{b}.mlp.fc1")), f"{b}.mlp.fc2")
    image = ln(x, f"{vp}.norm", 1e-6)
    tp = "blip.text_encoder"
    h = p(f"{tp}.embeddings.word_embeddings.weight")[ids] + p(f"{tp}.embeddings.position_embeddings.weight")[:ids.shape[1]]
    h = ln(h, f"{tp}.embeddings.LayerNorm", 1e-12)
    for i in range(2):
        b = f"{tp}.encoder.layer.{i}"
        a = attention(lin(h, f"{b}.attention.self.query"), lin(h, f"{b}.attention.self.key"),
                      lin(h, f"{b}.attention.self.value"), HEADS, mask)
        h = ln(lin(a, f"{b}.attention.output.dense") + h, f"{b}.attention.output.LayerNorm", 1e-12)
        c = attention(lin(h, f"{b}.crossattention.self.query"), lin(image, f"{b}.crossattention.self.key"),
                      lin(image, f"{b}.crossattention.self.value"), HEADS)
        h = ln(lin(c, f"{b}.crossattention.output.dense") + h, f"{b}.crossattention.output.LayerNorm", 1e-12)
        f = lin(F.gelu(lin(h, f"{b}.intermediate.dense")), f"{b}.output.dense")
        h = ln(f + h, f"{b}.output.LayerNorm", 1e-12)
    z = h[:, 0]
    for idx in (0, 2, 4, 6, 7):
        z = lin(z, f"mlp.layers.{idx}")
    return (z.squeeze(-1) - SCORE_MEAN) / SCORE_STD


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(1)
    x = F.interpolate(torch.rand(4, 3, 12, 15, generator=g), size=(80, 100), mode="bilinear", align_corners=False)
    return (x * 255).round() / 255


def test_imagereward_matches_the_authors_forward(tiny, images):
    _, sd = tiny
    reward = build(tiny, batch_size=3)
    out = reward(images, PROMPTS)
    assert out.scores.shape == (4,) and out.scores.dtype == torch.float32 and torch.isfinite(out.scores).all()
    assert torch.allclose(out.components["raw"], out.scores * SCORE_STD + SCORE_MEAN, atol=1e-5)

    from transformers import BertTokenizer

    tok = BertTokenizer.from_pretrained(str(tiny[0] / "tok"))
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    text = tok(PROMPTS, padding="max_length", truncation=True, max_length=MAX_TEXT_TOKENS, return_tensors="pt")
    pixels = reward.tensor_pixels(images)
    assert pixels.shape == (4, 3, SIZE, SIZE)
    with torch.no_grad():
        expected = authors_forward(sd, pixels, text["input_ids"], text["attention_mask"])
    assert float((out.scores - expected).abs().max()) < 1e-4, (out.scores, expected)

    again = build(tiny, batch_size=1)(images, PROMPTS)  # a fresh load, one image per forward: same scores
    assert torch.allclose(again.scores, out.scores, atol=1e-5)
    # the score reads the prompt and the image
    assert (reward(images, PROMPTS[::-1]).scores - out.scores).abs().max() > 1e-3
    assert (reward(images.flip(-1), PROMPTS).scores - out.scores).abs().max() > 1e-3
    # the authors' PIL transform gives the same pixels up to uint8 rounding
    reward.preprocess = "pil"
    assert (reward(images, PROMPTS).scores - out.scores).abs().max() < 0.05


def test_imagereward_weights_errors(tiny, tmp_path):
    d, sd = tiny
    missing = tmp_path / "nowhere" / "ImageReward.pt"
    with pytest.raises(UserError) as info:
        build(tiny, checkpoint=str(missing))
    assert str(missing) in str(info.value) and "\n" not in str(info.value)
    partial = tmp_path / "partial.pt"
    torch.save({k: v for k, v in sd.items() if not k.startswith("mlp.")}, partial)
    with pytest.raises(UserError, match="does not fit the model") as info:
        build(tiny, checkpoint=str(partial))
    assert str(partial) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UserError, match="no such folder"):
        build(tiny, tokenizer=str(tmp_path / "no_tokenizer"))
    with pytest.raises(ConfigError, match="needs option\\(s\\) checkpoint"):
        build_reward("imagereward")
