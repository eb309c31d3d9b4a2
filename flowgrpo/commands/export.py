"""LoRA of a run in diffusers' format, and ``flowgrpo export``.

At the end of a LoRA run on a diffusers model, :func:`flowgrpo.trainer.run.train` writes
``RUN_DIR/lora/pytorch_lora_weights.safetensors``: the EMA weights when ``train.ema`` is on (the
weights flowgrpo evaluates), else the live adapter. A stock pipeline loaded from the run's base
model then reproduces the trained policy::

    pipe = StableDiffusion3Pipeline.from_pretrained(base)
    pipe.load_lora_weights(RUN_DIR / "lora")

``flowgrpo export RUN_DIR --to DIR`` writes the same file from any checkpoint (``--checkpoint N``,
default the latest; ``--raw`` for the raw instead of the EMA weights), or with ``--fuse`` the whole
pipeline with the adapter fused into the transformer (``save_pretrained`` layout, loadable without
peft). A model adapter takes part by implementing :meth:`flowgrpo.policies.Policy.save_lora`.

A full fine-tune (``model.train_mode=full``) exports its trained weights instead: a diffusers model as
the base pipeline folder with the trained transformer in place of the base one (``save_pretrained``
layout: ``DiffusionPipeline.from_pretrained(DIR)`` loads it), the shapes world as a shapes weights
folder (``model.safetensors`` + ``config.json``, the world's own format, not diffusers': its model is
no diffusers class), which ``model.path=DIR`` takes as the base of a new run and ``flowgrpo shapes
probe --weights DIR`` reads.

``--to`` must be new or an empty folder. The export is written into a temporary folder beside it
and renamed at the end (:func:`flowgrpo.disk.new_folder`), after a check that its disk has room for
the weights: a write that fails (a full disk) removes what it wrote and is one line.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..disk import check_new_folder, new_folder, tensor_bytes, tensor_write_errors
from ..errors import UserError

LORA_DIRNAME = "lora"
#: the file diffusers' save_lora_weights writes and load_lora_weights reads in a LoRA folder
LORA_FILENAME = "pytorch_lora_weights.safetensors"


def checkpoint_weights(run_dir: Path, checkpoint: int | None = None, raw: bool = False):
    """(config, :class:`~flowgrpo.trainer.checkpoint.PolicyWeights`) of a LoRA run's checkpoint
    (``checkpoint``: an iteration; default the newest intact one)."""
    from ..trainer.checkpoint import load_policy_weights, read_run_config

    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir, for_training=False)
    if cfg.model.train_mode != "lora":
        raise UserError(f"{run_dir} is not a LoRA run (model.train_mode={cfg.model.train_mode}); "
                        "only LoRA adapters can be exported here")
    return cfg, load_policy_weights(run_dir, prefer_ema=not raw, checkpoint=checkpoint)


def save_pipeline(pipe, to: Path, what: str) -> None:
    """``pipe.save_pretrained`` into ``to`` through :func:`~flowgrpo.disk.new_folder` (room checked for its
    modules' tensors first; a failed write leaves nothing)."""
    import torch

    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    need = tensor_bytes(t for m in modules for t in m.state_dict().values())
    with new_folder(to, what, need, tensor_write_errors()) as tmp:
        pipe.save_pretrained(tmp)


def export_full(run_dir: Path, to: Path, checkpoint: int | None = None, raw: bool = False) -> Path:
    """Export a full fine-tune (see the module docstring): the shapes world's weights folder, or the base
    pipeline with the trained transformer. ``to`` was checked by the caller. Returns ``to``."""
    from ..policies.diffusers.common import load_pipeline
    from ..policies.diffusers.switches import torch_dtype
    from ..trainer.checkpoint import load_trained_policy

    run = load_trained_policy(run_dir, prefer_ema=not raw, iteration=checkpoint)
    policy, which, ckpt = run.policy, run.weights.kind, run.weights.path
    model = getattr(policy, "model", None)
    if run.cfg.model.name == "shapes":
        with new_folder(to, "shapes weights folder", tensor_bytes(model.state_dict().values()),
                        tensor_write_errors()) as tmp:
            model.save(tmp, {"exported_from": str(ckpt), "weights": which})
        print(f"wrote {to} (the shapes model with the {which} weights of {ckpt}; train from it with "
              f"model.path={to})")
        return to
    from ..policies import resolve_adapter

    base = resolve_adapter(run.cfg.model)[1]
    denoiser = getattr(policy, "denoiser_path", None)
    if not base or denoiser is None:
        raise UserError(f"{run_dir}: model {run.cfg.model.name!r} has no base pipeline folder to export into")
    from diffusers import DiffusionPipeline

    pipe = load_pipeline(DiffusionPipeline, base, torch_dtype(run.cfg.model.dtype))
    setattr(pipe, denoiser, getattr(policy, denoiser))  # the trained module replaces the base one
    save_pipeline(pipe, to, "pipeline folder")
    print(f"wrote {to} ({type(pipe).__name__} with the fully fine-tuned {denoiser} of {ckpt}, {which} weights)")
    return to


def export_run(run_dir: str | Path, to: str | Path, fuse: bool = False, checkpoint: int | None = None,
               raw: bool = False) -> Path:
    """Export a LoRA run's adapter to ``to`` (diffusers LoRA format), or with ``fuse`` the base
    pipeline with the adapter fused in. Returns ``to``."""
    import torch

    from ..policies import build_policy, resolve_adapter
    from ..policies.diffusers.common import load_pipeline
    from ..policies.diffusers.sd3 import torch_dtype
    from ..trainer.checkpoint import read_run_config

    to = check_new_folder(to, "--to")  # before the weights are read and the pipeline loaded
    if read_run_config(Path(run_dir), for_training=False).model.train_mode == "full":
        if fuse:
            raise UserError("--fuse fuses a LoRA into its base; a full fine-tune exports its trained weights "
                            "without it")
        return export_full(Path(run_dir), to, checkpoint, raw)
    cfg, trained = checkpoint_weights(Path(run_dir), checkpoint, raw)
    weights, which, ckpt = trained.weights, trained.kind, trained.path
    adapter, base = resolve_adapter(cfg.model)
    if fuse and not base:
        raise UserError(f"--fuse needs the base pipeline folder (model.path), which model {adapter!r} "
                        f"of {run_dir} does not have")
    torch.manual_seed(cfg.train.seed)
    policy = build_policy(cfg.model)
    if not policy.exports_lora:
        policy.save_lora(to)  # the base hook's one-line UserError
    if not fuse:
        with new_folder(to, "LoRA folder", tensor_bytes(weights.values()), tensor_write_errors()) as tmp:
            policy.save_lora(tmp, weights)
        print(f"wrote {to / LORA_FILENAME} ({which} weights of {ckpt})")
        return to
    from diffusers import DiffusionPipeline

    with tempfile.TemporaryDirectory() as tmp:
        lora_dir = policy.save_lora(Path(tmp) / LORA_DIRNAME, weights)
        del policy
        pipe = load_pipeline(DiffusionPipeline, base, torch_dtype(cfg.model.dtype))
        if hasattr(pipe, "load_lora_weights"):
            pipe.load_lora_weights(str(lora_dir))
            # further experts' adapters (Wan 2.2's transformer_2) sit in sub-folders named after them
            experts = [sub.name for sub in sorted(lora_dir.iterdir()) if (sub / LORA_FILENAME).is_file()]
            for name in experts:
                pipe.load_lora_weights(str(lora_dir / name), **{f"load_into_{name}": True})
            with torch.no_grad():
                pipe.fuse_lora(**({"components": ["transformer", *experts]} if experts else {}))
            pipe.unload_lora_weights()
        else:  # a pipeline without a LoRA loader (HunyuanVideo 1.5): its transformer's own
            pipe.transformer.load_lora_adapter(str(lora_dir), prefix="transformer", weight_name=LORA_FILENAME)
            with torch.no_grad():
                pipe.transformer.fuse_lora()
            pipe.transformer.unload_lora()
    save_pipeline(pipe, to, "fused pipeline folder")
    print(f"wrote {to} ({type(pipe).__name__} with the {which} LoRA of {ckpt} fused into its weights)")
    return to
