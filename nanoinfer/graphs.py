"""CUDA-graph capture and replay of the decode forward, over static input buffers.

A decode step is ~10 small kernels per layer; at batch 1 launching them from Python costs
more than running them. We capture `forward` once per batch-size bucket into a CUDA graph
whose inputs live in static buffers, and replay it: copy the step's (padded) Batch into the
buffers, replay, read the logits. Padding rows carry slot -1 (the KV write skips them) and a
context of 0 keys (attention writes zeros), and their logits are sliced off.
"""

from __future__ import annotations

import torch

from nanoinfer.attention import AttentionBackend
from nanoinfer.batch import Batch
from nanoinfer.config import ModelConfig
from nanoinfer.model import EAGER, LayerFunctions, Params, forward

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Graphs of `forward` for decode batches of up to `max_batch` sequences (one query row
    each) whose block tables are at most `max_blocks` wide.

    Each batch-size bucket is captured once per block-table width in `widths` (plus
    `max_blocks`): attention kernels size their launch from that width (the longest
    context it allows), so a step of short contexts replays a graph sized for them rather
    than one that splits every sequence's keys for the longest context the model allows.
    """

    def __init__(self, params: Params, kv: torch.Tensor, cfg: ModelConfig, backend: AttentionBackend,
                 max_batch: int, max_blocks: int, buckets=DEFAULT_BUCKETS, layer_fns: LayerFunctions = EAGER,
                 widths: tuple[int, ...] = ()):
        self.params, self.kv, self.cfg, self.backend, self.layer_fns = params, kv, cfg, backend, layer_fns
        self.buckets = tuple(b for b in buckets if b < max_batch) + (max_batch,)
        self.widths = tuple(sorted({w for w in widths if 0 < w < max_blocks})) + (max_blocks,)
        self.max_blocks = max_blocks
        device = kv.device
        n = max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one row per sequence
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # by (size, width)
        self.pool = None

    def _static_batch(self, size: int, width: int) -> Batch:
        return Batch(self.input_ids[:size], self.positions[:size], self.slot_mapping[:size],
                     self.block_tables[:size, :width], self.seq_lens[:size], self.query_start_loc[:size + 1],
                     self.logits_indices[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        for size, width in sorted(((s, w) for s in self.buckets for w in self.widths), reverse=True):
            batch = self._static_batch(size, width)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: lazy init and Triton autotuning off-graph
                forward(self.params, self.kv, batch, self.cfg, self.backend, self.layer_fns)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = forward(self.params, self.kv, batch, self.cfg, self.backend, self.layer_fns)
            self.pool = graph.pool()
            self.graphs[size, width] = (graph, logits)
        torch.cuda.synchronize()

    def can_run(self, batch: Batch) -> bool:
        """Pure decode (one token per sequence, logits for each) within the captured sizes."""
        n = batch.num_seqs
        return (bool(self.graphs) and batch.num_tokens == n and n <= self.buckets[-1]
                and batch.logits_indices.shape[0] == n and batch.block_tables.shape[1] <= self.max_blocks)

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [num_seqs, vocab] for a decode batch (see `can_run`), by graph replay."""
        n = batch.num_seqs
        size = next(b for b in self.buckets if b >= n)
        width = batch.block_tables.shape[1]
        # Columns past `width` may hold another step's blocks: seq_lens keeps them unread.
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        self.seq_lens[n:size].fill_(0)
        graph, logits = self.graphs[size, next(w for w in self.widths if w >= width)]
        graph.replay()
        return logits[:n]
