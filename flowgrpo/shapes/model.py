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

import hashlib

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..model_size import check_model_folder
from ..text_inputs import loads_json
from .cell_bias import install_cell_offset_bias
from .scene_text import SceneTextEncoder, SceneTokenizer, VocabularyError, prompt_words  # noqa: F401 (VocabularyError: re-exported)
from .world import VOCAB

WEIGHTS_DIR = Path(__file__).parent / "weights"


def weights_folder(directory: str | Path | None = None) -> Path:
    """The folder of shapes weights that ``directory`` names: itself, or (None / empty) the weights
    shipped inside the package, which is what ``model.path: null`` means."""
    return Path(directory) if directory else WEIGHTS_DIR


def base_fingerprint(model_path: str | None) -> dict:
    """{"path", "sha256"} of the base weights that ``model.path`` resolves to (None: the shipped weights),
    which a run records (:mod:`flowgrpo.trainer.base_weights`); the hash is over ``model.safetensors``
    (14 MB, tens of milliseconds)."""
    folder = weights_folder(model_path)
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    return {"path": str(folder.resolve()), "sha256": digest}


#: the text sides a shapes model can have (``ShapesModelConfig.text_encoder``)
TEXT_ENCODERS = ("scene", "words")


@dataclass
class ShapesModelConfig:
    """Size and conditioning of the shapes model; written into ``config.json`` beside its weights.

    The model's size is chosen at pretraining (``python -m flowgrpo.shapes.pretrain --layers N
    --heads N --head-dim N --text-dim N``); training and evaluation read it back from the weights."""

    image_size: int = 32  # pixels per side (the 4x4 grid of 8-pixel cells)
    patch_size: int = 8  # one patch = one grid cell
    num_layers: int = 6  # MMDiT blocks
    attention_head_dim: int = 32  # width = heads x head_dim
    num_attention_heads: int = 4
    text_dim: int = 64  # width of the text tokens and the pooled vector
    text_layers: int = 2  # Transformer layers of the text encoder
    max_tokens: int = 12  # word encoder only: tokens per prompt
    prediction: str = "x0"  # what the transformer outputs: "x0" (clean image) or "v" (velocity)
    # "scene": one token per parsed object group + a relation token (flowgrpo.shapes.scene_text);
    # "words": the word-level bag-of-words encoder of the weights shipped before issue 29.
    text_encoder: str = "scene"
    # scene encoder only: group tokens carry the relation from their side (see scene_text); weights
    # whose config.json lacks the key were trained without it and load with False
    group_relation: bool = True
    # the image tokens' position code: "sincos" (SD3's table, the shipped weights) or "grid" (see
    # grid_position_code); weights whose config.json lacks the key have SD3's table
    position_code: str = "sincos"
    # a learned attention bias per head between image cells by their row and column offset
    # (flowgrpo.shapes.cell_bias); weights whose config.json lacks the key were trained without it
    cell_offset_bias: bool = False
    # scene encoder only: a count token per group beside its colour-shape token (see scene_text);
    # weights whose config.json lacks the key were trained without them
    count_tokens: bool = False

    def __post_init__(self):
        if self.text_encoder not in TEXT_ENCODERS:
            raise ValueError(f"text_encoder must be one of {TEXT_ENCODERS}, got {self.text_encoder!r}")
        if self.position_code not in POSITION_CODES:
            raise ValueError(f"position_code must be one of {POSITION_CODES}, got {self.position_code!r}")
        if self.count_tokens and self.text_encoder != "scene":
            raise ValueError("count_tokens needs the scene text encoder (text_encoder='scene')")


#: the image tokens' position codes a shapes model can have (``ShapesModelConfig.position_code``)
POSITION_CODES = ("grid", "sincos")


