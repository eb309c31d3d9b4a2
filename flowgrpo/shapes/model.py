"""The tiny text-conditioned flow model of the shapes world.

A diffusers ``SD3Transformer2DModel`` (the MMDiT of Stable Diffusion 3) run directly in pixel space
on 32x32 RGB images with 8x8 patches (one patch = one grid cell of the world, 16 image tokens),
conditioned by a small word-level text encoder.

The transformer predicts the clean image x0 and the model returns the velocity
v = (x - x0_hat) / sigma that every sampler expects. At patch size 8 a patch holds 192 values,
more than the width of the transformer; v-prediction then leaves per-pixel noise in every sample,
while x0-prediction only has to emit one glyph template per patch. Using SD3's
own transformer class means LoRA targets, attention processors and the SD3 adapter code paths are
exercised by the embedded default exactly as they are on the real model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import UserError
from .world import VOCAB

WEIGHTS_DIR = Path(__file__).parent / "weights"


@dataclass
class ShapesModelConfig:
    image_size: int = 32
    patch_size: int = 8
    num_layers: int = 6
    attention_head_dim: int = 32
    num_attention_heads: int = 4
    text_dim: int = 64
    text_layers: int = 2
    max_tokens: int = 12
    prediction: str = "x0"  # what the transformer outputs: "x0" (clean image) or "v" (velocity)


class VocabularyError(UserError, ValueError):
    """A prompt with words the shapes-world model does not know (one line on the command line)."""


class WordTokenizer:
    """Word-level tokenizer over the closed shapes-world vocabulary.

    ``__call__(prompts)`` -> (ids [B, L] long, mask [B, L] bool). Unknown words raise
    :class:`VocabularyError` naming the words, since the model cannot represent them.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.index = {w: i for i, w in enumerate(VOCAB)}

    def __call__(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        ids = torch.zeros(len(prompts), self.max_tokens, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = prompt.lower().replace(",", " ").split()
            bad = [w for w in words if w not in self.index]
            if bad:
                raise VocabularyError(
                    f"prompt {prompt!r} uses words outside the shapes-world vocabulary: {bad}; "
                    f"valid words: {', '.join(VOCAB[3:])}"
                )
            toks = [self.index["<bos>"]] + [self.index[w] for w in words] + [self.index["<eos>"]]
            toks = toks[: self.max_tokens]
            ids[row, : len(toks)] = torch.tensor(toks)
        return ids, ids != 0


class WordTextEncoder(nn.Module):
    """Embedding + 2-layer Transformer encoder. Returns (hidden [B, L, text_dim], pooled [B, text_dim])."""

    def __init__(self, cfg: ShapesModelConfig):
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), cfg.text_dim)
        self.pos = nn.Parameter(torch.randn(cfg.max_tokens, cfg.text_dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            cfg.text_dim, nhead=4, dim_feedforward=cfg.text_dim * 2, batch_first=True, norm_first=True, dropout=0.0
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.text_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.text_dim)

    def forward(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        h = self.norm(self.encoder(h, src_key_padding_mask=~mask))
        m = mask.unsqueeze(-1).float()
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        return h, pooled


class ShapesFlowModel(nn.Module):
    """Text encoder + SD3 transformer in pixel space. Images are [B, 3, 32, 32] in [-1, 1]."""

    def __init__(self, cfg: ShapesModelConfig | None = None):
        super().__init__()
        from diffusers import SD3Transformer2DModel

        self.cfg = cfg or ShapesModelConfig()
        c = self.cfg
        self.tokenizer = WordTokenizer(c.max_tokens)
        self.text_encoder = WordTextEncoder(c)
        self.transformer = SD3Transformer2DModel(
            sample_size=c.image_size,
            patch_size=c.patch_size,
            in_channels=3,
            out_channels=3,
            num_layers=c.num_layers,
            attention_head_dim=c.attention_head_dim,
            num_attention_heads=c.num_attention_heads,
            joint_attention_dim=c.text_dim,
            caption_projection_dim=c.attention_head_dim * c.num_attention_heads,
            pooled_projection_dim=c.text_dim,
            pos_embed_max_size=c.image_size // c.patch_size,
        )

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Prompts -> (hidden [B, L, text_dim], pooled [B, text_dim])."""
        device = self.text_encoder.pos.device
        ids, mask = self.tokenizer(prompts)
        return self.text_encoder(ids.to(device), mask.to(device))

    def predict(self, x: Tensor, sigma: Tensor, hidden: Tensor, pooled: Tensor) -> Tensor:
        """The transformer's raw output for x [B, 3, H, W] at noise level sigma [B] (x0 or v, per config)."""
        return self.transformer(
            hidden_states=x, encoder_hidden_states=hidden, pooled_projections=pooled, timestep=sigma * 1000.0
        ).sample

    def forward(self, x: Tensor, sigma: Tensor, hidden: Tensor, pooled: Tensor) -> Tensor:
        """Velocity v = eps - x0 for x [B, 3, H, W] at noise level sigma [B] in (0, 1]."""
        out = self.predict(x, sigma, hidden, pooled)
        if self.cfg.prediction == "v":
            return out
        # x = (1 - sigma) x0 + sigma eps  =>  v = eps - x0 = (x - x0) / sigma; samplers never ask at sigma = 0
        s = sigma.to(out.dtype).clamp_min(1e-4).view(-1, *([1] * (x.ndim - 1)))
        return (x.to(out.dtype) - out) / s

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        """Write ``model.safetensors`` and ``config.json`` (plus ``extra`` metadata) atomically."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        tmp = directory / "model.safetensors.tmp"
        save_file(state, str(tmp))
        tmp.replace(directory / "model.safetensors")
        meta = {"config": asdict(self.cfg), **(extra or {})}
        tmp = directory / "config.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(directory / "config.json")

    @classmethod
    def load(cls, directory: str | Path | None = None) -> "ShapesFlowModel":
        """Load from ``directory`` (default: the weights shipped inside the package)."""
        from safetensors.torch import load_file

        directory = Path(directory) if directory else WEIGHTS_DIR
        weights = directory / "model.safetensors"
        if not weights.exists():
            raise FileNotFoundError(
                f"shapes model weights not found at {weights}; create them with "
                f"`python -m flowgrpo.shapes.pretrain --out {directory}`"
            )
        meta = json.loads((directory / "config.json").read_text())
        model = cls(ShapesModelConfig(**meta["config"]))
        model.load_state_dict(load_file(str(weights)))
        return model
