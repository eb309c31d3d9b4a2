"""Bounded HTTP exchanges for flowgrpo's clients: the ``remote`` reward, the VLM judges and
``flowgrpo unigenbench score`` (its judge and its reachability check).

httpx bounds each phase of a request (connecting, each read), not the whole, and inflates a
compressed body without limit: a server that sent its headers and then a byte every half second
held a ``timeout=3`` request for ever, and a 3 MiB gzip body that inflates to 3 GiB took a trainer
past 2.5 GiB of memory. :meth:`HTTPLoop.fetch` is how these clients send a request:

- **one deadline**: ``timeout`` seconds from sending the request to the body's last byte (asyncio
  cancels the exchange at the deadline, which closes its connection), raised as ``TimeoutError``;
- **a body cap after decompression**: the client asks for identity, gzip or deflate only and
  inflates here, never more than the room left under ``max_bytes`` at a time (httpx's own decoder
  inflates a whole network chunk at once); a larger body, or one in another encoding, raises
  :class:`ResponseRefused` once the cap is passed.

:class:`HTTPLoop` runs these exchanges on an event loop of its own in a daemon thread, so a
synchronous caller (the trainer) blocks on :meth:`HTTPLoop.run` and code already inside an event
loop (a notebook) works too. httpx is imported only when a client is first used.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import json
import os
import re
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Awaitable, Mapping

#: the largest response body a client reads, MiB after decompression (option ``max_response_mb`` of
#: the remote reward and the judges, ``--max-response-mb`` of ``unigenbench score``): a judge's answer
#: or a reward server's scores take kilobytes
DEFAULT_MAX_RESPONSE_MB = 16.0
MIB = 1 << 20
#: the encodings :class:`_Inflater` decodes, as the client asks for them
ACCEPT_ENCODING = "gzip, deflate"


class ResponseRefused(Exception):
    """A response body the client will not read: over its cap after decompression, or in an encoding
    it did not ask for (the message says which, in a phrase: "answered ...")."""


@dataclass
class Reply:
    """A whole response: ``status_code``, ``headers`` (httpx's, case-insensitive) and the decoded
    ``content`` (bytes, at most the exchange's cap)."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    @property
    def reason(self) -> str:
        """The standard reason phrase of the status ("Service Unavailable"), or "HTTP <code>"."""
        try:
            return http.HTTPStatus(self.status_code).phrase
        except ValueError:
            return f"HTTP {self.status_code}"

    @property
    def redirect(self) -> str | None:
        """For a 3xx answer, a phrase saying so ("answered HTTP 307, a redirect to URL, ..."); None
        otherwise. These clients never follow redirects (httpx's default): a request that carries a
        bearer token must not be replayed to an address the server picks, and a changed endpoint is
        the user's to set."""
        if not 300 <= self.status_code < 400:
            return None
        where = self.headers.get("location")
        to = f", a redirect to {where[:200]}," if where else ", a redirect"
        return f"answered HTTP {self.status_code}{to} which is not followed: use the address it names"

    def json(self) -> Any:
        """The body parsed as strict JSON: ValueError when it is not JSON, when it holds ``NaN`` or
        ``Infinity`` (Python's extensions, not JSON), or when it nests deeper than the parser's
        recursion allows (a hostile answer of 100,000 brackets)."""
        try:
            return json.loads(self.content, parse_constant=_refuse_constant)
        except RecursionError:
            raise ValueError("the JSON nests too deeply") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON (a failed value is null)")


def max_response_bytes(max_response_mb: float, option: str) -> int:
    """``max_response_mb`` (MiB, finite, > 0) in bytes; a ConfigError naming ``option`` otherwise."""
    from flowgrpo.errors import ConfigError

    if (not isinstance(max_response_mb, (int, float)) or isinstance(max_response_mb, bool)
            or not 0 < max_response_mb < float("inf")):  # NaN fails both; inf was an OverflowError in int()
        raise ConfigError(f"{option} must be a finite number of MiB > 0, got {max_response_mb!r}")
    return int(float(max_response_mb) * MIB)


def retry_after_s(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait: ASCII digits (``120``, also ``1.5``) or an HTTP
    date (seconds from now, at least 0). Anything else counts as absent (None): Python's ``float``
    and ``str.isdigit`` also accept other scripts' digits ("²", "٣"), which no server means."""
    text = (value or "").strip()
    if re.fullmatch(r"[0-9]+(?:\.[0-9]+)?", text):
        return float(text)
    if not text.isascii():
        return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


async def gather_all(coros: list[Awaitable]) -> list:
    """The results of ``coros`` run concurrently, in order; the first failure (or a cancellation)
    cancels the others, so none goes on sending requests after the caller has given up."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


class _Inflater:
    """Decodes a body's ``Content-Encoding`` chunk by chunk, refusing more than ``limit`` bytes out.

    zlib's ``max_length`` keeps each step within the room left (plus one byte, to tell "exactly
    full" from "over"), so memory stays within the cap whatever the compression ratio."""

    def __init__(self, encoding: str, limit: int):
        enc = encoding.strip().lower()
        if enc in ("", "identity"):
            self._zlib = None
        elif enc in ("gzip", "x-gzip", "deflate"):
            self._zlib = zlib.decompressobj(zlib.MAX_WBITS | 32)  # reads a gzip or a zlib header
        else:
            raise ResponseRefused(f"answered in Content-Encoding {encoding!r}, which it was not asked for "
                                  f"(accepted: identity, {ACCEPT_ENCODING})")
        self.limit, self.size = limit, 0

    def feed(self, data: bytes) -> bytes:
        """The decoded bytes of the next network chunk ``data``."""
        if self._zlib is None:
            out = data
        else:
            out = bytearray()
            try:
                while data and not self._zlib.eof and self.size + len(out) <= self.limit:
                    out += self._zlib.decompress(data, self.limit - self.size - len(out) + 1)
                    data = self._zlib.unconsumed_tail
            except zlib.error as exc:
                raise ResponseRefused(f"answered a body that does not inflate ({exc})") from None
        self.size += len(out)
        if self.size > self.limit:
            raise ResponseRefused(f"answered a body of more than {self.limit / MIB:g} MiB after decompression")
        return bytes(out)


class HTTPLoop:
    """An ``httpx.AsyncClient`` on an event loop in a daemon thread, for synchronous callers.

    ``name`` names the thread; ``timeout`` (s) is httpx's per-phase timeout (connect, each read),
    within :meth:`fetch`'s deadline; ``max_connections`` caps the open connections (None: httpx's
    default); ``headers`` go with every request. Nothing starts until the first :meth:`run`. A
    forked child (whose parent's loop thread does not exist there) starts its own loop and client
    on first use; :meth:`close` stops them (a later call starts them again)."""

    def __init__(self, name: str, timeout: float, max_connections: int | None = None,
                 headers: dict[str, str] | None = None):
        self.name, self.timeout, self.max_connections, self.headers = name, timeout, max_connections, headers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._http = None  # created on the loop thread, used only there
        self._pid: int | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> HTTPLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._loop = asyncio.new_event_loop()
                self._http = None
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True)
                self._thread.start()
            return self._loop

    def run(self, coro: Awaitable) -> Any:
        """Run ``coro`` on the loop and return its result (an interrupt cancels it)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def client(self):
        """The loop's ``httpx.AsyncClient`` (call on the loop thread)."""
        import httpx

        if self._http is None:
            n = self.max_connections
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=n) if n else httpx.Limits()
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout), limits=limits, headers=self.headers)
        return self._http

    async def fetch(self, method: str, url: str, *, timeout: float, max_bytes: int, headers: dict | None = None,
                    **request) -> Reply:
        """One exchange within ``timeout`` seconds in all, its body at most ``max_bytes`` after
        decompression (see the module docstring). ``request``: httpx's ``content``/``json``/...;
        raises ``TimeoutError``, :class:`ResponseRefused` or httpx's transport errors."""
        try:
            return await asyncio.wait_for(self._exchange(method, url, max_bytes, headers, request), timeout)
        except asyncio.TimeoutError:  # builtin TimeoutError from 3.11 on, not before
            raise TimeoutError(f"no whole answer within {timeout:g} s") from None

    async def _exchange(self, method: str, url: str, max_bytes: int, headers: dict | None, request: dict) -> Reply:
        headers = {**(headers or {}), "Accept-Encoding": ACCEPT_ENCODING}
        async with self.client().stream(method, url, headers=headers, **request) as resp:
            inflate = _Inflater(resp.headers.get("content-encoding", ""), max_bytes)
            body = bytearray()
            async for chunk in resp.aiter_raw():  # as sent: _Inflater decodes within the cap
                body += inflate.feed(chunk)
            return Reply(resp.status_code, resp.headers, bytes(body))

    def close(self) -> None:
        """Close the connections and stop the loop thread."""
        with self._lock:
            loop, thread, http_client = self._loop, self._thread, self._http
            self._loop = self._thread = self._http = None
        if loop is None or self._pid != os.getpid():
            return
        if http_client is not None:
            asyncio.run_coroutine_threadsafe(http_client.aclose(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
