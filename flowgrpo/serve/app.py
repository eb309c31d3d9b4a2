"""The reward server's FastAPI app: ``POST /score``, ``GET /health``, ``GET /stats``.

Order of checks on ``/score``: bearer token (401) -> content type must be JSON (415) ->
``Content-Length`` and the bytes actually read against the body limit (413, before any parsing)
-> JSON (400) -> schema (422) -> base64 and PNG/JPEG decoding with a pixel limit (400/413) ->
batched scoring (500 with a one-line reason if the reward fails). Every error answer is
``{"error": "<one line>"}``; the server keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..rewards.remote import one_line
from .batcher import Batcher
from .codec import RequestError, decode_image, json_floats, parse_score_request

DEFAULT_MAX_BODY_MB = 64
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


def _error(status: int, reason: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": one_line(reason)}, status_code=status, headers=headers)


def _check_token(request: Request, token: bytes | None) -> None:
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
        raise RequestError(401, "missing or wrong bearer token")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes, declared or actually sent."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise RequestError(415, f"content type must be application/json, got {ctype or 'none'}")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError(400, "invalid Content-Length")
        if int(declared) > limit:
            raise RequestError(413, f"body of {int(declared)} bytes exceeds the server's limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"body exceeds the server's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(reward, token: str | None = None, max_batch: int = 32, window_ms: float = 5.0,
               max_body_mb: float = DEFAULT_MAX_BODY_MB, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               name: str | None = None) -> FastAPI:
    """A FastAPI app serving ``reward`` (any :class:`~flowgrpo.rewards.Reward`).

    ``token``: the bearer token every endpoint requires (None: no authentication; only sensible on
    loopback). ``max_batch``: images per reward call; ``window_ms``: how long a batch waits for
    requests still being uploaded or decoded. ``max_body_mb``: request body limit;
    ``max_image_pixels``: per image (W * H), and ``max_batch`` times that per request. ``name``:
    reported by /health. Scores travel as JSON numbers, NaN/inf as ``null``.
    """
    token_bytes = token.encode() if token else None
    body_limit = int(max_body_mb * 1024 * 1024)
    batcher = Batcher(reward, max_batch=max_batch, window_s=window_ms / 1000.0)
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
        return _error(exc.status, exc.reason, headers)

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
            req = parse_score_request(await _read_body(request, body_limit))
            images = await asyncio.to_thread(_decode_all, req.images, max_image_pixels, max_image_pixels * max_batch)
        finally:
            batcher.arriving -= 1  # no await until the parts are queued in batcher.score
        try:
            scores, comps = await batcher.score(images, req.prompts, req.groups)
        except Exception as exc:  # the reward itself failed on this request's images
            raise RequestError(500, f"reward failed: {type(exc).__name__}: {exc}") from None
        return {"scores": json_floats(scores), "components": {k: json_floats(v) for k, v in comps.items()}}

    return app


def _decode_all(texts: list[str], max_pixels: int, budget: int) -> list:
    """Decode every image of a request; their pixel sum may not exceed ``budget`` (413)."""
    images, total = [], 0
    for i, text in enumerate(texts):
        img = decode_image(text, max_pixels, i)
        total += img.shape[-1] * img.shape[-2]
        if total > budget:
            raise RequestError(413, f"the request's images hold more than the server's limit of {budget} pixels")
        images.append(img)
    return images
