"""Defects that client code found in the diffusers plug-in (flowgrpo.diffusers) and in model folders,
each checked on the tiny random stock SD3 / FLUX / Wan pipelines of test_diffusers_plugin.py:

1. the pipeline's generator drives every SDE draw (rollout() and direct calls with
   ``scheduler.set_generator``): same generator, same latents bit for bit; another seed, others;
2. ``StepRecorder.velocity`` replays the velocity the pipeline stepped with for every guidance
   scheme (SD3 CFG, FLUX distilled guidance, FLUX true CFG with a negative prompt, Wan CFG), and
   refuses a combination it cannot replay instead of returning a wrong one;
3. a pipeline saved with a FlowGRPOScheduler loads again with the stock loaders, same images;
4. bad scheduler values and non-flow pipelines stop with one ValueError naming argument and range;
5. a pipeline folder whose model_index.json is not a JSON object is a one-line UserError (exit 2).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_cli, tiny_overrides
from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

from flowgrpo.diffusers import FlowGRPOScheduler, StepRecorder, ensure_flowgrpo_scheduler, rollout
from flowgrpo.errors import UserError
from flowgrpo.policies.tiny.flux import tiny_flux_pipeline
from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline
from flowgrpo.policies.tiny.wan import tiny_wan_pipeline

KW = {"sd3": dict(height=32, width=32, max_sequence_length=32, guidance_scale=4.5),
      "flux": dict(height=32, width=32, max_sequence_length=32),
      "wan": dict(height=32, width=32, num_frames=5, max_sequence_length=32, guidance_scale=4.0)}
BUILD = {"sd3": tiny_sd3_pipeline, "flux": tiny_flux_pipeline, "wan": tiny_wan_pipeline}
PROMPTS = ["a red cube", "two blue spheres"]


@pytest.fixture(scope="module")
def pipes():
    out = {}
    for name, build in BUILD.items():
        pipe = build(seed=0)
        pipe.set_progress_bar_config(disable=True)
        out[name] = pipe
    return out


@pytest.fixture
def restore_scheduler(pipes):
    """Put every pipeline's own scheduler back after the test."""
    stock = {name: pipe.scheduler for name, pipe in pipes.items()}
    yield
    for name, pipe in pipes.items():
        pipe.scheduler = stock[name]


def _levels(pr) -> torch.Tensor:
    """All chain levels of a PipelineRollout stacked: [T + 1, N, ...]."""
    return torch.stack([lv.x for lv in pr.rollout.levels])


def _rollout(pipe, name, seed, **kw):
    gen = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    return rollout(pipe, PROMPTS, trees_per_prompt=2, num_inference_steps=3, generator=gen,
                   scheduler_options=dict(noise_level=0.7), **KW[name], **kw)


# --------------------------------------------------------------------------- 1. reproducibility


@pytest.mark.parametrize("name", ["sd3", "flux", "wan"])
def test_rollout_generator_drives_the_sde_noise(pipes, restore_scheduler, name):
    pipe = pipes[name]
    torch.manual_seed(100)  # the global RNG differs between the calls: it must not matter
    a = _levels(_rollout(pipe, name, 7))
    torch.manual_seed(200)
    b = _levels(_rollout(pipe, name, 7))
    c = _levels(_rollout(pipe, name, 8))
    same, other = (a - b).abs().max().item(), (a - c).abs().max().item()
    print(f"{name}: same generator max |diff| {same:.3g}; another seed {other:.3g}")
    assert same == 0.0
    assert (a[1:] - c[1:]).flatten(2).abs().amax(-1).min().item() > 1e-3  # every level of every sample differs
    assert pipe.scheduler.generator is None  # rollout() does not keep the caller's generator


