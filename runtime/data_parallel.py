"""DataParallelEngine: N engine replicas behind one asyncio front (`data_parallel_size`), each request routed to one.

Each replica is a whole AsyncEngine (its worker thread, scheduler, KV pool and prefix cache) over its own copy of
the model on its own device: replica i on cuda:base + i * tensor_parallel_size (base: the device asked for, cuda:0
by default), every replica on the CPU there. A request goes to the replica that ReplicaRouter picks
(runtime/replica_router.py: the longest cached prefix of its prompt, else the least loaded) and stays there;
nothing else crosses replicas. The server and `nanoinfer serve --data-parallel-size N` use it as they use an
AsyncEngine: the same methods (`prepare`, `enqueue`, `submit`, `stream`, `generate`, `merge`, `collect`, `abort`,
`release`, `stats`, `healthy`, `shutdown`), with `stats()` per replica besides the totals.

A replica whose device fails (DeviceLost, a fatal step) fails its own requests, as one engine does; the others
keep theirs and take every new request. The front is healthy while one replica is (stats() and /metrics say
which is not); when none is, new requests are refused as by a dead engine.

Not supported here: tensor parallelism inside a replica (each tensor-parallel engine holds torch.distributed's
default process group, one per process), and the offline LLM, which runs one engine (LLMEngine refuses
data_parallel_size > 1 by name).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Sequence

import torch

from nanoinfer.errors import RequestError
from nanoinfer.loaders import LoadedModel, load_model, resolve_device
from nanoinfer.model import map_params
from nanoinfer.sampling import SamplingParams
from runtime.async_engine import AsyncEngine, EngineError, Prompt, RequestHandle
from runtime.config import EngineConfig, load_and_engine_configs
from runtime.engine.request_state import RequestState
from runtime.replica_router import Load, ReplicaRouter
from runtime.request_book import RequestReader

# Stats that are not counts: per replica only (a total would mean nothing).
NOT_SUMMED = ("healthy",)


def replica_devices(device: torch.device, replicas: int, tensor_parallel_size: int = 1) -> list[torch.device]:
    """Each replica's device (its tensor-parallel rank 0's): on CUDA cuda:k, cuda:k+T, ... from `device` = cuda:k
    (T ranks each take T GPUs in a row); on the CPU the CPU for all. RequestError when the GPUs are too few."""
    if device.type != "cuda":
        return [device] * replicas
    first, count = device.index or 0, torch.cuda.device_count()
    last = first + replicas * tensor_parallel_size - 1
    if last >= count:
        raise RequestError(f"data_parallel_size={replicas} x tensor_parallel_size={tensor_parallel_size} needs GPUs "
                           f"cuda:{first}..cuda:{last}, but this machine has {count} (cuda:0..cuda:{count - 1})",
                           param="data_parallel_size")
    return [torch.device("cuda", first + i * tensor_parallel_size) for i in range(replicas)]


def _on(model: LoadedModel, device: torch.device) -> LoadedModel:
    """`model` with its weights on `device` (the same tensors where they are there already: CPU replicas share
    their read-only weights)."""
    if model.params.device == device:
        return model
    return dataclasses.replace(model, params=map_params(lambda t: t.to(device), model.params))


class _ReplicasGrammars:
    """Structured output's compilers, one per replica (each engine thread keeps its own llguidance matchers and
    threads): the server compiles a request's grammar on every replica before it is routed, so that the
    replica that takes it finds it compiled."""

    def __init__(self, replicas: Sequence[AsyncEngine]):
        self.replicas = replicas

    def prepare(self) -> None:
        for replica in self.replicas:
            replica.grammars.prepare()

    def compile(self, spec) -> Future:
        """A future done when every replica's compile is: None, or the first one's RequestError."""
        futures = [replica.grammars.compile(spec) for replica in self.replicas]
        done, lock, left = Future(), threading.Lock(), [len(futures)]

        def one_done(_) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            error = next((f.exception() for f in futures if f.exception() is not None), None)
            done.set_exception(error) if error is not None else done.set_result(None)
        for future in futures:
            future.add_done_callback(one_done)
        return done


class DataParallelEngine(RequestReader):
    """AsyncEngine's interface over `replicas` (AsyncEngines of one model and one EngineConfig, not started).
    Use as `async with engine:` (start/shutdown), as an AsyncEngine."""

    def __init__(self, replicas: Sequence[AsyncEngine]):
        if len(replicas) < 2:
            raise ValueError(f"{len(replicas)} replica(s): data parallelism takes two or more (one: an AsyncEngine)")
        self.replicas = tuple(replicas)
        first = self.replicas[0]
        self.model, self.tokenizer = first.model, first.tokenizer
        config = first.core.config
        self.router = ReplicaRouter([r.stats()["total_blocks"] for r in self.replicas], config.block_size,
                                    config.enable_prefix_caching)
        self.grammars = _ReplicasGrammars(self.replicas)
        self._replica_of: weakref.WeakKeyDictionary[RequestHandle, AsyncEngine] = weakref.WeakKeyDictionary()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas:
            replica.start()

    async def shutdown(self) -> None:
        """Every replica's shutdown, all of them even when one fails (its error raised after)."""
        self._loop = None
        results = await asyncio.gather(*(replica.shutdown() for replica in self.replicas), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    @property
    def healthy(self) -> bool:
        """False once every replica's device failed for good (one that did is in `stats()`)."""
        return any(replica.healthy for replica in self.replicas)

    def stats(self) -> dict:
        """The counts of every replica summed (as one AsyncEngine's `stats()`), `healthy` (as the property) and
        `replicas`: each replica's own `stats()`, in order."""
        per = [replica.stats() for replica in self.replicas]
        totals = {key: sum(s[key] for s in per) for key in per[0] if key not in NOT_SUMMED}
        return {**totals, "healthy": self.healthy, "replicas": per}

    @property
    def num_in_flight(self) -> int:
        return sum(replica.num_in_flight for replica in self.replicas)

    @property
    def num_seqs_in_flight(self) -> int:
        return sum(replica.num_seqs_in_flight for replica in self.replicas)

    # -- requests ----------------------------------------------------------------------------

    def _check_open(self, request_id: str | None) -> AsyncEngine:
        """The replica that checks requests (all check alike: the first healthy one), once the front
        takes them and `request_id` is free."""
        if self._loop is None:
            raise RuntimeError("the engine is not running: use `async with engine:` or call start()")
        if not self.healthy:
            fatal = self.replicas[0]._fatal
            raise EngineError(f"every replica is unhealthy (restart the server): {fatal!r}") from fatal
        if request_id is not None and any(r.holds(request_id) for r in self.replicas):
            raise RequestError(f"request_id {request_id!r} is already in flight", param="request_id")
        return next(r for r in self.replicas if r.healthy)

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0, chat_template_kwargs: dict | None = None, *, stream: bool = True
               ) -> RequestHandle:
        """As `AsyncEngine.submit`: checked now, queued on the replica the router picks."""
        return self.enqueue(self._check_open(request_id).engine.new_request(
            prompt, params, request_id=request_id, priority=priority, chat_template_kwargs=chat_template_kwargs,
            stream=stream))

    async def prepare(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      priority: int = 0, chat_template_kwargs: dict | None = None, *, stream: bool = True
                      ) -> RequestState:
        """As `AsyncEngine.prepare` (rendered and checked on a thread); `enqueue` routes it."""
        return await self._check_open(request_id).prepare(prompt, params, request_id, priority, chat_template_kwargs, stream=stream)

    def enqueue(self, state: RequestState) -> RequestHandle:
        """Queue a request made by `prepare` on the replica the router picks."""
        self._check_open(state.request_id)
        while any(r.holds(state.request_id) for r in self.replicas):  # (an automatic id that a caller's took)
            state.request_id = f"{state.request_id}+"
        loads = [Load(r.num_in_flight, r.num_prompt_tokens_in_flight) for r in self.replicas]
        replica = self.replicas[self.router.route(state.prompt_ids, loads, [r.healthy for r in self.replicas])]
        handle = replica.enqueue(state)
        self._replica_of[handle] = replica
        return handle

    def replica_of(self, handle: RequestHandle) -> int:
        """The index of the replica running `handle`'s request."""
        return self.replicas.index(self._replica_of[handle])

    def abort(self, request_id: str) -> None:
        """As `AsyncEngine.abort`, on the replica holding the request (unknown ids are ignored)."""
        for replica in self.replicas:
            if replica.holds(request_id):
                replica.abort(request_id)

    def abort_all(self, error: BaseException | None = None) -> None:
        for replica in self.replicas:
            replica.abort_all(error)

    def release(self, request: RequestHandle) -> None:
        self._replica_of[request].release(request)


