"""``flowgrpo unigenbench generate``: ``{index}_{j}.png`` for every prompt of a set, resumable.

The model is anything ``model.name`` accepts (an adapter such as ``sd3-tiny``, a diffusers pipeline
folder or a cached hub id), or a run directory: then the run's config builds the policy and the
latest checkpoint's weights are loaded into it (the EMA weights when the run kept them, as
``flowgrpo eval`` and the run's ``lora/`` export use), so a trained LoRA is evaluated as trained.

Images come from the deterministic ODE (Euler on the policy's own sigma grid, classifier-free
guidance as configured), each from its own initial noise seeded by (``--seed``, index, j), in
batches of ``--batch-size`` counted from the set's first image. Each PNG is written to a temporary
name and renamed, so a file is either complete or absent; on start, every ``{index}_{j}.png`` that
is complete (PNG signature and final IEND chunk) is kept and any other (e.g. cut short by a copy)
is made again: its whole batch is run again and only the missing images are written, so a resumed
run with the same ``--batch-size`` makes the images of an uninterrupted one bit for bit. (An image
made in a batch of another size or content can differ by one 8-bit level: the model's matrix
products sum in an order that depends on the batch shape.) ``generate.json`` records the settings;
resuming into the folder with other settings is refused, so one folder never mixes two models.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..images import png_bytes
from ..output.drawing import check_draw_flags, noise_seed
from .judgements import file_sha256
from .prompts import BenchPrompt, PromptSet
from ..text_inputs import loads_json

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"
SETTINGS_NAME = "generate.json"


@dataclass
class GenerateOptions:
    """Sampling settings. ``steps``/``guidance`` None: the model config's (``eval.num_steps``,
    ``model.guidance_scale``). ``overrides``: ``model.*`` (or other) config overrides, e.g.
    ``model.resolution=1024``. ``batch_size``: images per model call."""

    images_per_prompt: int = 4
    seed: int = 0
    steps: int | None = None
    guidance: float | None = None
    batch_size: int = 4
    limit: int | None = None
    overrides: list[str] = field(default_factory=list)


def _png_path(out: Path, prompt: BenchPrompt, j: int) -> Path:
    return out / f"{prompt.index}_{j}.png"


def png_is_complete(path: Path) -> bool:
    """Whether ``path`` is a PNG file with its signature and final IEND chunk (not cut short)."""
    try:
        size = path.stat().st_size
        if size < len(PNG_SIGNATURE) + len(PNG_END):
            return False
        with open(path, "rb") as fh:
            head = fh.read(len(PNG_SIGNATURE))
            fh.seek(-len(PNG_END), os.SEEK_END)
            return head == PNG_SIGNATURE and fh.read() == PNG_END
    except OSError:
        return False


def resolve_model(model: str, overrides: list[str]):
    """(config, description) for a model name / pipeline folder or a run directory (nothing is loaded;
    a run's description names its newest intact checkpoint, whose weights :func:`build_generator` loads).
    The shapes-world model is refused: its closed vocabulary cannot read UniGenBench's prompts."""
    from ..config import apply_overrides, load_config, validate
    from ..policies import resolve_adapter

    path = Path(model)
    if not (path / "config.yaml").is_file():
        cfg, desc = load_config(None, None, [f"model.name={model}", *overrides]), {"model": model}
    else:
        from ..trainer.checkpoint import latest_checkpoint, read_run_config

        cfg = read_run_config(path, for_training=False)
        apply_overrides(cfg, overrides)
        validate(cfg, for_training=False)
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise UserError(f"run directory {path} has no checkpoint yet")
        desc = {"run": str(path.resolve()), "checkpoint": ckpt.name}
    if resolve_adapter(cfg.model)[0] == "shapes":
        raise UserError(f"{model} is a shapes-world model: it only knows the words of its toy world and cannot "
                        "draw UniGenBench prompts; give a text-to-image model (an SD3 or FLUX pipeline, or a run of one)")
    return cfg, desc


def build_generator(cfg, desc: dict):
    """The policy of :func:`resolve_model`'s result, with a run's checkpoint weights loaded (its EMA
    weights when it kept them, else the raw ones)."""
    from ..policies import build_policy

    policy = build_policy(cfg.model)
    if "run" in desc:
        from ..trainer.checkpoint import load_policy_weights

        run = Path(desc["run"])
        trained = load_policy_weights(run, checkpoint=run / "checkpoints" / desc["checkpoint"])
        policy.load_trainable_state_dict(trained.weights)
    return policy


def _settings(prompt_set: PromptSet, desc: dict, cfg, opts: GenerateOptions, steps: int, guidance: float) -> dict:
    from ..config import to_dict

    return {"set": prompt_set.name, "prompts_sha256": file_sha256(prompt_set.source), **desc,
            "model_config": to_dict(cfg)["model"], "shift": cfg.sampler.shift, "steps": steps,
            "guidance": guidance, "seed": opts.seed, "solver": "euler"}


def read_settings(folder: Path) -> dict | None:
    """The ``generate.json`` of an image folder (None when it has none; a UserError when unreadable)."""
    path = Path(folder) / SETTINGS_NAME
    if not path.is_file():
        return None
    try:
        settings = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} cannot be read ({str(exc).splitlines()[0]}); remove it or use another folder") from None
    if not isinstance(settings, dict):
        raise UserError(f"{path} does not hold generation settings (a JSON object); remove it or use another folder")
    return settings


