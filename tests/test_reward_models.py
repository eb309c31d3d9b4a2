"""Reward models on tiny random models built offline: HPS v2, PickScore, CLIPScore, LAION aesthetic.

Each reward is built through the same loading path a user calls with real weights (an open_clip
architecture + a checkpoint file, a transformers folder, a head file), and its scores are compared
with an INDEPENDENT computation of the authors' formula: the test loads the same weights itself,
preprocesses with the libraries' own transforms on PIL images (open_clip's ``image_transform``, the
transformers processor; HPS: the hpsv2 eval transform rebuilt from torchvision ops) and computes the
cosine / logit-scaled cosine / MLP output by hand.

Nothing downloads: conftest sets HF_HUB_OFFLINE=1 and every model, processor and head is a local
path written into a temp folder. The input images are multiples of 1/255, so the PIL path sees the
same pixels as the tensor path.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowgrpo.errors import ConfigError, UserError
from flowgrpo.rewards.video import score_frames
from flowgrpo.rewards import build_reward
from flowgrpo.rewards.clip_common import CLIP_MEAN, CLIP_STD, to_pil

open_clip = pytest.importorskip("open_clip")
transformers = pytest.importorskip("transformers")

TINY = "flowgrpo-tiny-clip"  # an open_clip architecture registered from a JSON config below
EMBED = 24
PROMPTS = ["a red cube on a wooden table", "two dogs playing in the snow", "an astronaut riding a horse",
           "a bowl of fruit, oil painting"]
EXACT = 1e-5
# The tensor path resizes float pixels with torch's antialiased bicubic; the libraries resize uint8
# images (PIL's fixed-point bicubic, or torchvision's on uint8 in transformers 5) and round the result
# to uint8. Both are Keys a=-0.5 kernels with the same support, so pixels agree to about one uint8
# level (rounding 0.5 + kernel arithmetic); after normalisation by the smallest CLIP std that is at
# most 2/255/0.2613 = 0.030.
PIXEL_TOL = 2 / 255 / min(CLIP_STD)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """4 non-square images [4, 3, 240, 304] on the uint8 grid (304 -> a 283 px long side after the
    resize: an odd crop margin, where torchvision's round(d/2) and transformers' d//2 differ)."""
    g = torch.Generator().manual_seed(0)
    low = torch.rand(4, 3, 30, 38, generator=g)  # smooth content, like a decoded image
    x = F.interpolate(low, size=(240, 304), mode="bilinear", align_corners=False)
    x = (x + 0.05 * torch.rand(x.shape, generator=g)).clamp(0, 1)
    return (x * 255).round() / 255


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A registered tiny open_clip config, its random weights saved twice: under a "state_dict"
    key (as the HPS checkpoints) and as a plain state dict."""
    d = tmp_path_factory.mktemp("tiny_open_clip")
    cfg = {"embed_dim": EMBED,
           "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    (d / f"{TINY}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(d)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = open_clip.create_model(TINY, pretrained=None)
    torch.save({"state_dict": model.state_dict(), "epoch": 1}, d / "HPS_tiny.pt")
    torch.save(model.state_dict(), d / "clip_tiny.pt")
    return d


def reference_open_clip(path):
    """The tiny open_clip model loaded independently of the rewards' loader."""
    model = open_clip.create_model(TINY, pretrained=None)
    sd = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(sd.get("state_dict", sd))
    return model.eval()


def open_clip_features(model, pixels, prompts):
    """L2-normalised (image [B, D], text [B, D]) from the model's forward, the authors' call."""
    out = model(pixels, open_clip.get_tokenizer(TINY)(prompts))
    if isinstance(out, dict):
        return out["image_features"], out["text_features"]
    return out[0], out[1]


def open_clip_val_pixels(pils):
    """open_clip's own eval transform (resize shorter side bicubic, centre crop, CLIP mean/std) on PIL."""
    transform = open_clip.image_transform(224, is_train=False)
    return torch.stack([transform(p) for p in pils])


def outputs_both_ways(reward, images):
    """(output with ``preprocess="pil"``, output with ``preprocess="tensor"``); leaves the reward on "tensor"."""
    reward.preprocess = "pil"
    pil_out = reward(images, PROMPTS)
    reward.preprocess = "tensor"
    return pil_out, reward(images, PROMPTS)


def max_diff(a, b) -> float:
    return float((torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max())


# --------------------------------------------------------------------------- HPS v2


def hps_authors_pixels(pils):
    """hpsv2's eval transform (``light_augmentation=True``: ResizeMaxSize): ToTensor, resize the longer
    side to 224 (bicubic, on the tensor), zero-pad to 224 x 224, normalise."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    out = []
    for p in pils:
        t = TF.to_tensor(p)
        h, w = t.shape[-2:]
        scale = 224 / float(max(h, w))
        new = [round(h * scale), round(w * scale)]
        t = TF.resize(t, new, interpolation=InterpolationMode.BICUBIC, antialias=True)
        ph, pw = 224 - new[0], 224 - new[1]
        t = TF.pad(t, [pw // 2, ph // 2, pw - pw // 2, ph - ph // 2], fill=0)
        out.append(TF.normalize(t, CLIP_MEAN, CLIP_STD))
    return torch.stack(out)


def test_hps_matches_the_authors_formula(tiny_clip, images):
    ckpt = tiny_clip / "HPS_tiny.pt"
    reward = build_reward("hpsv2", checkpoint=str(ckpt), model_name=TINY, device="cpu", batch_size=4)
    out = reward(images, PROMPTS)
    assert out.scores.dtype == torch.float32 and out.scores.shape == (4,)

    ref = reference_open_clip(ckpt)
    pixels = hps_authors_pixels(to_pil(images))
    with torch.no_grad():
        img, txt = open_clip_features(ref, pixels, PROMPTS)
        expected = torch.diagonal(img @ txt.T)  # hpsv2.score: no logit scale
        from_pixels = reward.score_pixels(pixels, PROMPTS)["score"]
    print(f"hpsv2 max|reward - authors| = {max_diff(out.scores, expected):.2e}")
    assert max_diff(reward.tensor_pixels(images), pixels) <= EXACT  # the same resize + pad
    assert max_diff(from_pixels, expected) <= EXACT  # features -> score
    assert max_diff(out.scores, expected) <= EXACT  # end to end
    assert float(out.scores.abs().max()) <= 1.0 + 1e-6  # a cosine

    reward.batch_size = 1
    assert max_diff(reward(images, PROMPTS).scores, out.scores) <= 1e-6


def test_hps_bad_checkpoints_are_user_errors(tiny_clip, tmp_path):
    missing = tmp_path / "nowhere" / "HPS_v2.1_compressed.pt"
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint")
    wrong = tmp_path / "wrong.pt"
    torch.save({"layers.0.weight": torch.zeros(2, 2)}, wrong)
    for path in (missing, junk, wrong):
        with pytest.raises(UserError) as info:
            build_reward("hpsv2", checkpoint=str(path), model_name=TINY, device="cpu")
        message = str(info.value)
        assert str(path) in message and "\n" not in message, message
    with pytest.raises(ConfigError, match="needs option\\(s\\) checkpoint"):
        build_reward("hpsv2", model_name=TINY)
    with pytest.raises(ConfigError, match="unknown option\\(s\\) colour for reward 'hpsv2'"):
        build_reward("hpsv2", checkpoint="x.pt", colour=1)


# --------------------------------------------------------------------------- PickScore


@pytest.fixture(scope="module")
def tiny_pickscore(tmp_path_factory):
    """A tiny transformers CLIPModel and a CLIPProcessor (offline BPE tokenizer) saved to folders."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from flowgrpo.policies.tiny.sd3 import tiny_clip_tokenizer

    d = tmp_path_factory.mktemp("tiny_pickscore")
    tok = tiny_clip_tokenizer(num_merges=500, max_length=77)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=224, patch_size=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=EMBED))
    model.save_pretrained(d / "model")
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tok).save_pretrained(d / "processor")
    return d


