"""The recipes against the reference code they cite (flowgrpo/recipes/sources/references.yaml).

Every row of the table is resolved through the layers of ``flowgrpo config show`` and must equal the
reference's value, or be a stated deviation with its reason; the LoRA rows that say how many layers
and parameters they wrap are counted on the real-size transformer on the meta device. The review that
asked for this found ``sd35-medium`` + ``flow-grpo`` wrapping 337 layers (47.0 M) where Flow-GRPO's
train_sd3.py wraps 191 (18.8 M), and ``flux1-dev`` 418 layers (523 M) where DanceGRPO's LoRA script
trains 149 M.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.realsize.configs import REAL_TRANSFORMERS, build_transformer
from flowgrpo.realsize.memory import lora_layer_counts
from flowgrpo.commands.recipe_references import DOC, check, load_table, markdown, rows

ROOT = Path(__file__).parent.parent


def test_every_row_resolves_as_the_reference_sets_it():
    problems = check()
    assert not problems, "\n".join(problems)


def test_a_difference_that_is_not_a_stated_deviation_fails():
    row = next(r for r in rows() if (r.recipe, r.method, r.key) == ("sd35-medium", "flow-grpo", "model.lora_targets"))
    moved = type(row)(**{**row.__dict__, "value": ["attn.to_q"]})
    assert check([moved]) == [f"flow-grpo on sd35-medium: model.lora_targets resolves to {row.value!r}, the table says "
                              f"['attn.to_q'] (Flow-GRPO pickscore_sd3, scripts/train_sd3.py:419-428): not a stated deviation"]
    converted = type(row)(**{**row.__dict__, "key": "train.timestep_fraction", "value": 0.9, "reference": 0.99})
    assert "no why or deviation" in check([converted])[0]


def test_the_page_is_rendered_from_the_table():
    assert (ROOT / DOC).read_text() == markdown(), "run: python -m flowgrpo.commands.recipe_references --write"


def test_every_repository_is_cited_at_a_commit():
    for repo in load_table()["repositories"].values():
        assert len(repo["commit"]) == 40 and int(repo["commit"], 16) >= 0
    for row in rows():
        for source in row.at:
            path, _, lines = source.rpartition(":")
            assert path and all(part.isdigit() for part in lines.split("-")), f"{row.where}: source {source!r}"


def test_the_issues_keys_are_in_the_table():
    """What the review found: LoRA targets and init, MixGRPO's script, DiffusionNFT's step count and times."""
    got = {(r.recipe, r.method, r.key): r for r in rows()}
    assert got["sd35-medium", "flow-grpo", "model.lora_init"].value == "gaussian"
    assert got["flux1-dev", "dance-grpo", "model.lora_targets"].value == "attention_qkvo"
    assert got["flux1-dev", "dance-grpo", "model.lora_init"].value is True
    assert got["flux1-dev", "dance-grpo", "sampler.shift"].value == 3.0
    mix = {k: got["flux1-dev", "mix-grpo", k].value for k in (
        "model.train_mode", "train.lr", "sampler.shared_group_noise", "strategy.rollback", "sampler.shift",
        "sampler.grid", "reward.combine", "train.iterations")}
    assert mix == {"model.train_mode": "full", "train.lr": 1e-5, "sampler.shared_group_noise": True,
                   "strategy.rollback": True, "sampler.shift": 3.0, "sampler.grid": "shift",
                   "reward.combine": "normalize_then_sum", "train.iterations": 300}
    assert set(got["flux1-dev", "mix-grpo", "reward.weights"].value) == {"hpsv2", "imagereward", "pickscore"}
    for recipe, steps in (("sd35-medium", 1), ("sd35-geneval", 1), ("sd35-ocr", 2)):
        assert got[recipe, "diffusion-nft", "train.minibatches"].value == steps
        assert got[recipe, "diffusion-nft", "loss.nft.timesteps"].value == 9  # timestep_fraction 0.99 of 10
    assert got["sd35-geneval", "flow-grpo", "reward.weights"].value == {"geneval": 1.0}
    assert (got["sd35-ocr", "flow-grpo", "eval.every"].value, got["sd35-ocr", "flow-grpo", "eval.num_steps"].value) == (60, 40)


def test_sd35_medium_flow_grpo_wraps_flow_grpos_191_layers():
    """24 blocks x 8 projections of the first attention, less the last block's to_add_out (context_pre_only);
    the 13 dual-attention blocks' attn2 and every feed-forward are left out: 18.8 M parameters at r 32."""
    counts = lora_layer_counts("sd35-medium", preset="flow-grpo")
    assert counts["wrapped"] == 191 == 24 * 8 - 1
    assert counts["lora_params"] == 18_776_064 == 191 * 32 * (1536 + 1536)
    assert not any(".attn2." in layer or ".ff" in layer for layer in counts["wrapped_by_layer"])


def test_flux1_dev_dance_grpo_trains_149m_lora_parameters():
    """to_q, to_k, to_v, to_out.0: 19 double blocks x 4 + 38 single blocks x 3 (no to_out there), r 128."""
    counts = lora_layer_counts("flux1-dev", preset="dance-grpo")
    assert counts["wrapped"] == 190 == 19 * 4 + 38 * 3
    assert counts["lora_params"] == 149_422_080 == 190 * 128 * (3072 + 3072)


