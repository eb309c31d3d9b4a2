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

from ..advantages import estimate_advantages
from ..anchor import ode_anchor_loss
from ..config import RunConfig
from ..data import PromptSource
from ..ops import grpo_loss, grpo_loss_ref
from ..policies import build_policy
from ..rewards import build_reward
from ..samplers.forest import Rollout, TransitionBatch
from ..samplers.rollout import ForestSampler
from ..samplers.steps import sde_step
from ..samplers.strategies import build_strategy


@dataclass
class IterationResult:
    metrics: dict
    rollout: Rollout
    images: torch.Tensor


def _seed_for(seed: int, iteration: int, salt: int) -> int:
    return int(np.random.default_rng([seed, iteration, salt]).integers(2**62))


class GRPOTrainer:
    """Holds the policy, optimizer, EMA and the pipeline stages; :meth:`iteration` runs one step.

    Checkpoint/resume state is :meth:`state_dict` / :meth:`load_state_dict`. The run loop (run
    directory, logging, evaluation) lives in :mod:`flowgrpo.trainer.run`.
    """

    def __init__(self, cfg: RunConfig, accelerator=None):
        from accelerate import Accelerator

        self.cfg = cfg
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if tc.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        torch.manual_seed(tc.seed)  # adapter initialisation
        self.policy = build_policy(cfg.model).to(self.accelerator.device)
        if (cfg.loss.beta > 0 or cfg.loss.anchor_weight > 0) and hasattr(self.policy, "snapshot_reference"):
            self.policy.snapshot_reference()
        params = self.policy.trainable_parameters()
        if not params:
            raise ValueError("the policy has no trainable parameters (model.train_mode?)")
        self.optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.adam_betas), eps=tc.adam_eps,
                                           weight_decay=tc.weight_decay)
        # The policy stays unwrapped (its methods, not only forward, are called); the optimizer is prepared.
        self.optimizer = self.accelerator.prepare(self.optimizer)
        self.strategy = build_strategy(cfg.sampler, cfg.strategy)
        self.sampler = ForestSampler(self.policy, cfg.sampler.max_micro_batch)
        self.rewards = {name: build_reward(name) for name in cfg.reward.weights}
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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "iteration": self.iteration,
            "trainable": self.policy.trainable_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema,
        }

    def load_state_dict(self, state: dict) -> None:
        self.iteration = state["iteration"]
        self.policy.load_trainable_state_dict(state["trainable"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.ema = state["ema"]

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
        """Rewards [L] per name, plus named components for logging.

        Pairwise rewards (attribute ``needs_groups = True``) also receive the leaves' group ids [L].
        """
        scores, comps = {}, {}
        for name, fn in self.rewards.items():
            out = fn(images, prompts, groups=groups) if getattr(fn, "needs_groups", False) else fn(images, prompts)
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
        rollout = self.sampler.rollout(plan, prompts, cfg.data.group_size, gen, cfg.sampler.shared_group_noise,
                                       cond=cond)
        images = self.decode_leaves(rollout)
        t_rollout = time.perf_counter() - t0
        rewards, comps = self.score(images, rollout.leaf_prompts, rollout.leaf_groups)
        adv = estimate_advantages(cfg.advantage.estimator, rollout, rewards, cfg.advantage, cfg.reward)
        edge_masks = [None] + [rollout.mean_over_descendants(adv.leaf_mask.float(), d) > 0
                               for d in range(1, len(rollout.levels))]
        pruned = self.strategy.edge_train_masks(rollout, adv, it)
        if pruned is not None:  # backward-only pruning: the rollout and rewards are untouched
            edge_masks = [m if p is None else (p if m is None else m & p) for m, p in zip(edge_masks, pruned)]
        steps = self.select_steps(plan, it)
        t1 = time.perf_counter()
        train_stats = {}
        if adv.leaf_mask.any():
            batch = rollout.transitions(adv.edge_advantages, steps, edge_masks)
            clip = self.strategy.clip_range(it, cfg.loss.clip_range, rewards)
            train_stats = self.update(batch, plan, cond, it, clip, rollout)
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
        metrics["reward_mean"] = adv.stats["combined_reward_mean"]
        metrics["nan_rewards_dropped"] = adv.stats["nan_dropped"]
        metrics["zero_std_ratio"] = adv.stats["zero_std_ratio"]
        metrics.update(train_stats)
        metrics.update({"nfe_rollout": rollout.nfe, "rollout_s": t_rollout, "train_s": t_train,
                        "iter_s": time.perf_counter() - t0, "trained_steps": len(steps)})
        self.iteration += 1
        return IterationResult(metrics, rollout, images)

    def _means(self, x, v, batch: TransitionBatch, plan) -> torch.Tensor:
        """Recompute the SDE mean mu for each row from velocity v, per step's kind and noise level."""
        out = torch.empty_like(x, dtype=torch.float32)
        for s in batch.step.unique().tolist():
            rows = (batch.step == s).nonzero(as_tuple=True)[0]
            spec = plan.steps[s]
            res = sde_step(x[rows], v[rows], batch.sigma[rows], batch.sigma_next[rows], noise_level=spec.noise_level,
                           kind=spec.sde_kind, prev_sample=batch.prev_sample[rows], sigma_max=plan.sigmas[1])
            out[rows] = res.mean
        return out

    def _sigma_t(self, batch: TransitionBatch, plan) -> torch.Tensor:
        from ..samplers.steps import sde_sigma_t

        out = torch.empty(len(batch))
        for s in batch.step.unique().tolist():
            rows = (batch.step == s).nonzero(as_tuple=True)[0]
            spec = plan.steps[s]
            out[rows] = sde_sigma_t(batch.sigma[rows], batch.sigma_next[rows], spec.noise_level, spec.sde_kind,
                                    plan.sigmas[1].expand(len(rows)))
        return out

    def update(self, batch: TransitionBatch, plan, cond, iteration: int, clip_range: float, rollout=None) -> dict:
        """Inner epochs x minibatches of clipped-surrogate updates over ``batch``. Returns diagnostics."""
        from ..loss_weights import transition_weights

        cfg, tc = self.cfg, self.cfg.train
        trees = batch.tree.unique()
        rng = np.random.default_rng([tc.seed, iteration, 31])
        stats = {"ratio": [], "logp_diff": [], "clip_high": [], "clip_low": [], "kl": [], "loss": [], "anchor": []}
        grad_norms = []
        first_dev = None
        weights_all = transition_weights(batch, plan, cfg.loss)
        for epoch in range(tc.inner_epochs):
            order = trees[torch.from_numpy(rng.permutation(len(trees)))]
            for mb_trees in torch.tensor_split(order, tc.minibatches):
                rows = torch.isin(batch.tree, mb_trees).nonzero(as_tuple=True)[0]
                if len(rows) == 0:
                    continue
                # micro-batches ordered by timestep, as in the rollout (each row is independent)
                rows = rows[torch.argsort(batch.step[rows], stable=True)]
                self.optimizer.zero_grad(set_to_none=True)
                for mrows in torch.split(rows, tc.micro_batch):
                    mb = batch.select(mrows)
                    x = mb.sample.to(self.accelerator.device)
                    with self.accelerator.autocast():
                        v = self.policy.velocity(x.to(self.sampler._dtype), mb.sigma, cond.index(mb.prompt)).float()
                    mean = self._means(x, v, mb, plan)
                    mean_ref, kl_sigma = None, None
                    if cfg.loss.beta > 0:
                        v_ref = self.policy.reference_velocity(x.to(self.sampler._dtype), mb.sigma, cond.index(mb.prompt)).float()
                        mean_ref = self._means(x, v_ref, mb, plan).detach()
                        kl_sigma = mb.std if cfg.loss.kl_sigma == "transition_std" else self._sigma_t(mb, plan)
                    loss, st = self.loss_fn(mb.prev_sample, mean, mb.mean_old, mb.std, mb.log_prob_old, mb.advantages,
                                            weights_all[mrows], clip_range=clip_range, guard=cfg.loss.guard,
                                            mean_ref=mean_ref, kl_sigma=kl_sigma, beta=cfg.loss.beta)
                    aux = self.strategy.auxiliary_loss(self.policy, mb, v, mean, plan, rollout)
                    if aux is not None:
                        loss = loss + aux
                    self.accelerator.backward(loss * (len(mrows) / len(rows)))
                    stats["ratio"].append(st["ratio"])
                    stats["logp_diff"].append(st["logp"] - mb.log_prob_old)
                    stats["clip_high"].append(st["clipped_high"].float())
                    stats["clip_low"].append(st["clipped_low"].float())
                    stats["kl"].append(st["kl"])
                    stats["loss"].append(loss.detach().reshape(1))
                    if first_dev is None:
                        first_dev = float((st["ratio"] - 1).abs().max())
                if rollout is not None and cfg.loss.anchor_weight > 0:
                    anchor = ode_anchor_loss(self.policy, rollout, plan, cond, cfg.loss.anchor_weight,
                                             cfg.loss.anchor_steps, rng)
                    if anchor is not None:
                        self.accelerator.backward(anchor)
                        stats["anchor"].append(anchor.detach().reshape(1))
                gn = self.accelerator.clip_grad_norm_(self.policy.trainable_parameters(), tc.max_grad_norm)
                grad_norms.append(float(gn))
                self.optimizer.step()
        ratio = torch.cat(stats["ratio"])
        dlogp = torch.cat(stats["logp_diff"])
        return {
            "loss": float(torch.cat(stats["loss"]).mean()),
            "ratio_mean": float(ratio.mean()),
            "ratio_std": float(ratio.std()) if len(ratio) > 1 else 0.0,
            "approx_kl": float(0.5 * (dlogp**2).mean()),
            "clipfrac_high": float(torch.cat(stats["clip_high"]).mean()),
            "clipfrac_low": float(torch.cat(stats["clip_low"]).mean()),
            "kl": float(torch.cat(stats["kl"]).mean()),
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "onpolicy_ratio_maxdev": first_dev if first_dev is not None else 0.0,
            "transitions": len(batch),
            **({"anchor_loss": float(torch.cat(stats["anchor"]).mean())} if stats["anchor"] else {}),
        }
