"""VLM judges against a fake OpenAI-compatible server on loopback: retries, drops, caching, win rates.

The fake server decodes the data-URL images and answers deterministically: in a pairwise question
the brighter image wins, a pointwise rating is 10 x the mean brightness. Which pairwise requests
misbehave is decided by a hash of the request content, so a retry of the same request meets the
same fate: some are malformed or too slow forever (their queries must be dropped), others only on
the first attempt (the retry must rescue them).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import asyncio
import base64
import contextlib
import hashlib
import io
import logging
import socket
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("httpx")
fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from flowgrpo.errors import ConfigError  # noqa: E402
from flowgrpo.rewards import build_reward  # noqa: E402
from flowgrpo.rewards.judge import parse_pairwise, parse_score_0_10, parse_yes_no  # noqa: E402
from flowgrpo.rewards.openai_client import JudgeEndpointError  # noqa: E402

torch.set_num_threads(1)

TIMEOUT = 1.0  # client seconds per attempt (roomy for a busy 2-core machine); slow answers take SLOW
SLOW = 3.0
PAIR_TEMPLATE = 'Prompt: "{prompt}". Which image is brighter? Answer "Image 1 is better" or "Image 2 is better".'
MALFORMED = ["<think>both look fine</think><answer>I cannot tell</answer>",
             "Image 1 is better. Actually, Image 2 is better.",
             "<think>let me count the pixels one by one, starting from the top left corner"]
# fate of a pairwise request by hash bucket (of 100): ~10 % malformed, ~5 % slow, half of each forever
FATES = [(5, "bad"), (10, "bad_once"), (13, "slow"), (15, "slow_once"), (100, "ok")]
PERMANENT = {"bad", "slow"}


def _level(url: str) -> int:
    png = base64.b64decode(url.split(",", 1)[1])
    return int(round(float(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).mean())))


class FakeJudge:
    """The server's state: hits per request key and the fate of every pairwise question."""

    def __init__(self):
        self.attempts: dict[str, int] = {}
        self.fate: dict[tuple[int, int], str] = {}  # (level of image 1, level of image 2) -> fate
        self.auth: list = []
        self.hits = 0

    async def answer(self, body: dict, auth):
        content = body["messages"][-1]["content"]
        text = "".join(p["text"] for p in content if p["type"] == "text")
        levels = [_level(p["image_url"]["url"]) for p in content if p["type"] == "image_url"]
        key = f"{text}|{levels}"
        self.hits += 1
        self.auth.append(auth)
        attempt = self.attempts[key] = self.attempts.get(key, 0) + 1
        h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100
        if len(levels) == 2:
            fate = "bad" if "doomed" in text else next(name for bound, name in FATES if h < bound)
            self.fate[tuple(levels)] = fate
            if fate == "bad" or (fate == "bad_once" and attempt == 1):
                return MALFORMED[h % 3]
            if fate == "slow" or (fate == "slow_once" and attempt == 1):
                await asyncio.sleep(SLOW)
            winner = 1 if levels[0] > levels[1] else 2
            return f"<think>Image {winner} has more light.</think>\n<answer>Image {winner} is better</answer>"
        n = round(levels[0] / 255 * 10)
        if "garbage" in text:
            return "I like it. " + "x" * 500
        if "hang" in text:
            await asyncio.sleep(SLOW)
        if ("flaky" in text or "ratelimit" in text) and attempt == 1:
            return 503 if "flaky" in text else 429
        if "yesno" in text:
            return "Yes." if n > 5 else "No, it is too dark."
        if "think" in text:
            return f"<think>Score: 1 would be unfair.</think>\nScore: {n}/10"
        return f"Score: {n}"


@pytest.fixture(scope="module")
def server():
    state = FakeJudge()
    app = fastapi.FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: fastapi.Request):
        out = await state.answer(await request.json(), request.headers.get("authorization"))
        if isinstance(out, int):
            return fastapi.responses.JSONResponse({"error": "busy"}, status_code=out)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": out}}]}

    with on_loopback(app, grace=SLOW + 2) as base_url:
        state.base_url = base_url
        yield state