def test_pickscore_matches_the_authors_formula(tiny_pickscore, images):
    from transformers import AutoProcessor, CLIPModel

    model_dir, proc_dir = str(tiny_pickscore / "model"), str(tiny_pickscore / "processor")
    reward = build_reward("pickscore", model=model_dir, processor=proc_dir, device="cpu", batch_size=4)

    # the authors' computation: the processor on PIL images, the model's own logit-scaled similarity
    processor, model = AutoProcessor.from_pretrained(proc_dir), CLIPModel.from_pretrained(model_dir).eval()
    inputs = processor(images=to_pil(images), text=PROMPTS, padding=True, truncation=True, max_length=77,
                       return_tensors="pt")
    with torch.no_grad():
        expected = torch.diagonal(model(**inputs).logits_per_image)  # logit_scale.exp() * cosine
        from_pixels = reward.score_pixels(inputs["pixel_values"], PROMPTS)
        tensor_pixels = reward.tensor_pixels(images)
    pil_out, tensor_out = outputs_both_ways(reward, images)
    print(f"pickscore max|pil - authors| = {max_diff(pil_out.scores, expected):.2e}, "
          f"max|tensor - authors| = {max_diff(tensor_out.scores, expected):.2e}, "
          f"max|tensor pixels - processor pixels| = {max_diff(tensor_pixels, inputs['pixel_values']):.2e}")
    assert max_diff(from_pixels["score"], expected) <= EXACT  # features -> score
    assert max_diff(pil_out.scores, expected) <= EXACT  # end to end with the processor
    assert max_diff(tensor_pixels, inputs["pixel_values"]) <= PIXEL_TOL  # the tensor preprocessing
    scale = float(model.logit_scale.detach().exp())
    torch.testing.assert_close(tensor_out.scores, scale * tensor_out.components["cosine"])
    # end to end through the tensor path: pixels within PIXEL_TOL move the cosine by ~3e-4 here
    assert max_diff(tensor_out.scores / scale, expected / scale) <= 2e-3

    reward.preprocess, reward.batch_size = "tensor", 1
    assert max_diff(reward(images, PROMPTS).scores, tensor_out.scores) <= 1e-5


