"""Flow-OPD with real teachers: run folders of 1-iteration shapes-world runs and LoRA folders of tiny
SD3 / FLUX / Wan pipelines (random adapters, saved as ``flowgrpo export`` writes them); the one-line
refusals of a missing teacher and of a teacher of another model; ``flowgrpo train --preset flow-opd``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowgrpo.cli import main
from flowgrpo.config import load_config
from flowgrpo.errors import UserError
from flowgrpo.trainer.trainer import Trainer

SMALL = ["data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=4", "train.threads=1",
         "log.progress=false", "log.trackers=[]", "eval.evaluator=none"]


@pytest.fixture(scope="module")
def teacher_runs(tmp_path_factory, shapes_model_dir):
    """Two shapes-world teachers: 1-iteration GRPO runs (another seed each, a reward that moves a random model)."""
    out = tmp_path_factory.mktemp("teachers")
    for name, seed in (("counting", 1), ("colors", 2)):
        assert main(["train", "--preset", "shapes", f"model.path={shapes_model_dir}", *SMALL, "train.iterations=1",
                     "train.lr=1e-2", f"train.seed={seed}", "reward.weights={jpeg_compressibility: 1.0}",
                     f"log.out_dir={out}", f"log.run_name={name}"]) in (0, None)
    return out


def _opd(model_path, teachers, *extra):
    routes = ", ".join(f"{k}: {v}" for k, v in teachers.items())
    return [f"model.path={model_path}", *SMALL, f"loss.flow_opd.teachers={{{routes}}}",
            f"loss.flow_opd.default_teacher={next(iter(teachers.values()))}", *extra]


def test_flowgrpo_train_preset_flow_opd_on_the_shapes_world(teacher_runs, shapes_model_dir, tmp_path):
    teachers = {"counting": teacher_runs / "counting", "colors": teacher_runs / "colors"}
    rc = main(["train", "--preset", "flow-opd", *_opd(shapes_model_dir, teachers), "train.iterations=2",
               "train.lr=1e-3", "log.checkpoint_every=1", f"log.out_dir={tmp_path}", "log.run_name=opd"])
    assert rc in (0, None)
    rows = [json.loads(line) for line in (tmp_path / "opd" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "opd_kl" in r]
    assert len(train) == 2
    for r in train:
        assert r["opd_kl"] > 0 and r["anchor_kl"] > 0 and math.isfinite(r["loss"]) and r["grad_norm"] > 0
    # the student started from the merged teachers (cold_start=merge) and moved from there
    from flowgrpo.trainer.checkpoint import load_policy_weights

    a, b = (load_policy_weights(teachers[k], prefer_ema=False).weights for k in ("counting", "colors"))
    trained = load_policy_weights(tmp_path / "opd", prefer_ema=False).weights
    merged = {n: (a[n] + b[n]) / 2 for n in a}
    moved = max(float((trained[n] - merged[n]).abs().max()) for n in a)
    assert 0 < moved < max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_every_sde_kind_distils(kind, teacher_runs, shapes_model_dir):
    teachers = {"counting": teacher_runs / "counting", "colors": teacher_runs / "colors"}
    extra = [f"sampler.sde_kind={kind}", "reward.weights={jpeg_compressibility: 1.0}", "train.micro_batch=512",
             *(["sampler.noise_level=0.3"] if kind == "dance" else [])]
    trainer = Trainer(load_config("flow-opd", None, _opd(shapes_model_dir, teachers, *extra), recipe="shapes"))
    m = trainer.iteration_step().metrics
    assert m["opd_kl"] > 0 and m["grad_norm"] > 0
    bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v) and k != "reward_mean"}
    assert not bad, bad


def test_a_missing_teacher_is_one_line(shapes_model_dir, tmp_path):
    cfg = load_config("flow-opd", None, _opd(shapes_model_dir, {"counting": tmp_path / "nope"}), recipe="shapes")
    with pytest.raises(UserError) as err:
        Trainer(cfg)
    msg = str(err.value)
    assert "\n" not in msg and "loss.flow_opd.teachers.counting" in msg and "does not exist" in msg


def test_a_teacher_of_another_model_is_one_line(teacher_runs, tmp_path):
    from flowgrpo.shapes.model import ShapesFlowModel

    other = tmp_path / "other_model"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        ShapesFlowModel().save(other)
    cfg = load_config("flow-opd", None, _opd(other, {"counting": teacher_runs / "counting"}), recipe="shapes")
    with pytest.raises(UserError) as err:
        Trainer(cfg)
    msg = str(err.value)
    assert "\n" not in msg and str(teacher_runs / "counting") in msg and "student's own base model" in msg


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from flowgrpo.policies.tiny.flux import save_tiny_flux_pipeline
    from flowgrpo.policies.tiny.wan import save_tiny_wan

    return {"flux": save_tiny_flux_pipeline(tmp_path_factory.mktemp("flux"), seed=0, guidance_embeds=True),
            "wan": save_tiny_wan(tmp_path_factory.mktemp("wan") / "tiny-wan")}


def _tiny(model: str, dirs) -> list[str]:
    lora = ["model.train_mode=lora", "model.lora_rank=4", "model.lora_alpha=8"]
    if model == "sd3":
        return ["model.name=sd3-tiny", "model.resolution=64", "model.max_sequence_length=16", *lora]
    if model == "flux":
        return [f"model.name={dirs['flux']}", "model.resolution=32", "model.max_sequence_length=16", *lora]
    return [f"model.name={dirs['wan']}", "model.resolution=32", "model.num_frames=5", "model.max_sequence_length=16", *lora]


def _lora_teacher(cfg, folder, seed):
    """A LoRA folder of ``cfg``'s model whose adapter is random (B non-zero, so it changes the velocity)."""
    from flowgrpo.policies import build_policy

    policy = build_policy(cfg.model)
    gen = torch.Generator().manual_seed(seed)  # the tiny pipeline seeds torch's global generator itself
    weights = {n: torch.randn(t.shape, generator=gen).to(t.dtype) * 0.05 for n, t in policy.trainable_state_dict().items()}
    return policy.save_lora(folder, weights)