def grid_position_code(grid: int, dim: int, norm: float) -> Tensor:
    """A position code [grid * grid, dim] (row-major cells) whose rows and columns are told apart sharply.

    SD3's 2D sincos table is built for grids of tens of patches: on the shapes world's 4 x 4 grid its
    64 frequencies per axis barely turn, and any two cells' codes have cosine 0.80-0.98 (the shipped
    weights' table). A model that tells its own column from another's only by that small difference
    may fail to keep B off A's column; a sharp code removes that possibility (measured: it trains to
    the same accuracy and the same tie rate, docs/shapes_world.md). Here the first half
    of the dimensions codes the row and the second half the column, each position lighting its own
    block of dim / (2 grid) dimensions: cells on one row (or column) share exactly half of their code
    (cosine 0.5), other cells none (cosine 0), and "same column" is one projection. ``norm`` is each
    code's L2 norm (SD3's table has norm sqrt(dim / 2))."""
    half, block = dim // 2, dim // (2 * grid)
    if block < 1 or dim % (2 * grid):
        raise ValueError(f"a grid position code needs dim divisible by 2 * grid = {2 * grid}, got dim={dim}")
    code = torch.zeros(grid, grid, dim)
    for p in range(grid):
        code[p, :, p * block:(p + 1) * block] = 1.0  # row p
        code[:, p, half + p * block:half + (p + 1) * block] = 1.0  # column p
    return (code * norm / math.sqrt(2 * block)).reshape(grid * grid, dim)


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
            words = prompt_words(prompt)
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
        if c.text_encoder == "scene":
            self.tokenizer = SceneTokenizer(group_relation=c.group_relation, count_tokens=c.count_tokens)
            self.text_encoder = SceneTextEncoder(c.text_dim, c.text_layers, count_tokens=c.count_tokens)
        else:
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
        if c.position_code == "grid":
            table = self.transformer.pos_embed.pos_embed  # persistent buffer [1, cells, width]: saved with the weights
            table.copy_(grid_position_code(c.image_size // c.patch_size, table.shape[-1],
                                           float(table[0].norm(dim=-1).mean()))[None])
        if c.cell_offset_bias:
            install_cell_offset_bias(self.transformer, c.image_size // c.patch_size)

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Prompts -> (hidden [B, L, text_dim], pooled [B, text_dim]); L = 3 slots (scene; 5 with count tokens)
        or max_tokens (words)."""
        device = next(self.text_encoder.parameters()).device
        if self.cfg.text_encoder == "scene":
            return self.text_encoder(self.tokenizer(prompts).to(device))
        ids, mask = self.tokenizer(prompts)
        return self.text_encoder(ids.to(device), mask.to(device))

    def token_labels(self, prompt: str) -> list[str]:
        """What each of the L tokens of ``prompt`` stands for (a word, or a slot's content), so that
        the tokens of two prompts made of the same parts can be matched (the probe)."""
        if self.cfg.text_encoder == "scene":
            return SceneTokenizer.labels(prompt, self.cfg.count_tokens)
        w = ["<bos>"] + prompt.lower().replace(",", " ").split() + ["<eos>"]
        return (w + ["<pad>"] * self.cfg.max_tokens)[: self.cfg.max_tokens]

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

        directory = weights_folder(directory)
        weights = directory / "model.safetensors"
        if not weights.exists():
            raise FileNotFoundError(
                f"shapes model weights not found at {weights}; create them with "
                f"`python -m flowgrpo.shapes.pretrain --out {directory}`"
            )
        meta = loads_json((directory / "config.json").read_text())
        # weights written before the scene encoder existed carry no text_encoder key: they are "words";
        # scene weights written before group_relation existed were trained without it
        # and weights written before position_code existed have SD3's sincos table
        cfg = ShapesModelConfig(**{"text_encoder": "words", "group_relation": False, "position_code": "sincos",
                                   **meta["config"]})
        # an absurd size in config.json (num_layers: 1000000) is refused before the model is built
        check_model_folder(directory, directory / "config.json", meta["config"], lambda: cls(cfg))
        model = cls(cfg)
        model.load_state_dict(load_file(str(weights)))
        return model
