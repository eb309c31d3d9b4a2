"""The GRPO trainer: orchestrates sampler -> rewards -> advantages -> loss -> optimizer.

One outer iteration n:
  1. the strategy turns n into a sampling plan; prompts and noise come from RNGs seeded by (seed, n),
     so an iteration is reproducible on its own (this is what makes resume exact);
  2. the sampler rolls out a forest without gradients;
  3. rewards score the decoded leaves; NaN rewards are dropped and counted;
  4. the advantage estimator assigns credit to every SDE edge;
  5. for each inner epoch and minibatch, the selected transitions are re-run with gradients and
     fed to the GRPO loss; gradients accumulate over all timesteps of the minibatch, then one
     AdamW step (with gradient clipping);
  6. the EMA of the trainable weights is updated; metrics, grids and checkpoints are written.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..advantages import AdvantageResult, estimate_advantages
from ..anchor import ode_anchor_loss
from ..clip_schedule import clip_range_for
from ..config import RunConfig
from ..data import PromptSource
from ..loss_weights import transition_weights
from ..ops import grpo_loss, grpo_loss_ref
from ..policies import build_policy
from ..rewards import build_reward
from ..rewards.video import score_frames
from ..samplers.forest import Rollout, TransitionBatch
from ..samplers.recompute import transition_log_prob_std, transition_means, transition_sigma_t
from ..samplers.rollout import ForestSampler
from ..samplers.schedule import sigma_grid
from ..samplers.strategies import build_strategy
from ..sft import best_path_sft_loss, best_paths
from ..sharded_tensors import like_param
from .data_parallel import DataParallel, ForestView
from .update_stats import UpdateStats, UpdateStatsCollector


@dataclass
class IterationResult:
    """One iteration's outcome: its metrics, this rank's rollout and decoded leaves
    ([L_local, 3, H, W] or videos [L_local, F, 3, H, W]), and the whole iteration's advantages."""

    metrics: dict
    rollout: Rollout
    images: torch.Tensor
    advantages: AdvantageResult | None = None


def _seed_for(seed: int, iteration: int, salt: int) -> int:
    return int(np.random.default_rng([seed, iteration, salt]).integers(2**62))


