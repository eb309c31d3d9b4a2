"""``flowgrpo sample RUN_DIR --prompts FILE --out DIR``: images (or videos) from a trained run.

Any run folder (or one of its checkpoint folders) of any adapter, the shapes world or a diffusers
model, with or without a held-out evaluator: the run's policy is rebuilt from its ``config.yaml``
with its trained weights (:func:`~flowgrpo.trainer.checkpoint.load_trained_policy`, the EMA where the
run kept one unless ``--weights raw``) and draws every prompt of a ``.txt`` / ``.jsonl`` prompt file
with the run's sampler settings: the deterministic ODE (Euler on the policy's own sigma grid of
``sampler.num_steps`` steps at ``sampler.shift``, classifier-free guidance ``model.guidance_scale``),
the run's resolution, frames and dtype. ``--steps`` and ``--guidance`` override those two. An
image-editing run's prompt file names each prompt's reference image (the ``image`` column).

Seeds: image ``j`` of prompt ``i`` (the prompt's line among the file's prompts, from 0) starts from
``torch.randn(latent_shape)`` of a CPU generator seeded with :func:`noise_seed` ``(seed, i, j) =
(seed * 100000 + i) * 100 + j`` (``--seed``, default 0), so an image depends on its prompt, its
place in the file and the seed only: the same command gives the same files, two runs sampled with
one file start from the same noises, and adding images per prompt keeps the first ones.

Output: ``{i:04d}_{j}.png`` per image (``.mp4`` per video, with a ``.png`` of its frames),
``grid.png`` (one row per prompt, captioned with it and each image's seed; the first
:data:`GRID_PROMPTS` prompts) and ``samples.json`` (the settings and each file's prompt and seed).
Everything is written to a temporary folder beside ``--out`` and renamed into place at the end, so
``--out`` holds a complete set or nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..disk import check_new_folder, new_folder
from ..errors import UserError
from ..output.drawing import check_draw_flags, draw, noise_seed

#: prompts shown in ``grid.png`` (all are written as files)
GRID_PROMPTS = 16
#: the narrowest grid row in pixels: small images are enlarged (pixel repetition) up to it so captions fit
GRID_MIN_WIDTH = 512
SETTINGS_FILE = "samples.json"


@dataclass(frozen=True)
class SampleOptions:
    """What ``flowgrpo sample`` draws. ``steps`` / ``guidance`` None: the run's ``sampler.num_steps`` /
    ``model.guidance_scale``; ``weights`` None: the EMA where the run kept one, else the raw weights;
    ``checkpoint`` None: the newest intact checkpoint."""

    prompts: str
    out: str
    weights: str | None = None
    seed: int = 0
    steps: int | None = None
    guidance: float | None = None
    checkpoint: int | None = None
    images_per_prompt: int = 1
    batch_size: int = 4


def _check_options(opts: SampleOptions) -> list[dict]:
    """The prompt file's rows; one UserError for any bad option, before a model is built."""
    from ..data import load_prompt_file

    if opts.weights not in (None, "ema", "raw"):
        raise UserError(f"--weights must be ema or raw, got {opts.weights!r}")
    if opts.guidance is not None and not (math.isfinite(opts.guidance) and opts.guidance >= 0):
        raise UserError(f"--guidance must be a finite number >= 0, got {opts.guidance}")
    check_draw_flags(seed=opts.seed, images_per_prompt=opts.images_per_prompt, steps=opts.steps,
                     batch_size=opts.batch_size)
    check_new_folder(opts.out, "--out")
    rows = load_prompt_file(opts.prompts)
    check_draw_flags(num_prompts=len(rows), source=opts.prompts)
    return rows


