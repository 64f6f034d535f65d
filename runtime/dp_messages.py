"""What the data-parallel front and a replica process say to each other: every message type, in one place.

The front (runtime/data_parallel.py, runtime/dp_client.py) and each replica (runtime/dp_replica.py) share one
socket, framed and pickled by multiprocessing.connection. A request crosses as its key (the front's number for
it, never reused: an output of an aborted request that was on its way is dropped by key) and what the engine
needs, already tokenized and checked; its outputs come back as RequestOutputs (the replica detokenizes), and its
timings with its last one. Exceptions cross as themselves where they pickle, else as EngineError with their text.
"""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

from nanoinfer.loaders import LoadConfig, LoadedModel
from nanoinfer.sampling import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.outputs import RequestOutput
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


class Timing(NamedTuple):
    """A request's milestones in the replica (time.monotonic(): one clock for every process of the host)."""

    scheduled_at: float | None
    first_token_at: float | None
    finished_at: float | None
    token_gaps: tuple[float, ...]


class Output(NamedTuple):
    key: int
    output: RequestOutput
    timing: Timing | None  # with the request's last output


class Report(NamedTuple):
    """After each step or command, as AsyncEngine's worker reports (runtime/worker.py's StepReport)."""

    outputs: tuple[Output, ...]
    stats: dict
    fatal: BaseException | None  # the replica's engine is dead: every request of it was failed


class Compiled(NamedTuple):
    key: int
    error: BaseException | None  # RequestError naming what makes the grammar unusable


# -- front to replica ---------------------------------------------------------------------------


class Submit(NamedTuple):
    key: int
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    stream: bool


class Abort(NamedTuple):
    key: int


class Compile(NamedTuple):
    key: int
    spec: Any  # nanoinfer.structured.GrammarSpec


class PrepareGrammars(NamedTuple):
    pass


class Stop(NamedTuple):
    pass


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
