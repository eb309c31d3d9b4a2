"""Value checks of a composed :class:`~flowgrpo.config.schema.RunConfig` beyond its types: choices,
ranges, names against the registries (imported inside :func:`validate`, so that loading a config
builds no model), each reward's options, the strategy's and the objective's options, and the pairs of
keys that cannot be combined. :func:`~flowgrpo.config.schema.load_config` runs :func:`validate`;
``eval``, ``sample`` and ``export`` run it with ``for_training=False`` on a finished run's config.
"""

from __future__ import annotations

import math
import os

from ..disk import check_inside
from ..errors import ConfigError, UserError
from ..fields import as_number, check_choices, check_ranges
from ..monitors.config import check_monitor
from ..objectives.options import check_objective_options
from ..policies.base.lora import check_lora_settings

# The functions take a RunConfig (flowgrpo.config.schema) untyped: schema imports validate for
# load_config, so an import of schema here, even for typing only, would be an import cycle.


def _check_trackers(trackers: list) -> None:
    from accelerate.utils import LoggerType

    valid = sorted(t.value for t in LoggerType if t.value != "all")
    for t in trackers:
        if t not in valid:
            raise ConfigError(f"config key 'log.trackers': unknown tracker {t!r}; valid choices: {', '.join(valid)}")


def _check_adam_betas(betas: list) -> None:
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"config key 'train.adam_betas' must be two numbers in [0, 1), got {betas!r}")


def _check_guard_log_prob(cfg) -> None:
    """Refuse GRPO-Guard's ratio normalisation (``loss.grpo.guard``) with CPS's mse log-prob.

    Guard's log r^ = s (logp - logp_old) + mse / (2 s), s the std the log-prob is scored with, is
    -mean_D((mu_old - mu) eps) for x' = mu_old + s eps when s is the transition's std: the same spread
    at every step. The mse convention scores with 1/sqrt(2), which leaves -sqrt(2) s mean_D(...), a
    spread that scales with s = sigma' sin(a pi / 2) again. With the true s it would be exactly the
    gaussian convention's r^ (logp_mse - logp_mse_old = 2 s^2 (logp - logp_old)): mse has no place
    under Guard, so the pair is refused rather than silently ignored."""
    if cfg.loss.grpo.guard and cfg.sampler.sde_kind == "cps" and cfg.sampler.cps_log_prob == "mse":
        raise ConfigError("config keys 'loss.grpo.guard' = true and 'sampler.cps_log_prob' = mse cannot be combined: "
                          "GRPO-Guard normalises by the transition std, the mse log-prob scores with 1/sqrt(2); "
                          "use sampler.cps_log_prob=gaussian (under Guard the mse ratio would equal it)")


def _check_threads(threads: int) -> None:
    """More threads than CPUs never run faster; torch crashes at 100,000 (SIGSEGV), stalls at 10,000."""
    cpus = os.cpu_count() or 1
    if threads > cpus:
        raise ConfigError(f"config key 'train.threads' = {threads} is more than this machine's {cpus} CPUs: "
                          f"use at most {cpus}, or 0 for torch's default")