def test_pickscore_missing_folder_is_a_user_error(tmp_path, tiny_pickscore):
    missing = tmp_path / "PickScore_v1"
    with pytest.raises(UserError) as info:
        build_reward("pickscore", model=str(missing), processor=str(tiny_pickscore / "processor"), device="cpu")
    assert str(missing) in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- CLIPScore


@pytest.mark.parametrize("formula,prefix", [("cosine", None), ("clipscore", None), ("clipscore", "")])
def test_clipscore_matches_the_formula(tiny_clip, images, formula, prefix):
    ckpt = tiny_clip / "clip_tiny.pt"
    reward = build_reward("clipscore", model_name=TINY, pretrained=str(ckpt), device="cpu", batch_size=4,
                          formula=formula, scale=1.5, preprocess="pil", prefix=prefix)
    ref = reference_open_clip(ckpt)
    paper = formula == "clipscore" and prefix is None  # the paper's "A photo depicts " prefix by default
    prompts = [("A photo depicts " if paper else "") + p for p in PROMPTS]
    pixels = open_clip_val_pixels(to_pil(images))
    with torch.no_grad():
        img, txt = open_clip_features(ref, pixels, prompts)
        cos = F.cosine_similarity(img, txt, dim=-1)
        expected = 1.5 * (2.5 * cos.clamp(min=0) if formula == "clipscore" else cos)
        from_pixels = reward.score_pixels(pixels, PROMPTS)["score"]
        tensor_pixels = reward.tensor_pixels(images)
    pil_out, tensor_out = outputs_both_ways(reward, images)
    print(f"clipscore[{formula}] max|pil - ref| = {max_diff(pil_out.scores, expected):.2e}, "
          f"max|tensor - ref| = {max_diff(tensor_out.scores, expected):.2e}, "
          f"max|tensor pixels - open_clip pixels| = {max_diff(tensor_pixels, pixels):.2e}")
    assert max_diff(from_pixels, expected) <= EXACT
    assert max_diff(pil_out.scores, expected) <= EXACT
    assert max_diff(pil_out.components["cosine"], cos) <= EXACT
    assert max_diff(tensor_pixels, pixels) <= PIXEL_TOL
    assert max_diff(tensor_out.components["cosine"], cos) <= 2e-3  # pixels within PIXEL_TOL: ~2e-4 here
    if formula == "clipscore" and not paper:  # (this tiny model gives mixed signs here) max(cos, 0)
        assert bool((expected == 0).any()) and bool((expected > 0).any())

    reward.batch_size = 3  # uneven chunks
    assert max_diff(reward(images, PROMPTS).scores, tensor_out.scores) <= 1e-6


def test_clipscore_bad_pretrained_is_a_user_error(tmp_path):
    missing = tmp_path / "ViT-L-14.pt"
    with pytest.raises(UserError) as info:
        build_reward("clipscore", model_name=TINY, pretrained=str(missing), device="cpu")
    assert str(missing) in str(info.value)
    with pytest.raises(ConfigError, match="formula must be one of cosine, clipscore"):
        build_reward("clipscore", model_name=TINY, pretrained=str(missing), formula="cos")


# --------------------------------------------------------------------------- LAION aesthetic


