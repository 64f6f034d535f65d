"""Running the server process: uvicorn with limits for slow clients, clean stops (its settings: config.py).

`serve(engine, config)` binds, prints the URL and serves until SIGINT/SIGTERM; then it drains:
new requests get 503 while those in flight have --shutdown-timeout seconds to finish, and what
is left ends with an error (a 503, an SSE `error` event, a WebSocket `error` per id) before
connections close. The HTTP app itself is runtime/serve/server.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from nanoinfer.errors import NanoInferError
from runtime.async_engine import AsyncEngine
from runtime.serve.config import ServerConfig, allowed_hosts
from runtime.serve.server import create_app


def _protocol(header_timeout: float):
    """uvicorn's h11 protocol with a deadline for each request's head: uvicorn has none, so a
    client sending its headers a byte every few seconds would hold a connection for ever."""
    class Protocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self._head_deadline is not None:
                self._head_deadline.cancel()  # the head is in: the request runs as long as it needs
                self._head_deadline = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request on this connection gets its own deadline

        def connection_lost(self, exc):
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            self._head_deadline = self.loop.call_later(header_timeout, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()
    return Protocol


class _WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, quiet about a handshake refused with an HTTP answer (a
    cross-origin page, a wrong Host, a draining server): uvicorn 0.54 logs each as the error
    "ASGI callable returned without completing handshake" (uvicorn PR #3138 fixes it)."""

    async def send(self, message) -> None:
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True


def check_port_free(host: str, port: int) -> None:
    """Fail before loading a model for minutes, not after."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise NanoInferError(f"port {port} on {host} {why}: pick another with --port") from exc


def serve(engine: AsyncEngine, config: ServerConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if allowed_hosts(config) is None:
        logging.getLogger("nanoinfer.server").warning(
            "answering any Host name: a page on another site can reach this server through DNS rebinding "
            "(--allowed-hosts names the ones to answer)")
    build_server(engine, config).run()


def build_server(engine: AsyncEngine, config: ServerConfig) -> uvicorn.Server:
    """The uvicorn server `serve` runs: SIGINT/SIGTERM set its `should_exit` (a test running it
    in a thread sets that itself), and its shutdown drains before closing connections."""
    app = create_app(engine, config)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1]
                print(f"nanoinfer: serving {app.state.model_name} at http://{config.host}:{port}  (chat page at /, "
                      f"API at /v1)", flush=True)

        async def shutdown(self, sockets=None):
            # SIGINT/SIGTERM: drain while still listening (new requests get a 503, not a refused
            # connection), so that every request in flight ends with its answer or an error
            # before uvicorn closes connections (a WebSocket with 1012 at once).
            await app.state.drain(config.shutdown_timeout, give_up=lambda: self.force_exit)
            await super().shutdown(sockets)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its graceful stop, so the process would die
            # by SIGTERM; a clean stop on request is a normal exit here (status 0).
            self._captured_signals.clear()

    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
        timeout_graceful_shutdown=10, timeout_keep_alive=config.timeout_keep_alive,
        http=_protocol(config.timeout_headers), h11_max_incomplete_event_size=config.max_header_bytes,
        ws=_WebSocketProtocol, ws_max_size=config.max_body_bytes)
    return Server(uvicorn_config)
