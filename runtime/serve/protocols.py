"""uvicorn's HTTP and WebSocket protocols with the server's limits: a deadline and a size for each request's head.

HTTP is httptools' parser (llhttp, in C) on uvloop where installed: under a few hundred streams the server's
process spends its time writing chunks, and h11, pure Python, cost a third of that (bench/RESULTS.md, issue 60).
uvicorn has no deadline for a request's head and httptools no bound on its size, so this adds both: a client
sending its headers a byte every few seconds would otherwise hold a connection for ever, and one sending a
header without end would grow the parser's buffer without end.
"""

from __future__ import annotations

import asyncio
import functools
import http

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

# The ASGI scope extension under which a request finds `write_chunk_now` for its response (see there).
WRITE_CHUNK_NOW = "nanoinfer.write_chunk_now"


def write_chunk_now(cycle, body: bytes) -> bool:
    """Write `body` as the next chunk of `cycle`'s response, at once and from a plain function, if the connection
    takes it without waiting — the response's head is out, it is chunked and not done, the client is there and
    keeps up (uvicorn's flow control has not paused writing); else write nothing and say False (the caller then
    awaits ASGI's `send`, which waits for all of that). A server's stream writes a step's chunk from the engine's
    report callback so, instead of waking a task per stream per step (bench/RESULTS.md, issue 60). The framing is
    the one uvicorn's own `send` writes for a body chunk."""
    if (cycle.disconnected or cycle.flow.write_paused or not cycle.response_started or cycle.response_complete
            or not cycle.chunked_encoding):
        return False
    if body:  # (an empty chunk would end the response)
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
    return True


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size bound for each request's head (their values: a
    subclass's, made by `http_protocol`)."""

    header_timeout = 10.0  # seconds
    max_header_bytes = 16384

    # A head is in progress from a message's first byte to its last header (`_in_head`); its bytes are
    # counted there, whatever else runs on the connection (a pipelined head behind a stream included). The
    # deadline runs while the connection waits for a message to begin (opened, or its last response done
    # with nothing newer begun) and while a head arrives.
    _head_deadline: asyncio.TimerHandle | None = None
    _in_head = False
    _head_bytes = 0  # of the head in progress, fed to the parser so far
    _begun = 0  # messages begun on this connection
    _answered = 0  # responses completed

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            # (the chunk where a head began may also end the message before it: counted whole, a bound
            # that a pipelining client with a large body in the same read could trip, never one too loose)
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse(http.HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                             f"the request's head is over {self.max_header_bytes} bytes (the server's "
                             f"--max-header-bytes)")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun += 1
        self._in_head, self._head_bytes = True, 0
        if self._head_deadline is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()  # the head is in: the request runs as long as it needs
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # (an upgrade made none: a WebSocket's)
            self.scope.setdefault("extensions", {})[WRITE_CHUNK_NOW] = functools.partial(write_chunk_now, cycle)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._answered += 1
        if self._begun == self._answered and not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        waiting = self._in_head or self._begun == self._answered  # (not a request that runs)
        if waiting and not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: http.HTTPStatus, message: str) -> None:
        self._disarm()
        body = message.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                             % (status.value, status.phrase.encode(), len(body), body))
        self.transport.close()


def http_protocol(header_timeout: float, max_header_bytes: int) -> type[LimitedHttpProtocol]:
    """The HTTP protocol class: a request's head (line and headers) must arrive within `header_timeout`
    seconds of the connection opening or its previous response ending (else the connection closes), and
    hold at most `max_header_bytes` (else a 431 answer, and the connection closes)."""
    return type("HttpProtocol", (LimitedHttpProtocol,), {"header_timeout": header_timeout,
                                                          "max_header_bytes": max_header_bytes})


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, quiet about a handshake refused with an HTTP answer (a
    cross-origin page, a wrong Host, a draining server): uvicorn 0.54 logs each as the error
    "ASGI callable returned without completing handshake" (uvicorn PR #3138 fixes it)."""

    async def send(self, message) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True
