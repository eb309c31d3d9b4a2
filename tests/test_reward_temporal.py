"""temporal_consistency (VBench's subject consistency) on a tiny random DINO-style ViT built offline.

The score is recomputed as VBench's loop does it, frame by frame with torchvision's ``Resize(size,
antialias=False)`` and ``Normalize``, the ViT's [CLS] output, and the max(0, cos) to the previous and the
first frame. A static video scores 1, the same frames in order score above the same frames shuffled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowgrpo.errors import ConfigError, UserError
from flowgrpo.rewards import build_reward
from flowgrpo.rewards.temporal import IMAGENET_MEAN, IMAGENET_STD

transformers = pytest.importorskip("transformers")
tv = pytest.importorskip("torchvision")

SIZE = 32


@pytest.fixture(scope="module")
def dino(tmp_path_factory):
    from transformers import ViTConfig, ViTModel

    d = tmp_path_factory.mktemp("tiny_dino")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   image_size=SIZE, patch_size=8), add_pooling_layer=False)
    model.save_pretrained(d)
    return d, model.eval()


def moving_video(frames: int = 8, seed: int = 0) -> torch.Tensor:
    """A bright square drifting over a smooth background: [frames, 3, 40, 56] in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    background = F.interpolate(torch.rand(1, 3, 5, 7, generator=g), size=(40, 56), mode="bilinear")[0]
    out = []
    for t in range(frames):
        f = background.clone()
        f[:, 10:24, 4 + 5 * t:18 + 5 * t] = torch.tensor([1.0, 0.9, 0.2]).view(3, 1, 1)
        out.append(f)
    return torch.stack(out)


def vbench_score(model, video):
    from torchvision import transforms as T

    transform = T.Compose([T.Resize(size=SIZE, antialias=False), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    total, former, first = 0.0, None, None
    for i, frame in enumerate(video):
        with torch.no_grad():
            f = model(pixel_values=transform(frame)[None], interpolate_pos_encoding=True).last_hidden_state[:, 0]
        f = F.normalize(f, dim=-1, p=2)
        if i == 0:
            first = f
        else:
            total += (max(0.0, F.cosine_similarity(former, f).item()) + max(0.0, F.cosine_similarity(first, f).item())) / 2
        former = f
    return total / (len(video) - 1)


def test_temporal_consistency_is_vbench_subject_consistency(dino):
    path, model = dino
    reward = build_reward("temporal_consistency", model=str(path), size=SIZE, device="cpu", batch_size=3)
    assert reward.takes_videos
    ordered = moving_video()
    shuffled = ordered[torch.tensor([0, 5, 2, 7, 1, 6, 3, 4])]
    static = ordered[:1].expand(8, -1, -1, -1)
    out = reward(torch.stack([ordered, shuffled, static]), ["a square"] * 3)
    assert out.scores.shape == (3,) and set(out.components) == {"adjacent", "first_frame"}
    for got, video in zip(out.scores, (ordered, shuffled)):
        assert abs(float(got) - vbench_score(model, video)) < 1e-5
    assert abs(float(out.scores[2]) - 1.0) < 1e-5  # a static video
    assert out.scores[2] > out.scores[0] > out.scores[1]  # static > in order > shuffled
    assert torch.allclose(out.scores, (out.components["adjacent"] + out.components["first_frame"]) / 2)
    assert torch.equal(reward(list(torch.stack([ordered, shuffled, static])), ["x"] * 3).scores, out.scores)
    with pytest.raises(ValueError, match="scores videos"):
        reward(ordered, ["x"] * 8)  # images, not videos
    with pytest.raises(ValueError, match="at least 2 frames"):
        reward(ordered[None, :1], ["x"])


def test_temporal_consistency_weights_errors(tmp_path):
    missing = tmp_path / "dino-vitb16"
    with pytest.raises(UserError, match="no such folder") as info:
        build_reward("temporal_consistency", model=str(missing), device="cpu")
    assert str(missing) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="size must be an integer >= 1"):
        build_reward("temporal_consistency", model=str(missing), size=0)
