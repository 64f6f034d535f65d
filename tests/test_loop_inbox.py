"""LoopInbox: a thread's reports reach the event loop in order, in batches while the loop is busy (runtime/loop_inbox.py)."""

from __future__ import annotations

import asyncio
import threading
import time

from runtime.loop_inbox import LoopInbox


def test_what_comes_while_the_loop_is_busy_arrives_as_one_batch_in_order():
    batches: list[list[int]] = []

    async def main():
        inbox = LoopInbox(asyncio.get_running_loop(), batches.append)
        inbox.put(0)
        await asyncio.sleep(0.05)  # drained alone: the loop was free
        sent = threading.Event()

        def report():
            for i in range(1, 101):
                inbox.put(i)
            sent.set()
        threading.Thread(target=report).start()
        sent.wait(5)  # the loop is busy (blocked here) while the thread reports: one drain takes them all
        await asyncio.sleep(0.05)
        inbox.put(101)
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert batches == [[0], list(range(1, 101)), [101]]


def test_a_closed_loop_is_not_an_error_for_the_reporting_thread():
    loop = asyncio.new_event_loop()
    inbox = LoopInbox(loop, lambda items: None)
    loop.close()
    for i in range(1000):
        inbox.put(i)  # (an engine's last reports, after its server's loop ended: dropped, none kept)
    assert inbox._items == []


def test_a_stream_that_falls_behind_gets_its_tokens_as_fewer_larger_chunks(tiny_chat_model):
    """A front whose loop is held up (here: blocked for 0.3 s) takes the steps that came meanwhile together, and
    each stream writes them as one chunk: the same text, in fewer events."""
    import httpx

    from tests.live_server import LiveServer

    with LiveServer(tiny_chat_model) as server:
        body = {"prompt": "The sea", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(line)
                    break
            server.engine._loop.call_soon_threadsafe(time.sleep, 0.3)  # the loop busy: steps pile up
            events += [line for line in lines if line.startswith("data: {")]
        import json

        texts = [json.loads(e[len("data: "):])["choices"][0]["text"] for e in events]
        assert "".join(texts) == whole
        assert len(events) < 40  # some chunks carry several tokens