def test_per_sample_generators(pipes, restore_scheduler):
    """A list of generators (one per sample) seeds each chain on its own: changing one generator
    changes its chain only."""
    pipe, n = pipes["sd3"], len(PROMPTS) * 2
    a = _levels(_rollout(pipe, "sd3", [torch.Generator().manual_seed(s) for s in range(n)]))
    b = _levels(_rollout(pipe, "sd3", [torch.Generator().manual_seed(s) for s in range(n)]))
    c = _levels(_rollout(pipe, "sd3", [torch.Generator().manual_seed(s) for s in (0, 1, 2, 99)]))
    kept = (a[:, :3] - c[:, :3]).abs().max().item()
    print(f"per-sample generators: same {(a - b).abs().max().item():.3g}; samples 0-2 after reseeding "
          f"sample 3: {kept:.3g}; sample 3: {(a[:, 3] - c[:, 3]).abs().max().item():.3g}")
    assert torch.equal(a, b)
    assert kept <= 1e-6 and (a[1:, 3] - c[1:, 3]).abs().max().item() > 1e-3
    with pytest.raises(ValueError, match="3 generators for a batch of 4"):
        _rollout(pipe, "sd3", [torch.Generator().manual_seed(s) for s in range(3)])


def test_direct_pipeline_call_with_set_generator(pipes, restore_scheduler):
    pipe = pipes["sd3"]
    sched = ensure_flowgrpo_scheduler(pipe, noise_level=0.7)

    def call(seed):
        gen = torch.Generator().manual_seed(seed)
        sched.set_generator(gen)
        return pipe(PROMPTS, num_inference_steps=3, generator=gen, output_type="latent", **KW["sd3"]).images

    torch.manual_seed(1)
    a = call(5)
    torch.manual_seed(2)
    b, c = call(5), call(6)
    sched.set_generator(None)
    print(f"direct calls: same generator {(a - b).abs().max().item():.3g}, another {(a - c).abs().max().item():.3g}")
    assert torch.equal(a, b) and (a - c).abs().max().item() > 1e-3
    # the documented fallback without set_generator: torch's global RNG
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(3)
    d = pipe(PROMPTS, num_inference_steps=3, generator=gen, output_type="latent", **KW["sd3"]).images
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(3)
    e = pipe(PROMPTS, num_inference_steps=3, generator=gen, output_type="latent", **KW["sd3"]).images
    assert torch.equal(d, e)


# --------------------------------------------------------------------------- 2. guidance replay

SCHEMES = {
    "sd3_cfg": ("sd3", {}, 4.5),
    "flux_distilled": ("flux", dict(guidance_scale=3.5), None),
    "flux_true_cfg": ("flux", dict(guidance_scale=3.5, true_cfg_scale=2.0, negative_prompt=["blurry", "dark"]), 2.0),
    "wan_cfg": ("wan", {}, 4.0),
}


def _capture_stepped_velocity(scheduler) -> list[torch.Tensor]:
    """Record the ``model_output`` of every ``scheduler.step`` call (instance-level wrapper)."""
    seen, step = [], scheduler.step

    def wrapped(model_output, *args, **kwargs):
        seen.append(model_output.detach().float().clone())
        return step(model_output, *args, **kwargs)

    scheduler.step = wrapped
    return seen


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_replay_equals_stepped_velocity(pipes, restore_scheduler, scheme):
    name, extra, cfg_scale = SCHEMES[scheme]
    pipe = pipes[name]
    sched = ensure_flowgrpo_scheduler(pipe, noise_level=0.7)
    stepped = _capture_stepped_velocity(sched)
    kw = dict(KW[name], **extra)
    pr = rollout(pipe, PROMPTS, trees_per_prompt=2, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                 **kw)
    del sched.step
    rec = pr.recorder
    worst = 0.0
    with torch.no_grad():
        for i, v in enumerate(stepped):
            worst = max(worst, (rec.velocity(i, pr.rollout.levels[i].x) - v).abs().max().item())
    print(f"{scheme}: CFG scale {rec.guidance_scale}, max |replay - stepped| = {worst:.3g}")
    assert len(stepped) == 3 and worst <= 1e-5
    if cfg_scale is None:
        assert rec.guidance_scale is None and not rec.cfg
    else:
        assert rec.cfg and rec.guidance_scale == pytest.approx(cfg_scale, rel=1e-4)


