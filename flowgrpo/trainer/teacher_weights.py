"""A distillation teacher's weights from disk: a finished run folder or a LoRA export.

Flow-OPD (:mod:`flowgrpo.objectives.flow_opd`) distils teachers that are other runs of the *same*
base model: each teacher is the student's policy with the teacher's trainable weights loaded (the
LoRA adapter, or every transformer weight of a full fine-tune). This module turns a path into those
weights, keyed as :meth:`~flowgrpo.policies.Policy.trainable_state_dict`, and refuses a teacher of
another model in one line before any weight is loaded:

* **run** -- a run folder (``RUN_DIR`` with ``config.yaml``) or one of its checkpoint folders
  (``RUN_DIR/checkpoints/ckpt_N``): the newest intact checkpoint's EMA weights where the run kept an
  EMA (what the run evaluated and exported), else its raw weights. The teacher's ``model.name``,
  ``model.path``, ``model.train_mode`` and (for models that record one) the fingerprint of its base
  weights must be the student's.
* **lora** -- a LoRA folder in diffusers' format (``RUN_DIR/lora``, what ``flowgrpo export`` and the
  end of a LoRA run write) or its ``pytorch_lora_weights.safetensors``: read as plain tensors, its keys
  mapped back to the student's adapter. A LoRA folder inside a run folder is checked against that run's
  config as a run teacher is.

Both are registered lazily in :data:`flowgrpo.objectives.teachers.TEACHER_SOURCES`, which the objective
reads; this module lives beside the checkpoints it reads.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from ..errors import UserError
from .base_weights import BASE_FILE, base_fingerprint
from .checkpoint import CONFIG_FILE, STATE_FILE, load_policy_weights, read_run_config
from ..text_inputs import loads_json

#: the file diffusers' LoRA savers write in a LoRA folder
LORA_FILENAME = "pytorch_lora_weights.safetensors"


def _run_dir(path: Path) -> tuple[Path, Path | None]:
    """(run folder, checkpoint folder or None) of a run teacher's path."""
    if (path / STATE_FILE).is_file():
        return path.resolve().parent.parent, path
    return path, None


def check_same_model(run_dir: Path, model_cfg, what: str) -> None:
    """One UserError when run folder ``run_dir`` trained another model than ``model_cfg`` (the student's):
    another ``model.name``, ``model.path``, ``model.train_mode``, or recorded base-weights fingerprint."""

    cfg = read_run_config(run_dir, for_training=False)
    theirs, ours = cfg.model, model_cfg

    def where(m) -> str:
        return f"{m.name!r} (model.path={m.path or 'null'}, train_mode={m.train_mode})"

    same_path = (theirs.path or None) == (ours.path or None) or (
        theirs.path and ours.path and Path(theirs.path).resolve() == Path(ours.path).resolve())
    if theirs.name != ours.name or not same_path or theirs.train_mode != ours.train_mode:
        raise UserError(f"teacher {what} was trained on model {where(theirs)}, the student is {where(ours)}: "
                        "a Flow-OPD teacher must be a run of the student's own base model")
    recorded = run_dir / BASE_FILE
    now = base_fingerprint(ours)
    if recorded.is_file() and now is not None:
        sha = loads_json(recorded.read_text()).get("sha256")
        if sha != now["sha256"]:
            raise UserError(f"teacher {what} was trained from other {ours.name} base weights (sha256 "
                            f"{str(sha)[:12]}) than the student's {now['path']} (sha256 {now['sha256'][:12]}): "
                            "a Flow-OPD teacher must be a run of the student's own base model")


def load_run_teacher(path: Path, policy, model_cfg) -> dict[str, Tensor]:
    """The trained weights of run folder or checkpoint folder ``path`` (EMA where kept), after
    :func:`check_same_model`. ``policy`` is unused (the keys are checked by the caller)."""
    run_dir, ckpt = _run_dir(Path(path))
    if not (run_dir / CONFIG_FILE).is_file():
        raise UserError(f"teacher {path} is not a run folder (no {CONFIG_FILE}) nor one of its checkpoint folders")
    check_same_model(run_dir, model_cfg, str(path))
    return load_policy_weights(run_dir, prefer_ema=True, checkpoint=ckpt).weights


def load_lora_teacher(path: Path, policy, model_cfg) -> dict[str, Tensor]:
    """The adapter weights of LoRA folder (or file) ``path`` in diffusers' layout, keyed as the student
    ``policy``'s trainable tensors. A LoRA folder inside a run folder is checked against the run's config
    (:func:`check_same_model`); a loose LoRA only by its tensors' names and shapes (the caller's check)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    file = path / LORA_FILENAME if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"teacher {path} holds no {LORA_FILENAME}")
    if (file.parent.parent / CONFIG_FILE).is_file():  # RUN_DIR/lora: the run says which model it is
        check_same_model(file.parent.parent, model_cfg, str(path))
    if getattr(policy, "train_mode", "lora") != "lora":
        raise UserError(f"teacher {path} is a LoRA, but the student trains model.train_mode="
                        f"{policy.train_mode}: a LoRA teacher needs model.train_mode=lora")
    try:
        raw = load_file(str(file))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"teacher {file} cannot be read as safetensors ({str(exc).splitlines()[0]})") from None
    scale, ours = lora_teacher_scale(file), model_cfg.lora_alpha / model_cfg.lora_rank
    if scale is not None and abs(scale - ours) > 1e-6 * ours:
        raise UserError(f"teacher {path} is a LoRA of scale alpha/rank = {scale:g}, the student's is "
                        f"model.lora_alpha/model.lora_rank = {ours:g}: set them to the teacher's")
    adapter = getattr(policy, "adapter_name", "default")
    out: dict[str, Tensor] = {}
    for name in policy.trainable_state_dict():
        # the saved name: the policy's, without the adapter's (peft) -- "x.lora_A.default.weight" -> "x.lora_A.weight"
        saved = name.replace(f".{adapter}.", ".")
        if saved in raw:
            out[name] = raw[saved]
    return out


def lora_teacher_scale(file: Path) -> float | None:
    """alpha / rank a LoRA file's metadata records (None when it records none)."""

    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
    for value in meta.values():
        try:
            cfg = loads_json(value)
        except (TypeError, ValueError):
            continue
        if not isinstance(cfg, dict):
            continue
        # diffusers prefixes peft's config keys with the module ("transformer.r", "transformer.lora_alpha")
        short = {k.rsplit(".", 1)[-1]: v for k, v in cfg.items()}
        if short.get("r") and short.get("lora_alpha") is not None:
            return float(short["lora_alpha"]) / float(short["r"])
    return None


__all__ = ["LORA_FILENAME", "check_same_model", "load_lora_teacher", "load_run_teacher", "lora_teacher_scale"]
