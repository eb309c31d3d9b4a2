"""Qwen-Image-Edit-Plus through the generic adapter: diffusers 0.42.1's QwenImageEditPlusPipeline takes one
prompt per call, so the adapter probes, encodes and replays it one prompt at a time (flowgrpo/diffusers/replay/row_calls.py).
On a tiny random pipeline: Euler at noise 0 through flowgrpo = the stock pipeline run prompt by prompt
from the same latents (prompts of different text lengths in one batch); a LoRA run trains and samples."""

from __future__ import annotations

import json

import pytest
import torch

from flowgrpo.cli import main
from flowgrpo.config import ModelConfig
from flowgrpo.policies import build_policy
from flowgrpo.references import probe_references, to_pil
from flowgrpo.samplers.solvers import solve_ode

from test_edit_families import edit_prompt_file, moved_lora

RES, STEPS = 128, 3
PROMPTS = ["make the sky red", "add a small cat on the left please"]


@pytest.fixture(scope="module")
def plus_dir(tmp_path_factory):
    from diffusers import QwenImageEditPlusPipeline

    from flowgrpo.policies.tiny.families_edit import tiny_qwen_image_edit_components

    path = tmp_path_factory.mktemp("plus") / "qwen-image-edit-plus"
    QwenImageEditPlusPipeline(**tiny_qwen_image_edit_components(0)).save_pretrained(str(path))
    return path


def test_euler_matches_the_stock_pipeline_prompt_by_prompt(plus_dir):
    from diffusers import QwenImageEditPlusPipeline

    policy = build_policy(ModelConfig(name=str(plus_dir), train_mode="frozen", resolution=RES, max_sequence_length=32,
                                      guidance_scale=3.0))
    assert policy.takes_references and policy.combine.kind == "cfg_renorm"
    refs = probe_references(2, RES)
    noise = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cond = policy.encode_prompts(PROMPTS, list(refs))
        ours = policy.decode(solve_ode(lambda x, s: policy.velocity(x, torch.full((x.shape[0],), s), cond).float(),
                                       noise.clone(), policy.sigma_grid(STEPS)))
    assert any(k.endswith(".rowlen") for k in cond.tensors)  # the two prompts' texts differ in length
    pipe = QwenImageEditPlusPipeline.from_pretrained(str(plus_dir))
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        theirs = torch.cat([pipe(prompt=[p], image=to_pil(refs[i:i + 1]), height=RES, width=RES,
                                 num_inference_steps=STEPS, true_cfg_scale=3.0, negative_prompt=[" "],
                                 latents=policy.pipeline_latents(noise[i:i + 1]).clone(), output_type="pt",
                                 max_sequence_length=32).images for i, p in enumerate(PROMPTS)])
    assert theirs.std() > 1e-3 and ours.shape == theirs.shape == (2, 3, RES, RES)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # each row is replayed with its own reference: swapping the references changes both images
    with torch.no_grad():
        swapped = policy.encode_prompts(PROMPTS, list(refs.flip(0)))
        other = policy.decode(solve_ode(lambda x, s: policy.velocity(x, torch.full((x.shape[0],), s), swapped).float(),
                                        noise.clone(), policy.sigma_grid(STEPS)))
    assert all((other[i] - ours[i]).abs().max() > 1e-3 for i in range(2))


@pytest.mark.slow  # ~2 min on 2 cores; the default suite keeps the equivalence test above
def test_a_lora_run_trains_and_samples(plus_dir, tmp_path):
    prompts, _ = edit_prompt_file(tmp_path)
    argv = ["train", "--preset", "shapes", "--recipe", "shapes", f"model.name={plus_dir}", "model.train_mode=lora",
            f"model.resolution={RES}", "model.max_sequence_length=32", "model.lora_rank=4", "model.guidance_scale=3.0",
            "reward.weights={edit_consistency: 1.0}", f"data.prompts={prompts}", "data.prompts_per_iteration=2",
            "data.trees_per_prompt=2", f"sampler.num_steps={STEPS}", "sampler.strategy=flow_grpo",
            "train.iterations=1", "train.threads=1", "train.lr=3e-2", "eval.evaluator=none", "log.progress=false",
            "log.trackers=[]", f"log.out_dir={tmp_path}", "log.run_name=run"]
    assert main(argv) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[0]["onpolicy_ratio_maxdev"] < 1e-5  # on-policy: the replay is the rollout's velocity
    assert moved_lora(run)
    assert main(["sample", str(run), "--prompts", str(prompts), "--out", str(tmp_path / "s"), "--quiet"]) == 0
    assert len(json.loads((tmp_path / "s" / "samples.json").read_text())["files"]) == 2