def _check_settings(out: Path, settings: dict) -> None:
    path = out / SETTINGS_NAME
    old = read_settings(out)
    if old is not None:
        diff = [k for k in settings if old.get(k) != settings[k]]
        if diff:
            raise UserError(f"{out} holds images made with other settings ({', '.join(diff)} differ, see "
                            f"{path}); use another --out to keep one model per folder")
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False), encoding="utf-8")


def _save_png(image, path: Path) -> None:
    """Write one image ([3, H, W] float in [0, 1]) as a PNG under a temporary name, then rename it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(png_bytes(image, compress_level=6))
    os.replace(tmp, path)


def batches(items: list, batch_size: int) -> list[list]:
    """``items`` cut into batches of ``batch_size`` from the first (the last may be shorter)."""
    return [items[start:start + batch_size] for start in range(0, len(items), batch_size)]


def render(policy, items: list[tuple[BenchPrompt, int]], seed: int, steps: int, shift: float, batch_size: int):
    """Yield (batch of (prompt, j), images [B, 3, H, W] float in [0, 1] on the CPU), ``batch_size`` at a time."""
    yield from render_batches(policy, batches(items, batch_size), seed, steps, shift)


def render_batches(policy, groups: list[list[tuple[BenchPrompt, int]]], seed: int, steps: int, shift: float):
    """Yield (batch, images [B, 3, H, W] float in [0, 1] on the CPU) for each batch of (prompt, j) in ``groups``.

    Euler ODE over ``policy.sigma_grid(steps, shift)`` with the policy's guidance; step math in
    float32, the model in its own dtype; image (prompt, j) starts from the noise of
    :func:`~flowgrpo.output.drawing.noise_seed` (independent of batching and of ``--images-per-prompt``)."""
    import torch

    from ..samplers.solvers import solve_ode

    device = policy.device
    model_dtype = next(policy.parameters()).dtype
    sigmas = policy.sigma_grid(steps, shift)
    for batch in groups:
        noise = torch.stack([torch.randn(policy.latent_shape, generator=torch.Generator().manual_seed(
            noise_seed(seed, p.index, j))) for p, j in batch]).to(device)
        with torch.no_grad():
            cond = policy.encode_prompts([p.prompt for p, _ in batch])

            def velocity(x, s):
                return policy.velocity(x.to(model_dtype), torch.full((x.shape[0],), s, device=device), cond).float()

            images = policy.decode(solve_ode(velocity, noise, sigmas)).float().cpu()
        if images.ndim != 4:
            raise UserError(f"{type(policy).__name__} makes videos ({tuple(images.shape)}); UniGenBench judges images")
        yield batch, images.clamp(0, 1)


def generate_folder(model: str, prompt_set: PromptSet, out: str | Path, opts: GenerateOptions,
                    progress: bool = True) -> dict:
    """Generate the missing images of ``prompt_set`` into ``out``. Returns counts
    ``{"images", "kept", "regenerated", "generated"}`` (regenerated: incomplete files made again)."""
    import torch
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    check_draw_flags(seed=opts.seed, images_per_prompt=opts.images_per_prompt, steps=opts.steps,
                     batch_size=opts.batch_size)
    prompts = prompt_set.limited(opts.limit)
    cfg, desc = resolve_model(model, opts.overrides)  # before anything is written: a model it refuses leaves no folder
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for problem in prompt_set.problems:
        print(f"warning: {problem}")
    wanted = [(p, j) for p in prompts for j in range(opts.images_per_prompt)]
    paths = [_png_path(out, p, j) for p, j in wanted]
    missing = {path for path in paths if not png_is_complete(path)}
    broken = sum(1 for path in missing if path.exists())
    counts = {"images": len(wanted), "kept": len(wanted) - len(missing), "regenerated": broken,
              "generated": len(missing)}
    steps = opts.steps or cfg.eval.num_steps
    guidance = cfg.model.guidance_scale if opts.guidance is None else opts.guidance
    _check_settings(out, _settings(prompt_set, desc, cfg, opts, steps, guidance))
    if broken:
        print(f"{broken} incomplete images will be made again")
    if not missing:
        print(f"all {len(wanted)} images of set {prompt_set.name} are already in {out}")
        return counts
    policy = build_generator(cfg, desc)
    policy.eval()
    if torch.cuda.is_available():
        policy = policy.to("cuda")
    policy.guidance_scale = guidance  # before any prompt is encoded: guidance != 1 encodes the empty prompt too
    if counts["kept"]:
        print(f"resuming: {counts['kept']} of {len(wanted)} images already in {out}")
    bar = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn(), disable=not progress)
    with bar:
        task = bar.add_task("generate", total=len(wanted), completed=counts["kept"])
        # whole batches of the uninterrupted run (its images bit for bit), of which only the missing are written
        redo = [b for b in batches(wanted, opts.batch_size) if any(_png_path(out, *w) in missing for w in b)]
        for batch, images in render_batches(policy, redo, opts.seed, steps, cfg.sampler.shift):
            made = [(path, image) for w, image in zip(batch, images) if (path := _png_path(out, *w)) in missing]
            for path, image in made:
                _save_png(image, path)
            bar.update(task, advance=len(made))
    return counts
