"""The ``bench`` held-out evaluator: a benchmark's numbers during training, on any model.

``eval.evaluator=bench`` with ``eval.options.bench`` a benchmark (:mod:`flowgrpo.benches.suites`:
``pickscore``, ``ocr``, ``geneval``, ...) and ``eval.options.prompts`` its held-out prompt file (a path,
or the name of a file shipped in ``flowgrpo/benches/data/``; by default the benchmark's shipped set).
Every evaluation (``eval.every`` iterations, ``eval.every_minutes``, before and after training) draws
``eval.num_prompts`` prompts of the file (spread evenly over it) ``eval.seeds_per_prompt`` times with the
ODE of ``eval.num_steps`` steps (Flow-GRPO evaluates its SD3.5 runs every 60 epochs at 40 steps), from
the same noise seeds each time, and scores the images in memory with the benchmark's metric
(``eval.options.metric_options``: its weight paths). The result's ``accuracy`` is the benchmark's
headline (GenEval: the mean of its tag accuracies; a reward benchmark: the mean score), ``score`` the
mean score, ``per_tag`` the per-tag numbers, so the run's curves and ``summary.json`` carry them beside
the training reward. ``flowgrpo eval RUN --bench`` computes the same numbers after training.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError, UserError
from . import EvalResult, evaluator_options, seeded_drawing_options
from ..benches.scoring import build_scorer, summarise
from ..benches.suites import bench_prompts, get_bench

#: eval.options of the bench evaluator and their defaults
DEFAULTS = {"bench": None, "prompts": None, "metric_options": {}, "seed": 0, "batch_size": 4}


class BenchEvaluator:
    """A benchmark as the run's held-out evaluator (see the module docstring)."""

    name = "bench"

    def __init__(self, eval_cfg, shift: float = 1.0):
        from ..data import load_prompt_file

        opts = evaluator_options(eval_cfg, DEFAULTS, "bench")
        self.seed, self.batch_size = seeded_drawing_options(opts, eval_cfg)
        if not opts["bench"]:
            raise ConfigError("eval.evaluator=bench needs eval.options.bench (a benchmark name) and, where the "
                              "benchmark ships none, eval.options.prompts (its held-out prompt file)")
        if not isinstance(opts["metric_options"], dict):
            raise ConfigError("eval.options.metric_options must be a mapping of option -> value")
        self.bench = get_bench(str(opts["bench"]))
        try:
            prompts = bench_prompts(self.bench, opts["prompts"])
        except UserError as exc:
            raise ConfigError(f"eval.options.prompts: {exc}") from None
        rows = load_prompt_file(prompts)
        n = min(int(eval_cfg.num_prompts), len(rows))
        self.rows = [rows[(i * len(rows)) // n] for i in range(n)]
        self.scorer = build_scorer(self.bench, opts["metric_options"])
        self.per_prompt, self.steps, self.shift = int(eval_cfg.seeds_per_prompt), int(eval_cfg.num_steps), shift

    def evaluate(self, policy, split: str = "heldout", keep_images: bool = False) -> EvalResult:
        """Draw and score the held-out prompts (see the module docstring)."""
        from ..output.drawing import draw, noise_seed

        if split != "heldout":
            raise ValueError(f"the bench evaluator has only the held-out split, not {split!r}")
        items = [(i, j) for i in range(len(self.rows)) for j in range(self.per_prompt)]
        was_training = policy.training
        policy.eval()
        images, scores = [], []
        for start in range(0, len(items), self.batch_size):
            batch = items[start:start + self.batch_size]
            drawn = draw(policy, [self.rows[i]["prompt"] for i, _ in batch],
                         [noise_seed(self.seed, i, j) for i, j in batch], self.steps, self.shift)
            scores += self.scorer(drawn, [self.rows[i] for i, _ in batch])
            if keep_images:
                images.append(drawn)
        policy.train(was_training)
        rows = [self.rows[i] for i, _ in items]
        summary = summarise(self.bench, scores, rows, [i for i, _ in items])
        threshold = self.bench.threshold
        correct = [float(s >= threshold) if threshold is not None else float(s) for s in scores]
        res = EvalResult(accuracy=summary.headline, per_tag=summary.per_tag, num_samples=len(items),
                         score=summary.mean_score, correct=correct)
        if keep_images:
            res.images, res.prompts = torch.cat(images), [r["prompt"] for r in rows]
        return res
