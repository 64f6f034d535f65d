"""LoopInbox: what a thread reports, handed to the event loop in batches — one wake-up for all that came meanwhile.

An engine's reports (a worker thread's StepReports, an engine process's Steps read by its reader thread) reach
the event loop here instead of one `call_soon_threadsafe` each. While the loop is busy — its streams writing
their chunks — the reports of several steps pile up and are handled together, so that each stream then takes
several tokens at once and writes them as one chunk: a front that falls behind its engine costs its clients a
little latency, and its cost per token falls as it does, so it never holds the engine back.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class LoopInbox(Generic[T]):
    """Items `put` from any thread reach `handle(items)` on `loop`, in order, in batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handle: Callable[[list[T]], None]):
        self._loop, self._handle = loop, handle
        self._items: list[T] = []
        self._lock = threading.Lock()
        self._posted = False  # a drain is on the loop's queue: it will take what is put meanwhile

    def put(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            if self._posted:
                return
            self._posted = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is left to tell (nor anything kept for them)
            with self._lock:
                self._items, self._posted = [], False

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._posted = self._items, [], False
        self._handle(items)
