"""GenEval's object detector without mmcv: a transformers Mask2Former run as mmdet 2.x runs GenEval's.

GenEval detects with mmdet's ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco`` (instance segmentation
on the 80 COCO classes). :class:`Mask2FormerDetector` runs any transformers
``Mask2FormerForUniversalSegmentation`` with 80 labels in COCO's order (e.g. the Swin-S COCO-instance
conversion of the Mask2Former authors' checkpoint, ``facebook/mask2former-swin-small-coco-instance``:
the same architecture, trained by the authors in Detectron2 rather than by mmdet, so its boxes and
scores differ) through mmdet 2.x's test pipeline and ``MaskFormerFusionHead.instance_postprocess``:

* **Input** (the config's test pipeline): each image as uint8 (``round(255 x)``, what a saved PNG
  holds), resized keeping its aspect ratio to fit 1333 x 800 (scale ``min(1333 / long, 800 /
  short)``, sides ``int(side * scale + 0.5)``, bilinear without antialiasing as cv2's
  ``INTER_LINEAR``, rounded back to uint8), normalised with ImageNet's mean and std in 0-255 units,
  zero-padded at the right and bottom to multiples of 32.
* **Output**: the last decoder layer's class logits [Q, 81] and mask logits [Q, h / 4, w / 4]; masks
  upsampled (bilinear, ``align_corners=False``) to the padded input, cropped to the resized image,
  upsampled again to the original size; the softmax over the 80 classes (the "no object" logit
  dropped) flattened over queries x classes, its ``max_per_image`` (100) largest kept (unsorted, as
  mmdet's ``topk(sorted=False)``); the mask of each is its query's logits > 0, its score the class
  probability x the mean sigmoid inside that mask; its box the mask's extent (x2, y2 one past the
  last pixel; all zeros for an empty mask, mmdet's ``mask2bbox``).

Per image the result is GenEval's: class name -> rows [N, 5] float32 (x1, y1, x2, y2, score) and
masks [N, H, W] bool, ready for :func:`flowgrpo.rewards.geneval.evaluate_detections`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from flowgrpo.errors import UserError

from ..clip_common import first_line

#: GenEval's ``object_names.txt``: the 80 COCO classes in COCO's contiguous order, spelled as GenEval does
OBJECT_NAMES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote",
    "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock",
    "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)
#: mmdet's ``img_norm_cfg`` of the config (RGB, 0-255 units)
PIXEL_MEAN = (123.675, 116.28, 103.53)
PIXEL_STD = (58.395, 57.12, 57.375)
#: the test pipeline's ``img_scale``: the long side fits 1333, the short side 800
IMAGE_SCALE = (1333, 800)


@dataclass
class ImageDetections:
    """One image's detections: class name -> rows [N, 5] float32 (x1, y1, x2, y2 in pixels, score) and
    masks [N, H, W] bool at the image's size, row i of one class with mask i. Classes without rows are absent."""

    rows: dict[str, np.ndarray]
    masks: dict[str, np.ndarray]


def resized_size(height: int, width: int, scale: tuple[int, int] = IMAGE_SCALE) -> tuple[int, int]:
    """mmcv's ``rescale_size`` with ``keep_ratio``: (h, w) scaled to fit ``scale`` (long, short)."""
    factor = min(max(scale) / max(height, width), min(scale) / min(height, width))
    return int(height * factor + 0.5), int(width * factor + 0.5)


def mask_boxes(masks: Tensor) -> Tensor:
    """mmdet's ``mask2bbox``: boxes [N, 4] float32 of masks [N, H, W] bool (x2, y2 one past the last
    pixel; zeros for an empty mask)."""
    n, h, w = masks.shape
    cols, rows = masks.any(dim=1), masks.any(dim=2)  # [N, W], [N, H]
    xs = torch.arange(w, device=masks.device)
    ys = torch.arange(h, device=masks.device)
    big = max(h, w) + 1
    x1 = torch.where(cols, xs, big).min(dim=1).values
    x2 = torch.where(cols, xs, -1).max(dim=1).values + 1
    y1 = torch.where(rows, ys, big).min(dim=1).values
    y2 = torch.where(rows, ys, -1).max(dim=1).values + 1
    boxes = torch.stack([x1, y1, x2, y2], dim=1).float()
    empty = ~(cols.any(dim=1) & rows.any(dim=1))
    return torch.where(empty[:, None], torch.zeros_like(boxes), boxes)


