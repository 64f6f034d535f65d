"""CUDA-graph capture and replay of the forward, over static input buffers.

A decode step is ~10 small kernels per layer; at batch 1 launching them from Python costs
more than running them, and a mixed step (prefill chunks beside decodes) of a 28-layer model
costs ~25 ms of host launches on an H100's host, several times its GPU work. We capture the
forward into CUDA graphs whose inputs live in static buffers and replay them: copy the step's
Batch into the buffers (padded), replay, read its outputs. The captured step returns a tuple
of tensors with one row per logits row (the runner's: the logits, and each row's greedy
token and finite flag, so a greedy step samples inside the graph).

- Decode graphs, per batch-size bucket and block-table width: one query row per sequence.
- Mixed graphs, per token-count bucket: any step of up to `max_batch` sequences and up to
  `max_batch * rows_per_seq` logits rows (a bucket of fewer tokens: as many as its tokens);
  its block tables take the full width and its sequence count is `max_batch` (padding
  sequences own no query rows). Speculative decoding's verification steps (a few query rows
  per sequence, each with logits) replay the buckets below `max_batch` tokens, captured for it.

Padding rows carry slot -1 (the KV write skips them) and belong to a sequence with a context
of 0 keys (attention writes zeros); their outputs are sliced off.
"""

from __future__ import annotations

import gc
from typing import Callable, NamedTuple, Sequence

import torch

from nanoinfer.batch import Batch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# A mixed step pads to the next of these: by at most 256 tokens up to 4,096, then by at most
# an eighth. Steps that fill the token budget pad not at all, but one that holds all there is
# to do does not: a wave of chat turns whose histories are cached computes ~2,100 tokens at
# once, and padding that to 3,072 (the old coarser buckets) made the step, and so their time
# to first token, 1.45x longer.
DEFAULT_TOKEN_BUCKETS = ((8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224) + tuple(range(256, 4096, 256))
                         + tuple(range(4096, 8192, 512)) + tuple(range(8192, 16385, 1024)))


class GraphSizes(NamedTuple):
    """What StepGraphs captures (its constructor's size arguments): tensor-parallel ranks
    capture the same graphs as rank 0 from these."""

    max_batch: int
    max_blocks: int
    widths: tuple[int, ...] = ()
    max_tokens: int = 0
    rows_per_seq: int = 1


