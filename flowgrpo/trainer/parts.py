"""The parts a :class:`~flowgrpo.trainer.trainer.Trainer` runs, each built from the config where the
caller does not hand one in.

A trainer is assembled from seven parts: the **policy** (:class:`~flowgrpo.policies.Policy`), the
**rewards** (name -> reward), the sampling **strategy** (:class:`~flowgrpo.samplers.Strategy`), the
**sampler** (:class:`~flowgrpo.samplers.forest_sampler.ForestSampler` over the policy), the advantage
**estimator** (``(rollout, rewards, cfg_adv, cfg_reward) -> AdvantageResult``), the **objective**
(:class:`~flowgrpo.objectives.Objective`) and the **prompts** (a
:class:`~flowgrpo.data.PromptSource`). The config still gives every hyperparameter (``train.*``,
``loss.*``, ``data.*`` sizes, ...); a part handed in replaces only what its config key names
(``model.name``, ``reward.weights``, ``sampler.strategy``, ``advantage.estimator``,
``loss.objective``, ``data.prompts``). The functions here build the parts the config names, in the
order and with the seeding the trainer has always used, so that a trainer from a config and one from
the same parts built by hand are the same run (tests/test_api.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from ..config import RunConfig
from ..curriculum import SignalCurriculum
from ..data import PromptSource
from ..errors import UserError
from ..rewards import build_reward
from ..rewards.base import Reward, wants_references
from ..rewards.callable import as_reward
from ..samplers.schedule import sigma_grid


def build_rewards(cfg: RunConfig) -> dict[str, Reward]:
    """The rewards ``reward.weights`` names, each with its ``reward.options.<name>``."""
    return {name: build_reward(name, **cfg.reward.options.get(name, {})) for name in cfg.reward.weights}


def reward_parts(rewards: Mapping[str, Any], cfg: RunConfig) -> tuple[dict[str, Reward], RunConfig]:
    """Rewards handed to a trainer (name -> a :class:`Reward` or any callable ``(images, prompts,
    **metadata) -> scores``, :mod:`flowgrpo.rewards.callable`) and the config they run under: where
    their names differ from ``reward.weights``, a copy whose weights are ``reward.weights[name]`` for the
    names it gives and 1.0 for the others."""
    if not rewards:
        raise UserError("the rewards part is empty: give at least one name -> reward")
    parts = {str(name): as_reward(fn, str(name)) for name, fn in rewards.items()}
    if list(parts) == list(cfg.reward.weights):
        return parts, cfg
    weights = {name: float(cfg.reward.weights.get(name, 1.0)) for name in parts}
    options = {k: v for k, v in cfg.reward.options.items() if k in parts}
    return parts, dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, weights=weights, options=options))


def model_grid(policy, sampler_cfg):
    """The policy's sigma grid as a function of T, or None where it is the sampler's default one
    (``sampler.grid=shift``: always, the shifted uniform grid whatever the policy's own)."""
    if sampler_cfg.grid == "shift":
        return None
    own = policy.sigma_grid(sampler_cfg.num_steps, sampler_cfg.shift)
    if torch.equal(own.cpu().float(), sigma_grid(sampler_cfg.num_steps, sampler_cfg.shift)):
        return None
    return lambda n: policy.sigma_grid(n, sampler_cfg.shift)


def build_prompts(cfg: RunConfig) -> PromptSource:
    """``data.prompts`` with the signal curriculum where ``data.curriculum=signal`` (its ``curriculum``)."""
    dc = cfg.data
    curriculum = SignalCurriculum(dc.curriculum_floor, dc.curriculum_rate) if dc.curriculum == "signal" else None
    return PromptSource(dc.prompts, cfg.train.seed, curriculum, dc.curriculum_key)


def check_references(cfg: RunConfig, prompts: PromptSource, policy, rewards: dict[str, Reward]) -> None:
    """Image editing, checked before the first rollout: reference images (a prompt file's ``image``
    column) need an edit model, an edit model needs them, and so does a reward that wants them."""
    has, takes = prompts.has_references, bool(getattr(policy, "takes_references", False))
    spec, model = cfg.data.prompts, cfg.model.name
    column = 'use a .jsonl prompt file with an "image" column'
    if has and not takes:
        raise UserError(f"data.prompts={spec!r} gives reference images but model.name={model!r} takes none "
                        "(not an image-editing model)")
    if takes and not has:
        raise UserError(f"model.name={model!r} edits a reference image per prompt and data.prompts={spec!r} "
                        f"gives none: {column}")
    wanting = [name for name, fn in rewards.items() if wants_references(fn)]
    if wanting and not has:
        raise UserError(f"reward {wanting[0]!r} compares each image with its prompt's reference image, and "
                        f"data.prompts={spec!r} gives none: {column}")
