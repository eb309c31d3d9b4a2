"""Text-to-image and text-to-video families through the generic pipeline adapter, each on a tiny random
pipeline saved to disk.

Per family: (a) Euler at noise 0 through flowgrpo = the stock pipeline's images for the same latents;
(b) on-policy ratio 1 on the first update; (c) 2 LoRA iterations move the LoRA, not the base (the
trained policy's base weights equal the pipeline folder's); (d) ``flowgrpo export`` gives a LoRA the
stock pipeline loads and that reproduces the policy's images; (e) an untrainable pipeline class gets
one line naming what it lacks. Wan 2.2 (both layouts) runs the stock pipeline with flow-matching Euler
at its ``flow_shift`` in place of its UniPC solver, as the adapter does; for its two experts, the
trained steps decide which expert's LoRA moves. The measured values are printed (``pytest -s``).
"""

from __future__ import annotations

import inspect
import json
import math
import os
from dataclasses import dataclass, field

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from flowgrpo.cli import main
from flowgrpo.config import ModelConfig, load_config
from flowgrpo.errors import UserError
from flowgrpo.policies import build_policy, resolve_adapter
from flowgrpo.policies.diffusers.generic.families import family_of
from flowgrpo.policies.tiny.families import save_tiny_pipeline
from flowgrpo.policies.diffusers.generic.adapter import PipelinePolicy
from flowgrpo.policies.tiny.wan import save_tiny_wan
from flowgrpo.samplers.solvers import solve_ode
from flowgrpo.trainer import run as run_module
from flowgrpo.trainer.checkpoint import latest_checkpoint, load_checkpoint

STEPS = 3
PROMPTS = ["a photo of a cat", "a mountain lake at dawn"]


@dataclass(frozen=True)
class Case:
    """One tiny family: the adapter ``model.name=<folder>`` picks, the guidance value, image side, text
    tokens, and the stock ``__call__`` options that give the same guided sampling (written out here,
    independently of the family's entry), and the guidance scheme the generic adapter must infer."""

    adapter: str
    guidance: float
    scheme: tuple[str, float, float]  # (Combine.kind, offset, sign)
    resolution: int = 64
    seq: int = 32
    stock_kwargs: dict = field(default_factory=dict)
    #: whether the pipeline's latents= argument is in another layout than the scheduler's sample
    repacked: bool = False
    #: video frames (None: an image family)
    frames: int | None = None
    #: the stock pipeline steps with flow-matching Euler at its flow_shift instead of its own solver
    euler: bool = False
    #: the largest batch the stock pipeline runs (HunyuanVideo 1.5's VAE decodes one video at a time)
    stock_batch: int = 8
    #: the guidance value is the guider component's, not a keyword (HunyuanVideo 1.5)
    guider: bool = False
    #: the pipeline has no load_lora_weights: the LoRA goes into its transformer with load_lora_adapter
    adapter_loader: bool = False


CASES = {
    "sd35-large": Case("sd3", 2.0, ("cfg", 0.0, 1.0), stock_kwargs={"guidance_scale": 2.0}),
    # c + g (c - u), negated output
    "z-image": Case("pipeline", 3.0, ("cfg", 1.0, -1.0), stock_kwargs={"guidance_scale": 3.0}),
    # true CFG with norm rescale; the system-prompt template takes ~144 of the text tokens
    "qwen-image": Case("pipeline", 3.0, ("cfg_renorm", 0.0, 1.0), resolution=32, seq=200,
                       stock_kwargs={"true_cfg_scale": 3.0, "negative_prompt": " "}),
    # distilled guidance (a transformer input); latents= unpacked [B, 4C, h, w], the scheduler's packed;
    # the system message takes ~190 of the text tokens
    "flux2": Case("pipeline", 3.0, ("single", 0.0, 1.0), resolution=32, seq=256, stock_kwargs={"guidance_scale": 3.0},
                  repacked=True),
    # two experts split at boundary_ratio 0.875: step 0 of 3 (t = 1000) is transformer's, steps 1-2 transformer_2's
    "wan22-a14b": Case("pipeline", 4.0, ("cfg", 0.0, 1.0), resolution=32, seq=16, stock_kwargs={"guidance_scale": 4.0},
                       frames=5, euler=True),
    # one expert, 48 latent channels, per-token timesteps
    "wan22-5b": Case("pipeline", 4.0, ("cfg", 0.0, 1.0), resolution=64, seq=16, stock_kwargs={"guidance_scale": 4.0},
                     frames=5, euler=True),
    # the transformer's input is [sample, zero condition latents, zero mask]; guidance is the guider's; text
    # is padded to the pipeline's fixed 1000 MLLM + 256 ByT5 tokens (no max_sequence_length)
    "hunyuan-video15": Case("pipeline", 4.0, ("cfg", 0.0, 1.0), resolution=16, frames=5, stock_batch=1, guider=True,
                            adapter_loader=True),
}


