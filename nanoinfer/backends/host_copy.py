"""to_device: host values onto a device without waiting for the work already queued there.

CUDA copies from pageable host memory to the GPU first wait for the stream to drain, so
every `torch.tensor(list).to("cuda", non_blocking=True)` in a step would stall the host until
the step before it finishes, undoing the overlap of host and GPU work (runtime/executor/inflight.py).
Staging through pinned memory makes the copy truly asynchronous; PyTorch's caching host
allocator recycles the pinned buffers and reuses one only once its copy has completed. A step
loop's own copies go through a PinnedStaging instead: its few buffers are reused in turn.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
          torch.bool: np.bool_}


class PinnedStaging:
    """Pinned host buffers that `to_device_packed` stages through, taken in turn: one is written again only once
    the copy out of it has completed (its CUDA event, recorded after the copy). PyTorch's caching host allocator
    hands out a block per copy and queries an event of every block it holds to recycle them: ~8% of a busy
    server's step loop (issue 60's profile). `slots` must exceed the copies of the steps in flight; more only
    wait less."""

    def __init__(self, device: torch.device, slots: int = 8):
        self.device = torch.device(device)  # (whose stream the copies are queued on: not always the current device's)
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._copied: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def take(self, size: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """A slot and its buffer as `size` elements of `dtype`, free to write (its last copy has completed)."""
        slot, self._next = self._next, (self._next + 1) % len(self._buffers)
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()  # (done already unless `slots` copies were queued since)
        nbytes = size * dtype.itemsize
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:  # (grown by doubling: a few allocations over a run)
            buffer = torch.empty(max(nbytes, 2 * (0 if buffer is None else buffer.numel()), 1 << 12),
                                 dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buffer
        return slot, buffer[:nbytes].view(dtype)

    def copied(self, slot: int) -> None:
        """The copy out of `slot` is queued on the device's current stream: the buffer is busy until it runs."""
        event = self._copied[slot] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._copied[slot] = event


def to_device_packed(arrays, dtype: torch.dtype, device: torch.device | str,
                     staging: PinnedStaging | None = None) -> list[torch.Tensor]:
    """Several host arrays of one dtype as tensors on `device`, in one copy: concatenated
    into one buffer, moved, and split back into views of their shapes. (Each copy costs a
    pinned staging and a launch, ~30 µs of host time: a decode step at batch 1 has a dozen.)
    `staging`: the caller's PinnedStaging (a step loop's), else a buffer from the caching allocator."""
    if torch.device(device).type == "cpu":  # (nothing to pack: no copy to save)
        return [torch.from_numpy(np.asarray(a, dtype=_NUMPY[dtype])) for a in arrays]
    arrays = [np.asarray(a) for a in arrays]
    # Each view starts at a multiple of 16 elements: Triton specializes kernels on 16-byte
    # pointer alignment, and views at arbitrary offsets would compile (and run) other variants.
    padded = [-(-a.size // 16) * 16 for a in arrays]
    slot, buffer = staging.take(sum(padded), dtype) if staging is not None else (None, _pinned(sum(padded), dtype))
    host, start = buffer.numpy(), 0
    for a, size in zip(arrays, padded):
        host[start:start + a.size] = a.ravel()
        start += size
    flat = buffer.to(device, non_blocking=True)
    if staging is not None:
        staging.copied(slot)
    out, start = [], 0
    for a, size in zip(arrays, padded):
        out.append(flat[start:start + a.size].view(a.shape))
        start += size
    return out


def _pinned(size: int, dtype: torch.dtype) -> torch.Tensor:
    """A pinned host buffer from PyTorch's caching host allocator. (Pinning a pageable tensor
    instead first asks the driver whether it is pinned: measured at ~0.5 ms a call, a dozen a
    step.)"""
    return torch.empty(size, dtype=dtype, pin_memory=True)


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list, numpy array or CPU tensor) as a `dtype` tensor on `device`."""
    if torch.device(device).type != "cuda":
        t = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else torch.as_tensor(values)
        return t.to(dtype).to(device)
    if isinstance(values, torch.Tensor):
        return values.to(dtype).pin_memory().to(device, non_blocking=True)
    array = np.asarray(values, dtype=_NUMPY[dtype])
    staging = _pinned(array.size, dtype)
    staging.numpy()[:] = array.ravel()
    return staging.view(array.shape).to(device, non_blocking=True)
