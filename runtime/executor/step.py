"""What a step is to the executor: the chunks it computes, the input it launches, the results it returns.

The engine (runtime/engine/) plans a step as `Chunk`s, says in a `StepInput` which logits rows
sample, score prompt tokens or verify drafts, and has the executor launch it. The launch returns
an `InFlightStep` at once: its results (`StepTensors`, named fields, not offsets) are on their
way to the host, and `transfer.wait()` is the only place a step blocks.

With async scheduling the engine plans and launches step N+1 while the GPU still runs step N,
and reads step N's tokens only afterwards. Meanwhile:

- each sequence that sampled in step N counts one unresolved token (`Sequence.num_unresolved`);
  if step N+1 computes it, the input comes straight from the device, where the sampler left it
  in the input batch (`InputBatch.last_token`), never through the host;
- step N's results go to the host as non-blocking copies into pinned buffers, with an event
  recorded after them, so `DeviceToHost.wait` blocks for step N alone. (`.tolist()` on a
  CUDA tensor would also wait for step N+1, which is queued behind it: no overlap left.)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import torch

from nanoinfer.sampling.sampler import Logprobs, SamplingParams


class Sequence(Protocol):
    """What the executor reads of a sequence (the engine's runtime/engine/sequence.py, which
    it never changes): its tokens as known on the host, its place in the KV pools, its
    parameters."""

    seq_id: int
    params: SamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int]
    num_computed_tokens: int
    num_unresolved: int  # sampled by a step still in flight
    num_draft_computed: int  # how far a draft model's cache holds
    block_table: list[int]
    constraint: Any  # structured output's grammar state (nanoinfer/structured/grammars.py), or None

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_pending_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def is_finished(self) -> bool: ...


class Chunk(NamedTuple):
    """`num_tokens` tokens of `seq` from position `start`, computed by one step: its pending
    tokens, then `num_drafts` draft tokens to verify (speculative decoding). A sequence the
    step admits starts from its `cached` prefix blocks (the prefix cache), attached first."""

    seq: Sequence
    start: int
    num_tokens: int
    num_drafts: int = 0
    cached: tuple[int, ...] = ()


class SampledRow(NamedTuple):
    """Row i of a step's sampled tokens: which sequence it extends."""

    seq: Sequence
    logprobs: int | None  # top-k logprobs it asked for


class PromptLogprobRows(NamedTuple):
    """A prefill chunk's prompt logprobs: logits rows `first`.. score prompt tokens start+1 .. last."""

    seq: Sequence
    first: int  # index into the step's logits rows
    start: int
    targets: list[int]  # the prompt tokens those rows predict
    final: bool  # the chunk reaches the end of the prompt: the list is complete after it


class VerifiedRows(NamedTuple):
    """A sequence whose `num_drafts` drafts a step verifies in num_drafts + 1 rows, from logits
    row `first` (a row's token is its draft where accepted: the host needs no other copy)."""

    seq: Sequence
    first: int
    num_drafts: int
    logprobs: int | None = None  # top-k logprobs it asked for


class StepInput(NamedTuple):
    """What a step computes, in batch order (the engine decides it; the executor runs it)."""

    chunks: tuple[Chunk, ...]
    logits_rows: tuple[int, ...]  # token rows whose logits are computed
    samplers: tuple[tuple[Sequence, int], ...]  # (sequence, its index into those logits rows)
    prompt_rows: tuple[PromptLogprobRows, ...] = ()
    verifiers: tuple[VerifiedRows, ...] = ()  # rows verified (nanoinfer/sampling/rejection.py) rather than sampled
    host_drafts: tuple[int, ...] = ()  # the verifiers' drafts, in order, when the host proposed them (n-gram)


class VerifiedTensors(NamedTuple):
    """Per verification row: its draft passed, its token, its logits were finite."""

    accepted: torch.Tensor
    tokens: torch.Tensor
    finite: torch.Tensor
    logprobs: Logprobs | None  # when any verifying sequence asked for them


class StepTensors(NamedTuple):
    """A step's results, per sampled row unless said otherwise."""

    tokens: torch.Tensor  # [rows] int64
    finite: torch.Tensor  # [rows] bool: a row whose logits were not finite sampled garbage
    logprobs: Logprobs | None = None  # when any row asked for them
    prompt_logprobs: tuple[Logprobs, ...] = ()  # one per PromptLogprobRows
    verified: VerifiedTensors | None = None  # when the step verified drafts


def map_tensors(fn: Callable[[torch.Tensor], Any], tree):
    """`tree` (NamedTuples and tuples of tensors, None) with `fn` applied to each tensor."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if tree is None:
        return None
    items = [map_tensors(fn, t) for t in tree]
    return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)


def tensors_of(tree) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, tree)
    return found


class DeviceToHost:
    """Copies of a tree of device tensors on the host (the same shape of NamedTuples), complete
    once `wait()` returns. On the CPU the tensors are the copies; nothing is waited for."""

    def __init__(self, tree):
        self.event = None
        if not any(t.is_cuda for t in tensors_of(tree)):
            self.host = tree
            return
        # Pinned memory: what makes a device-to-host copy asynchronous. PyTorch's caching host
        # allocator keeps these buffers, so a step pays for no cudaHostAlloc after the first.
        self.host = map_tensors(lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
            t, non_blocking=True), tree)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host


class PendingSampling:
    """A step's sampling not queued yet, its grammar masks being filled on another thread
    (runtime/executor/grammar_masks.py): queued by the runner's next launch, before anything
    else goes on the stream, or when the step is read, whichever comes first, once. A
    DeviceToHost in every other respect. Queuing it never raises (the next launch is not to
    blame): reading the step raises the error, where the engine fails the step's sequences
    (`failed` is then set: runtime/engine/resolve.py)."""

    def __init__(self, sampling: Callable[[], DeviceToHost]):
        self._sampling, self._transfer = sampling, None
        self.failed: Exception | None = None

    def queue(self) -> None:
        if self._sampling is not None:
            sampling, self._sampling = self._sampling, None
            try:
                self._transfer = sampling()
            except Exception as exc:  # noqa: BLE001 - raised where the step is read
                self.failed = exc

    def wait(self):
        self.queue()
        if self.failed is not None:
            raise self.failed
        return self._transfer.wait()


class InFlightStep(NamedTuple):
    """A launched step: what its rows are, and its results on their way (`transfer.wait()`:
    a StepTensors on the host)."""

    rows: tuple[SampledRow, ...]
    prompt_logprobs: tuple[PromptLogprobRows, ...]
    transfer: DeviceToHost | PendingSampling
    verified: tuple[VerifiedRows, ...] = ()
    constrained: bool = False  # some row was masked by its sequence's grammar: the engine reads such
    # a step during the next one's launch, between its forward and its masks (the grammars first consume)
    draft_computed: tuple = ()  # (seq, position): how far its draft model's cache holds after the step
