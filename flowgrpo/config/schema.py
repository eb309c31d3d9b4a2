"""Typed run configuration: dataclasses with a help string on every field, and merging (the value checks
are :mod:`flowgrpo.config.validation`).

A run is configured by one :class:`RunConfig`, composed from a recipe (``flowgrpo/recipes``), a method
preset (``flowgrpo/presets``), a config file and overrides by :mod:`flowgrpo.config.layers`.
Overrides ``key.sub=value`` are parsed as YAML scalars and checked against the field's type.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from ..fields import as_number, field_ranges, help_field as _f, merge_into
from ..monitors.config import MonitorConfig
from ..objectives import check_objective_keys, objective_help, with_objective_options
from ..policies.base import TrainMode
from ..policies.base.lora import DEFAULT_LORA_INIT, DEFAULT_TARGETS
from ..samplers.plan import MAX_STEPS
from ..samplers.sde import DEFAULT_NOISE_LEVEL, LogProbConvention, SDEKindName
from .layers import RECIPE_METHOD, Composed, compose, deep_merge, parse_override
from .renames import RENAMED_KEYS, move_renamed
from .validation import validate


@dataclass
class ModelConfig:
    name: str = _f("shapes", "policy adapter (shapes | sd3 | sd3-tiny | flux | wan | pipeline, see `flowgrpo.policies.POLICIES`; pipeline: the generic adapter, for any flow-matching transformer pipeline in model.path), or a diffusers pipeline directory / cached hub id whose model_index.json picks the adapter (the generic one for a class without a dedicated adapter)")
    path: str | None = _f(None, "local weights directory (shapes: default shipped weights; sd3 / flux / wan / pipeline: a diffusers pipeline folder)")
    train_mode: TrainMode = _f("lora", "lora (peft adapter) | full (all transformer weights)")
    lora_rank: int = _f(32, "LoRA rank r")
    lora_alpha: float = _f(64.0, "LoRA alpha (scale = alpha / r)")
    lora_targets: str | list[str] = _f(DEFAULT_TARGETS, "layers the LoRA wraps: default (the adapter's own list: "
                                       "attention and feed-forward projections) | attention_qkvo (to_q, to_k, to_v, "
                                       "to_out.0 of every attention: DanceGRPO) | attention (those and the text "
                                       "stream's add_q/k/v_proj, to_add_out) | all_linear (every linear layer inside "
                                       "a numbered block) | a list of module names in peft's rule, each matching a "
                                       "name or its dotted suffix (Flow-GRPO: [attn.to_q, attn.to_k, ...] leaves "
                                       "SD3.5's attn2 out); a list entry or set that matches no layer is refused")
    lora_init: bool | str = _f(DEFAULT_LORA_INIT, "peft's init_lora_weights: gaussian (A ~ N(0, 1/r): Flow-GRPO, "
                               "DiffusionNFT) | true (A kaiming-uniform, peft's default: DanceGRPO); B starts at 0 "
                               "either way, so the policy starts as the base model")
    guidance_scale: float = _f(1.0, "classifier-free guidance scale during rollouts and eval (1 = off)", ge=0.0)
    dtype: Literal["float32", "bfloat16", "float16"] = _f("float32", "model dtype (step math is always float32; LoRA weights stay float32, and modules the library keeps in float32, e.g. Wan norms or T5 wo under fp16, stay so)")
    resolution: int | None = _f(None, "image (or video frame) side in pixels for latent models (sd3, flux, wan); null: the adapter's own default (its class's `resolution` argument)", ge=1)
    max_sequence_length: int | None = _f(None, "T5 / UMT5 tokens of the text encoding (sd3, flux, wan); null: the adapter's own default (its class's `max_sequence_length` argument)", ge=1)
    num_frames: int | None = _f(None, "video frames for video models (wan): 4k + 1; null: the adapter's own default", ge=1)
    gradient_checkpointing: bool = _f(False, "recompute transformer blocks in the backward pass (less memory, ~30 % slower; diffusers models)")
    vae_slicing: bool = _f(False, "decode one image at a time through the VAE (less memory; same images)")
    vae_tiling: bool = _f(False, "decode large images in overlapping VAE tiles (less memory at high resolution; not bit-identical once the image exceeds one tile)")
    offload_text_encoders: bool = _f(False, "keep the text encoders on the CPU between encodings; encodings are cached per prompt (LRU)")
    precompute_prompts: bool = _f(False, "encode every prompt the run uses (the data.prompts file, the evaluator's prompts, the empty prompt) once before training, keep the encodings in CPU memory keyed by prompt, and free the text encoders (no device or host memory for them afterwards); needs a finite prompt file (not a procedural source); a prompt outside the set is refused by name")
    reference_device: Literal["auto", "cpu"] = _f("auto", "model.train_mode=full: where the frozen reference copy of the denoiser (KL, anchor, base-velocity terms) lives: auto (beside the trained one, on the run's device) | cpu (in CPU memory; each reference call streams one transformer block at a time to the device: no resident copy, one host-to-device copy of the blocks per reference call)")
    compile_transformer: Literal[False, True, "whole", "regional"] = _f(False, "torch.compile the transformer, in place, for rollouts and updates: false | true or whole (its whole forward: slow first iterations) | regional (each repeated transformer block, e.g. FLUX's double- and single-stream blocks, compiled once for all blocks of its kind: a much shorter compile for PyTorch's and diffusers' reported near-whole speed-up, not yet measured here); backend inductor, or $FLOWGRPO_COMPILE_BACKEND; the compile_s metric is each iteration's compile seconds (the first one's build, then any recompilation), part of iter_s")
    attention_backend: Literal["sdpa", "native", "flex", "flash", "flash-3", "sage", "xformers"] = _f("sdpa", "attention kernels: sdpa (diffusers' default processors, unchanged) | native (PyTorch SDPA through diffusers' attention dispatcher) | flex (PyTorch FlexAttention; slow unless compiled) | flash (flash-attn 2) | flash-3 (FlashAttention 3, Hopper) | sage (sageattention) | xformers; flash, flash-3, sage and xformers need their package and a CUDA GPU, else the run stops naming the backends usable here")


@dataclass
class SamplerConfig:
    strategy: str = _f("flow_grpo", "sampling strategy (plan per iteration): see `flowgrpo.samplers.STRATEGIES`; its options are `strategy.*`")
    num_steps: int = _f(10, "denoising steps T of a rollout", ge=1, le=MAX_STEPS)
    noise_level: float = _f(DEFAULT_NOISE_LEVEL, "SDE noise level a (flow_grpo, cps) or eta (dance)", ge=0.0)
    sde_kind: SDEKindName = _f("flow_grpo", "SDE discretisation (flowgrpo.samplers.sde)")
    cps_log_prob: LogProbConvention = _f("gaussian", "log-prob of CPS steps: gaussian (the transition's Gaussian density, as every other kind) | mse (Flow-GRPO-Fast's -mean((x' - mu)^2), a Gaussian with std 1/sqrt(2) up to a constant)")
    shift: float = _f(1.0, "timestep shift s of the sigma grid (with sampler.grid=model, models whose pipeline owns its grid, e.g. sd3, ignore it)", gt=0.0)
    grid: Literal["model", "shift"] = _f("model", "sigma grid of the training rollouts: model (the policy's own: a diffusers pipeline's scheduler, e.g. FLUX.1's dynamic shift; the shapes world's uniform grid shifted by sampler.shift) | shift (uniform in sigma, then shifted by sampler.shift, whatever the pipeline's scheduler: DanceGRPO's and MixGRPO's sd3_time_shift grid); evaluation and sample grids keep the model's")
    shared_group_noise: bool = _f(False, "all members of a group start from the same initial noise (DanceGRPO)")
    max_micro_batch: int | Literal["auto"] = _f(256, "largest model batch during rollouts, in samples before CFG doubling (nodes of one depth are chunked by it) | auto (the largest whose rollout phase fits the GPU's memory, counted from the loaded modules at start, at most a process's samples per iteration; off CUDA every sample of a depth in one call: flowgrpo.realsize.micro_batch)", ge=1)


@dataclass
class DataConfig:
    prompts: str = _f("shapes", "prompt source: 'shapes' (procedural world) or a .txt/.jsonl prompt file")
    prompts_per_iteration: int = _f(8, "distinct prompts per iteration", ge=1)
    trees_per_prompt: int = _f(8, "initial noises (rollout trees) per prompt. A chain is a tree with one leaf, so for chain strategies this is the GRPO group size; tree strategies have trees_per_prompt x leaves-per-tree samples per prompt (formerly data.group_size)", ge=1)
    curriculum: Literal["none", "signal"] = _f("none", "none: prompts drawn uniformly | signal: prompt keys whose groups recently had reward spread (the groups that train) are drawn more often, weight max(moving-average signal rate, curriculum_floor) (flowgrpo.curriculum)")
    curriculum_floor: float = _f(0.1, "signal curriculum: smallest weight of a key, so solved or hopeless keys stay in the mix (1 = uniform)", gt=0.0, le=1.0)
    curriculum_rate: float = _f(0.2, "signal curriculum: moving-average step per observed group", gt=0.0, le=1.0)
    curriculum_key: Literal["auto", "tag", "prompt"] = _f("auto", "signal curriculum keys: tag (the shapes world's tags; a .jsonl file's tag column) | prompt (each prompt of a file) | auto (tags where the source has more than one)")


@dataclass
class RewardConfig:
    weights: dict = _f({"shapes": 1.0}, "reward name -> weight (names from `flowgrpo.rewards.REWARDS`)")
    combine: Literal["sum_then_normalize", "normalize_then_sum"] = _f("sum_then_normalize", "sum_then_normalize (Flow-GRPO) | normalize_then_sum (MixGRPO, Pref-GRPO)")
    options: dict = _f({}, "reward name -> {option: value} passed to the reward's factory (e.g. reward.options.hpsv2.checkpoint=/path/HPS_v2.1_compressed.pt); `flowgrpo.rewards.build_reward` lists a reward's valid options on a miss")
    frame_stride: int = _f(1, "videos [B, F, 3, H, W]: every reward scores frames 0, s, 2s, ... and averages per video (flowgrpo.rewards.video)", ge=1)
    renormalize: bool = _f(False, "normalize_then_sum with several rewards: z-score the weighted sum of z-scores again per group (the references do not)")
    waves: int = _f(1, "roll out each process's trees in this many waves of whole groups and score wave k (decode + every reward) on a worker thread while wave k + 1 samples: collect time tends to max(sampling, scoring) instead of their sum (flowgrpo.trainer.waves); 1 = one batch, scored after it", ge=1)
    overlap: bool = _f(True, "with waves > 1: score on a worker thread while the next wave samples (false: score each wave right after it, the same numbers, for comparison)")


@dataclass
class AdvantageConfig:
    estimator: str = _f("group_zscore", "advantage estimator: see `flowgrpo.advantages.ESTIMATORS`")
    std: Literal["group", "global"] = _f("group", "normalise by the std of each group (group) or of the whole batch (global)")
    std_estimator: Literal["population", "unbiased"] = _f("population", "population std (divide by n: Flow-GRPO) | unbiased (n - 1: DanceGRPO, MixGRPO, BranchGRPO)")
    clip: float = _f(5.0, "advantages are clipped to +-clip", gt=0.0)
    eps: float = _f(1e-4, "added to the std before dividing (Flow-GRPO 1e-4; DanceGRPO/MixGRPO/BranchGRPO 1e-8)", ge=0.0)
    fusion_beta: float = _f(0.0, "branch_grpo estimator: reward fusion r(n) = sum_l softmax(beta log p(l | n)) r_l (0: mean of descendant leaves; 1: path probability)")


@with_objective_options  # + one options field per registered objective: loss.grpo, loss.nft, ... (flowgrpo.objectives)
@dataclass
class LossConfig:
    objective: str = _f("grpo", objective_help())
    # read by the trainer for every objective (the policy's guided forward in the update), so not loss.<objective>
    cfg_uncond_grad: bool = _f(True, "with classifier-free guidance in the update: gradients flow through the unconditional pass too (false: it runs without gradient in its own call, as Flow-GRPO's train_sd3.py detaches noise_pred_uncond; the same velocities, about 1.5x less backward work; SD3 / SD3.5 and Wan 2.1 adapters)")

    def __getattr__(self, name: str):
        """``cfg.loss.kl_beta`` and GRPO's other keys from before ``loss.grpo``: read through to
        ``cfg.loss.grpo`` (a DeprecationWarning), for code and plug-ins not yet moved. Only called for a
        name the instance lacks."""
        new = _GRPO_ATTRS.get(name)
        if new is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"cfg.loss.{name} is now cfg.loss.grpo.{new}", DeprecationWarning, stacklevel=2)
        return getattr(self.grpo, new)

    def __setattr__(self, name: str, value) -> None:
        if name in _GRPO_ATTRS:  # would otherwise add an attribute nothing reads
            raise AttributeError(f"cfg.loss.{name} is now cfg.loss.grpo.{_GRPO_ATTRS[name]}")
        super().__setattr__(name, value)


#: LossConfig's attributes that moved into ``loss.grpo``: old name -> name in GRPOOptions
_GRPO_ATTRS = {old.split(".")[1]: new[0].split(".")[2] for old, new in
               ((o, (n,) if isinstance(n, str) else n) for o, n in RENAMED_KEYS.items())
               if old.startswith("loss.") and old.count(".") == 1 and new[0].startswith("loss.grpo.")}


@dataclass
class TrainConfig:
    iterations: int = _f(100, "outer iterations (rollout + update)", ge=1)
    max_minutes: float = _f(0.0, "stop after this many minutes of training wall-clock (0 = no limit)", ge=0.0)
    clock: Literal["wall", "cpu"] = _f("wall", "what train.max_minutes and eval.every_minutes count: wall (wall-clock) | cpu (the process's CPU time, for comparing recipes on a busy machine: runs sharing it get the same budget while each keeps a core to itself; processes time-sliced on one core spend more CPU time on the same work, so a run that got under 0.85 of its cores (the CPU-seconds over the wall-seconds of its iterations: cpu_s and iter_s in metrics.jsonl) says so when it ends)")
    lr: float = _f(3e-4, "AdamW learning rate", gt=0.0)
    lr_schedule: Literal["constant", "cosine", "linear"] = _f("constant", "learning rate over the run, as a fraction of train.lr: constant | cosine | linear (from 1 down to train.lr_final, over the run's progress: the larger of the iterations and the train.max_minutes done; flowgrpo.trainer.lr_schedule)")
    lr_final: float = _f(0.1, "the learning rate at the run's end as a fraction of train.lr, for train.lr_schedule cosine | linear", ge=0.0, le=1.0)
    weight_decay: float = _f(1e-4, "AdamW weight decay", ge=0.0)
    adam_betas: list = _f([0.9, 0.999], "AdamW betas")
    adam_eps: float = _f(1e-8, "AdamW epsilon", gt=0.0)
    max_grad_norm: float = _f(1.0, "gradient clipping norm", gt=0.0)
    inner_epochs: int = _f(1, "passes over one iteration's rollouts", ge=1)
    minibatches: int = _f(1, "optimizer steps per inner epoch (samples split into this many minibatches)", ge=1)
    micro_batch: int = _f(64, "transitions per forward/backward", ge=1)
    fold_lora: Literal["auto", "always", "never"] = _f("auto", "how the GRPO update runs a float32 LoRA layer: always (one linear with W + s B A, gradients to A and B through it) | never (peft's W x + s B A x) | auto (folded where that is fewer FLOPs: rank a large share of the layer's width, e.g. tiny models; never a real model's wide layers); same gradients up to float rounding (flowgrpo.objectives.lora_fold)")
    timestep_fraction: float = _f(1.0, "fraction of trainable SDE steps used for the update", gt=0.0, le=1.0)
    timestep_order: Literal["ordered", "random"] = _f("ordered", "ordered (the first fraction of steps) | random (a fresh random subset each iteration)")
    ema: bool = _f(True, "keep an EMA of the trainable weights (used for evaluation)")
    ema_decay: float = _f(0.9, "EMA decay per iteration", ge=0.0, lt=1.0)
    ema_device: Literal["auto", "cpu"] = _f("auto", "where the EMA of the trainable weights lives: auto (beside them, on the run's device) | cpu (in CPU memory: one device-to-host copy of the trainable weights per iteration; useful for full fine-tuning, where the EMA is a whole weight copy); one process or DDP only (FSDP shards it with the weights)")
    old_policy_device: Literal["auto", "cpu"] = _f("auto", "where the objective's lagging copies of the trainable weights live (DiffusionNFT's old policy, AWM's rollout weights and EMA reference, DGPO's EMA, CRD's old and sampling policies): auto (beside them, on the run's device) | cpu (in CPU memory, and the live weights wait there while a copy runs: each old-policy forward copies the weights to the device and back; useful for full fine-tuning, where each copy is a whole weight copy); one process or DDP only (FSDP shards them with the weights)")
    seed: int = _f(0, "seed of every random choice (prompts, noise, subsets); runs are reproducible", ge=0, le=2**63 - 1)
    threads: int = _f(0, "torch CPU threads (0 = torch default); at most the machine's CPU count", ge=0)
    deterministic: bool = _f(True, "torch deterministic algorithms (resume reproduces an uninterrupted run)")


@dataclass
class EvalConfig:
    evaluator: str = _f("auto", "held-out evaluator: auto (the model's own, e.g. shapes accuracy for the shapes world; none for models without one) | none | a name from `flowgrpo.evaluation.EVALUATORS`")
    num_prompts: int = _f(64, "held-out prompts", ge=1)
    seen: bool = _f(True, "also evaluate on prompts from the training pools before and after (reported as eval_*_seen)")
    seeds_per_prompt: int = _f(4, "fixed seeds per held-out prompt", ge=1)
    num_steps: int = _f(20, "ODE steps for evaluation", ge=1, le=MAX_STEPS)
    every: int = _f(0, "evaluate every N iterations during training (0 = only before and after)", ge=0)
    every_minutes: float = _f(0.0, "evaluate every N minutes of training wall-clock (0 = off); the clock is paused while evaluating", ge=0.0)
    options: dict = _f({}, "options of the selected evaluator (e.g. eval.options.judge_url=... for unigenbench); the evaluator lists its valid options on a miss")


@dataclass
class LogConfig:
    out_dir: str = _f("runs", "parent folder of run directories")
    run_name: str = _f("", "run directory name (default: preset + timestamp)")
    checkpoint_every: int = _f(10, "write a checkpoint every N iterations (and at the end)", ge=1)
    grid_every: int = _f(25, "write a sample grid every N iterations (0 = never)", ge=0)
    trackers: list = _f(["tensorboard"], "experiment trackers, through accelerate's: any of tensorboard | wandb | mlflow | comet_ml | aim | clearml | dvclive | swanlab | trackio ([] = none; metrics.jsonl is always written). Each logs from the main process into the run directory where it has a local mode (W&B: set WANDB_MODE=offline to stay local)")
    project: str = _f("flowgrpo", "project name the trackers file the run under (the run directory's name is the run's)")
    progress: bool = _f(True, "show a rich progress bar")


@dataclass
class DistConfig:
    timeout_s: float = _f(600.0, "multi-process runs: seconds a collective waits for the other processes; a rank that died or hangs longer stops the run with an error naming it (the last checkpoint resumes). The other ranks wait while the main process evaluates and writes checkpoints, so keep it above the longest of those", gt=0.0)
    context_parallel: int = _f(1, "processes that split one video's tokens (context parallelism, diffusers' Ulysses attention): groups of this many consecutive ranks hold the same samples and each runs the transformer on 1/N of every sample's tokens; data parallelism runs over the groups. Must divide the number of processes, the attention heads and a sample's tokens; adapters: wan (docs/distributed.md)", ge=1)


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
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    strategy: dict = _f({}, "options of sampler.strategy (window, splits, ...; `flowgrpo config explain strategy` lists them per strategy); a preset, config file or set of overrides that selects another sampler.strategy starts from that strategy's defaults")
    preset: str = _f("", "name of the method preset this config came from")
    recipe: str = _f("", "name of the recipe (the world or model family, `flowgrpo recipes`) this config was composed on")
    description: str = _f("", "one line saying what this configuration is (shown by `flowgrpo presets`)")


# --------------------------------------------------------------------------- merging and validation


#: option mappings that a layer merges key by key: (section, key, what the mapping holds)
_MERGED_OPTIONS = (("reward", "options", "reward name -> options"), ("eval", "options", "option -> value"),
                   ("monitor", "reward_options", "reward name -> options"))


def apply_dict(cfg: Any, data: dict, prefix: str = "") -> None:
    """Merge a nested dict into ``cfg`` in place, refusing unknown keys and wrong types.

    On a :class:`RunConfig`: renamed keys are moved (with a warning); ``reward.options``,
    ``eval.options`` and ``monitor.reward_options`` merge key by key, so ``eval.options.seed=3``
    keeps a recipe's ``eval.options.bench``; a layer that selects another ``sampler.strategy`` /
    ``eval.evaluator`` starts the ``strategy`` / ``eval.options`` from empty (another's options
    would be unknown keys to it).
    """
    if isinstance(cfg, RunConfig) and isinstance(data, dict):
        data = move_renamed(data)
        sampler = data.get("sampler")
        new_strategy = sampler.get("strategy") if isinstance(sampler, dict) else None
        if new_strategy is not None and new_strategy != cfg.sampler.strategy:
            cfg.strategy = {}
        evaluation = data.get("eval")
        new_evaluator = evaluation.get("evaluator") if isinstance(evaluation, dict) else None
        if new_evaluator is not None and new_evaluator != cfg.eval.evaluator:
            cfg.eval.options = {}
        options = data.pop("strategy", None)
        merged = [(section, key, what, data[section].pop(key)) for section, key, what in _MERGED_OPTIONS
                  if isinstance(data.get(section), dict) and key in data[section]]
        merge_into(cfg, data, prefix)
        if isinstance(cfg.reward.weights, dict):  # a file's `w: 1e-2` is a string to YAML 1.1, as in coerce
            cfg.reward.weights = {k: float(v) if isinstance(v, str) and as_number(v) is not None else v
                                  for k, v in cfg.reward.weights.items()}
        for section, key, what, value in merged:  # like the strategy's options, below
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{section}.{key}' must be a mapping of {what}")
            deep_merge(getattr(getattr(cfg, section), key), value)
        if options is not None:
            if not isinstance(options, dict):
                raise ConfigError(f"config section 'strategy' must be a mapping, got {type(options).__name__}")
            cfg.strategy.update(options)  # strategy options merge, so a preset can set a subset
        return
    merge_into(cfg, data, prefix)


def apply_overrides(cfg: Any, overrides) -> None:
    """Apply ``key.sub=value`` ``overrides`` to ``cfg`` as one layer, as :func:`load_config` does (two
    ``eval.options.*`` overrides both count, whatever their order)."""
    merged: dict = {}
    for override in overrides:
        deep_merge(merged, parse_override(override))
    apply_dict(cfg, merged)


# --------------------------------------------------------------------------- composing


def compose_config(preset: str | None = RECIPE_METHOD, config_file: str | None = None, overrides: list[str] = (),
                   recipe: str | None = None) -> Composed:
    """The layers composed into a :class:`RunConfig` (unvalidated) with each key's source:
    :func:`flowgrpo.config.layers.compose` over this module's dataclasses and merge rules. A key that a
    config file or an override sets and the objective would ignore is refused here, where the
    sources are known (:func:`~flowgrpo.objectives.check_objective_keys`)."""
    composed = compose(RunConfig, apply_dict, preset, config_file, overrides, recipe)
    check_objective_keys(composed.config, composed.sources)
    return composed


def load_config(preset: str | None = RECIPE_METHOD, config_file: str | None = None, overrides: list[str] = (),
                recipe: str | None = None) -> RunConfig:
    """Build a validated :class:`RunConfig`: defaults <- recipe <- method preset <- the recipe's settings
    for that preset <- config file <- overrides (:mod:`flowgrpo.config.layers`).

    ``preset``: a method preset, None for none, or (the default) the recipe's own method
    (``DEFAULT_PRESET`` on the shapes world). ``recipe``: a recipe name; None picks the shapes world,
    or the ``diffusers`` recipe when the file or overrides name another model."""
    cfg = compose_config(preset, config_file, overrides, recipe).config
    validate(cfg)
    return cfg


#: the bounded numeric fields, ``{"section.key": {"ge" | "gt" | "lt" | "le": bound}}``: the bounds are
#: written beside each field (``_f(..., ge=0.0)``) and checked by :func:`flowgrpo.fields.check_ranges`
RANGES = field_ranges(RunConfig)


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)
