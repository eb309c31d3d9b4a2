"""Distillation teachers: other trained weights of the student's own model, routed per prompt.

A teacher is the student's policy with the teacher's trainable weights loaded (the LoRA adapter, or
every transformer weight of a full fine-tune), run without gradients, the live weights loaded back
after: no second model is built, and LoRA, full fine-tuning and sharded weights are served alike
(as :mod:`.old_policy` evaluates its lagging copy).

Teachers are named by path in the config (``loss.flow_opd.teachers``, a prompt key -> path mapping;
``default_teacher``; ``anchor_teacher``). :func:`teacher_source` tells a run folder (or checkpoint
folder) from a LoRA folder or file; the loaders themselves sit beside the checkpoints they read
(:mod:`flowgrpo.trainer.teacher_weights`, registered lazily in :data:`TEACHER_SOURCES`). Every teacher
is checked against the student before it is used: the same model (name, base weights, train mode: by
the run's config where there is one) and exactly the student's trainable tensors, by name and shape;
anything else is one :class:`~flowgrpo.errors.UserError` naming the config key and the path.

Routing: each prompt's key (``Collected.prompt_keys``: the shapes world's tag, a ``.jsonl`` prompt
file's ``tag`` column, see ``data.curriculum_key``) picks its teacher from the mapping, else the
default teacher; a prompt that has neither is an error naming the key and the mapping's keys.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import ConfigError, UserError
from ..registry import Registry
from .old_policy import trainable_weights_loaded

#: teacher kind -> loader ``(path, policy, model_cfg) -> {trainable name: tensor}``
TEACHER_SOURCES: Registry = Registry("teacher source")
TEACHER_SOURCES.register_lazy("run", "flowgrpo.trainer.teacher_weights:load_run_teacher")
TEACHER_SOURCES.register_lazy("lora", "flowgrpo.trainer.teacher_weights:load_lora_teacher")


def teacher_source(path: str, key: str) -> str:
    """"run" (a run folder or checkpoint folder) or "lora" (a LoRA folder or .safetensors file) for
    ``path``; one UserError naming config key ``key`` when it is neither or does not exist."""
    p = Path(path)
    if not path or not p.exists():
        raise UserError(f"{key} = {path!r} does not exist; a teacher is a run folder, one of its "
                        "checkpoints/ckpt_N folders, or a LoRA folder or .safetensors file")
    if (p / "config.yaml").is_file() or (p / "state.pt").is_file():
        return "run"
    if p.suffix == ".safetensors" or (p / "pytorch_lora_weights.safetensors").is_file():
        return "lora"
    raise UserError(f"{key} = {path!r} is neither a run folder (config.yaml), a checkpoint folder "
                    "(state.pt) nor a LoRA (pytorch_lora_weights.safetensors)")


def load_teacher(path: str, key: str, policy, model_cfg) -> dict[str, Tensor]:
    """The trainable weights of teacher ``path`` (config key ``key``), after checking that they are
    exactly the student ``policy``'s trainable tensors by name and shape."""
    weights = TEACHER_SOURCES.get(teacher_source(path, key))(Path(path), policy, model_cfg)
    ours = policy.trainable_state_dict()
    missing = [n for n in ours if n not in weights]
    extra = [n for n in weights if n not in ours]
    wrong = [n for n in ours if n in weights and tuple(weights[n].shape) != tuple(ours[n].shape)]
    if missing or extra or wrong:
        first = (missing or extra or wrong)[0]
        what = "lacks" if missing else ("has tensors the student lacks, e.g." if extra else "has another shape for")
        raise UserError(f"{key} = {path!r} does not fit the student (model.name={model_cfg.name}): it {what} "
                        f"{first!r} ({len(missing)} missing, {len(extra)} extra, {len(wrong)} of another shape "
                        f"of {len(ours)}): a teacher must be a run of the student's model with its train mode "
                        "and LoRA rank")
    return {n: weights[n].detach().to(ours[n].dtype) for n in ours}


class TeacherSet:
    """The teachers of one run, loaded once, and each prompt's route to one of them.

    Args:
        routes: prompt key -> teacher path. default: the teacher of other keys ("" none).
        anchor: the task-agnostic teacher of the anchor term ("" none: the caller uses the base model).
        policy: the student (its trainable tensors are what a teacher must match).
        model_cfg: the student's ``model`` section (a teacher run's must be the same model).
        option: the config key prefix named in errors (``loss.flow_opd``).
    """

    def __init__(self, routes: dict, default: str, anchor: str, policy, model_cfg, option: str):
        if not routes and not default:
            raise ConfigError(f"{option}.teachers is empty and {option}.default_teacher is unset: name at least "
                              f"one teacher, e.g. {option}.teachers='{{counting: runs/counting_teacher}}'")
        self.option = option
        self.routes = {str(k): str(v) for k, v in routes.items()}
        self.default = default
        #: distinct teacher paths, routes first, then the default (the order of :meth:`route`'s indices)
        self.paths = list(dict.fromkeys([*self.routes.values(), *([default] if default else [])]))
        keys = {p: next((f"{option}.teachers.{k}" for k, v in self.routes.items() if v == p),
                        f"{option}.default_teacher") for p in self.paths}
        self.weights = [load_teacher(p, keys[p], policy, model_cfg) for p in self.paths]
        self.anchor = load_teacher(anchor, f"{option}.anchor_teacher", policy, model_cfg) if anchor else None

    def route(self, prompt_keys: list[str]) -> Tensor:
        """[P] long: the teacher index (into :attr:`paths`) of each prompt, from its key."""
        out = []
        for key in prompt_keys:
            path = self.routes.get(str(key), self.default)
            if not path:
                raise UserError(f"prompt key {key!r} has no teacher: {self.option}.teachers routes "
                                f"{sorted(self.routes)}; add it there or set {self.option}.default_teacher")
            out.append(self.paths.index(path))
        return torch.tensor(out, dtype=torch.long)

    def merged(self) -> dict[str, Tensor]:
        """The element-wise mean of the teachers' trainable tensors (the anchor not included): for a
        LoRA, each A and each B averaged on its own, as the authors' merge script does."""
        return {n: torch.stack([w[n].float() for w in self.weights]).mean(0).to(self.weights[0][n].dtype)
                for n in self.weights[0]}

    @torch.no_grad()
    def velocity(self, policy, index: int | None, x: Tensor, sigma: Tensor, cond) -> Tensor:
        """Teacher ``index``'s velocity [B, ...] at x [B, ...], sigma [B] (None: the anchor teacher)."""
        with trainable_weights_loaded(policy, self.anchor if index is None else self.weights[index]):
            return policy.velocity(x, sigma, cond)
