"""The trainer: orchestrates collect (rollout + rewards) -> credit (advantages) -> update (objective).

One outer iteration n (:meth:`Trainer.iteration_step`):
  1. **collect** (:meth:`Trainer.collect`): the strategy turns n into a sampling plan; prompts and
     noise come from generators seeded by (seed, n) (:mod:`flowgrpo.seeds`), so an iteration is
     reproducible on its own (this is what makes resume exact); the sampler rolls out a forest
     without gradients and the rewards score its decoded leaves;
  2. **credit** (:meth:`Trainer.credit`): the advantage estimator assigns credit over the whole
     iteration's forest (every rank the same numbers); it also decides which edges carry signal,
     strategies may prune more, and the trained steps are chosen;
  3. **update** (:meth:`Trainer.update`): the objective (``loss.objective``, :mod:`flowgrpo.objectives`)
     turns both into rows and losses; the shared loop (:mod:`.update_loop`) runs epochs, minibatches,
     accumulation and the optimizer steps;
  4. the EMA of the trainable weights is updated (:mod:`.ema`); metrics are returned (the run loop writes grids
     and checkpoints).

Each stage is a method with typed inputs and outputs (:class:`~flowgrpo.objectives.Collected`,
:class:`~flowgrpo.objectives.Credit`), so a benchmark or a new objective can call one stage
without re-implementing the others. The trainer runs seven parts (policy, rewards, strategy,
sampler, estimator, objective, prompts: :mod:`.parts`); :meth:`Trainer.from_config` builds them all
from a config, and any of them may be handed in instead (docs/api.md).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..advantages import ESTIMATORS, AdvantageResult, valid_reward_mask
from ..config import RunConfig
from ..curriculum import groups_with_signal
from ..objectives import Collected, Credit, UpdateContext, build_objective
from ..objectives.old_policy import copy_loaded, lerp_toward, old_policy_home, trainable_copy, trainable_weights_loaded
from ..policies import build_policy
from ..realsize.micro_batch import AUTO, choose_rollout_micro_batch
from ..references import resize_references
from ..errors import ConfigError, UserError
from ..rewards import REWARDS, check_rewards_fit_model
from ..rewards.base import check_metadata
from ..rewards.video import score_frames
from ..samplers.forest import Rollout
from ..samplers.forest_sampler import ForestSampler
from ..samplers.strategies import build_strategy
from ..seeds import ROLLOUT, STEP_SUBSET, derive_seed
from ..callbacks import CallbackList
from . import context_parallel
from .data_parallel import DataParallel
from .ema import ema_home
from .prompt_set import precompute_run_prompts
from .parts import build_prompts, build_rewards, check_references, model_grid, reward_parts
from .update_loop import run_update, update_rng
from .waves import collect_in_waves, wave_ranges


@dataclass
class IterationResult:
    """One iteration's outcome: its metrics, this rank's rollout and decoded leaves
    ([L_local, 3, H, W] or videos [L_local, F, 3, H, W]), and the whole iteration's advantages."""

    metrics: dict
    rollout: Rollout
    images: torch.Tensor
    advantages: AdvantageResult | None = None
    leaf_rewards: torch.Tensor | None = None  # [L_local] weighted reward sum of this rank's leaves (NaN: a reward failed)


