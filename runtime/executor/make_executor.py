"""Executor: the one interface between the engine and the devices, and the choice of which one runs.

The engine core (runtime/engine/) talks to an executor only through `Executor`: rows come and
go as sequences start and stop running, its KV pools copy and swap blocks as the block manager says,
a step is launched and its results come back later. `ModelRunner` runs the model on one device;
`TensorParallelRunner` (runtime/executor/tensor_parallel.py) is the same runner over ranks that
each hold a shard; `PipelineParallelRunner` (pipeline_parallel.py), over stages of the layers.
Other ways of running a model are executors too, and nothing above this file changes for them.
"""

from __future__ import annotations

from typing import Callable, Protocol

from nanoinfer.errors import RequestError
from nanoinfer.loaders import LoadedModel
from runtime.engine_config import EngineConfig
from runtime.executor.kv_pools import KVPools
from runtime.executor.step import InFlightStep, Sequence, StepInput


class Executor(Protocol):
    num_blocks: int  # device KV blocks (the block manager's pool)
    max_model_len: int  # the longest sequence it runs: the engine's, or less where the pool holds less
    num_cpu_blocks: int  # host blocks for swapped-out sequences
    row_of: dict[int, int]  # seq_id -> its row, for the sequences that have one
    pools: KVPools  # the KV blocks: the block manager's copies and swaps are applied to them
    # Launched steps the engine keeps unread with async scheduling: 1, or 2 where two steps of
    # disjoint sequences overlap on the devices (pipeline parallelism: runtime/engine/virtual_engines.py)
    steps_in_flight: int

    def add(self, seq: Sequence) -> None:
        """`seq` starts running: give it a row."""

    def remove(self, seq: Sequence) -> None:
        """`seq` stopped running (finished, preempted): free its row (none: nothing to do)."""

    def table_changed(self, seq: Sequence) -> None:
        """`seq`'s block table grew, or a block in its write range was replaced (copy-on-write)."""

    def launch(self, inp: StepInput, forward_done: Callable[[], None],
               before_sampling: Callable[[], None] = lambda: None) -> InFlightStep:
        """Queue the step's forward and sampling and start copying the results to the host;
        returns without waiting for the device, and changes no sequence. `before_sampling` is
        called once the forward is queued and before the grammar masks are filled (it may
        finish sequences: their rows are sampled, and dropped when the step resolves)."""

    def emitted(self, seq: Sequence, token_ids: list[int]) -> None:
        """Tokens a verification emitted for `seq` (speculative decoding)."""

    def close(self) -> None:
        """Release what outlives the engine (idempotent)."""


def uses_ranks(config: EngineConfig) -> bool:
    """Whether the model runs over torch.distributed ranks (tensor or pipeline parallelism).
    Tests force it at one rank, so that a one-GPU machine runs that path (tests/conftest.py)."""
    return config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1


def make_executor(model: LoadedModel, config: EngineConfig, max_model_len: int,
                  draft_model: LoadedModel | None = None) -> Executor:
    """The executor `config` asks for, with speculative decoding's draft model when it has one
    (`draft_model`, or loaded from `config.speculative_config.model`)."""
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        from runtime.executor.draft_runner import check_draft

        if draft_model is None:
            from nanoinfer.loaders import load_model

            draft_model = load_model(spec.model, device=str(model.params.device), progress=False,
                                     dtype=str(model.params.dtype).removeprefix("torch."),
                                     quantization=spec.quantization)
        check_draft(model, draft_model)
        draft_model = draft_model.for_context(max_model_len)  # (longrope: the target's context)
    elif draft_model is not None:
        raise RequestError("a draft model was given but speculative_config does not ask for one: expected "
                           "method 'draft_model'", param="speculative_config")
    if config.pipeline_parallel_size > 1:
        from runtime.executor.pipeline_parallel import PipelineParallelRunner

        return PipelineParallelRunner(model, config, max_model_len, draft_model)
    if uses_ranks(config):
        from runtime.executor.tensor_parallel import TensorParallelRunner

        return TensorParallelRunner(model, config, max_model_len, draft_model)
    from runtime.executor.model_runner import ModelRunner

    return ModelRunner(model, config, max_model_len, draft_model)
