"""Held-out evaluation, pluggable per world or benchmark.

An :class:`Evaluator` generates images for a fixed set of (prompt, seed) pairs with a policy and
scores them; it returns an :class:`EvalResult`. ``eval.evaluator`` picks one from
:data:`EVALUATORS` ("auto": the policy's own, ``Policy.evaluator``; "none": skip). A model without
an evaluator (e.g. SD3 on free-form prompts) trains without one, and the run's summary says so.

The evaluators' contract and names are :mod:`flowgrpo.evaluators` (a leaf, re-exported here). The
general evaluators live in this package; two live beside what they evaluate, because their packages
sit where importing them from here would make an import cycle: the shapes world's (its world is a
layer below the rewards, as its policy adapter is) and UniGenBench's (its package also holds the
``unigenbench generate`` command, which reads training runs). Built in: ``shapes`` (verifier accuracy
of the embedded shapes world, :mod:`flowgrpo.shapes.evaluate`) and ``unigenbench`` (UniGenBench on a
prompt subset, judged by a VLM over an OpenAI-compatible API; configured through ``eval.options``,
:mod:`flowgrpo.unigenbench.evaluator`) and ``edit`` (image-editing
runs: held-out edit prompts drawn with their reference images and scored by a reward that is given
them, :mod:`.edit`) and ``bench`` (a benchmark of the field, GenEval, OCR, PickScore,
..., on a held-out prompt file of any model: :mod:`.bench`). :mod:`.in_training` runs the selected
one before, during and after a training run.
"""

from __future__ import annotations

from ..evaluators import (EVALUATORS, EvalResult, Evaluator, evaluator_options, paired_gain, seed_standard_error,
                          seeded_drawing_options)

__all__ = ["EVALUATORS", "EvalResult", "Evaluator", "build_evaluator", "evaluator_options", "paired_gain",
           "seed_standard_error", "seeded_drawing_options"]



def build_evaluator(eval_cfg, policy, shift: float = 1.0) -> tuple[Evaluator | None, str]:
    """The evaluator ``eval_cfg.evaluator`` selects for ``policy``, and a note (why none, when None)."""
    name = eval_cfg.evaluator
    if name == "none":
        return None, "evaluation disabled (eval.evaluator=none)"
    if name == "auto":
        name = policy.evaluator
        if name is None:
            return None, (f"no held-out evaluator for model {type(policy).__name__}: evaluation skipped "
                          f"(set eval.evaluator to one of: {', '.join(EVALUATORS.names())})")
    return EVALUATORS.build(name, eval_cfg, shift), ""
