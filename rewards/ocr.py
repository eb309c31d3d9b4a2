"""OCR text-rendering reward (Flow-GRPO): does the image show the text quoted in the prompt?

The target is the quoted text of the prompt (``A sign that says "Hello World"`` -> ``Hello World``).
The image is read with RapidOCR (PP-OCRv4 detection + recognition as ONNX models shipped inside the
``rapidocr-onnxruntime`` wheel: no download) and scored by Flow-GRPO's edit-distance rule
(:func:`ocr_text_score`).
"""

from __future__ import annotations

import logging
import math
import re
import unicodedata

import numpy as np
import torch
from torch import Tensor

from flowgrpo.errors import UserError
from flowgrpo.images import to_uint8

from .base import RewardOutput

log = logging.getLogger(__name__)

# Straight and typographic double quotes pair with each other (“Hello" counts).
_DQ = "\"\u201c\u201d\u201e\u201f"
_DOUBLE_QUOTED = re.compile(f"[{_DQ}]([^{_DQ}]*)[{_DQ}]")
# Single quotes only as a fallback and only at word edges, so apostrophes (cat's, Joe’s) never open
# or close a span: the opening quote follows the start or whitespace/bracket, the closing one is
# followed by the end, whitespace or punctuation.
_SINGLE_QUOTED = re.compile(r"(?<![^\s(\[])['\u2018](.+?)['\u2019](?=$|[\s.,;:!?)\]])")


def quoted_text(prompt: str) -> str | None:
    """The target text of ``prompt``: its quoted spans joined with a space, or None without any.

    Double quotes (straight or curly) are used when the prompt has a closed pair of them; otherwise
    single quotes (straight or curly) at word edges. Empty or blank spans are ignored.
    """
    spans = [s for s in _DOUBLE_QUOTED.findall(prompt) if s.strip()]
    if not spans:
        spans = [s for s in _SINGLE_QUOTED.findall(prompt) if s.strip()]
    return " ".join(s.strip() for s in spans) if spans else None


def normalize_text(text: str, case_sensitive: bool = False) -> str:
    """Flow-GRPO's normalisation: drop every space, lower-case (unless ``case_sensitive``).

    Also NFKC-folds the text so that full-width forms the Chinese/English PP-OCRv4 recogniser may
    emit (``！``, ``Ａ``) compare equal to their ASCII forms; other punctuation is kept and counts.
    """
    text = re.sub(r"\s+", "", unicodedata.normalize("NFKC", text))
    return text if case_sensitive else text.lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (unit-cost insertions, deletions, substitutions) between ``a`` and ``b``."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_text_score(target: str, recognized: str, case_sensitive: bool = False) -> tuple[float, int]:
    """Flow-GRPO's OCR reward of ``recognized`` text against ``target``. Returns (score, distance).

    With ``t`` and ``r`` the normalised strings (:func:`normalize_text`)::

        d = 0                      if t is a substring of r (extra text around the target is free)
        d = levenshtein(r, t)      otherwise
        d = min(d, len(t))         (many unrelated characters cost no more than none at all)
        score = 1 - d / len(t)     in [0, 1]; 1 = the target was read exactly

    ``score`` is NaN (and ``d`` -1) when ``t`` is empty.
    """
    t = normalize_text(target, case_sensitive)
    r = normalize_text(recognized, case_sensitive)
    if not t:
        return math.nan, -1
    d = 0 if t in r else min(levenshtein(r, t), len(t))
    return 1.0 - d / len(t), d


def to_bgr_uint8(images: Tensor) -> np.ndarray:
    """Images [B, 3, H, W] RGB float in [0, 1] -> uint8 [B, H, W, 3] in BGR order.

    RapidOCR (cv2 underneath) passes a 3-channel numpy array through unchanged as BGR; only file
    paths, bytes and PIL images are converted from RGB. So numpy input must be BGR.
    """
    return np.ascontiguousarray(to_uint8(images)[..., ::-1])


