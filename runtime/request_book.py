"""RequestBook: the event loop's side of the requests in flight — a handle each, the one way one ends, and how
its consumer reads its outputs (RequestReader).

AsyncEngine (runtime/async_engine.py) is a RequestBook that a worker thread feeds: it admits requests
(`_add`), and the worker's reports reach their consumers through `_deliver`. Everything here runs on the
event loop; the worker is reached only through `_send`.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Sequence

import msgspec

from nanoinfer.errors import RequestError
from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine.llm_engine import Prompt, cheap_to_prepare, failed
from runtime.engine.outputs import CompletionOutput, RequestOutput
from runtime.engine.request_state import RequestState, merge
from runtime.worker import Abort, Submit


async def made_off_the_loop(new_request: Callable[..., RequestState], prompt: Prompt, params, **kwargs
                            ) -> RequestState:
    """`new_request(prompt, params, **kwargs)` (a request rendered, tokenized and checked): on the loop for a prompt
    cheaper to check than a thread hop (`cheap_to_prepare`: token ids, a short text), else on a thread, so that a
    long one (a chat with 2,000 tools, a megabyte of text) never stalls the loop."""
    if cheap_to_prepare(prompt, params):
        return new_request(prompt, params, **kwargs)
    return await asyncio.to_thread(new_request, prompt, params, **kwargs)


class RequestHandle:
    """The consumer's side of one request (see `AsyncEngine.submit`): the outputs the worker
    delivered that it has not taken yet, and whether it has ended here. Its timings and
    counts are the request's (`state`, kept by the engine thread)."""

    def __init__(self, state: RequestState):
        self.state = state
        self.pending: list[RequestOutput] = []
        self.wakeup = asyncio.Event()
        self.ended: str | None = None  # ended on this side (an abort) before the engine said so
        self.final_seen = False  # the request's last output has been taken
        self.retired = False  # out of the engine's books: finished, failed or aborted
        # Called with each output as it arrives, in place of `pending` and `wakeup` (see `listen`).
        self.listener: Callable[[RequestOutput], None] | None = None

    def __getattr__(self, name: str):  # request_id, prompt, prompt_ids, params, arrival, ...
        return getattr(self.state, name)

    @property
    def finished(self) -> bool:
        return self.ended is not None or self.state.finished

    @property
    def finish_reasons(self) -> list[str | None]:
        return [r or self.ended for r in self.state.finish_reasons]

    def listen(self, listener: Callable[[RequestOutput], None]) -> None:
        """From now on, hand each output to `listener` on the loop as it arrives (what came before, first): a
        server's stream writes its chunk there and then, where waking a task per stream per step cost it more than
        the write (bench/RESULTS.md, issue 60). `listener` must not raise."""
        self.listener = listener
        if self.pending:
            self.put(self.take_pending())

    def put(self, out: RequestOutput) -> None:
        """`out` to the consumer: its listener's now, or kept for its next `take` and its wait woken."""
        if self.listener is None:
            self.pending.append(out)
            self.wakeup.set()
            return
        self.final_seen = out.finished
        self.listener(out)

    def take_pending(self) -> RequestOutput:
        out, self.pending = merge(self.pending), []
        return out

    def take(self) -> RequestOutput | None:
        """What arrived since the last call, as one output (None: nothing new). Raises
        EngineError if the engine failed the request."""
        if not self.pending:
            return None
        out = self.take_pending()
        self.final_seen = out.finished
        if out.error is not None:
            raise failed(out)
        return out


