"""`flowgrpo sample`: a trained tiny SD3 LoRA run (no evaluator) and a shapes-world run drawn with one
command; the files are the trained policy's images (and the stock pipeline's with the run's LoRA),
the same for the same seed, and bad input is one line with nothing written."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from flowgrpo.cli import main
from flowgrpo.config import load_config
from flowgrpo.images import to_uint8
from flowgrpo.policies import build_policy
from flowgrpo.output.drawing import noise_seed
from flowgrpo.samplers.solvers import solve_ode
from flowgrpo.trainer.checkpoint import latest_checkpoint, load_checkpoint
from flowgrpo.trainer.run import train

from conftest import tiny_overrides, train_tiny_sd3_lora_run

SEQ, STEPS, GUIDANCE = 16, 3, 2.0
PROMPTS = ["a photo of a cat", "a mountain lake at dawn", "a red cube"]


@pytest.fixture(scope="module")
def sd3_run(tmp_path_factory):
    """(base pipeline dir, run dir, prompt file): a 2-iteration tiny SD3 LoRA run with an EMA, no evaluator."""
    base, run_dir, prompts, _ = train_tiny_sd3_lora_run(tmp_path_factory.mktemp("sample_run"), PROMPTS, seq=SEQ,
                                                         steps=STEPS, guidance=GUIDANCE, extra=("eval.evaluator=none",))
    return base, run_dir, prompts


def pixels(folder, name) -> np.ndarray:
    return iio.imread(folder / name)


def test_sample_draws_the_trained_policy_and_the_stock_pipeline_with_its_lora(sd3_run, tmp_path, capsys):
    base, run_dir, prompts = sd3_run
    out = tmp_path / "out"
    assert main(["sample", str(run_dir), "--prompts", str(prompts), "--out", str(out), "--quiet"]) == 0
    assert "wrote 3 samples" in capsys.readouterr().out
    record = json.loads((out / "samples.json").read_text())
    assert record["weights"] == "ema" and record["checkpoint"] == "ckpt_000002" and record["steps"] == STEPS
    assert record["guidance"] == GUIDANCE
    names = [f"{i:04d}_0.png" for i in range(3)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, "grid.png", "samples.json"])
    assert [f["seed"] for f in record["files"]] == [noise_seed(0, i, 0) for i in range(3)] == [0, 100, 200]
    grid = iio.imread(out / "grid.png")
    assert grid.shape[1] >= 512 and grid.shape[0] > 3 * 512  # three captioned rows, enlarged to 512 wide
    files = np.stack([pixels(out, n) for n in names])
    assert files.shape == (3, 64, 64, 3)

    # the trained policy's own ODE sampling: its EMA weights, the run's grid, steps and guidance
    cfg = load_config("shapes", None, ["model.name=sd3", f"model.path={base}", "model.train_mode=lora",
                                       "model.resolution=64", f"model.max_sequence_length={SEQ}", "model.lora_rank=4",
                                       "model.lora_alpha=8", f"model.guidance_scale={GUIDANCE}"], recipe="shapes")
    state = load_checkpoint(latest_checkpoint(run_dir))["trainer"]
    policy = build_policy(cfg.model)
    policy.load_trainable_state_dict(state["ema"])
    noise = torch.stack([torch.randn(policy.latent_shape, generator=torch.Generator().manual_seed(s))
                         for s in (0, 100, 200)])
    with torch.no_grad():
        cond = policy.encode_prompts(PROMPTS)
        ours = policy.decode(solve_ode(lambda x, s: policy.velocity(x, torch.full((3,), s), cond).float(),
                                       noise.clone(), policy.sigma_grid(STEPS)))
    assert np.array_equal(to_uint8(ours), files)

    # the stock pipeline with the run's exported LoRA (its EMA) from the same noises
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(base), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(run_dir / "lora"))
    with torch.no_grad():
        theirs = pipe(prompt=PROMPTS, height=64, width=64, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                      latents=noise.clone(), output_type="pt", max_sequence_length=SEQ).images
    diff = np.abs(to_uint8(theirs).astype(int) - files.astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99

    # the same command again: the same files, byte for byte
    again = tmp_path / "again"
    assert main(["sample", str(run_dir), "--prompts", str(prompts), "--out", str(again), "--quiet"]) == 0
    assert all((again / n).read_bytes() == (out / n).read_bytes() for n in names)

    # raw weights of checkpoint 1, another seed, two images per prompt: other images, recorded as such
    other = tmp_path / "other"
    assert main(["sample", str(run_dir), "--prompts", str(prompts), "--out", str(other), "--weights", "raw",
                 "--checkpoint", "1", "--seed", "3", "--images-per-prompt", "2", "--quiet"]) == 0
    rec = json.loads((other / "samples.json").read_text())
    assert (rec["weights"], rec["checkpoint"], rec["seed"]) == ("raw", "ckpt_000001", 3)
    assert [f["seed"] for f in rec["files"][:2]] == [30_000_000, 30_000_001] and len(rec["files"]) == 6
    assert not np.array_equal(pixels(other, "0000_0.png"), files[0])


def test_sample_errors_are_one_line_and_write_nothing(sd3_run, tmp_path, capsys):
    _, run_dir, prompts = sd3_run
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    refs = tmp_path / "edit.jsonl"
    iio.imwrite(tmp_path / "ref.png", np.zeros((8, 8, 3), np.uint8))
    refs.write_text('{"prompt": "make it red", "image": "ref.png"}\n')
    capsys.readouterr()
    cases = [
        (["--out", str(busy)], "not an empty folder"),
        (["--out", str(tmp_path / "a"), "--checkpoint", "7"], "available: 1, 2"),
        (["--out", str(tmp_path / "b"), "--steps", "0"], "--steps must be in 1..1000, got 0"),
        (["--out", str(tmp_path / "b"), "--steps", "100000000"], "--steps must be in 1..1000, got 100000000"),
        (["--out", str(tmp_path / "c"), "--guidance", "nan"], "--guidance must be a finite number"),
        (["--out", str(tmp_path / "d"), "--prompts", str(tmp_path / "none.txt")], "prompt file not found"),
        (["--out", str(tmp_path / "e"), "--prompts", str(refs)], "takes no reference images"),
    ]
    for extra, needle in cases:
        argv = ["sample", str(run_dir), "--prompts", str(prompts), "--quiet", *extra]
        assert main(argv) == 2, extra
        err = capsys.readouterr().err.strip()
        assert needle in err and err.count("\n") == 0 and err.startswith("flowgrpo: error:"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "edit.jsonl", "ref.png"]  # no output, no temporary
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def test_a_failure_while_drawing_leaves_nothing(sd3_run, tmp_path, monkeypatch):
    import flowgrpo.commands.sample as command

    _, run_dir, prompts = sd3_run

    def fail(folder, *args):
        (folder / "0000_0.png").write_bytes(b"half")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(command, "_sample_into", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        main(["sample", str(run_dir), "--prompts", str(prompts), "--out", str(tmp_path / "new" / "deeper" / "out"),
              "--quiet"])
    assert list(tmp_path.iterdir()) == []  # neither the files, nor the temporary folder, nor the parents made


def test_sample_a_shapes_world_run(shapes_model_dir, tmp_path):
    from flowgrpo.shapes.evaluate import generate_ode
    from flowgrpo.trainer.checkpoint import load_trained_policy

    cfg = load_config("shapes", None, tiny_overrides(shapes_model_dir, **{
        "train.iterations": 1, "log.out_dir": str(tmp_path), "log.run_name": "s", "log.trackers": "[]",
        "eval.evaluator": "none"}), recipe="shapes")
    train(cfg)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\nfour red squares\n")
    out = tmp_path / "out"
    assert main(["sample", str(tmp_path / "s"), "--prompts", str(prompts), "--out", str(out), "--quiet"]) == 0
    files = np.stack([pixels(out, f"{i:04d}_0.png") for i in range(2)])
    assert files.shape == (2, 32, 32, 3)
    # the shapes evaluator's own sampler, on the run's trained policy, from the same seeds
    policy = load_trained_policy(tmp_path / "s").policy.eval()
    ref = generate_ode(policy, ["a red circle", "four red squares"], [0, 100], num_steps=cfg.sampler.num_steps,
                       shift=cfg.sampler.shift)
    assert np.abs(to_uint8(ref).astype(int) - files.astype(int)).max() <= 1


def test_sample_a_video_run(tmp_path):
    from flowgrpo.output.drawing import draw
    from flowgrpo.images import image_grid
    from flowgrpo.policies.tiny.wan import save_tiny_wan
    from flowgrpo.trainer.checkpoint import load_trained_policy

    frames, res = 5, 32
    base = save_tiny_wan(tmp_path / "tiny-wan")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat walking on a beach\na red ball rolling\n")
    cfg = load_config("flow-grpo", None, [
        f"model.name={base}", f"model.num_frames={frames}", f"model.resolution={res}", "model.train_mode=lora",
        "model.max_sequence_length=16", "model.lora_rank=4", "model.guidance_scale=3.0",
        "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompts}", "eval.evaluator=none",
        "data.prompts_per_iteration=1", "data.trees_per_prompt=2", "sampler.num_steps=2", "train.iterations=1",
        "train.threads=1", "log.progress=false", "log.trackers=[]", f"log.out_dir={tmp_path}", "log.run_name=w"],
        recipe="shapes")
    train(cfg)
    out = tmp_path / "out"
    assert main(["sample", str(tmp_path / "w"), "--prompts", str(prompts), "--out", str(out), "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["0000_0.mp4", "0000_0.png", "0001_0.mp4", "0001_0.png",
                                                      "grid.png", "samples.json"]
    assert iio.imread(out / "0000_0.mp4", plugin="FFMPEG").shape[:3] == (frames, res, res)
    # the frames png is the trained policy's video, drawn from the same seeds
    policy = load_trained_policy(tmp_path / "w").policy.eval()
    videos = draw(policy, ["a cat walking on a beach", "a red ball rolling"], [0, 100], 2, cfg.sampler.shift)
    assert videos.shape == (2, frames, 3, res, res)
    for i in range(2):
        assert np.array_equal(iio.imread(out / f"{i:04d}_0.png"), image_grid(videos[i], ncol=frames))
