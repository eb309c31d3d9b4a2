"""Pretrain the shapes-world flow model whose weights ship inside the package.

    python -m flowgrpo.shapes.pretrain --out flowgrpo/shapes/weights --minutes 40

Rectified-flow training (x_sigma = (1 - sigma) x0 + sigma eps, target v = eps - x0, sigma drawn
logit-normal as in SD3) on procedurally rendered scenes, with 10 % empty prompts so classifier-free
guidance works, and an EMA of the weights. Every ``--eval-every`` steps the EMA model is evaluated
on the held-out prompts (deterministic ODE sampling); each evaluated snapshot is kept under
``OUT/snapshots/step_N`` with its accuracy, so that a deliberately imperfect base model (held-out
accuracy well below 1, leaving room for GRPO) can be picked and copied to ``OUT``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch

from .model import ShapesFlowModel, ShapesModelConfig
from .world import render, sample_spec


def make_batch(rng: np.random.Generator, batch: int, size: int, drop_prob: float) -> tuple[torch.Tensor, list[str]]:
    """Rendered scenes [B, 3, size, size] in [-1, 1] and their prompts ('' with prob ``drop_prob``)."""
    imgs, prompts = [], []
    for _ in range(batch):
        spec = sample_spec(rng)
        imgs.append(render(spec, rng, size))
        prompts.append("" if rng.random() < drop_prob else spec.prompt)
    x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return x, prompts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "weights"))
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget")
    ap.add_argument("--steps", type=int, default=100000, help="step budget (whichever ends first)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--init", default=None, help="start from these weights (a snapshot folder) instead of random")
    ap.add_argument("--warmup", type=int, default=200, help="linear learning-rate warm-up steps")
    args = ap.parse_args(argv)

    from ..evaluate import evaluate_shapes_model  # late import: evaluation pulls in the samplers

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    cfg = ShapesModelConfig()
    model = ShapesFlowModel.load(args.init) if args.init else ShapesFlowModel(cfg)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    warmup = max(1, args.warmup)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "pretrain_log.jsonl").open("a")
    start = time.time()
    step = 0
    losses: list[float] = []
    while step < args.steps and time.time() - start < args.minutes * 60:
        x0, prompts = make_batch(rng, args.batch, cfg.image_size, drop_prob=0.1)
        sigma = torch.sigmoid(torch.randn(args.batch))
        eps = torch.randn_like(x0)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * eps
        hidden, pooled = model.encode(prompts)
        v = model(xt, sigma, hidden, pooled)
        loss = torch.mean((v - (eps - x0)) ** 2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        # EMA with a warm-up (early on, averaging in the random init only adds noise)
        decay = args.ema if args.init else min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        losses.append(loss.item())
        step += 1
        if step % args.eval_every == 0:
            res = evaluate_shapes_model(ema, num_prompts=64, seeds_per_prompt=1)
            rec = {"step": step, "minutes": (time.time() - start) / 60, "loss": float(np.mean(losses)),
                   "accuracy": res["accuracy"], "per_tag": res["per_tag"]}
            losses = []
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            ema.save(out / "snapshots" / f"step_{step}", extra={"pretrain": rec})
    ema.save(out / "snapshots" / "final", extra={"pretrain": {"step": step}})
    print(f"done: {step} steps in {(time.time() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
