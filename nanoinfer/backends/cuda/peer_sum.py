"""Sums over tensor-parallel ranks for one token, over NVLink peer memory instead of NCCL.

At batch 1 a tensor-parallel step runs two all-reduces a layer of a few KB each; NCCL's take
6-10 µs apiece inside a CUDA graph (bench/RESULTS.md: 65 a step, 0.45 ms of an 8B step's
3.5 ms at TP=2), mostly its kernel's own start and protocol, not bytes. Here the projection
that makes a partial sum (nanoinfer.backends.cuda.gemv.fused_gemv with a `Push`) stores its outputs straight
into a slot of every rank's buffer, and one small kernel a rank (`PeerLinks.pull`) waits for
the ranks' outputs there, adds them and writes the sum: no collective kernel, no copy.

The protocol is NCCL's "LL": each 8-byte word holds two outputs and a flag, written with one
store, so a reader that sees a word's flag sees its outputs, with no fence and no counter to
wait for (a first version counted each GEMV program's rows with a release at system scope: the
8B step was slower than with NCCL's sums).
The flag is 1 or 2 by the parity of the slot's uses, which each rank counts alike (its pull
adds one once it has read): a word still holding the slot's last use has the other flag.
Two slots alternate: a layer's output projection sums in slot 0, its down projection in slot 1.
A rank can be no more than one sum ahead of any peer (every sum waits for all ranks), so the
slot it writes has been read. The sum is in fp32 in rank order, rounded once: at two ranks the
same as NCCL's sum of two bf16 values.

The buffers are torch's symmetric memory (each rank maps its peers'), allocated and exchanged
once (`PeerLinks.connect`, a collective: every rank calls it at the same point, before any
step). Torch exchanges the buffers' handles through the process group's store under keys
numbered by a count of exchanges kept per process (StoreExchange's `seq_id_` in its C++
source), so a rendezvous only meets peers that made as many before it. The ranks an engine
starts are new processes, rank 0 is the user's: a second engine in one process hung in the
rendezvous (2x H100: both ranks waiting, with a name of its own as with the default group's).
So a process makes one rendezvous (`PeerLinks.first_in_process`) and a later engine sums with
NCCL. The reference is `dist.all_reduce` (tests/test_gpu_tensor_parallel.py; the kernels
alone, with one process's buffers as the ranks': tests/test_peer_sum.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from nanoinfer.backends.cuda import pdl
from nanoinfer.model.decoder import RankSum

_SLOTS = 2
_HEAD = 128  # bytes before the slots: each slot's count of uses (int32), then the failed pulls' count
_POLLS = 1 << 22  # (seconds of polling)
# Whether this process made a symmetric-memory rendezvous: state of the process, as torch's
# count of exchanges is (see the module docstring).
_RENDEZVOUS: dict[str, bool] = {"made": False}


@triton.jit
def _pull_kernel(words_ptr, uses_ptr, failed_ptr, out_ptr, WORDS, POLLS, RANKS: tl.constexpr, RANKS_P2: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # One program: every rank's words of this slot at once, re-read (volatile: from L2, where the
    # peers' NVLink stores land) until every flag is this use's (one round trip a poll, not one
    # a rank). After POLLS reads it gives up and counts a failure: a wrong sum rather than a
    # hang when a peer is gone (the engine's watchdog reports the lost rank). After a failure no
    # pull waits: the ranks are out of step for good, and a step's 2 pulls a layer would each
    # wait out their polls.
    if PDL:  # (nanoinfer.backends.cuda.pdl: the next kernel's programs may start fetching their weights while this waits)
        pdl.start()
    uses = tl.load(uses_ptr)
    limit = tl.where(tl.load(failed_ptr) > 0, 0, POLLS)
    flag = (uses & 1) + 1
    ranks = tl.arange(0, RANKS_P2)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (ranks < RANKS) & (offs < WORDS)
    ptrs = words_ptr + ranks * WORDS + offs
    word = tl.load(ptrs, mask=mask, other=0, volatile=True)
    # (the stale words counted in int32: a min over booleans is an any, true being -1 as int1)
    stale = tl.sum(tl.sum((((word >> 32).to(tl.int32) != flag) & mask).to(tl.int32), 1), 0)
    polls = 0
    while (stale > 0) & (polls < limit):
        word = tl.load(ptrs, mask=mask, other=0, volatile=True)
        stale = tl.sum(tl.sum((((word >> 32).to(tl.int32) != flag) & mask).to(tl.int32), 1), 0)
        polls += 1
    if stale > 0:
        tl.atomic_add(failed_ptr, 1)
    dtype = out_ptr.dtype.element_ty
    lo = (word & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
    hi = ((word >> 16) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
    lo_sum = tl.zeros([BLOCK], tl.float32)
    hi_sum = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(RANKS):  # (in rank order, each rank's row picked out exactly: NCCL's order)
        lo_sum += tl.sum(tl.where(ranks == r, lo, 0.0), 0)
        hi_sum += tl.sum(tl.where(ranks == r, hi, 0.0), 0)
    out = tl.reshape(tl.join(lo_sum, hi_sum), [2 * BLOCK])
    offs_out = tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + offs_out, out.to(dtype), mask=offs_out < 2 * WORDS)
    tl.store(uses_ptr, uses + 1)


@dataclass
class Push:
    """Where one projection's outputs go: `table` (int64 on the device) holds each rank's slot
    address for this rank's words, then the address of this rank's count of the slot's uses;
    `configs` are the GEMV's tuned configs, kept so that a push never runs in a tuning
    (nanoinfer.backends.cuda.gemv.fused_gemv)."""

    table: torch.Tensor
    ranks: int
    configs: dict = field(default_factory=dict)  # the GEMV's, by its tuning key


class PeerLinks:
    """One rank's sum buffers and its peers' addresses (see the module docstring)."""

    def __init__(self, rank: int, ranks: int, hidden: int, dtype: torch.dtype, device: torch.device):
        if hidden % 2:
            raise ValueError(f"peer sums pair a row's outputs: hidden size {hidden} is odd")
        self.rank, self.ranks, self.hidden, self.dtype, self.device = rank, ranks, hidden, dtype, device
        self.buffer: torch.Tensor | None = None
        self.pushes: tuple[Push, ...] = ()
        self._handle = None  # (torch's symmetric memory: the peers' buffers mapped here)

    @property
    def ready(self) -> bool:
        return self.buffer is not None

    def _slot_bytes(self) -> int:
        return self.ranks * self.hidden // 2 * 8

    @staticmethod
    def head_bytes() -> int:
        """The buffer's head: each slot's count of uses, the failed pulls' count."""
        return _HEAD

    def nbytes(self) -> int:
        """The buffer's size: the head, then each slot's words from every rank."""
        return _HEAD + _SLOTS * self._slot_bytes()

    @staticmethod
    def first_in_process() -> bool:
        """Whether `connect` can meet new ranks: no rendezvous was made in this process."""
        return not _RENDEZVOUS["made"]

    def connect(self, group_name: str) -> None:
        """Allocate this rank's buffer and map the peers' (a collective over the process group
        `group_name`: every rank calls it at the same point, before any step, once a process)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        if not self.first_in_process():
            raise RuntimeError("peer sums connect once a process: torch counts its symmetric-memory exchanges per "
                               "process, and a rendezvous with new ranks would wait for ever")
        _RENDEZVOUS["made"] = True
        buffer = symm_mem.empty(self.nbytes(), dtype=torch.uint8, device=self.device)
        buffer.zero_()
        self._handle = symm_mem.rendezvous(buffer, group_name)
        torch.cuda.synchronize(self.device)
        # (every rank's buffer is zero before any rank writes a peer's; on this rank's device: it
        # may be the first NCCL call, and a guess would take cuda:rank)
        dist.barrier(device_ids=[torch.device(self.device).index])
        self.attach(buffer, [int(p) for p in self._handle.buffer_ptrs])

    def attach(self, buffer: torch.Tensor, bases: list[int]) -> None:
        """Use `buffer` (zeroed) as this rank's, `bases[r]` as rank r's address of its own
        (`connect`; tests/test_peer_sum.py gives the ranks' buffers of one process)."""
        self.buffer = buffer
        mine = self.rank * self.hidden // 2 * 8
        self.pushes = tuple(
            Push(torch.tensor([base + _HEAD + slot * self._slot_bytes() + mine for base in bases]
                              + [buffer.data_ptr() + 4 * slot], dtype=torch.int64, device=buffer.device), self.ranks)
            for slot in range(_SLOTS))

    def pull(self, slot: int, polls: int = _POLLS) -> torch.Tensor:
        """The sum [1, hidden] of the outputs every rank pushed into `slot` (waits for them, up to
        `polls` reads of every rank's words; then `failures` counts it)."""
        assert self.buffer is not None, "PeerLinks.connect first"
        words = self.buffer[_HEAD:].view(torch.int64).view(_SLOTS, self.ranks * self.hidden // 2)
        head = self.buffer[:_HEAD].view(torch.int32)
        out = torch.empty((1, self.hidden), dtype=self.dtype, device=self.buffer.device)
        ranks, block = triton.next_power_of_2(self.ranks), triton.next_power_of_2(self.hidden // 2)
        # (8 warps measured at 2 and 4 ranks of 2,048 words; more where the words would spill registers)
        _pull_kernel[(1,)](words[slot], head[slot:], head[_SLOTS:], out, self.hidden // 2, polls,
                           RANKS=self.ranks, RANKS_P2=ranks, BLOCK=block,
                           num_warps=min(32, max(8, ranks * block // 1024)), **pdl.launch(out.device))
        return out

    def failures(self) -> int:
        """How many pulls gave up waiting for a peer's outputs (their sums are wrong). Reads the
        device: not for a step's path."""
        return 0 if self.buffer is None else int(self.buffer[:_HEAD].view(torch.int32)[_SLOTS].item())

    def close(self) -> None:
        """Drop the buffers."""
        self.buffer, self.pushes, self._handle = None, (), None


@dataclass(frozen=True)
class PeerSum(RankSum):
    """A `RankSum` whose one-token sums after the fused projections go over `links`
    (nanoinfer.backends.cuda.fused_layers); any other sum is `sum`'s (NCCL)."""

    links: PeerLinks | None = None
