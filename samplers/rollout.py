"""Execute a sampling plan over a forest, one batched model call per depth (chunked)."""

from __future__ import annotations

import torch
from torch import Tensor

from .forest import Level, Rollout
from .plan import SamplingPlan
from .steps import euler_step, sde_step


class ForestSampler:
    """Runs :class:`SamplingPlan`s with a policy.

    Every node of one depth, across all trees and prompts, is evaluated in one model batch
    (split into chunks of ``max_micro_batch``); a node with K children is evaluated once and its
    velocity reused for all K (shared prefixes are computed once).

    Args:
        policy: a :class:`flowgrpo.policies.Policy` (velocity, encode_prompts, latent_shape).
        max_micro_batch: largest model batch (before classifier-free-guidance doubling).
    """

    def __init__(self, policy, max_micro_batch: int = 256):
        self.policy = policy
        self.max_micro_batch = max_micro_batch

    def velocity(self, x: Tensor, sigma: float | Tensor, cond, prompt_rows: Tensor) -> Tensor:
        """Velocity for nodes x [N, ...] whose conditioning rows are ``prompt_rows`` [N], chunked."""
        out = []
        for start in range(0, x.shape[0], self.max_micro_batch):
            sl = slice(start, start + self.max_micro_batch)
            xs = x[sl]
            s = torch.as_tensor(sigma, dtype=torch.float32, device=xs.device).expand(xs.shape[0])
            out.append(self.policy.velocity(xs.to(self._dtype), s, cond.index(prompt_rows[sl])).float())
        return torch.cat(out)

    @property
    def _dtype(self):
        return next(self.policy.parameters()).dtype

    def initial_noise(self, num_prompts: int, group_size: int, generator: torch.Generator,
                      shared_group_noise: bool) -> Tensor:
        """[P * G, ...] float32 initial noise; identical within a group when ``shared_group_noise``."""
        shape = tuple(self.policy.latent_shape)
        n = num_prompts if shared_group_noise else num_prompts * group_size
        noise = torch.randn((n, *shape), generator=generator, dtype=torch.float32)
        if shared_group_noise:
            noise = noise.repeat_interleave(group_size, dim=0)
        return noise.to(self.policy.device)

    @torch.no_grad()
    def rollout(self, plan: SamplingPlan, prompts: list[str], group_size: int, generator: torch.Generator,
                shared_group_noise: bool = False, cond=None) -> Rollout:
        """Sample ``group_size`` trees per prompt following ``plan``.

        Returns a :class:`Rollout` whose leaves are the final samples ([P * G * leaves_per_tree, ...]);
        group g of the forest holds the trees of prompt g.
        """
        device = self.policy.device
        cond = cond if cond is not None else self.policy.encode_prompts(prompts)
        num_trees = len(prompts) * group_size
        tree_prompt = torch.arange(len(prompts), device=device).repeat_interleave(group_size)
        x = self.initial_noise(len(prompts), group_size, generator, shared_group_noise)
        levels = [Level(x=x, parent=torch.full((num_trees,), -1, dtype=torch.long, device=device),
                        tree=torch.arange(num_trees, device=device))]
        sigmas = plan.sigmas.to(device)
        nfe = 0
        for i, step in enumerate(plan.steps):
            cur = levels[-1]
            v = self.velocity(cur.x, sigmas[i], cond, tree_prompt[cur.tree])
            nfe += len(cur)
            parent = torch.arange(len(cur), device=device)
            if step.branch > 1:
                parent = parent.repeat_interleave(step.branch)
            xs, vs = cur.x[parent], v[parent]
            if step.sde:
                out = sde_step(xs, vs, sigmas[i], sigmas[i + 1], noise_level=step.noise_level, kind=step.sde_kind,
                               generator=generator, sigma_max=sigmas[1])
                levels.append(Level(x=out.prev_sample, parent=parent, tree=cur.tree[parent], mean=out.mean,
                                    std=out.std, log_prob=out.log_prob))
            else:
                xn = euler_step(xs, vs, sigmas[i], sigmas[i + 1])
                levels.append(Level(x=xn, parent=parent, tree=cur.tree[parent]))
        return Rollout(plan=plan, levels=levels, prompts=list(prompts), tree_prompt=tree_prompt.cpu(),
                       tree_group=tree_prompt.cpu().clone(), nfe=nfe)
