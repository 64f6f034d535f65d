"""The chat WebSocket endpoint, /v1/chat/ws: the SSE stream's requests and chunks over one
connection, several requests at once.

Each client message is a JSON WsClientMessage: `{"type": "request", "id": ID, "body": {...}}`
with the body POST /v1/chat/completions takes (always streamed), or `{"type": "cancel",
"id": ID}`. The server answers per id with WsServerMessage: `chunk` messages carrying the
same chat.completion.chunk objects as the SSE stream, then `done`; or one `error` (OpenAI's
error object): a bad request, a cancelled one (code `cancelled`), an engine failure. A bad
message is answered, not fatal; closing the connection aborts everything it started.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect

from runtime import protocol as api

log = logging.getLogger("nanoinfer.server")
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(api.WsClientMessage).decode


class ChatSocket:
    """One connection: its running requests by client id."""

    def __init__(self, srv, websocket: WebSocket):
        self.srv, self.websocket = srv, websocket
        self.running: dict[str, asyncio.Task] = {}
        self._send_lock = asyncio.Lock()  # (one frame at a time from the requests' tasks)

    async def send(self, message: api.WsServerMessage) -> None:
        async with self._send_lock:
            await self.websocket.send_text(_encode(message).decode())

    async def error(self, request_id: str | None, exc: BaseException) -> None:
        from runtime.server import HTTPError

        err = HTTPError.of(exc, self.srv.engine.healthy)
        if err.status >= 500:
            log.error("websocket request %s failed: %r", request_id, exc)
        await self.send(api.WsServerMessage("error", request_id, error=err.body))

    async def serve(self) -> None:
        from runtime.server import HTTPError

        try:
            self.srv.check_access(self.websocket)
        except HTTPError as err:  # (before accepting: the handshake is refused)
            await self.websocket.close(code=1008, reason=err.body.message[:120])
            return
        await self.websocket.accept()
        try:
            while True:
                raw = await self.websocket.receive_text()
                try:
                    message = _decode(raw)
                except msgspec.DecodeError as exc:
                    await self.error(None, HTTPError(400, f"invalid message: {exc} (expected "
                                                          '{"type": "request"|"cancel", "id": ..., "body": ...})'))
                    continue
                if message.type == "cancel":
                    task = self.running.get(message.id)
                    if task is None:
                        await self.error(message.id, HTTPError(404, f"no running request with id {message.id!r}",
                                                               param="id"))
                    else:
                        task.cancel()
                elif message.id in self.running:
                    await self.error(message.id, HTTPError(400, f"id {message.id!r} is already running", param="id"))
                else:
                    self.running[message.id] = asyncio.create_task(self.run(message.id, message.body))
        except WebSocketDisconnect:
            pass
        finally:  # (a closed connection aborts what it started: cancelling a stream releases its requests)
            for task in self.running.values():
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def run(self, request_id: str, body: dict | None) -> None:
        """One chat completion, streamed as chunk messages."""
        from runtime.server import HTTPError

        handles, status = [], 499
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            req = self.srv.parse(body, api.ChatCompletionRequest)
            handles, out = await self.srv.submit_chat(rid, req)
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
            if self.websocket.client_state.name == "CONNECTED":  # (a cancel message, not a closed socket)
                try:
                    await self.send(api.WsServerMessage("error", request_id, error=api.ErrorBody(
                        "cancelled by the client", "invalid_request_error", None, "cancelled")))
                except Exception:  # noqa: BLE001 - the socket went while we answered
                    pass
        except WebSocketDisconnect:
            pass
        except Exception as exc:  # noqa: BLE001 - answered on the socket, which keeps serving
            status = HTTPError.of(exc, self.srv.engine.healthy).status
            await self.error(request_id, exc)
        finally:
            self.running.pop(request_id, None)
            if handles:
                for handle in handles:  # (a request refused before its stream began holds no slot)
                    self.srv.engine.release(handle)
                self.srv.finished(rid, handles, status)
