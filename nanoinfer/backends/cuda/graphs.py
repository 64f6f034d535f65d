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

A pipeline stage (runtime/executor/pipeline_parallel.py) captures the same graphs of its own
forward, which takes the previous stage's activations besides the batch (`stage_input`: a
static buffer of its own, which the received activations are copied into before a replay) and,
but on the last stage, returns activations for every token (`per_token`) rather than logits.

Capture. A bucket's capture runs its forward once eagerly (the warm-up: Triton compiles and
specializes the kernels for its shapes, seconds each on a cold cache) and records it; all
graphs share one memory pool. Capturing every bucket at start (`lazy` False; the engine's
`cuda_graph_capture="all"`) took most of a cold start (~17 s of ~31 s for Qwen3-0.6B on an
H100), for buckets most runs never meet. So by default (`lazy`) `capture()` takes at start only
the largest mixed bucket and the largest decode bucket (the widest), and every other bucket is
captured the first time a step needs it (`run`). Why those two: a graph's memory comes from the
pool, the private pool of the caching allocator, which never gives back what a capture took;
captured first, the largest graphs' intermediates are freed into the pool for every later
(smaller) capture to reuse, so a later capture adds little but its outputs (its logits rows):
the pool takes its size, beside the KV pool sized before it (kv_budget.py), while the engine
starts, not mid-serving, and holds at most about what capturing every bucket would. (Smaller
graphs captured first would leave their freed blocks too small for a larger one's, which would
then take new memory on top.)

