"""Tensor parallelism: a model's weights split over N ranks, and the collectives its forward needs.

Rank r of N holds (Megatron's split, as nano-vllm, gpt-fast and vLLM shard):
- attention by heads: query heads r·H/N .. (r+1)·H/N, and the key/value heads those query
  heads read (heads are divided when N divides the KV heads; with more ranks than KV heads
  each KV head is held by N / KV ranks: a rank holds one);
- `gate_up` column-parallel (its slice of the intermediate units, gate and up alike), so
  SwiGLU runs on local values;
- `o_proj` and `down_proj` row-parallel (the input columns of its heads and units): each
  rank's output is a partial sum, and one all-reduce after each adds them up;
- the embedding and the LM head vocab-parallel: a rank holds ceil(V/N) rows (the last rows
  zero-padded); the embedding of an id outside a rank's rows is zero there, an all-reduce
  adds the ranks' lookups, and the logits' shards are all-gathered.

Each rank then runs the ordinary forward over its shard with `layer_functions` (the sharded
config's head counts and sizes are the rank's), and its own KV pool holds only its heads.
Collectives go through torch.distributed (gloo on the CPU, NCCL on CUDA): nothing home-made.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from nanoinfer.config import ModelConfig
from nanoinfer.errors import RequestError
from nanoinfer.model import LayerFunctions, LayerParams, Params
from nanoinfer.quantized import embedding


class Shard(NamedTuple):
    rank: int
    size: int  # N, the tensor-parallel world
    group: object = None  # the torch.distributed process group (None: the default one)


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """RequestError naming what keeps `cfg` from splitting over `size` ranks."""
    kv = cfg.num_kv_heads
    problems = [f"{name}={value} is not divisible by tensor_parallel_size={size}"
                for name, value in (("num_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size))
                if value % size]
    if kv % size and size % kv:
        problems.append(f"num_kv_heads={kv} and tensor_parallel_size={size}: expected one to divide the other")
    if problems:
        raise RequestError(f"{cfg.architecture} cannot be split over {size} ranks: " + "; ".join(problems),
                           param="tensor_parallel_size")


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The rank's view of the model: its heads and intermediate units (the vocabulary stays
    whole: the logits are gathered)."""
    check_shardable(cfg, size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size),
                               intermediate_size=cfg.intermediate_size // size)


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t[start:start + count].contiguous()


def _vocab_rows(table: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    per = -(-table.shape[0] // size)
    part = table[rank * per:(rank + 1) * per]
    if part.shape[0] < per:  # (the last rank's rows, padded: their logits are cut after the gather)
        part = torch.cat([part, part.new_zeros(per - part.shape[0], *part.shape[1:])])
    return part.contiguous()


def shard_params(params: Params, cfg: ModelConfig, rank: int, size: int) -> Params:
    """Rank `rank`'s part of dense weights (`cfg`: the whole model's config)."""
    check_shardable(cfg, size)
    d, heads, kv = cfg.head_dim, cfg.num_heads // size, max(1, cfg.num_kv_heads // size)
    kv_first = rank * cfg.num_kv_heads // size  # (with more ranks than KV heads: the head its queries read)
    inter = cfg.intermediate_size // size

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t.split((cfg.q_size, cfg.kv_size, cfg.kv_size))
        return torch.cat([_rows(q, rank * heads * d, heads * d), _rows(k, kv_first * d, kv * d),
                          _rows(v, kv_first * d, kv * d)])

    def layer(lp: LayerParams) -> LayerParams:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            if not isinstance(getattr(lp, name), torch.Tensor):
                raise RequestError(f"tensor parallelism needs dense weights here: {name} is "
                                   f"{type(getattr(lp, name)).__name__}", param="tensor_parallel_size")
        gate, up = lp.gate_up_proj.split(cfg.intermediate_size)
        return dataclasses.replace(
            lp, qkv_proj=qkv_rows(lp.qkv_proj), qkv_bias=None if lp.qkv_bias is None else qkv_rows(lp.qkv_bias),
            o_proj=lp.o_proj[:, rank * heads * d:(rank + 1) * heads * d].contiguous(),
            gate_up_proj=torch.cat([_rows(gate, rank * inter, inter), _rows(up, rank * inter, inter)]),
            down_proj=lp.down_proj[:, rank * inter:(rank + 1) * inter].contiguous())

    embed = _vocab_rows(params.embed, rank, size)
    lm_head = embed if params.lm_head is params.embed else _vocab_rows(params.lm_head, rank, size)
    return dataclasses.replace(params, embed=embed, lm_head=lm_head,
                               layers=tuple(layer(lp) for lp in params.layers))


def layer_functions(base: LayerFunctions, shard: Shard, vocab_size: int) -> LayerFunctions:
    """`base` with the collectives of rank `shard.rank`: sums after the row-parallel
    projections, the vocab-parallel embedding, the gathered logits."""
    rank, size, group = shard

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    def embed(table, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        per = table.shape[0]
        local = ids - rank * per
        inside = (local >= 0) & (local < per)
        x = embedding(table, local.clamp(0, per - 1), dtype) * inside[:, None].to(dtype)
        return all_reduce(x)

    def gather_logits(shard_logits: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(shard_logits) for _ in range(size)]
        dist.all_gather(parts, shard_logits.contiguous(), group=group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    return base._replace(all_reduce=all_reduce, embed=embed, gather_logits=gather_logits)
