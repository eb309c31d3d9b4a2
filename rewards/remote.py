"""The ``remote`` reward: score images on a flowgrpo reward server (``flowgrpo serve-reward``).

The wire format (JSON only, never pickle) is in :mod:`flowgrpo.rewards.wire`, shared with the server.

Images travel as 8-bit PNG after ``round(x * 255)``, the quantisation the shapes, JPEG and OCR
rewards apply before scoring, so their remote scores equal the in-process ones (a reward that reads
float pixels sees them quantised to 1/255). ``null`` (a failed sample) comes back as NaN. Requests
hold at most ``batch_size`` images and never split a group (pairwise rewards compare within groups);
without groups, images of one prompt stay together. A request over the server's limits (images per
request, decoded size) is refused with a 413 naming the limit: lower ``batch_size``.

``timeout`` bounds each request's whole exchange, and an answer is read up to ``max_response_mb``
after decompression (:mod:`flowgrpo.rewards.http_client`). Connection errors, timeouts, 429 and 5xx
answers are retried ``retries`` times with exponential backoff (``backoff``, ``2 * backoff``, ...);
then :class:`~flowgrpo.errors.RewardUnavailableError` names the URL (the trainer stops; its last
checkpoint is intact and ``--resume`` continues). Any other 4xx answer, and an answer over
``max_response_mb``, is an immediate :class:`~flowgrpo.errors.UserError` with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import torch
from torch import Tensor

from flowgrpo.errors import ConfigError, RewardUnavailableError, UserError

from .base import RewardOutput
from .http_client import (DEFAULT_MAX_RESPONSE_MB, HTTPLoop, Reply, ResponseRefused, gather_all,
                          max_response_bytes)
from .wire import encode_png_b64, one_line, pack_groups, parse_floats


class RemoteReward:
    """A reward computed by a flowgrpo reward server at ``url`` (see the module docstring).

    Options: ``url`` (``http://host:port``), ``token_env`` (name of an environment variable holding
    the server's bearer token; the token itself never sits in a config), ``timeout`` (seconds per
    request, the whole exchange), ``retries`` and ``backoff`` (seconds before the first retry, doubled
    each time), ``max_response_mb`` (the largest answer read, MiB after decompression),
    ``batch_size`` (images per request), ``concurrency`` (requests in flight at once: the server
    batches concurrent requests, so a slow reward model is called fewer times), ``name`` (the
    reward's display name), ``references`` (image editing: the server's reward compares each image
    with its prompt's reference image, so this reward asks the trainer for them,
    ``wants_references``, and sends each image's reference with it as a PNG).
    """

    def __init__(self, url: str, token_env: str | None = None, timeout: float = 30.0, retries: int = 3,
                 backoff: float = 1.0, batch_size: int = 64, concurrency: int = 1, name: str | None = None,
                 references: bool = False, max_response_mb: float = DEFAULT_MAX_RESPONSE_MB):
        try:
            import httpx  # noqa: F401 (used by the HTTP loop; checked here, before any request)
        except ImportError:
            raise ConfigError("the remote reward needs httpx: pip install 'flowgrpo[remote]'") from None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.options.remote.url must be an http(s) URL, got {url!r}")
        if int(retries) < 0 or float(backoff) < 0 or float(timeout) <= 0 or int(batch_size) < 1 or int(concurrency) < 1:
            raise ConfigError("reward.options.remote: retries and backoff must be >= 0, timeout > 0, batch_size >= 1, "
                              "concurrency >= 1")
        self.concurrency = int(concurrency)
        self.url = url.rstrip("/")
        self.endpoint = f"{self.url}/score"
        self.retries, self.backoff, self.batch_size = int(retries), float(backoff), int(batch_size)
        self.timeout = float(timeout)
        self.max_response_mb = float(max_response_mb)
        self.max_response_bytes = max_response_bytes(max_response_mb, "reward.options.remote.max_response_mb")
        self.name = name or "remote"
        self.wants_references = bool(references)
        headers = {}
        if token_env:
            token = os.environ.get(token_env)
            if not token:
                raise ConfigError(f"reward.options.remote.token_env: environment variable {token_env} is not set")
            headers["Authorization"] = f"Bearer {token}"
        # no cap on connections beyond httpx's: each call keeps to `concurrency`, and calls from several
        # threads at once must not wait for a connection inside their deadline
        self._http = HTTPLoop("remote-reward", self.timeout, headers=headers)

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None,
                 references: Tensor | None = None) -> RewardOutput:
        """images [B, 3, H, W] in [0, 1], prompts [B], groups [B] long or None, with ``references``
        (option) each image's reference [B, 3, H, W] in [0, 1] -> scores [B] and components [B]."""
        if self.wants_references and references is None:
            raise UserError(f"reward {self.name!r} (reward.options.remote.references=true) needs each image's "
                            "reference image: a .jsonl prompt file with an \"image\" column")
        n = images.shape[0]
        group_list = None if groups is None else [int(g) for g in torch.as_tensor(groups).reshape(-1).tolist()]
        scores = torch.full((n,), float("nan"), dtype=torch.float32)
        comps: dict[str, Tensor] = {}
        packs = pack_groups(group_list if group_list is not None else list(prompts), self.batch_size)
        bodies = []
        for idx in packs:
            body = {"prompts": [prompts[i] for i in idx], "images": encode_png_b64(images[idx])}
            if group_list is not None:
                body["groups"] = [group_list[i] for i in idx]
            if self.wants_references:
                body["references"] = encode_png_b64(references[idx])
            bodies.append(body)
        # encoded here, off the HTTP loop: the images' base64 text is most of each body
        answers = self._http.run(self._post_all([json.dumps(b, separators=(",", ":")).encode() for b in bodies]))
        for idx, answer in zip(packs, answers):
            try:
                scores[idx] = parse_floats(answer.get("scores"), len(idx), "scores")
                raw_comps = answer.get("components") or {}
                if not isinstance(raw_comps, dict):
                    raise ValueError("components is not a mapping")
                for k, v in raw_comps.items():
                    comps.setdefault(str(k), torch.full((n,), float("nan"), dtype=torch.float32))[idx] = parse_floats(
                        v, len(idx), f"components.{k}")
            except (AttributeError, ValueError) as exc:
                raise UserError(f"reward server {self.endpoint} sent a malformed answer: {one_line(exc)}") from None
        return RewardOutput(scores, comps)

    async def _post_all(self, bodies: list[bytes]) -> list[dict]:
        """POST every JSON body, at most ``concurrency`` at once; the answers in request order (the
        first failure cancels the rest)."""
        sem = asyncio.Semaphore(self.concurrency)

        async def one(body: bytes) -> dict:
            async with sem:
                return await self._post(body)

        return await gather_all([one(b) for b in bodies])

    async def _post(self, body: bytes) -> dict:
        """POST one request; retry transient failures; return the decoded JSON answer."""
        import httpx

        attempts = self.retries + 1
        reason = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                resp = await self._http.fetch("POST", self.endpoint, content=body, timeout=self.timeout,
                                              max_bytes=self.max_response_bytes,
                                              headers={"Content-Type": "application/json"})
            except (httpx.HTTPError, TimeoutError) as exc:  # connection refused/reset, timeouts, protocol errors
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                continue
            except ResponseRefused as exc:
                raise UserError(f"reward server {self.endpoint} {exc}; refused (reward.options.remote."
                                f"max_response_mb={self.max_response_mb:g})") from None
            if resp.status_code == 429 or resp.status_code >= 500:
                reason = f"HTTP {resp.status_code}: {_server_reason(resp)}"
                continue
            if resp.redirect:
                raise UserError(f"reward server {self.endpoint} {resp.redirect} (reward.options.remote.url)")
            if resp.status_code >= 400:
                raise UserError(f"reward server {self.endpoint} refused the request "
                                f"(HTTP {resp.status_code}): {one_line(_server_reason(resp))}")
            try:
                return resp.json()
            except ValueError as exc:
                raise UserError(f"reward server {self.endpoint} answered with something other than JSON "
                                f"({one_line(exc, 120)})") from None
        raise RewardUnavailableError(f"reward server {self.endpoint} unavailable after {attempts} attempt(s): "
                                     f"{one_line(reason)}")

    def close(self) -> None:
        """Close the HTTP connections and stop the loop thread."""
        self._http.close()


def _server_reason(resp: Reply) -> str:
    with contextlib.suppress(ValueError):  # a body that is not JSON: its text is the reason
        data = resp.json()
        if isinstance(data, dict) and "error" in data:
            return str(data["error"])
    return resp.text[:200] or resp.reason
