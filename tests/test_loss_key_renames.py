"""GRPO's options moved under ``loss.grpo.*`` (issue 45 item 1): nothing a shipped configuration
resolves to changed, and every old key still loads.

* Every method preset on every recipe, and every recipe with its own method, resolves to the loss
  section (and the filled descriptions that quote a loss key) of ``tests/data/loss_keys_snapshot.json``:
  the same compositions at the commit the file names, before the move, with each old flat key written
  at its new place (:func:`flowgrpo.config.renames.new_keys`). A key that moved to two objectives'
  options (``loss.guard_reweight``, ``loss.tempflow_weight``, read by grpo and flow_dppo alike) keeps
  its value in the options of the objective that runs and the default in the other's.
* Each old key in a config file or an override gives its new key(s) the value, with exactly one
  ``ConfigKeyRenamedWarning`` naming the old key and the new.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from flowgrpo.config import RECIPE_METHOD, compose_config, load_config, preset_names, recipe_names
from flowgrpo.config.layers import flatten
from flowgrpo.config.renames import RENAMED_KEYS, ConfigKeyRenamedWarning, new_keys
from flowgrpo.config.show import config_value, fill_description, recipe_description
from flowgrpo.objectives.crd import CRDOptions
from flowgrpo.objectives.flow_opd import FlowOPDOptions
from flowgrpo.recipes import recipe_meta

SNAPSHOT = json.loads((Path(__file__).parent / "data" / "loss_keys_snapshot.json").read_text())
#: loss keys added since the snapshot, each with its reason: they are not compared
ADDED_SINCE: set[str] = {
    "loss.diffusion_dpo.pairs_with_ties",  # issue 47 item 5: Flow-Factory's tie pairs, on by default
    "loss.flow_dppo.kl_norm",  # issue 47 item 5: the authors' trust-region normaliser, the default
    # issue 47 item 3: the NormGuard hinge of the forward-process objectives, off by default
    *(f"loss.{obj}.norm_guard_{k}" for obj in ("nft", "awm", "dgpo") for k in ("beta", "margin")),
    # issue 47 item 2: CRD's options (a new objective: nothing of it moved)
    *(f"loss.crd.{f.name}" for f in dataclasses.fields(CRDOptions)),
    # issue 47 item 1: Flow-OPD's options (a new objective: nothing of it moved)
    *(f"loss.flow_opd.{f.name}" for f in dataclasses.fields(FlowOPDOptions)),
}
#: method presets added since the snapshot, each with its reason: a new method has no keys that moved
PRESETS_ADDED_SINCE = {"crd", "flow-opd"}  # issue 47 items 2 and 1: Centered Reward Distillation, Flow-OPD
#: the old keys of the loss options, each with a value other than its new key's default
OLD_LOSS_KEYS = {"loss.clip_range": 0.25, "loss.clip_adapt": 0.5, "loss.kl_beta": 0.04, "loss.beta": 0.03,
                 "loss.kl_sigma": "transition_std", "loss.batched_reference": False, "loss.guard": True,
                 "loss.guard_reweight": True, "loss.tempflow_weight": True, "loss.sft_weight": 0.2,
                 "loss.anchor_weight": 0.5, "loss.anchor_steps": 3, "loss.backend": "reference",
                 "strategy.clip_adapt": 0.7, "strategy.sft_weight": 0.3}


def _resolved(preset: str, recipe: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigKeyRenamedWarning)  # no shipped preset or recipe uses an old key
        cfg = compose_config(preset, None, [], recipe).config
        out = {"loss": {k: v for k, v in flatten(cfg).items() if k.startswith("loss.") and k not in ADDED_SINCE}}
        if "{loss." in cfg.description:
            out["description"] = fill_description(cfg.description, cfg)
        if preset == RECIPE_METHOD and "{loss." in recipe_meta(recipe, "description", ""):
            out["recipe_description"] = recipe_description(recipe)
    return out


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_preset_and_recipe_resolves_to_the_loss_values_from_before_the_move(recipe):
    for preset in [RECIPE_METHOD, *(p for p in preset_names() if p not in PRESETS_ADDED_SINCE)]:
        name = f"{'<own>' if preset == RECIPE_METHOD else preset}@{recipe}"
        want = dict(SNAPSHOT["configs"][name])
        want["loss"] = SNAPSHOT["loss"][want["loss"]]
        assert _resolved(preset, recipe) == want, name
    assert {n.split("@")[1] for n in SNAPSHOT["configs"]} == set(recipe_names())
    assert {n.split("@")[0] for n in SNAPSHOT["configs"]} == {"<own>", *preset_names()} - PRESETS_ADDED_SINCE


def test_the_renames_cover_every_loss_option_that_moved():
    assert set(OLD_LOSS_KEYS) == {k for k in RENAMED_KEYS if k.startswith("loss.") or
                                  any(n.startswith("loss.") for n in new_keys(k))}
    flat = {f.name for f in dataclasses.fields(load_config("flow-grpo").loss)}
    assert flat == {"objective", "cfg_uncond_grad", "grpo", "nft", "awm", "dgpo", "crd", "flow_dppo", "diffusion_dpo",
                    "flow_opd"}


@pytest.mark.parametrize("old", sorted(OLD_LOSS_KEYS))
@pytest.mark.parametrize("where", ["override", "file"])
def test_an_old_key_loads_at_its_new_place_with_one_warning(old, where, tmp_path):
    value = OLD_LOSS_KEYS[old]
    overrides, path = [], None
    if where == "override":
        overrides = [f"{old}={str(value).lower() if isinstance(value, bool) else value}"]
    else:
        section, key = old.split(".")
        path = tmp_path / "run.yaml"
        path.write_text(json.dumps({section: {key: value}}))  # JSON is YAML
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config("tree-rpo", None if path is None else str(path), overrides)
    renamed = [w for w in caught if issubclass(w.category, ConfigKeyRenamedWarning)]
    assert len(renamed) == 1, [str(w.message) for w in renamed]
    message = str(renamed[0].message)
    assert f"'{old}'" in message and all(f"'{new}'" in message for new in new_keys(old))
    for new in new_keys(old):
        assert new.startswith("loss.") and config_value(cfg, new) == value, new
    assert old.split(".")[1] not in cfg.strategy


def test_the_new_key_wins_over_the_old_one_in_the_same_layer():
    with pytest.warns(ConfigKeyRenamedWarning, match=r"'loss\.kl_beta' is now 'loss\.grpo\.kl_beta'"):
        cfg = load_config("flow-grpo", None, ["loss.kl_beta=0.5", "loss.grpo.kl_beta=0.25"])
    assert cfg.loss.grpo.kl_beta == 0.25


def test_config_show_writes_the_new_keys_and_its_text_loads_back(tmp_path, capsys):
    from flowgrpo.cli import main

    with pytest.warns(ConfigKeyRenamedWarning):
        assert main(["config", "show", "--preset", "flow-grpo", "loss.kl_beta=0.07"]) == 0
    text = capsys.readouterr().out
    assert "  grpo:" in text and "kl_beta: 0.07" in text and "# override" in text.split("kl_beta: 0.07")[1].splitlines()[0]
    path = tmp_path / "shown.yaml"
    path.write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigKeyRenamedWarning)
        assert load_config(None, str(path)).loss.grpo.kl_beta == 0.07


def test_old_attribute_reads_go_through_to_loss_grpo():
    """``cfg.loss.kl_beta`` (code and plug-ins written before the move) reads ``cfg.loss.grpo.kl_beta``
    with a DeprecationWarning; writing it is refused (it would set an attribute nothing reads)."""
    cfg = load_config("flow-grpo")
    with pytest.warns(DeprecationWarning, match=r"cfg\.loss\.kl_beta is now cfg\.loss\.grpo\.kl_beta"):
        assert cfg.loss.kl_beta == cfg.loss.grpo.kl_beta
    with pytest.raises(AttributeError, match="cfg.loss.grpo.clip_range"):
        cfg.loss.clip_range = 0.1
    with pytest.raises(AttributeError):
        cfg.loss.not_a_key  # noqa: B018
