"""The gate of every request, before the app sees it: its headers in time (`HeadersInTime`), the body's
size limit, the API key, the whole body read (and timed), and per-request metrics."""
from __future__ import annotations

import asyncio
import hmac
import time
from typing import TYPE_CHECKING, Any

import h11
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from tierkv.serve.errors import ApiError
from tierkv.serve.metrics import Metrics

if TYPE_CHECKING:
    from tierkv.serve.app import Closing

CLOSING_POLL_S = 0.25       # how often a body still arriving looks whether the server began shutting down
BODY_IDLE_S = 30.0          # a request whose body stops arriving for this long is a 408
HEADERS_S = 30.0            # a connection whose request's headers are not whole this long after it opened, or
                            # after its last response, is answered 408 and closed
TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
             b"content-length: 37\r\n\r\nthe request's headers did not arrive\n")


class HeadersInTime(H11Protocol):
    """uvicorn's HTTP/1.1 connection (``uvicorn.Config(http=HeadersInTime)``), which waits for a
    request's headers for ever: a client that connected and sent nothing, or part of a request line,
    held the connection until it left. Its headers must now be whole within ``HEADERS_S`` of the
    connection's opening or of its last response (a slow link sends them in a few packets, not 30 s);
    then it is answered 408 and closed. A request being answered is not timed here."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:     # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:               # a request's headers came whole: it is answered now
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()                               # (first: a pipelined request the call below takes disarms it)
        super().on_response_complete()
        if self._deadline is not None and self.conn.trailing_data[0]:
            self._unset_keepalive_if_required()  # part of the next request came with this one: not an idle line

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(HEADERS_S, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._disarm()                            # (the connection is a websocket's from here)
        super().handle_websocket_upgrade(event)

    def _late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            if self.conn.their_state is h11.IDLE:   # (not a body still coming for a request answered already)
                self.transport.write(TIMED_OUT)
            self.transport.close()


class Guard:
    """Size limit, API key, the request's body and per-request metrics, before anything else sees a
    request (plain ASGI, so a streamed response still sees its client hang up). The body is read here
    whole: one past the limit is a 413 however it is sent (with a length or chunked), one that stops
    arriving a 408 after ``BODY_IDLE_S``, and one still arriving when the server shuts down a 503, so
    that a client whose body stops arriving holds neither a connection nor the shutdown (one that trickles
    a byte within every ``BODY_IDLE_S`` is still read, as a slow link is)."""

    def __init__(self, app: Any, *, metrics: Metrics, api_key: str | None, max_body_bytes: int,
                 routes: FastAPI, closing: Closing) -> None:
        self.app, self.metrics, self.api_key, self.limit = app, metrics, api_key, max_body_bytes
        self._routes, self._paths, self.closing = routes, None, closing

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, start, status = scope["path"], time.perf_counter(), [500]
        if self._paths is None:
            self._paths = {getattr(route, "path", None) for route in self._routes.routes}
        label = path if path in self._paths else "other"   # any path a client sends is not a new series
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            self._check(path, headers)
            read = await self._whole_body(receive)
        except ApiError as error:
            await JSONResponse(error.body, status_code=error.status, headers=error.headers)(scope, receive, sending)
        else:
            await self.app(scope, read, sending)
        finally:
            self.metrics.requests.labels(label, str(status[0])).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - start)

    def _check(self, path: str, headers: dict[str, str]) -> None:
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            raise _too_large(self.limit)
        if self.api_key is not None and path.startswith("/v1/"):
            scheme, _, token = headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                               kind="authentication_error", code="invalid_api_key")

    async def _whole_body(self, receive: Any) -> Any:
        """Read the request's body; returns the ``receive`` the app gets: the body in one message, then
        the client's own (its hang-up)."""
        pieces, size, first = [], 0, None
        while first is None:
            message = await self._next_piece(receive)
            if message["type"] != "http.request":
                first = message                           # it hung up: the app sees that
                break
            pieces.append(message.get("body", b""))
            size += len(pieces[-1])
            if size > self.limit:
                raise _too_large(self.limit)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(pieces), "more_body": False}
        given = [first]

        async def read() -> dict:
            return given.pop() if given else await receive()
        return read

    async def _next_piece(self, receive: Any) -> dict:
        piece = asyncio.ensure_future(receive())
        idle = time.monotonic() + BODY_IDLE_S
        try:
            while not (await asyncio.wait([piece], timeout=CLOSING_POLL_S))[0]:
                if self.closing.cut_at is not None:
                    raise ApiError(503, "the server is shutting down: the request's body had not all arrived",
                                   kind="server_error", code="server_shutdown")
                if time.monotonic() >= idle:
                    raise ApiError(408, f"the request's body stopped arriving: nothing came for {BODY_IDLE_S:g} s",
                                   code="request_timeout")
            return piece.result()
        finally:
            piece.cancel()


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server takes: at most {limit} bytes "
                         "(tierkv serve --max-body-bytes)", code="request_too_large")
