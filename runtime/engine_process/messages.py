"""What a front and its engine processes say to each other: every message type, in one place.

The front (runtime/engine_process/data_parallel.py, runtime/engine_process/client.py: a server's HTTP process) and each engine process
(runtime/engine_process/replica.py: data parallelism's replicas, or a server's one engine apart from its front) share one
socket, framed by multiprocessing.connection. A request crosses as its key (the front's number for it, never
reused: progress of an aborted request that was on its way is dropped by key) and what the engine needs, already
tokenized and checked. What comes back at every step is one typed message, `Step` (msgspec's msgpack: no pickle
on the hot path): every completion's progress — its new token, its end, its logprobs — which the front files into
its own RequestState, detokenizing and matching stop strings there (as vLLM's front does), so that the engine's
process spends its time on steps. The rare messages (the engine's readiness, a failure, a grammar's compile,
commands) are pickled. Exceptions cross as themselves where they pickle, else as EngineError with their text.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import msgspec

from nanoinfer.loaders import LoadConfig, LoadedModel
from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine_config import EngineConfig
from runtime.engine.outputs import Progress, TokenLogprob
from runtime.engine.request_limits import RequestLimits

# -- the replica's arguments, on its stdin (runtime/executor/tp_processes.py's way: shared weights by handle) --


class ReplicaArgs(NamedTuple):
    index: int
    config: EngineConfig  # data_parallel_size 1: the replica is one engine
    device: str
    model: LoadedModel | None  # the front's, weights shared (data_parallel_from_loaded); or
    path: str | None  # the checkpoint each replica loads itself (data_parallel_from_model),
    load: LoadConfig | None  # as this says (its device: the replica's)
    threads: int | None  # torch's intra-op threads (CPU replicas share the cores)
    setup: str | None = None  # "module:function" called with (index, LLMEngine) before serving (tests' faults)
    fronts: int = 1  # the processes that send it requests (a server's API server processes), a socket each


# -- replica to front ---------------------------------------------------------------------------


class Ready(NamedTuple):
    """Sent once the engine is built: the model without its weights (config, tokenizer, name), what it serves."""

    model: LoadedModel  # params None
    limits: RequestLimits
    stats: dict


class Failed(NamedTuple):
    """Sent instead of Ready when the engine could not be built (a bad checkpoint, too little memory): the error,
    raised in the front as one engine's would be."""

    error: BaseException


class Advance(msgspec.Struct, array_like=True, gc=False):
    """One completion's progress in one step (runtime/engine/outputs.py's Progress, keyed by its request's key)."""

    key: int
    index: int
    token_id: int | None
    finished: bool
    finish_reason: str | None
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    error: bytes | None = None  # the pickled (portable) exception the engine failed the request with
    scheduled_at: float | None = None  # time.monotonic(): one clock for every process of the host
    cached_tokens: int = 0

    @classmethod
    def of(cls, key: int, p: Progress) -> "Advance":
        return cls(key, p.index, p.token_id, p.finished, p.finish_reason, p.logprob, p.prompt_logprobs,
                   None if p.error is None else pickled(p.error), p.scheduled_at, p.cached_tokens)

    def progress(self) -> Progress:
        return Progress(self.index, self.token_id, self.finished, self.finish_reason, self.logprob,
                        self.prompt_logprobs, None if self.error is None else pickle.loads(self.error),
                        self.scheduled_at, self.cached_tokens)


class Step(msgspec.Struct, array_like=True, gc=False):
    """After each step or command, as AsyncEngine's worker reports (runtime/worker.py's StepReport): one message."""

    advances: list[Advance]
    stats: dict[str, Any]
    fatal: bytes | None = None  # pickled: the engine is dead, every request of it was failed


class Beat(NamedTuple):
    """Sent by an engine process while no step has ended for BEAT_EVERY seconds: it lives, and steps since
    `busy_since` (time.monotonic(); None: idle). A front that hears nothing for SILENCE seconds, or a step older
    than its step timeout, treats the process as hung."""

    busy_since: float | None


BEAT_EVERY = 1.0  # seconds
SILENCE = 3.0  # seconds without a word from an engine process before its front kills it as hung


# Framing: one tag byte, then a Step in msgpack or any other message pickled.
_STEP, _PICKLED = b"S", b"P"
_encode_step = msgspec.msgpack.Encoder().encode
_decode_step = msgspec.msgpack.Decoder(Step).decode


def frame(message) -> bytes:
    """`message` as the bytes that cross the socket."""
    return _STEP + _encode_step(message) if isinstance(message, Step) else _PICKLED + pickle.dumps(message)


def unframe(data: bytes):
    """The message `frame` made."""
    body = memoryview(data)[1:]
    return _decode_step(body) if data[:1] == _STEP else pickle.loads(body)


class Compiled(NamedTuple):
    key: int
    error: BaseException | None  # RequestError naming what makes the grammar unusable


# -- front to replica ---------------------------------------------------------------------------


class Submit(NamedTuple):
    key: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int


class Abort(NamedTuple):
    key: int
    index: int | None = None  # one completion (its front matched a stop string), else the whole request
    reason: str = "abort"


class Compile(NamedTuple):
    key: int
    spec: Any  # nanoinfer.structured.spec.GrammarSpec


class PrepareGrammars(NamedTuple):
    pass


class Stop(NamedTuple):
    pass


def pickled(exc: BaseException) -> bytes:
    """`exc` (portable) as bytes, for a field of a typed message."""
    return pickle.dumps(portable(exc))


def portable(exc: BaseException | None) -> BaseException | None:
    """`exc` if it survives a pickle round trip, else an EngineError carrying its type and text."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception can fail to pickle, in any way
        from runtime.engine.llm_engine import EngineError

        return EngineError(f"{type(exc).__name__}: {exc}")
