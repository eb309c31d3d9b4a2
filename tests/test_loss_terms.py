"""The loss terms (flowgrpo.objectives.terms) and the one-line objective registration.

The KL term is checked in float64 against its formula (with and without the 1 / (2 sigma_t^2) weight
at a noise level other than 0.7), the term options' help and bounds reach the keys that declare them,
and a registered objective's options become a ``loss.<name>`` field without an edit to config.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest
import torch
from conftest import run_cli

import flowgrpo.objectives.terms as terms_pkg
from flowgrpo import objectives
from flowgrpo.config import LossConfig, load_config
from flowgrpo.objectives.options import GRPOOptions
from flowgrpo.errors import ConfigError
from flowgrpo.objectives.options import AWMOptions, DGPOOptions, NFTOptions
from flowgrpo.objectives.terms import LossTerm, term_field
from flowgrpo.objectives.terms.anchor import LowNoiseAnchor, ODEAnchor
from flowgrpo.objectives.terms.kl import KLOptions, VelocityKL


def _term_classes() -> list[type]:
    out = []
    for info in pkgutil.iter_modules(terms_pkg.__path__):
        mod = importlib.import_module(f"{terms_pkg.__name__}.{info.name}")
        out += [c for c in vars(mod).values()
                if isinstance(c, type) and issubclass(c, LossTerm) and c is not LossTerm and c.__module__ == mod.__name__]
    return out


def test_every_term_has_options_with_help_on_every_field():
    classes = _term_classes()
    assert {c.__name__ for c in classes} >= {"VelocityKL", "ODEAnchor", "LowNoiseAnchor", "BestPathSFT", "StepWeights",
                                             "ClipSchedule"}
    for cls in classes:
        fields = dataclasses.fields(cls.Options)
        assert fields, cls
        for f in fields:
            assert f.metadata.get("help", "").strip(), f"{cls.__name__}.{f.name} has no help"


def test_velocity_kl_is_its_formula_in_float64():
    g = torch.Generator().manual_seed(0)
    v, v_ref = torch.randn(5, 3, 4, generator=g, dtype=torch.float64), torch.randn(5, 3, 4, generator=g, dtype=torch.float64)
    t = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.995], dtype=torch.float64)
    plain = VelocityKL(KLOptions(kl_beta=0.25))
    weighted, kl = plain.value(v, v_ref, t)
    want = ((v - v_ref) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(kl, want, rtol=1e-15, atol=0)
    torch.testing.assert_close(weighted, 0.25 * want, rtol=1e-15, atol=0)
    a = 0.5  # not the 0.7 that awm used to hard-code
    sig = VelocityKL.from_config(AWMOptions(kl_beta=2.0, kl_sigma_weighting=True, kl_noise_level=a))
    weighted, kl = sig.value(v, v_ref, t)
    sigma2 = a**2 * t / (1 - t.clamp(max=0.99))
    torch.testing.assert_close(kl, want / (2 * sigma2), rtol=1e-14, atol=0)
    torch.testing.assert_close(weighted, 2.0 * want / (2 * sigma2), rtol=1e-14, atol=0)


def test_terms_name_the_references_they_need():
    assert VelocityKL(KLOptions(kl_beta=1e-3)).references == {"base"}
    assert VelocityKL(KLOptions(kl_beta=1.0), reference="ema").references == {"ema"}
    assert VelocityKL(KLOptions(kl_beta=0.0)).references == frozenset()  # off: no reference pass
    assert ODEAnchor.from_config(GRPOOptions(anchor_beta=1.0)).references == {"base"}
    assert not ODEAnchor.from_config(GRPOOptions()).active
    assert LowNoiseAnchor.from_config(NFTOptions(policy_min_t=0.4, anchor_beta=0.0)).references == frozenset()
    assert LowNoiseAnchor.from_config(NFTOptions(policy_min_t=0.4)).references == {"base"}
    # the objectives read one term: dgpo's KL weight is its own option, not awm's
    assert VelocityKL.from_config(DGPOOptions(kl_beta=0.5)).opt.kl_beta == 0.5


def test_term_field_carries_the_terms_help_range_and_a_per_objective_default():
    src = {f.name: f for f in dataclasses.fields(KLOptions)}["kl_beta"]
    for host, default in ((NFTOptions, 1e-4), (AWMOptions, 1e-3), (DGPOOptions, 1e-3)):
        f = {f.name: f for f in dataclasses.fields(host)}["kl_beta"]
        assert f.metadata["help"].startswith(src.metadata["help"]) and f.metadata["range"] == {"ge": 0.0}
        assert f.default == default

    @dataclasses.dataclass
    class Host:
        kl_beta: float = term_field(KLOptions, "kl_beta", 0.5, "mine")

    f = dataclasses.fields(Host)[0]
    assert Host().kl_beta == 0.5 and f.metadata["help"].endswith("(mine)")


def test_term_option_bounds_are_checked_on_the_objectives_keys():
    with pytest.raises(ConfigError, match=r"'loss\.awm\.kl_noise_level' must be a finite number > 0") as err:
        load_config("awm", overrides=["loss.awm.kl_noise_level=0"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"'loss\.nft\.kl_beta' must be a finite number >= 0"):
        load_config(overrides=["loss.nft.kl_beta=-1"])
    with pytest.raises(ConfigError, match=r"'loss\.grpo\.anchor_beta' must be a finite number >= 0"):
        load_config("flow-grpo", overrides=["loss.grpo.anchor_beta=-1"])


def test_loss_config_holds_one_options_field_per_registered_objective():
    names = [f.name for f in dataclasses.fields(LossConfig)]
    with_options = [n for n, spec in objectives.OBJECTIVE_SPECS.items() if spec.options]
    assert names[-len(with_options):] == with_options  # in registration order, after the shared loss.* keys
    assert names == ["objective", "cfg_uncond_grad", *with_options] and with_options[0] == "grpo"
    assert set(objectives.OBJECTIVE_SPECS) == set(objectives.OBJECTIVES.names())
    help_text = {f.name: f for f in dataclasses.fields(LossConfig)}["objective"].metadata["help"]
    for name in objectives.OBJECTIVE_SPECS:
        assert f"{name} (" in help_text
    assert objectives.objective_label("nft") == "DiffusionNFT" and objectives.objective_label("my_obj") == "MY_OBJ"


def test_registering_an_objective_adds_its_options_without_touching_config():
    @dataclasses.dataclass
    class Base:
        objective: str = "grpo"

    name = "toy_objective_for_test"
    objectives.register_objective(name, "flowgrpo.objectives.nft:build_nft", "flowgrpo.objectives.options:NFTOptions",
                                  "Toy", "a toy")
    try:
        cls = objectives.with_objective_options(Base)
        made = cls()
        assert isinstance(getattr(made, name), NFTOptions) and getattr(made, name) is not getattr(cls(), name)
        field = {f.name: f for f in dataclasses.fields(cls)}[name]
        assert field.metadata["help"] == f"Toy options (loss.objective={name})"
        assert name in objectives.objective_help() and objectives.objective_label(name) == "Toy"
        assert cls.__name__ == "Base" and cls.__module__ == Base.__module__
    finally:
        objectives.OBJECTIVES.unregister(name)
        del objectives.OBJECTIVE_SPECS[name]


# --------------------------------------------------------------------------- keys an objective does not read


def test_a_users_key_the_objective_ignores_is_refused_in_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  timestep_fraction: 0.5\n")
    with pytest.raises(ConfigError) as err:
        load_config("awm", str(path))  # AWM draws its own training times: the credit stage's subset does nothing
    assert str(err.value) == ("config key 'train.timestep_fraction' = 0.5 has no effect with loss.objective=awm "
                              "(read by: grpo, flow_dppo, flow_opd); leave it at its default 1.0")
    with pytest.raises(ConfigError, match=r"'train\.timestep_order' = 'random' .* loss\.objective=nft"):
        load_config(overrides=["train.timestep_order=random"])
    # what the objective reads is accepted, and so is a key left at its default
    assert load_config("flow-dppo", overrides=["train.timestep_fraction=0.5"]).train.timestep_fraction == 0.5
    assert load_config("flow-grpo", overrides=["loss.grpo.kl_beta=0.2", "train.timestep_fraction=0.5"]).loss.grpo.kl_beta == 0.2
    load_config(overrides=["train.timestep_fraction=1.0"])


def test_another_objectives_options_are_kept_whatever_runs():
    """An objective's options are its own (``loss.<objective>.*``): set under another objective they are
    kept and not read, GRPO's as AWM's (a preset switched to another objective keeps its options)."""
    cfg = load_config(overrides=["loss.grpo.kl_beta=0.2", "loss.awm.kl_beta=0.3"])  # the default recipe runs nft
    assert cfg.loss.objective == "nft" and cfg.loss.grpo.kl_beta == 0.2 and cfg.loss.awm.kl_beta == 0.3
    cfg = load_config("flow-dppo", overrides=["loss.flow_dppo.guard_reweight=true", "loss.grpo.sft_beta=0.1"])
    assert cfg.loss.flow_dppo.guard_reweight and not cfg.loss.grpo.guard_reweight and cfg.loss.grpo.sft_beta == 0.1


def test_a_presets_grpo_keys_do_not_stop_switching_the_objective():
    cfg = load_config("shapes", overrides=["loss.objective=nft"])  # the shapes preset sets loss.grpo.kl_beta = 0.01
    assert cfg.loss.objective == "nft" and cfg.loss.grpo.kl_beta == 0.01


def test_no_shipped_preset_sets_a_key_its_objective_ignores():
    from flowgrpo.config import RECIPE_METHOD, compose_config
    from flowgrpo.presets import preset_names
    from flowgrpo.recipes import recipe_names

    # every method on the shapes world, and every recipe with its own method (its settings for it included)
    pairs = [(preset, "shapes") for preset in preset_names()] + [(RECIPE_METHOD, r) for r in recipe_names()]
    for preset, recipe in pairs:
        composed = compose_config(preset, None, [], recipe)
        # every key as if the user had set it: nothing a preset or recipe sets may be ignored
        objectives.check_objective_keys(composed.config, {k: "override" for k in composed.sources})
        # an objective's options set by a preset or recipe are the objective's that runs (or GRPO's
        # defaults, which a preset for another objective may inherit from its base)
        objective = composed.config.loss.objective
        for key, src in composed.sources.items():
            parts = key.split(".")
            if parts[0] == "loss" and len(parts) == 3 and src != "default":
                assert parts[1] == objective, f"{preset} on {recipe} sets {key} under loss.objective={objective}"


def test_the_cli_refuses_an_ignored_key_before_writing_anything(tmp_path):
    out = tmp_path / "runs"
    proc = run_cli(["train", "train.timestep_order=random", f"log.out_dir={out}"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("flowgrpo: error: config key 'train.timestep_order' = 'random' has no effect with "
                                "loss.objective=nft")
    assert not out.exists()


def test_self_guidance_is_its_formula_in_float64_and_pushes_along_the_guidance_direction():
    """b * mean((v - T)^2), T = v_u + g (v_old - v_u), on rows at t >= min_t (0 below); at v = v_old its
    gradient is -2 b (g - 1) (v_old - v_u) / D: the push along the guidance direction the module derives."""
    from flowgrpo.objectives.terms.self_guidance import SelfGuidance, SelfGuidanceOptions

    g = torch.Generator().manual_seed(0)
    v_old, v_u = (torch.randn(4, 3, 5, generator=g, dtype=torch.float64) for _ in range(2))
    v = (v_old + 0.1 * torch.randn(4, 3, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    t = torch.tensor([0.2, 0.4, 0.7, 1.0], dtype=torch.float64)
    term = SelfGuidance(SelfGuidanceOptions(self_guidance_beta=0.5, self_guidance_scale=3.0), min_t=0.4)
    assert term.active and term.references == frozenset()  # the old policy is the objective's own copy
    weighted, gap = term.value(v, v_old, v_u, t)
    target = v_u + 3.0 * (v_old - v_u)
    want = ((v - target) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(gap, want.detach(), rtol=1e-15, atol=0)
    torch.testing.assert_close(weighted, 0.5 * want * torch.tensor([0.0, 1, 1, 1], dtype=torch.float64),
                               rtol=1e-15, atol=0)
    at_old = v_old.clone().requires_grad_(True)
    term.value(at_old, v_old, v_u, t)[0].sum().backward()
    push = -2 * 0.5 * (3.0 - 1) * (v_old - v_u) / 15
    push[0] = 0  # the row below min_t
    torch.testing.assert_close(at_old.grad, push, rtol=1e-13, atol=1e-15)
    assert not SelfGuidance.from_config(NFTOptions()).active  # off by default


def test_self_guidance_weight_is_refused_where_the_policy_would_run_away():
    """beta (g - 1) must stay below the KL weight (terms/self_guidance.py: the fixed point's a < 1)."""
    cfg = load_config("shapes-nft", overrides=["loss.nft.self_guidance_beta=5"])  # kl_beta 10, g 2: a = 0.5
    assert cfg.loss.nft.self_guidance_beta == 5.0
    with pytest.raises(ConfigError, match=r"'loss\.nft\.self_guidance_beta' must be < loss\.nft\.kl_beta / "
                                          r"\(loss\.nft\.self_guidance_scale - 1\) = 10 .*got 10\.0"):
        load_config("shapes-nft", overrides=["loss.nft.self_guidance_beta=10"])
    with pytest.raises(ConfigError, match=r"= 0\.5 .*got 1\.0"):
        load_config("shapes-nft", overrides=["loss.nft.self_guidance_beta=1", "loss.nft.kl_beta=1",
                                             "loss.nft.self_guidance_scale=3"])
    with pytest.raises(ConfigError, match=r"'loss\.nft\.self_guidance_scale' must be a finite number > 1"):
        load_config("shapes-nft", overrides=["loss.nft.self_guidance_scale=1"])


def test_self_guidance_uncond_choice_is_validated_and_names_the_choices():
    assert load_config("shapes-nft", overrides=["loss.nft.self_guidance_uncond=base"]).loss.nft.self_guidance_uncond == "base"
    with pytest.raises(ConfigError, match=r"self_guidance_uncond.*old.*base"):
        load_config("shapes-nft", overrides=["loss.nft.self_guidance_uncond=ema"])
