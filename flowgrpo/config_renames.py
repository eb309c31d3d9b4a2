"""Configuration keys that moved: an old key still loads, moved to its new place with one
:class:`ConfigKeyRenamedWarning` per key (:func:`move_renamed`, applied by
:func:`flowgrpo.config.apply_dict`'s callers before the dataclasses are filled)."""

from __future__ import annotations

import warnings

from .errors import ConfigError

#: Keys that moved: old key -> new key. The old key still works and warns once per load.
RENAMED_KEYS = {
    "data.group_size": "data.trees_per_prompt",
    "strategy.fusion_beta": "advantage.fusion_beta",
    "strategy.clip_adapt": "loss.clip_adapt",
    "strategy.sft_weight": "loss.sft_weight",
    "loss.beta": "loss.kl_beta",  # one name for the KL weight across objectives
}


class ConfigKeyRenamedWarning(UserWarning):
    """A configuration used a key that has moved (see :data:`RENAMED_KEYS`)."""


def move_renamed(data: dict) -> dict:
    """A copy of ``data`` with every old key moved to its new place (a warning per key)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    log = out.get("log")
    if isinstance(log, dict) and "tensorboard" in log:  # a switch that became a list entry
        on = log.pop("tensorboard")
        warnings.warn("config key 'log.tensorboard' is now the list 'log.trackers' (log.tensorboard=false is "
                      "log.trackers=[]); please rename it", ConfigKeyRenamedWarning, stacklevel=4)
        if not isinstance(on, bool):
            on = str(on).strip().lower() in ("1", "true", "yes", "on")
        if "trackers" not in log:
            log["trackers"] = ["tensorboard"] if on else []
    for old, new in RENAMED_KEYS.items():
        osec, okey = old.split(".")
        nsec, nkey = new.split(".")
        if isinstance(out.get(osec), dict) and okey in out[osec]:
            value = out[osec].pop(okey)
            warnings.warn(f"config key '{old}' is now '{new}'; please rename it", ConfigKeyRenamedWarning, stacklevel=4)
            section = out.setdefault(nsec, {})
            if not isinstance(section, dict):
                raise ConfigError(f"config section '{nsec}' must be a mapping, got {type(section).__name__}")
            section.setdefault(nkey, value)
    return out