class StepGraphs:
    """Graphs of a forward `step` for batches of up to `max_batch` sequences whose block tables
    are at most `max_blocks` wide: decode batches (one query row each), and, when
    `max_tokens` is given, mixed batches of up to `max_tokens` tokens.

    Each decode bucket is captured once per block-table width in `widths` (plus
    `max_blocks`): attention kernels size their launch from that width (the longest
    context it allows), so a step of short contexts replays a graph sized for them rather
    than one that splits every sequence's keys for the longest context the model allows.
    """

    def __init__(self, step: Callable[[Batch], Sequence[torch.Tensor]], device: torch.device, max_batch: int,
                 max_blocks: int, buckets=DEFAULT_BUCKETS, widths: tuple[int, ...] = (), max_tokens: int = 0,
                 token_buckets=DEFAULT_TOKEN_BUCKETS, rows_per_seq: int = 1):
        """`step(batch)`: the forward to capture (it writes the batch's KV); it returns a tuple
        of tensors whose rows are the batch's logits rows. `rows_per_seq` > 1 (speculative
        decoding verifies rows_per_seq - 1 drafts per sequence) also captures mixed graphs
        of fewer tokens than `max_batch`."""
        self.step = step
        self.buckets = tuple(b for b in buckets if b < max_batch) + (max_batch,)
        self.widths = tuple(sorted({w for w in widths if 0 < w < max_blocks})) + (max_blocks,)
        # Mixed steps have more tokens than sequences: buckets past the decode sizes only, but
        # for verification steps.
        smallest = 1 if rows_per_seq > 1 else max_batch
        self.token_buckets = () if max_tokens <= smallest else (
            tuple(t for t in token_buckets if smallest < t < max_tokens) + (max_tokens,))
        self.max_rows = max_batch * rows_per_seq
        self.max_batch, self.max_blocks = max_batch, max_blocks
        n, t = max_batch, max(max_batch, max_tokens)
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.decode_starts = torch.arange(n + 1, dtype=torch.int32, device=device)  # one row per sequence
        self.decode_rows = torch.arange(n, dtype=torch.int64, device=device)
        self.mixed_starts = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.mixed_rows = torch.zeros(self.max_rows, dtype=torch.int64, device=device)
        Captured = tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]  # the graph, its outputs
        self.graphs: dict[tuple[int, int], Captured] = {}  # decode, by (size, width)
        self.mixed: dict[int, Captured] = {}  # by token bucket
        self.pool = None

    def _decode_batch(self, size: int, width: int) -> Batch:
        return Batch(self.input_ids[:size], self.positions[:size], self.slot_mapping[:size],
                     self.block_tables[:size, :width], self.seq_lens[:size], self.decode_starts[:size + 1],
                     self.decode_rows[:size])

    def _mixed_batch(self, tokens: int) -> Batch:
        seqs = self._mixed_seqs(tokens)
        return Batch(self.input_ids[:tokens], self.positions[:tokens], self.slot_mapping[:tokens],
                     self.block_tables[:seqs], self.seq_lens[:seqs], self.mixed_starts[:seqs + 1],
                     self.mixed_rows[:self._mixed_rows(tokens)])

    def _mixed_seqs(self, tokens: int) -> int:
        """Sequences a mixed bucket holds: no more than its tokens (a verification step of a
        few sequences then runs attention over those, not over `max_batch` empty ones)."""
        return min(tokens, self.max_batch)

    def _mixed_rows(self, tokens: int) -> int:
        """Logits rows a mixed bucket computes (`max_rows`, or one per token if fewer)."""
        return min(tokens, self.max_rows)

    def _capture(self, batch: Batch) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: lazy init and Triton autotuning off-graph
            self.step(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = tuple(self.step(batch))
        self.pool = graph.pool()
        return graph, outputs

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        # Each torch.cuda.graph() begins with gc.collect(), which walks every object on the
        # heap, compiling's included: frozen objects are skipped (as vLLM does).
        gc.collect()
        gc.freeze()
        try:
            self._capture_all()
        finally:
            gc.unfreeze()

    def _capture_all(self) -> None:
        # Capture-time batches: every token in the first sequence, no keys read or written.
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(0)
        self.mixed_starts.fill_(0)
        for tokens in sorted(self.token_buckets, reverse=True):
            self.mixed_starts[1:].fill_(tokens)
            self.mixed[tokens] = self._capture(self._mixed_batch(tokens))
        for size, width in sorted(((s, w) for s in self.buckets for w in self.widths), reverse=True):
            self.graphs[size, width] = self._capture(self._decode_batch(size, width))
        torch.cuda.synchronize()

    def can_run(self, batch: Batch) -> bool:
        """A step within the captured sizes: decode, or mixed when mixed graphs were captured."""
        n, t = batch.num_seqs, batch.num_tokens
        if not self.graphs or n > self.max_batch or batch.block_tables.shape[1] > self.max_blocks:
            return False
        if t == n:
            return batch.logits_indices.shape[0] == n
        if not self.token_buckets or t > self.token_buckets[-1]:
            return False
        return batch.logits_indices.shape[0] <= self._mixed_rows(next(b for b in self.token_buckets if b >= t))

    def run(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """The step's outputs (rows: len(batch.logits_indices)) for a batch that `can_run`, by
        graph replay."""
        n, t = batch.num_seqs, batch.num_tokens
        width = batch.block_tables.shape[1]
        # Columns past `width` may hold another step's blocks: seq_lens keeps them unread.
        self.input_ids[:t].copy_(batch.input_ids, non_blocking=True)
        self.positions[:t].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:t].copy_(batch.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        if t == n:
            size = next(b for b in self.buckets if b >= n)
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(0)
            graph, outputs = self.graphs[size, next(w for w in self.widths if w >= width)]
            graph.replay()
            return tuple(out[:n] for out in outputs)
        tokens = next(b for b in self.token_buckets if b >= t)
        rows = batch.logits_indices.shape[0]
        seqs = self._mixed_seqs(tokens)
        self.slot_mapping[t:tokens].fill_(-1)
        self.seq_lens[n:seqs].fill_(0)
        # Padding tokens form sequence n (no keys: attention writes zeros); later ones own none.
        self.mixed_starts[:n + 1].copy_(batch.query_start_loc, non_blocking=True)
        self.mixed_starts[n + 1:seqs + 1].fill_(tokens)
        self.mixed_rows[:rows].copy_(batch.logits_indices, non_blocking=True)
        self.mixed_rows[rows:self._mixed_rows(tokens)].fill_(0)
        graph, outputs = self.mixed[tokens]
        graph.replay()
        return tuple(out[:rows] for out in outputs)
