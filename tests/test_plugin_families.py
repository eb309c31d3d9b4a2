"""The diffusers plug-in on every family the generic adapter trains: ``flowgrpo.diffusers.rollout()``
records the stock pipeline's rollout, and ``StepRecorder.velocity`` recomputes each step's velocity,
whatever the transformer's signature (positional, list or channel-extended inputs, reference-image
tokens) and guidance scheme (CFG, Z-Image's negated c + g (c - u), Qwen-Image's true CFG with norm
rescale, distilled guidance, a guider component), equal to the velocity the pipeline stepped with."""

from __future__ import annotations

import inspect
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from test_pipeline_families import CASES, STEPS, stock  # noqa: E402

from flowgrpo.diffusers import rollout  # noqa: E402
from flowgrpo.diffusers.rollout import ensure_flowgrpo_scheduler  # noqa: E402
from flowgrpo.policies.tiny.families import save_tiny_pipeline  # noqa: E402

EDIT_KWARGS = {  # the stock options of the tiny edit pipelines (as tests/test_edit_families.py)
    "flux-kontext": dict(resolution=32, guidance_scale=3.0, max_area=32 * 32, _auto_resize=False),
    "qwen-image-edit": dict(resolution=128, true_cfg_scale=3.0, negative_prompt=[" "]),
}
# the generic path's guidance scheme per family (None: the recorder's own u + g (c - u) replay)
GENERAL = {"z-image": "cfg", "qwen-image": "cfg_renorm", "hunyuan-video15": "cfg", "qwen-image-edit": "cfg_renorm",
           "flux-kontext": "single"}


def _capture(scheduler) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(stepped velocity, sample) of every ``scheduler.step`` call (an instance-level wrapper)."""
    seen, step = [], scheduler.step

    def wrapped(model_output, *args, **kwargs):
        sample = kwargs.get("sample", args[1] if len(args) > 1 else None)
        seen.append((model_output.detach().float().clone(), sample.detach().clone()))
        return step(model_output, *args, **kwargs)

    scheduler.step = wrapped
    return seen


@pytest.mark.parametrize("name", [*CASES, *EDIT_KWARGS])
def test_rollout_records_and_replays_every_family(name, tmp_path):
    base = save_tiny_pipeline(name, tmp_path / name)
    if name in CASES:
        case = CASES[name]
        pipe = stock(base, case)
        kw = {"height": case.resolution, "width": case.resolution, **case.stock_kwargs}
        if case.frames:
            kw["num_frames"] = case.frames
        if "max_sequence_length" in inspect.signature(type(pipe).__call__).parameters:
            kw["max_sequence_length"] = case.seq
    else:
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(str(base), local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        opts = dict(EDIT_KWARGS[name])
        side = opts.pop("resolution")
        rgb = np.random.default_rng(0).integers(0, 256, size=(48, 40, 3), dtype=np.uint8)
        kw = {"height": side, "width": side, "image": Image.fromarray(rgb), "max_sequence_length": 32, **opts}
    # HunyuanVideo 1.5's pipeline in diffusers 0.42.1 fails for num_videos_per_prompt > 1 (its text mask
    # is not repeated), so it gets one sample per prompt
    per_prompt = 1 if name == "hunyuan-video15" else 2
    sched = ensure_flowgrpo_scheduler(pipe, noise_level=0.7)
    seen = _capture(sched)
    pr = rollout(pipe, ["a photo of a cat"], trees_per_prompt=per_prompt, num_inference_steps=STEPS,
                 generator=torch.Generator().manual_seed(0), **kw)
    del sched.step
    rec = pr.recorder
    assert len(seen) == STEPS and len(pr.rollout.levels) == STEPS + 1
    assert not rec.unreplayable, rec.unreplayable
    with torch.no_grad():
        worst = max((rec.velocity(i, sample) - v).abs().max().item() for i, (v, sample) in enumerate(seen))
        # the rollout's own levels are the samples the scheduler stepped
        levels = max((pr.rollout.levels[i].x - s.float().reshape(pr.rollout.levels[i].x.shape)).abs().max().item()
                     for i, (_, s) in enumerate(seen))
    kinds = sorted({g.rule.kind for g in rec.general.values()})
    print(f"{name}: schemes {kinds or ['u + g (c - u)']}, max |replay - stepped| = {worst:.3g}, levels {levels:.3g}")
    assert worst <= 1e-5 and levels == 0.0
    if GENERAL.get(name):
        assert kinds == [GENERAL[name]] and len(rec.general) == STEPS
    else:
        assert not rec.general
