"""Typed config: presets load and validate, overrides parse and are type-checked, registries."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from flowgrpo.config import (
    DEFAULT_PRESET,
    RunConfig,
    apply_dict,
    load_config,
    parse_override,
    preset_names,
    read_preset,
    to_dict,
    validate,
)
from flowgrpo.errors import ConfigError, UserError
from flowgrpo.registry import Registry


def test_shapes_is_a_preset():
    assert "shapes" in preset_names()


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_validates(name):
    cfg = load_config(name)
    assert isinstance(cfg, RunConfig)
    assert cfg.preset == name
    validate(cfg)
    assert read_preset(name).get("description"), f"preset {name} has no description line"
    # the resolved config survives the YAML round trip a run directory relies on (resume, eval)
    again = RunConfig()
    apply_dict(again, yaml.safe_load(yaml.safe_dump(to_dict(cfg))))
    assert to_dict(again) == to_dict(cfg)


def test_the_default_preset_is_the_shapes_world_nft_recipe():
    cfg = load_config()
    assert cfg.preset == DEFAULT_PRESET == "shapes-nft"
    assert cfg.model.name == "shapes" and cfg.data.prompts == "shapes" and cfg.reward.weights == {"shapes": 1.0}
    assert cfg.loss.objective == "nft" and cfg.sampler.strategy == "ode" and cfg.train.max_minutes == 15
    assert cfg.loss.nft.policy_min_t > 0 and cfg.loss.nft.anchor_beta > 0 and cfg.loss.nft.kl_beta > 0


@pytest.mark.parametrize("text,expected", [
    ("train.lr=1e-4", {"train": {"lr": 1e-4}}),
    ("train.lr=3.0e-4", {"train": {"lr": 3e-4}}),
    ("train.lr=1E-3", {"train": {"lr": 1e-3}}),
    ("train.iterations=7", {"train": {"iterations": 7}}),
    ("log.progress=true", {"log": {"progress": True}}),
    ("log.progress=false", {"log": {"progress": False}}),
    ("train.adam_betas=[0.8, 0.95]", {"train": {"adam_betas": [0.8, 0.95]}}),
    ("reward.weights={shapes: 1.0, jpeg_compressibility: 0.5}",
     {"reward": {"weights": {"shapes": 1.0, "jpeg_compressibility": 0.5}}}),
    ("log.run_name=my-run", {"log": {"run_name": "my-run"}}),
    ("data.prompts=/tmp/a=b.txt", {"data": {"prompts": "/tmp/a=b.txt"}}),
    ("model.path=null", {"model": {"path": None}}),
])
def test_overrides_parse(text, expected):
    out = parse_override(text)
    assert out == expected
    leaf = next(iter(next(iter(out.values())).values()))
    exp_leaf = next(iter(next(iter(expected.values())).values()))
    assert type(leaf) is type(exp_leaf)


def test_overrides_apply_with_types():
    cfg = load_config("shapes", None, ["train.lr=1e-4", "log.progress=false", "train.adam_betas=[0.8, 0.9]",
                                        "loss.grpo.clip_range=1", "sampler.shared_group_noise=true"])
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.log.progress is False and cfg.sampler.shared_group_noise is True
    assert cfg.train.adam_betas == [0.8, 0.9]
    assert cfg.loss.grpo.clip_range == 1.0 and isinstance(cfg.loss.grpo.clip_range, float)  # ints are fine for floats
    # later overrides win; strategy options merge
    cfg = load_config("mix-grpo", None, ["train.iterations=3", "train.iterations=5", "strategy={window: 2}",
                                         "strategy={stride: 2}"])
    assert cfg.train.iterations == 5
    assert cfg.strategy["window"] == 2 and cfg.strategy["stride"] == 2 and cfg.strategy["shift_every"] == 10
    # options are checked against the strategy's option dataclass when the config loads
    with pytest.raises(ConfigError, match="unknown config key 'strategy.a'; valid keys under 'strategy': window"):
        load_config("mix-grpo", None, ["strategy.a=1"])


def test_config_file_applies_between_preset_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  iterations: 9\n  lr: 0.01\n")
    cfg = load_config("shapes", str(f), ["train.lr=0.02"])
    assert cfg.train.iterations == 9 and cfg.train.lr == 0.02
    f.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config("shapes", str(f))
    with pytest.raises(ConfigError, match="not found"):
        load_config("shapes", str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("override,needle", [
    ("train.lr=abc", "train.lr"),
    ("train.iterations=1.5", "train.iterations"),
    ("train.iterations=true", "train.iterations"),
    ("log.progress=3", "log.progress"),
    ("train.adam_betas=0.9", "train.adam_betas"),
    ("reward.weights=shapes", "reward.weights"),
])
def test_wrong_types_are_refused(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config("shapes", None, [override])


def test_unknown_keys_list_the_valid_ones():
    with pytest.raises(ConfigError) as exc:
        load_config("shapes", None, ["train.learning_rate=1"])
    msg = str(exc.value)
    assert "train.learning_rate" in msg and "lr" in msg and "iterations" in msg
    with pytest.raises(ConfigError) as exc:
        load_config("shapes", None, ["trian.lr=1"])
    assert "trian" in str(exc.value) and "train" in str(exc.value)
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("train.lr")


@pytest.mark.parametrize("override,needle", [
    ("sampler.sde_kind=ddim", "flow_grpo, dance, cps"),
    ("advantage.std=batch", "group, global"),
    ("reward.combine=max", "sum_then_normalize"),
    ("train.iterations=0", ">= 1"),
    ("data.trees_per_prompt=0", ">= 1"),
    ("train.timestep_fraction=1.5", "> 0.0 and <= 1.0"),
    ("reward.weights={}", "at least one reward"),
])
def test_value_validation(override, needle):
    with pytest.raises(ConfigError) as exc:
        load_config("shapes", None, [override])
    assert needle in str(exc.value)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError) as exc:
        load_config("nope")
    assert "nope" in str(exc.value) and "shapes" in str(exc.value)


def test_config_errors_are_user_errors():
    assert issubclass(ConfigError, UserError)


# --------------------------------------------------------------------------- registries


def test_registry_refuses_duplicates_and_lists_valid_names():
    reg: Registry = Registry("widget")

    @reg.register("alpha")
    def alpha():
        return "A"

    reg.register_lazy("beta", "json:dumps")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("alpha")(lambda: None)
    with pytest.raises(ValueError, match="already registered"):
        reg.register_lazy("beta", "json:loads")
    with pytest.raises(ValueError, match="already registered"):
        reg.register_lazy("alpha", "json:loads")
    assert reg.names() == ["alpha", "beta"] and "beta" in reg
    assert reg.build("alpha") == "A"
    import json

    assert reg.get("beta") is json.dumps  # lazy entries import on first use
    with pytest.raises(UserError) as exc:
        reg.get("gamma")
    msg = str(exc.value)
    assert "widget" in msg and "gamma" in msg and "alpha" in msg and "beta" in msg
    reg.unregister("alpha")  # a scoped entry (a benchmark's model) leaves the registry as it was
    assert reg.names() == ["beta"] and "alpha" not in reg
    reg.register("alpha")(alpha)  # and its name is free again
    with pytest.raises(KeyError, match="widget 'gamma' is not registered"):
        reg.unregister("gamma")


def test_bench_gpu_leaves_the_policy_registry_as_it_was():
    """bench gpu's model is a policy only within its block: tests run after it in the same process
    see the adapters they list."""
    from flowgrpo.benchmarks.gpu_setup import BENCH_MODEL, registered_components
    from flowgrpo.policies import POLICIES

    before = POLICIES.names()
    with registered_components({}) as name:
        assert name == BENCH_MODEL and name in POLICIES
    assert POLICIES.names() == before


def test_builtin_registries():
    from flowgrpo.advantages import ESTIMATORS
    from flowgrpo.policies import POLICIES
    from flowgrpo.rewards import REWARDS, build_reward
    from flowgrpo.samplers.strategies import STRATEGIES

    assert {"shapes", "jpeg_compressibility", "jpeg_incompressibility"} <= set(REWARDS.names())
    assert {"shapes", "sd3", "sd3-tiny"} <= set(POLICIES.names())
    assert "flow_grpo" in STRATEGIES.names() and "group_zscore" in ESTIMATORS.names()
    with pytest.raises(ValueError, match="already registered"):
        REWARDS.register("shapes")(object)
    with pytest.raises(UserError) as exc:
        build_reward("hpsv9")
    assert "hpsv9" in str(exc.value) and "jpeg_compressibility" in str(exc.value) and "shapes" in str(exc.value)


def test_switching_strategy_drops_the_previous_strategys_options():
    # the default preset sets mix_grpo window options; another strategy must not inherit them
    cfg = load_config("shapes", None, ["sampler.strategy=branch_grpo", "strategy.branch=3"])
    assert cfg.strategy == {"branch": 3}
    cfg = load_config("shapes", None, ["strategy.branch=3", "sampler.strategy=branch_grpo"])  # order-free
    assert cfg.strategy == {"branch": 3}
    # keeping the strategy keeps (and merges) its options
    cfg = load_config("shapes", None, ["strategy.window=3"])
    assert cfg.sampler.strategy == "mix_grpo" and cfg.strategy["window"] == 3 and cfg.strategy["mode"] == "frozen"


def test_renamed_keys_still_work_with_a_warning():
    from flowgrpo.config import ConfigKeyRenamedWarning

    with pytest.warns(ConfigKeyRenamedWarning, match="'data.group_size' is now 'data.trees_per_prompt'"):
        cfg = load_config("shapes", None, ["data.group_size=3"])
    assert cfg.data.trees_per_prompt == 3
    # options that moved from the strategy to the loss / advantage sections
    with pytest.warns(ConfigKeyRenamedWarning) as rec:
        cfg = load_config("tree-rpo", None, ["strategy.sft_weight=0.3", "strategy.fusion_beta=1.0"])
    assert cfg.loss.grpo.sft_beta == 0.3 and cfg.advantage.fusion_beta == 1.0
    assert "sft_weight" not in cfg.strategy and len(rec) == 2
    # the new key wins over the old one in the same layer
    with pytest.warns(ConfigKeyRenamedWarning):
        cfg = load_config("shapes", None, ["data.group_size=3", "data.trees_per_prompt=5"])
    assert cfg.data.trees_per_prompt == 5
    # GRPO's KL weight has the name every objective uses; configs written with the old one still load
    with pytest.warns(ConfigKeyRenamedWarning, match="'loss.beta' is now 'loss.grpo.kl_beta'"):
        cfg = load_config("flow-grpo", None, ["loss.beta=0.03"])
    assert cfg.loss.grpo.kl_beta == 0.03 and "beta" not in {f.name for f in dataclasses.fields(cfg.loss)}


@pytest.mark.parametrize("override,message", [
    ("sampler.sde_kind=ito", "'sampler.sde_kind' = 'ito' is not one of: flow_grpo, dance, cps"),
    ("advantage.std_estimator=sample", "not one of: population, unbiased"),
    ("strategy.mode=sideways", "'strategy.mode' = 'sideways' is not one of: progressive, random, frozen"),
    ("sampler.cps_log_prob=mse", "needs sampler.sde_kind = cps"),
    ("eval.evaluator=geneval", "unknown evaluator 'geneval'; valid choices: auto, none, bench, edit, shapes"),
])
def test_choices_are_checked_in_one_place(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("mix-grpo", None, [override])


def test_choices_set_in_code_are_checked_by_validate():
    cfg = load_config("shapes")
    cfg.loss.grpo.kl_sigma = "sigma"
    with pytest.raises(ConfigError, match="'loss.grpo.kl_sigma' = 'sigma' is not one of: sigma_t, transition_std"):
        validate(cfg)


def test_reward_options_merge_and_reach_the_factory(tmp_path):
    from flowgrpo.rewards import build_reward

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("reward:\n  weights: {shapes: 1.0, jpeg_compressibility: 0.5}\n"
                        "  options: {jpeg_compressibility: {quality: 80}}\n")
    cfg = load_config("shapes", str(cfg_file), ["reward.options.jpeg_compressibility.quality=50"])
    assert cfg.reward.options == {"jpeg_compressibility": {"quality": 50}}
    reward = build_reward("jpeg_compressibility", **cfg.reward.options["jpeg_compressibility"])
    assert reward.quality == 50
    with pytest.raises(ConfigError, match="'reward.options.hpsv2': 'hpsv2' is not one of the run's rewards"):
        load_config("shapes", None, ["reward.options.hpsv2.checkpoint=/x"])
    with pytest.raises(ConfigError, match="unknown option\\(s\\) colour for reward 'shapes'; valid options: "):
        build_reward("shapes", colour=1)


def test_model_name_may_be_a_pipeline_directory(tmp_path):
    from flowgrpo.policies import resolve_adapter

    sd3 = tmp_path / "sd3"
    sd3.mkdir()
    (sd3 / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    cfg = load_config("shapes", None, [f"model.name={sd3}"])
    assert resolve_adapter(cfg.model) == ("sd3", str(sd3))
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    with pytest.raises(ConfigError, match="'StableDiffusionXLPipeline' is not supported: model_index.json names no "
                                          "transformer component \\(dedicated adapters: FluxPipeline, "
                                          "StableDiffusion3Pipeline, WanPipeline;"):
        load_config("shapes", None, [f"model.name={other}"])
    with pytest.raises(ConfigError, match="neither an adapter \\(flux, pipeline, sd3, sd3-tiny, shapes, wan\\)"):
        load_config("shapes", None, [f"model.name={tmp_path / 'missing'}"])


def test_choice_lists_are_defined_once_where_they_live():
    """sampler.sde_kind / sampler.cps_log_prob / model.train_mode take their choices from the modules
    that implement them (a new SDE kind or train mode needs no second list in the config)."""
    from flowgrpo.config import ModelConfig, SamplerConfig
    from flowgrpo.fields import choices_of, hints
    from flowgrpo.policies.base import TRAIN_MODES
    from flowgrpo.samplers.sde import LOG_PROB_CONVENTIONS, SDE_KINDS

    assert choices_of(hints(SamplerConfig)["sde_kind"]) == tuple(SDE_KINDS)
    assert choices_of(hints(SamplerConfig)["cps_log_prob"]) == LOG_PROB_CONVENTIONS
    assert (*choices_of(hints(ModelConfig)["train_mode"]), "frozen") == TRAIN_MODES
