"""DataParallelEngine: N engine replicas behind one asyncio front (`data_parallel_size`), each request routed to one.

Each replica is its own process (runtime/engine_process/replica.py: `python -m runtime.engine_process.replica`, never the user's
program), a whole engine — its step loop, scheduler, KV pool and prefix cache — over its own copy of the model on
its own device: replica i on cuda:base + i * tensor_parallel_size (base: the device asked for, cuda:0 by default;
with tensor_parallel_size T its group's other ranks take the next T - 1 GPUs, started by the replica), every
replica on the CPU there (sharing the cores). One process each, so that the replicas' Python step loops do not
share one interpreter's lock. The front — this process, where the server's event loop runs — renders, tokenizes
and checks each request (against the replicas' limits), and sends it to the replica that ReplicaRouter picks
(runtime/engine_process/router.py: the longest cached prefix of its prompt, else the least loaded); it stays there. The
replica's outputs (detokenized there) come back to the front's loop (runtime/engine_process/client.py). The server and
`nanoinfer serve --data-parallel-size N` use it as they use an AsyncEngine: the same methods (`prepare`,
`enqueue`, `submit`, `stream`, `generate`, `merge`, `collect`, `abort`, `release`, `stats`, `healthy`,
`shutdown`), with `stats()` per replica besides the totals.

Structured output: a request's grammar is compiled in every healthy replica before it is routed (the one that
takes it finds it compiled), so a bad grammar is still a RequestError where the request is submitted.

A replica whose device fails (DeviceLost, a fatal step) fails its own requests, as one engine does; one whose
process ends fails them with ReplicaLost (its index, exit code and last output). The others keep theirs and take
every new request. The front is healthy while one replica is (stats() and /metrics say which is not); when none
is, new requests are refused as by a dead engine. The offline LLM runs one engine (LLMEngine refuses
data_parallel_size > 1 by name).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import subprocess
import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Sequence

import torch

from nanoinfer.errors import RequestError
from nanoinfer.loaders import LoadedModel, resolve_device
from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine_process import messages as msg
from runtime.async_engine import EngineError, Prompt, RequestHandle
from runtime.engine_config import EngineConfig, load_and_engine_configs
from runtime.engine_process.client import ReplicaClient, spawn
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.request_limits import RequestLimits
from runtime.engine.request_state import RequestState
from runtime.engine_process.router import Load, ReplicaRouter
from runtime.request_book import RequestReader, made_off_the_loop

# Stats that are not counts: per replica only (a total would mean nothing).
NOT_SUMMED = ("healthy",)
STOP_WAIT = 8.0  # seconds the replicas have to exit after shutdown() tells them (then they are killed)


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


class _ReplicasGrammars:
    """Structured output's compilers, one per replica (in its process): the server compiles a request's grammar
    on every healthy replica before it is routed, so that the replica that takes it finds it compiled."""

    def __init__(self, replicas: Sequence[ReplicaClient]):
        self.replicas = replicas

    def prepare(self) -> None:
        for replica in self.replicas:
            replica.link.post(msg.PrepareGrammars())

    def compile(self, spec) -> Future:
        """A future done when every healthy replica's compile is: None, or the first one's RequestError."""
        futures = [replica.compile(spec) for replica in self.replicas if replica.healthy]
        done, lock, left = Future(), threading.Lock(), [len(futures)]
        if not futures:
            done.set_exception(EngineError("the engine processes are down (restart them)"))

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


class _FrontRequests(LLMEngine):
    """LLMEngine's `new_request` — a prompt rendered, tokenized and checked into a RequestState — in the front,
    which runs no engine: no core is built; the checks are the replicas' (their smallest KV pool) and their
    grammar compilers'. Only `new_request` is used."""

    def __init__(self, model: LoadedModel, limits: RequestLimits, grammars: _ReplicasGrammars):
        # (LLMEngine.__init__ is not called: it builds an engine core, which the front has no use for)
        self.model, self.fatal, self._ids = model, None, itertools.count()
        self.limits, self.grammars = limits, grammars
        self.core = self  # (new_request calls core.check_request, and reads core.closed)
        self.closed = False  # (the replicas' engines close in their processes; the front's is never closed)

    def check_request(self, prompt_token_ids, params: SamplingParams) -> list[int]:
        ids = self.limits.check(prompt_token_ids, params)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs).result()  # (answered on the replicas' reader threads)
        return ids