def aesthetic_mlp(width: int) -> torch.nn.Sequential:
    """The improved-aesthetic-predictor MLP, written out independently."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))


@pytest.fixture(scope="module")
def aesthetic_head(tmp_path_factory):
    path = tmp_path_factory.mktemp("aesthetic") / "sac+logos+ava1-l14-linearMSE.pth"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        mlp = aesthetic_mlp(EMBED)
    torch.save({f"layers.{k}": v for k, v in mlp.state_dict().items()}, path)
    return path


def test_aesthetic_matches_the_predictor(tiny_clip, aesthetic_head, images):
    ckpt = tiny_clip / "clip_tiny.pt"
    reward = build_reward("aesthetic", head=str(aesthetic_head), clip_model=TINY, clip_pretrained=str(ckpt),
                          device="cpu", batch_size=4, preprocess="pil")
    ref = reference_open_clip(ckpt)
    mlp = aesthetic_mlp(EMBED)
    sd = torch.load(aesthetic_head, weights_only=True)
    mlp.load_state_dict({k[len("layers."):]: v for k, v in sd.items()})
    mlp.eval()
    pixels = open_clip_val_pixels(to_pil(images))
    with torch.no_grad():
        emb = ref.encode_image(pixels).numpy()
        emb = emb / np.linalg.norm(emb, axis=-1, keepdims=True)  # the authors' numpy normalisation
        expected = mlp(torch.from_numpy(emb).float()).squeeze(-1)
        from_pixels = reward.score_pixels(pixels, PROMPTS)["score"]
    pil_out, tensor_out = outputs_both_ways(reward, images)
    print(f"aesthetic max|pil - ref| = {max_diff(pil_out.scores, expected):.2e}, "
          f"max|tensor - ref| = {max_diff(tensor_out.scores, expected):.2e}")
    assert max_diff(from_pixels, expected) <= EXACT
    assert max_diff(pil_out.scores, expected) <= EXACT
    assert max_diff(tensor_out.scores, expected) <= 1e-3  # pixels within PIXEL_TOL: ~5e-6 here
    reward.batch_size = 1
    assert max_diff(reward(images, PROMPTS).scores, tensor_out.scores) <= 1e-6


def test_aesthetic_bad_heads_are_user_errors(tiny_clip, tmp_path):
    ckpt = str(tiny_clip / "clip_tiny.pt")
    missing = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    with pytest.raises(UserError, match="no such file"):
        build_reward("aesthetic", head=str(missing), clip_model=TINY, clip_pretrained=ckpt, device="cpu")
    wide = tmp_path / "head768.pth"
    torch.save({f"layers.{k}": v for k, v in aesthetic_mlp(768).state_dict().items()}, wide)
    with pytest.raises(UserError, match="takes 768-d embeddings"):
        build_reward("aesthetic", head=str(wide), clip_model=TINY, clip_pretrained=ckpt, device="cpu")
    with pytest.raises(ConfigError, match="needs option\\(s\\) head"):
        build_reward("aesthetic")


# --------------------------------------------------------------------------- videos and the registry


def test_frame_wise_scores_the_mean_of_every_stride_th_frame(tiny_clip):
    reward = build_reward("clipscore", model_name=TINY, pretrained=str(tiny_clip / "clip_tiny.pt"), device="cpu")
    g = torch.Generator().manual_seed(3)
    video = torch.rand(2, 5, 3, 64, 80, generator=g)
    prompts = PROMPTS[:2]
    out = score_frames(reward, video, prompts, stride=2)
    frames = [reward(video[:, f], prompts) for f in (0, 2, 4)]
    expected = torch.stack([f.scores for f in frames]).mean(0)
    assert out.scores.shape == (2,) and max_diff(out.scores, expected) <= 1e-6
    cos = torch.stack([f.components["cosine"] for f in frames]).mean(0)
    assert max_diff(out.components["cosine"], cos) <= 1e-6
    # images pass through unchanged
    single = score_frames(reward, video[:, 1], prompts, stride=2)
    assert max_diff(single.scores, reward(video[:, 1], prompts).scores) == 0.0
    with pytest.raises(ValueError, match="frame stride must be an integer >= 1"):
        score_frames(reward, video, prompts, stride=0)


def test_reward_modules_import_without_heavy_libraries():
    code = ("import sys, flowgrpo.rewards.hps, flowgrpo.rewards.pickscore, flowgrpo.rewards.clipscore, "
            "flowgrpo.rewards.aesthetic, flowgrpo.rewards.video, flowgrpo.rewards.imagereward, "
            "flowgrpo.rewards.hpsv3, flowgrpo.rewards.videoalign, flowgrpo.rewards.temporal; "
            "print(sorted(m for m in ('open_clip', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