def validate(cfg, *, model_folder_may_be_absent: bool = False, for_training: bool = True) -> None:
    """Value checks beyond types: choices (every ``Literal`` field), ranges, names, strategy options.
    ``model_folder_may_be_absent``: a ``model.name`` that names nothing yet is let through (``config
    show`` of a recipe for a folder about to be downloaded; ``train`` never sets it).
    ``for_training`` False: the checks of what only training builds are skipped (the rewards, the
    objective, the strategy and the estimator, which may be plug-ins of the training session, such as a
    function given to ``Trainer.from_config(cfg, rewards=...)``): evaluating, sampling or exporting a
    finished run rebuilds its policy only."""
    check_choices(cfg)
    _check_trackers(cfg.log.trackers)
    if cfg.log.run_name:  # the default (preset + time stamp) is always inside
        check_inside(cfg.log.out_dir, cfg.log.run_name, "log.run_name", "log.out_dir")
    check_ranges(cfg)
    if for_training:  # not for a finished run's config evaluated on a smaller machine
        _check_threads(cfg.train.threads)
    _check_adam_betas(cfg.train.adam_betas)
    if for_training and not cfg.reward.weights:
        raise ConfigError("config key 'reward.weights' needs at least one reward")
    for name, w in cfg.reward.weights.items():
        if isinstance(w, str) or as_number(w) is None or not math.isfinite(w):
            raise ConfigError(f"config key 'reward.weights.{name}' must be a finite number, got {w!r}")
    for name, opts in cfg.reward.options.items():
        if name not in cfg.reward.weights:
            raise ConfigError(f"config key 'reward.options.{name}': {name!r} is not one of the run's rewards "
                              f"(reward.weights: {', '.join(cfg.reward.weights)})")
        if not isinstance(opts, dict):
            raise ConfigError(f"config key 'reward.options.{name}' must be a mapping of option -> value")
    # names are checked against the registries here, before any model is built (no heavy imports)
    from ..advantages import ESTIMATORS
    from ..objectives import OBJECTIVES
    from ..policies import POLICIES, resolve_adapter
    from ..rewards import REWARDS
    from ..samplers.strategies import STRATEGIES, options_class
    from ..samplers.strategy_base import parse_options

    if cfg.model.name not in POLICIES and not model_folder_may_be_absent:  # a folder or cached hub id picks its adapter
        try:
            resolve_adapter(cfg.model)
        except UserError as exc:
            raise ConfigError(f"config key 'model.name': {exc}") from None
    for key, registry, names in (("sampler.strategy", STRATEGIES, [cfg.sampler.strategy]),
                                 ("loss.objective", OBJECTIVES, [cfg.loss.objective]),
                                 ("advantage.estimator", ESTIMATORS, [cfg.advantage.estimator]),
                                 ("reward.weights", REWARDS, list(cfg.reward.weights))) if for_training else ():
        for name in names:  # a registered name, or an import path 'package.module:attr' fitting the contract
            try:
                registry.check(name)
            except UserError as exc:
                raise ConfigError(f"config key '{key}': {exc}") from None
    if cfg.eval.evaluator not in ("auto", "none"):
        from ..evaluators import EVALUATORS

        if cfg.eval.evaluator not in EVALUATORS:
            raise ConfigError(f"config key 'eval.evaluator': unknown evaluator {cfg.eval.evaluator!r}; valid choices: "
                              f"auto, none, {', '.join(EVALUATORS.names())}")
    check_lora_settings(cfg.model.lora_targets, cfg.model.lora_init)
    check_monitor(cfg.monitor)
    if cfg.sampler.cps_log_prob != "gaussian" and cfg.sampler.sde_kind != "cps":
        raise ConfigError("config key 'sampler.cps_log_prob' = mse needs sampler.sde_kind = cps")
    if not for_training:
        return
    _check_guard_log_prob(cfg)
    parse_options(options_class(cfg.sampler.strategy), cfg.strategy, cfg.sampler.num_steps)
    check_objective_options(cfg.loss)
    _check_group_spread(cfg)


#: the estimators that centre each reward on its group (a prompt's samples): a group of one trains nothing
_GROUP_ESTIMATORS = ("group_zscore", "branch_grpo", "tempflow", "g2rpo")


def _check_group_spread(cfg) -> None:
    """Refuse ``data.trees_per_prompt`` = 1 where a prompt's group is one sample: a chain strategy (one
    leaf per tree) with a built-in estimator gives every sample advantage 0, so no step ever trains.
    Tree strategies (several leaves per tree) and plug-in estimators are left alone."""
    if cfg.data.trees_per_prompt > 1 or cfg.advantage.estimator not in _GROUP_ESTIMATORS:
        return
    from ..samplers.strategies import build_strategy

    if build_strategy(cfg.sampler, cfg.strategy).plan(0).leaves_per_tree == 1:
        raise ConfigError(f"config key 'data.trees_per_prompt' = 1 trains nothing with sampler.strategy="
                          f"{cfg.sampler.strategy}: each prompt's group is one sample, whose advantage (reward "
                          "minus its group's mean) is always 0; use 2 or more (the GRPO group size)")
