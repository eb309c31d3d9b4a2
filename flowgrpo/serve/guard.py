"""Connections that never send a whole request: a header deadline and a cap on open connections.

uvicorn (0.54, h11) waits forever for a connection's header block (its keep-alive timer starts
only after a response), and its ``limit_concurrency`` answers 503 to every new request, ``/health``
included, once that many connections are open: 1,000 connections that each sent one header line
held the server for minutes, and at ``ulimit -n 1024`` an authorised ``/health`` timed out and the
server logged "Too many open files". :func:`guarded_protocol` gives uvicorn an h11 protocol with

- a header deadline: a connection that has not completed its request's header block within
  ``header_timeout_s`` of connecting, or of its previous response, is closed (no answer is sent:
  there is no request to answer). A request whose headers arrived is not affected until it is
  answered; its body has the app's own deadline (``body_timeout_s``, 408). A request answered
  before its body was read (401, 413) counts as answered: the rest of its body is not waited for,
  however slowly it trickles in (it kept uvicorn's keep-alive timer from ever firing);
- a connection cap: when a new connection makes more than ``max_connections`` open, the idle one
  (no request under way, or its answer sent) that has waited longest is closed to make room (if
  every open connection is in the middle of a request, the new one is closed instead). So idle or stalled connections can never
  lock out a client that sends its request at once, and the open sockets stay under the file limit.

A request that declares its body's length twice, with both ``Content-Length`` and
``Transfer-Encoding``, is answered 400 and its connection closed (RFC 9112 section 6.1: such a message
may be an attempt at request smuggling, and a server that answers it must close the connection): h11
alone frames the body by ``Transfer-Encoding``, answers the request, and reads whatever the
``Content-Length`` covered beyond the chunked body as the next request on the same connection.

Each header block is also capped at h11's 16 KiB (uvicorn's ``h11_max_incomplete_event_size``), so a
held connection costs a few KiB. The listening backlog is ``max_connections`` too (asyncio accepts up
to a backlog of connections in one go, before any of them can be closed), and :class:`GuardedServer`
reports a burst that still runs out of file descriptors as one warning a minute instead of a
traceback per attempt (asyncio then waits a second and accepts again).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from .codec import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS

#: at most one warning this often while the cap is being hit (an attack would flood the log)
_WARN_EVERY_S = 60.0

log = logging.getLogger("uvicorn.error")


class OneFramingConnection(h11.Connection):
    """h11's connection, refusing a request with both ``Content-Length`` and ``Transfer-Encoding``.

    The refusal is h11's :class:`h11.RemoteProtocolError`, which uvicorn answers with a 400 carrying
    ``Connection: close`` and then closes the connection, so nothing after the request's header
    block is read as another request."""

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding", error_status_hint=400)
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a connection cap and one body framing per
    request (see the module docstring); :func:`guarded_protocol` sets the two class attributes."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    _last_warning = [float("-inf")]  # shared by the connections of one server

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        size = config.h11_max_incomplete_event_size  # as uvicorn sizes its own connection
        self.conn = OneFramingConnection(h11.SERVER, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._waiting_since = time.monotonic()
        self._arm()
        # closed ones linger in the set until their connection_lost: count those still open
        if sum(not c.transport.is_closing() for c in self.connections) > self.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.idle():  # a header block is complete: a request is under way
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.idle():  # kept alive: a new deadline
            self._waiting_since = time.monotonic()
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def idle(self) -> bool:
        """True while the connection owes no answer: before its first header block is complete, and
        from a response (whether or not the client has sent all of that request's body) to the
        next request's header block."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _disarm(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and self.idle():
            self.transport.close()

    def _make_room(self) -> None:
        """Close the idle connection that has waited longest (this one if none is idle)."""
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                and not c.transport.is_closing() and c.idle()]
        victim = min(idle, key=lambda c: c._waiting_since) if idle else self
        now = time.monotonic()
        if now - self._last_warning[0] >= _WARN_EVERY_S:
            self._last_warning[0] = now
            log.warning("more than max_connections=%d connections open: closing the idle one that waited longest "
                        "for a request (logged at most once a minute)", self.max_connections)
        victim.transport.close()


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    """A :class:`GuardedH11Protocol` subclass with these limits, for ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "max_connections": int(max_connections),
                 "_last_warning": [float("-inf")]})


class GuardedServer(uvicorn.Server):
    """uvicorn's server, with asyncio's "socket.accept() out of system resource" (no file descriptor
    left for a new connection) as one warning line at most once a minute, not a traceback each time."""

    _last_warning = float("-inf")

    async def serve(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        await super().serve(sockets)

    def _loop_error(self, loop, context: dict) -> None:
        if not context.get("message", "").startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning("no file descriptor left to accept a connection (%s; open-file limit %d): new connections "
                        "wait; lower max_connections (logged at most once a minute)", context.get("exception"),
                        resource.getrlimit(resource.RLIMIT_NOFILE)[0])