def test_every_measured_row_is_counted_on_the_meta_device():
    measured = {(r.recipe, r.method): r.measure for r in rows() if r.measure and r.recipe in REAL_TRANSFORMERS}
    assert ("sd35-medium", "flow-grpo") in measured and ("flux1-dev", "dance-grpo") in measured
    for (recipe, method), want in measured.items():
        counts = lora_layer_counts(recipe, preset=method)
        assert {k: counts[k] for k in want} == want, f"{method} on {recipe}"


def _combinations():
    return sorted({(r.recipe, r.method) for r in rows()})


@pytest.mark.parametrize("recipe,method", _combinations())
def test_every_referenced_combination_validates(recipe, method):
    from flowgrpo.rewards import REWARDS

    missing = [name for r in rows() if (r.recipe, r.method, r.key) == (recipe, method, "reward.weights")
               for name in r.value if name not in REWARDS]
    if missing:  # another part of issue 44 registers it; the table's row already resolved above
        pytest.skip(f"reward {missing} is not registered yet: only this validation is skipped")
    cfg = load_config(method, recipe=recipe)
    assert cfg.recipe == recipe and cfg.preset == method


# --------------------------------------------------------------------------- model.lora_targets / lora_init
def test_a_target_list_that_matches_nothing_is_one_line_naming_the_key_and_real_names():
    from flowgrpo.policies.base.lora import add_lora

    model = build_transformer("sd35-medium")  # meta device: no memory
    with pytest.raises(ConfigError) as info:
        add_lora(model, 4, 8.0, ["attn.to_qq"])
    text = str(info.value)
    assert "\n" not in text and "'model.lora_targets'" in text and "SD3Transformer2DModel" in text
    assert "attn.to_q" in text and "attn.add_q_proj" in text  # names that exist, as a list takes them
    with pytest.raises(ConfigError, match=r"'nothing' matches no module"):
        add_lora(build_transformer("sd35-medium"), 4, 8.0, ["attn.to_q", "nothing"])


def test_named_sets_on_the_real_sizes():
    from peft.tuners.lora import LoraLayer

    from flowgrpo.policies.base.lora import add_lora

    def wrapped(recipe, targets):
        model = build_transformer(recipe)
        add_lora(model, 4, 8.0, targets)
        return [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]

    qkvo = wrapped("sd35-medium", "attention_qkvo")
    assert len(qkvo) == (24 + 13) * 4  # attn and the dual blocks' attn2
    assert len(wrapped("sd35-medium", "attention")) == 24 * 8 - 1 + 13 * 4
    linear = wrapped("flux1-dev", "all_linear")
    assert "transformer_blocks.0.ff.net.2" in linear and "proj_out" not in linear and "x_embedder" not in linear


def test_config_refuses_unknown_sets_empty_lists_and_inits_that_move_the_start():
    with pytest.raises(ConfigError, match=r"'model.lora_targets' = 'attn' is not one of: default, attention_qkvo"):
        load_config(overrides=["model.lora_targets=attn"])
    with pytest.raises(ConfigError, match=r"'model.lora_targets' = \[\]"):
        load_config(overrides=["model.lora_targets=[]"])
    for init in ("false", "pissa"):
        with pytest.raises(ConfigError, match=r"'model.lora_init' = .* is not one of: true, gaussian"):
            load_config(overrides=[f"model.lora_init={init}"])


def test_targets_and_init_reach_the_policy():
    from peft.tuners.lora import LoraLayer

    from flowgrpo.policies import build_policy

    cfg = load_config(overrides=["model.name=sd3-tiny", "model.train_mode=lora", "model.lora_targets=[attn.to_q, attn.to_v]",
                                 "model.lora_init=true"])
    policy = build_policy(cfg.model)
    layers = {n: m for n, m in policy.transformer.named_modules() if isinstance(m, LoraLayer)}
    assert layers and all(n.endswith(("attn.to_q", "attn.to_v")) for n in layers)
    assert policy.transformer.peft_config["default"].init_lora_weights is True
    assert all(float(m.lora_B["default"].weight.detach().abs().max()) == 0.0 for m in layers.values())  # starts as the base


def test_sampler_grid_shift_replaces_the_pipelines_grid():
    import torch

    from flowgrpo.policies import build_policy
    from flowgrpo.samplers.schedule import sigma_grid
    from flowgrpo.trainer.parts import model_grid

    cfg = load_config(overrides=["model.name=sd3-tiny", "sampler.num_steps=6"])
    policy = build_policy(cfg.model)
    assert model_grid(policy, cfg.sampler) is not None  # the pipeline's own (shift 3 of SD3's scheduler)
    shifted = load_config(overrides=["model.name=sd3-tiny", "sampler.num_steps=6", "sampler.grid=shift", "sampler.shift=3"])
    assert model_grid(policy, shifted.sampler) is None  # the sampler's sd3_time_shift grid
    grid = sigma_grid(6, 3.0)
    assert torch.allclose(grid, 3 * torch.linspace(1, 0, 7) / (1 + 2 * torch.linspace(1, 0, 7)))
