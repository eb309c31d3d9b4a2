"""The reward server's FastAPI app: ``POST /score``, ``GET /health``, ``GET /stats``.

Order of checks on ``/score``: bearer token (401) -> content type must be JSON (415) ->
``Content-Length`` against the body limit (413) -> room in the server's budget of bodies in flight
(waits; 503 with ``Retry-After`` after ``queue_timeout_s``) -> the bytes actually read against the
body limit (413), the whole body within ``body_timeout_s`` (408; a stalled upload is cut off) -> the
count of JSON values against what ``max_images`` images need (413, before parsing) -> JSON (400) ->
schema (422) -> images per request (413) -> base64 and every image header (400): pixels per image
and the request's decoded size (413, before any pixel is decompressed) -> room in the budget of
decoded images in flight (waits; 503) -> PNG/JPEG decoding (400) -> batched scoring (500 with a
one-line reason if the reward fails). JSON parsing and image decoding run in worker threads, so the
event loop keeps answering ``/health``. Every error answer is ``{"error": "<one line>"}``; the
server keeps serving after any of them. A client that disconnects before its body is read costs
one INFO log line, no traceback.

Memory, server-wide: the requests in flight hold at most ``max_bodies_mb`` of bodies (each reserved
at its ``Content-Length``, or at ``max_body_mb`` when the length is not declared, until it is
answered; while it is parsed a body takes up to three times its size: the bytes, their text, the
strings) and ``max_inflight_mb`` of decoded images (counted as float32 RGB; they wait as uint8, a
quarter of that); a reward call gets at most ``max_decoded_mb`` of float images and ``max_batch``
images (a group larger than that stays whole); ``max_images`` also bounds a pairwise reward's
pairs, n (n - 1) / 2 per group. Connections are bounded by :mod:`flowgrpo.serve.guard`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..rewards.base import wants_references
from ..rewards.wire import json_floats, one_line
from .batcher import Batcher
from .budget import ByteBudget
from .codec import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODIES_MB, DEFAULT_MAX_BODY_MB, DEFAULT_MAX_DECODED_MB,
                    DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES, DEFAULT_MAX_INFLIGHT_MB, DEFAULT_QUEUE_TIMEOUT_S, MIB,
                    RequestError, close_images, decode_pixels, open_images, parse_score_request)

# uvicorn configures this logger (format, --log-level); the app's few lines go with the server's own
log = logging.getLogger("uvicorn.error")


def _error(status: int, reason: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": one_line(reason)}, status_code=status, headers=headers)


def _check_token(request: Request, token: bytes | None) -> None:
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
        raise RequestError(401, "missing or wrong bearer token")


def _declared_size(request: Request, limit: int) -> int:
    """The body size the request declares (``limit`` when it does not: chunked), after checking the
    content type (415) and the declared size against ``limit`` (413)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise RequestError(415, f"content type must be application/json, got {ctype or 'none'}")
    declared = request.headers.get("content-length")
    if declared is None:
        return limit
    if not declared.strip().isdigit():
        raise RequestError(400, "invalid Content-Length")
    if int(declared) > limit:
        raise RequestError(413, f"body of {int(declared)} bytes exceeds the server's limit of {limit} bytes")
    return int(declared)


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes actually sent and (408) a body that
    has not fully arrived after ``timeout`` seconds."""
    try:
        # one deadline for the whole body: uvicorn waits forever for a body shorter than its
        # Content-Length, and a byte every few seconds would defeat a per-chunk timeout
        return await asyncio.wait_for(_read_chunks(request, limit), timeout)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {timeout:g} s (body_timeout_s)") from None


async def _read_chunks(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"body exceeds the server's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(reward, token: str | None = None, max_batch: int = 32, window_ms: float = 5.0,
               max_body_mb: float = DEFAULT_MAX_BODY_MB, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               max_decoded_mb: float = DEFAULT_MAX_DECODED_MB, max_images: int = DEFAULT_MAX_IMAGES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_inflight_mb: float = DEFAULT_MAX_INFLIGHT_MB,
               max_bodies_mb: float = DEFAULT_MAX_BODIES_MB, queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
               name: str | None = None) -> FastAPI:
    """A FastAPI app serving ``reward`` (any :class:`~flowgrpo.rewards.Reward`).

    ``token``: the bearer token every endpoint requires (None: no authentication; only sensible on
    loopback). ``max_batch``: images per reward call; ``window_ms``: how long a batch waits for
    requests still being uploaded or decoded. Limits (413 beyond them): ``max_body_mb`` per request
    body; ``max_image_pixels`` per image (W * H); ``max_decoded_mb`` for a request's images and for
    one reward call's, counted as float32 RGB (12 bytes per pixel); ``max_images`` per request.
    ``body_timeout_s``: a body not fully received by then is a 408. Budgets across all requests in
    flight (see the module docstring): ``max_inflight_mb`` of decoded images (float32 RGB) and
    ``max_bodies_mb`` of request bodies; a request waits up to ``queue_timeout_s`` for room in each
    (then 503 with ``Retry-After``). ``name``: reported by /health. Scores travel as JSON numbers,
    NaN/inf as ``null``.
    """
    token_bytes = token.encode() if token else None
    body_limit = int(max_body_mb * MIB)
    decoded_limit = int(max_decoded_mb * MIB)
    wants_refs = wants_references(reward)
    batcher = Batcher(reward, max_batch=max_batch, window_s=window_ms / 1000.0, max_bytes=decoded_limit)
    inflight = ByteBudget(int(max_inflight_mb * MIB), queue_timeout_s, "decoded images", "max_inflight_mb")
    bodies = ByteBudget(int(max_bodies_mb * MIB), queue_timeout_s, "request bodies", "max_bodies_mb")
    reward_name = name or getattr(reward, "name", type(reward).__name__)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="flowgrpo reward server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.batcher = batcher
    app.state.budgets = {"inflight": inflight, "bodies": bodies}

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else dict(exc.headers or {})
        if exc.status in (408, 503):  # the rest of a stalled or unread body may still come: drop the connection
            headers["Connection"] = "close"
        return _error(exc.status, exc.reason, headers)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect):
        # an ordinary event (a client killed or timed out mid-upload), not a server fault: without
        # this handler it would reach the catch-all below and be logged as an ERROR with a traceback
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("%s disconnected before its request body was read", client)
        return _error(400, "client disconnected")  # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health(request: Request):
        _check_token(request, token_bytes)
        return {"status": "ok", "reward": reward_name}

    @app.get("/stats")
    async def stats(request: Request):
        _check_token(request, token_bytes)
        sizes = dict(sorted(batcher.batch_sizes.items()))
        return {"requests": batcher.requests, "batches": sum(sizes.values()),
                "images": sum(k * v for k, v in sizes.items()), "batch_sizes": {str(k): v for k, v in sizes.items()}}

    @app.post("/score")
    async def score(request: Request):
        _check_token(request, token_bytes)
        arriving = True
        batcher.arriving += 1  # the batcher waits (up to the window) for requests still on the way
        try:
            # budgets are taken bodies first, then decoded images, and held until the answer: no
            # holder of the second ever waits for the first, so waiting requests cannot deadlock
            async with bodies.reserve(_declared_size(request, body_limit)):
                body = await _read_body(request, body_limit, body_timeout_s)
                req = await asyncio.to_thread(parse_score_request, body, max_images, wants_refs)  # off the loop
                del body
                # an edit reward's reference images are decoded with the images, within the same budgets
                texts = req.images + (req.references or [])
                opened, nbytes = await asyncio.to_thread(open_images, texts, max_image_pixels, decoded_limit)
                try:
                    async with inflight.reserve(nbytes):
                        images = await asyncio.to_thread(decode_pixels, opened)
                        images, refs = images[:len(req.prompts)], images[len(req.prompts):] or None
                        req.images = req.references = []  # the base64 text is no longer needed
                        arriving = False
                        batcher.arriving -= 1  # no await until the parts are queued in batcher.score
                        try:
                            scores, comps = await batcher.score(images, req.prompts, req.groups, refs)
                        except Exception as exc:  # the reward itself failed on this request's images
                            raise RequestError(500, f"reward failed: {type(exc).__name__}: {exc}") from None
                finally:
                    close_images(opened)  # already closed unless the wait or the decoding failed
        finally:
            if arriving:
                batcher.arriving -= 1
        return {"scores": json_floats(scores), "components": {k: json_floats(v) for k, v in comps.items()}}

    return app
