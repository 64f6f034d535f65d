"""CUDA graphs emulated on the CPU, for dry runs of the code that captures and replays them
(nanoinfer/backends/cuda/graphs.py and its callers) where there is no GPU.

A "graph" records the step StepGraphs ran inside its capture, over the graph's static inputs,
and a replay runs that step again over the same tensors, copying its results into the outputs
the capture returned: what a replay does, the static buffers' reuse and the padding included,
but not the GPU's streams (but for one of their effects: a step's results copied to the host
before the next step's replay overwrites them, which async scheduling relies on), nor the
pinned staging copy of a batch built on the host (it replays as a batch on the device). `install`
also makes the CPU kernels claim graphs (eager layers).

Run as `python -m tests.fake_cuda_graphs RANK SIZE HOST:PORT`, as runtime/executor/tensor_parallel.py's RANK_MODULE:
a rank with the emulation installed; where NANOINFER_TEST_REPLAYS names a folder, the rank
writes its count of replays there (a file named by its rank) once it stops, and where
NANOINFER_TEST_CAPTURES does, the buckets it captured, in order (JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from nanoinfer.backends.cuda.graphs import StepGraphs

REPLAYS = [0]  # this process's replays
CAPTURES: list = []  # this process's captured buckets, in order (StepGraphs._capture's keys)
_CAPTURING: list[FakeGraph] = []


class FakeGraph:
    def __init__(self):
        self.calls = []  # (rerun, the outputs the capture returned)

    def pool(self):
        return None

    def replay(self) -> None:
        REPLAYS[0] += 1
        for rerun, outputs in self.calls:
            for out, new in zip(outputs, rerun()):
                out.copy_(new)


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def _graph(graph: FakeGraph, pool=None, stream=None, capture_error_mode="global"):
    _CAPTURING.append(graph)
    try:
        yield
    finally:
        _CAPTURING.pop()


def _counting(real_capture):
    def capture(self, key):
        CAPTURES.append(key)
        return real_capture(self, key)

    return capture


def _recording(real_step):
    def step(self, batch):
        outputs = tuple(real_step(self, batch))
        if _CAPTURING:
            _CAPTURING[-1].calls.append((lambda: tuple(real_step(self, batch)), outputs))
        return outputs

    return step


class _PaddingAttention:
    """The CPU's attention, doing what the GPU's does for a graph's padding sequences (no keys:
    their query rows get zeros), which the CPU's never meets otherwise."""

    def __init__(self, inner, partition_size: int):
        self.inner, self.partition_size = inner, partition_size

    def graph_widths(self, block_size: int) -> tuple[int, ...]:
        """(The GPU's backend's: its split-K partition's width alone here, as the tests' buckets expect.)"""
        return (self.partition_size // block_size,)

    def prepare(self, batch, cfg, window):
        real = int((batch.seq_lens > 0).sum())  # (the padding sequences come after the batch's own)
        return self.inner.prepare(batch._replace(block_tables=batch.block_tables[:real],
                                                 seq_lens=batch.seq_lens[:real],
                                                 query_start_loc=batch.query_start_loc[:real + 1]), cfg, window)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _claiming_graphs(kernels_for, partition_blocks: int):
    """kernels_for whose CPU kernels (unless eager) say graphs may be captured; the attention's
    split-K partition (which sizes the narrow decode graphs) `partition_blocks` blocks."""
    from nanoinfer.sampling.draw import random_draw

    def claiming(cfg, device, block_size, *, eager=False, **kwargs):
        kernels = kernels_for(cfg, device, block_size, eager=eager, **kwargs)
        if eager:
            return kernels
        return kernels._replace(attention=_PaddingAttention(kernels.attention, partition_blocks * block_size),
                                graphs=True, draw=kernels.draw or random_draw)

    return claiming


def _unpinned(real_run):
    """StepGraphs.run taking a batch built on the host (a draft model's passes) as one on the
    device: its one staging copy needs pinned memory, which the CPU has not."""
    from nanoinfer.model.batch import HostBatch

    def run(self, batch, *args, **kwargs):
        return real_run(self, batch.to(self.device) if isinstance(batch, HostBatch) else batch, *args, **kwargs)

    return run


def _copying(real_init):
    """DeviceToHost's constructor, copying: on the CPU its "copies" are the tensors themselves,
    which for a replay's results are the graph's outputs, and with async scheduling the next
    step's replay would overwrite them before they are read; a GPU copies them to the host in
    stream order, before that replay."""
    from runtime.executor.step import map_tensors

    def init(self, tree):
        real_init(self, map_tensors(torch.clone, tree))

    return init


def install(setattr=setattr, partition_blocks: int = 2) -> None:
    """The emulation, through `setattr` (pytest's monkeypatch.setattr undoes it after a test)."""
    from runtime.executor import device_model, step, tp_follower

    setattr(torch.cuda, "CUDAGraph", FakeGraph)
    setattr(torch.cuda, "graph", _graph)
    setattr(torch.cuda, "Stream", lambda *args, **kwargs: _FakeStream())
    setattr(torch.cuda, "current_stream", lambda *args, **kwargs: _FakeStream())
    setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    setattr(StepGraphs, "_step", _recording(StepGraphs._step))
    setattr(StepGraphs, "_capture", _counting(StepGraphs._capture))
    setattr(StepGraphs, "run", _unpinned(StepGraphs.run))
    setattr(step.DeviceToHost, "__init__", _copying(step.DeviceToHost.__init__))
    for module in (device_model, tp_follower):
        setattr(module, "kernels_for", _claiming_graphs(module.kernels_for, partition_blocks))


def main() -> None:
    from runtime.executor import tp_rank

    install()
    tp_rank.main(sys.argv[1:])
    if os.environ.get("NANOINFER_TEST_REPLAYS"):
        (Path(os.environ["NANOINFER_TEST_REPLAYS"]) / sys.argv[1]).write_text(str(REPLAYS[0]))
    if os.environ.get("NANOINFER_TEST_CAPTURES"):
        (Path(os.environ["NANOINFER_TEST_CAPTURES"]) / sys.argv[1]).write_text(json.dumps(CAPTURES))


if __name__ == "__main__":
    main()
