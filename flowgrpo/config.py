"""Typed run configuration: dataclasses with a help string on every field, YAML presets, overrides.

A run is configured by one :class:`RunConfig`; presets are YAML files shipped in
``flowgrpo/presets`` holding a partial config (with an optional ``base:`` preset they extend).
Overrides ``key.sub=value`` are parsed as YAML scalars and checked against the field's type.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError


def _f(default: Any, help: str, **kw) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class ModelConfig:
    name: str = _f("shapes", "policy adapter: shapes | sd3 | sd3-tiny (see `flowgrpo.policies.POLICIES`)")
    path: str | None = _f(None, "local weights directory (shapes: default shipped weights; sd3: a diffusers pipeline folder)")
    train_mode: str = _f("lora", "lora (peft adapter) | full (all transformer weights)")
    lora_rank: int = _f(32, "LoRA rank r")
    lora_alpha: float = _f(64.0, "LoRA alpha (scale = alpha / r)")
    guidance_scale: float = _f(1.0, "classifier-free guidance scale during rollouts and eval (1 = off)")
    dtype: str = _f("float32", "model dtype: float32 | bfloat16 | float16 (step math is always float32)")
    resolution: int = _f(64, "image resolution in pixels for latent models (sd3*)")
    max_sequence_length: int = _f(32, "T5 tokens for sd3* text encoding")


@dataclass
class SamplerConfig:
    strategy: str = _f("flow_grpo", "sampling strategy (plan per iteration): see `flowgrpo.samplers.STRATEGIES`")
    num_steps: int = _f(10, "denoising steps T of a rollout")
    noise_level: float = _f(0.7, "SDE noise level a (flow_grpo, cps) or eta (dance)")
    sde_kind: str = _f("flow_grpo", "SDE discretisation: flow_grpo | dance | cps")
    shift: float = _f(1.0, "timestep shift s of the sigma grid (SD3 uses 3)")
    shared_group_noise: bool = _f(False, "all members of a group start from the same initial noise (DanceGRPO)")
    max_micro_batch: int = _f(256, "largest model batch during rollouts (nodes of one depth are chunked by it)")


@dataclass
class DataConfig:
    prompts: str = _f("shapes", "prompt source: 'shapes' (procedural world) or a .txt/.jsonl prompt file")
    prompts_per_iteration: int = _f(8, "distinct prompts per iteration")
    group_size: int = _f(8, "samples (trees) per prompt; the GRPO group")


@dataclass
class RewardConfig:
    weights: dict = _f({"shapes": 1.0}, "reward name -> weight (names from `flowgrpo.rewards.REWARDS`)")
    combine: str = _f("sum_then_normalize", "sum_then_normalize (Flow-GRPO) | normalize_then_sum (MixGRPO, Pref-GRPO)")
    renormalize: bool = _f(False, "normalize_then_sum with several rewards: z-score the weighted sum of z-scores again per group (the references do not)")


@dataclass
class AdvantageConfig:
    estimator: str = _f("group_zscore", "advantage estimator: see `flowgrpo.advantages.ESTIMATORS`")
    std: str = _f("group", "normalise by the std of each group (group) or of the whole batch (global)")
    clip: float = _f(5.0, "advantages are clipped to +-clip")
    eps: float = _f(1e-4, "added to the std before dividing")


@dataclass
class LossConfig:
    clip_range: float = _f(1e-4, "PPO clip epsilon on the importance ratio")
    beta: float = _f(0.0, "KL weight against the reference model (adapter off); 0 disables the reference pass")
    kl_sigma: str = _f("sigma_t", "KL denominator: sigma_t (mean((mu - mu_ref)^2) / (2 sigma_t^2), as the current Flow-GRPO code) | transition_std (divides by s^2 = sigma_t^2 * (-dt) instead: ~T times larger at T steps, so divide beta by ~T to match)")
    guard: bool = _f(False, "GRPO-Guard ratio normalisation")
    guard_reweight: bool = _f(False, "GRPO-Guard per-step gradient reweighting (weight proportional to 1/|dt|, mean 1)")
    tempflow_weight: bool = _f(False, "TempFlow noise-aware weighting (weight proportional to sigma_t*sqrt(-dt), mean 1)")
    anchor_weight: float = _f(0.0, "weight of the anchor term: mean (v_theta - v_ref)^2 against the frozen base model on the rollout's ODE (untrained) steps; holds full fine-tuning where no policy gradient reaches (flowgrpo.anchor)")
    anchor_steps: int = _f(2, "ODE depths per update on which the anchor term is evaluated")
    backend: str = _f("auto", "auto (fused op where built, else reference) | reference | fused")


@dataclass
class TrainConfig:
    iterations: int = _f(100, "outer iterations (rollout + update)")
    max_minutes: float = _f(0.0, "stop after this many minutes of training wall-clock (0 = no limit)")
    lr: float = _f(3e-4, "AdamW learning rate")
    weight_decay: float = _f(1e-4, "AdamW weight decay")
    adam_betas: list = _f([0.9, 0.999], "AdamW betas")
    adam_eps: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    inner_epochs: int = _f(1, "passes over one iteration's rollouts")
    minibatches: int = _f(1, "optimizer steps per inner epoch (samples split into this many minibatches)")
    micro_batch: int = _f(64, "transitions per forward/backward")
    timestep_fraction: float = _f(1.0, "fraction of trainable SDE steps used for the update")
    timestep_order: str = _f("ordered", "ordered (the first fraction of steps) | random (a fresh random subset each iteration)")
    ema: bool = _f(True, "keep an EMA of the trainable weights (used for evaluation)")
    ema_decay: float = _f(0.9, "EMA decay per iteration")
    seed: int = _f(0, "seed of every random choice (prompts, noise, subsets); runs are reproducible")
    threads: int = _f(0, "torch CPU threads (0 = torch default)")
    deterministic: bool = _f(True, "torch deterministic algorithms (resume reproduces an uninterrupted run)")


@dataclass
class EvalConfig:
    num_prompts: int = _f(64, "held-out prompts")
    seeds_per_prompt: int = _f(4, "fixed seeds per held-out prompt")
    num_steps: int = _f(20, "ODE steps for evaluation")
    every: int = _f(0, "evaluate every N iterations during training (0 = only before and after)")
    every_minutes: float = _f(0.0, "evaluate every N minutes of training wall-clock (0 = off); the clock is paused while evaluating")
    seen: bool = _f(True, "also evaluate on prompts from the training pools before and after (reported as eval_*_seen)")


@dataclass
class LogConfig:
    out_dir: str = _f("runs", "parent folder of run directories")
    run_name: str = _f("", "run directory name (default: preset + timestamp)")
    checkpoint_every: int = _f(10, "write a checkpoint every N iterations (and at the end)")
    grid_every: int = _f(25, "write a sample grid every N iterations (0 = never)")
    tensorboard: bool = _f(True, "write TensorBoard events")
    progress: bool = _f(True, "show a rich progress bar")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    strategy: dict = _f({}, "strategy-specific options (window size, branch steps, ...), passed to the strategy; a preset, config file or set of overrides that selects another sampler.strategy starts from that strategy's defaults")
    preset: str = _f("", "name of the preset this config came from")
    description: str = _f("", "one line saying what this configuration is (shown by `flowgrpo presets`)")


# --------------------------------------------------------------------------- merging and validation


def _hint(obj) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a field type; ints are accepted for floats."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"bad value for {key}")
    base = origin or hint
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is bool and not isinstance(value, bool):
        raise ConfigError(f"config key '{key}' expects true/false, got {value!r}")
    if base in (int, float) and isinstance(value, bool):
        raise ConfigError(f"config key '{key}' expects {base.__name__}, got {value!r}")
    if base in (int, float, str, bool, list, dict) and not isinstance(value, base):
        raise ConfigError(f"config key '{key}' expects {base.__name__}, got {type(value).__name__} {value!r}")
    return value


def apply_dict(cfg: Any, data: dict, prefix: str = "") -> None:
    """Merge a nested dict into dataclass ``cfg`` in place, refusing unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix or '<root>'}' must be a mapping, got {type(data).__name__}")
    hints = _hint(cfg)
    names = [f.name for f in dataclasses.fields(cfg)]
    if isinstance(cfg, RunConfig):
        new_strategy = (data.get("sampler") or {}).get("strategy") if isinstance(data.get("sampler"), dict) else None
        if new_strategy is not None and new_strategy != cfg.sampler.strategy:
            # strategy options belong to their strategy: choosing another one starts from its defaults
            # (options given in the same layer still apply)
            cfg.strategy = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{full}'; valid keys{' under ' + repr(prefix[:-1]) if prefix else ''}: {', '.join(names)}")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            apply_dict(current, value, full + ".")
        elif isinstance(current, dict) and isinstance(value, dict) and key == "strategy":
            current.update(value)  # strategy options merge, so a preset can set a subset
        else:
            setattr(cfg, key, _coerce(value, hints[key], full))


