"""HPSv3 and VideoAlign on tiny random Qwen2-VL models built offline, through their real loading paths.

A tiny base folder holds what the references read from Qwen2-VL-*-Instruct: ``config.json`` and a
processor (byte-level BPE tokenizer with Qwen's chat and vision specials, image and video processors,
a chat template). The checkpoints are written in the references' own layouts:

* HPSv3: the full model's state dict (``model.visual.*``, ``model.language_model.*``, ``lm_head``,
  ``rm_head.{0,3,5}``) as a safetensors file. Its scores are recomputed with transformers' own
  ``Qwen2VLModel`` forward (vision tower and placeholder scatter inside transformers) at the plain
  sequence positions the authors' forward uses, and the head applied by hand.
* VideoAlign: ``model_config.json`` and ``checkpoint-N/model.pth``, a PEFT-wrapped state dict in
  transformers 4.45's layout (``base_model.model.visual.*``, ``base_model.model.model.layers.*`` with
  ``base_layer`` / ``lora_A`` / ``lora_B``). Its scores are recomputed by the PEFT model itself
  (unmerged LoRA), which checks the merge and the key conversion.
"""

from __future__ import annotations

import json

import pytest
import torch

from flowgrpo.errors import ConfigError, UserError
from flowgrpo.rewards import build_reward

transformers = pytest.importorskip("transformers")

VISION_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPTS = ["a red cube on a table", "two dogs in the snow", "an astronaut riding a horse"]
HIDDEN = 16


def tiny_config(tok, extra_tokens: int):
    from transformers import Qwen2VLConfig

    ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(VISION_TOKENS)))
    text = dict(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=len(tok) + extra_tokens, max_position_embeddings=8192, bos_token_id=None,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})
    return Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=16, hidden_size=HIDDEN, num_heads=2, mlp_ratio=2),
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen2-VL base folder: config.json and a processor (tokenizer, image / video processors, template)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    from flowgrpo.policies.tiny.families import tiny_qwen_tokenizer

    d = tmp_path_factory.mktemp("tiny_qwen2vl")
    tok = tiny_qwen_tokenizer(max_length=16384)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = TEMPLATE
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                     chat_template=TEMPLATE).save_pretrained(d)
    tiny_config(tok, 0).save_pretrained(d)
    return d, tok


def images(seed: int, n: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.interpolate(torch.rand(n, 3, 6, 8, generator=g), size=(60, 76), mode="bilinear")


# --------------------------------------------------------------------------- HPSv3


@pytest.fixture(scope="module")
def hps_checkpoint(base, tmp_path_factory):
    from safetensors.torch import save_file
    from transformers import Qwen2VLForConditionalGeneration

    from flowgrpo.rewards.hpsv3 import ranknet_head

    _, tok = base
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        full = Qwen2VLForConditionalGeneration(tiny_config(tok, 1))
        head = ranknet_head(HIDDEN)
    sd = {k: v.clone().contiguous() for k, v in full.state_dict().items()}
    sd.update({f"rm_head.{k}": v.clone() for k, v in head.state_dict().items()})
    path = tmp_path_factory.mktemp("hpsv3") / "HPSv3.safetensors"
    save_file(sd, str(path))
    return path, full.eval(), head.eval()


def test_hpsv3_matches_the_transformers_forward(base, hps_checkpoint):
    path, full, head = hps_checkpoint
    reward = build_reward("hpsv3", checkpoint=str(path), base_model=str(base[0]), device="cpu", batch_size=2)
    x = images(0)
    out = reward(x, PROMPTS)
    assert out.scores.shape == (3,) and out.scores.dtype == torch.float32 and torch.isfinite(out.scores).all()
    assert (out.components["sigma"] > 0).all()

    from flowgrpo.rewards.qwen_vl import encode, resize

    batch = encode(reward.processor, reward.texts(PROMPTS), torch.device("cpu"), images=[resize(i[None], 200704, 200704)[0] for i in x])
    assert tuple(batch["image_grid_thw"][0].tolist()) == (1, 30, 38)  # 60 x 76 -> 420 x 532 (aspect kept, ~200,704 px)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        hidden = full.model(input_ids=ids, attention_mask=mask, pixel_values=batch["pixel_values"],
                            image_grid_thw=batch["image_grid_thw"],
                            position_ids=torch.arange(ids.shape[1]).expand(3, ids.shape[0], -1)).last_hidden_state
        at = (ids == reward.token_ids[0]).float().argmax(-1)
        expected = head(hidden[torch.arange(3), at])
    assert torch.allclose(out.scores, expected[:, 0], atol=1e-4), (out.scores, expected)
    assert torch.allclose(out.components["sigma"], expected[:, 1].exp(), atol=1e-4)

    # deterministic, batch-size invariant, and the score reads the image and the prompt (a few characters
    # among ~2,800 instruction tokens move a random tiny model little, but well above float noise)
    assert torch.equal(reward(x, PROMPTS).scores, out.scores)
    reward.batch_size = 1
    assert torch.allclose(reward(x, PROMPTS).scores, out.scores, atol=1e-6)
    assert (reward(images(1), PROMPTS).scores - out.scores).abs().max() > 1e-4
    assert (reward(x, PROMPTS[::-1]).scores - out.scores).abs().max() > 1e-6