def test_direct_recorder_finds_flux_true_cfg_scale(pipes, restore_scheduler):
    """Without rollout() (which knows ``true_cfg_scale``) the recorder reads the scale off the step."""
    pipe = pipes["flux"]
    rec = StepRecorder().attach(pipe)
    stepped = _capture_stepped_velocity(pipe.scheduler)
    x0 = torch.randn(2, 4, pipe.transformer.config.in_channels, generator=torch.Generator().manual_seed(0))
    try:
        pipe(PROMPTS[:2], num_inference_steps=2, latents=x0, callback_on_step_end=rec,
             callback_on_step_end_tensor_inputs=rec.tensor_inputs(pipe), guidance_scale=3.5, true_cfg_scale=2.0,
             negative_prompt=["blurry", "dark"], output_type="latent", **{k: v for k, v in KW["flux"].items()})
    finally:
        rec.detach()
        del pipe.scheduler.step
    with torch.no_grad():
        diff = max((rec.velocity(i, rec.latents_in(i, x0)) - v).abs().max().item() for i, v in enumerate(stepped))
    print(f"direct FLUX true CFG: fitted scale {rec.guidance_scale:.7g}, max |replay - stepped| = {diff:.3g}")
    assert rec.guidance_scale == pytest.approx(2.0, rel=1e-4) and diff <= 1e-5


def test_unreplayable_guidance_is_refused(pipes, restore_scheduler):
    """SD3 skip-layer guidance (from step 1 on) adds a third output the recorder does not model:
    velocity() says so for those steps instead of returning another velocity."""
    pipe = pipes["sd3"]
    pr = rollout(pipe, PROMPTS[:1], num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                 scheduler_options=dict(noise_level=0.7), skip_guidance_layers=[0], skip_layer_guidance_start=0.0,
                 skip_layer_guidance_stop=1.0, **KW["sd3"])
    rec, levels = pr.recorder, pr.rollout.levels
    assert sorted(rec.unreplayable) == [1, 2] and rec.guidance_scales == {0: 4.5}
    with torch.no_grad():
        rec.velocity(0, levels[0].x)
    with pytest.raises(ValueError, match="cannot replay step 1") as info:
        rec.velocity(1, levels[1].x)
    print(info.value)


# --------------------------------------------------------------------------- 3. save / load


def test_saved_pipeline_loads_again(pipes, restore_scheduler, tmp_path):
    pipe = pipes["sd3"]
    sched = ensure_flowgrpo_scheduler(pipe, noise_level=0.0, window_start=1, window_size=2)
    pipe.save_pretrained(tmp_path)
    entry = json.loads((tmp_path / "model_index.json").read_text())["scheduler"]
    ref = pipe(PROMPTS, num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="pt",
               **KW["sd3"]).images
    for loader in (StableDiffusion3Pipeline, DiffusionPipeline):
        again = loader.from_pretrained(tmp_path)
        again.set_progress_bar_config(disable=True)
        assert type(again) is StableDiffusion3Pipeline and type(again.scheduler) is FlowGRPOScheduler
        assert {k: again.scheduler.config[k] for k in ("noise_level", "window_start", "window_size", "shift")} == \
            {k: sched.config[k] for k in ("noise_level", "window_start", "window_size", "shift")}
        got = again(PROMPTS, num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="pt",
                    **KW["sd3"]).images
        diff = (ref - got).abs().max().item()
        print(f"{loader.__name__}.from_pretrained ({entry}): max |image diff| at noise 0 = {diff:.3g}")
        assert diff == 0.0


# --------------------------------------------------------------------------- 4. bad values

BAD = [
    (dict(noise_level=-1), "noise_level=-1", ">= 0"),
    (dict(noise_level=float("nan")), "noise_level=nan", ">= 0"),
    (dict(noise_level=float("inf")), "noise_level=inf", ">= 0"),
    (dict(noise_level="abc"), "noise_level='abc'", ">= 0"),
    (dict(noise_level=True), "noise_level=True", ">= 0"),
    (dict(noise_level=1.5, sde_kind="cps"), "noise_level=1.5", "[0, 1]"),
    (dict(sde_kind="ddim"), "sde_kind='ddim'", "flow_grpo, dance, cps"),
    (dict(log_prob="mse"), "log_prob='mse'", "cps"),
    (dict(log_prob="l2"), "log_prob='l2'", "gaussian, mse"),
    (dict(sde_steps=[-1]), "sde_steps=[-1]", ">= 0"),
    (dict(sde_steps=[1.5]), "sde_steps=[1.5]", ">= 0"),
    (dict(sde_steps=3), "sde_steps=3", "list"),
    (dict(window_start=-3, window_size=2), "window_start=-3", ">= 0"),
    (dict(window_start=0, window_size=0), "window_size=0", ">= 1"),
    (dict(window_start="a", window_size=2), "window_start='a'", ">= 0"),
    (dict(window_start=1), "window_start", "window_size"),
    (dict(sde_steps=[0], window_start=0, window_size=1), "sde_steps", "window_start"),
]