def _grid(images: Tensor, prompts: list[str], seeds: list[int], per_prompt: int) -> np.ndarray:
    """``grid.png``'s pixels: a row per prompt (its images, or a video's frames), captioned with the prompt
    and each image's seed."""
    from ..output.plots import captioned_grid

    if images.ndim == 5:  # one row per video: its frames
        b, f = images.shape[:2]
        cells = images.reshape(b * f, *images.shape[2:])
        captions = [(p, [f"seed {s}"] + [""] * (f - 1)) for p, s in zip(prompts, seeds)]
        ncol = f
    else:
        cells, ncol = images, per_prompt
        captions = [(prompts[r * per_prompt], [f"seed {s}" for s in seeds[r * per_prompt:(r + 1) * per_prompt]])
                    for r in range(len(prompts) // per_prompt)]
    scale = max(1, math.ceil(GRID_MIN_WIDTH / (ncol * cells.shape[-1])))
    return captioned_grid(cells, ncol, captions, scale=scale)


def _write(folder: Path, stem: str, item: Tensor) -> str:
    """One image [3, H, W] as ``stem.png`` or one video [F, 3, H, W] as ``stem.mp4`` (and its frames as
    ``stem.png``); returns the file name."""
    from ..images import png_bytes

    if item.ndim == 4:
        from ..output.video_io import save_frame_grid, save_mp4

        save_frame_grid(folder / f"{stem}.png", item[None])
        try:
            save_mp4(folder / f"{stem}.mp4", item)
        except RuntimeError as exc:  # no imageio-ffmpeg: a one-line error, the temporary folder is removed
            raise UserError(str(exc).splitlines()[0]) from None
        return f"{stem}.mp4"
    (folder / f"{stem}.png").write_bytes(png_bytes(item, compress_level=6))
    return f"{stem}.png"


def sample_run(run: str | Path, opts: SampleOptions, progress: bool = True) -> dict:
    """Draw ``opts.prompts`` with the trained policy of ``run`` into ``opts.out`` (see the module
    docstring). Returns the record written to ``samples.json``."""
    from ..trainer.checkpoint import load_trained_policy

    rows = _check_options(opts)
    overrides = () if opts.guidance is None else (f"model.guidance_scale={opts.guidance}",)
    trained = load_trained_policy(Path(run), prefer_ema=opts.weights != "raw", iteration=opts.checkpoint,
                                  overrides=overrides)
    cfg, policy = trained.cfg, trained.policy
    if opts.weights == "ema" and trained.weights.kind != "ema":
        raise UserError(f"{run} kept no EMA weights (train.ema_decay was 0); use --weights raw")
    has_refs = "image" in rows[0]
    if policy.takes_references and not has_refs:
        raise UserError(f"{run} trained an image-editing model: give a .jsonl prompt file whose lines name "
                        "each prompt's reference image (\"image\": path)")
    if has_refs and not policy.takes_references:
        raise UserError(f"{run} trained {type(policy).__name__}, which takes no reference images; give a prompt "
                        "file without an \"image\" column")
    if torch.cuda.is_available():
        policy = policy.to("cuda")
    policy.eval()
    steps = opts.steps or cfg.sampler.num_steps
    record = {"run": str(Path(run).resolve()), "checkpoint": trained.weights.path.name,
              "iteration": trained.weights.iteration, "weights": trained.weights.kind, "steps": steps,
              "guidance": cfg.model.guidance_scale, "shift": cfg.sampler.shift, "solver": "euler",
              "seed": opts.seed, "files": []}
    with new_folder(opts.out, "--out") as tmp:  # nothing half-written: not even the parents made for it
        _sample_into(tmp, policy, rows, opts, steps, cfg.sampler.shift, record, progress)
        (tmp / SETTINGS_FILE).write_text(json.dumps(record, indent=2, ensure_ascii=False), encoding="utf-8")
    return record


def _sample_into(folder: Path, policy, rows: list[dict], opts: SampleOptions, steps: int, shift: float,
                 record: dict, progress: bool) -> None:
    """Draw every (prompt, j) in batches of ``opts.batch_size`` into ``folder``, then its ``grid.png``;
    each file's entry goes to ``record["files"]``."""
    import imageio.v3 as iio
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..references import read_reference

    items = [(i, j) for i in range(len(rows)) for j in range(opts.images_per_prompt)]
    shown = min(len(rows), GRID_PROMPTS) * opts.images_per_prompt
    grid: list[Tensor] = []
    bar = Progress(TextColumn("[bold]sampling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   disable=not progress)
    with bar:
        task = bar.add_task("sample", total=len(items))
        for start in range(0, len(items), opts.batch_size):
            batch = items[start:start + opts.batch_size]
            seeds = [noise_seed(opts.seed, i, j) for i, j in batch]
            refs = [read_reference(rows[i]["image"]) for i, _ in batch] if "image" in rows[0] else None
            images = draw(policy, [rows[i]["prompt"] for i, _ in batch], seeds, steps, shift, refs)
            for (i, j), seed, item in zip(batch, seeds, images):
                name = _write(folder, f"{i:04d}_{j}", item)
                record["files"].append({"file": name, "prompt": rows[i]["prompt"], "prompt_index": i, "j": j,
                                        "seed": seed})
                if len(grid) < shown:
                    grid.append(item)
            bar.update(task, advance=len(batch))
    entries = record["files"][:shown]
    iio.imwrite(folder / "grid.png", _grid(torch.stack(grid), [e["prompt"] for e in entries],
                                           [e["seed"] for e in entries], opts.images_per_prompt))


def _cmd_sample(args) -> int:
    from ..policies.diffusers.common import show_library_progress

    show_library_progress(not args.quiet)
    opts = SampleOptions(prompts=args.prompts, out=args.out, weights=args.weights, seed=args.seed, steps=args.steps,
                         guidance=args.guidance, checkpoint=args.checkpoint, images_per_prompt=args.images_per_prompt,
                         batch_size=args.batch_size)
    record = sample_run(args.run_dir, opts, progress=not args.quiet)
    print(f"wrote {len(record['files'])} samples, grid.png and {SETTINGS_FILE} to {args.out} "
          f"({record['checkpoint']}, {record['weights']} weights, {record['steps']} steps, guidance "
          f"{record['guidance']:g}, seed {record['seed']})")
    return 0


def register(subparsers) -> None:
    """Add ``sample`` to the ``flowgrpo`` parser's ``subparsers``."""
    s = subparsers.add_parser("sample", help="draw images (or videos) from a trained run: files, a captioned grid "
                                             "and samples.json")
    s.add_argument("run_dir", metavar="RUN_DIR", help="run folder (or one of its checkpoints/ckpt_N folders)")
    s.add_argument("--prompts", required=True, metavar="FILE",
                   help=".txt (one prompt a line) or .jsonl prompt file (with an \"image\" column for edit runs)")
    s.add_argument("--out", required=True, metavar="DIR", help="new (or empty) output folder")
    s.add_argument("--weights", choices=["ema", "raw"], default=None,
                   help="trained weights: their EMA or the raw ones (default: ema where the run kept one)")
    s.add_argument("--seed", type=int, default=0,
                   help="image j of prompt i starts from the noise of seed (seed * 100000 + i) * 100 + j")
    s.add_argument("--steps", type=int, default=None, help="ODE steps (default: the run's sampler.num_steps)")
    s.add_argument("--guidance", type=float, default=None,
                   help="guidance scale (default: the run's model.guidance_scale)")
    s.add_argument("--checkpoint", type=int, default=None, metavar="N",
                   help="checkpoint iteration (default: the newest intact one)")
    s.add_argument("--images-per-prompt", type=int, default=1, metavar="K", help="samples per prompt (1..100)")
    s.add_argument("--batch-size", type=int, default=4, help="samples per model call")
    s.add_argument("--quiet", action="store_true", help="no progress bars (neither flowgrpo's nor the libraries')")
    s.set_defaults(fn=_cmd_sample)
