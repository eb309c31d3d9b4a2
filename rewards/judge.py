"""VLM judges at an OpenAI-compatible endpoint: a pointwise score and Pref-GRPO pairwise win rates.

``judge`` (:class:`PointwiseJudgeReward`) asks the model to rate each image against its prompt and
parses the answer (``parser="score_0_10"``: "Score: N" scaled to [0, 1], on the scale the answer
states if it states one, "4/5"; ``"yes_no"``: 1 / 0; ``"unifiedreward"``: UnifiedReward's question
and "Final Score: N" / 5, also registered as the reward ``unifiedreward``, :class:`UnifiedRewardJudge`).
``judge_pairwise`` (:class:`PairwiseJudgeReward`) asks which of two images of one group follows
the prompt better (UnifiedReward-Think style: "Image 1 is better") and feeds
:func:`~flowgrpo.rewards.pairwise.win_rates`.

Images travel as base64 PNG data URLs in ``image_url`` parts. Answers are cached in memory (LRU of
``cache_size`` entries) by (template id, prompt, sha256 of each PNG), so an identical question is
never asked twice. A request that still fails after ``retries`` (transport error, timeout, 429/5xx,
unparseable answer) drops its sample: the score is NaN (the trainer drops and counts it), the
``judge_failed`` component is 1 for it, and a warning shows the truncated last answer.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import re
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import Tensor

from flowgrpo.errors import ConfigError
from flowgrpo.images import png_bytes

from .base import RewardOutput
from .http_client import DEFAULT_MAX_RESPONSE_MB
from .openai_client import ChatClient
from .pairwise import PairwiseJudgeBase, PairwiseReward, parse_verdict

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"

SCORE_TEMPLATE = (
    'This image was generated from the prompt:\n"{prompt}"\n\n'
    "Rate how faithfully the image follows the prompt: the objects it names, their number, colors, "
    "attributes, positions and any written text. Judge alignment with the prompt, not beauty. "
    "1 means unrelated to the prompt, 10 means every detail is right. Think briefly, then end with "
    'a last line of the form "Score: N", where N is an integer from 1 to 10.'
)
YES_NO_TEMPLATE = (
    'This image was generated from the prompt:\n"{prompt}"\n\n'
    "Does the image show everything the prompt asks for? Answer with one word: Yes or No."
)
PAIRWISE_TEMPLATE = (
    'Both images were generated from the prompt:\n"{prompt}"\n\n'
    "Compare Image 1 (shown first) with Image 2 (shown second). Weigh first how closely each follows "
    "the prompt (objects, counts, colors, attributes, spatial layout, text), then visual quality and "
    "plausibility. Reason step by step inside <think></think>, then give the verdict inside "
    '<answer></answer> as exactly "Image 1 is better" or "Image 2 is better".'
)


#: UnifiedReward's pointwise question for a generated image (CodeGoat24/UnifiedReward,
#: ``inference_qwen/image_generation/qwen_point_score_image_generation.py``), character for character;
#: the image is sent before it, as there
UNIFIEDREWARD_TEMPLATE = (
    'You are given a text caption and a generated image based on that caption. Your task is to '
    'evaluate this image based on two key criteria:\n'
    '1. Alignment with the Caption: Assess how well this image aligns with the provided caption. '
    'Consider the accuracy of depicted objects, their relationships, and attributes as described in '
    'the caption.\n'
    '2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail '
    'preservation, color accuracy, and overall aesthetic appeal.\n'
    'Extract key elements from the provided text caption, evaluate their presence in the generated '
    "image using the format: 'element (type): value' (where value=0 means not generated, and value=1 "
    "means generated), and assign a score from 1 to 5 after 'Final Score:'.\n"
    'Your task is provided as follows:\n'
    'Text Caption: [{prompt}]'
)


# --------------------------------------------------------------------------- answers


def answer_part(text: str) -> str | None:
    """The part of a model's answer to parse: the last ``<answer>...</answer>`` if present, else the
    text without ``<think>...</think>`` blocks; None when a think block never closes (cut off)."""
    if not isinstance(text, str):
        return None
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S | re.I)
    if tagged:
        return tagged[-1].strip()
    body = re.sub(r"<think>.*?</think>", " ", text, flags=re.S | re.I)
    if re.search(r"<think>", body, flags=re.I):
        return None
    return body.strip()


#: a number and the scale the answer states for it, if any: "4/5", "4 / 5", "4 out of 5" (groups 1, 2)
_SCORED = r"(\d+(?:\.\d+)?)(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?"


def parse_score_0_10(text: str) -> float | None:
    """"Score: N" (the last such line wins; "Rating: N" and a bare number also work) -> N / 10, N in [0, 10].

    A scale the answer states is the one read: "Score: 4/5" and "4 out of 5" are 0.8, "8/10" is 0.8.
    Reading "4/5" as 4 on the asked-for 1 to 10 scale (0.4) would score a judge that answers on its own
    scale silently wrong. A number above its scale, or a scale of 0, is unparseable (None)."""
    part = answer_part(text)
    if not part:
        return None
    found = re.findall(r"(?:score|rating)\s*(?:is)?\s*[:=]?\s*\**\s*" + _SCORED, part, flags=re.I)
    if not found:
        found = re.findall(r"^\s*\**" + _SCORED + r"\**\s*\.?\s*$", part, flags=re.I)
    if not found:
        return None
    value, scale = float(found[-1][0]), float(found[-1][1] or 10.0)
    return value / scale if scale > 0 and 0.0 <= value <= scale else None


def parse_yes_no(text: str) -> float | None:
    """"Yes..." -> 1.0, "No..." -> 0.0; None when both or neither word appears."""
    part = answer_part(text)
    if not part:
        return None
    words = set(re.findall(r"\b(yes|no)\b", part.lower()))
    if len(words) != 1:
        return None
    return 1.0 if words == {"yes"} else 0.0


def parse_pairwise(text: str) -> str | None:
    """"Image 1 is better" -> "a", "Image 2 is better" -> "b", else :func:`parse_verdict` of the
    answer part (or of its last line); None when unreadable or contradictory."""
    part = answer_part(text)
    if not part:
        return None
    better = set(re.findall(r"image\s*([12ab])\s+is\s+(?:better|preferred|superior)", part.lower()))
    if len(better) == 1:
        return "a" if better.pop() in "1a" else "b"
    if better:
        return None
    verdict = parse_verdict(part)
    if verdict is None:
        lines = [ln for ln in part.splitlines() if ln.strip()]
        verdict = parse_verdict(lines[-1]) if len(lines) > 1 else None
    return verdict


def parse_final_score(text: str) -> float | None:
    """UnifiedReward's reading of its answer (``DiffusionDPO/sift_dpo_data.py``: the text after the last
    "Final Score:", its first run of digits) on the 1 to 5 scale, divided by 5 as Flow-GRPO does -> 0.2 .. 1.0.
    None (unparseable) when "Final Score:" is absent or the number is outside 1..5, where the repository reads 0."""
    part = answer_part(text)
    if not part or "Final Score:" not in part:
        return None
    digits = re.findall(r"\d+", part.split("Final Score:")[-1])
    value = int(digits[0]) if digits else 0
    return value / 5.0 if 1 <= value <= 5 else None


PARSERS: dict[str, Callable[[str], Any]] = {"score_0_10": parse_score_0_10, "yes_no": parse_yes_no,
                                            "unifiedreward": parse_final_score}
DEFAULT_TEMPLATES = {"score_0_10": SCORE_TEMPLATE, "yes_no": YES_NO_TEMPLATE, "unifiedreward": UNIFIEDREWARD_TEMPLATE}


# --------------------------------------------------------------------------- images and the cache


def image_part(png: bytes) -> dict:
    """An ``image_url`` content part carrying ``png`` as a base64 data URL."""
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


class LRUCache:
    """A bounded mapping that forgets the least recently used entry first (``size`` 0: no caching)."""

    def __init__(self, size: int):
        self.size = max(0, int(size))
        self._data: OrderedDict = OrderedDict()

    def get(self, key):
        if key in self._data:
            self._data.move_to_end(key)
            return self._data[key]
        return None

    def put(self, key, value) -> None:
        if self.size == 0:
            return
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


class JudgeCore:
    """Template, client and cache shared by the judges: :meth:`ask` answers many questions at once."""

    def __init__(self, kind: str, template: str, parse: Callable[[str], Any], options: dict):
        if "{prompt}" not in template:
            raise ConfigError(f"judge template must contain the placeholder {{prompt}}: {template[:80]!r}")
        cache_size = options.pop("cache_size")
        self.client = ChatClient(**options)
        self.template, self.parse = template, parse
        self.template_id = hashlib.sha256(f"{kind}\n{self.client.model}\n{template}".encode()).hexdigest()[:16]
        self.cache = LRUCache(cache_size)
        self.cache_hits = 0

    @property
    def stats(self) -> dict:
        """Client counters (requests sent, retries, failed, ...) plus ``cache_hits``."""
        return {**self.client.stats, "cache_hits": self.cache_hits}

    def messages(self, prompt: str, pngs: list[bytes]) -> list[dict]:
        """The chat messages of one question: the images, then the filled template."""
        text = self.template.replace("{prompt}", prompt)
        return [{"role": "user", "content": [*map(image_part, pngs), {"type": "text", "text": text}]}]

    def ask(self, questions: list[tuple[str, list[bytes]]]) -> list[Any]:
        """Parsed answers (None: dropped after retries) to (prompt, PNGs) questions, in order."""
        results: list[Any] = [None] * len(questions)
        todo: dict[tuple, list[int]] = {}
        for i, (prompt, pngs) in enumerate(questions):
            key = (self.template_id, prompt, *(hashlib.sha256(p).hexdigest() for p in pngs))
            hit = self.cache.get(key)
            if hit is not None:
                results[i] = hit
                self.cache_hits += 1
            else:
                todo.setdefault(key, []).append(i)
        keys = list(todo)
        outcomes = self.client.complete([self.messages(*questions[todo[k][0]]) for k in keys], self.parse)
        for key, out in zip(keys, outcomes):
            if out.value is not None:
                self.cache.put(key, out.value)
            else:
                answer = out.answer if out.answer is None else out.answer[:200]
                log.warning("judge dropped %d sample(s) for prompt %r after %d attempt(s) (%s); last answer: %r",
                            len(todo[key]), key[1][:80], out.attempts, out.error, answer)
            for i in todo[key]:
                results[i] = out.value
        return results

    def close(self) -> None:
        """Release the HTTP connections and the client's loop thread."""
        self.client.close()


