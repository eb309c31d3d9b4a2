"""What the CLIP-based reward models share: tensor preprocessing, weights on disk, batching, devices.

* :func:`clip_pixels` turns images [B, 3, H, W] in [0, 1] into a CLIP input [B, 3, S, S] on tensors:
  resize (shortest side / longest side + zero pad / squash) with antialiased bicubic or bilinear
  interpolation (``torch.nn.functional.interpolate(..., antialias=True)``, the kernel torchvision
  uses for tensors), centre crop, then ``(x - mean) / std``.
* :func:`load_state_dict_file` / :func:`load_weights` read a checkpoint and load it strictly,
  turning every failure into a one-line :class:`~flowgrpo.errors.UserError` that names the path.
* :func:`load_open_clip` builds an open_clip model from a pretrained tag or a checkpoint path.
* :class:`ClipReward` is the shared ``__call__``: chunk by ``batch_size``, preprocess, score.

Heavy libraries (open_clip, transformers) are imported inside functions only.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from flowgrpo.errors import ConfigError, UserError
from flowgrpo.images import to_uint8

from .base import RewardOutput

#: the OpenAI CLIP normalisation (also open_clip's and transformers' default)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESIZE_MODES = ("shortest", "longest", "squash")
PREPROCESS_MODES = ("tensor", "pil")
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".npz")


# --------------------------------------------------------------------------- devices and weights


def resolve_device(device: str | None) -> torch.device:
    """``None`` -> CUDA when available, else CPU; a string -> that device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def looks_like_path(value: str) -> bool:
    """True for a filesystem path (has a separator, a weights suffix, or exists) rather than a tag."""
    s = str(value)
    return os.sep in s or "/" in s or s.endswith(WEIGHT_SUFFIXES) or Path(s).exists()


def first_line(exc: BaseException, limit: int = 160) -> str:
    """``"ExcType: first line of the message"``, cut to ``limit`` characters (for one-line errors)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def existing_file(path, what: str) -> Path:
    """``path`` as a Path, or a UserError naming it when it is not a file."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_file():
        raise UserError(f"{what}: no such file {str(p)!r}")
    return p


def load_state_dict_file(path, what: str) -> dict[str, Tensor]:
    """Read a state dict from ``path`` (torch pickle or safetensors; a top-level ``"state_dict"``
    key and a DataParallel ``module.`` prefix are unwrapped). Failures -> one-line UserError."""
    p = existing_file(path, what)
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p), device="cpu")
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable, truncated, not a checkpoint, pickled objects beyond tensors
        why = ("not a torch checkpoint, or it pickles objects other than tensors" if "Weights only" in str(exc)
               else first_line(exc))
        raise UserError(f"{what}: cannot read {str(p)!r} as a weights-only checkpoint ({why})") from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, Tensor) for v in sd.values()):
        raise UserError(f"{what}: {str(p)!r} holds no state dict of tensors")
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def load_weights(module: torch.nn.Module, state_dict: dict[str, Tensor], path, what: str, assign: bool = False) -> None:
    """Strictly load ``state_dict`` into ``module``; a mismatch -> one-line UserError naming ``path``.
    ``assign``: take the tensors themselves (for a module built on the meta device, :func:`empty_model`)."""
    try:
        module.load_state_dict(state_dict, strict=True, assign=assign)
    except RuntimeError as exc:
        want, have = set(module.state_dict()), set(state_dict)
        missing, unexpected = sorted(want - have), sorted(have - want)
        detail = first_line(exc)
        if missing or unexpected:
            detail = (f"missing {len(missing)} key(s) e.g. {missing[:2]}, "
                      f"unexpected {len(unexpected)} e.g. {unexpected[:2]}")
        raise UserError(f"{what}: {str(path)!r} does not fit the model ({detail})") from None


def empty_model(factory):
    """``factory()`` with its parameters on the meta device (no memory, no random init; buffers stay
    real), for a large model whose every parameter a state dict then supplies (``load_weights(...,
    assign=True)``)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return factory()


@contextlib.contextmanager
def _quiet_random_init_warning():
    """Drop open_clip's root-logger warning "No pretrained weights loaded ..." for a moment."""
    class _Drop(logging.Filter):
        def filter(self, record):
            return not str(record.msg).startswith("No pretrained weights loaded")

    root, drop = logging.getLogger(), _Drop()
    root.addFilter(drop)
    try:
        yield
    finally:
        root.removeFilter(drop)