class Trainer:
    """Holds the policy, optimizer, EMA, objective and the pipeline stages; :meth:`iteration_step`
    runs one iteration.

    Checkpoint/resume state is :meth:`state_dict` / :meth:`load_state_dict`. The run loop (run
    directory, logging, evaluation) lives in :mod:`flowgrpo.trainer.run`.
    """

    def __init__(self, cfg: RunConfig, accelerator=None, objective=None, *, policy=None, rewards=None,
                 strategy=None, sampler=None, estimator=None, prompts=None, callbacks=()):
        """Args: cfg, the run's configuration (every hyperparameter, and the parts not handed in);
        accelerator, an accelerate ``Accelerator`` (default: one made from ``cfg``); objective, policy,
        rewards, strategy, sampler, estimator, prompts: the parts (:mod:`.parts`), each replacing the one
        its config key names (None: built from ``cfg``). ``rewards`` maps names to rewards or to any
        callable ``(images, prompts, **metadata) -> scores`` (a name missing from ``reward.weights``
        weighs 1.0); ``sampler`` must sample ``policy``. callbacks: :class:`~.callbacks.Callback` s or
        functions ``(trainer, metrics)`` that the run loop calls (:mod:`.callbacks`)."""
        from .accelerator import make_accelerator, weight_engine

        if not isinstance(cfg, RunConfig):  # was an AttributeError deep inside ('str' has no attribute 'train')
            raise TypeError(f"a Trainer is built from a flowgrpo.RunConfig (load_config(...)), got {type(cfg).__name__}")
        if rewards is not None:
            rewards, cfg = reward_parts(rewards, cfg)
        self.cfg = cfg
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if tc.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.accelerator = accelerator or make_accelerator(cfg)
        self.dp = DataParallel(self.accelerator, cfg.dist.context_parallel)
        self.engine = weight_engine(self.accelerator, self.dp)  # whole weights, FSDP shards or DeepSpeed ZeRO
        context_parallel.check_degree(cfg.dist.context_parallel, self.dp.processes, self.engine.name)
        self.dp.equal_shards = self.engine.lockstep
        if cfg.reward.waves > 1 and self.engine.lockstep:
            # waves cut at group boundaries, which fall differently in each rank's shard: the ranks would
            # make different numbers of model calls, and a sharded engine gathers weights on every call
            raise ConfigError(f"reward.waves={cfg.reward.waves} cannot run under {type(self.engine).__name__} "
                              "(FSDP / DeepSpeed ZeRO need the same model calls on every rank): use reward.waves=1 "
                              "or DDP")
        self.dp.tree_shard(cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt)  # fail now if too few trees
        torch.manual_seed(tc.seed)  # adapter initialisation
        # rewards first: a reward that cannot read this model's images fails before the model loads
        self.rewards = rewards if rewards is not None else build_rewards(cfg)
        if policy is None:
            check_rewards_fit_model(self.rewards, cfg.model)
        self.policy = (policy if policy is not None else build_policy(cfg.model)).to(self.accelerator.device)
        if not cfg.loss.cfg_uncond_grad:
            if not self.policy.can_detach_uncond:
                raise ConfigError(f"loss.cfg_uncond_grad=false is not supported by {type(self.policy).__name__} "
                                  "(it replays the pipeline's guidance calls as recorded); use loss.cfg_uncond_grad=true")
            self.policy.uncond_grad = False
        if cfg.model.reference_device != "auto":
            if not callable(getattr(self.policy, "set_reference_device", None)):
                raise ConfigError(f"model.reference_device={cfg.model.reference_device} needs a policy that keeps "
                                  f"a frozen reference copy; {type(self.policy).__name__} has none")
            self.policy.set_reference_device(cfg.model.reference_device)
        self.objective = objective if objective is not None else build_objective(cfg, self.accelerator.device)
        if self.objective.lagging_copies:  # whole host copies are refused under FSDP, in one line
            old_policy_home(tc, self.engine.name)
        if self.objective.needs_reference:
            self.policy.snapshot_reference()
        if cfg.dist.context_parallel > 1:  # after the reference copy, which splits its tokens too
            context_parallel.check_policy(self.policy, cfg.dist.context_parallel, cfg.model.name)
            context_parallel.enable(self.policy, cfg.dist.context_parallel, self.dp.processes, self.accelerator.device)
        self.engine.prepare(self.policy)  # before the optimizer and EMA see the parameters
        params = self.policy.trainable_parameters()
        if not params:
            raise ValueError("the policy has no trainable parameters (model.train_mode?)")
        # The policy stays unwrapped (its methods, not only forward, are called); the engine takes the optimizer.
        self.engine.attach_optimizer(torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.adam_betas), eps=tc.adam_eps,
                                                       weight_decay=tc.weight_decay), self.policy, tc.max_grad_norm)
        self.strategy = strategy if strategy is not None else build_strategy(
            cfg.sampler, cfg.strategy, grid=model_grid(self.policy, cfg.sampler))
        micro = cfg.sampler.max_micro_batch  # "auto": resolved below, once the run's modules are all set
        self.sampler = sampler if sampler is not None else ForestSampler(self.policy, 1 if micro == AUTO else micro)
        if self.sampler.policy is not self.policy:
            raise UserError("the sampler part samples another policy than the trainer's: build it as "
                            "ForestSampler(policy, ...) over the policy part")
        self.estimator = estimator if estimator is not None else ESTIMATORS.get(cfg.advantage.estimator)
        self.prompts = prompts if prompts is not None else build_prompts(cfg)
        self.curriculum = getattr(self.prompts, "curriculum", None)
        check_references(cfg, self.prompts, self.policy, self.rewards)
        check_metadata(self.rewards, cfg.data.prompts, self.prompts.has_metadata)
        self.objective.setup(self.policy)  # before the EMA copies the weights, which setup may set (Flow-OPD's merge)
        #: where the EMA lives: None (beside the weights) or "cpu" (train.ema_device)
        self.ema_home = ema_home(tc, self.engine.name)
        self.ema = trainable_copy(self.policy, self.ema_home) if tc.ema else None
        if cfg.model.precompute_prompts:  # after the objective's setup, which may encode the empty prompt
            precompute_run_prompts(cfg, self.prompts, self.policy, self.dp.is_main)
        #: what ``sampler.max_micro_batch=auto`` resolved to (None: a number was configured)
        self.micro_batch_fit = None
        if micro == AUTO and hasattr(self.sampler, "max_micro_batch"):
            self.micro_batch_fit = choose_rollout_micro_batch(self)
            self.sampler.max_micro_batch = min(self.dp.gather(self.micro_batch_fit.micro_batch))  # ranks agree
        self.callbacks = CallbackList(callbacks)
        self.iteration = 0

    @classmethod
    def from_config(cls, cfg: RunConfig, accelerator=None, callbacks=(), **parts) -> "Trainer":
        """The trainer ``cfg`` describes, every part built from it (the CLI's trainer, bit for bit);
        ``parts`` (keywords of :class:`Trainer`) replace single parts."""
        return cls(cfg, accelerator, callbacks=callbacks, **parts)

    @property
    def optimizer(self):
        """The AdamW the engine steps (accelerate's wrapper, or DeepSpeed's partitioned optimizer)."""
        return self.engine.optimizer

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Iteration, trainable weights, optimizer and EMA as whole tensors (the same checkpoint
        whatever the number of processes; with sharded weights a collective: call it on every rank)."""
        return {
            "iteration": self.iteration,
            "trainable": self.engine.full(self.policy.trainable_state_dict()),
            "optimizer": self.engine.optimizer_state_dict(),
            "ema": self.engine.full(self.ema),
            "objective": self.objective.state_dict(),
            "curriculum": self.curriculum.state_dict() if self.curriculum is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.iteration = state["iteration"]
        self.engine.load_weights(self.policy, state["trainable"])
        self.engine.load_optimizer_state_dict(state["optimizer"])
        self.ema = None if state["ema"] is None else copy_loaded(state["ema"], self.policy, self.ema_home)
        self.objective.load_state_dict(state.get("objective") or {})
        if self.curriculum is not None:
            self.curriculum.load_state_dict(state.get("curriculum") or {})

    def ema_weights(self):
        """Context manager: the policy runs with the EMA weights inside (no-op without EMA); the live
        weights wait where the EMA lives (train.ema_device)."""
        if self.ema is None:
            return contextlib.nullcontext()
        return trainable_weights_loaded(self.policy, self.ema, stash=self.ema_home)

    # ------------------------------------------------------------------ one iteration
    @torch.no_grad()
    def decode_leaves(self, rollout: Rollout, chunk: int = 64) -> torch.Tensor:
        x = rollout.leaves.x
        return torch.cat([self.policy.decode(x[i:i + chunk]).float().cpu() for i in range(0, x.shape[0], chunk)])

    def score(self, images: torch.Tensor, prompts: list[str], groups: torch.Tensor | None = None,
              references: list[torch.Tensor] | torch.Tensor | None = None,
              metadata: list[dict] | None = None) -> tuple[dict, dict]:
        """Rewards [L] per name, plus named components for logging. Every reward also receives the
        leaves' group ids [L] (pairwise rewards compare within a group); videos are scored every
        ``reward.frame_stride``-th frame and averaged. ``references`` (image editing: each leaf's
        reference image, [3, h, w] in [0, 1]) reach the rewards that declare ``wants_references``,
        resized to the images' size ([L, 3, H, W]); ``metadata`` (each leaf's prompt line of a .jsonl
        prompt file) reach the rewards that declare ``wants_metadata``."""
        scores, comps = {}, {}
        if references is not None:
            references = resize_references(references, images.shape[-2], images.shape[-1])
        for name, fn in self.rewards.items():
            out = score_frames(fn, images, prompts, groups, self.cfg.reward.frame_stride, references, metadata)
            scores[name] = out.scores.float().cpu()
            for k, v in out.components.items():
                comps[f"{name}.{k}"] = v.float().cpu()
        return scores, comps

    def select_steps(self, plan, iteration: int) -> list[int]:
        """The trained SDE steps of this iteration (a fraction, in order or a random subset)."""
        steps = plan.trained_steps()
        k = max(1, int(round(len(steps) * self.cfg.train.timestep_fraction)))
        if k >= len(steps):
            return steps
        if self.cfg.train.timestep_order == "random":
            rng = np.random.default_rng([self.cfg.train.seed, iteration, STEP_SUBSET])
            return sorted(rng.choice(steps, size=k, replace=False).tolist())
        return steps[:k]

    # ------------------------------------------------------------------ the three stages
    def collect(self, iteration: int) -> Collected:
        """Roll out iteration ``iteration``'s forest (this rank's trees) and score its leaves; the
        rewards are gathered into the whole forest's leaf order."""
        cfg = self.cfg
        plan = self.strategy.plan(iteration)
        drawn = self.prompts.draw(iteration, cfg.data.prompts_per_iteration)
        prompts = drawn.prompts
        gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, iteration, ROLLOUT))
        self.policy.eval()
        refs = drawn.references  # image editing: one reference image per prompt, else None
        # once per iteration: the rollout and the update share it
        cond = self.policy.encode_prompts(prompts) if refs is None else self.policy.encode_prompts(prompts, refs)
        per_prompt = cfg.data.trees_per_prompt
        shard = self.dp.tree_shard(len(prompts) * per_prompt)
        noise_state = gen.get_state()  # every wave draws its trees' noise from the same state

        def sample(trees: range) -> Rollout:
            wave_gen = torch.Generator()
            wave_gen.set_state(noise_state)
            return self.sampler.rollout(plan, prompts, per_prompt, wave_gen, cfg.sampler.shared_group_noise,
                                        cond=cond, trees=trees)

        def score(ro: Rollout):
            images = self.decode_leaves(ro)
            if not self.dp.is_leader:  # a context-parallel group scores once: its leader shares the rewards
                return images, {}, {}
            leaf_prompt = ro.tree_prompt[ro.leaf_tree].tolist()
            leaf_refs = None if refs is None else [refs[i] for i in leaf_prompt]
            leaf_meta = None if drawn.metadata is None else [drawn.metadata[i] for i in leaf_prompt]
            return (images, *self.score(images, ro.leaf_prompts, ro.leaf_groups, leaf_refs, leaf_meta))

        waves = wave_ranges(shard, per_prompt, cfg.reward.waves)
        with self.objective.rollout_weights(self.policy):  # e.g. DiffusionNFT samples with its old policy
            wc = collect_in_waves(waves, sample, score, overlap=cfg.reward.overlap and len(waves) > 1)
        rollout, images, local_rewards, local_comps = wc.rollout, wc.images, wc.rewards, wc.components
        view = self.dp.forest_view(rollout)
        rewards = view.gather_leaf_values(local_rewards)
        for name, r in rewards.items():
            if r.numel() and not torch.isfinite(r).any():  # the whole iteration: every rank stops together
                raise UserError(f"reward {name!r} gave NaN for all {r.numel()} images of iteration {iteration}: it "
                                f"cannot score this model's images or prompts (model.name={cfg.model.name!r}, "
                                f"data.prompts={cfg.data.prompts!r}); choose rewards for them with reward.weights=... "
                                f"(valid: {', '.join(REWARDS.names())})")
        return Collected(iteration=iteration, plan=plan, cond=cond, rollout=rollout, images=images, view=view,
                         rewards=rewards, components=view.gather_leaf_values(local_comps),
                         seconds=wc.sample_seconds, collect_seconds=wc.seconds, prompt_keys=drawn.keys)

    def credit(self, col: Collected) -> Credit:
        """Advantages over the whole iteration's forest, the edges that may train (a leaf with
        signal below them, minus strategy pruning) and the trained plan steps."""
        cfg, whole = self.cfg, col.view.whole
        adv = self.estimator(whole, col.rewards, cfg.advantage, cfg.reward)
        edge_masks = [None] + [whole.mean_over_descendants(adv.leaf_mask.float(), d) > 0
                               for d in range(1, len(whole.levels))]
        pruning = self.strategy.pruning(whole, adv, col.iteration)
        pruned_edges = None
        if pruning.edges is not None:  # backward-only pruning: the rollout and rewards are untouched
            pruned_edges = int(sum(int((~p).sum()) for p in pruning.edges if p is not None))
            edge_masks = [m if p is None else (p if m is None else m & p) for m, p in zip(edge_masks, pruning.edges)]
        valid = valid_reward_mask({k: r.cpu() for k, r in col.rewards.items()}) if col.rewards else None
        return Credit(advantages=adv, edge_masks=edge_masks, pruned_edges=pruned_edges,
                      steps=self.select_steps(col.plan, col.iteration), leaf_valid=valid, leaf_kept=pruning.leaves)

    def observe_signal(self, col: Collected, adv: AdvantageResult) -> dict[str, float]:
        """Tell the curriculum which of the iteration's groups had signal; its weights as metrics
        (``curriculum.<key>``, for at most 16 keys) or their effective number of keys."""
        if self.curriculum is None:
            return {}
        whole = col.view.whole
        signal = groups_with_signal(whole.leaf_groups, adv.leaf_mask, len(col.prompt_keys))
        self.curriculum.observe(col.prompt_keys, signal)
        keys = sorted(self.curriculum.signal)
        w = self.curriculum.weights(keys)
        if len(keys) <= 16:
            return {f"curriculum.{k}": float(p) for k, p in zip(keys, w)}
        return {"curriculum.effective_keys": float(1.0 / (w**2).sum())}

    def update_context(self, col: Collected, cr: Credit) -> UpdateContext:
        """The context the objective's update of one iteration reads."""
        return UpdateContext(cfg=self.cfg, policy=self.policy, collected=col, credit=cr,
                             device=self.accelerator.device, dtype=self.sampler.model_dtype, dp=self.dp,
                             rng=update_rng(self.cfg.train.seed, col.iteration), autocast=self.accelerator.autocast,
                             lockstep=self.engine.lockstep)

    def update(self, col: Collected, cr: Credit) -> dict[str, float]:
        """The objective's update over one iteration (every epoch and minibatch); pooled metrics."""
        ctx = self.update_context(col, cr)
        return run_update(ctx, self.objective, self.engine, idle_pass=lambda: self._idle_pass(ctx))

    def _idle_pass(self, ctx: UpdateContext) -> None:
        """One zero-gradient padding pass of a lock-step engine (the objective's model calls)."""
        self.engine.backward(self.objective.idle_pass(ctx))

    def iteration_step(self) -> IterationResult:
        """Run outer iteration ``self.iteration`` (collect, credit, update, EMA) and advance it."""
        cfg, it = self.cfg, self.iteration
        compiling = bool(getattr(self.policy, "compile_transformer", False))
        c0 = compile_seconds() if compiling else 0.0
        t0 = time.perf_counter()
        col = self.collect(it)
        cr = self.credit(col)
        adv = cr.advantages
        curriculum_metrics = self.observe_signal(col, adv)
        t1 = time.perf_counter()
        train_stats = self.update(col, cr)
        t_train = time.perf_counter() - t1
        if self.ema is not None:
            lerp_toward(self.ema, self.policy, 1 - cfg.train.ema_decay, self.ema_home)
        metrics = {"iteration": it}
        for name, r in col.rewards.items():
            fin = torch.isfinite(r)
            metrics[f"reward.{name}"] = float(r[fin].mean()) if fin.any() else float("nan")
        for k, v in col.components.items():
            fin = torch.isfinite(v)
            metrics[f"reward.{k}"] = float(v[fin].mean()) if fin.any() else float("nan")
        metrics["reward_mean"] = adv.reward_mean
        metrics["nan_rewards_dropped"] = adv.nan_dropped
        metrics["zero_std_ratio"] = adv.zero_std_ratio
        metrics.update({f"advantage.{k}": v for k, v in adv.diagnostics.items()})
        metrics.update(curriculum_metrics)
        if cr.pruned_edges is not None:
            metrics["pruned_edges"] = cr.pruned_edges
        metrics.update(train_stats)
        metrics.update({"nfe_rollout": col.view.whole.nfe, "rollout_s": col.seconds,
                        "collect_s": col.collect_seconds, "train_s": t_train,
                        "iter_s": time.perf_counter() - t0, "trained_steps": len(cr.steps)})
        if compiling:  # torch.compile's share of iter_s: the first iteration's build, then recompilations
            metrics["compile_s"] = compile_seconds() - c0
        self.iteration += 1
        w = cfg.reward.weights
        local = col.view.local_leaves
        leaf_rewards = sum(wt * col.rewards[k].float()[local] for k, wt in w.items())
        return IterationResult(metrics, col.rollout, col.images, adv, leaf_rewards)


def compile_seconds() -> float:
    """Wall seconds ``torch.compile`` has spent compiling in this process (dynamo's frame and backward
    compiles, cumulative; 0.0 where this torch does not count them)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # a private torch API: its absence costs the metric, not the run
        return 0.0


def __getattr__(name: str):
    # the trainer runs every objective, not GRPO's alone: the old name warns for one release, then goes
    if name == "GRPOTrainer":
        import warnings

        warnings.warn("flowgrpo.trainer.trainer.GRPOTrainer is now Trainer; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
