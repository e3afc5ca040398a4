"""What ``compress serve``'s HTTP layer guards against before a request reaches its handler:
bodies too large, clients that stall, and more connections than the process has files for.

Without these, four stalled sockets (headers never finished, a body shorter than its
Content-Length, a chunked body that never ends, a connection that sends nothing) stayed open for
good, and 300 idle sockets under ``ulimit -n 256`` took every file descriptor: accepting failed
(EMFILE) and ``/health`` timed out for everyone. uvicorn (0.54-0.55) has no timeout for reading a
request, only the keep-alive one after a response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# nginx's client_header_timeout / client_body_timeout are 60 s; a client on localhost or a LAN
# sends a request's headers in milliseconds
HEADER_TIMEOUT_S = 30.0  # from the connection (or the last response) to a request's headers
BODY_TIMEOUT_S = 30.0  # the longest pause between two parts of a request's body
MAX_CONNECTIONS = 1000  # open at once; more are answered 503 and closed (see connection_cap)


def error_json(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error body, which clients read (``param``: the request field at fault)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes is a 413, from its Content-Length before it
    is read, or (chunked) once more than ``limit`` bytes have come; a body that stops arriving
    for ``timeout`` seconds is a 408. Both are raised from ``receive``, which FastAPI's body
    reader passes on as the response."""

    def __init__(self, app, limit: int, timeout: float | None = None) -> None:
        self.app, self.limit = app, limit
        self.timeout = BODY_TIMEOUT_S if timeout is None else timeout

    def _message(self, size: str) -> str:
        return (f"the request body is {size}; this server takes at most {self.limit} bytes "
                f"({self.limit >> 20} MiB): send fewer or shorter prompts per request")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            from fastapi.responses import JSONResponse

            body = error_json(413, self._message(f"{int(length)} bytes"), "invalid_request_error")
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        seen, whole = 0, False

        async def limited():
            nonlocal seen, whole
            if whole:  # after the body, receive waits for the disconnect: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:  # TimeoutError itself from 3.11
                raise HTTPException(408, f"the request body stopped arriving ({seen} bytes came, "
                                         f"then nothing for {self.timeout:g} s); send the whole "
                                         "body at once") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                whole = True
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, self._message(f"over {self.limit} bytes"))
            return message

        await self.app(scope, limited, send)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's headers (from the connection, and
    again after each response on a kept-alive one: the connection is closed) and a cap on open
    connections. Past the cap the oldest connection that waits for a request is closed to make
    room (held idle sockets kept ``/health`` at 503 for good); with none, the new one gets a
    JSON 503 and is closed before it holds a file for long. Subclasses set ``header_timeout``
    and ``max_connections`` (``protocol``)."""

    header_timeout = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS
    refused_drain_s = 1.0  # a refused connection's request is read and dropped this long

    def _idle(self) -> bool:
        """Waiting for a request: none in flight on this connection."""
        return self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete)

    def connection_made(self, transport) -> None:
        self._header_deadline, self._opened, self._refused = None, self.loop.time(), False
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11)
                    and c._idle() and not c.transport.is_closing()]
            if idle:
                min(idle, key=lambda c: c._opened).transport.close()
                self._arm_header_deadline()
                return
            message = (f"{len(self.connections) - 1} connections are open already (the bound "
                       f"is {self.max_connections}); retry later")
            body = json.dumps(error_json(503, message, "server_error")).encode()
            head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    f"retry-after: 1\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n")
            transport.write(head.encode() + body)
            # closed with its request unread, the socket reset: a client still sending a body
            # got a broken pipe, not the 503. Half-close, drop what comes, close in a moment.
            self._refused = True
            if transport.can_write_eof():
                transport.write_eof()
            self.loop.call_later(self.refused_drain_s, transport.close)
            return
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_late)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        # IDLE: no request's headers complete since the deadline was armed
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers have come
            self._cancel_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the next request on this connection

    def connection_lost(self, exc) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)


def protocol(header_timeout: float = HEADER_TIMEOUT_S,
             max_connections: int | None = None) -> type[GuardedH11]:
    """``GuardedH11`` with these bounds (``max_connections`` None: ``connection_cap()``)."""
    cap = connection_cap() if max_connections is None else max_connections
    return type("GuardedH11", (GuardedH11,),
                {"header_timeout": header_timeout, "max_connections": cap})


def uvicorn_config(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   header_timeout: float = HEADER_TIMEOUT_S, max_connections: int | None = None):
    """uvicorn's config for ``app`` on the guarded protocol (what ``serve`` and the tests run).
    The listen backlog leaves room under the open-file limit: asyncio accepts up to backlog
    sockets at once before the cap sees them, and past the limit logged a traceback for each
    (7,744 under ``ulimit -n 256``)."""
    import uvicorn

    cap = connection_cap() if max_connections is None else max_connections
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    room = 2048 if soft == resource.RLIM_INFINITY else soft - cap - 64
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=protocol(header_timeout, cap), backlog=max(16, min(2048, room)))


def connection_cap() -> int:
    """``MAX_CONNECTIONS``, or half the open-file limit where that is lower (the rest is for
    the model's files, torch and the listening socket), after raising the soft limit toward the
    hard one as servers do (vLLM raises it to 65535)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65535 if hard == resource.RLIM_INFINITY else min(hard, 65535)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:  # a container may refuse: keep its limit
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(8, min(MAX_CONNECTIONS, soft // 2))
