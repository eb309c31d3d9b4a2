"""The reward server (``flowgrpo serve-reward``): a reward model behind HTTP, JSON only.

Endpoints (see :mod:`flowgrpo.serve.app`)::

    POST /score   {"prompts": [str], "images": [base64 PNG/JPEG], "groups": [int]?}
               -> {"scores": [float | null], "components": {name: [float | null]}}
    GET  /health  -> {"status": "ok", "reward": NAME}
    GET  /stats   -> {"requests", "batches", "images", "batch_sizes": {size: count}}

Concurrent requests are batched (:mod:`flowgrpo.serve.batcher`); the ``remote`` reward
(:mod:`flowgrpo.rewards.remote`) is the client, and :mod:`flowgrpo.rewards.wire` holds the protocol
helpers both sides use. Limits on memory and time per request and budgets across requests:
:func:`flowgrpo.serve.app.create_app` (:mod:`flowgrpo.serve.budget`); a header deadline and a cap on
open connections: :mod:`flowgrpo.serve.guard`.
Needs the ``remote`` extra (fastapi, uvicorn).
"""

from .server import ServerThread, free_port, is_loopback, resolve_token, serve_reward, start_server_process


def create_app(reward, **kwargs):
    """See :func:`flowgrpo.serve.app.create_app` (imported lazily: it needs fastapi)."""
    from .app import create_app as make

    return make(reward, **kwargs)


__all__ = ["ServerThread", "create_app", "free_port", "is_loopback", "resolve_token", "serve_reward",
           "start_server_process"]