class RequestReader:
    """How a consumer reads submitted requests: as deltas (`stream`, `merge`) or whole
    (`generate`, `collect`). The engine underneath provides `submit` and `release`: one
    RequestBook (AsyncEngine), or the replicas' (runtime/engine_process/data_parallel.py)."""

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0, chat_template_kwargs: dict | None = None, *, stream: bool = True) -> RequestHandle:
        raise NotImplementedError

    def release(self, request: RequestHandle) -> None:
        raise NotImplementedError

    async def __aenter__(self):
        """`async with engine:` starts it (its worker threads) and shuts it down at the end."""
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                     priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's progress as deltas: each item carries only the new text and ids;
        the last has `finish_reason` set. Leaving the loop early, or `aclose()`, aborts it."""
        request = self.submit(prompt, params, request_id, priority)
        try:
            async for out in self._outputs(request):
                yield out
        finally:  # (closing this generator does not close the inner one: release now, not at its collection)
            self.release(request)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                       priority: int = 0, chat_template_kwargs: dict | None = None) -> RequestOutput:
        """Run one request to completion; the whole text and ids."""
        return await self.collect(self.submit(prompt, params, request_id, priority, chat_template_kwargs,
                                              stream=False))

    # -- consuming ------------------------------------------------------------------------------

    async def _outputs(self, request: RequestHandle) -> AsyncIterator[RequestOutput]:
        """`request`'s outputs as they arrive, until its last; released however the loop ends."""
        try:
            while not request.final_seen:
                await request.wakeup.wait()
                request.wakeup.clear()
                out = request.take()
                if out is not None:
                    yield out
        finally:
            self.release(request)

    async def merge(self, requests: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(position in `requests`, delta) from several submitted requests as they progress;
        leaving early aborts those still running (the server's multi-prompt streams)."""
        wakeup = asyncio.Event()
        for request in requests:  # one event for all: one wait covers every request
            request.wakeup = wakeup
        wakeup.set()  # (outputs may have arrived before this started)
        try:
            while not all(r.final_seen for r in requests):
                await wakeup.wait()
                wakeup.clear()
                for i, request in enumerate(requests):
                    out = request.take()
                    if out is not None:
                        yield i, out
        finally:
            for request in requests:
                self.release(request)

    async def collect(self, request: RequestHandle) -> RequestOutput:
        """Wait for a submitted request's end; the whole text, ids and logprobs of each
        completion. Cancelling the wait aborts the request."""
        parts = [out async for out in self._outputs(request)]
        whole = merge(parts)
        n = request.params.n
        if len(whole.outputs) < n:  # (every completion, even one that produced nothing)
            have = {c.index for c in whole.outputs}
            whole = msgspec.structs.replace(whole, outputs=tuple(sorted(
                whole.outputs + tuple(CompletionOutput(i, "", (), None) for i in range(n) if i not in have),
                key=lambda c: c.index)))
        return msgspec.structs.replace(whole, finished=True)


class RequestBook(RequestReader):
    """The requests in flight by id, until each is retired (finished, failed or aborted)."""

    def __init__(self):
        self._requests: dict[str, RequestHandle] = {}  # by request id, until retired
        self._num_seqs = 0  # sequences of the requests in `_requests`
        self._num_prompt_tokens = 0  # their prompts' tokens
        self._send: Callable[[Submit | Abort], None] | None = None  # the worker's commands, while it runs

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet finished (waiting, running or swapped)."""
        return len(self._requests)

    @property
    def num_seqs_in_flight(self) -> int:
        """Their sequences: a request with n completions counts n."""
        return self._num_seqs

    @property
    def num_prompt_tokens_in_flight(self) -> int:
        """Their prompts' tokens (a data-parallel router's measure of queued work)."""
        return self._num_prompt_tokens

    def holds(self, request_id: str) -> bool:
        """Whether a request with this id is in flight here."""
        return str(request_id) in self._requests

    def _check_free(self, request_id: str | None) -> None:
        if request_id is not None and self.holds(request_id):
            raise RequestError(f"request_id {request_id!r} is already in flight", param="request_id")

    def _add(self, state: RequestState) -> RequestHandle:
        """Book a checked request and hand it to the worker."""
        while state.request_id in self._requests:  # (an automatic id that a caller's took)
            state.request_id = f"{state.request_id}+"
        request = RequestHandle(state)
        state.owner = request
        self._requests[state.request_id] = request
        self._num_seqs += state.params.n
        self._num_prompt_tokens += len(state.prompt_ids)
        self._send(Submit(state))
        return request

    def _deliver(self, outputs) -> None:
        """Hand each (state, output) the worker reported to its request's consumer and wake it."""
        for state, out in outputs:
            request: RequestHandle = state.owner
            if request.ended is not None:
                continue  # ended here already (an abort): nothing more reaches its consumer
            if out.finished:
                self._retire(request)
            request.put(out)

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort" and its blocks are freed
        at the worker's next command drain (within one step)."""
        request = self._requests.get(str(request_id))
        if request is not None:
            self._end(request, "abort")

    def abort_all(self, error: BaseException | None = None) -> None:
        """Abort every request in flight (shutdown: their streams end at once). With `error`,
        each consumer raises EngineError from it (a server ending what it could not finish)
        instead of seeing finish_reason "abort"."""
        for request in list(self._requests.values()):
            self._end(request, "abort", error)

    def release(self, request: RequestHandle) -> None:
        """The consumer is gone: abort the request if it is still running (synchronously, so
        its id is free again and its blocks are freed within a step)."""
        if not request.finished:
            self._end(request, "abort")
        self._retire(request)

    # -- the one way a request ends here ---------------------------------------------------------

    def _end(self, request: RequestHandle, reason: str, error: BaseException | None = None) -> None:
        """End `request` on this side now: its consumer sees `reason` (or raises from `error`)
        at once, and the worker aborts it."""
        if not request.finished and self._send is not None:
            request.ended = reason
            self._send(Abort(request.state))
            outputs = tuple(CompletionOutput(i, "", (), reason) for i, r in enumerate(request.state.finish_reasons)
                            if r is None)
            self._retire(request)
            request.put(RequestOutput(request.request_id, request.prompt, request.state.prompt_ids_tuple, outputs, True,
                                      None, request.cached_tokens, error))
        self._retire(request)
        request.wakeup.set()

    def _retire(self, request: RequestHandle) -> None:
        if request.retired:
            return
        request.retired = True
        self._num_seqs -= request.params.n
        self._num_prompt_tokens -= len(request.prompt_ids)
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