def base_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The non-LoRA parameters of ``module`` under their names without peft's ``base_layer.``."""
    return {n.replace("base_layer.", ""): p.detach().clone() for n, p in module.named_parameters() if "lora_" not in n}


def run_config(base, case: Case, root, *overrides: str):
    """A LoRA run of ``case`` on the pipeline folder ``base`` writing to ``root/run``: 2 iterations of
    flow_grpo (every step trained) unless ``overrides`` say otherwise."""
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return load_config("shapes", None, [
        *([f"model.num_frames={case.frames}"] if case.frames else []), "reward.frame_stride=1",
        f"model.name={base}", "model.train_mode=lora", f"model.resolution={case.resolution}",
        f"model.max_sequence_length={case.seq}", "model.lora_rank=4", "model.lora_alpha=8",
        f"model.guidance_scale={case.guidance}", "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompts}",
        "data.prompts_per_iteration=2", "data.trees_per_prompt=2", f"sampler.num_steps={STEPS}",
        "sampler.strategy=flow_grpo", "train.iterations=2", "train.threads=1", "train.lr=3e-2", "eval.evaluator=none",
        "log.progress=false", "log.trackers=[]", "log.checkpoint_every=1", f"log.out_dir={root}", "log.run_name=run",
        *overrides,
    ], recipe="shapes")


def moved_lora(run_dir) -> list[str]:
    """Names of the LoRA B matrices of the run's latest checkpoint that left zero (where peft starts them)."""
    state = load_checkpoint(latest_checkpoint(run_dir))["trainer"]["trainable"]
    return [k for k, v in state.items() if "lora_B" in k and v.abs().max() > 0]


# HunyuanVideo 1.5's stock pipeline is the slowest to replay (about 50 s on 2 cores): slow (`pytest -m slow`)
@pytest.fixture(scope="module", params=[pytest.param(c, marks=pytest.mark.slow) if c == "hunyuan-video15" else c
                                        for c in sorted(CASES)])
def family(request, tmp_path_factory):
    """(name, pipeline folder, case, run dir, run config, trained policy): a 2-iteration LoRA run."""
    name = request.param
    case = CASES[name]
    root = tmp_path_factory.mktemp(name)
    base = save_tiny_pipeline(name, root / "base")
    cfg = run_config(base, case, root)
    trainers = []

    class Capturing(run_module.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_module, "Trainer", Capturing)
        run_module.train(cfg)
    return name, base, case, root / "run", cfg, trainers[0].policy


