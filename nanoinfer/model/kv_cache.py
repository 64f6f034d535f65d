"""The paged KV pool: one preallocated tensor for every layer's keys and values."""

from __future__ import annotations

import torch

from nanoinfer.model.config import ModelConfig
from nanoinfer.backends.host_copy import to_device
from nanoinfer.quant.quantized import FP8, to_fp8

# kv: [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]. Block-major with heads
# innermost, so one block of one layer is a contiguous [block_size, kv_heads, head_dim]
# slab: a page gather is one index_select, and a slot is a flat row of kv[l, i].view(-1, ...).
#
# The pool holds the model's dtype, or float8 e4m3 (`kv_cache_dtype="fp8"`): half the bytes a
# decode step reads and twice the tokens in the same memory. Keys and values are stored
# unscaled, saturated at e4m3's +-448 (vLLM's default where a checkpoint ships no KV scales),
# and every reader widens them back to the queries' dtype.

KV_CACHE_DTYPES = ("auto", "fp8")


def kv_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    return FP8 if kv_cache_dtype == "fp8" else model_dtype


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values in the pool's dtype (saturating into fp8: no NaN from a large value)."""
    return to_fp8(x) if dtype == FP8 and x.dtype != FP8 else x.to(dtype)


def allocate_kv_pool(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed pool of `num_blocks` blocks of `block_size` token slots for every layer."""
    shape = (cfg.num_layers + cfg.kv_extra_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers, keys and values (to size a pool from a budget)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (cfg.num_layers + cfg.kv_extra_layers) * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize


def copy_blocks(kv: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks within the pool, every layer at once (copy-on-write of shared blocks)."""
    if copies:
        src, dst = (to_device(idx, torch.int64, kv.device) for idx in zip(*copies))
        kv[:, :, dst] = kv[:, :, src]


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """Copy blocks between the device pool and the host pool, either way; (src block, dst block)."""
    if copies:
        src, dst = zip(*copies)
        moved = src_pool[:, :, torch.tensor(src, device=src_pool.device)]
        # Non-blocking only towards the device: a non-blocking copy to the host may still be
        # in flight when the host pool's index_put reads it.
        dst_pool[:, :, torch.tensor(dst, device=dst_pool.device)] = moved.to(dst_pool.device,
                                                                            non_blocking=dst_pool.is_cuda)
