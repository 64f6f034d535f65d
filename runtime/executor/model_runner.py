"""ModelRunner: the model on one device — its KV pools, its input batch, its kernels and graphs, and
the launch of a step (forward and sampling) whose results come back later.

The engine core decides what runs; the runner makes it run (the Executor interface,
runtime/executor/make_executor.py). It keeps each running sequence's state in the input batch
(runtime/executor/input_batch.py) so a step sends only what changed, builds the step's index
tensors from it with numpy, launches the forward (a CUDA graph for decode steps where it can)
and the sampler, and starts copying the results to the host without waiting:
`InFlightStep.transfer.wait()` is the only place a step blocks. Speculative decoding's draft
model and verification (runtime/executor/draft_runner.py, verify.py) and structured output's
masks (grammar_masks.py) plug in here when a step has them; tensor parallelism is a subclass
(tensor_parallel.py).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

from nanoinfer.model.batch import Batch, layout
from nanoinfer.model.decoder import EAGER
from nanoinfer.backends.host_copy import PinnedStaging, to_device_packed
from nanoinfer.model.kv_cache import kv_bytes_per_block
from nanoinfer.loaders import LoadedModel
from nanoinfer.sampling.sampler import compute_logprobs, greedy_and_finite, sample
from runtime.engine_config import EngineConfig
from runtime.executor.input_batch import InputBatch
from runtime.executor.kv_budget import kv_blocks_for_memory
from runtime.executor.device_model import DeviceModel
from runtime.executor.step import (
    DeviceToHost,
    InFlightStep,
    PendingSampling,
    SampledRow,
    StepInput,
    StepTensors,
)


class ForwardOutput(NamedTuple):
    """A step's forward, per logits row: the logits (the model's dtype) and what a greedy step
    needs of them, computed in the same CUDA graph."""

    logits: torch.Tensor  # [rows, vocab]
    greedy: torch.Tensor  # [rows] int64: the most likely token
    finite: torch.Tensor  # [rows] bool: every logit finite


class ModelRunner(DeviceModel):
    steps_in_flight = 1  # (the Executor protocol's: one step overlaps the host's work on the next)
    defers_sampling = True  # (a masked step's sampling may wait for the next launch: see __init__)

    def __init__(self, model: LoadedModel, config: EngineConfig, max_model_len: int,
                 draft: LoadedModel | None = None):
        """`draft`: the draft model of speculative decoding, if any (its KV pool takes its share
        of the memory: runtime/executor/draft_runner.py)."""
        super().__init__(model, config)
        cfg, dtype = self.cfg, self.kv_dtype
        self.attention = self.kernels.attention
        per_block = self._kv_bytes_per_block(dtype)
        if draft is not None:
            from runtime.executor.draft_runner import draft_bytes_per_block

            per_block += draft_bytes_per_block(draft, config)
        # (the profiling step's MLP as the steps run it: a mixture of experts' grouped kernels hold every
        # (token, expert) pair's intermediate rows, which the reference's loop over experts never does at once;
        # its sums over ranks stay out: a rank profiles alone)
        peak_fns = EAGER._replace(attention_output_and_mlp=self.kernels.layer_fns.attention_output_and_mlp)
        self.num_blocks = config.num_blocks or kv_blocks_for_memory(model, config, max_model_len, per_block,
                                                                    lambda: self.attention, peak_fns)
        self.num_cpu_blocks = config.swap_space // per_block
        # No sequence outgrows the whole pool: the tables and graphs are sized for the longest one it holds,
        # not for a declared context (a long-context or hostile file's may be billions of positions).
        self.max_model_len = min(max_model_len, self.num_blocks * config.block_size)
        self.max_blocks = -(-self.max_model_len // config.block_size)
        self._before_pools(dtype)
        self._allocate(self.num_blocks, self.num_cpu_blocks)
        # (n - 1 forks may take rows in the step their parent's prefill ends, before it is planned)
        self.batch = InputBatch(config.scheduler.max_num_seqs + 8, self.max_blocks, cfg.vocab_size,
                                cfg.eos_token_ids, self.device)
        self.row_of = self.batch.row_of
        self.staging = PinnedStaging(self.device) if self.device.type == "cuda" else None  # (each step's inputs go through it)
        self.draft = None
        if draft is not None:
            from runtime.executor.draft_runner import DraftRunner

            self.draft = DraftRunner(draft, config, self.num_blocks, self.num_cpu_blocks, self.batch)
            self.pools.followers.append(self.draft.pools)
        self.constrained: set[int] = set()  # ids of the sequences with rows that a grammar constrains
        # With async scheduling a step's masks are filled while the host plans the next step,
        # and its sampling is queued by the next launch (`_pending` until then): grammar_masks.py.
        self.defer_sampling = self.defers_sampling and (
            self.device.type == "cuda" if config.async_scheduling is None else bool(config.async_scheduling))
        self._pending: PendingSampling | None = None
        self._grammars = None
        if self.kernels.graphs:
            self._capture(**self._graph_sizes()._asdict())

    def _graph_sizes(self):
        from nanoinfer.backends.cuda.graphs import GraphSizes, StepGraphs

        spec, c = self.config.speculative_config, self.config
        return GraphSizes(
            max_batch=StepGraphs.batch_cap(c.scheduler.max_num_seqs), max_blocks=self.max_blocks,
            max_tokens=c.scheduler.max_num_batched_tokens,
            # Steps of short contexts get graphs whose attention does not split them (no
            # reduce kernel).
            widths=self.attention.graph_widths(c.block_size),
            rows_per_seq=1 + (0 if spec is None else spec.num_speculative_tokens),
            lazy=c.cuda_graph_capture == "lazy")

    def _kv_bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        """Bytes of one KV block, which the pool's size is counted in (the tensor-parallel
        subclass: the largest of its ranks')."""
        return kv_bytes_per_block(self.cfg, self.config.block_size, kv_dtype)

    def _before_pools(self, kv_dtype: torch.dtype) -> None:
        """(A seam of tensor_parallel.py's subclass: the ranks' setup.)"""

    @property
    def grammars(self):
        """Structured output's compiler and masks (nanoinfer/structured/grammars.py), made on first use."""
        if self._grammars is None:
            from nanoinfer.structured.grammars import Grammars

            self._grammars = Grammars(self.model.tokenizer, self.cfg.vocab_size)
        return self._grammars

    def close(self) -> None:
        """Give the device's memory back: weights, pools, graphs, the step's buffers and the draft's (the
        tensor-parallel runner stops its ranks first). Nothing runs here after."""
        draft = getattr(self, "draft", None)  # (a start that failed before the draft was made closes too)
        if draft is not None:
            draft.release()
        self.release()
        self.draft = self.batch = self.staging = self._pending = None

    # -- rows (the KV blocks' copies and swaps: self.pools) --------------------------------------------------------------------------------

    def add(self, seq) -> None:
        """`seq` starts running: give it a row."""
        self.batch.add(seq)
        if seq.constraint is not None:
            self.constrained.add(seq.seq_id)

    def remove(self, seq) -> None:
        """`seq` stopped running (finished, preempted): free its row."""
        self.batch.remove(seq)
        self.constrained.discard(seq.seq_id)

    def table_changed(self, seq) -> None:
        """`seq`'s block table grew, or a block in its write range was replaced (copy-on-write)."""
        if seq in self.batch:
            self.batch.sync_table(seq, seq.num_computed_tokens // self.block_size)

    def emitted(self, seq, token_ids: list[int]) -> None:
        """Tokens a verification emitted for `seq`: its penalty counts learn them (a sampled
        step's tokens are counted on the device as they are drawn)."""
        self.batch.emitted(seq, token_ids)

    # -- a step --------------------------------------------------------------------------------

    def _build(self, inp: StepInput, draft_tokens: torch.Tensor | None) -> tuple[Batch, np.ndarray, torch.Tensor]:
        """The step's Batch; also the samplers' rows, on the host and the device."""
        rows_of, bs = self.batch.row_of, self.block_size
        # One pass over the chunks (it runs for every sequence, every step), then numpy.
        meta: list[int] = []  # row, start, tokens, tokens known on the host: per chunk
        host_tokens: list[int] = []
        draft_at: list[int] = []  # batch rows of draft tokens (taken from the device)
        offset = 0
        for seq, start, n, drafts, _ in inp.chunks:
            ids = seq.token_ids
            known = min(start + n - drafts, len(ids)) - start
            if known == 1:
                host_tokens.append(ids[start])
            elif known > 1:
                host_tokens += ids[start:start + known]
            if drafts:
                host_tokens += [0] * drafts  # (placeholders: overwritten from the device below)
                draft_at += range(offset + known, offset + known + drafts)
                known += drafts
            meta += (rows_of[seq.seq_id], start, n, known)
            offset += n
        rows, starts, lens, known = np.array(meta, dtype=np.int64).reshape(-1, 4).T
        at = layout(starts, lens, self.batch.table_np, rows, bs)
        # Tokens known on the host come from it; a chunk that ends at a token still on its way
        # (sampled by the step in flight) takes it from the device, where it already is.
        from_host = at.positions < (starts + known)[at.seq_of_token]
        input_ids = np.zeros(at.positions.shape[0], dtype=np.int64)
        input_ids[from_host] = host_tokens
        fill_at = np.flatnonzero(~from_host)
        fill_rows = rows[at.seq_of_token[fill_at]]
        sampler_meta = [v for seq, _ in inp.samplers
                        for v in (rows_of[seq.seq_id], len(seq.token_ids) - seq.num_prompt_tokens + seq.num_unresolved)]
        sampler_rows, steps = np.array(sampler_meta, dtype=np.int64).reshape(-1, 2).T
        (input_ids_t, positions_t, slots_t, logits_t, rows_t, fill_at_t, fill_rows_t, sampler_rows_t,
         steps_t, draft_at_t) = to_device_packed([input_ids, at.positions, at.slot_mapping, inp.logits_rows, rows,
                                                  fill_at, fill_rows, sampler_rows, steps, draft_at], torch.int64,
                                                 self.device, self.staging)
        seq_lens, qsl_t = to_device_packed([at.seq_lens, at.query_start_loc], torch.int32, self.device,
                                           self.staging)
        # The step before's sampling, if pending, goes first: it writes the last tokens read below
        # and that the rows joining now overwrite (the host work above overlaps its masks' fill).
        self.queue_pending()
        self.batch.flush()
        if len(fill_at):
            input_ids_t.index_copy_(0, fill_at_t, self.batch.last_token.index_select(0, fill_rows_t))
        if draft_at:
            input_ids_t.index_copy_(0, draft_at_t, draft_tokens)
        block_tables = self.batch.table_device.index_select(0, rows_t)[:, :at.num_blocks]
        batch = Batch(input_ids_t, positions_t, slots_t, block_tables, seq_lens, qsl_t, logits_t)
        return batch, sampler_rows, (sampler_rows_t, steps_t)

    def _eager_forward(self, batch: Batch) -> ForwardOutput:
        logits = self._forward_logits(batch)
        return ForwardOutput(logits, *(self.kernels.greedy or greedy_and_finite)(logits))

    def _forward(self, batch: Batch) -> ForwardOutput:
        """The step's forward: a CUDA graph's replay where one fits the batch."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return ForwardOutput(*self.graphs.run(batch))
        return self._eager_forward(batch)

    def launch(self, inp: StepInput, forward_done: Callable[[], None] = lambda: None,
               before_sampling: Callable[[], None] = lambda: None) -> InFlightStep:
        """Queue the step's forward and sampling and start copying the results to the host;
        returns without waiting for the device. Changes no sequence. (`forward_done` is called
        between the two, for the step's phase timings.) `before_sampling` runs once the forward
        is queued, before the grammar masks are filled: the engine reads the step before there,
        so that its grammars consume their tokens while the device runs this forward (the
        forward needs no mask; only the sampler does). With async scheduling, a step whose
        masks are still being filled leaves its sampling pending (`PendingSampling`): the next
        launch queues it once its inputs are on their way (`_build`), or reading the step does."""
        draft_tokens = draft_probs = None
        draft_computed = ()
        if self.draft is not None:  # a draft model proposes now that the plan gave its slots
            draft_tokens, draft_probs, draft_computed = self.draft.propose(
                [(c.seq, c.start, c.num_tokens) for c in inp.chunks])
        elif inp.host_drafts:
            (draft_tokens,) = to_device_packed([inp.host_drafts], torch.int64, self.device)
        batch, sampler_rows, (sampler_rows_t, steps_t) = self._build(inp, draft_tokens)
        verify = None
        if inp.verifiers:
            from runtime.executor.verify import Verification

            verify = Verification(self, inp, draft_tokens, draft_probs)
        out = self._forward(batch)
        forward_done()
        st = self.batch.sampling(sampler_rows, sampler_rows_t, steps_t)  # (before_sampling may free rows)
        before_sampling()
        masks = None
        if self.constrained:  # (no pass over rows when no sequence is constrained)
            from runtime.executor.grammar_masks import grammar_masks

            masks = grammar_masks(self, [(seq, i, ()) for i, (seq, _) in enumerate(inp.samplers)],
                                  later=self.defer_sampling and verify is None and self.draft is None)
        wanted = [s.params.logprobs for s, _ in inp.samplers]

        def sampling() -> DeviceToHost:
            return _sample(self, inp, out, st, masks, verify, sampler_rows_t, wanted)

        if masks is not None and masks.filling is not None:
            transfer = self._pending = PendingSampling(sampling)
        else:
            transfer = sampling()
        rows = tuple(SampledRow(seq, k) for (seq, _), k in zip(inp.samplers, wanted))
        return InFlightStep(rows, inp.prompt_rows, transfer, inp.verifiers,
                            constrained=masks is not None or (verify is not None and verify.masks is not None),
                            draft_computed=draft_computed)

    def queue_pending(self) -> None:
        """Queue the sampling a step left pending, if any: before anything on the stream that
        reads or writes what it does (the step's logits, each row's last token and penalty
        counts: the next forward, and the rows that join)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.queue()


def _sample(runner: ModelRunner, inp: StepInput, out: ForwardOutput, st, masks, verify, sampler_rows_t: torch.Tensor,
            wanted: list) -> DeviceToHost:
    """Queue the step's sampling (or verification) over its forward's output `out`, masked
    by the grammars' `masks` (grammar_masks.StepMasks, or None), and the copy of its
    results to the host."""
    full, all_logits = out, out.logits
    sample_at = [i for _, i in inp.samplers]
    if sample_at != list(range(out.logits.shape[0])):  # (a pure decode step needs no gather)
        (index,) = to_device_packed([sample_at], torch.int64, runner.device)
        out = ForwardOutput(*(t.index_select(0, index) for t in out))
    logits = out.logits
    if st.all_greedy and st.penalties is None and masks is None:
        tokens = out.greedy  # (the graph's own argmax: no float copy of the logits, no launch)
    elif masks is None:
        logits = logits.float()
        tokens = sample(logits, st, runner.kernels.draw, greedy=out.greedy)
    else:  # (the masked copy is the float copy; logprobs below read the raw logits)
        tokens = sample(masks.applied(logits, runner.device, runner.kernels.mask), st, runner.kernels.draw)
    runner.batch.sampled(sampler_rows_t, tokens)
    logprobs = None
    if any(k is not None for k in wanted):
        logprobs = compute_logprobs(logits, tokens, max(k or 0 for k in wanted))
    prompt_logprobs = _prompt_logprobs(inp, all_logits, runner.device)
    verified = None if verify is None else verify.run(full)
    transfer = DeviceToHost(StepTensors(tokens, out.finite, logprobs, prompt_logprobs, verified))
    if verify is not None:
        verify.after_transfer(verified)
    return transfer


def _prompt_logprobs(inp: StepInput, all_logits: torch.Tensor, device: torch.device) -> tuple:
    """The logprobs of the prompt tokens that the step's prompt rows asked for, one tensor each."""
    out = []
    for entry in inp.prompt_rows:
        (target_t,) = to_device_packed([entry.targets], torch.int64, device)
        out.append(compute_logprobs(all_logits[entry.first:entry.first + len(entry.targets)], target_t,
                                    entry.seq.params.prompt_logprobs))
    return tuple(out)
