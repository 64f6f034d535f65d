"""Running the server process: its settings, uvicorn with limits for slow clients, clean stops.

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
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from nanoinfer.errors import NanoInferError
from nanoinfer.settings import check_settings, setting
from runtime.async_engine import AsyncEngine
from runtime.serve.server import LOOPBACK_HOSTS, create_app

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to bind (loopback only unless you say otherwise)")
    port: int = setting(8000, "port to bind (0 picks a free one)", minimum=0, maximum=65535)
    api_key: str | None = setting(None, "require `Authorization: Bearer KEY` on /v1/*", optional=True)
    served_model_name: str | None = setting(None, "the model id clients use (default: the model's short name or "
                                                  "file stem)", optional=True)
    cors_origin: tuple[str, ...] = setting((), "allow this origin (repeatable; CORS is off without it): its pages "
                                               "may call the API and open the WebSocket", repeated=True)
    allowed_hosts: tuple[str, ...] = setting((), "also answer this Host name (repeatable; '*': any). Without it a "
                                                 "loopback server answers only loopback names, another any name",
                                             repeated=True)
    max_pending: int = setting(1024, "sequences (prompts x n) in flight, waiting or running, before new "
                                     "requests get 503", minimum=1)
    max_n: int = setting(16, "largest n (completions per prompt) a request may ask for", minimum=1, maximum=128)
    max_body_bytes: int = setting(1 << 20, "largest request body (and WebSocket message)", minimum=1, size=True)
    log_level: str = setting("info", "info: a line per request and a throughput line; warning: quiet",
                             choices=LOG_LEVELS)
    timeout_keep_alive: int = setting(5, "seconds an idle keep-alive connection stays open", minimum=1)
    timeout_headers: float = setting(10.0, "seconds a client may take to send a request's headers", above=0)
    timeout_body: float = setting(30.0, "seconds a client may take to send a request's body (then 408)", above=0)
    shutdown_timeout: float = setting(20.0, "seconds SIGINT/SIGTERM lets requests in flight finish (new ones get "
                                            "503) before ending the rest with an error", minimum=0)
    max_header_bytes: int = setting(16384, "largest request head (line and headers) held while it arrives",
                                    minimum=1024, size=True)

    def __post_init__(self):
        check_settings(self)


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


def allowed_hosts(config: ServerConfig) -> tuple[str, ...] | None:
    """The Host names the server answers (None: any). A loopback server answers loopback names;
    with --allowed-hosts, those too, and the address it is bound to."""
    if "*" in config.allowed_hosts or (config.host not in LOOPBACK_HOSTS and not config.allowed_hosts):
        return None
    bound = () if config.host in LOOPBACK_HOSTS or config.host in ("0.0.0.0", "::", "") else (config.host,)
    return (*LOOPBACK_HOSTS, *bound, *config.allowed_hosts)


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
    name = config.served_model_name or engine.model.model_id
    app = create_app(engine, model_name=name, api_key=config.api_key, cors_origins=config.cors_origin,
                     max_pending=config.max_pending, max_n=config.max_n, max_body_bytes=config.max_body_bytes,
                     allowed_hosts=allowed_hosts(config), timeout_body=config.timeout_body)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1]
                print(f"nanoinfer: serving {name} at http://{config.host}:{port}  (chat page at /, API at /v1)",
                      flush=True)

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