A capture mid-serving is stream-ordered, at the cost of one wait per bucket: torch.cuda.graph
first waits for the device (the steps already queued, a pipeline's side stream included) and
empties the allocator's cache for the pool. It captures in "thread_local" mode, so only this
thread is barred from the calls a capture forbids, not another thread (the grammars' thread
allocates pinned memory: nanoinfer/structured/grammars.py), as torch.compile's own captures mid-run do.
Every tensor-parallel rank and pipeline stage captures on first use too: they run the same
batches (micro-batches) in the same order, so each captures the same buckets at the same step,
their collectives inside in step with each other's.

Every graph reads its batch from its own region of one device buffer (the regions overlap:
one graph replays at a time, in stream order), laid out field after field. A batch built on
the host (`HostBatch`) is written, padded, straight into a pinned copy of that region and
moved in one copy; a batch already on the device is copied field by field.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from nanoinfer.model.batch import Batch, HostBatch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# A mixed step pads to the next of these: by at most 256 tokens up to 4,096, then by at most
# an eighth. Steps that fill the token budget pad not at all, but one that holds all there is
# to do does not: a wave of chat turns whose histories are cached computes ~2,100 tokens at
# once, and padding that to 3,072 (the old coarser buckets) made the step, and so their time
# to first token, 1.45x longer.
DEFAULT_TOKEN_BUCKETS = ((8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224) + tuple(range(256, 4096, 256))
                         + tuple(range(4096, 8192, 512)) + tuple(range(8192, 16385, 1024)))


class GraphSizes(NamedTuple):
    """What StepGraphs captures, and when (its constructor's size arguments and `lazy`):
    tensor-parallel ranks and pipeline stages capture the same graphs as rank 0 from these."""

    max_batch: int
    max_blocks: int
    widths: tuple[int, ...] = ()
    max_tokens: int = 0
    rows_per_seq: int = 1
    lazy: bool = False


_ALIGN = 64  # bytes: each field starts aligned (Triton specializes kernels on 16-byte pointer alignment)
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


class _Inputs(NamedTuple):
    """Where a captured graph reads its batch: the (byte offset, dtype, shape) in the input
    buffer of each Batch field, None for a field the graph takes from elsewhere (a decode
    graph's query starts and logits rows: constants); and the bytes the fields span."""

    fields: tuple[tuple[int, torch.dtype, tuple[int, ...]] | None, ...]
    nbytes: int

    @classmethod
    def of(cls, tokens: int, seqs: int, width: int, rows: int, decode: bool) -> "_Inputs":
        shapes = (((tokens,), torch.int64), ((tokens,), torch.int64), ((tokens,), torch.int64),  # ids, positions, slots
                  ((seqs, width), torch.int32), ((seqs,), torch.int32),
                  None if decode else ((seqs + 1,), torch.int32), None if decode else ((rows,), torch.int64))
        fields, at = [], 0
        for field in shapes:
            if field is None:
                fields.append(None)
                continue
            shape, dtype = field
            fields.append((at, dtype, shape))
            at += -(-int(np.prod(shape)) * dtype.itemsize // _ALIGN) * _ALIGN
        return cls(tuple(fields), at)

    @property
    def decode(self) -> bool:
        """A decode graph's inputs: its query starts and logits rows are constants."""
        return self.fields[5] is None

    def views(self, buffer: torch.Tensor | np.ndarray) -> Batch:
        """The fields as views of `buffer` (bytes: the device's input buffer, or a host staging
        copy); None where the graph has no such input."""
        if isinstance(buffer, np.ndarray):  # (per step: one constructor call per field)
            return Batch(*(None if f is None else np.ndarray(f[2], _NUMPY[f[1]], buffer, f[0]) for f in self.fields))
        return Batch(*(None if f is None else
                       buffer[f[0]:f[0] + int(np.prod(f[2])) * f[1].itemsize].view(f[1]).view(f[2])
                       for f in self.fields))


Key = tuple[int, int] | int  # a bucket: a decode graph's (batch size, block-table width), a mixed graph's tokens


class Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, ...]
    inputs: _Inputs  # where it reads its batch
    views: Batch  # its inputs in the device buffer


def _fill(to: Batch, batch: Batch | HostBatch) -> None:
    """Write `batch` into a graph's inputs `to` (views of the host staging copy or of the
    device buffer: numpy arrays and tensors take the same slice assignments), padded: padding
    tokens at position 0 with slot -1 (no KV written), padding sequences with no keys. Block
    table entries past a sequence's context are left as they are: attention never reads them."""
    t, n = batch.num_tokens, batch.num_seqs
    tokens, seqs = to.input_ids.shape[0], to.seq_lens.shape[0]
    to.input_ids[:t] = batch.input_ids
    to.positions[:t] = batch.positions
    to.slot_mapping[:t] = batch.slot_mapping
    to.block_tables[:n, :batch.block_tables.shape[1]] = batch.block_tables
    to.seq_lens[:n] = batch.seq_lens
    if t < tokens:
        to.input_ids[t:] = 0
        to.positions[t:] = 0
        to.slot_mapping[t:] = -1
    if n < seqs:
        to.seq_lens[n:] = 0
    if to.query_start_loc is None:  # a decode graph: one row per sequence, padding ones too (constants)
        return
    r = batch.logits_indices.shape[0]
    # Padding tokens form sequence n (no keys: attention writes zeros); later ones own none.
    to.query_start_loc[:n + 1] = batch.query_start_loc
    to.query_start_loc[n + 1:] = tokens
    to.logits_indices[:r] = batch.logits_indices
    to.logits_indices[r:] = 0


@contextlib.contextmanager
def _frozen_heap():
    """The heap out of the collector's way while graphs are captured: a torch.cuda.graph() may
    begin with gc.collect() (torch's force_cudagraph_gc), which walks every object, compiling's
    included, but skips frozen ones (as vLLM does). Unless something froze it already: unfreezing
    thaws every frozen object, and a server froze what its start made (runtime/serve/server.py)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class StepGraphs:
    """Graphs of a forward `step` for batches of up to `max_batch` sequences whose block tables
    are at most `max_blocks` wide: decode batches (one query row each), and, when
    `max_tokens` is given, mixed batches of up to `max_tokens` tokens.

    Each decode bucket is captured once per block-table width in `widths` (plus
    `max_blocks`): attention kernels size their launch from that width (the longest
    context it allows), so a step of short contexts replays a graph sized for them rather
    than one that splits every sequence's keys for the longest context the model allows.

    `lazy`: `capture()` takes the largest buckets only, and `run` captures each other bucket
    on its first use (see the module's docstring).
    """

    @staticmethod
    def batch_cap(max_num_seqs: int) -> int:
        """The `max_batch` a runner captures for: the scheduler's `max_num_seqs`, up to the
        largest decode bucket (a step of more sequences runs eagerly)."""
        return min(max_num_seqs, DEFAULT_BUCKETS[-1])

    def __init__(self, step: Callable[..., Sequence[torch.Tensor]], device: torch.device, max_batch: int,
                 max_blocks: int, buckets=DEFAULT_BUCKETS, widths: tuple[int, ...] = (), max_tokens: int = 0,
                 token_buckets=DEFAULT_TOKEN_BUCKETS, rows_per_seq: int = 1,
                 stage_input: tuple[int, torch.dtype] | None = None, per_token: bool = False, lazy: bool = False):
        """`step(batch)`: the forward to capture (it writes the batch's KV); it returns a tuple
        of tensors whose rows are the batch's logits rows. `rows_per_seq` > 1 (speculative
        decoding verifies rows_per_seq - 1 drafts per sequence) also captures mixed graphs
        of fewer tokens than `max_batch`. A pipeline stage's: `stage_input` (width, dtype) of
        the activations it takes, `step(batch, hidden)` then reading them as [tokens, width];
        `per_token`: its outputs' rows are the batch's tokens, not its logits rows. `lazy`:
        capture each bucket but the largest on its first use."""
        self.step = step
        self.per_token = per_token
        self.lazy = lazy
        self.buckets = tuple(b for b in buckets if b < max_batch) + (max_batch,)
        self.widths = tuple(sorted({w for w in widths if 0 < w < max_blocks})) + (max_blocks,)
        # Mixed steps have more tokens than sequences: buckets past the decode sizes only, but
        # for verification steps.
        smallest = 1 if rows_per_seq > 1 else max_batch
        self.token_buckets = () if max_tokens <= smallest else (
            tuple(t for t in token_buckets if smallest < t < max_tokens) + (max_tokens,))
        self.max_rows = max_batch * rows_per_seq
        self.max_batch, self.max_blocks = max_batch, max_blocks
        # Each graph's inputs, at the start of one device buffer (the regions overlap).
        self.decode_inputs = {(size, width): _Inputs.of(size, size, width, size, decode=True)
                              for size in self.buckets for width in self.widths}
        self.mixed_inputs = {tokens: _Inputs.of(tokens, self._mixed_seqs(tokens), max_blocks,
                                                self._mixed_rows(tokens), decode=False)
                             for tokens in self.token_buckets}
        size = max(i.nbytes for i in (*self.decode_inputs.values(), *self.mixed_inputs.values()))
        self.device = device
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.decode_starts = torch.arange(max_batch + 1, dtype=torch.int32, device=device)  # one row per sequence
        self.decode_rows = torch.arange(max_batch, dtype=torch.int64, device=device)
        # The activations a stage takes: every graph reads its first rows (padding rows keep what
        # they held, finite: their outputs are sliced off, and they write no KV).
        self.hidden = None if stage_input is None else torch.zeros(
            max((self.buckets[-1], *self.token_buckets)), stage_input[0], dtype=stage_input[1], device=device)
        self.graphs: dict[tuple[int, int], Captured] = {}  # decode, by (size, width)
        self.mixed: dict[int, Captured] = {}  # by token bucket
        self.pool = None
        self.stream: torch.cuda.Stream | None = None  # every capture's side stream (`_capture_stream`)
        self.started = False  # capture() ran: steps replay graphs from then on

    def _views(self, inputs: _Inputs) -> Batch:
        """A graph's inputs in the device buffer (a decode graph's constants added)."""
        views = inputs.views(self.buffer)
        if inputs.decode:
            size = views.seq_lens.shape[0]
            views = views._replace(query_start_loc=self.decode_starts[:size + 1],
                                   logits_indices=self.decode_rows[:size])
        return views

    def _mixed_seqs(self, tokens: int) -> int:
        """Sequences a mixed bucket holds: no more than its tokens (a verification step of a
        few sequences then runs attention over those, not over `max_batch` empty ones)."""
        return min(tokens, self.max_batch)

    def _mixed_rows(self, tokens: int) -> int:
        """Logits rows a mixed bucket computes (`max_rows`, or one per token if fewer)."""
        return min(tokens, self.max_rows)

    def _step(self, batch: Batch) -> Sequence[torch.Tensor]:
        """The captured step over a graph's inputs (a stage's: its activations' rows too)."""
        return self.step(batch) if self.hidden is None else self.step(batch, self.hidden[:batch.num_tokens])

    def _capture(self, key: Key) -> Captured:
        """Capture `key`'s graph (at start, or on its first use) into the pool."""
        decode = isinstance(key, tuple)
        inputs = self.decode_inputs[key] if decode else self.mixed_inputs[key]
        # Capture-time batch: every token in the first sequence, no keys read or written.
        batch = self._views(inputs)
        self.buffer.zero_()  # (in stream order: after the replays queued before, which read it)
        batch.slot_mapping.fill_(-1)
        if not inputs.decode:
            batch.query_start_loc[1:].fill_(batch.num_tokens)
        stream = self._capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: lazy init and Triton autotuning off-graph
            self._step(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
            outputs = tuple(self._step(batch))
        self.pool = graph.pool()
        captured = Captured(graph, outputs, inputs, batch)
        (self.graphs if decode else self.mixed)[key] = captured
        return captured

    def _capture_stream(self) -> torch.cuda.Stream:
        """The side stream of this device every warm-up and capture runs on. Not torch.cuda.graph's
        own default, one stream per process made on whichever device captured first (a second
        engine on another GPU, data parallelism, would capture its kernels there); and one stream
        for all captures, not one each: cuBLAS and cuBLASLt keep a workspace per (handle, stream)
        for as long as the process lives (PyTorch issue 99196), so a stream per graph would leave
        a workspace behind for every graph captured."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        return self.stream

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, or (`lazy`) the largest mixed and decode ones: largest first,
        so that the smaller ones reuse their memory in the pool (see the module's docstring)."""
        mixed = sorted(self.token_buckets, reverse=True)
        decode = sorted(self.decode_inputs, reverse=True)  # (the first: max_batch at max_blocks)
        if self.lazy:
            mixed, decode = mixed[:1], decode[:1]
        gc.collect()
        with _frozen_heap():
            for key in (*mixed, *decode):
                self._capture(key)
            torch.cuda.synchronize()
        self.started = True

    @torch.inference_mode()
    def _capture_on_first_use(self, key: Key) -> Captured:
        """`key`'s graph, captured now, mid-run (`lazy`): between the steps queued before and
        its replay, in stream order (see the module's docstring)."""
        with _frozen_heap():  # (as capture(), without its collect: that would walk the heap mid-serving)
            return self._capture(key)

    def _key(self, batch: Batch | HostBatch) -> Key:
        """The bucket that replays `batch` (one that `can_run`)."""
        n, t = batch.num_seqs, batch.num_tokens
        if t == n:
            width = batch.block_tables.shape[1]
            return next(b for b in self.buckets if b >= n), next(w for w in self.widths if w >= width)
        return next(b for b in self.token_buckets if b >= t)

    def can_run(self, batch: Batch | HostBatch) -> bool:
        """A step within the captured sizes, once `capture()` ran: decode, or mixed where mixed
        graphs are captured (a bucket not captured yet is captured by `run`)."""
        n, t = batch.num_seqs, batch.num_tokens
        if not self.started or n > self.max_batch or batch.block_tables.shape[1] > self.max_blocks:
            return False
        if t == n:
            return batch.logits_indices.shape[0] == n
        if not self.token_buckets or t > self.token_buckets[-1]:
            return False
        return batch.logits_indices.shape[0] <= self._mixed_rows(next(b for b in self.token_buckets if b >= t))

    def run(self, batch: Batch | HostBatch, input_ids: torch.Tensor | None = None,
            hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The step's outputs (rows: len(batch.logits_indices), or its tokens with `per_token`)
        for a batch that `can_run`, by graph replay. A HostBatch moves in one copy; `input_ids`
        on the device, if given, replace the batch's own (tokens that never went to the host).
        `hidden`: a stage's input activations [tokens, width]. The outputs are the graph's own
        memory: the next replay of any graph of this pool may overwrite them. A bucket's first
        use captures it (`lazy`)."""
        t = batch.num_tokens
        key = self._key(batch)
        captured = (self.graphs if isinstance(key, tuple) else self.mixed).get(key)
        if captured is None:
            captured = self._capture_on_first_use(key)
        views = captured.views
        if isinstance(batch, HostBatch):
            staging = torch.empty(captured.inputs.nbytes, dtype=torch.uint8, pin_memory=True)  # (see host_copy.py)
            _fill(captured.inputs.views(staging.numpy()), batch)
            self.buffer[:captured.inputs.nbytes].copy_(staging, non_blocking=True)
        else:
            _fill(views, batch)
        if input_ids is not None:
            views.input_ids[:t].copy_(input_ids, non_blocking=True)
        if hidden is not None:
            self.hidden[:t].copy_(hidden, non_blocking=True)
        captured.graph.replay()
        rows = t if self.per_token else batch.logits_indices.shape[0]
        return tuple(out[:rows] for out in captured.outputs)
