"""The control channel (runtime/executor/control_channel.py) alone, and as the engine's way to its ranks.

Alone: every reader, in its own process, gets every message in order, of any size (a slot's,
several slots', more than the whole ring), across the ring's wrap-around; the writer waits
while the ring is full and goes on once the readers catch up; a reader that dies while the
ring is full fails the writer's write naming it (through its check), one that only lags past
the timeout fails it naming that reader. With the engine: no shared memory is left behind by
an engine that closes or by rank 0 killed mid-run (the ring has no name in /dev/shm)."""

import hashlib
import multiprocessing
import os
import threading
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import pytest

from runtime.executor.control_channel import ChannelReader, ChannelWriter, channel_bytes

SLOTS, SLOT_SIZE = 8, 64
BOUND = 10.0  # seconds: the bound for a report


def messages(count: int, seed: int = 0) -> list[bytes]:
    """Varied sizes: empty, under a slot, a slot exactly, a few slots, more than the whole ring."""
    rng = np.random.default_rng(seed)
    sizes = [0, 1, SLOT_SIZE, SLOT_SIZE + 1, 3 * SLOT_SIZE, (SLOTS + 3) * SLOT_SIZE + 5]
    sizes += [int(n) for n in rng.integers(0, 4 * SLOT_SIZE, count - len(sizes))]
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_in_process(name: str, index: int, count: int, results, exit_after: int | None = None) -> None:
    """Reader `index` over the channel in shared memory `name`: the digests of `count` messages
    (or, `exit_after`: it reads that many and exits with code 3)."""
    memory = SharedMemory(name)
    reader = ChannelReader(memory.buf, index)
    got = []
    for _ in range(count):
        got.append(digest(reader.read()))
        if len(got) == exit_after:
            os._exit(3)
    results.put((index, got))
    del reader
    memory.close()


@pytest.fixture
def ring():
    memory = SharedMemory(create=True, size=channel_bytes(SLOTS, SLOT_SIZE, 2))
    try:
        yield memory
    finally:
        memory.unlink()


def readers(ring, count: int, exit_after: dict[int, int] | None = None):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=read_in_process, args=(ring.name, i, count, results, (exit_after or {}).get(i)),
                         daemon=True) for i in range(2)]
    for p in procs:
        p.start()
    return procs, results


def test_every_reader_gets_every_message_in_order(ring):
    sent = messages(200)
    writer = ChannelWriter(ring.buf, SLOTS, SLOT_SIZE, 2)  # (first: it writes the layout the readers check)
    procs, results = readers(ring, len(sent))
    for message in sent:
        writer.write(message)
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(BOUND)
    assert got == {0: [digest(m) for m in sent], 1: [digest(m) for m in sent]}
    assert writer.count > 3 * SLOTS  # (the ring wrapped around, more than once)
    assert writer.drained(0)
    del writer


def test_the_writer_waits_while_the_ring_is_full():
    """A reader that has not read yet holds the writer at the ring's size; once it reads, the
    writer goes on and both readers get everything."""
    buffer = bytearray(channel_bytes(SLOTS, SLOT_SIZE, 2))
    writer = ChannelWriter(buffer, SLOTS, SLOT_SIZE, 2)
    sent = messages(3 * SLOTS, seed=1)
    sent = [m[:SLOT_SIZE] for m in sent]  # (a slot each: the ring holds SLOTS of them)
    go = threading.Event()
    got: dict[int, list[bytes]] = {0: [], 1: []}

    def read(index: int, wait: bool) -> None:
        reader = ChannelReader(buffer, index)
        if wait:
            go.wait()
        got[index] = [reader.read() for _ in sent]

    threads = [threading.Thread(target=read, args=(0, False)), threading.Thread(target=read, args=(1, True))]
    writing = threading.Thread(target=lambda: [writer.write(m) for m in sent])
    for t in [*threads, writing]:
        t.start()
    deadline = time.monotonic() + BOUND
    while writer.count < SLOTS and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert writer.count == SLOTS and writing.is_alive()  # (full: it waits for reader 1)
    go.set()
    for t in [writing, *threads]:
        t.join(BOUND)
    assert got == {0: sent, 1: sent}


