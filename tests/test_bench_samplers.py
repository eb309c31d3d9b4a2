"""`bench samplers` smoke test: JSON schema, CSV/PNG outputs, and NFE counts equal to the plans' formulas."""

from __future__ import annotations

import csv
import json
import math

import pytest

from flowgrpo.benchmarks.bench_samplers import BASELINE, ROW_KEYS, bench_config, bench_presets, run_bench_samplers

T, PROMPTS, LEAVES = 5, 1, 2


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_samplers")
    res = run_bench_samplers(out / "samplers.json", presets=["mix-grpo", "flow-grpo"], iterations=1, num_steps=T,
                             group_size=LEAVES, prompts_per_iteration=PROMPTS, resolution=32, out_dir=out,
                             quiet=True)
    return out, res


def test_json_schema(bench):
    out, res = bench
    data = json.loads((out / "samplers.json").read_text())
    assert data == json.loads(json.dumps(res))
    assert set(data) == {"model", "rows"} and data["model"] == "sd3-tiny"
    assert [r["preset"] for r in data["rows"]] == [BASELINE, "mix-grpo"]  # baseline first
    for row in data["rows"]:
        assert set(row) == set(ROW_KEYS)
        assert isinstance(row["preset"], str)
        assert isinstance(row["nfe_rollout"], int) and isinstance(row["nfe_grad"], int)
        for k in ("rollout_s", "train_s", "iter_s", "ratio_vs_flow_grpo"):
            assert isinstance(row[k], float) and math.isfinite(row[k]) and row[k] > 0
        assert row["rollout_s"] + row["train_s"] <= row["iter_s"] + 1e-9
    base = data["rows"][0]
    assert base["ratio_vs_flow_grpo"] == 1.0
    mix = data["rows"][1]
    assert mix["ratio_vs_flow_grpo"] == pytest.approx(mix["iter_s"] / base["iter_s"])


def test_nfe_counts_follow_the_plans(bench):
    _, res = bench
    rows = {r["preset"]: r for r in res["rows"]}
    samples = PROMPTS * LEAVES  # chains: one leaf per tree
    # flow-grpo: every one of the T steps of every chain is sampled and trained
    assert rows["flow-grpo"]["nfe_rollout"] == T * samples
    assert rows["flow-grpo"]["nfe_grad"] == T * samples
    # mix-grpo: all T steps sampled, only the window's w steps trained
    window = 4  # the preset's strategy.window
    assert rows["mix-grpo"]["nfe_rollout"] == T * samples
    assert rows["mix-grpo"]["nfe_grad"] == window * samples


def test_outputs_written(bench):
    out, _ = bench
    with (out / "samplers.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [r["preset"] for r in table] == [BASELINE, "mix-grpo"]
    assert {"nfe_rollout", "nfe_grad", "iter_s", "ratio_vs_flow_grpo", "leaves_per_prompt", "num_steps"} <= set(table[0])
    assert all(int(r["num_steps"]) == T and int(r["leaves_per_prompt"]) == LEAVES for r in table)
    assert (out / "samplers.png").stat().st_size > 0


def test_equal_leaves_per_prompt(tmp_path):
    """Trees get round(leaves / leaves_per_tree) trees per prompt (at least 1), chains `leaves` chains;
    every preset but the shapes world is benchmarked, flow-grpo first."""
    names = bench_presets()
    assert names[0] == BASELINE and "shapes" not in names and len(names) == len(set(names))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    for preset, leaves_per_tree, trees in [("mix-grpo-flash-star", 1, 8), ("branch-grpo-mix", 8, 1),
                                           ("tree-rpo", 8, 1)]:
        cfg, lpt, n = bench_config(preset, prompts_file=str(prompts), num_steps=20, group_size=8)
        assert (lpt, n) == (leaves_per_tree, trees)
        assert cfg.sampler.num_steps == 20 and cfg.data.trees_per_prompt == trees
        assert cfg.model.name == "sd3-tiny" and cfg.reward.weights == {"jpeg_compressibility": 1.0}


def test_every_benchmarked_preset_resolves(tmp_path):
    """`flowgrpo bench samplers` with no arguments ran every preset and stopped at flow-opd, which
    needs teacher runs ("loss.flow_opd.teachers is empty ..."): each preset it runs must configure."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    from flowgrpo.trainer.trainer import Trainer

    for preset in bench_presets():
        cfg, _, _ = bench_config(preset, prompts_file=str(prompts), prompts_per_iteration=2)
        Trainer(cfg)  # the objective's own checks (flow-opd's teachers) run here, not in load_config


def test_tree_nfe_counts_follow_the_plan(tmp_path):
    """branch-grpo-mix (K = 2 at steps 0, 3, 6; SDE window 0..2): one 8-leaf tree per prompt."""
    t = 7
    res = run_bench_samplers(None, presets=["branch-grpo-mix"], iterations=1, num_steps=t, group_size=8,
                             prompts_per_iteration=1, resolution=32, out_dir=tmp_path, quiet=True)
    rows = {r["preset"]: r for r in res["rows"]}
    assert set(rows) == {BASELINE, "branch-grpo-mix"}
    # nodes stepping at each depth: 1 (step 0), 2 (steps 1-3), 4 (steps 4-6), 8 after the last split
    assert rows["branch-grpo-mix"]["nfe_rollout"] == 1 + 2 * 3 + 4 * 3 + 8 * (t - 7)
    # trained SDE edges: the children at the window steps 0, 1, 2 and the split steps 3, 6
    assert rows["branch-grpo-mix"]["nfe_grad"] == 2 + 2 + 2 + 4 + 8
    assert rows[BASELINE]["nfe_rollout"] == rows[BASELINE]["nfe_grad"] == 8 * t  # 8 chains of T steps
