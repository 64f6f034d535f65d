"""The chat WebSocket endpoint, /v1/chat/ws: the SSE stream's requests and chunks over one
connection, several requests at once.

Each client message is a JSON WsClientMessage: `{"type": "request", "id": ID, "body": {...}}`
with the body POST /v1/chat/completions takes (always streamed), or `{"type": "cancel",
"id": ID}`. The server answers per id with WsServerMessage: `chunk` messages carrying the
same chat.completion.chunk objects as the SSE stream, then `done`; or one `error` (OpenAI's
error object): a bad request, a cancelled one (code `cancelled`), an engine failure, a
server shutting down (code `shutting_down`). A bad message (not JSON, nested too deeply,
larger than --max-body-bytes, a binary frame) is answered with an error whose id is null, and
the connection serves on; closing the connection aborts everything it started.

A browser applies no CORS to WebSockets, so the handshake checks Origin itself: only this
server's own origin and the --cors-origin ones (a client with no Origin is no browser).
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import msgspec
from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from runtime.serve import protocol as api
from runtime.serve.http_errors import HTTPError

log = logging.getLogger("nanoinfer.server")
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(api.WsClientMessage).decode
_EXPECTED = '(expected {"type": "request"|"cancel", "id": ..., "body": ...})'


def origin_allowed(origin: str | None, host: str | None, allowed: frozenset[str]) -> bool:
    """Whether a handshake's Origin may use the socket: none (no browser), this server's own
    (its authority is the Host header the browser sent), or one `allowed` names ("*": any)."""
    if origin is None or "*" in allowed or origin.lower() in allowed:
        return True
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and host is not None and parts.netloc.lower() == host.lower()


async def refuse(websocket: WebSocket, status: int, body: bytes) -> None:
    """Refuse a handshake with an HTTP answer (uvicorn's servers can send one), else a close."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(Response(body, status, media_type="application/json"))
    else:
        await websocket.close(code=1008)


class ChatSocket:
    """One connection: its running requests by client id."""

    def __init__(self, srv, websocket: WebSocket):
        self.srv, self.websocket = srv, websocket
        self.running: dict[str, asyncio.Task] = {}
        self.cancelled: set[str] = set()  # ids the client cancelled (and no one else: a closed socket says nothing)
        self._send_lock = asyncio.Lock()  # (one frame at a time from the requests' tasks)

    async def send(self, message: api.WsServerMessage) -> None:
        async with self._send_lock:
            await self.websocket.send_text(_encode(message).decode())

    async def error(self, request_id: str | None, exc: BaseException) -> None:
        err = HTTPError.of(exc, self.srv.engine.healthy)
        if err.status == 500:
            log.error("websocket request %s failed: %r", request_id, exc)
        await self.send(api.WsServerMessage("error", request_id, error=err.body))

    async def serve(self) -> None:
        try:
            self.srv.admission.check_access(self.websocket)
            origin = self.websocket.headers.get("origin")
            if not origin_allowed(origin, self.websocket.headers.get("host"), self.srv.cors_origins):
                raise HTTPError(403, f"Origin {origin!r} may not open this WebSocket: expected this server's own "
                                     f"origin or one given with --cors-origin", param="origin",
                                code="origin_not_allowed")
            self.srv.shutdown.check_open()
        except HTTPError as err:  # (before accepting: the handshake is refused)
            log.info("WebSocket %s: %d, %s", self.websocket.url.path, err.status, err.body.message)
            await refuse(self.websocket, err.status, _encode(api.ErrorResponse(err.body)))
            return
        await self.websocket.accept()
        self.srv.shutdown.sockets.add(self)
        try:
            while True:
                frame = await self.websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                try:
                    message = self.read(frame)
                except HTTPError as err:
                    await self.error(None, err)  # (a message not read has no id)
                    continue
                try:
                    self.handle(message)
                except HTTPError as err:
                    await self.error(message.id, err)
        except WebSocketDisconnect:  # (a send while the client left)
            pass
        finally:  # (a closed connection aborts what it started: cancelling a stream releases its requests)
            self.srv.shutdown.sockets.discard(self)
            for task in self.running.values():
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)

    def read(self, frame: dict) -> api.WsClientMessage:
        """The message a frame holds, or HTTPError saying why it cannot be read: checked before
        it is decoded, as an HTTP body is."""
        text, limit = frame.get("text"), self.srv.config.max_body_bytes
        if text is None:
            raise HTTPError(400, "binary frames are not read: send each message as JSON in a text frame")
        size = len(text) if len(text) > limit or len(text) * 4 <= limit else len(text.encode())  # (UTF-8: 1-4 bytes)
        if size > limit:
            raise HTTPError(413, f"message of {len(text.encode())} bytes exceeds the limit of {limit} bytes "
                                 f"(--max-body-bytes)")
        try:
            return _decode(text)
        except msgspec.DecodeError as exc:
            raise HTTPError(400, f"invalid message: {exc} {_EXPECTED}") from exc
        except RecursionError as exc:
            raise HTTPError(400, "invalid message: it nests JSON too deeply") from exc

    def handle(self, message: api.WsClientMessage) -> None:
        if message.type == "cancel":
            task = self.running.get(message.id)
            if task is None:
                raise HTTPError(404, f"no running request with id {message.id!r}", param="id")
            self.cancelled.add(message.id)
            task.cancel()
        elif message.id in self.running:
            raise HTTPError(400, f"id {message.id!r} is already running", param="id")
        else:
            self.running[message.id] = asyncio.create_task(self.run(message.id, message.body))

    async def run(self, request_id: str, body: dict | None) -> None:
        """One chat completion, streamed as chunk messages."""
        handles, status = [], 499
        rid = self.srv.admission.new_id("chatcmpl")
        try:
            req = self.srv.admission.parse(body, api.ChatCompletionRequest)
            req = msgspec.structs.replace(req, stream=True)  # (always)
            handles, out = await self.srv.admission.submit_chat(rid, req)
            for chunk in out.start():
                await self.send(api.WsServerMessage("chunk", request_id, chunk))
            async for position, delta in self.srv.engine.merge(handles):
                for chunk in out.chunks(position, delta):
                    await self.send(api.WsServerMessage("chunk", request_id, chunk))
            for chunk in out.end():
                await self.send(api.WsServerMessage("chunk", request_id, chunk))
            await self.send(api.WsServerMessage("done", request_id))
            status = 200
        except asyncio.CancelledError:
            if request_id in self.cancelled:  # (a cancel message, not a closed socket)
                try:
                    await self.send(api.WsServerMessage("error", request_id, error=api.ErrorBody(
                        "cancelled by the client", "invalid_request_error", None, "cancelled")))
                except Exception:  # noqa: BLE001 - the socket went while we answered
                    pass
        except WebSocketDisconnect:
            pass
        except Exception as exc:  # noqa: BLE001 - answered on the socket, which keeps serving
            status = HTTPError.of(exc, self.srv.engine.healthy).status
            try:
                await self.error(request_id, exc)
            except Exception:  # noqa: BLE001 - the socket went while we answered
                pass
        finally:
            self.running.pop(request_id, None)
            self.cancelled.discard(request_id)
            if handles:
                for handle in handles:  # (a request refused before its stream began holds no slot)
                    self.srv.engine.release(handle)
                self.srv.responder.finished(rid, handles, status)
