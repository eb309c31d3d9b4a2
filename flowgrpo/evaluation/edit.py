"""The ``edit`` held-out evaluator: image-editing runs judged on held-out edit prompts with their references.

``eval.evaluator=edit`` with ``eval.options.prompts`` a ``.jsonl`` prompt file whose lines name each
prompt's reference image (the ``image`` column, as a training file of an edit run; prompts the run
does not train on). Each of ``eval.num_prompts`` prompts (spread evenly over the file) is drawn
``eval.seeds_per_prompt`` times with its reference by :func:`~flowgrpo.output.drawing.draw` (the ODE of
``eval.num_steps`` steps from the seeds ``noise_seed(options.seed, i, j)``), and every image is
scored by a reward (``options.reward``, default ``edit_consistency``, with ``options.reward_options``)
that is given the references, resized to the images' size, when it asks for them
(``wants_references``). An image is correct when its score reaches ``options.threshold``; the
result's ``score`` is the mean reward and ``per_tag`` follows the file's ``tag`` column.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import ConfigError, UserError
from . import EvalResult, evaluator_options, seeded_drawing_options

#: eval.options of the edit evaluator and their defaults
DEFAULTS = {"prompts": None, "reward": "edit_consistency", "reward_options": {}, "threshold": 0.5, "seed": 0,
            "batch_size": 4}


class EditEvaluator:
    """Held-out accuracy of an image-editing policy (see the module docstring)."""

    name = "edit"

    def __init__(self, eval_cfg, shift: float = 1.0):
        from ..rewards import build_reward
        from ..data import load_prompt_file

        opts = evaluator_options(eval_cfg, DEFAULTS, "edit")
        self.seed, self.batch_size = seeded_drawing_options(opts, eval_cfg)
        if not opts["prompts"]:
            raise ConfigError("eval.evaluator=edit needs eval.options.prompts: a .jsonl file of held-out edit "
                              "prompts whose lines name their reference image (\"image\": path)")
        rows = load_prompt_file(str(opts["prompts"]))
        if "image" not in rows[0]:
            raise ConfigError(f"eval.options.prompts={opts['prompts']!r} names no reference images: each line "
                              "needs an \"image\" column")
        n = min(int(eval_cfg.num_prompts), len(rows))
        self.rows = [rows[(i * len(rows)) // n] for i in range(n)]
        if not isinstance(opts["reward_options"], dict):
            raise ConfigError("eval.options.reward_options must be a mapping of option -> value")
        self.reward = build_reward(str(opts["reward"]), **opts["reward_options"])
        threshold = opts["threshold"]
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ConfigError(f"eval.options.threshold must be a finite number, got {threshold!r}")
        self.threshold = float(threshold)
        self.seeds_per_prompt, self.steps, self.shift = int(eval_cfg.seeds_per_prompt), int(eval_cfg.num_steps), shift

    def items(self) -> list[tuple[int, int]]:
        """The evaluated (prompt index, seed index) pairs, prompt-major."""
        return [(i, j) for i in range(len(self.rows)) for j in range(self.seeds_per_prompt)]

    def evaluate(self, policy, split: str = "heldout", keep_images: bool = False) -> EvalResult:
        """Draw every held-out edit prompt with its reference and score the images (see the module docstring)."""
        from ..output.drawing import draw, noise_seed
        from ..references import read_reference, resize_references
        from ..rewards.base import wants_references

        if split != "heldout":
            raise ValueError(f"the edit evaluator has only the held-out split, not {split!r}")
        if not getattr(policy, "takes_references", False):
            raise UserError(f"eval.evaluator=edit evaluates image-editing models; {type(policy).__name__} takes no "
                            "reference images")
        refs = [read_reference(row["image"]) for row in self.rows]
        items = self.items()
        was_training = policy.training
        policy.eval()
        images = []
        for start in range(0, len(items), self.batch_size):
            batch = items[start:start + self.batch_size]
            images.append(draw(policy, [self.rows[i]["prompt"] for i, _ in batch],
                               [noise_seed(self.seed, i, j) for i, j in batch], self.steps, self.shift,
                               [refs[i] for i, _ in batch]))
        policy.train(was_training)
        images = torch.cat(images)
        prompts = [self.rows[i]["prompt"] for i, _ in items]
        groups = torch.tensor([i for i, _ in items])
        extra = {}
        if wants_references(self.reward):
            extra["references"] = resize_references([refs[i] for i, _ in items], images.shape[-2], images.shape[-1])
        scores = self.reward(images, prompts, groups, **extra).scores.detach().float().cpu().numpy()
        correct = [float(s >= self.threshold) for s in scores]  # a NaN score (failed sample) is wrong
        tags = [self.rows[i]["tag"] for i, _ in items]
        per_tag = {t: float(np.mean([c for c, u in zip(correct, tags) if u == t])) for t in sorted(set(tags))}
        res = EvalResult(accuracy=float(np.mean(correct)), per_tag=per_tag, num_samples=len(items),
                         score=float(np.nanmean(scores)) if np.isfinite(scores).any() else None, correct=correct)
        if keep_images:
            res.images, res.prompts = images, prompts
        return res