class DataParallelEngine(RequestReader):
    """AsyncEngine's interface over replica processes (ReplicaClients, each ready: see data_parallel_from_model
    and data_parallel_from_loaded). Use as `async with engine:` (start/shutdown), as an AsyncEngine."""

    def __init__(self, replicas: Sequence[ReplicaClient], config: EngineConfig):
        self.replicas, self.config = tuple(replicas), config  # (one replica: a server's engine apart from it)
        ready = [r.ready for r in self.replicas]
        self.model, self.tokenizer = ready[0].model, ready[0].model.tokenizer
        limits = dataclasses.replace(ready[0].limits, num_blocks=min(r.limits.num_blocks for r in ready))
        self.router = ReplicaRouter([r.limits.num_blocks for r in ready], limits.block_size,
                                    config.enable_prefix_caching)
        self.grammars = _ReplicasGrammars(self.replicas)
        self._requests = _FrontRequests(self.model, limits, self.grammars)
        self.max_model_len = limits.max_model_len  # the longest prompt and output (the smallest replica's)
        self._replica_of: weakref.WeakKeyDictionary[RequestHandle, ReplicaClient] = weakref.WeakKeyDictionary()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas:
            replica.start(self._loop)

    async def shutdown(self) -> None:
        """Abort what is in flight and stop every replica's process (killed if it has not exited in STOP_WAIT s)."""
        if self._loop is not None:
            self.abort_all()
        self._loop = None
        await asyncio.to_thread(stop_all, self.replicas)

    @property
    def healthy(self) -> bool:
        """False once every replica failed for good (one that did is in `stats()`)."""
        return any(replica.healthy for replica in self.replicas)

    def stats(self) -> dict:
        """The counts of every replica summed (as one AsyncEngine's `stats()`), `healthy` (as the property) and
        `replicas`: each replica's own `stats()`, in order (a replica that is down says why in `error`)."""
        per = [replica.stats() for replica in self.replicas]
        keys = [k for k, v in per[0].items() if k not in NOT_SUMMED and isinstance(v, (int, float))]
        totals = {key: sum(s.get(key, 0) for s in per) for key in keys}
        return {**totals, "healthy": self.healthy, "replicas": per}

    @property
    def num_in_flight(self) -> int:
        return sum(replica.num_in_flight for replica in self.replicas)

    @property
    def num_seqs_in_flight(self) -> int:
        return sum(replica.num_seqs_in_flight for replica in self.replicas)

    # -- requests ----------------------------------------------------------------------------

    def _check_open(self, request_id: str | None) -> None:
        """Once the front takes requests and `request_id` is free."""
        if self._loop is None:
            raise RuntimeError("the engine is not running: use `async with engine:` or call start()")
        if not self.healthy:
            fatal = self.replicas[0]._fatal
            what = "the engine process is" if len(self.replicas) == 1 else "every replica is"
            raise EngineError(f"{what} down (restart it): {fatal}") from fatal
        if request_id is not None and any(r.holds(request_id) for r in self.replicas):
            raise RequestError(f"request_id {request_id!r} is already in flight", param="request_id")

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0, chat_template_kwargs: dict | None = None, *, stream: bool = True
               ) -> RequestHandle:
        """As `AsyncEngine.submit`: checked now, queued on the replica the router picks."""
        self._check_open(request_id)
        return self.enqueue(self._requests.new_request(
            prompt, params, request_id=request_id, priority=priority, chat_template_kwargs=chat_template_kwargs,
            stream=stream))

    async def prepare(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      priority: int = 0, chat_template_kwargs: dict | None = None, *, stream: bool = True
                      ) -> RequestState:
        """As `AsyncEngine.prepare` (a prompt that is not cheap rendered and checked on a thread); `enqueue`
        routes it."""
        self._check_open(request_id)
        return await made_off_the_loop(self._requests.new_request, prompt, params, request_id=request_id,
                                       priority=priority, chat_template_kwargs=chat_template_kwargs, stream=stream)

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
        return self._replica_of[handle].index

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