def load_mask2former(path, what: str = "reward.options.geneval.detector"):
    """An eval-mode ``Mask2FormerForUniversalSegmentation`` from a local folder, with 80 COCO labels.
    A missing folder, an unreadable one or another label count is a one-line UserError naming ``what``."""
    from transformers import Mask2FormerForUniversalSegmentation

    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise UserError(f"{what}: no such folder {str(folder)!r} (a transformers Mask2Former COCO-instance "
                        "checkpoint folder, e.g. facebook/mask2former-swin-small-coco-instance downloaded)")
    try:
        model = Mask2FormerForUniversalSegmentation.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - any loading failure is one line naming the folder
        raise UserError(f"{what}: cannot load a Mask2Former from {str(folder)!r} ({first_line(exc)})") from None
    if model.config.num_labels != len(OBJECT_NAMES):
        raise UserError(f"{what}: {str(folder)!r} has {model.config.num_labels} labels; GenEval needs the 80 COCO "
                        "classes (a COCO instance-segmentation checkpoint)")
    return model.eval()


class Mask2FormerDetector:
    """``detector(images [B, 3, H, W] in [0, 1]) -> B ImageDetections`` (module docstring).

    Args:
        model: a ``Mask2FormerForUniversalSegmentation`` with 80 labels in COCO's order.
        device: where it runs. ``max_per_image``: detections kept per image (mmdet's 100).
        image_scale: (long, short) the input is resized to fit (mmdet's (1333, 800); tests use small ones).
    """

    def __init__(self, model, device: torch.device, max_per_image: int = 100,
                 image_scale: tuple[int, int] = IMAGE_SCALE):
        self.model = model.to(device).eval()
        self.device = device
        self.max_per_image = int(max_per_image)
        self.image_scale = tuple(int(s) for s in image_scale)

    def pixels(self, images: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Images [B, 3, H, W] in [0, 1] -> the model input [B, 3, H', W'] (padded to 32) and the
        resized size (h, w) before padding."""
        x = (images.float().clamp(0, 1) * 255).round()
        h, w = resized_size(x.shape[-2], x.shape[-1], self.image_scale)
        if (h, w) != tuple(x.shape[-2:]):
            x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False).round().clamp(0, 255)
        mean = torch.tensor(PIXEL_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(PIXEL_STD, device=x.device).view(1, 3, 1, 1)
        x = (x - mean) / std
        ph, pw = -h % 32, -w % 32
        return F.pad(x, (0, pw, 0, ph), value=0.0), (h, w)

    def postprocess(self, class_logits: Tensor, mask_logits: Tensor, padded: tuple[int, int],
                    resized: tuple[int, int], size: tuple[int, int]) -> ImageDetections:
        """One image's class logits [Q, C + 1] and mask logits [Q, h, w] -> its detections at ``size``."""
        masks = F.interpolate(mask_logits[None].float(), size=padded, mode="bilinear", align_corners=False)[0]
        masks = masks[:, :resized[0], :resized[1]]
        masks = F.interpolate(masks[None], size=size, mode="bilinear", align_corners=False)[0]
        scores = class_logits.float().softmax(dim=-1)[:, :-1]
        n_cls = scores.shape[1]
        top, idx = scores.flatten().topk(min(self.max_per_image, scores.numel()), sorted=False)
        labels, queries = idx % n_cls, torch.div(idx, n_cls, rounding_mode="floor")
        logits = masks[queries]
        binary = logits > 0
        mask_score = (logits.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
        rows = torch.cat([mask_boxes(binary), (top * mask_score)[:, None]], dim=1).cpu().numpy()
        labels, binary = labels.cpu().numpy(), binary.cpu().numpy()
        out_rows, out_masks = {}, {}
        for k in np.unique(labels):
            sel = labels == k
            out_rows[OBJECT_NAMES[k]], out_masks[OBJECT_NAMES[k]] = rows[sel].astype(np.float32), binary[sel]
        return ImageDetections(out_rows, out_masks)

    @torch.no_grad()
    def __call__(self, images: Tensor) -> list[ImageDetections]:
        """Detections of each image of a batch [B, 3, H, W] in [0, 1] (one size)."""
        x, resized = self.pixels(images.to(self.device))
        out = self.model(pixel_values=x)
        size = tuple(images.shape[-2:])
        return [self.postprocess(c, m, tuple(x.shape[-2:]), resized, size)
                for c, m in zip(out.class_queries_logits, out.masks_queries_logits)]
