"""``eval.evaluator=unigenbench``: UniGenBench scoring of a fixed prompt subset during training.

Configure it through ``eval.options`` (``eval.num_prompts``, ``eval.seeds_per_prompt`` and
``eval.num_steps`` set the subset size, images per prompt and ODE steps)::

    eval.evaluator=unigenbench eval.seen=false eval.num_prompts=60 eval.seeds_per_prompt=1
    eval.options.judge_url=http://127.0.0.1:8080/v1 eval.options.set=en

Options: ``judge_url`` (required), ``judge_model`` (QwenVL), ``api_key_env``, ``set`` (en | zh |
en_long | zh_long), ``csv`` (a newer prompt file), ``workers`` (16), ``timeout`` (300 s),
``retries`` (3), ``batch_size`` (images per model call, 8), ``seed`` (0). The subset is
``eval.num_prompts`` prompts spread evenly over the set (so it spans the dimensions), the same at
every evaluation; images are judged in memory with the protocol of ``flowgrpo unigenbench score``.

The result: ``accuracy`` is the overall score (mean of the primary dimensions), ``per_tag`` the
accuracy per primary dimension, ``score`` the pooled share of checkpoints scored 1, and ``correct``
each image's share of its checkpoints scored 1 (NaN for a failed judgement, which is left out of
the accuracies). UniGenBench has no training prompts, so ``eval.seen`` must be false.
"""

from __future__ import annotations

import math

from ..errors import ConfigError, UserError
from ..evaluators import EvalResult
from .prompts import load_prompt_set

DEFAULTS = {"judge_url": None, "judge_model": "QwenVL", "api_key_env": None, "set": "en", "csv": None,
            "workers": 16, "timeout": 300.0, "retries": 3, "batch_size": 8, "seed": 0}


class UniGenBenchEvaluator:
    """UniGenBench on ``eval.num_prompts`` prompts x ``eval.seeds_per_prompt`` images, judged over HTTP."""

    name = "unigenbench"

    def __init__(self, eval_cfg, shift: float = 1.0):
        from ..evaluators import evaluator_options
        from .score import JudgeOptions

        opts = evaluator_options(eval_cfg, DEFAULTS, "unigenbench")
        if not opts["judge_url"]:
            raise ConfigError("eval.evaluator=unigenbench needs eval.options.judge_url (an OpenAI-compatible API root, "
                              "e.g. http://127.0.0.1:8080/v1 for vllm serve)")
        self.prompt_set = load_prompt_set(str(opts["set"]), opts["csv"])
        every = self.prompt_set.prompts
        n = min(int(eval_cfg.num_prompts), len(every))
        if n < 1:
            raise ConfigError("eval.num_prompts must be at least 1 for the unigenbench evaluator")
        self.prompts = [every[(i * len(every)) // n] for i in range(n)]
        self.images_per_prompt = int(eval_cfg.seeds_per_prompt)
        self.steps, self.shift = int(eval_cfg.num_steps), float(shift)
        self.batch_size, self.seed = int(opts["batch_size"]), int(opts["seed"])
        self.judge = JudgeOptions(url=str(opts["judge_url"]), model=str(opts["judge_model"]),
                                  api_key_env=opts["api_key_env"], workers=int(opts["workers"]),
                                  timeout=float(opts["timeout"]), retries=int(opts["retries"]))
        self.judge.base_url()  # a malformed URL fails now, not after the first generation

    def evaluate(self, policy, split: str = "heldout", keep_images: bool = False) -> EvalResult:
        """Generate the subset's images with ``policy``, judge them, and return the accuracies."""
        import torch
        from PIL import Image

        from ..images import to_uint8
        from .generate import render
        from .score import ImageTask, judge_images
        from .summary import build_summary

        if split != "heldout":
            raise UserError(f"the unigenbench evaluator has only the held-out split, not {split!r}")
        items = [(p, j) for p in self.prompts for j in range(self.images_per_prompt)]
        tasks, kept = [], []
        for batch, images in render(policy, items, self.seed, self.steps, self.shift, self.batch_size):
            tasks += [ImageTask(f"{p.index}_{j}", p, j, Image.fromarray(a)) for (p, j), a in zip(batch, to_uint8(images))]
            if keep_images:
                kept.append(images)
        records, _ = judge_images(tasks, self.prompt_set.language, self.judge)
        summary = build_summary(self.prompt_set.name, self.prompt_set.language, self.judge.model, records)
        passed, total = (sum(c[i] for c in summary["counts"]["primary"].values()) for i in (0, 1))
        return EvalResult(
            accuracy=summary["overall"] if summary["overall"] is not None else math.nan,
            per_tag=dict(summary["primary"]),
            num_samples=len(records),
            score=passed / total if total else None,
            correct=[sum(r["scores"]) / len(r["scores"]) if r["ok"] else math.nan for r in records],
            prompts=[p.prompt for p, _ in items] if keep_images else None,
            images=torch.cat(kept) if kept else None,
        )
