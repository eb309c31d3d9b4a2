"""HPS v2 / v2.1 (Human Preference Score): an open_clip ViT-H-14 fine-tuned on human preferences.

Score as the HPS authors' ``hpsv2.score``: L2-normalised image and text features of the fine-tuned
CLIP, ``diag(image_features @ text_features.T)`` — the raw cosine, not multiplied by the logit
scale (typical values 0.2-0.35). The checkpoint (``HPS_v2.1_compressed.pt`` or
``HPS_v2_compressed.pt`` from the HF hub repo ``xswu/HPSv2``) is a state dict, possibly under a
``"state_dict"`` key, for ``open_clip.create_model("ViT-H-14", pretrained=None)``.

Preprocessing (tensor path, on the reward's device): the authors build their eval transform with
``light_augmentation=True``, i.e. ``ResizeMaxSize``: ToTensor, resize the LONGER side to 224
(bicubic, on the float tensor), zero-pad to 224 x 224 (black before normalisation), CLIP mean/std.
That is what ``resize_mode="longest"`` (the default) does, with antialiasing (torchvision >= 0.17's
default for tensors; older torchvision resized tensors without it). Square images, the usual case,
are simply resized. Differences: no uint8 rounding of the input (the authors read saved images), and
a non-square image whose longer side is already 224 is padded here (theirs would not be).
"""

from __future__ import annotations

from torch import Tensor

from .clip_common import (RESIZE_MODES, OpenClipReward, check_choice, existing_file, load_open_clip,
                          open_clip_image_cfg, positive_int, resolve_device)


class HPSv2Reward(OpenClipReward):
    """HPS v2 / v2.1: ``reward(images [B, 3, H, W] in [0, 1], prompts [B]) -> scores [B]`` (cosine).

    Options: ``checkpoint`` (path to ``HPS_v2.1_compressed.pt`` / ``HPS_v2_compressed.pt``; required),
    ``model_name`` (open_clip architecture, "ViT-H-14"), ``device`` (default CUDA if available),
    ``batch_size`` (images per forward), ``resize_mode`` ("longest": the authors' resize + pad;
    "shortest": resize + centre crop; "squash").
    """

    name = "hpsv2"
    clamp_resized = False  # the authors resize the float tensor (ToTensor first): no uint8 saturation

    def __init__(self, checkpoint: str, model_name: str = "ViT-H-14", device: str | None = None,
                 batch_size: int = 16, resize_mode: str = "longest"):
        self.device = resolve_device(device)
        self.batch_size = positive_int("hpsv2 batch_size", batch_size)
        self.resize_mode = check_choice("hpsv2 resize_mode", resize_mode, RESIZE_MODES)
        path = existing_file(checkpoint, "hpsv2 checkpoint")
        self.model, self.tokenizer = load_open_clip(model_name, str(path), self.device, quick_gelu=False,
                                                    what="hpsv2 checkpoint")
        self.image_cfg = open_clip_image_cfg(self.model)

    def score_pixels(self, pixels: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """CLIP input [b, 3, S, S] and b prompts -> {"score": cosine [b]} (HPS: no logit scale)."""
        return {"score": self.cosine(pixels, prompts)}
