"""What a run shows while it trains: the progress bar's text (time against the budget, the
objective's name, metrics named for what they are) and the sample grids' captions (prompt and
rewards of each row)."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from conftest import run_cli, tiny_overrides
from rich.console import Console

from flowgrpo.output.plots import captioned_grid, grid_captions, image_grid, rows_by_key, save_sample_grid
from flowgrpo.trainer.progress import bar_fields, bar_info, clock, progress_bar

#: a GRPO iteration's metrics as the trainer logs them (approx_kl: drift from the rollout policy; kl: the KL term)
GRPO_METRICS = {"iteration": 440, "reward_mean": 0.5123, "approx_kl": 2.8e-15, "kl": 6.6e-4,
                "clipfrac_high": 0.01, "clipfrac_low": 0.02, "loss": 1e-8}


def rendered(fields: dict) -> str:
    """The line the run's progress bar draws for ``fields``."""
    with progress_bar(False) as bar:
        bar.add_task(**fields)
        console = Console(record=True, width=200)
        console.print(bar.make_tasks_table(bar.tasks))
    return console.export_text()


def testclock():
    assert clock(451.2) == "7:31"
    assert clock(900) == "15:00"
    assert clock(3723) == "1:02:03"
    assert clock(-1) == "0:00"


def test_bar_with_time_budget_shows_minutes_against_it_and_counts_iterations():
    f = bar_fields("grpo", 441, 100000, 451.2, 15, GRPO_METRICS)
    assert (f["completed"], f["total"]) == (451.2, 900)  # the bar fills over the budget, not the iterations
    line = rendered(f)
    assert "7:31 / 15:00" in line
    assert "iteration 441" in line
    assert "100000" not in line and "441/" not in line
    assert line.lstrip().startswith("GRPO")


def test_bar_without_time_budget_shows_iterations_against_the_total():
    f = bar_fields("grpo", 3, 10, 75.0, 0.0, GRPO_METRICS)
    assert (f["completed"], f["total"]) == (3, 10)
    line = rendered(f)
    assert "iteration 3/10" in line and "1:15" in line


def test_bar_past_the_budget_stays_full():
    f = bar_fields("grpo", 7, 100, 1000.0, 15, {})
    assert f["completed"] == f["total"] == 900
    assert "16:40 / 15:00" in f["status"]


def test_bar_names_each_kl_for_what_it_is():
    info = bar_info(GRPO_METRICS)
    assert "kl_ref 6.60e-04" in info  # the KL term of the loss (metric "kl")
    assert "policy_drift 2.80e-15" in info  # approx_kl, the drift from the rollout policy
    assert "clip 0.03" in info and "reward 0.512" in info
    assert " kl " not in f" {info} "  # no bare, ambiguous "kl"
    assert "kl_ref" not in bar_info(GRPO_METRICS, ref_kl=False)  # GRPO without a reference model (beta 0)
    assert bar_info({}) == ""


@pytest.mark.parametrize("objective, label", [("grpo", "GRPO"), ("nft", "DiffusionNFT"), ("awm", "AWM"),
                                              ("dgpo", "DGPO"), ("mine", "MINE")])
def test_bar_label_is_the_objective(objective, label):
    metrics = {"reward_mean": 0.25, "loss": 0.125, "kl": 1e-3, "ema_kl": 2e-3}
    line = rendered(bar_fields(objective, 5, 10, 60.0, 0.0, metrics))
    assert line.lstrip().startswith(label)
    if objective != "grpo":
        assert "GRPO" not in line
        assert "loss 0.125" in line and "kl_ref 1.00e-03" in line and "kl_ema 2.00e-03" in line
        assert "policy_drift" not in line and "clip" not in line  # GRPO's ratio diagnostics only


def test_grid_captions_one_per_row_with_prompt_and_rewards():
    prompts = ["a red circle"] * 3 + ["two blue squares"] * 3
    caps = grid_captions(prompts, [1.0, 0.5, 0.0, 0.25, None, 0.75], ncol=3)
    assert len(caps) == 2
    assert caps[0][0].startswith("a red circle") and "mean r 0.500" in caps[0][0]
    assert caps[0][1] == ["r 1.000", "r 0.500", "r 0.000"]
    assert caps[1][0].startswith("two blue squares") and "mean r 0.500" in caps[1][0]
    assert caps[1][1] == ["r 0.250", "", "r 0.750"]
    # padding (empty prompts) is skipped; a row holding two prompts names both; no rewards, no labels
    caps = grid_captions(["a", "a", "b", "", "c", ""], None, ncol=2)
    assert caps == [("a", ["", ""]), ("b", ["", ""]), ("c", ["", ""])]
    assert grid_captions(["a", "b"], [float("nan"), 1.0], ncol=2) == [("a | b  (mean r 1.000)", ["r nan", "r 1.000"])]
    # a video row: one reward (on its first frame), no mean to repeat it
    assert grid_captions(["a cat"] * 3, [0.5, None, None], ncol=3) == [("a cat", ["r 0.500", "", ""])]


def test_rows_by_key_one_row_per_prompt():
    keys = [0, 1, 0, 1, 2, 0, 3]
    assert rows_by_key(keys) == [[0, 2, 5], [1, 3], [4], [6]]
    assert rows_by_key(keys, max_rows=2, max_cols=2) == [[0, 2], [1, 3]]


def test_captioned_grid_adds_a_band_above_each_row():
    images = torch.rand(6, 3, 16, 16)
    bare = image_grid(images, 3, scale=2)
    caps = grid_captions(["a red circle"] * 3 + ["two blue squares"] * 3, [1.0] * 6, ncol=3)
    grid = captioned_grid(images, 3, caps, scale=2)
    assert grid.shape[1] == bare.shape[1] and grid.shape[0] > bare.shape[0] + 2 * 11
    assert grid.dtype == np.uint8 and grid.shape[2] == 3
    # the images themselves are untouched: the bottom row's strip is the bare grid's
    h = 32 + 2
    np.testing.assert_array_equal(grid[-h - 2:], bare[-h - 2:])
    with pytest.raises(ValueError, match="captions"):
        captioned_grid(images, 3, caps[:1])


def test_sample_grid_rows_are_prompts(tmp_path):
    # a tree rollout interleaves prompts among the leaves: the grid still gives each prompt one row
    prompts = ["a red circle", "two blue squares"]
    tree_prompt = torch.tensor([0, 1, 0, 1])
    leaf_tree = torch.tensor([0, 0, 1, 2, 2, 3])  # leaves of prompts 0, 0, 1, 0, 0, 1
    keys = tree_prompt[leaf_tree].tolist()
    images = torch.rand(6, 3, 8, 8)
    path = tmp_path / "grids" / "iter_000000.png"
    save_sample_grid(path, images, [prompts[i] for i in keys], keys, torch.arange(6.0) / 10)
    png = iio.imread(path)
    # rows: prompt 0's leaves 0, 1, 3, 4; prompt 1's leaves 2, 5 padded with white
    white = torch.ones(3, 8, 8)
    bare = image_grid(torch.stack([images[0], images[1], images[3], images[4], images[2], images[5], white, white]),
                      4, scale=2)
    assert png.shape[1] == bare.shape[1] and png.shape[0] > bare.shape[0]
    row = 16 + 2 * 2
    np.testing.assert_array_equal(png[-row:], bare[-row:])  # the bottom row is prompt 1's


def test_tiny_run_shows_the_budget_bar_and_writes_captioned_grids(shapes_model_dir, tmp_path):
    out = tmp_path / "runs"
    # a little JPEG compressibility gives every group signal, so that every iteration updates (and
    # reports its drift and KL); the random model rarely satisfies a prompt
    extra = {"log.progress": "true", "train.max_minutes": 30, "log.grid_every": 1,
             "reward.weights": "{shapes: 1.0, jpeg_compressibility: 0.01}"}
    # GRPO (the shapes preset): its bar carries the ratio diagnostics as well as the KL term
    args = ["train", "--preset", "shapes", *tiny_overrides(shapes_model_dir, **extra), f"log.out_dir={out}",
            "log.run_name=bar"]
    proc = run_cli(args)
    assert proc.returncode == 0, f"flowgrpo train failed:\n{proc.stdout}\n{proc.stderr}"
    bar = [ln for ln in proc.stdout.splitlines() if "/ 30:00" in ln]
    assert bar, f"no time-budget progress line in:\n{proc.stdout}"
    line = bar[-1]
    assert line.lstrip().startswith("GRPO")
    assert "iteration 2" in line and "2/2" not in line
    assert "policy_drift" in line and "kl_ref" in line and "reward" in line  # tiny_overrides: beta 0.01
    grids = sorted((out / "bar" / "grids").glob("iter_*.png"))
    assert [g.name for g in grids] == ["iter_000000.png", "iter_000001.png"]
    # 2 prompts x 4 samples of 32 px images drawn at scale 2: the bare grid is 134 x 266; the caption
    # bands make it taller
    png = iio.imread(grids[-1])
    assert png.shape[1] == 4 * (64 + 2) + 2
    assert png.shape[0] > 2 * (64 + 2) + 2 + 2 * 11
