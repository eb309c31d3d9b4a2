"""Reward-hacking monitors (flowgrpo.monitors, flowgrpo.trainer.monitor): the image statistics on
synthetic images, the rules, the velocity norm against the base model, and a tiny run on a hackable
reward whose stop rule fires."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from flowgrpo.errors import ConfigError
from flowgrpo.monitors.config import MonitorConfig, check_monitor, monitor_rules, parse_rule
from flowgrpo.monitors.measure import reward_means, spread, velocity_norm_ratio
from flowgrpo.monitors.stats import (STAT_NAMES, dark_share, grid_energy, high_freq_energy, image_stats,
                                     luminance, saturation)

N = 64


def _grey(value: float, n: int = 1, size: int = N) -> torch.Tensor:
    return torch.full((n, 3, size, size), value)


def _checkerboard(square: int, size: int = N) -> torch.Tensor:
    """Black and white squares of ``square`` pixels: period 2 * square in both axes, [1, 3, size, size]."""
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    return ((yy // square + xx // square) % 2).float().expand(3, size, size)[None].clone()


def _noise(n: int = 4, size: int = N, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the statistics


def test_dark_share_is_one_for_black_zero_for_white_and_counts_pixels_below_the_level():
    assert dark_share(_grey(0.0)).tolist() == [1.0]
    assert dark_share(_grey(1.0)).tolist() == [0.0]
    half = _grey(1.0)
    half[..., : N // 4, :] = 0.0  # a quarter of the rows black
    assert dark_share(half).item() == pytest.approx(0.25)
    assert dark_share(_grey(0.09)).item() == 1.0 and dark_share(_grey(0.11)).item() == 0.0  # level 0.1
    assert dark_share(_grey(0.3), level=0.5).item() == 1.0


def test_saturation_is_zero_for_grey_one_for_primaries():
    assert saturation(_grey(0.5)).item() == 0.0 and saturation(_grey(0.0)).item() == 0.0  # black: 0, not NaN
    red = torch.zeros(1, 3, 8, 8)
    red[:, 0] = 1.0
    assert saturation(red).item() == 1.0
    pastel = torch.tensor([1.0, 0.5, 0.5]).reshape(1, 3, 1, 1).expand(1, 3, 8, 8)
    assert saturation(pastel).item() == pytest.approx(0.5)


def test_a_checkerboard_at_the_grid_period_has_all_its_energy_on_the_grid():
    assert grid_energy(_checkerboard(8), period=16).item() == pytest.approx(1.0)  # 8-px grid: on the 16-px lattice
    assert grid_energy(_checkerboard(4), period=8).item() == pytest.approx(1.0)
    # a pattern of another period (12 px) puts most of its energy off the 8-pixel lattice
    assert grid_energy(_checkerboard(6, size=48), period=8).item() < 0.2
    noise = grid_energy(_noise(8), period=16)
    expected = (16 ** 2 - 1) / (N * N - 1)  # white noise spreads evenly over the bins
    assert noise.mean().item() == pytest.approx(expected, rel=0.25)
    assert grid_energy(_grey(0.3)).item() == 0.0  # no variance at all


def test_grid_energy_is_the_share_of_the_spectrum_on_the_grid_lattice():
    """The docstring's definition, read off the FFT, equals the tile-mean computation."""
    images = _noise(3, size=48, seed=1) + 0.5 * _checkerboard(4, size=48)
    for period in (8, 16):
        y = luminance(images)
        y = y - y.mean((1, 2), keepdim=True)
        power = torch.fft.fft2(y).abs() ** 2
        lattice = torch.zeros(48, 48, dtype=torch.bool)
        lattice[:: 48 // period, :: 48 // period] = True
        lattice[0, 0] = False
        fft_share = power[:, lattice].sum(1) / power.flatten(1).sum(1)
        torch.testing.assert_close(grid_energy(images, period), fft_share)


def test_high_frequency_energy_of_a_pixel_checkerboard_noise_and_a_smooth_image():
    assert high_freq_energy(_checkerboard(1)).item() == pytest.approx(1.0)
    noise = high_freq_energy(_noise(8)).mean().item()
    assert noise == pytest.approx(1 - math.pi * 0.25 ** 2, abs=0.03)  # the disc's share of the square
    xx = torch.arange(N).float() / N
    smooth = (0.5 + 0.4 * torch.sin(2 * math.pi * xx))[None, None, None, :].expand(1, 3, N, N)
    assert high_freq_energy(smooth).item() < 1e-9  # one frequency, 1/64 cycles per pixel
    assert high_freq_energy(_grey(0.5)).item() == 0.0
    odd = _noise(2, size=33)  # an odd width: the half spectrum has no Nyquist column
    assert 0.7 < high_freq_energy(odd).mean().item() < 0.9


def test_statistics_shapes_types_and_videos():
    images = _noise(5)
    stats = image_stats(images)
    for name in STAT_NAMES:
        value = getattr(stats, name)
        assert value.shape == (5,) and value.dtype == torch.float64 and value.device.type == "cpu"
        assert bool(((value >= 0) & (value <= 1)).all())
    assert set(stats.means()) == set(STAT_NAMES)
    video = torch.stack([_grey(0.0, 2), _grey(1.0, 2)], dim=1)  # [2, F=2, 3, H, W]: a black and a white frame
    assert dark_share(video).tolist() == [0.5, 0.5]
    assert image_stats(video).dark_share.shape == (2,)
    assert dark_share(images * 5 - 2).shape == (5,)  # values outside [0, 1] are clamped
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        dark_share(torch.zeros(2, 1, 8, 8))
    with pytest.raises(ValueError, match="16-pixel period"):
        grid_energy(_grey(0.5, size=8), period=16)


# --------------------------------------------------------------------------- the rules


def test_rules_parse_judge_and_refuse_what_they_cannot_read():
    rule = parse_rule("+0.2 warn")
    assert (rule.rise, rule.fall, rule.action) == (0.2, None, "warn")
    assert rule.breach("dark_share", 0.6, 0.45) is None
    message = rule.breach("dark_share", 0.93, 0.45)
    assert message.startswith("dark_share 0.93 is 0.48 above its before-training 0.45 (limit +0.2)")
    both = parse_rule("+100% -50% stop")
    assert both.bounds(0.2) == (pytest.approx(0.1), pytest.approx(0.4)) and both.action == "stop"
    assert "below" in both.breach("x", 0.09, 0.2) and both.breach("x", 0.39, 0.2) is None
    assert "above" in parse_rule("+10% warn").breach("r", -0.8, -1.0)  # relative to the magnitude
    assert parse_rule("off") is None
    assert parse_rule("+0.1 warn").breach("x", math.nan, 0.0) is None
    for bad in ("0.2 warn", "+0.2", "+0.2 +0.3 warn", "warn", "+x warn", "+0.2 loud"):
        with pytest.raises(ConfigError, match="config key 'monitor.dark_share'"):
            parse_rule(bad, "monitor.dark_share")


def test_the_monitor_section_is_checked_with_the_config(tiny_config):
    from flowgrpo.config import load_config

    cfg = tiny_config(**{"monitor.rewards": "[shapes]", "monitor.dark_share": "'+0.05 stop'",
                         "monitor.velocity_norm": "off"})
    rules = monitor_rules(cfg.monitor)
    assert rules["dark_share"].action == "stop" and "velocity_norm" not in rules
    assert rules["reward.shapes"].text == MonitorConfig().reward_rule
    with pytest.raises(ConfigError, match="monitor.grid_energy"):
        load_config(None, None, ["monitor.grid_energy=+2"])
    with pytest.raises(ConfigError, match="monitor.rewards.*nope"):
        load_config(None, None, ["monitor.rewards=[nope]"])
    with pytest.raises(ConfigError, match="monitor.reward_options.pickscore"):
        check_monitor(MonitorConfig(rewards=["shapes"], reward_options={"pickscore": {}}))


# --------------------------------------------------------------------------- measuring


class _LinearPolicy(nn.Module):
    """A policy whose velocity is ``scale * W x`` (base: ``W x``), for the velocity norm."""

    latent_shape = (3, 8, 8)
    takes_references = False

    def __init__(self, scale: float):
        super().__init__()
        self.w = nn.Parameter(torch.eye(3))
        self.scale, self.off = scale, False

    @property
    def device(self):
        return self.w.device

    def encode_prompts(self, prompts):
        return prompts

    def sigma_grid(self, num_steps, shift=1.0):
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def velocity(self, x, sigma, cond):
        v = torch.einsum("ij,bjhw->bihw", self.w, x)
        return v if self.off else self.scale * v

    def adapter_disabled(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.off = True
            try:
                yield
            finally:
                self.off = False

        return ctx()


def test_velocity_norm_is_one_for_the_base_and_the_scale_of_an_inflated_velocity():
    prompts = ["a", "b", "c"]
    assert velocity_norm_ratio(_LinearPolicy(1.0), prompts, 4) == pytest.approx(1.0)
    assert velocity_norm_ratio(_LinearPolicy(1.5), prompts, 4, batch_size=2) == pytest.approx(1.5)


def test_velocity_norm_of_the_shapes_policy_is_one_before_training(tiny_config):
    from flowgrpo.trainer.trainer import Trainer

    trainer = Trainer(tiny_config(**{"log.trackers": "[]"}))
    assert velocity_norm_ratio(trainer.policy, ["a red circle", "two blue squares"], 3) == pytest.approx(1.0, abs=1e-5)


def test_held_out_rewards_average_their_finite_scores():
    def half_nan(images, prompts, groups=None):
        from flowgrpo.rewards import RewardOutput

        scores = images.flatten(1).mean(1).clone()
        scores[::2] = float("nan")
        return RewardOutput(scores, {})

    images = torch.stack([_grey(v)[0] for v in (0.1, 0.2, 0.3, 0.4)])
    out = reward_means({"bright": half_nan}, images, list("abcd"), batch_size=3)
    assert out == {"reward.bright": pytest.approx(0.2)}  # batches [0.1, 0.2, 0.3], [0.4]: 0.2 alone is not NaN
    assert spread(list(range(10)), 3) == [0, 3, 6] and spread([1, 2], 5) == [1, 2]


# --------------------------------------------------------------------------- in a run


class _Trainer:
    """What MonitorAlarms reads of a trainer: its iteration and callbacks."""

    def __init__(self):
        from flowgrpo.callbacks import CallbackList

        self.iteration, self.callbacks = 0, CallbackList()


def _result(**monitors):
    from flowgrpo.evaluation import EvalResult

    return EvalResult(accuracy=0.5, per_tag={}, num_samples=1, monitors=monitors)


def test_alarms_warn_once_stop_and_resume_from_the_run_folder(tmp_path, capsys):
    from flowgrpo.trainer.monitor import MonitorAlarms

    mcfg = MonitorConfig(dark_share="+0.2 warn", velocity_norm="+10% stop")
    trainer, alarms = _Trainer(), MonitorAlarms(mcfg)
    trainer.callbacks.extend([alarms])
    trainer.callbacks.run_start(trainer, tmp_path, False)
    alarms.on_evaluation(trainer, _result(dark_share=0.45, velocity_norm=1.0), "before")
    (tmp_path / "eval_before.json").write_text(json.dumps({"monitors": {"dark_share": 0.45, "velocity_norm": 1.0}}))
    for it, dark in ((1, 0.5), (2, 0.93), (3, 0.95)):
        trainer.iteration = it
        alarms.on_evaluation(trainer, _result(dark_share=dark, velocity_norm=1.0), "during")
        alarms.on_iteration_end(trainer, {"iteration": it - 1, "train_seconds": 60.0 * it})
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["monitor warn: dark_share 0.93 is 0.48 above its before-training 0.45 (limit +0.2) at "
                     "iteration 2 (monitor.dark_share='+0.2 warn')"]  # once, though iteration 3 breaches it too
    assert trainer.callbacks.stop_reason is None
    trainer.iteration = 4
    alarms.on_evaluation(trainer, _result(dark_share=0.5, velocity_norm=1.25), "during")
    alarms.on_iteration_end(trainer, {"iteration": 3, "train_seconds": 240.0})
    assert trainer.callbacks.stop_reason.startswith("monitor stop: velocity_norm 1.25 is 25% above")
    assert "stopping the run" in capsys.readouterr().out
    records = [json.loads(x) for x in (tmp_path / "monitors.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["iteration"], r["train_seconds"]) for r in records] == [
        ("before", 0, 0.0), ("during", 1, 60.0), ("during", 2, 120.0), ("during", 3, 180.0), ("during", 4, 240.0)]
    assert [[a["monitor"] for a in r["alarms"]] for r in records] == [[], [], ["dark_share"], ["dark_share"],
                                                                       ["velocity_norm"]]
    assert (tmp_path / "monitors.png").exists()  # drawn where an alarm fired
    # resumed from the checkpoint after iteration 3: the later record goes, the baseline comes from eval_before.json
    resumed, trainer.iteration = MonitorAlarms(mcfg), 3
    trainer.callbacks.items[:] = [resumed]
    trainer.callbacks.run_start(trainer, tmp_path, True)
    assert trainer.callbacks.stop_reason is None and resumed.before == {"dark_share": 0.45, "velocity_norm": 1.0}
    assert len((tmp_path / "monitors.jsonl").read_text().splitlines()) == 4 and resumed.fired == {"dark_share"}
    resumed.on_evaluation(trainer, _result(dark_share=0.99, velocity_norm=1.0), "after")
    assert capsys.readouterr().out == ""  # the warning was given before the interruption


def test_a_run_on_a_hackable_reward_fires_its_stop_rule(tmp_path):
    """The shipped model trained on JPEG incompressibility at a large learning rate learns JPEG-block
    texture: within two iterations the share of the held-out samples' variance on the 8-pixel grid
    more than doubles while the held-out verifier reward falls; the stop rule ends the run with a
    checkpoint and the evaluation after training, and every record is on disk."""
    from flowgrpo.api import train
    from flowgrpo.config import load_config

    overrides = {"reward.weights": "{jpeg_incompressibility: 1.0}", "train.lr": 1e-2, "train.iterations": 6,
                 "data.prompts_per_iteration": 2, "data.trees_per_prompt": 4, "sampler.num_steps": 4,
                 "eval.num_prompts": 8, "eval.seeds_per_prompt": 1, "eval.num_steps": 8, "eval.every": 2,
                 "eval.seen": "false", "monitor.grid_energy": "'+100% stop'", "monitor.rewards": "[shapes]",
                 "monitor.velocity_samples": 2, "monitor.velocity_steps": 3, "log.progress": "false",
                 "log.trackers": "[]", "log.grid_every": 0, "train.threads": 1, "log.out_dir": str(tmp_path),
                 "log.run_name": "hack"}
    summary = train(load_config(None, None, [f"{k}={v}" for k, v in overrides.items()]))
    run = tmp_path / "hack"
    records = [json.loads(x) for x in (run / "monitors.jsonl").read_text().splitlines()]
    stops = [r for r in records if any(a["action"] == "stop" for a in r["alarms"])]
    assert stops and stops[0]["stage"] == "during"
    assert summary["iterations"] == stops[0]["iteration"] < 6  # it stopped after the iteration that fired
    assert (run / "checkpoints" / f"ckpt_{summary['iterations']:06d}").is_dir()
    assert records[0]["stage"] == "before" and records[0]["monitors"]["velocity_norm"] == pytest.approx(1.0, abs=1e-5)
    fired = stops[0]["monitors"]
    assert fired["grid_energy"] > 2 * records[0]["monitors"]["grid_energy"]
    assert fired["reward.shapes"] < records[0]["monitors"]["reward.shapes"]  # the held-out reward saw it too
    assert records[-1]["stage"] == "after" and summary["eval_after"]["monitors"] == records[-1]["monitors"]
    assert (run / "monitors.png").exists()
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("monitor.high_freq" in m and "monitor.reward.shapes" in m for m in logged if "eval_accuracy" in m)
