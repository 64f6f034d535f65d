"""`serve --stream-interval N`: a stream's deltas gather N tokens before they go out (its first token and
its end at once), and the text a client reads is the same as with a delta every step."""

import asyncio

import httpx
import msgspec
import pytest

from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine.outputs import Progress
from runtime.engine.request_state import RequestState
from runtime.serve.server_config import ServerConfig
from tests.live_server import LiveServer


def _taken(state: RequestState, tokens: list[int], last: bool) -> list[tuple[int, ...] | None]:
    """What `take` hands out after each token is filed (the last one ends the completion)."""
    taken = []
    for i, token in enumerate(tokens):
        end = last and i == len(tokens) - 1
        state.file(Progress(0, token, end, "length" if end else None), float(i))
        out = state.take()
        taken.append(None if out is None else out.outputs[0].token_ids)
    return taken


def test_interval_gathers_tokens_first_and_last_at_once():
    state = RequestState("r", None, [1, 2], SamplingParams(max_tokens=8), None)
    state.stream_interval = 3
    assert _taken(state, [10, 11, 12, 13, 14, 15, 16], last=True) == [
        (10,), None, None, (11, 12, 13), None, None, (14, 15, 16)]
    state = RequestState("r", None, [1, 2], SamplingParams(max_tokens=8), None)
    state.stream_interval = 3
    assert _taken(state, [10, 11, 12], last=True) == [(10,), None, (11, 12)]  # (its end: at once)


def test_interval_one_is_a_delta_a_step_and_a_waiting_request_is_unchanged():
    state = RequestState("r", None, [1], SamplingParams(max_tokens=4), None)
    assert _taken(state, [5, 6, 7], last=True) == [(5,), (6,), (7,)]
    state = RequestState("r", None, [1], SamplingParams(max_tokens=4), None, stream=False)
    state.stream_interval = 2
    assert _taken(state, [5, 6, 7], last=True) == [None, None, (5, 6, 7)]


def test_a_stop_string_ends_the_completion_at_once_while_its_delta_gathers(tiny_chat_model):
    """Stop strings are matched at every step (the engine stops decoding at once), whatever the interval: only
    the delta waits."""
    tokenizer = tiny_chat_model.tokenizer
    ids = tokenizer.encode("one two three four five six seven eight", add_special_tokens=False)
    stop_at = next(i for i in range(len(ids)) if "three" in tokenizer.decode(ids[:i + 1]))
    seen = {}
    for every in (1, 8):
        state = RequestState("r", None, [1], SamplingParams(max_tokens=len(ids), stop=["three"]), tokenizer)
        state.stream_interval = every
        for i, token in enumerate(ids):
            state.file(Progress(0, token, False, None), float(i))
            out = state.take()
            if state.stopped:
                seen[every] = (i, out.outputs[-1].finish_reason, state.completions[0].detok is not None)
                break
    assert seen[1][0] == seen[8][0] == stop_at and seen[8][1] == "stop"


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        ServerConfig(stream_interval=0)


def _chunks(url: str, body: dict) -> list[str]:
    async def go():
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                texts = []
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        choices = msgspec.json.decode(line[6:])["choices"]
                        texts += [c["text"] for c in choices if c["text"]]
                return texts
    return asyncio.run(go())


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_server_text_is_the_same_in_fewer_chunks(tiny_chat_model, live_server, engine_process):
    body = {"model": "tiny-chat", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True}
    every_step = _chunks(live_server.url, body)
    with LiveServer(tiny_chat_model, stream_interval=8, engine_process=engine_process) as gathered:
        chunks = _chunks(gathered.url, body)
    assert "".join(chunks) == "".join(every_step)
    assert len(every_step) > 20 and len(chunks) <= 40 // 8 + 2  # (the first token alone, then 8 at a time)
