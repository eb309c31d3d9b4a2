"""Pretrain the shapes-world flow model whose weights ship inside the package.

    python -m flowgrpo.shapes.pretrain --out /tmp/shapes_pretrain     # resumable: run it again to go on

Rectified-flow training (x_sigma = (1 - sigma) x0 + sigma eps, sigma drawn logit-normal as in SD3 and
then shifted toward high noise by ``--sigma-shift``, sigma' = s sigma / (1 + (s - 1) sigma): the layout,
which the prompt decides, is settled at sigma > 0.7, where the unshifted sampler puts only 20 % of its
samples (58 % at s = 3))
of an x0-predicting MMDiT on procedurally rendered scenes, with 10 % empty prompts so classifier-
free guidance works, an EMA of the weights, and a cosine learning-rate schedule over ``--steps``.

**Caption noise** makes the base model misaligned the way web captions make real models: with a
per-tag probability (``--caption-noise``) a training image does *not* show its caption but a scene
that violates it (:func:`~flowgrpo.shapes.world.wrong_scene`: wrong count, swapped colours,
flipped relation, a dropped or replaced object). The converged model draws crisply and follows a
prompt only part of the time; GRPO then has choices, not drawing, to fix. Held-out prompts
(:func:`~flowgrpo.shapes.prompts.split_specs`) are never used as captions.

Every ``--eval-every`` steps the EMA model is evaluated on the held-out prompts (deterministic ODE
sampling, guidance 1 and ``--eval-cfg``), the line is appended to ``OUT/pretrain_log.jsonl``, a
snapshot is written to ``OUT/snapshots/step_N`` and the full training state to ``OUT/state.pt``,
so a run that is cut off resumes where it stopped when started again with the same ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..safe_load import load_tensors
from ..samplers.schedule import shift_sigmas
from .model import POSITION_CODES, TEXT_ENCODERS, ShapesFlowModel, ShapesModelConfig
from .prompts import FREE_COUNTING_SHARE, sample_train_spec
from .world import CELL, GRID, TAGS, draw, place, wrong_scene

# Probability that a training image violates its caption, per tag. With conditioning that can tell the
# prompts apart, a converged model follows a prompt with about 1 - noise of its competence, so these aim
# the base at 0.30-0.50 held-out accuracy while the right scene stays the most likely one. Where a
# violation has a single form (the flipped relation, the swapped colours) the noise must stay well
# below 0.5: at 0.5 the captions carry no information about the relation, and a first pretraining at
# position=0.5 drew the same scene for "A rel B" and "B rel A" 88 % of the time (docs/shapes_world.md).
# Single-object and colour mistakes spread over 2-3 alternatives, so 0.55 still leaves the right one the mode.
DEFAULT_CAPTION_NOISE = {"single_object": 0.55, "two_object": 0.5, "counting": 0.45, "colors": 0.55,
                         "position": 0.2, "color_attr": 0.4}

# Relative share of each tag in the training batches. The relation is the slowest thing the MMDiT learns:
# its high-noise prediction only starts to lean toward the relation's side after about 30 k clean position
# captions, and mis-captions weaken that signal by (1 - 2 * noise). With uniform tags and position noise
# 0.35, 1,500 steps of 128 still left the prediction blind to the relation (flowgrpo shapes probe:
# relation prior 0.50), so position gets three shares and less caption noise.
DEFAULT_TAG_WEIGHTS = {"single_object": 1.0, "two_object": 1.0, "counting": 1.0, "colors": 1.0,
                       "position": 3.0, "color_attr": 1.0}


#: noise-level sampler shift of pretraining (SD3's value for its own training-time shift)
DEFAULT_SIGMA_SHIFT = 3.0


def parse_noise(text: str | None, defaults: dict[str, float] = DEFAULT_CAPTION_NOISE,
                option: str = "--caption-noise") -> dict[str, float]:
    """``"0.3"`` (every tag) or ``"counting=0.4,position=0.3"`` (the rest keep ``defaults``)."""
    noise = dict(defaults)
    if not text:
        return noise
    if "=" not in text:
        return {t: float(text) for t in TAGS}
    for part in text.split(","):
        tag, val = part.split("=")
        if tag.strip() not in TAGS:
            raise SystemExit(f"{option}: unknown tag {tag.strip()!r}; valid tags: {', '.join(TAGS)}")
        noise[tag.strip()] = float(val)
    return noise


def make_batch(rng: np.random.Generator, batch: int, drop_prob: float, noise: dict[str, float],
               tag_weights: dict[str, float] | None = None,
               free_counting_share: float = FREE_COUNTING_SHARE) -> tuple[torch.Tensor, list[str]]:
    """Training pairs: images [B, 3, 32, 32] in [-1, 1] and captions ('' with prob ``drop_prob``).

    Tags are drawn in proportion to ``tag_weights`` (None: uniform), and a counting draw is colour-free
    with probability ``free_counting_share`` (:func:`~flowgrpo.shapes.prompts.sample_train_spec`). With
    probability ``noise[tag]`` the image shows a scene that violates its caption."""
    p = None if tag_weights is None else np.array([tag_weights[t] for t in TAGS]) / sum(tag_weights[t] for t in TAGS)
    imgs, prompts = [], []
    for _ in range(batch):
        spec = sample_train_spec(rng, None if p is None else TAGS[rng.choice(len(TAGS), p=p)], free_counting_share)
        shown = wrong_scene(spec, rng) if rng.random() < noise[spec.tag] else spec
        imgs.append(draw(place(shown, rng)))
        prompts.append("" if rng.random() < drop_prob else spec.prompt)
    x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return x, prompts


def cell_noise_levels(x0: torch.Tensor, sigma: torch.Tensor, lead_prob: float, gen: torch.Generator) -> torch.Tensor:
    """Per-pixel noise levels [B, 1, 32, 32] for images x0 [B, 3, 32, 32] at noise levels sigma [B]:
    sigma everywhere, except that with probability ``lead_prob`` one drawn object's cell (a cell that is
    not all background) *leads*, at sigma * u with u ~ U(0, 1).

    Why: in a clean training scene every object sits at the same noise level, so the pretraining loss
    never asks where B goes once A has been placed; both emerge together and the model learns each
    object's placement apart (it puts B in A's column at the chance rate, 1 in 5). A leading object
    is the state a sampler reaches when one object commits first, and the loss then teaches the
    conditional placement of the rest (diffusion forcing's per-token noise, on one token)."""
    b = x0.shape[0]
    levels = sigma.view(b, 1, 1, 1).expand(b, 1, GRID * CELL, GRID * CELL).clone()
    if lead_prob <= 0:
        return levels
    occupied = (x0 > -1).any(1).view(b, GRID, CELL, GRID, CELL).any(4).any(2).flatten(1)  # [B, 16] cells
    lead = torch.rand(b, generator=gen) < lead_prob
    pick = torch.multinomial(occupied.float() + 1e-9, 1, generator=gen).squeeze(1)  # one occupied cell each
    u = torch.rand(b, generator=gen)
    for i in torch.nonzero(lead & occupied.any(1)).flatten().tolist():
        r, c = divmod(int(pick[i]), GRID)
        levels[i, :, r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = sigma[i] * u[i]
    return levels


def adopt_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into ``model`` where the two differ only in the scene encoder's token layout (weights
    without count tokens into a model with them, or back): every tensor of the same shape is copied;
    a table or matrix that grew keeps its new rows as initialised and gets the old block in its corner,
    except the pooled map's new input columns, which start at zero so that the new tokens first change
    nothing. Any other difference (a missing key, another rank) is the RuntimeError load_state_dict gives."""
    own = model.state_dict()
    if set(own) != set(state):
        model.load_state_dict(state)  # raises, naming the keys
    for name, old in state.items():
        new = own[name]
        if new.shape == old.shape:
            new.copy_(old)
            continue
        if new.ndim != old.ndim:
            raise RuntimeError(f"{name}: shape {tuple(old.shape)} cannot become {tuple(new.shape)}")
        if name.endswith("pool.weight"):
            new.zero_()
        block = tuple(slice(0, min(a, b)) for a, b in zip(new.shape, old.shape))
        new[block] = old[block]


def resolve_device(name: str) -> torch.device:
    """``--device``: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; a
    CUDA device that is not there is a one-line error naming the choices."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: no CUDA device here (torch.cuda.is_available() is False); "
                             "valid choices: auto, cpu, cuda, cuda:N")
        return torch.device(name)
    raise SystemExit(f"--device {name!r}: valid choices are auto, cpu, cuda, cuda:N")