def parse_override(text: str) -> dict:
    """``"train.lr=1e-4"`` -> ``{"train": {"lr": 1e-4}}`` (the value is parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_float(raw):
        value = float(raw)  # YAML 1.1 reads "1e-4" as a string
    out: dict = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def _deep_merge(into: dict, data: dict) -> None:
    for k, v in data.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = v


def _looks_float(raw: str) -> bool:
    try:
        float(raw)
        return True
    except ValueError:
        return False


# --------------------------------------------------------------------------- presets


def preset_dir():
    return resources.files("flowgrpo.presets")


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in preset_dir().iterdir() if p.name.endswith(".yaml"))


def read_preset(name: str) -> dict:
    path = preset_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(preset_names())}")
    return _load_yaml_text(path.read_text(), f"preset {name}")


def _load_yaml_text(text: str, what: str) -> dict:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold a mapping at the top level")
    return data


def _apply_with_bases(cfg: RunConfig, data: dict, seen: tuple[str, ...] = ()) -> None:
    base = data.pop("base", None)
    if base:
        if base in seen:
            raise ConfigError(f"preset inheritance loops: {' -> '.join(seen + (base,))}")
        _apply_with_bases(cfg, read_preset(base), seen + (base,))
    apply_dict(cfg, data)


def load_config(preset: str | None = "shapes", config_file: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Build a :class:`RunConfig`: defaults <- preset (with its bases) <- config file <- overrides."""
    cfg = RunConfig()
    if preset:
        _apply_with_bases(cfg, read_preset(preset), (preset,))
        cfg.preset = preset
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        _apply_with_bases(cfg, _load_yaml_text(path.read_text(), f"config file {path}"))
    if overrides:  # the overrides form one layer, whatever their order
        merged: dict = {}
        for ov in overrides:
            _deep_merge(merged, parse_override(ov))
        apply_dict(cfg, merged)
    validate(cfg)
    return cfg


