"""A deterministic OpenAI-compatible UniGenBench judge on loopback, for tests and benchmarks.

It answers ``POST /v1/chat/completions`` in the official answer format. The prompt and the
checkpoint list are read back from the question's ``<prompt>`` / ``<checkpoint>`` lines; the image
is told apart by its content: ``j`` is read from the mean grey level of the decoded image (the
tests draw image ``j`` of a prompt in flat grey ``level_of(j)``), or, with ``decode_images=False``
(benchmarks), from a hash of the data URL. The verdict of checkpoint ``k`` is ``scores(prompt, j,
testpoints)`` when a rule is given, else ``1`` unless ``(crc32(prompt) + j + k) % 3 == 0``.

``plan[(prompt, j)]`` scripts misbehaviour per attempt, e.g. ``["500", "malformed", "ok"]`` (the
last entry repeats): ``ok``, ``500`` (HTTP 500), ``malformed`` (no tags), ``short`` (a score list one
element short), ``slow`` (sleeps ``slow_seconds`` first). ``service_seconds`` adds a fixed (async)
service time to every answer. ``gate(n)`` lets only the first ``n`` answers out; later requests wait
(until :meth:`open_gate`), and those whose client went away meanwhile are dropped unanswered.

Counters: ``received[(prompt, j)]`` requests seen, ``answered[(prompt, j)]`` answers delivered;
``service`` the handler's own seconds per answered request; ``waiting`` requests held at the gate. ``GET /stats`` returns them as JSON.

Run stand-alone (benchmarks): ``python -m flowgrpo.unigenbench.fake_judge --port P --service-ms 20``.

(No ``from __future__ import annotations`` here: FastAPI reads the handler's annotations at runtime.)
"""

import argparse
import asyncio
import base64
import contextlib
import io
import re
import time
import zlib
from ast import literal_eval
from collections import Counter
from typing import Callable

_PROMPT = re.compile(r"<prompt>(.*?)</prompt>", re.DOTALL)
_CHECKPOINTS = re.compile(r"<checkpoint>(\[.*?\])</checkpoint>", re.DOTALL)


def level_of(j: int) -> int:
    """The flat grey level (0-255) the tests draw image ``j`` of a prompt in."""
    return 30 + 50 * j


def _image_j(url: str, decode: bool) -> int:
    if not decode:
        return zlib.crc32(url[-4096:].encode()) % 4
    import numpy as np
    from PIL import Image

    data = base64.b64decode(url.split(",", 1)[1])
    mean = float(np.asarray(Image.open(io.BytesIO(data)).convert("L")).mean())
    return max(0, round((mean - level_of(0)) / (level_of(1) - level_of(0))))


def default_scores(prompt: str, j: int, testpoints: list[str]) -> list[int]:
    """The fake judge's verdicts when no rule is given: 0 where ``(crc32(prompt) + j + k) % 3 == 0``."""
    base = zlib.crc32(prompt.encode("utf-8"))
    return [0 if (base + j + k) % 3 == 0 else 1 for k in range(len(testpoints))]


def format_answer(prompt: str, testpoints: list[str], scores: list[int]) -> str:
    """An answer in the official format (``<analysis>`` and ``<score>`` list literals)."""
    analysis = [f"{tp}: the image {'shows' if s else 'does not show'} what the prompt asks" for tp, s in zip(testpoints, scores)]
    return (f"<description>\n<prompt>{prompt}</prompt>\n<checkpoint>{testpoints}</checkpoint>\n"
            f"<analysis>{analysis!r}</analysis>\n<score>{list(scores)!r}</score>\n</description>")


