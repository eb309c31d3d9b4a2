"""The UniGenBench judge protocol: the question for one (prompt, image), and the answer's parser.

The judge (UniGenBench-EvalModel on vLLM, or Gemini / GPT behind any OpenAI-compatible API) gets
one user message: the image as a base64 JPEG data URL (quality 95, RGB), then the language's
template (``data/judge_en.txt`` / ``data/judge_zh.txt``) with four fields filled in:

* ``{prompt}``: the generation prompt;
* ``{testpoints}``: the prompt's checkpoint names as a Python list literal (``['Style', 'World Knowledge']``);
* ``{definitions}``: a header, then ``\\n{name}: {definition}`` per checkpoint, then ``\\n」``;
* ``{descriptions}``: a header, then ``\\n{name}: {what it means in this prompt}`` per checkpoint, then ``\\n」``.

The templates, headers and checkpoint definitions are the official evaluation scripts' (see
``data/ATTRIBUTION.md``), kept as data in ``data/protocol.json`` so that the judge model sees the
prompt it was trained on. The answer holds ``<analysis>[...]</analysis>`` and ``<score>[...]</score>``,
two list literals with one element per checkpoint; anything else is unreadable (and retried).
"""

from __future__ import annotations

import ast
import base64
import functools
import io
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

LANGUAGES = ("en", "zh")
JPEG_QUALITY = 95


@dataclass(frozen=True)
class Protocol:
    """One language's judge protocol (``data/protocol.json``).

    Attributes:
        language: "en" or "zh". template: the question with ``{prompt}``, ``{testpoints}``,
            ``{definitions}`` and ``{descriptions}`` fields. definitions: checkpoint name -> definition.
        prompt_column, dims_column: the CSV columns holding the prompt and its JSON annotations.
        testpoints_key, descriptions_key: the keys of the checkpoint names and descriptions in that JSON.
        definitions_header, descriptions_header, block_end: how the two checkpoint blocks open and close.
    """

    language: str
    template: str
    definitions: dict[str, str]
    prompt_column: str
    dims_column: str
    testpoints_key: str
    descriptions_key: str
    definitions_header: str
    descriptions_header: str
    block_end: str


def data_path(name: str) -> Path:
    """Path of a file shipped in ``flowgrpo/unigenbench/data``."""
    return Path(str(resources.files("flowgrpo.unigenbench").joinpath("data", name)))


@functools.lru_cache(maxsize=2)
def protocol(language: str) -> Protocol:
    """The judge protocol of ``language`` ("en" | "zh")."""
    if language not in LANGUAGES:
        raise ValueError(f"unknown UniGenBench language {language!r}; valid: {', '.join(LANGUAGES)}")
    spec = json.loads(data_path("protocol.json").read_text(encoding="utf-8"))[language]
    template = data_path(spec.pop("template")).read_text(encoding="utf-8")
    return Protocol(language=language, template=template, **spec)


_FIELDS = re.compile(r"\{(prompt|testpoints|definitions|descriptions)\}")


def judge_text(language: str, prompt: str, testpoints: list[str], descriptions: list[str]) -> str:
    """The judge's question for one prompt: the template with its four fields filled (one pass,
    so braces inside a prompt are never taken for fields)."""
    p = protocol(language)
    defs = p.definitions_header + "".join(f"\n{t}: {p.definitions[t]}" for t in testpoints) + p.block_end
    descs = p.descriptions_header + "".join(f"\n{t}: {d}" for t, d in zip(testpoints, descriptions)) + p.block_end
    values = {"prompt": prompt, "testpoints": str(list(testpoints)), "definitions": defs, "descriptions": descs}
    return _FIELDS.sub(lambda m: values[m.group(1)], p.template)


def jpeg_data_url(image) -> str:
    """A ``data:image/jpeg;base64,...`` URL of ``image`` (a path or a PIL image), as RGB at quality 95."""
    from PIL import Image

    buf = io.BytesIO()
    if isinstance(image, (str, Path)):
        with Image.open(image) as img:
            img.convert("RGB").save(buf, format="JPEG", quality=JPEG_QUALITY)
    else:
        image.convert("RGB").save(buf, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def judge_messages(image_url: str, text: str) -> list[dict]:
    """The chat ``messages`` of one judgement: one user turn, the image first, then the question."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": text}]}]


@dataclass(frozen=True)
class Verdict:
    """A parsed answer: one analysis string and one 0/1 score per checkpoint, in checkpoint order."""

    analysis: tuple[str, ...]
    scores: tuple[int, ...]


_ANALYSIS = re.compile(r"<analysis>(.*?)</analysis>", re.DOTALL)
_SCORE = re.compile(r"<score>(.*?)</score>", re.DOTALL)


def _binary(value) -> int | None:
    if isinstance(value, bool) or value in (0, 1):
        return int(value)
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return int(value.strip())
    return None


def parse_answer(text: str, num_checkpoints: int) -> Verdict | None:
    """The :class:`Verdict` in a judge's answer, or None when it has no ``<analysis>`` / ``<score>``
    list literal, a list of another length than ``num_checkpoints``, or a score other than 0 / 1."""
    a, s = _ANALYSIS.search(text or ""), _SCORE.search(text or "")
    if a is None or s is None:
        return None
    try:
        analysis, scores = ast.literal_eval(a.group(1).strip()), ast.literal_eval(s.group(1).strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    if not isinstance(analysis, (list, tuple)) or not isinstance(scores, (list, tuple)):
        return None
    if len(analysis) != num_checkpoints or len(scores) != num_checkpoints:
        return None
    binary = [_binary(v) for v in scores]
    if any(b is None for b in binary):
        return None
    return Verdict(tuple(str(x) for x in analysis), tuple(binary))