def load_open_clip(model_name: str, pretrained: str | None, device: torch.device, quick_gelu: bool | None = None,
                   what: str = "open_clip model"):
    """An eval-mode open_clip model and its tokenizer.

    ``pretrained``: a tag of ``open_clip.list_pretrained()`` (downloaded to / read from the hub
    cache), a checkpoint path (loaded strictly into ``create_model(model_name, pretrained=None)``)
    or None (random weights). ``quick_gelu`` None: as the tag's config says (True for "openai").
    Returns ``(model, tokenizer)``.
    """
    import open_clip

    if model_name not in open_clip.list_models():
        raise UserError(f"{what}: unknown open_clip architecture {model_name!r} "
                        f"(see open_clip.list_models(), or register a config with open_clip.add_model_config)")
    is_path = pretrained is not None and looks_like_path(pretrained)
    tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained) if pretrained and not is_path else {}
    if pretrained and not is_path and not tag_cfg:
        tags = open_clip.list_pretrained_tags_by_model(model_name)
        raise UserError(f"{what}: {pretrained!r} is neither a file nor a pretrained tag of {model_name!r} "
                        f"(tags: {', '.join(tags) or 'none'})")
    if quick_gelu is None:
        quick_gelu = bool(tag_cfg.get("quick_gelu", False))
    if is_path:
        sd = load_state_dict_file(pretrained, what)
        with _quiet_random_init_warning():  # open_clip warns "initialized randomly"; the weights follow
            model = open_clip.create_model(model_name, pretrained=None, force_quick_gelu=quick_gelu)
        load_weights(model, sd, pretrained, what)
    else:
        try:
            model = open_clip.create_model(model_name, pretrained=pretrained, force_quick_gelu=quick_gelu)
        except Exception as exc:
            raise UserError(f"{what}: cannot load {model_name!r} with pretrained={pretrained!r} "
                            f"(not in the hub cache while offline? {first_line(exc)})") from None
    return model.to(device).eval(), open_clip.get_tokenizer(model_name)


def open_clip_image_cfg(model) -> dict:
    """``{size, mean, std, mode, interpolation}`` of an open_clip model's eval preprocessing."""
    cfg = dict(getattr(model.visual, "preprocess_cfg", {}) or {})
    size = cfg.get("size", getattr(model.visual, "image_size", 224))
    return {"size": size, "mean": tuple(cfg.get("mean", CLIP_MEAN)), "std": tuple(cfg.get("std", CLIP_STD)),
            "mode": cfg.get("resize_mode", "shortest"), "interpolation": cfg.get("interpolation", "bicubic")}


# --------------------------------------------------------------------------- preprocessing


def _square(size) -> int:
    if isinstance(size, (tuple, list)):
        if len(set(size)) != 1:
            raise ValueError(f"only square CLIP inputs are supported, got {tuple(size)}")
        size = size[0]
    return int(size)


