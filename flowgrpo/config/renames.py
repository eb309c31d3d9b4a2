"""Configuration keys that moved: an old key still loads, moved to its new place with one
:class:`ConfigKeyRenamedWarning` per key (:func:`move_renamed`, applied by
:func:`flowgrpo.config.apply_dict`'s callers before the dataclasses are filled).

Keys are dotted paths of any depth (``loss.kl_beta`` -> ``loss.grpo.kl_beta``). A key that two
objectives read before their options were split moves to both (:func:`new_keys`)."""

from __future__ import annotations

import warnings

from ..errors import ConfigError

#: GRPO's options that sat flat in ``loss`` until each objective's options moved under ``loss.<objective>``
_GRPO_MOVED = ("clip_range", "clip_adapt", "kl_beta", "kl_sigma", "batched_reference", "guard", "anchor_steps",
               "backend")

#: Keys that moved: old key -> new key, or a tuple of new keys where the old one set several (the
#: per-step weights were read by grpo and flow_dppo alike). The old key still works and warns once per load.
RENAMED_KEYS: dict[str, str | tuple[str, ...]] = {
    "data.group_size": "data.trees_per_prompt",
    "strategy.fusion_beta": "advantage.fusion_beta",
    "strategy.clip_adapt": "loss.grpo.clip_adapt",
    "strategy.sft_weight": "loss.grpo.sft_beta",
    "loss.beta": "loss.grpo.kl_beta",  # one name for the KL weight across objectives
    **{f"loss.{key}": f"loss.grpo.{key}" for key in _GRPO_MOVED},
    "loss.sft_weight": "loss.grpo.sft_beta",
    "loss.anchor_weight": "loss.grpo.anchor_beta",
    "loss.guard_reweight": ("loss.grpo.guard_reweight", "loss.flow_dppo.guard_reweight"),
    "loss.tempflow_weight": ("loss.grpo.tempflow_weight", "loss.flow_dppo.tempflow_weight"),
}


class ConfigKeyRenamedWarning(UserWarning):
    """A configuration used a key that has moved (see :data:`RENAMED_KEYS`)."""


def new_keys(key: str) -> tuple[str, ...]:
    """The keys a dotted ``key`` now sets: its new places if it moved, else ``(key,)``."""
    new = RENAMED_KEYS.get(key, key)
    return (new,) if isinstance(new, str) else tuple(new)


def renamed_text(old: str) -> str:
    """``'loss.grpo.kl_beta'`` or ``'loss.grpo.guard_reweight' and 'loss.flow_dppo.guard_reweight'``."""
    return " and ".join(f"'{k}'" for k in new_keys(old))


def _copy(data: dict) -> dict:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def _pop(data: dict, path: list[str]) -> tuple[bool, object]:
    node = data
    for part in path[:-1]:
        node = node.get(part)
        if not isinstance(node, dict):
            return False, None
    if path[-1] not in node:
        return False, None
    return True, node.pop(path[-1])


def _set_default(data: dict, path: list[str], value) -> None:
    """``data[path] = value`` unless the layer sets the new key itself (it wins), creating sections."""
    node = data
    for depth, part in enumerate(path[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config section '{'.'.join(path[:depth + 1])}' must be a mapping, got {type(node).__name__}")
    node.setdefault(path[-1], value)


def move_renamed(data: dict) -> dict:
    """A copy of ``data`` with every old key moved to its new place(s) (one warning per key)."""
    out = _copy(data)
    log = out.get("log")
    if isinstance(log, dict) and "tensorboard" in log:  # a switch that became a list entry
        on = log.pop("tensorboard")
        warnings.warn("config key 'log.tensorboard' is now the list 'log.trackers' (log.tensorboard=false is "
                      "log.trackers=[]); please rename it", ConfigKeyRenamedWarning, stacklevel=4)
        if not isinstance(on, bool):
            on = str(on).strip().lower() in ("1", "true", "yes", "on")
        if "trackers" not in log:
            log["trackers"] = ["tensorboard"] if on else []
    for old in RENAMED_KEYS:
        found, value = _pop(out, old.split("."))
        if not found:
            continue
        warnings.warn(f"config key '{old}' is now {renamed_text(old)}; please rename it", ConfigKeyRenamedWarning,
                      stacklevel=4)
        for new in new_keys(old):
            _set_default(out, new.split("."), value)
    return out