@pytest.mark.parametrize("model", ["sd3", "flux", "wan"])
def test_flow_opd_distils_lora_teachers_on_tiny_pipelines(model, model_dirs, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\na red circle on a white table\n")
    common = [*_tiny(model, model_dirs), f"data.prompts={prompts}", *SMALL[:-1], "train.iterations=2", "train.lr=1e-3",
              "reward.weights={jpeg_compressibility: 1.0}", "eval.evaluator=none"]
    base_cfg = load_config("flow-opd", None, [*common, "loss.flow_opd.default_teacher=unused"], recipe="shapes")
    t1, t2 = (_lora_teacher(base_cfg, tmp_path / f"t{i}", seed=i) for i in (1, 2))
    cfg = load_config("flow-opd", None, [*common, f"loss.flow_opd.default_teacher={t1}",
                                         f"loss.flow_opd.anchor_teacher={t2}"], recipe="shapes")
    trainer = Trainer(cfg)
    policy = trainer.policy
    ids = {id(p) for p in policy.trainable_parameters()}
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if id(p) not in ids and n.startswith("transformer")}
    start = policy.trainable_state_dict()
    from flowgrpo.trainer.teacher_weights import load_lora_teacher

    teacher = load_lora_teacher(t1, policy, cfg.model)
    assert all(torch.equal(start[n], teacher[n].to(start[n].dtype)) for n in start)  # merge of one teacher: the teacher
    assert all(torch.equal(trainer.ema[n], start[n]) for n in start)  # the EMA starts from the merged weights
    first, second = (trainer.iteration_step().metrics for _ in range(2))
    # the student starts as its one teacher: no distance to it on the first rollout, only the anchor's pull
    assert first["opd_kl"] == 0 and first["anchor_kl"] > 0 and first["grad_norm"] > 0
    assert second["opd_kl"] > 0 and math.isfinite(second["loss"]) and second["grad_norm"] > 0
    after = policy.trainable_state_dict()
    assert any(not torch.equal(start[n], after[n]) for n in start)
    params = dict(policy.named_parameters())
    assert all(torch.equal(params[n].detach(), t) for n, t in frozen.items())


@pytest.mark.parametrize("student, extra, expected", [
    ("flux", [], ["loss.flow_opd.default_teacher", "does not fit the student"]),  # a LoRA of another model
    ("sd3", ["model.lora_alpha=16"], ["alpha/rank = 2", "model.lora_alpha/model.lora_rank = 4"]),  # of another scale
], ids=["another-model", "another-scale"])
def test_a_lora_teacher_that_does_not_fit_the_student_is_one_line(student, extra, expected, model_dirs, tmp_path):
    sd3 = load_config("flow-opd", None, [*_tiny("sd3", model_dirs), "loss.flow_opd.default_teacher=unused"],
                      recipe="shapes")
    lora = _lora_teacher(sd3, tmp_path / "sd3_lora", seed=0)
    cfg = load_config("flow-opd", None, [*_tiny(student, model_dirs), *extra, *SMALL, "data.prompts=shapes",
                                         "reward.weights={jpeg_compressibility: 1.0}",
                                         f"loss.flow_opd.default_teacher={lora}"], recipe="shapes")
    with pytest.raises(UserError) as err:
        Trainer(cfg)
    msg = str(err.value)
    assert "\n" not in msg and all(part in msg for part in expected), msg
