"""Shutdown: a server draining refuses new requests (503), lets those in flight finish for a grace
period, then ends the rest with an error each."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from runtime.async_engine import AsyncEngine
from runtime.serve.http_errors import HTTPError

log = logging.getLogger("nanoinfer.server")


class Shutdown:
    """Whether the server still takes requests, and the graceful stop (`drain`)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.draining = False  # shutting down: new requests get 503
        self.sockets: set = set()  # the open chat WebSockets (ChatSocket), whose requests a drain waits for

    def check_open(self) -> None:
        if self.draining:
            raise HTTPError(503, "the server is shutting down and takes no new requests", type_="server_error",
                            code="shutting_down")

    def idle(self) -> bool:
        """Nothing in flight: no request in the engine, none of a WebSocket's still answering."""
        return self.engine.num_in_flight == 0 and not any(s.running for s in self.sockets)

    async def drain(self, grace: float, give_up: Callable[[], bool] = lambda: False) -> None:
        """Shutdown: refuse new requests (503), let those in flight finish for up to `grace`
        seconds, then end the rest with a 503 (an error response, an SSE `error` event, a
        WebSocket `error` per id) and wait a little for those answers to go out. `give_up`:
        stop waiting (a second Ctrl-C)."""
        self.draining = True
        if await self._wait_idle(grace, give_up):
            return
        log.warning("shutting down: %d requests still running after %g s end with an error", self.engine.num_in_flight,
                    grace)
        self.engine.abort_all(error=HTTPError(503, f"the server shut down before this request finished (it waited "
                                                   f"{grace:g} s: --shutdown-timeout)", type_="server_error",
                                              code="shutting_down"))
        await self._wait_idle(5.0, give_up)  # (an error each: written at once, unless a client stopped reading)

    async def _wait_idle(self, seconds: float, give_up: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + seconds
        while not self.idle():
            if give_up() or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True
