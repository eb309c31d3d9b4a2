"""The reward server's FastAPI app: ``POST /score``, ``GET /health``, ``GET /stats``.

Order of checks on ``/score``: bearer token (401) -> content type must be JSON (415) ->
``Content-Length`` and the bytes actually read against the body limit (413, before any parsing),
the whole body within ``body_timeout_s`` (408; a stalled upload is cut off) -> JSON (400) -> schema
(422) -> images per request (413) -> base64 and every image header (400): pixels per image and the
request's decoded size (413, before any pixel is decompressed) -> PNG/JPEG decoding (400) -> batched
scoring (500 with a one-line reason if the reward fails). Every error answer is
``{"error": "<one line>"}``; the server keeps serving after any of them. A client that disconnects
before its body is read costs one INFO log line, no traceback.

Memory: a waiting request holds at most ``max_body_mb`` of body and a quarter of ``max_decoded_mb``
of uint8 images (the limit counts them as the float32 RGB the reward receives); a reward call gets at
most ``max_decoded_mb`` of float images and ``max_batch`` images (a group larger than that stays
whole); ``max_images`` also bounds a pairwise reward's pairs, n (n - 1) / 2 per group.
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

from ..rewards.wire import json_floats, one_line
from .batcher import Batcher
from .codec import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_MB, DEFAULT_MAX_DECODED_MB, DEFAULT_MAX_IMAGE_PIXELS,
                    DEFAULT_MAX_IMAGES, MIB, RequestError, decode_images, parse_score_request)

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


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes, declared or actually sent, and
    (408) a body that has not fully arrived after ``timeout`` seconds."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise RequestError(415, f"content type must be application/json, got {ctype or 'none'}")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError(400, "invalid Content-Length")
        if int(declared) > limit:
            raise RequestError(413, f"body of {int(declared)} bytes exceeds the server's limit of {limit} bytes")
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
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, name: str | None = None) -> FastAPI:
    """A FastAPI app serving ``reward`` (any :class:`~flowgrpo.rewards.Reward`).

    ``token``: the bearer token every endpoint requires (None: no authentication; only sensible on
    loopback). ``max_batch``: images per reward call; ``window_ms``: how long a batch waits for
    requests still being uploaded or decoded. Limits (413 beyond them): ``max_body_mb`` per request
    body; ``max_image_pixels`` per image (W * H); ``max_decoded_mb`` for a request's images and for
    one reward call's, counted as float32 RGB (12 bytes per pixel); ``max_images`` per request.
    ``body_timeout_s``: a body not fully received by then is a 408. ``name``: reported by /health.
    Scores travel as JSON numbers, NaN/inf as ``null``.
    """
    token_bytes = token.encode() if token else None
    body_limit = int(max_body_mb * MIB)
    decoded_limit = int(max_decoded_mb * MIB)
    batcher = Batcher(reward, max_batch=max_batch, window_s=window_ms / 1000.0, max_bytes=decoded_limit)
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

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.status == 408:  # the rest of a stalled body may still come: drop the connection
            headers = {"Connection": "close"}
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
        batcher.arriving += 1  # the batcher waits (up to the window) for requests still on the way
        try:
            req = parse_score_request(await _read_body(request, body_limit, body_timeout_s), max_images)
            images = await asyncio.to_thread(decode_images, req.images, max_image_pixels, decoded_limit)
        finally:
            batcher.arriving -= 1  # no await until the parts are queued in batcher.score
        try:
            scores, comps = await batcher.score(images, req.prompts, req.groups)
        except Exception as exc:  # the reward itself failed on this request's images
            raise RequestError(500, f"reward failed: {type(exc).__name__}: {exc}") from None
        return {"scores": json_floats(scores), "components": {k: json_floats(v) for k, v in comps.items()}}

    return app
