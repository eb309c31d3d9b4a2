"""A small bounded-concurrency client for OpenAI-compatible ``/chat/completions`` endpoints.

Used by the VLM judges (:mod:`flowgrpo.rewards.judge`) against vLLM, SGLang or a hosted API. The
trainer is synchronous, so the client owns one event loop running in a daemon thread; every
:meth:`ChatClient.complete` call submits its requests to that loop and blocks until all of them
have an outcome. It therefore works when called repeatedly from a sync loop, and also from code
that is itself running inside an event loop (a notebook), where ``asyncio.run`` would refuse.

Every request gets at most ``1 + retries`` attempts. An attempt fails on a transport error or
timeout (``timeout`` bounds the whole attempt, :mod:`flowgrpo.rewards.http_client`), on HTTP 429 or
5xx, on a malformed response body, or when the caller's ``parse`` cannot read the answer; a failed
attempt is retried after the server's ``Retry-After`` (ASCII seconds or an HTTP date, at most 60 s)
or ``backoff * 2**attempt`` seconds. HTTP 401, 403 and 404 mean a wrong key, model or URL, and a
body over ``max_response_mb`` after decompression a server that is not a judge: they raise
:class:`JudgeEndpointError` at once instead of dropping every sample. Other 4xx answers fail the
request without retrying.

Large requests (an image each) can be passed as zero-argument callables that build the messages:
they are built in a worker thread shortly before they are sent (at most ``2 * max_concurrency`` are
held at once), so a long list never holds every payload in memory. ``on_outcome(i, outcome)`` is
called as each request finishes, so a caller can record results as they arrive.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from flowgrpo.errors import ConfigError, UserError

from .http_client import (DEFAULT_MAX_RESPONSE_MB, HTTPLoop, ResponseRefused, gather_all, max_response_bytes,
                          retry_after_s)

#: the longest wait a server's Retry-After gets (s)
MAX_RETRY_AFTER_S = 60.0


class JudgeEndpointError(UserError):
    """The endpoint refuses every request (bad key, unknown model, wrong URL)."""


@dataclass
class Outcome:
    """One request's result: ``value`` is ``parse(answer)`` or None when every attempt failed;
    ``answer`` the last text received (or None), ``error`` why the last attempt failed; ``seconds``
    the wall time of the last attempt's HTTP exchange (s)."""

    value: Any = None
    answer: str | None = None
    error: str | None = None
    attempts: int = 0
    seconds: float = 0.0


class _Retry(Exception):
    """An attempt failed in a way worth retrying (``delay``: the server's Retry-After, if any)."""

    def __init__(self, msg: str, delay: float | None = None):
        super().__init__(msg)
        self.delay = delay


class _Fail(Exception):
    """An attempt failed in a way that retrying will not fix (this request only)."""


def message_text(data: Any) -> str:
    """The assistant text of a chat-completions response body; raises ValueError when absent.

    ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts."""
    try:
        content = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"no choices[0].message.content in the response ({type(e).__name__})") from None
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ValueError("message content is not text")
    return content


