"""Tensor parallelism: a model's weights split over N ranks, and the collectives its forward needs.

Rank r of N holds (Megatron's split, as nano-vllm, gpt-fast and vLLM shard):
- attention by heads: whole GQA groups (a KV head and the query heads that read it), r·KV/N
  .. (r+1)·KV/N, uneven where N does not divide them; with more ranks than KV heads, the
  N/KV ranks sharing a KV head each hold it and split its query heads (`rank_heads`);
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
    kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    problems = []
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by tensor_parallel_size={size}")
    if kv < size and (size % kv or group % (size // kv)):
        problems.append(f"num_kv_heads={kv} (each read by {group} query heads) cannot be shared evenly by {size} "
                        f"ranks: expected tensor_parallel_size to be a multiple of num_kv_heads that splits "
                        f"each group of query heads")
    if problems:
        raise RequestError(f"{cfg.architecture} cannot be split over {size} ranks: " + "; ".join(problems),
                           param="tensor_parallel_size")


def rank_heads(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of rank `rank`. With at least
    as many KV heads as ranks each rank takes whole GQA groups (r·KV/N .. (r+1)·KV/N: uneven
    when N does not divide them, as 3 KV heads over 2 ranks); with fewer, the N/KV ranks
    sharing a KV head split its group of query heads."""
    check_shardable(cfg, size)
    kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    if kv >= size:
        first, last = rank * kv // size, (rank + 1) * kv // size
        return first * group, (last - first) * group, first, last - first
    share = size // kv
    per = group // share
    return (rank // share) * group + (rank % share) * per, per, rank // share, 1


def shard_config(cfg: ModelConfig, rank: int, size: int) -> ModelConfig:
    """Rank `rank`'s view of the model: its heads and intermediate units (the vocabulary stays
    whole: the logits are gathered)."""
    _, heads, _, kv = rank_heads(cfg, rank, size)
    return dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv, intermediate_size=cfg.intermediate_size // size)


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
    d, inter = cfg.head_dim, cfg.intermediate_size // size
    q_first, heads, kv_first, kv = rank_heads(cfg, rank, size)

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:
        q, k, v = t.split((cfg.q_size, cfg.kv_size, cfg.kv_size))
        return torch.cat([_rows(q, q_first * d, heads * d), _rows(k, kv_first * d, kv * d),
                          _rows(v, kv_first * d, kv * d)])

    def layer(lp: LayerParams) -> LayerParams:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            if not isinstance(getattr(lp, name), torch.Tensor):
                raise RequestError(f"tensor parallelism needs dense weights here: {name} is "
                                   f"{type(getattr(lp, name)).__name__}", param="tensor_parallel_size")
        gate, up = lp.gate_up_proj.split(cfg.intermediate_size)
        return dataclasses.replace(
            lp, qkv_proj=qkv_rows(lp.qkv_proj), qkv_bias=None if lp.qkv_bias is None else qkv_rows(lp.qkv_bias),
            o_proj=lp.o_proj[:, q_first * d:(q_first + heads) * d].contiguous(),
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