def stock(path, case: Case):
    """The stock pipeline of the folder (with flow-matching Euler at its flow_shift where ``case.euler``)."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    pipe = DiffusionPipeline.from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if case.euler:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    if case.guider:
        pipe.guider = pipe.guider.new(guidance_scale=case.guidance)
    return pipe


def stock_images(pipe, noise, case: Case, prompts=PROMPTS):
    """Images [B, 3, H, W] (videos [B, F, 3, H, W]) of the stock pipeline from ``noise``."""
    options = {"num_frames": case.frames} if case.frames else {}
    if "max_sequence_length" in inspect.signature(type(pipe).__call__).parameters:
        options["max_sequence_length"] = case.seq
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), case.stock_batch):
            # a copy: ZImagePipeline writes its chat-templated prompts into the list it is given
            out.append(pipe(prompt=list(prompts[i:i + case.stock_batch]), height=case.resolution, width=case.resolution,
                            num_inference_steps=STEPS, latents=noise[i:i + case.stock_batch].clone(), output_type="pt",
                            **options, **case.stock_kwargs)[0])
    return torch.cat(out)


def load_lora(pipe, directory, policy, case: Case) -> None:
    """The exported LoRA into the stock pipeline: ``load_lora_weights`` (each further expert's from its
    sub-folder), or the transformer's ``load_lora_adapter`` where the pipeline has no LoRA loader."""
    if case.adapter_loader:
        assert not hasattr(pipe, "load_lora_weights")
        pipe.transformer.load_lora_adapter(str(directory), prefix="transformer",
                                           weight_name="pytorch_lora_weights.safetensors")
        return
    pipe.load_lora_weights(str(directory))
    for expert in experts(policy)[1:]:  # Wan 2.2: DIR/transformer_2, loaded into the second expert
        pipe.load_lora_weights(str(directory / expert), **{f"load_into_{expert}": True})


def experts(policy) -> tuple[str, ...]:
    """The policy's trained denoisers (pipeline attribute names)."""
    return policy.switch.names if isinstance(policy, PipelinePolicy) else ("transformer",)


def noise_shape(policy) -> tuple[int, ...]:
    """The per-sample shape of the stock pipeline's ``latents=`` argument."""
    return policy.layout.input_shape if isinstance(policy, PipelinePolicy) else policy.latent_shape


def policy_images(policy, noise, prompts=PROMPTS):
    """Euler on the policy's grid from the stock pipeline's initial ``noise``, decoded."""
    x = policy.policy_latents(noise.clone()) if isinstance(policy, PipelinePolicy) else noise.clone()
    with torch.no_grad():
        cond = policy.encode_prompts(list(prompts))
        vel = lambda x, s: policy.velocity(x, torch.full((x.shape[0],), s), cond).float()  # noqa: E731
        return policy.decode(solve_ode(vel, x, policy.sigma_grid(STEPS)))


def test_a_euler_matches_the_stock_pipeline(family):
    name, base, case, _, cfg, _ = family
    assert resolve_adapter(cfg.model)[0] == case.adapter
    frozen = ModelConfig(name=str(base), train_mode="frozen", resolution=case.resolution, max_sequence_length=case.seq,
                         guidance_scale=case.guidance, num_frames=case.frames)
    policies = [build_policy(frozen)]  # what model.name=<folder> builds
    if case.adapter != "pipeline":  # a dedicated adapter: the generic one too, built directly
        pipe = stock(base, Case("", 0.0, ("", 0.0, 0.0)))
        policies.append(PipelinePolicy(pipe, family_of(type(pipe).__name__), resolution=case.resolution,
                                       max_sequence_length=case.seq, guidance_scale=case.guidance, train_mode="frozen",
                                       num_frames=case.frames))
    generic = policies[-1]
    assert isinstance(generic, PipelinePolicy)
    # the sampled steps reach every expert (both of Wan 2.2 A14B)
    routed = generic.switch.route(generic.sigma_grid(STEPS)[:-1]).unique().tolist()
    assert routed == list(range(len(generic.switch.names))), routed
    assert (generic.combine.kind, generic.combine.offset, generic.combine.sign) == case.scheme
    assert (generic.layout.index is not None) == case.repacked
    noise = torch.randn(2, *noise_shape(generic), generator=torch.Generator().manual_seed(0))
    # prompts of different lengths (padded text), then of one length (Qwen-Image drops its text mask)
    for prompts in (PROMPTS, ["a red cube", "a big tree"]):
        theirs = stock_images(stock(base, case), noise, case, prompts)
        assert theirs.std() > 1e-3  # a real image, not a constant
        for policy in policies:
            ours = policy_images(policy, noise, prompts)
            frames = (case.frames,) if case.frames else ()
            assert ours.shape == theirs.shape == (2, *frames, 3, case.resolution, case.resolution)
            diff = float((ours - theirs).abs().max())
            print(f"\n[{name}] (a) {type(policy).__name__} Euler vs stock, {prompts[0]!r}...: max abs {diff:.3g}")
            assert diff <= 1e-5, (type(policy).__name__, diff)