def _client_options(base_url, model, api_key_env, max_concurrency, timeout, retries, backoff, temperature,
                    max_tokens, cache_size, max_response_mb) -> dict:
    return dict(base_url=base_url, model=model, api_key_env=api_key_env, max_concurrency=max_concurrency,
                timeout=timeout, retries=retries, backoff=backoff, temperature=temperature,
                max_tokens=max_tokens, cache_size=cache_size, max_response_mb=max_response_mb)


# --------------------------------------------------------------------------- the rewards


class PointwiseJudgeReward:
    """Reward = the judge's rating of each image against its prompt, in [0, 1] (NaN: dropped).

    Options: ``model`` (required), ``base_url`` (API root, ``{base_url}/chat/completions`` is
    called), ``api_key_env`` (name of the env var holding the key), ``template`` (with
    ``{prompt}``; default per parser), ``parser`` ("score_0_10" or "yes_no"), ``max_concurrency``,
    ``timeout`` (s per attempt, the whole exchange), ``retries``, ``backoff`` (s), ``temperature``,
    ``max_tokens``, ``cache_size``, ``max_response_mb`` (the largest answer read, MiB after
    decompression; a larger one stops the run). Component ``judge_failed``: 1 for a dropped sample.
    """

    name = "judge"

    def __init__(self, model: str, base_url: str = DEFAULT_BASE_URL, api_key_env: str | None = None,
                 template: str | None = None, parser: str = "score_0_10", max_concurrency: int = 8,
                 timeout: float = 60.0, retries: int = 2, backoff: float = 0.5, temperature: float = 0.0,
                 max_tokens: int = 512, cache_size: int = 4096, max_response_mb: float = DEFAULT_MAX_RESPONSE_MB):
        if parser not in PARSERS:
            raise ConfigError(f"unknown judge parser {parser!r}; valid: {', '.join(PARSERS)}")
        opts = _client_options(base_url, model, api_key_env, max_concurrency, timeout, retries, backoff,
                               temperature, max_tokens, cache_size, max_response_mb)
        self.core = JudgeCore(f"pointwise:{parser}", template or DEFAULT_TEMPLATES[parser], PARSERS[parser], opts)

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        """Rate every image; ``groups`` is ignored."""
        if images.shape[0] != len(prompts):
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        answers = self.core.ask([(p, [png_bytes(img)]) for p, img in zip(prompts, images)])
        scores = torch.tensor([float("nan") if a is None else float(a) for a in answers], dtype=torch.float32)
        return RewardOutput(scores, {"judge_failed": torch.isnan(scores).float()})

    def close(self) -> None:
        """Release the HTTP client."""
        self.core.close()


