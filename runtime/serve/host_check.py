"""HostCheck: ASGI middleware refusing a Host header the server does not answer (DNS rebinding), before any route.

It covers every route alike: the API, the chat page, static files, 404s and the WebSocket handshake.
"""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.datastructures import Headers
from starlette.websockets import WebSocket

from runtime.serve import protocol as api
from runtime.serve.server_config import ServerConfig, allowed_hosts
from runtime.serve.http_errors import HTTPError, error_response
from runtime.serve.websocket import refuse

log = logging.getLogger("nanoinfer.server")
_encode = msgspec.json.Encoder().encode
# A Host header as RFC 9110 has it: a name or IPv4 address, or an IPv6 address in brackets, then
# an optional numeric port. Anything else (`127.0.0.1:80@evil.example`) is refused, not guessed at.
_HOST = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::[0-9]{1,5})?")


class HostCheck:
    """The app behind it sees only requests whose Host `config` allows (all, if it names none)."""

    def __init__(self, app, config: ServerConfig):
        self.app = app
        hosts = allowed_hosts(config)
        self.allowed = None if hosts is None else \
            {f"[{h}]" if ":" in h and not h.startswith("[") else h for h in map(str.lower, hosts)}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            try:
                hosts = Headers(scope=scope).getlist("host")
                if len(hosts) > 1:  # (RFC 9112 §3.2: a request with more than one is refused, whatever they say)
                    raise HTTPError(400, f"{len(hosts)} Host headers: a request has one", param="host")
                self.check(hosts[0] if hosts else None)
            except HTTPError as err:
                log.info("%s %s: %d, %s", scope.get("method", "WebSocket"), scope["path"], err.status, err.body.message)
                if scope["type"] == "websocket":
                    await refuse(WebSocket(scope, receive, send), err.status, _encode(api.ErrorResponse(err.body)))
                else:
                    await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, host: str | None) -> None:
        """The Host header is one this server answers (a request without one is no browser's)."""
        if self.allowed is None or host is None:
            return
        match = _HOST.fullmatch(host)
        if match is None:
            raise HTTPError(400, f"Host {host!r} is malformed: expected host[:port] (an IPv6 address in brackets)",
                            param="host")
        name = f"[{match['ipv6']}]" if match["ipv6"] is not None else match["name"]
        if name.lower() not in self.allowed:
            # A page on another site that resolves its name to this server's address (DNS
            # rebinding) would otherwise reach it from the user's browser.
            raise HTTPError(400, f"Host {host!r} is not allowed: this server answers only "
                                 f"{sorted(self.allowed)} (--allowed-hosts adds names)", param="host")