class GRPOTrainer:
    """Holds the policy, optimizer, EMA and the pipeline stages; :meth:`iteration` runs one step.

    Checkpoint/resume state is :meth:`state_dict` / :meth:`load_state_dict`. The run loop (run
    directory, logging, evaluation) lives in :mod:`flowgrpo.trainer.run`.
    """

    def __init__(self, cfg: RunConfig, accelerator=None):
        from .accelerator import make_accelerator, weight_engine

        self.cfg = cfg
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if tc.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.accelerator = accelerator or make_accelerator(cfg)
        self.dp = DataParallel(self.accelerator)
        self.engine = weight_engine(self.accelerator, self.dp)  # whole weights, FSDP shards or DeepSpeed ZeRO
        self.dp.equal_shards = self.engine.lockstep
        self.dp.tree_shard(cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt)  # fail now if too few trees
        torch.manual_seed(tc.seed)  # adapter initialisation
        self.policy = build_policy(cfg.model).to(self.accelerator.device)
        if cfg.loss.beta > 0 or cfg.loss.anchor_weight > 0:
            self.policy.snapshot_reference()
        self.engine.prepare(self.policy)  # before the optimizer and EMA see the parameters
        params = self.policy.trainable_parameters()
        if not params:
            raise ValueError("the policy has no trainable parameters (model.train_mode?)")
        # The policy stays unwrapped (its methods, not only forward, are called); the engine takes the optimizer.
        self.engine.attach_optimizer(torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.adam_betas), eps=tc.adam_eps,
                                                       weight_decay=tc.weight_decay), self.policy, tc.max_grad_norm)
        self.strategy = build_strategy(cfg.sampler, cfg.strategy, grid=self._model_grid())
        self.sampler = ForestSampler(self.policy, cfg.sampler.max_micro_batch)
        self.rewards = {name: build_reward(name, **cfg.reward.options.get(name, {})) for name in cfg.reward.weights}
        self.prompts = PromptSource(cfg.data.prompts, tc.seed)
        self.ema = {n: p.detach().clone() for n, p in self.policy.named_trainable_parameters()} if tc.ema else None
        if cfg.loss.backend == "reference":
            self.loss_fn = grpo_loss_ref
        elif cfg.loss.backend == "fused":
            self.loss_fn = functools.partial(grpo_loss, backend="fused")
        else:  # auto: the fused op where a kernel is built, else the reference (one warning)
            self.loss_fn = grpo_loss
        if cfg.loss.backend != "reference":
            # build/load the extension now, not inside the first (timed) iteration: a first JIT build
            # takes ~20 s, which would otherwise be charged to the training clock
            from ..ops import fused_available

            fused_available(self.accelerator.device)
        self.iteration = 0

    @property
    def optimizer(self):
        """The AdamW the engine steps (accelerate's wrapper, or DeepSpeed's partitioned optimizer)."""
        return self.engine.optimizer

    def _model_grid(self):
        """The policy's sigma grid as a function of T, or None where it is the sampler's default one."""
        cfg = self.cfg.sampler
        own = self.policy.sigma_grid(cfg.num_steps, cfg.shift)
        if torch.equal(own.cpu().float(), sigma_grid(cfg.num_steps, cfg.shift)):
            return None
        return lambda n: self.policy.sigma_grid(n, cfg.shift)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Iteration, trainable weights, optimizer and EMA as whole tensors (the same checkpoint
        whatever the number of processes; with sharded weights a collective: call it on every rank)."""
        return {
            "iteration": self.iteration,
            "trainable": self.engine.full(self.policy.trainable_state_dict()),
            "optimizer": self.engine.optimizer_state_dict(),
            "ema": self.engine.full(self.ema),
        }

    def load_state_dict(self, state: dict) -> None:
        self.iteration = state["iteration"]
        self.engine.load_weights(self.policy, state["trainable"])
        self.engine.load_optimizer_state_dict(state["optimizer"])
        if state["ema"] is None:
            self.ema = None
        else:
            live = dict(self.policy.named_trainable_parameters())
            self.ema = {n: like_param(t, live[n]) for n, t in state["ema"].items()}

    def ema_weights(self):
        """Context manager: the policy runs with the EMA weights inside (no-op without EMA)."""
        import contextlib

        @contextlib.contextmanager
        def swap():
            if self.ema is None:
                yield
                return
            live = self.policy.trainable_state_dict()
            self.policy.load_trainable_state_dict(self.ema)
            try:
                yield
            finally:
                self.policy.load_trainable_state_dict(live)

        return swap()

    # ------------------------------------------------------------------ one iteration
    @torch.no_grad()
    def decode_leaves(self, rollout: Rollout, chunk: int = 64) -> torch.Tensor:
        x = rollout.leaves.x
        return torch.cat([self.policy.decode(x[i:i + chunk]).float().cpu() for i in range(0, x.shape[0], chunk)])

    def score(self, images: torch.Tensor, prompts: list[str], groups: torch.Tensor | None = None) -> tuple[dict, dict]:
        """Rewards [L] per name, plus named components for logging. Every reward also receives the
        leaves' group ids [L] (pairwise rewards compare within a group); videos are scored every
        ``reward.frame_stride``-th frame and averaged."""
        scores, comps = {}, {}
        for name, fn in self.rewards.items():
            out = score_frames(fn, images, prompts, groups, self.cfg.reward.frame_stride)
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
            rng = np.random.default_rng([self.cfg.train.seed, iteration, 29])
            return sorted(rng.choice(steps, size=k, replace=False).tolist())
        return steps[:k]

    def iteration_step(self) -> IterationResult:
        """Run outer iteration ``self.iteration`` and advance it. Returns its metrics."""
        cfg, it = self.cfg, self.iteration
        t0 = time.perf_counter()
        plan = self.strategy.plan(it)
        prompts = self.prompts.batch(it, cfg.data.prompts_per_iteration)
        gen = torch.Generator().manual_seed(_seed_for(cfg.train.seed, it, 11))
        self.policy.eval()
        cond = self.policy.encode_prompts(prompts)  # once per iteration: the rollout and the update share it
        shard = self.dp.tree_shard(len(prompts) * cfg.data.trees_per_prompt)
        rollout = self.sampler.rollout(plan, prompts, cfg.data.trees_per_prompt, gen, cfg.sampler.shared_group_noise,
                                       cond=cond, trees=shard)
        images = self.decode_leaves(rollout)
        t_rollout = time.perf_counter() - t0
        local_rewards, local_comps = self.score(images, rollout.leaf_prompts, rollout.leaf_groups)
        # credit assignment sees the whole iteration's forest and rewards (every rank: the same numbers)
        view = self.dp.forest_view(rollout)
        whole = view.whole
        rewards, comps = view.gather_leaf_values(local_rewards), view.gather_leaf_values(local_comps)
        adv = estimate_advantages(cfg.advantage.estimator, whole, rewards, cfg.advantage, cfg.reward)
        edge_masks = [None] + [whole.mean_over_descendants(adv.leaf_mask.float(), d) > 0
                               for d in range(1, len(whole.levels))]
        pruned = self.strategy.edge_train_masks(whole, adv, it)
        pruned_edges = 0
        if pruned is not None:  # backward-only pruning: the rollout and rewards are untouched
            pruned_edges = int(sum(int((~p).sum()) for p in pruned if p is not None))
            edge_masks = [m if p is None else (p if m is None else m & p) for m, p in zip(edge_masks, pruned)]
        steps = self.select_steps(plan, it)
        t1 = time.perf_counter()
        train_stats = {}
        if adv.leaf_mask.any():
            batch = rollout.transitions([view.local(d, a) for d, a in enumerate(adv.edge_advantages)], steps,
                                        [view.local(d, m) for d, m in enumerate(edge_masks)],
                                        allow_empty=self.dp.world > 1)
            clip = clip_range_for(cfg.loss.clip_range, cfg.loss.clip_adapt, rewards)
            train_stats = self.update(batch, plan, cond, it, clip, rollout, adv, view).metrics()
            train_stats["clip_range"] = clip
        t_train = time.perf_counter() - t1
        if self.ema is not None:
            d = cfg.train.ema_decay
            with torch.no_grad():
                for n, p in self.policy.named_trainable_parameters():
                    self.ema[n].lerp_(p.detach(), 1 - d)
        metrics = {"iteration": it}
        for name, r in rewards.items():
            fin = torch.isfinite(r)
            metrics[f"reward.{name}"] = float(r[fin].mean()) if fin.any() else float("nan")
        for k, v in comps.items():
            fin = torch.isfinite(v)
            metrics[f"reward.{k}"] = float(v[fin].mean()) if fin.any() else float("nan")
        metrics["reward_mean"] = adv.reward_mean
        metrics["nan_rewards_dropped"] = adv.nan_dropped
        metrics["zero_std_ratio"] = adv.zero_std_ratio
        metrics.update({f"advantage.{k}": v for k, v in adv.diagnostics.items()})
        if pruned is not None:
            metrics["pruned_edges"] = pruned_edges
        metrics.update(train_stats)
        metrics.update({"nfe_rollout": whole.nfe, "rollout_s": t_rollout, "train_s": t_train,
                        "iter_s": time.perf_counter() - t0, "trained_steps": len(steps)})
        self.iteration += 1
        return IterationResult(metrics, rollout, images, adv)

    def update(self, batch: TransitionBatch, plan, cond, iteration: int, clip_range: float,
               rollout: Rollout | None = None, advantages: AdvantageResult | None = None,
               view: ForestView | None = None) -> UpdateStats:
        """Inner epochs x minibatches of clipped-surrogate updates over ``batch`` (M transitions).

        Each micro-batch re-runs the model on the stored states, asks the sampler layer for the
        transitions' means (and sigma_t for the KL), and feeds the loss op; gradients of a minibatch
        accumulate (each row weighted by 1 / rows of the minibatch) before one clipped AdamW step.

        Data parallel (``view`` of the whole forest, ``batch`` and ``rollout`` this rank's shard):
        minibatches are drawn over the trees of every rank, each rank back-propagates its own rows
        of a minibatch weighted by 1 / (the minibatch's rows on all ranks), and the gradients are
        summed over ranks before the step, which therefore equals the 1-process step."""
        cfg, tc, dp = self.cfg, self.cfg.train, self.dp
        # tree ids are global: the rollout's tree_prompt spans the whole iteration's trees
        n_trees = len(rollout.tree_prompt) if rollout is not None else int(batch.tree.max()) + 1
        rank_rows = torch.bincount(batch.tree.cpu(), minlength=n_trees)[None]  # [ranks, trees]
        if dp.world > 1:
            rank_rows = torch.stack(dp.gather(rank_rows[0]))
        tree_rows = rank_rows.sum(0)
        trees = tree_rows.nonzero(as_tuple=True)[0]
        rng = np.random.default_rng([tc.seed, iteration, 31])
        collect = UpdateStatsCollector(len(batch))
        weights_all = transition_weights(batch, plan, cfg.loss)
        logp_std_all = transition_log_prob_std(batch, plan)
        best = None
        if cfg.loss.sft_weight > 0 and rollout is not None and advantages is not None:
            whole = view.whole if view is not None else rollout
            best = best_paths(whole, advantages.leaf_advantages, advantages.leaf_mask)
            if view is not None:
                best = [view.local(d, b) for d, b in enumerate(best)]
        level_sizes = [len(lv) for lv in view.whole.levels] if view is not None and dp.world > 1 else None
        params = self.policy.trainable_parameters()
        dtype = self.sampler.model_dtype
        for epoch in range(tc.inner_epochs):
            order = trees[torch.from_numpy(rng.permutation(len(trees)))]
            for mb_trees in torch.tensor_split(order, tc.minibatches):
                mb_rows = int(tree_rows[mb_trees].sum())  # on every rank
                if mb_rows == 0:
                    continue
                # sharded weights: every rank makes as many model calls as the busiest (engine.idle_passes)
                micro = (rank_rows[:, mb_trees].sum(1) + tc.micro_batch - 1) // tc.micro_batch
                idle = self.engine.idle_passes(micro)
                rows = torch.isin(batch.tree, mb_trees).nonzero(as_tuple=True)[0]
                # micro-batches ordered by timestep, as in the rollout (each row is independent)
                rows = rows[torch.argsort(batch.step[rows], stable=True)]
                with self.engine.accumulate():  # one gradient reduction per step (DeepSpeed)
                    for mrows in torch.split(rows, tc.micro_batch) if len(rows) else ():  # (split of none: one empty part)
                        mb = batch.select(mrows)
                        x = mb.sample.to(self.accelerator.device)
                        with self.accelerator.autocast():
                            v = self.policy.velocity(x.to(dtype), mb.sigma, cond.index(mb.prompt)).float()
                        mean = transition_means(mb, v, plan)
                        mean_ref, kl_sigma = None, None
                        if cfg.loss.beta > 0:
                            v_ref = self.policy.reference_velocity(x.to(dtype), mb.sigma, cond.index(mb.prompt)).float()
                            mean_ref = transition_means(mb, v_ref, plan).detach()
                            kl_sigma = mb.std if cfg.loss.kl_sigma == "transition_std" else transition_sigma_t(mb, plan)
                        out = self.loss_fn(mb.prev_sample, mean, mb.mean_old, logp_std_all[mrows], mb.log_prob_old,
                                           mb.advantages, weights_all[mrows], clip_range=clip_range, guard=cfg.loss.guard,
                                           mean_ref=mean_ref, kl_sigma=kl_sigma, beta=cfg.loss.beta)
                        loss = out.loss
                        if best is not None:
                            sft = best_path_sft_loss(mb, mean, best, cfg.loss.sft_weight)
                            if sft is not None:
                                loss = loss + sft
                        self.engine.backward(loss * (len(mrows) / mb_rows))
                        collect.add(out, loss, mb.log_prob_old, mb.step)
                    for _ in range(idle):
                        self._idle_pass(cond)
                    if rollout is not None and cfg.loss.anchor_weight > 0:
                        anchor = ode_anchor_loss(self.policy, rollout, plan, cond, cfg.loss.anchor_weight,
                                                 cfg.loss.anchor_steps, rng, level_sizes)
                        if anchor is not None:
                            self.engine.backward(anchor)
                            collect.anchor.append(anchor.detach().reshape(1))
                collect.grad_norms.append(self.engine.step(params, tc.max_grad_norm))
        return collect.finish(dp if dp.world > 1 else None)

    def _idle_pass(self, cond) -> None:
        """The model calls of one update micro-batch on one dummy row, with a gradient of exactly zero.

        A sharded denoiser gathers its weights inside every forward and backward (collectives), so a
        rank with fewer micro-batches in a minibatch than another runs these to stay in step."""
        device, dtype = self.accelerator.device, self.sampler.model_dtype
        x = torch.zeros(1, *self.policy.latent_shape, device=device, dtype=dtype)
        sigma = torch.full((1,), 0.5)
        c = cond.index(torch.zeros(1, dtype=torch.long))
        with self.accelerator.autocast():
            v = self.policy.velocity(x, sigma, c).float()
        if self.cfg.loss.beta > 0:
            self.policy.reference_velocity(x, sigma, c)
        self.engine.backward(v.sum() * 0.0)