class UnifiedRewardJudge(PointwiseJudgeReward):
    """UnifiedReward's pointwise score of each image (Wang et al. 2025): :class:`PointwiseJudgeReward` with
    UnifiedReward's question and its "Final Score:" reading (``parser="unifiedreward"``), N / 5 in
    [0.2, 1] (NaN: dropped). ``model``: the name the server gives the UnifiedReward checkpoint
    (the repository's vLLM script serves it as "UnifiedReward")."""

    name = "unifiedreward"
    __init__ = functools.partialmethod(PointwiseJudgeReward.__init__, parser="unifiedreward")


class HTTPPairwiseJudge(PairwiseJudgeBase):
    """A :class:`~flowgrpo.rewards.pairwise.PairwiseJudge` asking a VLM which image is better.

    Answers "a" / "b" / "tie", or None for a query dropped after retries."""

    def __init__(self, core: JudgeCore):
        self.core = core

    def judge(self, prompt: str, image_a: Tensor, image_b: Tensor) -> str | None:
        return self.judge_batch([(prompt, image_a, image_b)])[0]

    def judge_batch(self, queries) -> list[str | None]:
        """All queries at once, concurrently; each distinct image is PNG-encoded once."""
        pngs: dict[tuple, bytes] = {}

        def png(img: Tensor) -> bytes:
            key = (img.data_ptr(), tuple(img.shape), tuple(img.stride()))
            if key not in pngs:
                pngs[key] = png_bytes(img)
            return pngs[key]

        return self.core.ask([(p, [png(a), png(b)]) for p, a, b in queries])