def test_bc_two_lora_iterations(family):
    name, base, case, run_dir, _, policy = family
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    print(f"\n[{name}] (b) first update on-policy ratio max |r - 1|: {rows[0]['onpolicy_ratio_maxdev']:.3g}")
    assert rows[0]["onpolicy_ratio_maxdev"] < 1e-5
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    state = load_checkpoint(latest_checkpoint(run_dir))["trainer"]["trainable"]
    assert state and all("lora" in k for k in state)
    moved = moved_lora(run_dir)
    assert moved
    assert set(policy.trainable_state_dict()) == set(state)
    # every expert's LoRA moved (all steps are trained here)
    assert all(any(k.startswith(e + ".") for k in moved) for e in experts(policy))
    # the base: the trained policy's non-LoRA weights of every expert are still the pipeline folder's
    pipe = stock(base, case)
    base_diff = 0.0
    for expert in experts(policy):
        before, after = base_weights(getattr(pipe, expert)), base_weights(getattr(policy, expert))
        assert set(after) == set(before)
        base_diff = max(base_diff, *(float((after[k].float() - before[k].float()).abs().max()) for k in before))
    print(f"[{name}] (c) {len(moved)} LoRA B matrices moved ({', '.join(experts(policy))}); "
          f"base weights max change {base_diff:.3g}")
    assert base_diff == 0.0


def test_d_export_loads_into_the_stock_pipeline(family, tmp_path):
    name, base, case, run_dir, cfg, _ = family
    assert main(["export", str(run_dir), "--to", str(tmp_path / "lora")]) == 0
    policy = build_policy(cfg.model)
    noise = torch.randn(2, *noise_shape(policy), generator=torch.Generator().manual_seed(3))
    policy.load_trainable_state_dict(load_checkpoint(latest_checkpoint(run_dir))["trainer"]["ema"])
    ours = policy_images(policy, noise)
    pipe = stock(base, case)
    before = stock_images(pipe, noise, case)
    load_lora(pipe, tmp_path / "lora", policy, case)
    theirs = stock_images(pipe, noise, case)
    change, diff = float((theirs - before).abs().max()), float((theirs - ours).abs().max())
    print(f"\n[{name}] (d) exported LoRA in the stock pipeline vs policy: max abs {diff:.3g} "
          f"(the LoRA changes the images by {change:.3g})")
    assert change > 1e-4  # the trained LoRA changes the images
    assert diff <= 1e-4
    if len(experts(policy)) > 1 or case.adapter_loader:  # --fuse fuses every expert's adapter, with either loader
        assert main(["export", str(run_dir), "--to", str(tmp_path / "fused"), "--fuse"]) == 0
        fused = stock_images(stock(tmp_path / "fused", case), noise, case)
        fused_diff = float((fused - theirs).abs().max())
        print(f"[{name}] (d) --fuse vs the LoRA-loaded pipeline: max abs {fused_diff:.3g}")
        assert fused_diff <= 1e-4


@pytest.mark.parametrize("start", [0, STEPS - 1])
def test_wan22_the_trained_steps_pick_the_expert(start, tmp_path):
    """Step 0 of 3 (t = 1000 >= 875) is transformer's, step 2 (t = 8.9) transformer_2's: a MixGRPO
    window of that one step trains that expert's LoRA only."""
    case = CASES["wan22-a14b"]
    base = save_tiny_pipeline("wan22-a14b", tmp_path / "base")
    cfg = run_config(base, case, tmp_path, "sampler.strategy=mix_grpo", "strategy.window=1",
                     f"strategy.start={start}", "strategy.mode=frozen", "train.iterations=1")
    run_module.train(cfg)
    moved = {k.split(".")[0] for k in moved_lora(tmp_path / "run")}
    print(f"\n[wan22-a14b] window at step {start}: LoRA moved in {sorted(moved)}")
    assert moved == {"transformer" if start == 0 else "transformer_2"}