def test_hpsv3_weights_errors(base, hps_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    missing = tmp_path / "nowhere" / "HPSv3.safetensors"
    with pytest.raises(UserError) as info:
        build_reward("hpsv3", checkpoint=str(missing), base_model=str(base[0]), device="cpu")
    assert str(missing) in str(info.value) and "\n" not in str(info.value)
    headless = tmp_path / "headless.safetensors"
    save_file({k: v for k, v in load_file(str(hps_checkpoint[0])).items() if not k.startswith("rm_head.")}, str(headless))
    with pytest.raises(UserError, match="does not fit the model") as info:
        build_reward("hpsv3", checkpoint=str(headless), base_model=str(base[0]), device="cpu")
    assert str(headless) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UserError, match="no such folder"):
        build_reward("hpsv3", checkpoint=str(hps_checkpoint[0]), base_model=str(tmp_path / "no_base"), device="cpu")
    with pytest.raises(ConfigError, match="needs option\\(s\\) checkpoint"):
        build_reward("hpsv3")


# --------------------------------------------------------------------------- VideoAlign

STATS = {"VQ_mean": 0.5, "VQ_std": 2.0, "MQ_mean": -0.25, "MQ_std": 0.5, "TA_mean": 0.1, "TA_std": 1.5}


@pytest.fixture(scope="module")
def videoalign(base, tmp_path_factory):
    """A VideoReward folder (model_config.json, checkpoint-N/model.pth in PEFT's 4.45 layout) and the PEFT model."""
    from peft import LoraConfig, get_peft_model

    from flowgrpo.rewards.qwen_vl import QwenVLRewardModel

    d, tok = base
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        inner = QwenVLRewardModel(tiny_config(tok, 3), torch.nn.Linear(HIDDEN, 1, bias=False))
        targets = [n for n, m in inner.named_modules() if isinstance(m, torch.nn.Linear) and ".language_model." in n]
        peft = get_peft_model(inner, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)).eval()
        lm_head = torch.randn(len(tok) + 3, HIDDEN)
    sd = {}
    for key, value in peft.state_dict().items():
        key = key.replace("base_model.model.model.language_model.", "base_model.model.model.")
        sd[key.replace("base_model.model.model.visual.", "base_model.model.visual.")] = value.clone()
    sd["base_model.model.lm_head.weight"] = lm_head
    ckpt = tmp_path_factory.mktemp("VideoReward")
    (ckpt / "checkpoint-3").mkdir()  # an older step without weights: the latest is read
    (ckpt / "checkpoint-12").mkdir()
    torch.save(sd, ckpt / "checkpoint-12" / "model.pth")
    (ckpt / "model_config.json").write_text(json.dumps({
        "data_config": {"max_frame_pixels": 56 * 56, "fps": 2.0, "num_frames": None, "eval_dim": ["VQ", "MQ", "TA"],
                        "prompt_template_type": "detailed_special", "sample_type": "uniform"},
        "model_config": {"model_name_or_path": str(d), "output_dim": 1, "use_special_tokens": True, "reward_token": "special"},
        "peft_lora_config": {"lora_enable": True, "lora_r": 4, "lora_alpha": 8, "use_rslora": False},
        "inference_config": STATS}))
    return ckpt, peft


def videos(seed: int, n: int = 3, frames: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, frames, 3, 64, 80, generator=g)


def test_videoalign_sampling_follows_the_reference():
    from flowgrpo.rewards.videoalign import sample_frames

    assert sample_frames(12, 16.0, 2.0, None) == [0, 4, 7, 11]  # 1.5 frames at 2 fps -> the minimum 4
    assert sample_frames(81, 16.0, 2.0, None) == torch.linspace(0, 80, 10).round().long().tolist()  # 10.1 -> 10
    assert sample_frames(81, 16.0, None, 7) == torch.linspace(0, 80, 8).round().long().tolist()  # num_frames, even
    assert sample_frames(3, 16.0, 2.0, None) == [0, 2]  # never more than the video: 2
    with pytest.raises(ValueError, match="at least 2 frames"):
        sample_frames(1, 16.0, 2.0, None)


