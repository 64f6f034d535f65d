"""The paged KV pool: one preallocated tensor for every layer's keys and values."""

from __future__ import annotations

import torch

from nanoinfer.config import ModelConfig

# kv: [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]. Block-major with heads
# innermost, so one block of one layer is a contiguous [block_size, kv_heads, head_dim]
# slab: a page gather is one index_select, and a slot is a flat row of kv[l, i].view(-1, ...).


def allocate_kv_pool(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A zeroed pool of `num_blocks` blocks of `block_size` token slots for every layer."""
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers, keys and values (to size a pool from a budget)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize
