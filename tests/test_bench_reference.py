"""`flowgrpo bench reference`: flowgrpo against Flow-GRPO's own SD3 code on the same tiny model.

The comparison needs a checkout of github.com/yifan123/flow_grpo (never part of this repository):
set ``FLOWGRPO_REFERENCE=/path/to/flow_grpo``; without it those tests skip.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flowgrpo.benchmarks.bench_reference import ENV, parse_variant, run_bench_reference
from flowgrpo.benchmarks.reference_flow_grpo import load_reference
from flowgrpo.cli import main as cli_main

CHECKOUT = os.environ.get(ENV)
needs_reference = pytest.mark.skipif(not CHECKOUT, reason=f"set {ENV} to a checkout of github.com/yifan123/flow_grpo")


def test_not_a_checkout_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Flow-GRPO checkout"):
        load_reference(tmp_path)


def test_cli_needs_the_path(capsys):
    assert cli_main(["bench", "reference"]) == 2
    assert "--flow-grpo PATH" in capsys.readouterr().err


def test_variant_parsing():
    assert parse_variant("plain:model.a=1 train.b=2") == ("plain", ["model.a=1", "train.b=2"])
    with pytest.raises(ValueError):
        parse_variant("no-colon")


@needs_reference
def test_same_chains_and_outputs(tmp_path):
    """Both sides draw the same latents and log-probs (equal work), and every output is written."""
    res = run_bench_reference(CHECKOUT, tmp_path / "r.json", num_steps=3, prompts=2, group=2, repeats=1, warmup=0,
                              variants={"flowgrpo": [], "plain": ["loss.grpo.backend=reference"]},
                              out_dir=tmp_path, quiet=True)
    assert res["max_latent_diff"] < 1e-5
    assert res["max_logprob_diff"] < 1e-5
    data = json.loads((tmp_path / "r.json").read_text())
    for key in ("rollout_ratio", "update_ratio", "iteration_ratio"):
        assert data[key] > 0
    assert [r["side"] for r in data["rows"]] == ["flow_grpo (reference)", "flowgrpo", "plain"]
    assert data["rows"][0]["iteration_ratio"] == 1.0
    assert (tmp_path / "reference.csv").read_text().count("\n") == 4
    assert Path(tmp_path / "reference.png").stat().st_size > 0