_CHOICES = {
    "model.train_mode": ("lora", "full"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "sampler.sde_kind": ("flow_grpo", "dance", "cps"),
    "reward.combine": ("sum_then_normalize", "normalize_then_sum"),
    "advantage.std": ("group", "global"),
    "loss.kl_sigma": ("transition_std", "sigma_t"),
    "loss.backend": ("auto", "reference", "fused"),
    "train.timestep_order": ("ordered", "random"),
}


def validate(cfg: RunConfig) -> None:
    """Value checks beyond types: choices, ranges."""
    for key, choices in _CHOICES.items():
        sec, name = key.split(".")
        value = getattr(getattr(cfg, sec), name)
        if value not in choices:
            raise ConfigError(f"config key '{key}' = {value!r} is not one of: {', '.join(choices)}")
    positive = ["sampler.num_steps", "data.prompts_per_iteration", "data.group_size", "train.iterations",
                "train.inner_epochs", "train.minibatches", "train.micro_batch", "eval.num_prompts",
                "eval.seeds_per_prompt", "eval.num_steps", "sampler.max_micro_batch"]
    for key in positive:
        sec, name = key.split(".")
        if getattr(getattr(cfg, sec), name) < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {getattr(getattr(cfg, sec), name)}")
    if not 0.0 < cfg.train.timestep_fraction <= 1.0:
        raise ConfigError(f"config key 'train.timestep_fraction' must be in (0, 1], got {cfg.train.timestep_fraction}")
    if not cfg.reward.weights:
        raise ConfigError("config key 'reward.weights' needs at least one reward")
    # names are checked against the registries here, before any model is built (no heavy imports)
    from .advantages import ESTIMATORS
    from .policies import POLICIES
    from .rewards import REWARDS
    from .samplers.strategies import STRATEGIES

    for key, registry, names in (("model.name", POLICIES, [cfg.model.name]),
                                 ("sampler.strategy", STRATEGIES, [cfg.sampler.strategy]),
                                 ("advantage.estimator", ESTIMATORS, [cfg.advantage.estimator]),
                                 ("reward.weights", REWARDS, list(cfg.reward.weights))):
        for name in names:
            if name not in registry:
                raise ConfigError(f"config key '{key}': unknown {registry.kind} {name!r}; "
                                  f"valid choices: {', '.join(registry.names())}")


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)
