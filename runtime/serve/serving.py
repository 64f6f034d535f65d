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

import uvicorn

from nanoinfer.errors import NanoInferError
from runtime.async_engine import AsyncEngine
from runtime.serve.server_config import ServerConfig, allowed_hosts
from runtime.serve.protocols import WebSocketProtocol, http_protocol
from runtime.serve.server import create_app


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


def serve(engine: AsyncEngine, config: ServerConfig, *, sockets: list[socket.socket] | None = None,
          index: int = 0) -> None:
    """Serve `engine` until SIGINT/SIGTERM. With --api-server-count N > 1, the first API server (`index` 0,
    binding the port) starts the other N - 1 (runtime/serve/api_servers.py), which come here with their own
    `sockets` on the same port."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if allowed_hosts(config) is None and index == 0:
        logging.getLogger("nanoinfer.server").warning(
            "answering any Host name: a page on another site can reach this server through DNS rebinding "
            "(--allowed-hosts names the ones to answer)")
    others = None
    if config.api_server_count > 1 and index == 0:
        from runtime.serve.api_servers import ApiServers, listening_socket

        sockets = [listening_socket(config.host, config.port)]
        others = ApiServers(engine, config, sockets[0].getsockname()[1])
        try:
            others.wait_serving()
        except BaseException:
            others.stop(0.0)
            raise
    build_server(engine, config, others, index).run(sockets=sockets)


def build_server(engine: AsyncEngine, config: ServerConfig, others=None, index: int = 0) -> uvicorn.Server:
    """The uvicorn server `serve` runs: SIGINT/SIGTERM set its `should_exit` (a test running it
    in a thread sets that itself), and its shutdown drains before closing connections (with the
    other API servers, `others`, draining at the same time)."""
    app = create_app(engine, config)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1]
                what = f"serving {app.state.model_name}" if index == 0 else f"API server {index} serving"
                print(f"nanoinfer: {what} at http://{config.host}:{port}  (chat page at /, API at /v1)", flush=True)

        async def shutdown(self, sockets=None):
            # SIGINT/SIGTERM: drain while still listening (new requests get a 503, not a refused
            # connection), so that every request in flight ends with its answer or an error
            # before uvicorn closes connections (a WebSocket with 1012 at once). The other API
            # servers drain theirs meanwhile, and are gone before the engine stops.
            if others is not None:
                others.terminate()
            await app.state.drain(config.shutdown_timeout, give_up=lambda: self.force_exit)
            if others is not None:
                from runtime.serve.api_servers import STOP_GRACE

                await asyncio.to_thread(others.stop, config.shutdown_timeout + STOP_GRACE)
            await super().shutdown(sockets)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its graceful stop, so the process would die
            # by SIGTERM; a clean stop on request is a normal exit here (status 0).
            self._captured_signals.clear()

    return Server(uvicorn_config(app, config))


def uvicorn_config(app, config: ServerConfig, **overrides) -> uvicorn.Config:
    """uvicorn's settings for serving `app` as `config` says (a test's LiveServer changes the binding)."""
    settings = dict(host=config.host, port=config.port, log_level=config.log_level, access_log=False,
                    timeout_graceful_shutdown=10, timeout_keep_alive=config.timeout_keep_alive,
                    http=http_protocol(config.timeout_headers, config.max_header_bytes),
                    loop="auto",  # uvloop where installed (not on Windows): its loop and writes are C
                    ws=WebSocketProtocol, ws_max_size=config.max_body_bytes)  # (a larger message is never read)
    return uvicorn.Config(app, **{**settings, **overrides})
