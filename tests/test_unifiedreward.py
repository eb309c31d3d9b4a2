"""UnifiedReward through the judge client, against a fake OpenAI-compatible server on loopback.

The fake server checks that each request is UnifiedReward's: one user message, the image as a PNG data
URL first, then UnifiedReward's question with the prompt in ``Text Caption: [...]``. It answers like the
model, key elements then ``Final Score: N`` with N = 1 + round(4 x mean brightness), so the reward must
be N / 5. Prompts containing "noscore" get an answer without a final score (dropped after retries: NaN).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import base64  # noqa: E402
import io  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

pytest.importorskip("httpx")
fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from flowgrpo.rewards import build_reward  # noqa: E402
from flowgrpo.rewards.judge import UNIFIEDREWARD_TEMPLATE, parse_final_score  # noqa: E402
from test_judges import on_loopback  # noqa: E402  (pytest puts tests/ on sys.path)


@pytest.fixture(scope="module")
def server():
    app = fastapi.FastAPI()
    seen: list[dict] = []

    @app.post("/v1/chat/completions")
    async def chat(request: fastapi.Request):
        body = await request.json()
        seen.append(body)
        (message,) = body["messages"]
        image, text = message["content"]
        assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
        png = base64.b64decode(image["image_url"]["url"].split(",", 1)[1])
        level = float(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).mean()) / 255
        prompt = text["text"].split("Text Caption: [", 1)[1][:-1]
        assert text["text"] == UNIFIEDREWARD_TEMPLATE.replace("{prompt}", prompt)
        answer = "cube (object): 1\nred (attribute): 0\n"
        if "noscore" not in prompt:
            answer += f"Final Score: {1 + round(4 * level)}"
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}

    with on_loopback(app) as base_url:
        yield base_url, seen


def test_final_score_reading():
    assert parse_final_score("a (object): 1\nFinal Score: 4") == 0.8
    assert parse_final_score("Final Score: 2\n...\nFinal Score: 5") == 1.0  # the last one
    assert parse_final_score("Final Score: 3.5") == 0.6  # the repository reads the first run of digits
    assert parse_final_score("Final Score: 7") is None and parse_final_score("Final Score: none") is None
    assert parse_final_score("value=1, so 4") is None  # no "Final Score:" at all


def test_unifiedreward_scores_and_drops(server):
    base_url, seen = server
    reward = build_reward("unifiedreward", model="UnifiedReward", base_url=base_url, retries=1, backoff=0.0)
    levels = torch.tensor([0.0, 0.3, 0.62, 1.0])
    images = levels.view(-1, 1, 1, 1).expand(-1, 3, 8, 8).contiguous()
    prompts = ["a red cube", "two dogs", "a cat {sleeping}", "noscore please"]
    out = reward(images, prompts)
    expected = torch.tensor([1 + round(4 * float(x)) for x in (0.0, 0.3, round(0.62 * 255) / 255)] + [float("nan")]) / 5
    assert torch.allclose(out.scores[:3], expected[:3]) and torch.isnan(out.scores[3])
    assert out.components["judge_failed"].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert all(body["model"] == "UnifiedReward" and body["temperature"] == 0.0 for body in seen)
    again = reward(images[:3], prompts[:3])  # cached: no new requests
    assert torch.equal(again.scores, out.scores[:3]) and reward.core.stats["cache_hits"] == 3
    reward.close()