def resize_for_clip(images: Tensor, size, mode: str = "shortest", crop: str = "round",
                    interpolation: str = "bicubic", crop_size=None) -> Tensor:
    """Resize images [B, 3, H, W] (float) to [B, 3, C, C] (C = ``crop_size``, default S = ``size``).

    ``mode``: "shortest" (shorter side -> S, long side ``int(S * long / short)``, centre crop to C;
    crop offset ``round(d / 2)`` for ``crop="round"`` as torchvision/open_clip, ``d // 2`` for
    ``crop="floor"`` as transformers), "longest" (longer side -> S with ``round``, zero padding
    split ``d // 2`` before / rest after: HPS's ResizeMaxSize, open_clip's resize_mode "longest"),
    "squash" (both sides -> S). "longest" and "squash" need C == S.
    """
    if mode not in RESIZE_MODES:
        raise ValueError(f"resize mode {mode!r} is not one of {RESIZE_MODES}")
    s = _square(size)
    c = s if crop_size is None else _square(crop_size)
    if mode != "shortest" and c != s:
        raise ValueError(f"resize mode {mode!r} needs crop_size == size, got {c} and {s}")
    h, w = images.shape[-2:]
    if mode == "shortest":
        short, long = min(h, w), max(h, w)
        new_long = int(s * long / short)
        new = (s, new_long) if h <= w else (new_long, s)
    elif mode == "longest":
        scale = s / float(max(h, w))
        new = (round(h * scale), round(w * scale))
    else:
        new = (s, s)
    x = images
    if tuple(new) != (h, w):
        x = F.interpolate(x, size=new, mode=interpolation, align_corners=False, antialias=True)
    nh, nw = new
    if mode == "longest":
        ph, pw = s - nh, s - nw
        return F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=0.0)
    if (nh, nw) == (c, c):
        return x
    if min(nh, nw) < c:
        raise ValueError(f"cannot centre-crop {c} x {c} from {nh} x {nw}")
    offset = (lambda d: int(round(d / 2.0))) if crop == "round" else (lambda d: d // 2)
    top, left = offset(nh - c), offset(nw - c)
    return x[..., top:top + c, left:left + c]


def clip_pixels(images: Tensor, size=224, mean=CLIP_MEAN, std=CLIP_STD, mode: str = "shortest",
                crop: str = "round", interpolation: str = "bicubic", crop_size=None, clamp: bool = True) -> Tensor:
    """CLIP input [B, 3, C, C] (float32, normalised) from images [B, 3, H, W] in [0, 1]
    (see :func:`resize_for_clip` for ``size`` / ``mode`` / ``crop`` / ``crop_size``). ``clamp``
    clips the resized pixels to [0, 1] as a resize of uint8 images does (bicubic overshoots)."""
    x = resize_for_clip(images.float().clamp(0, 1), size, mode, crop, interpolation, crop_size)
    if clamp:
        x = x.clamp(0, 1)
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    sd = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / sd


def to_pil(images: Tensor) -> list:
    """Images [B, 3, H, W] in [0, 1] -> B RGB PIL images (``round(255 x)`` as uint8)."""
    from PIL import Image

    return [Image.fromarray(a, mode="RGB") for a in to_uint8(images)]


def check_images(name: str, images: Tensor, prompts: list[str]) -> None:
    """Refuse anything but images [B, 3, H, W] with one prompt each (a ValueError naming the reward)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"{name}: expected images [B, 3, H, W], got {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{name}: {images.shape[0]} images but {len(prompts)} prompts")


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{what} must be one of {', '.join(choices)}; got {value!r}")
    return value


# --------------------------------------------------------------------------- the shared __call__


class ClipReward(ABC):
    """Base of the CLIP-based rewards: subclasses set ``name``, ``device``, ``batch_size`` and
    ``preprocess`` ("tensor" | "pil") and implement :meth:`tensor_pixels`, :meth:`pil_pixels` and
    :meth:`score_pixels`; ``__call__`` chunks the batch and gathers scores and components."""

    name = "clip"
    device: torch.device
    batch_size: int = 16
    preprocess: str = "tensor"

    @abstractmethod
    def tensor_pixels(self, images: Tensor) -> Tensor:
        """Images [b, 3, H, W] in [0, 1] on ``self.device`` -> model input [b, 3, S, S]."""

    @abstractmethod
    def pil_pixels(self, pils: list) -> Tensor:
        """b PIL images -> model input [b, 3, S, S] (the library's own preprocessing)."""

    @abstractmethod
    def score_pixels(self, pixels: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """Model input [b, 3, S, S] and b prompts -> {"score": [b], component: [b], ...}."""

    def pixels(self, images: Tensor) -> Tensor:
        """Images [b, 3, H, W] in [0, 1] -> model input [b, 3, S, S] on ``self.device``."""
        if self.preprocess == "pil":
            return self.pil_pixels(to_pil(images)).to(self.device)
        return self.tensor_pixels(images.to(self.device))

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        check_images(self.name, images, prompts)
        parts: list[dict[str, Tensor]] = []
        for i in range(0, images.shape[0], self.batch_size):
            chunk = images[i:i + self.batch_size]
            out = self.score_pixels(self.pixels(chunk), list(prompts[i:i + self.batch_size]))
            parts.append({k: v.detach().float().cpu() for k, v in out.items()})
        if not parts:
            return RewardOutput(torch.zeros(0))
        merged = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        return RewardOutput(merged.pop("score"), merged)


class OpenClipReward(ClipReward):
    """A :class:`ClipReward` over an open_clip ``model`` / ``tokenizer``: preprocessing from the
    model's eval ``preprocess_cfg`` (``resize_mode`` overrides its resize mode) and cosines."""

    model = None
    tokenizer = None
    image_cfg: dict = {}
    resize_mode: str | None = None
    clamp_resized = True  # as PIL's uint8 resize (open_clip's eval transform); HPS resizes float tensors

    def tensor_pixels(self, images: Tensor) -> Tensor:
        """Images [b, 3, H, W] in [0, 1] -> [b, 3, S, S] as the model's eval preprocessing."""
        cfg = self.image_cfg
        return clip_pixels(images, cfg["size"], cfg["mean"], cfg["std"], mode=self.resize_mode or cfg["mode"],
                           interpolation="bilinear" if cfg["interpolation"] == "bilinear" else "bicubic",
                           clamp=self.clamp_resized)

    def pil_pixels(self, pils: list) -> Tensor:
        """PIL images -> [b, 3, S, S] through open_clip's own eval transform (``image_transform``)."""
        if getattr(self, "_pil_transform", None) is None:
            from open_clip import image_transform

            cfg = self.image_cfg
            self._pil_transform = image_transform(cfg["size"], is_train=False, mean=cfg["mean"], std=cfg["std"],
                                                  resize_mode=self.resize_mode or cfg["mode"],
                                                  interpolation=cfg["interpolation"])
        return torch.stack([self._pil_transform(p) for p in pils])

    def image_embeddings(self, pixels: Tensor) -> Tensor:
        """CLIP input [b, 3, S, S] -> L2-normalised image embeddings [b, D]."""
        return self.model.encode_image(pixels, normalize=True)

    def cosine(self, pixels: Tensor, prompts: list[str]) -> Tensor:
        """CLIP input [b, 3, S, S] and b prompts -> cosine of image and text embeddings [b]."""
        text = self.model.encode_text(self.tokenizer(prompts).to(self.device), normalize=True)
        return (self.image_embeddings(pixels) * text).sum(-1)


def positive_int(what: str, value) -> int:
    """``int(value)`` when it is an integer >= 1, else a ConfigError naming ``what``."""
    try:
        ok = not isinstance(value, bool) and int(value) == value and int(value) >= 1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{what} must be an integer >= 1; got {value!r}")
    return int(value)
