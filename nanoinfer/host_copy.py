"""to_device: host values onto a device without waiting for the work already queued there.

CUDA copies from pageable host memory to the GPU first wait for the stream to drain, so
every `torch.tensor(list).to("cuda", non_blocking=True)` in a step would stall the host until
the step before it finishes, undoing the overlap of host and GPU work (runtime/executor/inflight.py).
Staging through pinned memory makes the copy truly asynchronous; PyTorch's caching host
allocator recycles the pinned buffers and reuses one only once its copy has completed.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
          torch.bool: np.bool_}


def to_device_packed(arrays, dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Several host arrays of one dtype as tensors on `device`, in one copy: concatenated
    into one buffer, moved, and split back into views of their shapes. (Each copy costs a
    pinned staging and a launch, ~30 µs of host time: a decode step at batch 1 has a dozen.)"""
    if torch.device(device).type == "cpu":  # (nothing to pack: no copy to save)
        return [torch.from_numpy(np.asarray(a, dtype=_NUMPY[dtype])) for a in arrays]
    arrays = [np.asarray(a) for a in arrays]
    # Each view starts at a multiple of 16 elements: Triton specializes kernels on 16-byte
    # pointer alignment, and views at arbitrary offsets would compile (and run) other variants.
    padded = [-(-a.size // 16) * 16 for a in arrays]
    staging = _pinned(sum(padded), dtype)
    host, start = staging.numpy(), 0
    for a, size in zip(arrays, padded):
        host[start:start + a.size] = a.ravel()
        start += size
    flat = staging.to(device, non_blocking=True)
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