def stop_all(replicas: Sequence[ReplicaClient], wait: float = STOP_WAIT) -> None:
    """Tell every replica to stop, wait up to `wait` seconds for all to exit, kill the rest."""
    for replica in replicas:
        replica.link.stop()
    deadline = time.monotonic() + wait
    for replica in replicas:
        proc = replica.process.proc
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # a replica stuck in a step: it goes now
            replica.process.killed = True
            proc.kill()
            proc.wait()
        replica.conn.close()


def _check(config: EngineConfig) -> None:
    n = config.data_parallel_size
    if config.pipeline_parallel_size > 1:
        what = f"data_parallel_size={n}" if n > 1 else "an engine process (--engine-process on)"
        raise RequestError(f"{what} with pipeline_parallel_size={config.pipeline_parallel_size} is not supported yet: "
                           f"expected pipeline_parallel_size=1 (tensor parallelism inside it is)",
                           param="data_parallel_size" if n > 1 else "engine_process")


def _start(args: Sequence[msg.ReplicaArgs]) -> DataParallelEngine:
    """The replicas' processes started together, each waited for until its engine is built (all stopped if one
    fails: its error, ReplicaLost with its last output, is raised)."""
    replicas: list[ReplicaClient] = []  # (each client's group: a lost one names those serving on)
    try:
        for a in args:
            process, conns = spawn(a)
            replicas.append(ReplicaClient(a.index, process, conns[0], group=replicas, alone=len(args) == 1,
                                          step_timeout=a.config.step_timeout))
            replicas[-1].front_conns = conns[1:]
        for replica in replicas:
            replica.wait_ready()
    except BaseException:
        stop_all(replicas, wait=1.0)
        for replica in replicas:
            for conn in replica.front_conns:
                conn.close()
        raise
    return DataParallelEngine(replicas, args[0].config)


def _threads(devices: Sequence[torch.device]) -> int | None:
    """Torch's threads per replica: CPU replicas share the cores (else each would take them all)."""
    cpus = sum(d.type == "cpu" for d in devices)
    return max(1, (os.cpu_count() or 1) // cpus) if cpus else None


def data_parallel_from_model(model: str | Path | None = None, *, _setup: str | None = None, fronts: int = 1,
                             **kwargs) -> DataParallelEngine:
    """Load `model` as `AsyncEngine.from_model` does (the same keywords, `data_parallel_size` among them):
    each replica loads it in its own process, onto its own device. `fronts`: the API server processes that will
    send it requests (`serve --api-server-count`), this one first: each replica keeps a socket for each (the
    others' in its client's `front_conns`, for runtime/serve/api_servers.py to hand over)."""
    load, config = load_and_engine_configs(**kwargs)  # (checked before minutes of loading)
    _check(config)
    devices = replica_devices(resolve_device(load.device), config.data_parallel_size,
                              config.tensor_parallel_size)
    one, threads = dataclasses.replace(config, data_parallel_size=1), _threads(devices)
    path = None if model is None else str(model)
    return _start([msg.ReplicaArgs(i, one, str(d), None, path, load, threads, _setup, fronts)
                   for i, d in enumerate(devices)])


def data_parallel_from_loaded(model: LoadedModel, config: EngineConfig,
                              devices: Sequence[torch.device] | None = None, *,
                              _setup: str | None = None, fronts: int = 1) -> DataParallelEngine:
    """`config.data_parallel_size` replicas of a loaded model, on `devices` (default: from the model's device on,
    as `replica_devices` says): its weights handed to each replica's process as shared memory (CPU) or CUDA IPC
    handles, copied there to the replica's device where they are not on it. `_setup` ("module:function", for
    tests): called in each replica with (index, its LLMEngine) before it serves."""
    _check(config)
    n = config.data_parallel_size
    devices = list(devices) if devices is not None else replica_devices(model.params.device, n,
                                                                         config.tensor_parallel_size)
    one, threads = dataclasses.replace(config, data_parallel_size=1), _threads(devices)
    return _start([msg.ReplicaArgs(i, one, str(d), model, None, None, threads, _setup, fronts)
                   for i, d in enumerate(devices)])
