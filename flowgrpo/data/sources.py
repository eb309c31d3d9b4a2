"""Prompt sources: what each training iteration asks the policy to draw.

A source is a prompt file, read by :func:`~flowgrpo.data.prompt_files.load_prompt_file` (the reader
of every prompt file), or a procedural source named in :data:`PROCEDURAL_PROMPTS` (a world that draws
fresh prompts every iteration, e.g. ``shapes``: :class:`flowgrpo.shapes.prompts.TrainingPrompts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from ..curriculum import SignalCurriculum
from ..references import read_reference
from ..registry import Registry
from ..seeds import PROMPTS
from .prompt_files import load_prompt_file

#: procedural prompt sources by ``data.prompts`` name: classes with ``tags`` (their curriculum keys) and
#: ``sample(rng, tag=None) -> (prompt, tag)``, imported when named
PROCEDURAL_PROMPTS: Registry = Registry("procedural prompt source")
PROCEDURAL_PROMPTS.register_lazy("shapes", "flowgrpo.shapes.prompts:TrainingPrompts")


@dataclass
class PromptBatch:
    """One iteration's prompts and their curriculum keys (both of length N, group g = prompt g), and for
    a prompt file with an ``image`` column each prompt's reference image (float32 [3, H, W] in [0, 1]
    at the file's own size; None for prompts without images)."""

    prompts: list[str]
    keys: list[str]
    references: list[Tensor] | None = None
    #: a .jsonl file's line of each prompt (every field), for rewards with ``wants_metadata``; else None
    metadata: list[dict] | None = None


class PromptSource:
    """Deterministic prompt batches: ``draw(iteration, n)`` depends only on (seed, iteration) and, with a
    curriculum, on the curriculum's state (itself a function of the run so far, saved in checkpoints).

    ``spec`` names a procedural source (:data:`PROCEDURAL_PROMPTS`, e.g. "shapes": fresh shapes-world
    prompts every iteration, from the training pools only: held-out prompts are never trained on) or the path of a .txt / .jsonl prompt file
    (prompts drawn without replacement within an iteration). A .jsonl file's ``image`` column gives each
    prompt a reference image (image editing), drawn with it into :attr:`PromptBatch.references`.

    ``curriculum`` (optional, :class:`~flowgrpo.curriculum.SignalCurriculum`) reweights what is drawn.
    Its keys are the tags (a procedural source's ``tags``; a .jsonl file's ``tag`` column) when ``key_by`` is
    "tag", the prompts themselves when "prompt"; "auto" uses tags where the source has more than one.
    """

    def __init__(self, spec: str, seed: int = 0, curriculum: SignalCurriculum | None = None, key_by: str = "auto"):
        if key_by not in ("auto", "tag", "prompt"):
            raise ValueError(f"unknown curriculum key {key_by!r}; valid: auto, tag, prompt")
        self.spec = spec
        self.seed = seed
        self.curriculum = curriculum
        self.world = PROCEDURAL_PROMPTS.get(spec)() if spec in PROCEDURAL_PROMPTS else None
        self.rows = None if self.world is not None else load_prompt_file(spec)
        self._references: dict[int, Tensor] = {}
        if self.rows is None and key_by == "prompt" and curriculum is not None:
            raise ValueError(f"data.prompts={spec} draws fresh prompts every iteration: its curriculum keys are its "
                             "tags (data.curriculum_key=tag or auto), not the prompts")
        if key_by == "auto":
            key_by = "tag" if self.rows is None or len({r["tag"] for r in self.rows}) > 1 else "prompt"
        self.key_by = key_by

    def _key(self, prompt: str, tag: str) -> str:
        return tag if self.key_by == "tag" else prompt

    def draw(self, iteration: int, n: int) -> PromptBatch:
        """The ``n`` prompts of ``iteration`` with their curriculum keys."""
        rng = np.random.default_rng([self.seed, iteration, PROMPTS])
        cur = self.curriculum
        if self.rows is None:
            tags = self.world.tags
            if cur is None or self.key_by == "prompt":
                drawn = [self.world.sample(rng) for _ in range(n)]
            else:
                p = cur.weights(list(tags))
                drawn = [self.world.sample(rng, tags[rng.choice(len(tags), p=p)]) for _ in range(n)]
            return PromptBatch([prompt for prompt, _ in drawn], [self._key(prompt, tag) for prompt, tag in drawn])
        keys = [self._key(r["prompt"], r["tag"]) for r in self.rows]
        p = None if cur is None else cur.weights(keys)
        idx = rng.choice(len(self.rows), size=n, replace=len(self.rows) < n, p=p)
        refs = [self._reference(int(i)) for i in idx] if self.has_references else None
        meta = [self.rows[i]["metadata"] for i in idx] if self.has_metadata else None
        return PromptBatch([self.rows[i]["prompt"] for i in idx], [keys[i] for i in idx], refs, meta)

    @property
    def has_metadata(self) -> bool:
        """Whether each prompt comes with its .jsonl line (a .jsonl prompt file)."""
        return self.rows is not None and "metadata" in self.rows[0]

    @property
    def has_references(self) -> bool:
        """Whether the prompts come with reference images (a .jsonl file with an ``image`` column)."""
        return self.rows is not None and "image" in self.rows[0]

    def _reference(self, row: int) -> Tensor:
        """Row ``row``'s reference image [3, H, W], read once (the file was checked when loaded)."""
        if row not in self._references:
            self._references[row] = read_reference(self.rows[row]["image"])
        return self._references[row]

    def batch(self, iteration: int, n: int) -> list[str]:
        """The ``n`` prompts of ``iteration`` (:meth:`draw` without the keys)."""
        return self.draw(iteration, n).prompts