def test_a_reader_that_dies_fails_the_writer_naming_it(ring):
    """Reader 1 exits after two messages: the ring fills, and the writer's check (the engine's:
    RankLost) names it within the bound, rather than waiting for it forever."""
    procs = []

    def check() -> None:
        for i, p in enumerate(procs):
            if p.exitcode is not None:
                raise RuntimeError(f"reader {i} exited (code {p.exitcode})")

    writer = ChannelWriter(ring.buf, SLOTS, SLOT_SIZE, 2, check=check)
    started, _queue = readers(ring, 10 * SLOTS, exit_after={1: 2})  # (the queue kept: the readers unpickle it)
    procs += started
    with pytest.raises(RuntimeError, match=r"reader 1 exited \(code 3\)"):
        for message in messages(10 * SLOTS, seed=2):
            writer.write(message)
    begun = time.monotonic()
    with pytest.raises(RuntimeError, match="reader 1 exited"):
        writer.write(b"x" * SLOT_SIZE * SLOTS)
    assert time.monotonic() - begun < BOUND
    for p in procs:
        p.kill()
        p.join(BOUND)
    del writer


def test_a_reader_that_lags_past_the_timeout_is_named():
    buffer = bytearray(channel_bytes(SLOTS, SLOT_SIZE, 2))
    writer = ChannelWriter(buffer, SLOTS, SLOT_SIZE, 2, timeout=0.2, names=lambda i: f"tensor-parallel rank {i + 1}")
    ChannelReader(buffer, 1)  # (attached, never reads)
    reader = ChannelReader(buffer, 0)
    for _ in range(SLOTS):
        writer.write(b"order")
        assert reader.read() == b"order"
    with pytest.raises(TimeoutError, match=r"tensor-parallel rank 2 read no message in 0.2 s"):
        writer.write(b"one too many")


def test_a_buffer_without_a_channel_is_named():
    with pytest.raises(ValueError, match="control channel reader 0: the buffer holds no channel"):
        ChannelReader(bytearray(channel_bytes(SLOTS, SLOT_SIZE, 1)), 0)
    with pytest.raises(ValueError, match="expected at least"):
        ChannelWriter(bytearray(100), SLOTS, SLOT_SIZE, 1)


def shared_memory_of(pids) -> list[str]:
    """/dev/shm's entries that torch made for these processes (its names carry the maker's pid)."""
    return [n for n in os.listdir("/dev/shm") if any(f"_{pid}_" in n for pid in pids)]


def test_the_engine_leaves_no_shared_memory():
    """The ring goes to the ranks as the weights do (a descriptor, no name): none is in /dev/shm
    while the engine runs, nor after close."""
    from tests.test_tp_ranks import engine, greedy

    core = engine(2)
    try:
        assert greedy(core) and core.executor.tp.channel.count > 0
        pids = [os.getpid(), *(p.pid for p in core.executor.tp.procs)]
        assert shared_memory_of(pids) == []
    finally:
        core.close()
    assert shared_memory_of(pids) == []


KILLED = """
import json, os, signal, sys
from tests.test_tp_ranks import engine, greedy

core = engine(2)
greedy(core)
print(json.dumps([os.getpid(), *(p.pid for p in core.executor.tp.procs)]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_rank_0_killed_leaves_no_rank_and_no_shared_memory():
    """Rank 0 killed while its rank waits on the channel: the rank exits within the bound (it
    watches its parent), and nothing of the ring is left in /dev/shm."""
    import json
    import subprocess
    import sys

    from tests.test_tensor_parallel import running
    from tests.test_tp_ranks import ROOT

    done = subprocess.run([sys.executable, "-c", KILLED], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == -9, done.stderr[-3000:]
    pids = json.loads(done.stdout.splitlines()[-1])
    deadline = time.monotonic() + BOUND
    while any(running(pid) for pid in pids[1:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in pids[1:])
    assert shared_memory_of(pids) == []
