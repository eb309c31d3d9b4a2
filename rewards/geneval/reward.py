"""``geneval``: GenEval as a reward, scored as Flow-GRPO's reward server scores it.

Flow-GRPO trains on GenEval through a reward server: ``flow_grpo/rewards.py`` ``geneval_score``
(yifan123/flow_grpo, commit ac4c86e, lines 160-228) posts the images and each prompt's metadata to
``reward_server/gen_eval.py`` (yifan123/reward-server, commit 92ac29f), whose ``compute_geneval``
(lines 320-340) returns ``scores`` (the partial credit of ``evaluate_reward``, lines 201-264: what
``multi_score``, rewards.py lines 376-400, weights and trains on), ``strict_rewards`` (its exact-count
verdict) and ``rewards`` (the official GenEval verdict, ``evaluate``). This reward computes all three
(:func:`~flowgrpo.rewards.geneval.scorer.judge_reward_server` and
:func:`~flowgrpo.rewards.geneval.scorer.judge`) from one detector pass (:mod:`.detector`) and one
batched CLIP pass over every crop the colour rule reads (:mod:`.colour`).

Each image needs its prompt's GenEval metadata: the reward declares ``wants_metadata``, and the
trainer passes ``metadata=`` (each prompt's line of a .jsonl prompt file, e.g. GenEval's
``evaluation_metadata.jsonl`` or Flow-GRPO's ``dataset/geneval/*_metadata.jsonl`` used as
``data.prompts``). An image without metadata scores NaN.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from flowgrpo.errors import ConfigError, UserError
from flowgrpo.images import to_uint8

from ..base import RewardOutput
from ..clip_common import positive_int, resolve_device
from .colour import ColourClassifier, masked_crop
from .detector import Mask2FormerDetector, load_mask2former
from .scorer import judge, judge_reward_server, select_objects

SCORES = ("partial", "strict", "geneval")


def jpeg_round_trip(pixels: np.ndarray, quality: int) -> np.ndarray:
    """uint8 [H, W, 3] after PIL's JPEG encoding at ``quality`` and decoding (Flow-GRPO's client)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))


def colour_requests(metadata: dict, objects: dict[str, np.ndarray]) -> list[tuple[str, int]]:
    """(class, row) of every kept object the colour rules can read: the first ``count`` of a class
    whose include clause names a colour, when at least ``count`` were kept (the official rule reads
    those; the reward server's reads all kept, which are then exactly those)."""
    need = []
    for req in metadata.get("include", []):
        name, count = req["class"], req["count"]
        if "color" in req and len(objects.get(name, ())) >= count:
            need += [(name, j) for j in range(count) if (name, j) not in need]
    return need


class GenEvalReward:
    """``reward(images [B, 3, H, W] in [0, 1], prompts, metadata=[dict] * B) -> score [B]``.

    Options: ``detector`` (a transformers Mask2Former COCO-instance folder; required), ``clip_model``
    ("ViT-L-14"), ``clip_pretrained`` ("openai": a tag in the hub cache, or a checkpoint file),
    ``score`` ("partial": Flow-GRPO's trained score; "strict"; "geneval": the official 0/1 verdict),
    ``device``, ``batch_size`` (images per detector pass, crops per CLIP pass), ``max_size`` /
    ``min_size`` (the detector's input scale, mmdet's 1333 / 800), ``detector_bgr`` (false; true gives
    the detector the channels reversed, as Flow-GRPO's reward server does by handing mmdet RGB arrays
    that it reads as BGR), ``jpeg_quality`` (None; 75 scores each image after a JPEG round trip at PIL's
    default quality, as Flow-GRPO's client sends them, rewards.py lines 191-195). Components [B]:
    ``partial``, ``strict``, ``geneval`` (official correct).
    """

    name = "geneval"
    wants_metadata = True
    option_ranges = {"batch_size": {"ge": 1}, "max_size": {"ge": 32}, "min_size": {"ge": 32},
                     "jpeg_quality": {"ge": 1, "le": 95}}

    def __init__(self, detector: str, clip_model: str = "ViT-L-14", clip_pretrained: str = "openai",
                 score: str = "partial", device: str | None = None, batch_size: int = 16, max_size: int = 1333,
                 min_size: int = 800, detector_bgr: bool = False, jpeg_quality: int | None = None):
        if score not in SCORES:
            raise ConfigError(f"reward.options.geneval.score must be one of {', '.join(SCORES)}; got {score!r}")
        self.score, self.detector_bgr = score, bool(detector_bgr)
        self.jpeg_quality = None if jpeg_quality is None else int(jpeg_quality)
        self.device = resolve_device(device)
        self.batch_size = positive_int("reward.options.geneval.batch_size", batch_size)
        model = load_mask2former(detector, "reward.options.geneval.detector")
        self.detector = Mask2FormerDetector(model, self.device, image_scale=(int(max_size), int(min_size)))
        self.colours = ColourClassifier(clip_model, clip_pretrained, self.device, self.batch_size,
                                        what="reward.options.geneval.clip_pretrained")

    def detect(self, images: Tensor) -> list:
        """The detector's per-image results for images [B, 3, H, W], ``batch_size`` at a time."""
        x = images.flip(1) if self.detector_bgr else images
        return [d for i in range(0, len(x), self.batch_size) for d in self.detector(x[i:i + self.batch_size])]

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None, *,
                 metadata: list | None = None) -> RewardOutput:
        if metadata is None:
            raise UserError("reward 'geneval' needs each prompt's GenEval metadata: train on a .jsonl prompt file "
                            "whose lines carry 'tag' and 'include' (e.g. GenEval's evaluation_metadata.jsonl)")
        if images.ndim != 4 or len(metadata) != images.shape[0]:
            raise ValueError(f"geneval: {len(metadata)} metadata for images {tuple(images.shape)}")
        pixels = to_uint8(images)
        if self.jpeg_quality is not None:
            pixels = np.stack([jpeg_round_trip(p, self.jpeg_quality) for p in pixels])
            images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255
        found = self.detect(images)
        kept, crops, keys = [], [], []
        for i, (det, meta) in enumerate(zip(found, metadata)):
            if not isinstance(meta, dict) or "tag" not in meta:
                kept.append(None)
                continue
            sel = select_objects(det.rows, meta["tag"])
            objects = {c: det.rows[c][idx] for c, idx in sel.items()}
            kept.append(objects)
            for name, j in colour_requests(meta, objects):
                crops.append(masked_crop(pixels[i], objects[name][j], det.masks[name][sel[name][j]]))
                keys.append((i, name, j))
        named = dict(zip(keys, self.colours(crops, [k[1] for k in keys])))
        nan = float("nan")
        out = {k: [] for k in SCORES}
        for i, (objects, meta) in enumerate(zip(kept, metadata)):
            if objects is None:
                for k in SCORES:
                    out[k].append(nan)
                continue

            def colour_of(name, rows, i=i):
                return [named[(i, name, j)] for j in range(len(rows))]

            server = judge_reward_server(meta, objects, colour_of)
            out["partial"].append(server.score)
            out["strict"].append(float(server.strict))
            out["geneval"].append(float(judge(meta, objects, colour_of)[0]))
        comps = {k: torch.tensor(v, dtype=torch.float32) for k, v in out.items()}
        return RewardOutput(comps[self.score], comps)
