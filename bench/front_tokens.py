"""The server front's host work a token, without sockets or an engine: what `serve` does with one step's message.

    python bench/front_tokens.py [--tokenizer DIR] [--streams 256] [--steps 400] [--text] [--profile]

`--streams` streamed completion requests (prompts of 100-1,024 random tokens, as bench/serving.py sends) are booked
in an engine-process client (runtime/engine_process/client.py) as `serve --engine-process on` books them, each with
its SSE stream (runtime/serve/responses.py) writing into a list instead of a socket. Each step's message, one token
for every stream, is framed and unframed as it crosses the pipe, then handed to the client's report callback: filed,
detokenized, rendered and SSE-encoded — the part of the front's time a token that is ours, not the kernel's or
uvicorn's (bench/RESULTS.md, issue 60). Tokens are random ids (like the GPU bench's random weights) or, with
`--text`, a real text's tokens. Prints µs a token, best of `--repeats`; `--profile` prints cProfile's top entries.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import pstats
import random
import time

import msgspec

from nanoinfer.sampling.sampler import SamplingParams
from nanoinfer.text.tokenizer import Tokenizer
from runtime.engine.request_state import RequestState
from runtime.engine_process import messages as msg
from runtime.engine_process.client import ReplicaClient
from runtime.request_book import RequestBook
from runtime.serve import protocol as api
from runtime.serve.renderers import CompletionRenderer
from runtime.serve.responses import EventStream

TEXT = ("The engine keeps a request's tokens in its state, turns them into text as they arrive, and hands each "
        "stream its delta: a chunk of server-sent events, written at once where the client keeps up. ") * 40


class _Link:
    def post(self, message) -> None:
        pass


def _client() -> ReplicaClient:
    """An engine-process client with no process behind it: only its books and its report callback."""
    client = ReplicaClient.__new__(ReplicaClient)
    RequestBook.__init__(client)
    client.link, client._states, client._key_of, client._stats, client._fatal = _Link(), {}, {}, {}, None
    client._send, client._keys = (lambda command: None), itertools.count()
    return client


def run(tokenizer: Tokenizer, streams: int, steps: int, text: bool, seed: int = 0) -> tuple[float, int]:
    """Seconds for `steps` steps of `streams` streams, and the bytes written."""
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    client, written = _client(), []
    req = msgspec.convert({"model": "m", "prompt": "x", "stream": True, "max_tokens": steps + 1},
                          api.CompletionRequest)
    params = SamplingParams(max_tokens=steps + 1)
    keys = []
    for i in range(streams):
        prompt_ids = [rng.randrange(vocab) for _ in range(rng.randint(100, 1024))]
        state = RequestState(f"cmpl-{i}", None, prompt_ids, params, tokenizer, stream=True)
        handle = client.enqueue(state)
        keys.append(client._key_of[id(state)])
        out = CompletionRenderer(f"cmpl-{i}", "m", [handle], req, tokenizer, "fp")
        stream = EventStream(None, f"cmpl-{i}", [handle], out)
        stream.write_now = lambda body: written.append(body) or True
        handle.listen(lambda delta, s=stream: s.on_output(0, delta))
    frames = []
    for step in range(steps):
        advances = [msg.Advance(key, 0, text_ids[(step + k) % len(text_ids)] if text else rng.randrange(vocab),
                                False, None, scheduled_at=0.0) for k, key in enumerate(keys)]
        frames.append(msg.frame(msg.Step(advances, {"running": streams})))
    start = time.perf_counter()
    for data in frames:
        client._on_report([msg.unframe(data)])
    return time.perf_counter() - start, sum(map(len, written))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=".scratch/qwen06", help="a directory with tokenizer.json")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--text", action="store_true", help="a real text's tokens, not random ids")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    tokenizer = Tokenizer.from_hf_dir(a.tokenizer)
    asyncio.set_event_loop(asyncio.new_event_loop())  # (the streams' events need a loop to exist)
    tokens = a.streams * a.steps
    best = min(run(tokenizer, a.streams, a.steps, a.text)[0] for _ in range(a.repeats))
    print(f"{a.streams} streams x {a.steps} steps ({'text' if a.text else 'random ids'}): "
          f"{best / tokens * 1e6:.2f} us a token")
    if a.profile:
        prof = cProfile.Profile()
        prof.runcall(run, tokenizer, a.streams, a.steps, a.text)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