def test_videoalign_matches_the_peft_model(videoalign):
    ckpt, peft = videoalign
    reward = build_reward("videoalign", checkpoint=str(ckpt), device="cpu", batch_size=2)
    assert reward.takes_videos
    v = videos(0)
    out = reward(v, PROMPTS)
    assert out.scores.shape == (3,) and set(out.components) == {"VQ", "MQ", "TA"}
    parts = out.components
    assert torch.allclose(out.scores, parts["VQ"] + parts["MQ"] + parts["TA"])

    from flowgrpo.rewards.qwen_vl import encode

    clips = [reward.frames(x) for x in v]
    assert tuple(clips[0].shape) == (4, 3, 28, 56)  # 12 frames at 16 fps -> 4; 64 x 80 within 56 x 56 px
    batch = encode(reward.processor, reward.texts(PROMPTS), torch.device("cpu"), videos=clips)
    with torch.no_grad():
        raw = peft(reward.token_ids, **batch)[..., 0]  # [3, 3]: VQ, MQ, TA before normalisation
    for j, dim in enumerate(("VQ", "MQ", "TA")):
        expected = (raw[:, j] - STATS[f"{dim}_mean"]) / STATS[f"{dim}_std"]
        assert torch.allclose(parts[dim], expected, atol=1e-4), (dim, parts[dim], expected)

    # the option picks one output, normalisation can be switched off, videos as a list work
    vq = build_reward("videoalign", checkpoint=str(ckpt), dimension="VQ", normalize=False, device="cpu")
    single = vq(list(v), PROMPTS)
    assert torch.allclose(single.scores, raw[:, 0], atol=1e-4)
    assert torch.equal(vq(v, PROMPTS).scores, single.scores)
    assert (vq(videos(1), PROMPTS).scores - single.scores).abs().max() > 1e-4
    # the prompt comes after <|VQ_reward|> and <|MQ_reward|> in the instruction: with causal attention only
    # TA reads it (a property of VideoAlign's template)
    swapped = vq(v, PROMPTS[::-1])
    assert torch.equal(swapped.scores, single.scores) and torch.equal(swapped.components["MQ"], single.components["MQ"])
    assert (swapped.components["TA"] - single.components["TA"]).abs().max() > 1e-6
    with pytest.raises(ValueError, match="scores videos"):
        vq(v[:, 0], PROMPTS)


def test_videoalign_weights_errors(videoalign, tmp_path):
    ckpt, _ = videoalign
    with pytest.raises(UserError, match="no such folder") as info:
        build_reward("videoalign", checkpoint=str(tmp_path / "VideoReward"), device="cpu")
    assert str(tmp_path / "VideoReward") in str(info.value)
    empty = tmp_path / "empty"
    (empty / "checkpoint-5").mkdir(parents=True)
    (empty / "model_config.json").write_text((ckpt / "model_config.json").read_text())
    with pytest.raises(UserError, match="no model.pth") as info:
        build_reward("videoalign", checkpoint=str(empty), device="cpu")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="dimension must be one of"):
        build_reward("videoalign", checkpoint=str(ckpt), dimension="XQ")


def test_bfloat16_path(base, hps_checkpoint, videoalign):
    """dtype=bfloat16 (what "auto" picks on CUDA) runs end to end and stays near the float32 scores."""
    hps = {d: build_reward("hpsv3", checkpoint=str(hps_checkpoint[0]), base_model=str(base[0]), device="cpu", dtype=d)
           for d in ("bfloat16", "float32")}
    x = images(2)
    low, full = (hps[d](x, PROMPTS) for d in ("bfloat16", "float32"))
    assert low.scores.dtype == torch.float32 and hps["bfloat16"].model.rm_head[0].weight.dtype == torch.float32
    assert torch.allclose(low.scores, full.scores, atol=0.05) and torch.isfinite(low.components["sigma"]).all()
    va = {d: build_reward("videoalign", checkpoint=str(videoalign[0]), device="cpu", dtype=d) for d in ("bfloat16", "float32")}
    v = videos(3, n=2)
    low, full = (va[d](v, PROMPTS[:2]) for d in ("bfloat16", "float32"))
    assert va["bfloat16"].model.rm_head.weight.dtype == torch.bfloat16  # the authors' head runs in the model dtype
    assert torch.allclose(low.scores, full.scores, atol=0.1)
