"""``loss.objective=diffusion_dpo``: Diffusion-DPO (Wallace et al., arXiv 2311.12908) for flow models,
on preference pairs (chosen x^w, rejected x^l) against the frozen base model.

A pair is noised at a time t with one noise eps shared by both images (and t shared too), in the
flow-matching convention x_t = (1 - t) x0 + t eps, target velocity u = eps - x0. With the per-element
mean squared velocity errors e(v, x0) = mean_D((v(x_t) - u)^2) of the trained model (theta) and the
base model (ref),

    d = [e_theta(x^w) - e_ref(x^w)] - [e_theta(x^l) - e_ref(x^l)],     L = -log sigmoid(-beta / 2 * d).

This is the paper's Eq. 14 in velocity space, written as the authors' training script computes it: the
errors are means over the latent elements, and the paper's T omega(lambda_t) is a constant absorbed in
beta (their ``-0.5 * beta_dpo`` scale; beta 5000 for SD1.5 and SDXL). The loss of the step is the mean
over the pairs' (pair, time) rows. Its minimum pulls v_theta toward u on x^w and away from it on x^l,
measured against how well the base model already does on each: the reference makes it a KL-regularised
objective with strength 1 / beta.

Pairs come from one of two sources:

* **online** (default): within each group of the iteration's rollout (the samples of one prompt),
  ordered by their advantage (the combined reward, centred in the group): ``pairs=best_worst`` gives
  one pair, the best against the worst sample; ``pairs=all`` every pair with a strictly higher
  advantage. A group of two or more samples without reward spread gives, with ``pairs_with_ties``
  (default, as Flow-Factory's ``_form_pairs_from_advantages``), one tie pair, its first sample against
  itself: d = 0, loss log 2 and zero gradient, but it counts in the mean over pairs (2 tie groups of 4
  halve the step); ``pairs_with_ties=false`` gives none. Each pair trains on the rank that holds its
  chosen sample (its partner's latent is gathered), and its times and noise come from its own
  generator seeded by (train.seed, iteration, chosen id, rejected id): 2 processes make the 1-process
  update.
* **offline** (``pairs_file``): a ``.jsonl`` file, one object per line with ``prompt``, ``chosen`` and
  ``rejected`` (image paths, relative to the file's folder). Each iteration takes the next
  ``offline_pairs`` pairs of a fixed shuffle of the file (seeded by train.seed), resized to the
  model's image size and encoded by the policy (:func:`image_latents`). The iteration's rollout is
  still drawn and scored: it only reports the reward the trained model reaches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UserError
from ..fields import help_field as _f
from ..seeds import FORWARD_ROWS, derive_seed
from .base import MicroLoss, Objective, UpdateContext, idle_inputs
from .forward_rows import logit_normal_times, per_row_mean, rollout_times, uniform_times
from .terms.kl import velocity_kl
from ..text_inputs import loads_json


@dataclass
class DiffusionDPOOptions:
    """``loss.diffusion_dpo.*``."""

    beta: float = _f(5000.0, "beta of L = -log sigmoid(-beta / 2 * d), d the chosen-minus-rejected difference of the velocity errors' improvement over the base model, errors as means over latent elements (the authors: 5000, with T omega(lambda_t) absorbed in it); larger: closer to the base model", gt=0.0)
    pairs: Literal["best_worst", "all"] = _f("best_worst", "online pairs within each group, ordered by advantage: best_worst (one pair, the best against the worst sample) | all (every pair with a strictly higher advantage); ignored with pairs_file")
    pairs_with_ties: bool = _f(True, "online pairs: a group of two or more samples without reward spread gives one tie pair, its first sample against itself (loss log 2, zero gradient, but counted in the mean over pairs: the authors' (Flow-Factory) argmax / argmin pairing); false: such a group gives no pair, so only groups with spread share the mean")
    pairs_file: str = _f("", "offline preference pairs: a .jsonl file of {\"prompt\", \"chosen\", \"rejected\"} (image paths relative to the file) ('' : online pairs from the rollout)")
    offline_pairs: int = _f(8, "pairs per iteration taken from pairs_file (in a fixed shuffle of the file, seeded by train.seed)", ge=1)
    timesteps: int = _f(1, "training times per pair, each with its own noise shared by the two images (the authors: 1)", ge=1)
    time_sampler: Literal["uniform", "logit_normal", "rollout"] = _f("uniform", "uniform t in (0, 1) (the authors' uniform training timestep) | logit_normal (SD3's training distribution, with logit_mean, logit_std, time_shift) | rollout (the rollout's grid times)")
    logit_mean: float = _f(0.0, "logit-normal time sampler: mean")
    logit_std: float = _f(1.0, "logit-normal time sampler: std", gt=0.0)
    time_shift: float = _f(1.0, "logit-normal time sampler: shift s, t -> s t / (1 + (s - 1) t)", gt=0.0)
    train_guidance: float = _f(1.0, "guidance scale of the training forward passes (1: CFG-free)", gt=0.0)


@dataclass
class PairRows:
    """Rows (pair, time) of a Diffusion-DPO update.

    Attributes:
        x_w, x_l: [R, ...] clean latents of the chosen and the rejected image (model device).
        noise: [R, ...] float32 noise shared by both images of a row; t: [R] float32 times in (0, 1).
        prompt: [R] long row into the conditioning; tree: [R] long minibatch key (an iteration's tree id);
        pair: [R] long the pair's id in the iteration; step: [R] long time slot k of the row within its pair.
    """

    x_w: Tensor
    x_l: Tensor
    noise: Tensor
    t: Tensor
    prompt: Tensor
    tree: Tensor
    pair: Tensor
    step: Tensor

    def __len__(self) -> int:
        return self.t.shape[0]

    def select(self, idx: Tensor) -> "PairRows":
        dev = self.x_w.device
        return PairRows(x_w=self.x_w[idx.to(dev)], x_l=self.x_l[idx.to(dev)], noise=self.noise[idx.to(self.noise.device)],
                        **{k: getattr(self, k)[idx] for k in ("t", "prompt", "tree", "pair", "step")})


def diffusion_dpo_loss(err_w: Tensor, err_l: Tensor, ref_w: Tensor, ref_l: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """Per-row loss -log sigmoid(z) [R] and its logit z = -beta / 2 * ((err_w - ref_w) - (err_l - ref_l)) [R]
    from the velocity errors [R] of the trained (err) and the base model (ref) on the chosen (w) and
    rejected (l) image."""
    z = -0.5 * beta * ((err_w - ref_w.detach()) - (err_l - ref_l.detach()))
    return -F.logsigmoid(z), z


def online_pairs(adv: Tensor, group: Tensor, mode: str, ties: bool = False) -> Tensor:
    """Preference pairs [P, 2] long (chosen, rejected leaf ids) within groups, from leaf advantages [L]
    (NaN: the leaf is left out) and group ids [L]; groups in id order, leaves in id order within them.
    ``ties``: a group of two or more (finite) leaves without spread gives one pair, its first leaf
    against itself, in either mode (Flow-Factory's argmax / argmin of a flat group); else none."""
    out = []
    for g in torch.unique(group).tolist():
        ids = ((group == g) & torch.isfinite(adv)).nonzero(as_tuple=True)[0]
        a = adv[ids]
        if len(ids) < 2:
            continue
        if not bool(a.max() > a.min()):
            if ties:
                out.append([int(ids[0]), int(ids[0])])
            continue
        if mode == "best_worst":
            out.append([int(ids[int(torch.argmax(a))]), int(ids[int(torch.argmin(a))])])
        elif mode == "all":
            better = a[:, None] > a[None, :]
            out += [[int(ids[i]), int(ids[j])] for i, j in better.nonzero().tolist()]
        else:
            raise ValueError(f"unknown pairs mode {mode!r}; valid: best_worst, all")
    return torch.tensor(out, dtype=torch.long).reshape(-1, 2)


# ----------------------------------------------------------------------------- offline pairs

@dataclass(frozen=True)
class PreferencePair:
    """One line of a pairs file: the prompt and the two images' paths (resolved)."""

    prompt: str
    chosen: Path
    rejected: Path


def read_pairs_file(path: str | Path) -> list[PreferencePair]:
    """The pairs of a ``.jsonl`` file; a UserError names the file, the line and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"loss.diffusion_dpo.pairs_file: no file {str(path)!r}")
    pairs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = loads_json(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not a JSON object ({exc.msg}); each line is "
                            '{"prompt": ..., "chosen": IMAGE, "rejected": IMAGE}') from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: not a JSON object; each line is "
                            '{"prompt": ..., "chosen": IMAGE, "rejected": IMAGE}')
        missing = [k for k in ("prompt", "chosen", "rejected") if not isinstance(row.get(k), str) or not row[k]]
        if missing:
            raise UserError(f"{where}: missing or empty {', '.join(repr(k) for k in missing)} (strings: the prompt "
                            "and the chosen and rejected image paths)")
        images = [(path.parent / row[k]) for k in ("chosen", "rejected")]
        for k, img in zip(("chosen", "rejected"), images):
            if not img.is_file():
                raise UserError(f"{where}: {k} image {str(img)!r} does not exist")
        pairs.append(PreferencePair(row["prompt"], *images))
    if not pairs:
        raise UserError(f"loss.diffusion_dpo.pairs_file: {path} holds no pairs")
    return pairs


def load_image(path: Path, size: tuple[int, int]) -> Tensor:
    """An image file as [3, H, W] float in [0, 1], RGB, resized (bicubic) to ``size`` (H, W)."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if im.size != (size[1], size[0]):
            im = im.resize((size[1], size[0]), Image.BICUBIC)
        return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).float() / 255.0


@torch.no_grad()
def image_latents(policy, images: Tensor) -> Tensor:
    """Images [B, 3, H, W] in [0, 1] -> the policy's latents [B, ...]: ``policy.encode_images`` where the
    policy has it, else its diffusers VAE's mode (the inverse of the adapters' decode: (z - shift) x
    scaling); a UserError for a policy with neither."""
    if hasattr(policy, "encode_images"):
        return policy.encode_images(images)
    vae = getattr(policy, "vae", None)
    if vae is None or not hasattr(vae, "encode"):
        raise UserError(f"loss.diffusion_dpo.pairs_file: model {type(policy).__name__} has no image encoder "
                        "(neither encode_images nor a VAE); use online pairs (pairs_file='')")
    if images.ndim != 4:
        raise UserError("loss.diffusion_dpo.pairs_file: offline pairs are images; video models take online pairs")
    cfg = vae.config
    shift = cfg.shift_factor if getattr(cfg, "shift_factor", None) is not None else 0.0
    z = vae.encode((images * 2 - 1).to(vae.device, vae.dtype)).latent_dist.mode()
    return (z.float() - shift) * cfg.scaling_factor


class DiffusionDPOObjective(Objective):
    """Diffusion-DPO with ``loss.diffusion_dpo`` options (:class:`DiffusionDPOOptions`)."""

    name = "diffusion_dpo"
    needs_reference = True  # the DPO reference is the frozen base model

    def __init__(self, cfg):
        self.opt: DiffusionDPOOptions = cfg.loss.diffusion_dpo
        self.seed = cfg.train.seed
        self.pairs = read_pairs_file(self.opt.pairs_file) if self.opt.pairs_file else None
        self._cond = None  # the offline batch's conditioning (online: the rollout's)

    def _times(self, sigmas: Tensor):
        o = self.opt
        if o.time_sampler == "rollout":
            return rollout_times(sigmas)
        if o.time_sampler == "logit_normal":
            return logit_normal_times(o.logit_mean, o.logit_std, o.time_shift)
        return uniform_times()

    def _rows(self, ctx: UpdateContext, x_w: Tensor, x_l: Tensor, keys: list[tuple[int, int]], prompt: Tensor,
              tree: Tensor, pair: Tensor) -> PairRows:
        """K rows per pair, its times and shared noise from the generator of its ``keys`` entry."""
        k, times = self.opt.timesteps, self._times(ctx.collected.plan.sigmas)
        ts, noises = [], []
        for key in keys:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, ctx.collected.iteration, FORWARD_ROWS, *key))
            t = times(k, gen).float()
            ts.append(t)
            noises.append(torch.randn((len(t), *x_w.shape[1:]), generator=gen))
        k = len(ts[0])  # a grid sampler gives at most the grid's times
        rep = lambda v: v.repeat_interleave(k)  # noqa: E731  (pair-major rows)
        return PairRows(x_w=x_w.repeat_interleave(k, dim=0), x_l=x_l.repeat_interleave(k, dim=0),
                        noise=torch.cat(noises).to(x_w.device), t=torch.cat(ts), prompt=rep(prompt), tree=rep(tree),
                        pair=rep(pair), step=torch.arange(k).repeat(len(keys)))

    def rows(self, ctx: UpdateContext) -> PairRows | None:
        return self._offline_rows(ctx) if self.pairs is not None else self._online_rows(ctx)

    def _online_rows(self, ctx: UpdateContext) -> PairRows | None:
        col, dp = ctx.collected, ctx.dp
        view, whole = col.view, col.view.whole
        leaf_tree = whole.leaf_tree.cpu()
        adv = ctx.credit.advantages.leaf_advantages.float().cpu().clone()
        adv[~ctx.credit.trained_leaves()] = float("nan")  # the credit stage's record: invalid or pruned leaves pair with none
        pairs = online_pairs(adv, whole.tree_group.cpu()[leaf_tree], self.opt.pairs, self.opt.pairs_with_ties)
        local = view.local_leaves.cpu()
        x = col.rollout.leaves.x
        if dp.world > 1:  # a pair's rejected sample may be on another rank: every leaf's latent, in whole order
            full = torch.empty(whole.num_leaves, *x.shape[1:], dtype=x.dtype)
            full[dp.cat(local)] = dp.cat(x)
            x_at = lambda ids: full[ids].to(x.device)  # noqa: E731
        else:
            pos = torch.empty(whole.num_leaves, dtype=torch.long)
            pos[local] = torch.arange(len(local))
            x_at = lambda ids: x[pos[ids].to(x.device)]  # noqa: E731
        mine = pairs[torch.isin(pairs[:, 0], local)] if len(pairs) else pairs
        if len(mine) == 0:
            return None
        w, lo = mine[:, 0], mine[:, 1]
        group = whole.tree_group.cpu()[leaf_tree[w]]
        return self._rows(ctx, x_at(w), x_at(lo), [(int(a), int(b)) for a, b in mine.tolist()],
                          whole.tree_prompt.cpu()[leaf_tree[w]], group, torch.arange(len(mine)))

    def _offline_rows(self, ctx: UpdateContext) -> PairRows | None:
        col, dp, policy = ctx.collected, ctx.dp, ctx.policy
        n, b = len(self.pairs), self.opt.offline_pairs
        order = np.random.default_rng([self.seed, FORWARD_ROWS, n]).permutation(n)
        batch = [int(order[(col.iteration * b + i) % n]) for i in range(b)]
        share = batch[dp.rank * b // dp.world:(dp.rank + 1) * b // dp.world]  # this rank's contiguous part
        if not share:
            return None
        chosen = [self.pairs[i] for i in share]
        with torch.no_grad():
            shape = policy.decode(torch.zeros(1, *policy.latent_shape, device=ctx.device, dtype=ctx.dtype)).shape[-2:]
            imgs = lambda key: torch.stack([load_image(getattr(p, key), tuple(shape)) for p in chosen])  # noqa: E731
            x_w = image_latents(policy, imgs("chosen").to(ctx.device)).to(ctx.dtype)
            x_l = image_latents(policy, imgs("rejected").to(ctx.device)).to(ctx.dtype)
            self._cond = policy.encode_prompts([p.prompt for p in chosen])
        first = dp.rank * b // dp.world
        slot = torch.arange(first, first + len(share))
        n_trees = len(col.rollout.tree_prompt)
        return self._rows(ctx, x_w, x_l, [(i, int(s)) for i, s in zip(share, slot)], torch.arange(len(share)),
                          slot % n_trees, slot)

    def micro_loss(self, ctx: UpdateContext, rows: PairRows) -> MicroLoss:
        o, policy = self.opt, ctx.policy
        cond_all = self._cond if self.pairs is not None else ctx.collected.cond
        cond = cond_all.index(torch.cat([rows.prompt, rows.prompt]))
        t = rows.t.to(rows.noise.device).view(-1, *([1] * (rows.noise.ndim - 1)))
        x0 = torch.cat([rows.x_w.float(), rows.x_l.float()])
        noise = torch.cat([rows.noise, rows.noise])
        tt = torch.cat([t, t])
        x_in = ((1 - tt) * x0 + tt * noise).to(ctx.dtype).to(ctx.device)
        u = (noise - x0).to(ctx.device)
        sigma = torch.cat([rows.t, rows.t])
        with torch.no_grad(), ctx.autocast():
            v_ref = policy.reference_velocity(x_in, sigma, cond, o.train_guidance).float()
        with ctx.autocast():
            v = policy.velocity(x_in, sigma, cond, o.train_guidance).float()
        err, ref = per_row_mean((v - u) ** 2), per_row_mean((v_ref - u) ** 2)
        m = len(rows)
        loss, z = diffusion_dpo_loss(err[:m], err[m:], ref[:m], ref[m:], o.beta)
        stats = {"dpo_logit": z.detach(), "dpo_accuracy": (z.detach() > 0).float(),
                 "fm_loss_chosen": err[:m].detach(), "fm_loss_rejected": err[m:].detach(),
                 "kl": velocity_kl(v, v_ref).detach().view(2, m).mean(0)}
        return MicroLoss(loss=loss.mean(), stats=stats)

    def idle_pass(self, ctx: UpdateContext) -> Tensor:
        policy = ctx.policy
        x, t, c = idle_inputs(ctx, 2)
        with torch.no_grad(), ctx.autocast():
            policy.reference_velocity(x, t, c, self.opt.train_guidance)
        with ctx.autocast():
            v = policy.velocity(x, t, c, self.opt.train_guidance).float()
        return v.sum() * 0.0

    def after_update(self, ctx: UpdateContext) -> dict[str, float]:
        return {"dpo_beta": self.opt.beta}


def build_diffusion_dpo(cfg, device=None) -> DiffusionDPOObjective:
    """Factory of ``loss.objective=diffusion_dpo`` from a :class:`~flowgrpo.config.RunConfig`."""
    return DiffusionDPOObjective(cfg)


__all__ = ["DiffusionDPOObjective", "DiffusionDPOOptions", "diffusion_dpo_loss", "online_pairs", "read_pairs_file"]
