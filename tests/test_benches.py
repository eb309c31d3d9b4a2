"""``flowgrpo eval TARGET --bench NAME``: a benchmark of a run (trained and base side by side), a pipeline
folder or an exported LoRA; drawn to PNG files, scored from them, resumable, numbers as the paper defines.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from flowgrpo.benches.scoring import summarise
from flowgrpo.benches.suites import Bench
from flowgrpo.cli import main
from test_geneval_models import TINY, tiny_clip, tiny_detector  # noqa: F401 (fixtures)

PROMPTS = ["a red apple on a table", "a blue car in the rain", "a lighthouse at dusk"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny SD3 pipeline folder, a 1-iteration LoRA run on it and the run's exported LoRA."""
    from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline

    root = tmp_path_factory.mktemp("bench")
    tiny_sd3_pipeline().save_pretrained(root / "base")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "tag": t}) + "\n"
                               for p, t in zip(PROMPTS, ["food", "outdoor", "outdoor"])))
    assert main(["train", f"model.name={root / 'base'}", "model.dtype=float32", "model.resolution=64",
                 "model.max_sequence_length=16", "model.lora_rank=4", "model.lora_alpha=8", f"data.prompts={prompts}",
                 "data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=3", "train.iterations=1",
                 "train.lr=3e-2", "reward.weights={jpeg_compressibility: 1.0}", "eval.num_steps=3", "log.progress=false",
                 "log.trackers=[]", f"log.out_dir={root}", "log.run_name=run"]) == 0
    assert main(["export", str(root / "run"), "--to", str(root / "lora")]) == 0
    return root


@pytest.fixture(scope="module")
def tiny_pickscore(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from flowgrpo.policies.tiny.sd3 import tiny_clip_tokenizer

    d = tmp_path_factory.mktemp("pickscore")
    tok = tiny_clip_tokenizer(num_merges=500, max_length=77)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=77, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=224,
                  patch_size=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(d / "model")
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tok).save_pretrained(d / "processor")
    return [f"--option=model={d / 'model'}", f"--option=processor={d / 'processor'}", "--option=device=cpu"]


def bench(target, out, *extra):
    return main(["eval", str(target), "--bench", "pickscore", "--prompts", str(out.parent / "p.jsonl"),
                 "--out", str(out), "--batch-size", "2", *extra])


