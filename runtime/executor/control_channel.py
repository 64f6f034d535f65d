"""A one-writer, many-reader ring of messages in shared memory: rank 0's orders to the ranks on its host.

Over gloo each order cost rank 0 a quarter of a millisecond a broadcast (a socket write and
the peer's reply per rank), twice a step under pipeline parallelism: on GPUs, where rank 0's
host is the bottleneck, a tenth of its step. Here the writer copies the message into the next
slot of a ring in memory every rank maps and publishes it by advancing one counter; each
reader copies it out and advances its own counter, which frees the slot once every reader has.
Nothing is a system call on the writer's side, which never waits unless the ring is full.

The buffer (`channel_bytes` of them, zeroed) is the caller's: any writable memory shared by the
processes (tensor_parallel.py passes a torch tensor in shared memory to the ranks it starts,
with the weights: no name is left in /dev/shm, whoever dies; torchrun's ranks map a file in
/dev/shm, removed once they have). Its layout, in 64-byte lines, so that no two counters share
a cache line:

- line 0: MAGIC, slots, slot size, readers (the writer's; a reader checks them);
- line 1: `written`, the number of slots published; line 2 + i: reader i's count of slots read;
- then `slots` slots of (8 bytes: the message's length in bytes, payload of `slot size` bytes).

A message longer than a slot takes consecutive slots (its length in the first), so any size
goes, streaming through a ring smaller than itself.

Readers wait for the next message without a timeout (an engine may idle for days; a rank ends
with its parent): spinning first, since an order usually follows within moments, then sleeping
in steps growing to WAIT_MAX, so that an idle engine does not keep a core busy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

MAGIC = 0x4E49_4348_414E  # "NICHAN"
LINE = 64  # bytes: a cache line
WAIT_MIN, WAIT_MAX = 50e-6, 1e-3  # seconds a waiting side sleeps, first and at most (after its spin)
# Each sleep this much longer than the one before: the last sleep, by which a wait can overrun
# the message, stays within a quarter of the wait so far; the longest comes after ~4 ms idle.
GROWTH = 1.25
FULL_CHECK = 0.05  # seconds between the writer's checks for a dead reader while the ring is full


def channel_bytes(slots: int, slot_size: int, readers: int) -> int:
    """The buffer's size for `slots` slots of `slot_size` payload bytes (a multiple of 8) and `readers` readers."""
    return LINE * (2 + readers) + slots * (8 + slot_size)


_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release are one, on every platform). The writer
    stores the payload, then `written`; a reader loads `written`, then the payload. x86 keeps
    stores in order and loads in order (TSO), so there this only costs a few nanoseconds; ARM
    (a Grace host) may reorder both, and a reader could see the counter before the bytes."""
    with _fence_lock:
        pass


class _Ring:
    """The views of a channel's buffer (numpy, no copy) that both sides use."""

    def __init__(self, buffer, slots: int, slot_size: int, readers: int):
        memory = np.frombuffer(buffer, dtype=np.uint8)
        if slot_size % 8 or slots < 1 or readers < 1:
            raise ValueError(f"a channel of {slots} slots of {slot_size} bytes for {readers} readers: expected at "
                             f"least one slot and one reader, slots a multiple of 8 bytes")
        if memory.size < channel_bytes(slots, slot_size, readers):
            raise ValueError(f"a channel buffer of {memory.size} bytes: expected at least "
                             f"{channel_bytes(slots, slot_size, readers)} for {slots} slots of {slot_size} bytes "
                             f"and {readers} readers")
        self.slots, self.slot_size, self.readers = slots, slot_size, readers
        self.layout = memory[:32].view(np.int64)
        self.written = memory[LINE:LINE + 8].view(np.int64)
        # (reader i's counter, one a line: a strided view)
        self.read = np.ndarray((readers,), np.int64, memory, offset=2 * LINE, strides=(LINE,))
        data = memory[LINE * (2 + readers):channel_bytes(slots, slot_size, readers)].reshape(slots, 8 + slot_size)
        self.lengths = data[:, :8].view(np.int64)[:, 0]
        self.payloads = data[:, 8:]


