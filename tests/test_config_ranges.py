"""Numeric config values out of range are refused at load time with one line naming the key
(issue: noise_level=-1 used to train to the end and checkpoint NaN weights; lr=inf exited 0)."""

from __future__ import annotations

import pytest

from flowgrpo.config import RANGES, load_config, preset_names
from flowgrpo.errors import ConfigError


@pytest.mark.parametrize("override", ["sampler.noise_level=-1", "sampler.noise_level=nan", "train.lr=inf",
                                      "train.lr=nan", "train.lr=-1", "loss.grpo.clip_range=-1", "train.ema_decay=5",
                                      "train.adam_eps=0", "train.adam_betas=[0.9, 1.5]", "loss.nft.beta=0",
                                      "loss.awm.timesteps=0", "loss.dgpo.time_fraction=1.5", "train.max_grad_norm=0"])
def test_out_of_range_values_are_one_line_config_errors(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"config key 'loss.{key.split('.', 1)[1]}'" if key.startswith("loss.")
                       and key.count(".") == 2 else f"config key '{key}'"):
        load_config("shapes", None, [override])


@pytest.mark.parametrize("preset", preset_names())
def test_every_shipped_preset_is_within_range(preset):
    load_config(preset)


def test_range_table_names_real_fields():
    cfg = load_config("shapes")
    assert {"sampler.noise_level", "train.lr", "train.ema_decay", "data.trees_per_prompt", "dist.timeout_s"} <= set(RANGES)
    for key in RANGES:  # nested keys too (an objective's options: loss.flow_dppo.kl_threshold)
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        assert value is None or isinstance(value, (int, float)), key


def test_bounds_are_written_beside_their_fields():
    """Each bound is declared on its field (``_f(..., ge=0.0)``): the dataclass field carries it, and a
    value outside it is refused with the bound in the message."""
    import dataclasses

    from flowgrpo.config import TrainConfig

    ema = {f.name: f for f in dataclasses.fields(TrainConfig)}["ema_decay"]
    assert ema.metadata["range"] == {"ge": 0.0, "lt": 1.0}
    with pytest.raises(ConfigError, match=r"'train.timestep_fraction' must be a finite number > 0.0 and <= 1.0"):
        load_config("shapes", None, ["train.timestep_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"'data.trees_per_prompt' must be >= 1, got 0"):
        load_config("shapes", None, ["data.trees_per_prompt=0"])
    with pytest.raises(ConfigError, match=r"'model.resolution' must be >= 1, got 0"):
        load_config("shapes", None, ["model.resolution=0"])
    assert load_config("shapes", None, ["model.resolution=null"]).model.resolution is None