class PairwiseJudgeReward(PairwiseReward):
    """Pref-GRPO with a VLM judge: each image's win rate within its group (NaN: no pair judged).

    Options as :class:`PointwiseJudgeReward` (``template`` defaults to a UnifiedReward-Think style
    "Image 1 is better" / "Image 2 is better" question) plus ``swap`` (judge both orders).
    Components: ``ties``, ``failed`` (per sample), ``position_bias``, ``judge_failed``
    (1 for a dropped sample).
    """

    name = "judge_pairwise"

    def __init__(self, model: str, base_url: str = DEFAULT_BASE_URL, api_key_env: str | None = None,
                 template: str | None = None, swap: bool = False, max_concurrency: int = 8,
                 timeout: float = 120.0, retries: int = 2, backoff: float = 0.5, temperature: float = 0.0,
                 max_tokens: int = 2048, cache_size: int = 4096, max_response_mb: float = DEFAULT_MAX_RESPONSE_MB):
        opts = _client_options(base_url, model, api_key_env, max_concurrency, timeout, retries, backoff,
                               temperature, max_tokens, cache_size, max_response_mb)
        self.core = JudgeCore("pairwise", template or PAIRWISE_TEMPLATE, parse_pairwise, opts)
        super().__init__(HTTPPairwiseJudge(self.core), swap=bool(swap))

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        """Win rates of ``images`` within ``groups`` (by prompt when None)."""
        out = super().__call__(images, prompts, groups)
        out.components["judge_failed"] = torch.isnan(out.scores).float()
        return out

    def close(self) -> None:
        """Release the HTTP client."""
        self.core.close()