class ChatClient:
    """Sends chat requests concurrently (at most ``max_concurrency`` in flight) with bounded retries.

    Args:
        base_url: the API root, as for the OpenAI client (requests go to ``{base_url}/chat/completions``),
            e.g. ``http://127.0.0.1:8000/v1`` for ``vllm serve``.
        model: the served model name. api_key_env: name of an environment variable holding the key
            (sent as ``Authorization: Bearer ...``); None sends no key.
        timeout: seconds per attempt, the whole exchange. retries: extra attempts per request.
        backoff: first retry delay (s). max_response_mb: the largest answer read (MiB, decompressed).
    """

    def __init__(self, base_url: str, model: str, api_key_env: str | None = None, max_concurrency: int = 8,
                 timeout: float = 60.0, retries: int = 2, backoff: float = 0.5, temperature: float = 0.0,
                 max_tokens: int = 512, max_response_mb: float = DEFAULT_MAX_RESPONSE_MB):
        if not base_url or not model:
            raise ConfigError("an OpenAI-compatible judge needs base_url and model")
        for name, value, low, strict in (("max_concurrency", max_concurrency, 1, False), ("retries", retries, 0, False),
                                         ("timeout", timeout, 0, True), ("backoff", backoff, 0, False),
                                         ("max_tokens", max_tokens, 1, False)):
            # NaN passes every comparison: it reached asyncio ("deadline must not be NaN") as a traceback
            if not (math.isfinite(float(value)) and (float(value) > low if strict else float(value) >= low)):
                raise ConfigError(f"judge option {name} must be a finite number {'>' if strict else '>='} {low}, "
                                  f"got {value!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        if api_key_env and not os.environ.get(api_key_env):
            raise ConfigError(f"judge option api_key_env={api_key_env!r}: that environment variable is not set")
        self.max_concurrency = int(max_concurrency)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.max_response_mb = float(max_response_mb)
        self.max_response_bytes = max_response_bytes(max_response_mb, "judge option max_response_mb")
        self.stats = {"requests": 0, "retries": 0, "failed": 0, "http_errors": 0, "timeouts": 0, "unparsed": 0}
        self._http = HTTPLoop("judge-http", self.timeout, max_connections=self.max_concurrency)

    def close(self) -> None:
        """Close the HTTP connections and stop the loop thread (a later call starts them again)."""
        self._http.close()

    # ------------------------------------------------------------------ requests

    def complete(self, requests: Sequence[list[dict] | Callable[[], list[dict]]],
                 parse: Callable[[str], Any] | Sequence[Callable[[str], Any]],
                 on_outcome: Callable[[int, Outcome], None] | None = None) -> list[Outcome]:
        """Send every request and return one :class:`Outcome` each, in order.

        A request is a list of chat ``messages``, or a zero-argument callable returning one (built
        in a worker thread just before it is sent; an exception there fails that request only).
        ``parse(answer text)`` returns the value to keep or None for an unreadable answer (retried);
        a sequence gives one parser per request. ``on_outcome(index, outcome)`` runs (on the client's
        loop thread) as each request finishes."""
        if not requests:
            return []
        parsers = list(parse) if isinstance(parse, (list, tuple)) else [parse] * len(requests)
        if len(parsers) != len(requests):
            raise ValueError(f"{len(parsers)} parsers for {len(requests)} requests")
        return self._http.run(self._complete_all(list(requests), parsers, on_outcome))

    async def _complete_all(self, requests, parsers, on_outcome) -> list[Outcome]:
        sem = asyncio.Semaphore(self.max_concurrency)
        ahead = asyncio.Semaphore(2 * self.max_concurrency)  # lazily built requests held at once

        async def one(i: int) -> Outcome:
            if callable(requests[i]):
                async with ahead:
                    out = await self._built(requests[i], parsers[i], sem)
            else:
                out = await self._one(requests[i], parsers[i], sem)
            if on_outcome is not None:
                on_outcome(i, out)
            return out

        return await gather_all([one(i) for i in range(len(requests))])

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ.get(self.api_key_env, '')}"
        return headers

    async def _built(self, build, parse, sem) -> Outcome:
        """Build a request's messages in a worker thread, then send it (a failed build fails it)."""
        try:
            messages = await asyncio.get_running_loop().run_in_executor(None, build)
        except Exception as e:  # e.g. an unreadable image: this request fails, the others go on
            self.stats["failed"] += 1
            return Outcome(error=f"could not build the request: {type(e).__name__}: {e}")
        return await self._one(messages, parse, sem)

    async def _one(self, messages, parse, sem) -> Outcome:
        out = Outcome()
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}
        delay = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(delay if delay is not None else self.backoff * 2 ** (attempt - 1))
            out.attempts, delay = attempt + 1, None
            t0 = time.perf_counter()
            try:
                async with sem:
                    t0 = time.perf_counter()
                    text = await self._post(body)
            except _Retry as e:
                out.seconds = time.perf_counter() - t0
                out.error, delay = str(e), e.delay
                continue
            except _Fail as e:
                out.error, out.seconds = str(e), time.perf_counter() - t0
                break
            out.answer, out.seconds = text, time.perf_counter() - t0
            value = parse(text)
            if value is not None:
                out.value, out.error = value, None
                return out
            self.stats["unparsed"] += 1
            out.error = "unparseable answer"
        self.stats["failed"] += 1
        return out

    async def _post(self, body: dict) -> str:
        import httpx

        self.stats["requests"] += 1
        try:
            resp = await self._http.fetch("POST", self.url, json=body, headers=self._headers(),
                                            timeout=self.timeout, max_bytes=self.max_response_bytes)
        except (httpx.TimeoutException, TimeoutError):
            self.stats["timeouts"] += 1
            raise _Retry(f"timed out after {self.timeout:g} s") from None
        except httpx.TransportError as e:
            self.stats["http_errors"] += 1
            raise _Retry(f"transport error: {type(e).__name__}: {e}") from None
        except ResponseRefused as e:
            raise JudgeEndpointError(f"judge endpoint {self.url} {e}; refused (judge option max_response_mb="
                                     f"{self.max_response_mb:g})") from None
        if resp.redirect:
            raise JudgeEndpointError(f"judge endpoint {self.url} {resp.redirect} (base_url)")
        if resp.status_code in (401, 403, 404):
            raise JudgeEndpointError(f"judge endpoint {self.url} answered HTTP {resp.status_code} "
                                     f"(check base_url, model {self.model!r} and api_key_env): {resp.text[:200]}")
        if resp.status_code == 429 or resp.status_code >= 500:
            self.stats["http_errors"] += 1
            delay = retry_after_s(resp.headers.get("retry-after"))
            raise _Retry(f"HTTP {resp.status_code}", None if delay is None else min(delay, MAX_RETRY_AFTER_S))
        if resp.status_code >= 400:
            self.stats["http_errors"] += 1
            raise _Fail(f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            return message_text(resp.json())
        except ValueError as e:  # also a body that is not JSON
            raise _Retry(f"malformed response: {e}") from None