class OCRReward:
    """Flow-GRPO's text-rendering reward: 1 - (clamped) edit distance / target length.

    Scores [B] float32 in [0, 1] (:func:`ocr_text_score`), NaN for a prompt without quoted text
    (``ocr_no_target`` = 1) and for an image whose OCR raised (``ocr_failed`` = 1): the trainer drops
    NaN samples. Components [B]: ``ocr_edit_distance`` (the clamped ``d``), ``ocr_target_chars``,
    ``ocr_recognized_chars`` (normalised lengths), ``ocr_no_target``, ``ocr_failed``.

    Options: ``min_confidence`` keeps recognised boxes with confidence >= it (0.5: PaddleOCR's
    ``drop_score`` default, under which Flow-GRPO's scorer ran, and RapidOCR's ``text_score``);
    ``case_sensitive`` (False, as Flow-GRPO); ``use_cls`` runs the 180-degree text-direction
    classifier (False, as Flow-GRPO); ``threads`` onnxruntime intra-op threads (-1: its default).
    """

    name = "ocr"

    def __init__(self, min_confidence: float = 0.5, case_sensitive: bool = False, use_cls: bool = False,
                 threads: int = -1):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as exc:  # pragma: no cover - the rewards/test extras install it
            raise UserError("reward 'ocr' needs rapidocr-onnxruntime: pip install 'flowgrpo[rewards]'") from exc
        self.min_confidence = float(min_confidence)
        self.case_sensitive = bool(case_sensitive)
        self.engine = RapidOCR(text_score=self.min_confidence, use_cls=bool(use_cls),
                               intra_op_num_threads=int(threads), print_verbose=False)

    def read(self, image_bgr: np.ndarray) -> list[tuple[str, float]]:
        """Text boxes of one uint8 [H, W, 3] BGR image in reading order (top to bottom, then left
        to right, as RapidOCR sorts them): [(text, confidence)], boxes below ``min_confidence`` dropped."""
        result, _ = self.engine(image_bgr)
        return [(str(r[1]), float(r[2])) for r in (result or []) if float(r[2]) >= self.min_confidence]

    def recognize(self, image_bgr: np.ndarray) -> str:
        """The recognised text of one uint8 [H, W, 3] BGR image, boxes joined with a space."""
        return " ".join(text for text, _ in self.read(image_bgr))

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        if images.shape[0] != len(prompts):
            raise ValueError(f"ocr reward: {images.shape[0]} images but {len(prompts)} prompts")
        arr = to_bgr_uint8(images)
        n = len(prompts)
        scores, dist = np.full(n, np.nan), np.full(n, np.nan)
        t_len, r_len = np.full(n, np.nan), np.full(n, np.nan)
        no_target, failed = np.zeros(n), np.zeros(n)
        for i, prompt in enumerate(prompts):
            target = quoted_text(prompt)
            if target is None or not normalize_text(target, self.case_sensitive):
                no_target[i] = 1.0
                continue
            try:
                text = self.recognize(arr[i])
            except Exception as exc:  # one unreadable image must not sink the batch
                log.warning("ocr reward: OCR failed on sample %d (%s: %s); scored NaN", i, type(exc).__name__, exc)
                failed[i] = 1.0
                continue
            scores[i], dist[i] = ocr_text_score(target, text, self.case_sensitive)
            t_len[i] = len(normalize_text(target, self.case_sensitive))
            r_len[i] = len(normalize_text(text, self.case_sensitive))

        def f32(x):
            return torch.from_numpy(x.astype(np.float32))

        return RewardOutput(f32(scores), {"ocr_edit_distance": f32(dist), "ocr_target_chars": f32(t_len),
                                          "ocr_recognized_chars": f32(r_len), "ocr_no_target": f32(no_target),
                                          "ocr_failed": f32(failed)})
