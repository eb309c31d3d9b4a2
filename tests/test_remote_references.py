"""Image editing over the reward server's wire format: each image's reference image travels with it
("references", base64 PNG), the server scores an edit reward with them at the images' size, and a
request that lacks them (or sends them to a reward that takes none) is a one-line 422."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.errors import UserError
from flowgrpo.rewards import build_reward
from flowgrpo.serve import ServerThread, create_app
from flowgrpo.serve.codec import RequestError, max_json_values, parse_score_request


def quantized(t: torch.Tensor) -> torch.Tensor:
    return (t * 255).round() / 255  # what a PNG keeps


def test_remote_edit_reward_gets_the_references_and_matches_in_process():
    g = torch.Generator().manual_seed(0)
    images = quantized(torch.rand(6, 3, 32, 32, generator=g))
    refs = quantized(torch.rand(6, 3, 32, 32, generator=g))
    refs[:3] = images[:3]  # three unchanged edits: a perfect pixel score
    prompts = [f"edit {i // 2}" for i in range(6)]
    groups = torch.arange(6) // 2
    reward = build_reward("edit_consistency")
    expected = reward(images, prompts, groups, references=refs)
    with ServerThread(create_app(reward, max_batch=4)) as srv:
        remote = build_reward("remote", url=srv.url, batch_size=4, references=True)
        assert remote.wants_references
        out = remote(images, prompts, groups, references=refs)
        torch.testing.assert_close(out.scores, expected.scores, rtol=0, atol=1e-6)
        assert out.scores[:3].min() > out.scores[3:].max()  # the references really reached the reward
        # references at another size are resized to the image's on the server, as the trainer does
        from flowgrpo.references import resize_references

        big = quantized(torch.rand(6, 3, 48, 40, generator=g))
        want = reward(images, prompts, groups, references=resize_references(big, 32, 32))
        got = remote(images, prompts, groups, references=big)
        torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=2e-3)  # resized before / after 8 bits
        # without references: one line naming the field
        plain = build_reward("remote", url=srv.url, retries=0)
        with pytest.raises(UserError) as exc:
            plain(images, prompts, groups)
        assert "422" in str(exc.value) and "'references'" in str(exc.value) and "\n" not in str(exc.value)
    with ServerThread(create_app(build_reward("jpeg_compressibility"))) as srv:
        remote = build_reward("remote", url=srv.url, retries=0, references=True)
        with pytest.raises(UserError, match="takes no reference images"):
            remote(images, prompts, groups, references=refs)


def test_the_codec_checks_references():
    body = b'{"prompts": ["a", "b"], "images": ["x", "y"], "references": ["x"]}'
    with pytest.raises(RequestError, match="1 references but 2 images"):
        parse_score_request(body, 8, wants_references=True)
    with pytest.raises(RequestError, match="list of base64 strings"):
        parse_score_request(b'{"prompts": ["a"], "images": ["x"], "references": [1]}', 8, wants_references=True)
    req = parse_score_request(b'{"prompts": ["a"], "images": ["x"], "references": ["r"]}', 8, wants_references=True)
    assert req.references == ["r"]
    assert max_json_values(256) == 3 * 256 + 16 and max_json_values(256, True) == 4 * 256 + 16