def test_wan22_switches_reach_both_experts(tmp_path, monkeypatch):
    """model.gradient_checkpointing / compile_transformer act on transformer_2 as on transformer (compiling
    is recorded, not run), and the checkpointed velocity and LoRA gradients of both experts are the plain ones."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(self))
    base = save_tiny_pipeline("wan22-a14b", tmp_path / "base")
    options = dict(name=str(base), train_mode="lora", resolution=32, num_frames=5, max_sequence_length=16,
                   guidance_scale=4.0, lora_rank=4, lora_alpha=8)
    plain = build_policy(ModelConfig(**options))
    switched = build_policy(ModelConfig(**options, gradient_checkpointing=True, compile_transformer=True))
    assert compiled == [switched.transformer, switched.transformer_2]
    assert switched.transformer.is_gradient_checkpointing and switched.transformer_2.is_gradient_checkpointing
    x = torch.randn(2, *plain.latent_shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([1.0, 0.5])  # one row per expert
    grads = []
    for policy in (plain, switched):
        policy.train()
        torch.manual_seed(0)
        for p in policy.trainable_parameters():
            torch.nn.init.normal_(p, std=0.1)  # the same draws for both: B != 0, so A gets gradients too
        v = policy.velocity(x, sigma, policy.encode_prompts(PROMPTS))
        v.square().sum().backward()
        grads.append((v.detach(), [p.grad for p in policy.trainable_parameters()]))
    (v0, g0), (v1, g1) = grads
    torch.testing.assert_close(v1, v0, rtol=0, atol=1e-5)
    # the mixed batch's rows are each row's own velocity (routed to its expert and put back in place)
    with torch.no_grad():
        cond = plain.encode_prompts(PROMPTS)
        alone = torch.cat([plain.velocity(x[i:i + 1], sigma[i:i + 1], cond.index(torch.tensor([i]))) for i in (0, 1)])
    torch.testing.assert_close(alone, v0, rtol=0, atol=1e-5)
    assert all(a is not None for a in g0) and len(g0) == len(g1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_e_untrainable_pipelines_get_one_line(tmp_path):
    cases = {"unet": ({"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
                       "scheduler": ["diffusers", "EulerDiscreteScheduler"]}, "names no transformer component"),
             "ddpm": ({"_class_name": "SomeDiTPipeline", "transformer": ["diffusers", "DiTTransformer2DModel"],
                       "scheduler": ["diffusers", "DDPMScheduler"]}, "'DDPMScheduler' is not a flow-matching one")}
    # Wan 2.2 ships UniPC; the adapter takes it only on flow sigmas predicting flow
    cases["wan-eps"] = ({"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
                         "transformer_2": ["diffusers", "WanTransformer3DModel"],
                         "scheduler": ["diffusers", "UniPCMultistepScheduler"]},
                        "'UniPCMultistepScheduler' is not a flow-matching one")
    (tmp_path / "wan-eps" / "scheduler").mkdir(parents=True)
    (tmp_path / "wan-eps" / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "UniPCMultistepScheduler", "prediction_type": "epsilon"}))
    for folder, (index, needle) in cases.items():
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "model_index.json").write_text(json.dumps(index))
        with pytest.raises(UserError) as info:
            resolve_adapter(ModelConfig(name=str(tmp_path / folder)))
        assert needle in str(info.value) and "\n" not in str(info.value)
    # Wan 2.1 keeps the wan adapter
    assert resolve_adapter(ModelConfig(name=str(save_tiny_wan(tmp_path / "wan21"))))[0] == "wan"
    # two experts train as two LoRAs, not in full
    base = save_tiny_pipeline("wan22-a14b", tmp_path / "a14b")
    with pytest.raises(UserError) as info:
        build_policy(ModelConfig(name=str(base), train_mode="full", resolution=32, num_frames=5, max_sequence_length=16))
    assert "full fine-tuning of its 2 experts is not supported" in str(info.value) and "\n" not in str(info.value)
    print(f"\n(e) {info.value}")