@pytest.mark.parametrize("options,names,valid", BAD, ids=[b[1] for b in BAD])
def test_bad_scheduler_values_are_one_clear_error(options, names, valid):
    with pytest.raises(ValueError) as info:
        FlowGRPOScheduler(**options)
    msg = str(info.value)
    assert "\n" not in msg and names in msg and valid in msg, msg


@pytest.mark.parametrize("options,names", [(dict(sde_steps=[99]), "sde_steps=[99]"),
                                           (dict(sde_steps=[0, 4]), "sde_steps=[0, 4]"),
                                           (dict(window_start=4, window_size=2), "window_start=4")])
def test_steps_outside_the_grid_are_refused(options, names):
    sched = FlowGRPOScheduler(**options)
    with pytest.raises(ValueError) as info:
        sched.set_timesteps(4)
    msg = str(info.value)
    assert names in msg and "0..3" in msg and "\n" not in msg, msg
    sched = FlowGRPOScheduler(sde_steps=[3])
    sched.set_timesteps(4)
    assert sched.sde_mask() == [False, False, False, True]


def test_values_from_config_are_checked(pipes):
    with pytest.raises(ValueError, match="noise_level=nan"):
        FlowGRPOScheduler.from_config(pipes["sd3"].scheduler.config, noise_level=math.nan)
    assert FlowGRPOScheduler(noise_level=0).config.noise_level == 0  # an int is a number


def test_rollout_refuses_a_non_flow_pipeline():
    from diffusers import DDIMScheduler, DDPMPipeline, UNet2DModel

    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 8),
                       norm_num_groups=4, down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))
    for scheduler in (DDPMPipeline(unet, DDIMScheduler()).scheduler, None):
        pipe = DDPMPipeline(unet, scheduler or DDIMScheduler(prediction_type="v_prediction"))
        with pytest.raises(ValueError) as info:
            rollout(pipe, "x")
        msg = str(info.value)
        print(msg)
        assert "\n" not in msg and "DDIMScheduler" in msg and "flow-matching" in msg and "DDPMPipeline" in msg
        assert type(pipe.scheduler) is DDIMScheduler  # left untouched


# --------------------------------------------------------------------------- 5. broken pipeline folders

BROKEN = {"not_json": "{not json", "a_list": '["StableDiffusion3Pipeline"]', "binary": b"\xff\xfe\x00",
          "a_string": '"StableDiffusion3Pipeline"'}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_broken_model_index_is_a_user_error(tmp_path, kind):
    from flowgrpo.config import ModelConfig
    from flowgrpo.policies import resolve_adapter

    folder = tmp_path / kind
    folder.mkdir()
    content = BROKEN[kind]
    path = folder / "model_index.json"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(UserError) as info:
        resolve_adapter(ModelConfig(name=str(folder)))
    msg = str(info.value)
    print(msg)
    assert "\n" not in msg and str(path) in msg and "JSON object" in msg


def test_model_index_with_a_non_string_class_name(tmp_path):
    from flowgrpo.config import ModelConfig
    from flowgrpo.policies import resolve_adapter

    (tmp_path / "model_index.json").write_text('{"_class_name": ["StableDiffusion3Pipeline"]}')
    with pytest.raises(UserError, match="pipeline class \\['StableDiffusion3Pipeline'\\] is not supported"):
        resolve_adapter(ModelConfig(name=str(tmp_path)))


def test_broken_model_index_through_the_cli(tmp_path, shapes_model_dir):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "model_index.json").write_text("[1, 2")
    proc = run_cli(["train", *tiny_overrides(shapes_model_dir), f"log.out_dir={tmp_path / 'runs'}",
                    f"model.name={folder}"])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    print(proc.returncode, lines)
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("flowgrpo: error: ") and "model.name" in lines[0] and "model_index.json" in lines[0]