def _save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m flowgrpo.shapes.pretrain`` (also used to check recorded runs' arguments)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (snapshots, log, resumable state)")
    ap.add_argument("--steps", type=int, default=12000, help="optimizer steps (the cosine schedule spans them)")
    ap.add_argument("--minutes", type=float, default=120.0, help="wall-clock cap over all resumes")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=300, help="linear learning-rate warm-up steps")
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--caption-noise", default=None, help="per-tag probability of a mis-captioned image")
    ap.add_argument("--caption-dropout", type=float, default=0.1,
                    help="probability that a training caption is replaced by '' (the unconditional branch that "
                         "classifier-free guidance needs)")
    ap.add_argument("--tag-weights", default=None,
                    help="relative share of each tag in the batches, e.g. 'position=3' (default: position 3, others 1)")
    ap.add_argument("--free-counting-share", type=float, default=FREE_COUNTING_SHARE,
                    help="share of the counting captions that name no colour ('four triangles', see "
                         "flowgrpo.shapes.prompts); default 0, the world the shipped weights were pretrained on")
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-cfg", type=float, default=3.0, help="second guidance scale evaluated (besides 1)")
    ap.add_argument("--eval-prompts", type=int, default=66, help="held-out prompts per evaluation (2 seeds each)")
    ap.add_argument("--sigma-shift", type=float, default=DEFAULT_SIGMA_SHIFT,
                    help="shift of the logit-normal noise-level sampler toward high noise (1 = SD3's unshifted)")
    ap.add_argument("--text-encoder", default="scene", choices=TEXT_ENCODERS,
                    help="scene: a token per object group + a relation token; words: the old word-level encoder")
    ap.add_argument("--no-group-relation", dest="group_relation", action="store_false",
                    help="scene encoder: leave the group tokens' relation field empty (as the first scene weights; "
                         "the MMDiT then does not learn relations)")
    ap.add_argument("--count-tokens", action="store_true",
                    help="scene encoder: a count token per group beside its colour-shape token (see scene_text); "
                         "--init-model may then name weights without them (see adopt_weights)")
    d = ShapesModelConfig()
    ap.add_argument("--layers", type=int, default=d.num_layers, help="MMDiT blocks of the model")
    ap.add_argument("--heads", type=int, default=d.num_attention_heads, help="attention heads")
    ap.add_argument("--head-dim", type=int, default=d.attention_head_dim, help="width per head (width = heads x head-dim)")
    ap.add_argument("--text-dim", type=int, default=d.text_dim, help="width of the text tokens")
    ap.add_argument("--init-transformer", default=None, metavar="DIR",
                    help="start the MMDiT (the image side) from the shapes weights in DIR (model.safetensors + "
                         "config.json of the same size); the text encoder starts fresh")
    ap.add_argument("--init-model", default=None, metavar="DIR",
                    help="start every weight (text encoder and MMDiT) from the shapes weights in DIR; the options "
                         "that shape the model (size, --position-code, --cell-offset-bias, ...) must match them")
    ap.add_argument("--position-code", default="sincos", choices=POSITION_CODES,
                    help="image tokens' position code: sincos (SD3's table, nearly flat on a 4 x 4 grid; the "
                         "shipped weights) | grid (rows and columns told apart sharply; see grid_position_code)")
    ap.add_argument("--cell-offset-bias", action="store_true",
                    help="a learned attention bias per head between image cells by their row/column offset "
                         "(see flowgrpo.shapes.cell_bias)")
    ap.add_argument("--lead-prob", type=float, default=0.0,
                    help="probability that one object's cell of a training image is less noisy than the rest "
                         "(teaches where the other objects go once one is placed; see cell_noise_levels)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--device", default="auto",
                    help="where the model trains: auto (CUDA when there is one, else the CPU), cpu, cuda or cuda:N; "
                         "batches and noise are drawn on the CPU either way, so a seed gives the same data")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    from .evaluate import evaluate_shapes_model  # late import: evaluation pulls in the samplers

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    noise = parse_noise(args.caption_noise)
    tag_weights = parse_noise(args.tag_weights, DEFAULT_TAG_WEIGHTS, "--tag-weights")
    if not 0.0 <= args.caption_dropout < 1.0:
        raise SystemExit(f"--caption-dropout must be in [0, 1), got {args.caption_dropout}")
    if not 0.0 <= args.free_counting_share <= 1.0:
        raise SystemExit(f"--free-counting-share must be in [0, 1], got {args.free_counting_share}")
    if min(tag_weights.values()) < 0 or sum(tag_weights.values()) <= 0:
        raise SystemExit(f"--tag-weights must be >= 0 with a positive sum, got {tag_weights}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "state.pt"
    torch.manual_seed(args.seed)
    model_cfg = ShapesModelConfig(num_layers=args.layers, num_attention_heads=args.heads,
                                  attention_head_dim=args.head_dim, text_dim=args.text_dim,
                                  text_encoder=args.text_encoder, group_relation=args.group_relation,
                                  position_code=args.position_code, cell_offset_bias=args.cell_offset_bias,
                                  count_tokens=args.count_tokens)
    model = ShapesFlowModel(model_cfg)
    if args.init_transformer and args.init_model:
        raise SystemExit("give one of --init-transformer (the MMDiT only) and --init-model (every weight)")
    if args.init_transformer or args.init_model:
        option, folder = ("--init-model", args.init_model) if args.init_model else ("--init-transformer", args.init_transformer)
        init = ShapesFlowModel.load(folder)
        target, source = (model, init) if args.init_model else (model.transformer, init.transformer)
        try:
            if args.init_model and init.cfg.count_tokens != model_cfg.count_tokens:
                adopt_weights(target, source.state_dict())
            else:
                target.load_state_dict(source.state_dict())
        except RuntimeError as exc:
            raise SystemExit(f"{option} {folder}: its weights do not fit the model that --layers/--heads/--head-dim/"
                             f"--text-dim/--position-code/--cell-offset-bias ask for ({str(exc).splitlines()[0]})") from None
    model.to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        frac = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))  # cosine down to 10 %

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = np.random.default_rng(args.seed)
    lead_gen = torch.Generator().manual_seed(args.seed + 1)
    step, elapsed = 0, 0.0
    if state_path.exists():
        try:  # on the CPU: the optimizer moves its state to the parameters
            st = load_tensors(state_path, "pretraining state")
        except UserError as exc:
            raise SystemExit(str(exc)) from None
        model.load_state_dict(st["model"])
        ema.load_state_dict(st["ema"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        rng.bit_generator.state = st["rng"]
        torch.set_rng_state(st["torch_rng"])
        if "lead_rng" in st:  # states written before --lead-prob existed drew no leading cells
            lead_gen.set_state(st["lead_rng"])
        step, elapsed = st["step"], st["elapsed"]
        print(f"resumed from {state_path} at step {step} ({elapsed / 60:.1f} min)", flush=True)
    meta = {"args": vars(args), "caption_noise": noise, "tag_weights": tag_weights}
    (out / "pretrain_args.json").write_text(json.dumps(meta, indent=2))
    log = (out / "pretrain_log.jsonl").open("a")
    start = time.time() - elapsed
    losses: list[float] = []
    while step < args.steps and time.time() - start < args.minutes * 60:
        x0, prompts = make_batch(rng, args.batch, args.caption_dropout, noise, tag_weights,
                                 args.free_counting_share)
        sigma = shift_sigmas(torch.sigmoid(torch.randn(args.batch)), args.sigma_shift)
        eps = torch.randn_like(x0)
        s = cell_noise_levels(x0, sigma, args.lead_prob, lead_gen)
        x0, sigma, eps, s = (t.to(device, non_blocking=True) for t in (x0, sigma, eps, s))
        xt = (1 - s) * x0 + s * eps
        hidden, pooled = model.encode(prompts)
        pred = model.predict(xt, sigma, hidden, pooled)
        target = x0 if model.cfg.prediction == "x0" else eps - x0
        loss = torch.mean((pred - target) ** 2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        decay = min(args.ema, (1 + step) / (10 + step))  # EMA warm-up: early averages are mostly init
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1 - decay)
        losses.append(loss.item())
        step += 1
        if step % args.eval_every == 0 or step == args.steps:
            rec = {"step": step, "minutes": (time.time() - start) / 60, "loss": float(np.mean(losses)),
                   "lr": opt.param_groups[0]["lr"]}
            for g in (1.0, args.eval_cfg):
                res = evaluate_shapes_model(ema, num_prompts=args.eval_prompts, seeds_per_prompt=2, guidance_scale=g)
                rec[f"accuracy_cfg{g:g}"] = res["accuracy"]
                rec[f"per_tag_cfg{g:g}"] = res["per_tag"]
            losses = []
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            ema.save(out / "snapshots" / f"step_{step}", extra={"pretrain": rec, "caption_noise": noise})
            _save_state(state_path, {"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                     "sched": sched.state_dict(), "rng": rng.bit_generator.state,
                                     "torch_rng": torch.get_rng_state(), "lead_rng": lead_gen.get_state(), "step": step,
                                     "elapsed": time.time() - start})
    ema.save(out / "snapshots" / "final", extra={"pretrain": {"step": step, "caption_noise": noise}})
    print(f"done: {step} steps in {(time.time() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
