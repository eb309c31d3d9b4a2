"""Running the reward server: bind checks, token from the environment, uvicorn in the foreground
(``flowgrpo serve-reward``), in a thread or in a subprocess (tests and the benchmark).

The listening socket is bound before anything else happens, so a port already in use is one line
(exit code 2) before a reward model is loaded or "serving ..." is printed."""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from ..errors import UserError
from .codec import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_BODIES_MB, DEFAULT_MAX_BODY_MB,
                    DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_DECODED_MB, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES,
                    DEFAULT_MAX_INFLIGHT_MB, DEFAULT_QUEUE_TIMEOUT_S)

#: open files the server needs besides its connections (the listening socket, models, libraries)
SPARE_FILES = 64


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1); hostnames are not resolved."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_token(host: str, token_env: str | None) -> str | None:
    """The bearer token read from the environment variable ``token_env`` (None: no token).

    Refuses (:class:`~flowgrpo.errors.UserError`) a non-loopback ``host`` without a token, and a
    ``token_env`` that names an unset or empty variable.
    """
    token = None
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            raise UserError(f"--token-env {token_env}: the environment variable {token_env} is not set or empty")
    if token is None and not is_loopback(host):
        raise UserError(f"refusing to serve on {host} (not a loopback address) without a token: "
                        f"export a secret in an environment variable and pass --token-env VAR")
    return token


def parse_options(pairs: list[str]) -> dict:
    """``["quality=90", "name=x"]`` -> ``{"quality": 90, "name": "x"}`` (values parsed as YAML scalars)."""
    from ..config import parse_override

    options: dict = {}
    for pair in pairs or []:
        key = pair.split("=", 1)[0].strip()
        if "=" not in pair or not key:
            raise UserError(f"--option {pair!r} must look like key=value")
        options.update(parse_override(pair))
    return options


def check_reward(reward_name: str, options: dict) -> None:
    """Refuse an unknown reward name or options (one-line :class:`~flowgrpo.errors.UserError`)
    without building the reward: a reward model may take minutes to load."""
    from ..rewards import REWARDS, check_options

    check_options(reward_name, REWARDS.get(reward_name), options)


def build_app(reward_name: str, options: dict, token: str | None, **limits):
    """The reward ``build_reward(reward_name, **options)`` served by :func:`~flowgrpo.serve.app.create_app`."""
    from ..rewards import build_reward
    from .app import create_app

    return create_app(build_reward(reward_name, **options), token=token, name=reward_name, **limits)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (not yet listening: uvicorn listens on it).

    A port in use or an address that is not this machine's is a one-line
    :class:`~flowgrpo.errors.UserError`.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        hint = " (another server uses that port? pick one with --port)" if exc.errno == errno.EADDRINUSE else ""
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock


def uvicorn_config(app, log_level: str = "info", header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS):
    """uvicorn's configuration for ``app``: h11 with the header deadline and the connection cap of
    :mod:`flowgrpo.serve.guard` (and a listening backlog of ``max_connections``), keep-alive
    connections closed after 5 s idle. Serve it with :class:`~flowgrpo.serve.guard.GuardedServer`."""
    import uvicorn

    from .guard import guarded_protocol

    return uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug", timeout_keep_alive=5,
                          backlog=max_connections, http=guarded_protocol(header_timeout_s, max_connections))