def _check(config: EngineConfig) -> None:
    n, t = config.data_parallel_size, config.tensor_parallel_size
    if n < 2:
        raise RequestError(f"data_parallel_size={n}: a DataParallelEngine runs two replicas or more (one: an "
                           f"AsyncEngine)", param="data_parallel_size")
    if t > 1:
        raise RequestError(f"data_parallel_size={n} with tensor_parallel_size={t} is not supported yet: each "
                           f"tensor-parallel engine holds torch.distributed's default process group, one per "
                           f"process. Run one server per replica (--device cuda:K) behind a load balancer",
                           param="data_parallel_size")
    if config.pipeline_parallel_size > 1:
        raise RequestError(f"data_parallel_size={n} with pipeline_parallel_size={config.pipeline_parallel_size} is "
                           f"not supported yet: expected pipeline_parallel_size=1 (each pipeline holds "
                           f"torch.distributed's default process group, one per process)", param="data_parallel_size")


def data_parallel_from_model(model: str | Path | None = None, **kwargs) -> DataParallelEngine:
    """Load `model` as `AsyncEngine.from_model` does (the same keywords, `data_parallel_size` among them):
    once onto the first replica's device, copied to the others'."""
    load, config = load_and_engine_configs(**kwargs)  # (checked before minutes of loading)
    _check(config)
    devices = replica_devices(resolve_device(load.device), config.data_parallel_size,
                              config.tensor_parallel_size)
    loaded = load_model(model, dataclasses.replace(load, device=str(devices[0])))
    return data_parallel_from_loaded(loaded, config, devices)

def data_parallel_from_loaded(model: LoadedModel, config: EngineConfig,
                              devices: Sequence[torch.device] | None = None) -> DataParallelEngine:
    """`config.data_parallel_size` replicas of a loaded model, on `devices` (default: from the model's
    device on, as `replica_devices` says)."""
    _check(config)
    n = config.data_parallel_size
    devices = list(devices) if devices is not None else replica_devices(model.params.device, n,
                                                                         config.tensor_parallel_size)
    one = dataclasses.replace(config, data_parallel_size=1)
    replicas: list[AsyncEngine] = []
    try:
        for device in devices:
            # (made with its device current: its streams, graphs and compiled kernels are that device's)
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                replicas.append(AsyncEngine(_on(model, device), one))
    except BaseException:
        for replica in replicas:  # (their other processes, if any, go now)
            replica.engine.close()
        raise
    return DataParallelEngine(replicas)