class FakeJudge:
    """The judge's state and answers (see the module docstring)."""

    def __init__(self, scores: Callable[[str, int, list[str]], list[int]] | None = None,
                 plan: dict[tuple[str, int], list[str]] | None = None, service_seconds: float = 0.0,
                 slow_seconds: float = 5.0, decode_images: bool = True):
        self.scores = scores or default_scores
        self.plan = dict(plan or {})
        self.service_seconds = float(service_seconds)
        self.slow_seconds = float(slow_seconds)
        self.decode_images = decode_images
        self.received: Counter = Counter()
        self.answered: Counter = Counter()
        self.service: list[float] = []
        self.waiting = 0  # requests held at the gate now
        self._limit: int | None = None
        self._delivered = 0

    def gate(self, n: int) -> None:
        """Deliver only ``n`` more answers; later requests wait for :meth:`open_gate`."""
        self._limit = self._delivered + n

    def open_gate(self) -> None:
        self._limit = None

    def stats(self) -> dict:
        s = sorted(self.service)
        pick = (lambda q: s[min(len(s) - 1, int(q * len(s)))]) if s else (lambda q: 0.0)
        return {"received": sum(self.received.values()), "answered": sum(self.answered.values()),
                "service_mean_s": sum(s) / len(s) if s else 0.0, "service_p50_s": pick(0.5), "service_p95_s": pick(0.95)}

    async def handle(self, body: dict, disconnected: Callable) -> tuple[int, str]:
        """(HTTP status, answer text) for one chat request."""
        t0 = time.perf_counter()
        content = body["messages"][-1]["content"]
        text = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        url = next(p["image_url"]["url"] for p in content if p.get("type") == "image_url")
        prompt = _PROMPT.findall(text)[-1]
        testpoints = literal_eval(_CHECKPOINTS.findall(text)[-1])
        key = (prompt, _image_j(url, self.decode_images))
        self.received[key] += 1
        steps = self.plan.get(key, ["ok"])
        step = steps[min(self.received[key], len(steps)) - 1]
        if self.service_seconds:
            await asyncio.sleep(self.service_seconds)
        if step == "slow":
            end = time.perf_counter() + self.slow_seconds
            while time.perf_counter() < end:
                if await disconnected():  # the client timed out: nothing to answer
                    return 499, "client went away"
                await asyncio.sleep(0.02)
        if self._limit is not None and self._delivered >= self._limit:
            self.waiting += 1
            try:
                while self._limit is not None and self._delivered >= self._limit:
                    if await disconnected():
                        return 499, "client went away"
                    await asyncio.sleep(0.01)
            finally:
                self.waiting -= 1
        self._delivered += 1
        self.answered[key] += 1
        scores = self.scores(prompt, key[1], testpoints)
        if step == "500":
            out = (500, "internal error")
        elif step == "malformed":
            out = (200, "The image looks fine to me.")
        elif step == "short":
            out = (200, format_answer(prompt, testpoints[:-1], scores[:-1]))
        else:
            out = (200, format_answer(prompt, testpoints, scores))
        self.service.append(time.perf_counter() - t0)
        return out


def make_app(judge: FakeJudge):
    """The FastAPI app serving ``judge``."""
    import fastapi

    app = fastapi.FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: fastapi.Request):
        status, text = await judge.handle(await request.json(), request.is_disconnected)
        if status != 200:
            return fastapi.responses.JSONResponse({"error": text}, status_code=status)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}

    @app.get("/stats")
    async def stats():
        return judge.stats()

    return app


@contextlib.contextmanager
def running(judge: FakeJudge):
    """Serve ``judge`` on 127.0.0.1 in a daemon thread; yields the API root (``http://127.0.0.1:P/v1``)."""
    from ..serve import ServerThread

    with ServerThread(make_app(judge)) as server:
        try:
            yield server.url + "/v1"
        finally:
            judge.open_gate()


def main(argv: list[str] | None = None) -> None:
    """Serve a fake judge on 127.0.0.1:``--port`` until interrupted (for benchmarks in another process)."""
    import uvicorn

    ap = argparse.ArgumentParser(description="a deterministic OpenAI-compatible UniGenBench judge on loopback")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--service-ms", type=float, default=0.0, help="fixed service time per answer (ms)")
    ap.add_argument("--decode-images", action="store_true", help="tell images apart by grey level (tests)")
    args = ap.parse_args(argv)
    judge = FakeJudge(service_seconds=args.service_ms / 1000, decode_images=args.decode_images)
    uvicorn.run(make_app(judge), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
