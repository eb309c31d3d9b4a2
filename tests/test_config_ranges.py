"""Numeric config values out of range are refused at load time with one line naming the key
(issue: noise_level=-1 used to train to the end and checkpoint NaN weights; lr=inf exited 0)."""

from __future__ import annotations

import pytest

from flowgrpo.config import RANGES, load_config, preset_names
from flowgrpo.errors import ConfigError


@pytest.mark.parametrize("override", ["sampler.noise_level=-1", "sampler.noise_level=nan", "train.lr=inf",
                                      "train.lr=nan", "train.lr=-1", "loss.clip_range=-1", "train.ema_decay=5",
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
    for key, *_ in RANGES:
        sec, name = key.split(".")
        assert isinstance(getattr(getattr(cfg, sec), name), float), key