def test_a_run_is_benchmarked_beside_its_base_and_resumes(lora_run, tiny_pickscore, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text((lora_run / "prompts.jsonl").read_text())
    out = tmp_path / "out"
    assert bench(lora_run / "run", out, *tiny_pickscore) == 0
    result = json.loads((out / "bench.json").read_text())
    trained, base = result["models"].values()
    assert set(trained["per_tag"]) == {"food", "outdoor"} and trained["num_images"] == 3 == base["num_images"]
    assert math.isfinite(trained["headline"]) and trained["headline"] != base["headline"]  # the LoRA changed images
    assert len(list((out / "model0").glob("*.png"))) == 3 and (out / "grid_outdoor.png").is_file()
    assert "overall" in capsys.readouterr().out
    # resume: a removed image is drawn again, its score recomputed, the others read back; same numbers
    (out / "model0" / "00001_0.png").unlink()
    lines = (out / "model0" / "scores.jsonl").read_text().splitlines()
    (out / "model0" / "scores.jsonl").write_text("\n".join(l for l in lines if '"i": 1' not in l) + "\n")
    assert bench(lora_run / "run", out, *tiny_pickscore) == 0
    again = json.loads((out / "bench.json").read_text())
    for name, m in again["models"].items():  # batch composition moves a float32 image by an ulp, no more
        assert m["headline"] == pytest.approx(result["models"][name]["headline"], abs=1e-4)
        assert m["num_images"] == 3
    # other settings into the same folder: one line
    assert bench(lora_run / "run", out, *tiny_pickscore, "--seed", "5") == 2
    assert "other settings (seed)" in capsys.readouterr().err


def test_an_exported_lora_equals_its_run(lora_run, tiny_pickscore, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text((lora_run / "prompts.jsonl").read_text())
    assert bench(lora_run / "lora", tmp_path / "no_base", *tiny_pickscore) == 2
    assert "--base DIR" in capsys.readouterr().err
    assert bench(lora_run / "lora", tmp_path / "lora", *tiny_pickscore, "--base", str(lora_run / "base"),
                 "--steps", "3", "model.dtype=float32", "model.resolution=64", "model.max_sequence_length=16") == 0
    assert bench(lora_run / "run", tmp_path / "run", *tiny_pickscore) == 0
    lora = json.loads((tmp_path / "lora" / "bench.json").read_text())["models"]
    run = json.loads((tmp_path / "run" / "bench.json").read_text())["models"]
    # the same images: the exported LoRA in the policy draws what the run's trained policy draws
    assert abs(lora["lora"]["headline"] - run["trained (ema)"]["headline"]) < 1e-3
    assert abs(lora["base"]["headline"] - run["base"]["headline"]) < 1e-3


def test_geneval_headline_is_the_mean_of_tag_accuracies():
    g = Bench("g", "geneval", "tag_mean_accuracy", prompts="", source="", threshold=1.0)
    rows = [{"tag": "single_object"}] * 4 + [{"tag": "counting"}] * 2
    s = summarise(g, [1, 1, 1, 0, 0, float("nan")], rows, [0, 0, 1, 1, 2, 2])
    assert s.per_tag == {"counting": 0.0, "single_object": 0.75} and s.headline == pytest.approx(0.375)
    assert s.accuracy == pytest.approx(0.5) and s.num_failed == 1  # an unscored image counts wrong
    m = Bench("m", "pickscore", "mean_score", prompts="", source="")
    s = summarise(m, [0.2, 0.4, float("nan")], [{"tag": "a"}] * 3, [0, 1, 2])
    assert s.headline == pytest.approx(0.3) and s.accuracy is None
    assert s.stderr == pytest.approx(np.std([0.2, 0.4], ddof=1) / math.sqrt(2))


def test_the_bench_evaluator_logs_the_benchmark_during_training(lora_run, tiny_pickscore, tmp_path):
    opts = {k: v for k, v in (o.removeprefix("--option=").split("=", 1) for o in tiny_pickscore)}
    assert main(["train", f"model.name={lora_run / 'base'}", "model.dtype=float32", "model.resolution=64",
                 "model.max_sequence_length=16", "model.lora_rank=4", "model.lora_alpha=8",
                 f"data.prompts={lora_run / 'prompts.jsonl'}", "data.prompts_per_iteration=2", "data.trees_per_prompt=2",
                 "sampler.num_steps=3", "train.iterations=2", "reward.weights={jpeg_compressibility: 1.0}",
                 "eval.evaluator=bench", "eval.every=1", "eval.num_steps=3", "eval.num_prompts=3",
                 "eval.seeds_per_prompt=1", "eval.seen=false",
                 f"eval.options={{bench: pickscore, prompts: {lora_run / 'prompts.jsonl'}, metric_options: "
                 f"{{model: {opts['model']}, processor: {opts['processor']}, device: cpu}}}}",
                 "log.progress=false", "log.trackers=[]", f"log.out_dir={tmp_path}", "log.run_name=run"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(rows[0]["eval_accuracy"])  # beside the training reward (the last: the final evaluation)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # the after-training number is the one flowgrpo eval --bench computes on the same prompts and seeds
    out = tmp_path / "after"
    (tmp_path / "p.jsonl").write_text((lora_run / "prompts.jsonl").read_text())
    assert main(["eval", str(tmp_path / "run"), "--bench", "pickscore", "--prompts", str(tmp_path / "p.jsonl"),
                 "--out", str(out), *tiny_pickscore]) == 0
    trained = json.loads((out / "bench.json").read_text())["models"]["trained (ema)"]
    assert trained["headline"] == pytest.approx(summary["eval_after"]["score"], abs=2e-3)



def test_geneval_bench_end_to_end_on_a_tiny_pipeline_detector_and_clip(lora_run, tiny_clip, tiny_detector, tmp_path):
    """flowgrpo eval --bench geneval on the tiny SD3 folder, scored by a tiny random Mask2Former (biased to
    read every query as "cat") and a tiny random CLIP: the headline is the mean of the per-tag accuracies,
    each image's score the official verdict of its drawn file."""
    from flowgrpo.rewards import build_reward

    meta = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
            {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}],
             "prompt": "a photo of two cats"},
            {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}], "prompt": "a photo of a red cat"}]
    prompts = tmp_path / "evaluation_metadata.jsonl"
    prompts.write_text("".join(json.dumps(m) + "\n" for m in meta))
    options = {"detector": str(tiny_detector), "clip_model": TINY, "clip_pretrained": str(tiny_clip), "device": "cpu",
               "max_size": 96, "min_size": 64}
    out = tmp_path / "out"
    assert main(["eval", str(lora_run / "base"), "--bench", "geneval", "--prompts", str(prompts), "--out", str(out),
                 "--images-per-prompt", "2", "--steps", "3", "model.dtype=float32", "model.resolution=64",
                 "model.max_sequence_length=16", *(a for k, v in options.items() for a in ("--option", f"{k}={v}"))]) == 0
    model = json.loads((out / "bench.json").read_text())["models"]["model"]
    assert set(model["per_tag"]) == {"single_object", "counting", "colors"} and model["num_images"] == 6
    assert model["headline"] == pytest.approx(sum(model["per_tag"].values()) / 3)
    # each score is the official verdict of the PNG file it was drawn to
    from flowgrpo.commands.bench_eval import _read_png

    reward = build_reward("geneval", score="geneval", **options)
    files = sorted((out / "model0").glob("*.png"))
    verdicts = reward(torch.stack([_read_png(f) for f in files]), [m["prompt"] for m in meta for _ in range(2)],
                      metadata=[m for m in meta for _ in range(2)]).scores.tolist()
    logged = {(r["i"], r["j"]): r["score"] for r in map(json.loads, (out / "model0" / "scores.jsonl").read_text().splitlines())}
    assert [logged[(i, j)] for i in range(3) for j in range(2)] == verdicts