class ChannelWriter:
    """The one writer (rank 0). `check()`, called while the ring is full, raises if a reader's
    process is gone (RankLost): a dead reader never frees its slots."""

    def __init__(self, buffer, slots: int, slot_size: int, readers: int, check: Callable[[], None] = lambda: None,
                 timeout: float = 600.0, names: Callable[[int], str] = lambda i: f"reader {i}"):
        self.ring = _Ring(buffer, slots, slot_size, readers)
        self.ring.layout[:] = (MAGIC, slots, slot_size, readers)
        self.check, self.timeout, self.names = check, timeout, names
        self.count = int(self.ring.written[0])

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Publish `data` to every reader (waiting only while the ring is full)."""
        ring = self.ring
        view = memoryview(data).cast("B")
        at = 0
        while True:
            if self.count - self._oldest() >= ring.slots:
                self._wait_for_space()
            slot = self.count % ring.slots
            part = view[at:at + ring.slot_size]
            ring.lengths[slot] = len(view)
            ring.payloads[slot, :len(part)] = np.frombuffer(part, dtype=np.uint8)
            _fence()  # (the payload before the counter that publishes it)
            self.count += 1
            ring.written[0] = self.count  # (one aligned 8-byte store: a reader never sees half of it)
            at += ring.slot_size
            if at >= len(view):
                return

    def drained(self, timeout: float) -> bool:
        """Whether every reader has read every message within `timeout` seconds (at close: a reader
        that read the last order and exited is no failure, so `check` is not called)."""
        return self._wait(lambda: self._oldest() >= self.count, timeout, check=lambda: None)

    def _oldest(self) -> int:
        return int(self.ring.read.min())

    def _wait_for_space(self) -> None:
        ring = self.ring
        if not self._wait(lambda: self.count - self._oldest() < ring.slots, self.timeout):
            late = int(np.argmin(ring.read))
            raise TimeoutError(f"{self.names(late)} read no message in {self.timeout:g} s "
                               f"(the control channel's {ring.slots} slots are full)")

    def _wait(self, done: Callable[[], bool], timeout: float, check: Callable[[], None] | None = None) -> bool:
        deadline = time.monotonic() + timeout
        checked, pause = time.monotonic(), WAIT_MIN
        while not done():
            now = time.monotonic()
            if now - checked > FULL_CHECK:
                (check or self.check)()
                checked = now
            if now > deadline:
                return False
            time.sleep(pause)
            pause = min(GROWTH * pause, WAIT_MAX)
        return True


class ChannelReader:
    """Reader `index` (0-based: rank index + 1). `spin`: seconds it polls without sleeping before it
    backs off (a GPU rank's host core has nothing else to do; CPU ranks share theirs with the model)."""

    def __init__(self, buffer, index: int, spin: float = 100e-6):
        layout = np.frombuffer(buffer, dtype=np.int64, count=4)
        magic, slots, slot_size, readers = (int(v) for v in layout)
        if magic != MAGIC or not 0 <= index < readers:
            raise ValueError(f"control channel reader {index}: the buffer holds no channel for it "
                             f"(magic {magic:#x}, {readers} readers)")
        self.ring = _Ring(buffer, slots, slot_size, readers)
        self.index, self.spin = index, spin
        self.count = int(self.ring.read[index])

    def read(self) -> bytes:
        """The next message (waiting for it as long as it takes)."""
        ring = self.ring
        self._wait()
        slot = self.count % ring.slots
        length = int(ring.lengths[slot])
        out = bytearray(length)
        at = 0
        while True:
            n = min(ring.slot_size, length - at)
            out[at:at + n] = ring.payloads[slot, :n].data
            _fence()  # (the payload read before the slot is given back)
            self.count += 1
            ring.read[self.index] = self.count
            at += n
            if at >= length:
                return bytes(out)
            self._wait()
            slot = self.count % ring.slots

    def _wait(self) -> None:
        written = self.ring.written
        if written[0] > self.count:
            _fence()  # (the counter read before the payload)
            return
        begun, pause = time.perf_counter(), WAIT_MIN
        while written[0] <= self.count:
            if time.perf_counter() - begun > self.spin:
                time.sleep(pause)
                pause = min(GROWTH * pause, WAIT_MAX)
        _fence()