@contextlib.contextmanager
def on_loopback(app, grace: float = 2.0):
    """Serve the ASGI ``app`` with uvicorn on a free loopback port in a thread; yields its ``/v1`` API root."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    assert srv.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def flat(levels):
    """Constant images [n, 3, 8, 8] at the given 8-bit levels."""
    return torch.tensor(levels, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 3, 8, 8) / 255


def test_parsers():
    assert parse_score_0_10("Score: 7") == 0.7 and parse_score_0_10("**Score:** 10/10") == 1.0
    assert parse_score_0_10("<think>Score: 2?</think> Score: 9") == 0.9 and parse_score_0_10("8") == 0.8
    assert parse_score_0_10("Score: 11") is None and parse_score_0_10("nice") is None
    assert parse_score_0_10("<think>Score: 3 so far") is None  # reasoning cut off by max_tokens
    assert parse_yes_no("Yes.") == 1.0 and parse_yes_no("<answer>no</answer>") == 0.0
    assert parse_yes_no("yes and no") is None
    assert parse_pairwise("<think>...</think><answer>Image 2 is better</answer>") == "b"
    assert parse_pairwise("Image 1 is better") == "a" and parse_pairwise("Answer: Image 2") == "b"
    assert parse_pairwise("tie") == "tie"
    for bad in MALFORMED:
        assert parse_pairwise(bad) is None, bad


def test_pairwise_retries_drops_cache_and_win_rates(server, caplog):
    rng = np.random.default_rng(0)
    levels = rng.permutation(np.arange(20, 240, 2))[:102].tolist()  # distinct: the order is known
    # 20 groups of 5 (200 pairs), and a pair the server never answers properly: both images dropped
    groups = torch.cat([torch.arange(20).repeat_interleave(5), torch.tensor([20, 20])])
    prompts = [f"object {g}" for g in groups.tolist()[:100]] + ["doomed"] * 2
    reward = build_reward("judge_pairwise", base_url=server.base_url, model="fake", template=PAIR_TEMPLATE,
                          timeout=TIMEOUT, retries=2, backoff=0.05, max_concurrency=8)
    hits0 = server.hits
    t0 = time.time()
    with caplog.at_level(logging.WARNING, logger="flowgrpo.rewards.judge"):
        out = reward(flat(levels), prompts, groups)
    elapsed = time.time() - t0
    assert elapsed < 30
    # the fate of every pair, as the server decided it; expected win rates over the judged pairs
    pairs = [(i, j) for g in range(20) for i in range(5 * g, 5 * g + 5) for j in range(i + 1, 5 * g + 5)]
    pairs.append((100, 101))
    fates = [server.fate[(levels[i], levels[j])] for i, j in pairs]
    counts = {name: fates.count(name) for _, name in FATES}
    assert len(pairs) == 201 and all(counts.values()), counts
    wins, judged = np.zeros(102), np.zeros(102)
    for (i, j), fate in zip(pairs, fates):
        if fate not in PERMANENT:
            judged[[i, j]] += 1
            wins[i if levels[i] > levels[j] else j] += 1
    with np.errstate(invalid="ignore"):
        expected = torch.tensor(wins / judged, dtype=torch.float32)  # 0 / 0: NaN, dropped
    torch.testing.assert_close(out.scores, expected, equal_nan=True)
    assert torch.isnan(out.scores).tolist() == [False] * 100 + [True, True]
    dropped = sum(counts[f] for f in PERMANENT)
    # hits: one per fine request, two for a first-attempt failure, 1 + retries for a permanent one
    want_hits = counts["ok"] + 2 * (counts["bad_once"] + counts["slow_once"]) + 3 * dropped
    stats = reward.core.stats
    assert server.hits - hits0 == want_hits == stats["requests"]
    assert stats["retries"] == want_hits - 201 and stats["failed"] == dropped
    assert stats["timeouts"] == 3 * counts["slow"] + counts["slow_once"]
    assert out.components["failed"].sum() == 2 * dropped  # each failed query involves two images
    torch.testing.assert_close(out.components["judge_failed"], torch.isnan(expected).float())
    drops = [r.getMessage() for r in caplog.records if "judge dropped" in r.getMessage()]
    assert len(drops) == dropped and any("I cannot tell" in m for m in drops)
    # the same batch again: judged pairs come from the cache, only the dropped ones are asked again
    hits1 = server.hits
    again = reward(flat(levels), prompts, groups)
    torch.testing.assert_close(again.scores, out.scores, equal_nan=True)
    assert server.hits - hits1 == 3 * dropped
    assert reward.core.stats["cache_hits"] == 201 - dropped
    print(f"\npairwise: {len(pairs)} queries, fates {counts}, {want_hits} requests, {stats['retries']} retries, "
          f"{dropped} dropped queries, {int(torch.isnan(out.scores).sum())} dropped images, {elapsed:.1f} s")
    reward.close()


def test_pairwise_swap_and_duplicates_ask_once(server):
    reward = build_reward("judge_pairwise", base_url=server.base_url, model="fake", template=PAIR_TEMPLATE,
                          timeout=TIMEOUT, retries=2, backoff=0.05, swap=True)
    # images 1 and 2 are copies: both orders of their pair are the same question, sent once
    hits = server.hits
    out = reward(flat([241, 243, 243]), ["twins"] * 3)
    assert [server.fate[k] for k in [(241, 243), (243, 241), (243, 243)]] == ["ok"] * 3
    assert server.hits - hits == 3 == reward.core.stats["requests"]  # 6 queries
    # the server prefers "Image 2" on equal levels: a position bias that swapping cancels
    torch.testing.assert_close(out.scores, torch.tensor([0.0, 0.75, 0.75]))
    assert float(out.components["position_bias"][0]) == pytest.approx(-2 / 6)
    reward.close()


def test_pointwise_scores_retries_and_drops(server, caplog):
    reward = build_reward("judge", base_url=server.base_url, model="fake", timeout=TIMEOUT, retries=2,
                          backoff=0.05, template="Rate this: {prompt}")
    levels = [0, 51, 128, 179, 255, 128, 128, 128, 77]
    prompts = ["plain", "plain", "think", "flaky", "ratelimit", "garbage", "hang", "plain", "think"]
    t0 = time.time()
    with caplog.at_level(logging.WARNING, logger="flowgrpo.rewards.judge"):
        out = reward(flat(levels), prompts)
    assert time.time() - t0 < 15
    want = torch.tensor([0.0, 0.2, 0.5, 0.7, 1.0, float("nan"), float("nan"), 0.5, 0.3])
    torch.testing.assert_close(out.scores, want, equal_nan=True)
    assert out.components["judge_failed"].tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0]
    msg = next(r.getMessage() for r in caplog.records if "garbage" in r.getMessage())
    assert "I like it" in msg and "x" * 150 in msg and "x" * 201 not in msg  # the answer, truncated
    assert reward.core.stats["retries"] == 1 + 1 + 2 + 2  # flaky, ratelimit, garbage x2, hang x2
    # a repeated call from the sync loop: all but the failed ones come from the cache
    hits = server.hits
    again = reward(flat(levels), prompts)
    torch.testing.assert_close(again.scores, want, equal_nan=True)
    assert server.hits - hits == 3 + 3
    reward.close()


def test_yes_no_auth_and_running_event_loop(server, monkeypatch):
    monkeypatch.setenv("FAKE_JUDGE_KEY", "sekret")
    reward = build_reward("judge", base_url=server.base_url, model="fake", parser="yes_no", timeout=TIMEOUT,
                          api_key_env="FAKE_JUDGE_KEY", template="yesno: {prompt}")
    n = len(server.auth)
    out = reward(flat([30, 250]), ["a", "b"])
    assert out.scores.tolist() == [0.0, 1.0] and server.auth[n:] == ["Bearer sekret"] * 2

    async def inside_a_loop():  # e.g. a notebook: the client's own loop thread still works
        return reward(flat([252]), ["c"])

    assert asyncio.run(inside_a_loop()).scores.tolist() == [1.0]
    reward.close()


def test_configuration_errors(server):
    with pytest.raises(ConfigError, match="NO_SUCH_KEY_VAR"):
        build_reward("judge", model="m", api_key_env="NO_SUCH_KEY_VAR")
    with pytest.raises(ConfigError, match="placeholder"):
        build_reward("judge", model="m", template="no placeholder here")
    with pytest.raises(ConfigError, match="parser"):
        build_reward("judge", model="m", parser="stars")
    with pytest.raises(ConfigError, match="model"):
        build_reward("judge_pairwise")
    with pytest.raises(ConfigError, match="unknown option"):
        build_reward("judge_pairwise", model="m", api_key="sk-...")  # keys only via api_key_env
    wrong = build_reward("judge", base_url=server.base_url.replace("/v1", "/nope"), model="m", timeout=TIMEOUT)
    with pytest.raises(JudgeEndpointError, match="404"):
        wrong(flat([10]), ["p"])
    wrong.close()