def fit_open_files(max_connections: int) -> None:
    """Raise the soft open-file limit to ``max_connections`` + :data:`SPARE_FILES` if it is lower
    (up to the hard limit; a one-line :class:`~flowgrpo.errors.UserError` if that is not enough)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise UserError(f"--max-connections {max_connections} needs {need} open files but the hard limit "
                            f"(ulimit -Hn) is {hard}: lower --max-connections to {max(1, hard - SPARE_FILES)}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def run_server(app, sock: socket.socket, log_level: str = "info", header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
               max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
    """Serve ``app`` with uvicorn on the bound socket ``sock`` in the foreground until interrupted."""
    from .guard import GuardedServer

    server = GuardedServer(uvicorn_config(app, log_level, header_timeout_s, max_connections))
    server.run(sockets=[sock])
    if not server.started:  # uvicorn has logged why (e.g. the app's startup failed)
        raise UserError("the reward server failed to start")


def _check_limits(**values) -> None:
    """A UserError naming the first of ``serve-reward``'s numeric flags out of its range: ``port`` in
    0..65535, ``window_ms`` >= 0, every other one > 0, all finite (``--max-body-mb nan`` passed every
    comparison and ended in a traceback)."""
    for name, value in values.items():
        low_ok = value >= 0 if name in ("port", "window_ms") else value > 0
        if not (math.isfinite(value) and low_ok and (name != "port" or value <= 65535)):
            need = {"port": "in 0..65535", "window_ms": "a finite number >= 0"}.get(name, "a finite number > 0")
            raise UserError(f"--{name.replace('_', '-')} must be {need}, got {value:g}")


def serve_reward(reward: str, options: list[str] = (), host: str = "127.0.0.1", port: int = 8000,
                 token_env: str | None = None, max_batch: int = 32, window_ms: float = 5.0,
                 max_body_mb: float = DEFAULT_MAX_BODY_MB, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 max_decoded_mb: float = DEFAULT_MAX_DECODED_MB, max_images: int = DEFAULT_MAX_IMAGES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_inflight_mb: float = DEFAULT_MAX_INFLIGHT_MB,
                 max_bodies_mb: float = DEFAULT_MAX_BODIES_MB, queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
                 header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 log_level: str = "info") -> int:
    """``flowgrpo serve-reward``: check the limits, the reward's options and the bind, bind, build the
    reward, serve until interrupted. The limits are :func:`~flowgrpo.serve.app.create_app`'s, besides
    ``header_timeout_s`` and ``max_connections`` (:mod:`flowgrpo.serve.guard`)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError("the reward server needs fastapi and uvicorn: pip install 'flowgrpo[remote]'") from None
    token = resolve_token(host, token_env)
    _check_limits(port=port, window_ms=window_ms, max_batch=max_batch, max_body_mb=max_body_mb,
                  max_image_pixels=max_image_pixels, max_decoded_mb=max_decoded_mb, max_images=max_images,
                  body_timeout_s=body_timeout_s, max_inflight_mb=max_inflight_mb, max_bodies_mb=max_bodies_mb,
                  queue_timeout_s=queue_timeout_s, header_timeout_s=header_timeout_s, max_connections=max_connections)
    if max_inflight_mb < max_decoded_mb or max_bodies_mb < max_body_mb:
        raise UserError(f"--max-inflight-mb ({max_inflight_mb:g}) must be at least --max-decoded-mb "
                        f"({max_decoded_mb:g}) and --max-bodies-mb ({max_bodies_mb:g}) at least --max-body-mb "
                        f"({max_body_mb:g}): a request the limits allow must fit the server's budgets")
    fit_open_files(max_connections)
    options = parse_options(list(options))
    check_reward(reward, options)  # an unknown reward or option: refused before binding or loading
    sock = bind_socket(host, port)
    try:
        app = build_app(reward, options, token, max_batch=max_batch, window_ms=window_ms, max_body_mb=max_body_mb,
                        max_image_pixels=max_image_pixels, max_decoded_mb=max_decoded_mb, max_images=max_images,
                        body_timeout_s=body_timeout_s, max_inflight_mb=max_inflight_mb, max_bodies_mb=max_bodies_mb,
                        queue_timeout_s=queue_timeout_s)
        auth = f"bearer token from ${token_env}" if token else "no token"
        bound = sock.getsockname()[1]
        print(f"serving reward {reward!r} on http://{host}:{bound} ({auth}; max batch {max_batch}, "
              f"{max_images} images and {max_decoded_mb:g} MiB decoded per request, {max_inflight_mb:g} MiB decoded "
              f"in flight, {max_connections} connections)", flush=True)
        run_server(app, sock, log_level, header_timeout_s, max_connections)
    finally:
        sock.close()
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """``with ServerThread(app) as srv: httpx.get(srv.url + "/health")``: uvicorn in a daemon thread
    on a loopback socket bound before the thread starts (no port race)."""

    def __init__(self, app, host: str = "127.0.0.1", header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        from .guard import GuardedServer

        self.sock = bind_socket(host, 0)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = GuardedServer(uvicorn_config(app, "warning", header_timeout_s, max_connections))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the reward server thread did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def start_server_process(reward: str, port: int, options: list[str] = (), extra: list[str] = (),
                         env: dict | None = None, timeout: float = 60.0) -> subprocess.Popen:
    """``flowgrpo serve-reward`` in a subprocess on 127.0.0.1:``port``; returns once /health answers
    (``extra``: more CLI arguments; ``env``: the child's environment)."""
    cmd = [sys.executable, "-m", "flowgrpo.cli", "serve-reward", "--reward", reward, "--port", str(port),
           "--log-level", "warning", *[a for o in options for a in ("--option", o)], *extra]
    return wait_healthy(cmd, f"http://127.0.0.1:{port}", env, timeout)


def poll_health(url: str, alive: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll ``url``/health until it answers (any status): True then; False once ``alive()`` turns
    False (the server process exited) or ``timeout`` seconds have passed. Each poll is bounded as
    every flowgrpo client's request is (:mod:`flowgrpo.rewards.http_client`): 1 s in all, 1 MiB."""
    import httpx

    from ..rewards.http_client import MIB, HTTPLoop, ResponseRefused

    deadline = time.monotonic() + timeout
    with HTTPLoop("health-poll", 1.0) as http:
        while alive() and time.monotonic() <= deadline:
            try:
                http.run(http.fetch("GET", f"{url}/health", timeout=1.0, max_bytes=MIB))
                return True
            except ResponseRefused:  # an answer all the same
                return True
            except (httpx.HTTPError, TimeoutError):
                time.sleep(0.05)
    return False


def wait_healthy(cmd: list[str], url: str, env: dict | None = None, timeout: float = 60.0) -> subprocess.Popen:
    """Start ``cmd`` (a server), poll ``url``/health until it answers (any status) and return the
    process; raise with the server's stderr if it exits first or does not answer within ``timeout``."""
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    if poll_health(url, lambda: proc.poll() is None, timeout):
        return proc
    proc.kill()
    proc.wait()
    log.seek(0)
    raise RuntimeError(f"the reward server at {url} did not start (exit code {proc.returncode}): {log.read()[-2000:]}")
