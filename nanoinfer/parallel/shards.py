"""Tensor parallelism: a model's weights split over N ranks, and the collectives its forward needs.

Rank r of N holds (Megatron's split, as nano-vllm, gpt-fast and vLLM shard):
- attention by heads: whole GQA groups (a KV head and the query heads that read it), r·KV/N
  .. (r+1)·KV/N, uneven where N does not divide them; with more ranks than KV heads, the
  N/KV ranks sharing a KV head each hold it and split its query heads (`rank_heads`);
- `gate_up` column-parallel (its slice of the intermediate units, gate and up alike), so
  SwiGLU runs on local values;
- `o_proj` and `down_proj` row-parallel (the input columns of its heads and units): each
  rank's output is a partial sum, and one all-reduce after each adds them up;
- a mixture-of-experts layer's experts alike, each expert split as a dense MLP is (its slice of
  the inner units: gate/up rows, down columns), the router whole on every rank: each rank routes
  the same way and adds its partial products, one all-reduce after the experts (vLLM's and
  SGLang's tensor-parallel MoE; expert parallelism, whole experts per rank, is not done);
- the embedding and the LM head vocab-parallel: a rank holds ceil(V/N) rows (the last rows
  zero-padded); the embedding of an id outside a rank's rows is zero there, an all-reduce
  adds the ranks' lookups, and the logits' shards are all-gathered.

Quantized weights split in their own forms: per-row int8/fp8 by rows, or by columns with the
row scales kept whole; GGUF groups by rows, or by whole groups of columns (a rank's heads and
units must span whole groups: a cut is a named error); the CPU's packed blocks through their
exact groups, re-packed per rank. torch's int4 packing cannot be split.

Each rank then runs the ordinary forward over its shard with `layer_functions` (the sharded
config's head counts and sizes are the rank's), and its own KV pool holds only its heads.
Collectives go through torch.distributed (gloo on the CPU, NCCL on CUDA): nothing home-made.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from nanoinfer.model.config import ModelConfig
from nanoinfer.errors import RequestError
from nanoinfer.model.decoder import LayerFunctions, LayerParams, Params, RankSum
from nanoinfer.quant.quantized import (BlockWeight, ExpertStack, Fp8Weight, GroupedWeight, Int4CudaWeight, Int4Weight,
                                       Int8Weight, SplitInt8Weight, Weight, concat_rows, embedding, map_weight,
                                       take_rows)


class Shard(NamedTuple):
    rank: int
    size: int  # N, the tensor-parallel world (torch.distributed's default process group)


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """RequestError naming what keeps `cfg` from splitting over `size` ranks."""
    kv, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    if cfg.architecture == "nanochat":  # (its smear state and value embeddings are not split yet)
        raise RequestError("a nanochat model does not run under tensor parallelism yet: expected "
                           f"tensor_parallel_size=1, got {size}", param="tensor_parallel_size")
    problems = []
    if cfg.num_experts and cfg.expert_intermediate_size % size:
        problems.append(f"moe_intermediate_size={cfg.expert_intermediate_size} is not divisible by "
                        f"tensor_parallel_size={size}")
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
    experts = dict(moe_intermediate_size=cfg.expert_intermediate_size // size) if cfg.num_experts else {}
    return dataclasses.replace(cfg, num_heads=heads, num_kv_heads=kv, intermediate_size=cfg.intermediate_size // size,
                               **experts)


def _packed(w: Weight, pick: Callable[[Weight], Weight]) -> Weight:
    """`pick` (a part of a matrix) applied to `w`: dense, per-row int8/fp8 or GGUF groups as
    they are, the CPU's packed blocks and CUDA's 4-bit words through their exact groups
    (re-packed after)."""
    if isinstance(w, BlockWeight):  # (a rank's part laid out again as the whole was, where its columns allow)
        part = BlockWeight.from_groups(pick(w.groups()))
        keeps = w.interleaved and part.shape[1] % 256 == 0 and part.shape[0] >= w.interleaved
        return part.interleave(w.interleaved) if keeps else part
    if isinstance(w, Int4CudaWeight):
        if w.cols is not None:  # (a rank's columns of an act-order matrix are not a slice of its stored ones)
            raise RequestError("tensor parallelism cannot split a 4-bit matrix stored in act order (GPTQ desc_act): "
                               "expected one without act order", param="tensor_parallel_size")
        return Int4CudaWeight.from_groups(pick(w.groups()))
    if isinstance(w, (Int4Weight, SplitInt8Weight)):
        raise RequestError(f"tensor parallelism cannot split a matrix packed for torch's int4 kernel "
                           f"({type(w).__name__}): expected dense, int8, fp8 or GGUF-grouped weights",
                           param="tensor_parallel_size")
    return pick(w)


def _rows(w: Weight, start: int, count: int) -> Weight:
    """Output rows start.. of `w`, in their own memory."""
    return map_weight(torch.Tensor.contiguous, take_rows(w, slice(start, start + count)))


def _cols(w: Weight, start: int, count: int) -> Weight:
    """Input columns start.. of `w` (a row-parallel projection's part: per-row scales stay
    whole, a group's scale and min go with its columns)."""
    end = start + count
    if isinstance(w, torch.Tensor):
        return w[:, start:end].contiguous()
    if isinstance(w, (Int8Weight, Fp8Weight)):
        return type(w)(w.q[:, start:end].contiguous(), w.scale)
    g = w.group
    if start % g or count % g:
        raise RequestError(f"tensor parallelism would cut a group of {g} quantized inputs: columns {start}..{end} "
                           f"of a {w.shape[0]}x{w.shape[1]} matrix (expected each rank's heads and units to "
                           f"span whole groups)", param="tensor_parallel_size")
    return GroupedWeight(w.q[:, start:end].contiguous(), w.scale[:, start // g:end // g].contiguous(),
                         w.min[:, start // g:end // g].contiguous(), w.bits)


def _vocab_rows(table: Weight, rank: int, size: int) -> Weight:
    vocab = table.shape[0]
    per = -(-vocab // size)
    count = max(0, min(per, vocab - rank * per))
    # (the last rank's rows padded with zeros: their logits are cut after the gather)
    return map_weight(lambda t: torch.cat([t, t.new_zeros(per - count, *t.shape[1:])]),
                      _rows(table, rank * per, count))


def _each_expert(w, part: Callable[[Weight], Weight]):
    """`part` of each expert's matrix of a layer's experts (a float stack, an int8/fp8 ExpertStack, or a packed
    GGUF's ExpertWeights), in the same form."""
    from nanoinfer.model.moe import ExpertWeights

    if isinstance(w, ExpertWeights):
        return ExpertWeights(tuple(part(e) for e in w.experts))
    parts = [part(w[e]) for e in range(w.shape[0])]
    if isinstance(w, torch.Tensor):
        return torch.stack(parts)
    return ExpertStack(torch.stack([p.q for p in parts]), torch.stack([p.scale for p in parts]))


def shard_params(params: Params, cfg: ModelConfig, rank: int, size: int) -> Params:
    """Rank `rank`'s part of the weights (`cfg`: the whole model's config), in their own
    forms: dense, int8 or fp8 per row, GGUF groups, the CPU's packed blocks."""
    d = cfg.head_dim
    q_first, heads, kv_first, kv = rank_heads(cfg, rank, size)
    k0, v0 = cfg.q_size, cfg.q_size + cfg.kv_size

    def qkv_rows(w: Weight) -> Weight:
        return concat_rows([_rows(w, q_first * d, heads * d), _rows(w, k0 + kv_first * d, kv * d),
                            _rows(w, v0 + kv_first * d, kv * d)])

    def gate_up_rows(w: Weight, units: int = cfg.intermediate_size) -> Weight:
        part = units // size
        return concat_rows([_rows(w, rank * part, part), _rows(w, units + rank * part, part)])

    def down_cols(w: Weight, units: int = cfg.intermediate_size) -> Weight:
        part = units // size
        return _cols(w, rank * part, part)

    def layer(lp: LayerParams) -> LayerParams:
        if lp.moe is None:
            mlp = dict(gate_up_proj=_packed(lp.gate_up_proj, gate_up_rows), down_proj=_packed(lp.down_proj, down_cols))
        else:
            units = cfg.expert_intermediate_size
            mlp = dict(moe=dataclasses.replace(
                lp.moe, gate_up=_each_expert(lp.moe.gate_up, lambda w: _packed(w, lambda m: gate_up_rows(m, units))),
                down=_each_expert(lp.moe.down, lambda w: _packed(w, lambda m: down_cols(m, units)))))
        return dataclasses.replace(
            lp, qkv_proj=_packed(lp.qkv_proj, qkv_rows),
            qkv_bias=None if lp.qkv_bias is None else qkv_rows(lp.qkv_bias),
            o_proj=_packed(lp.o_proj, lambda w: _cols(w, q_first * d, heads * d)), **mlp)

    def vocab(table: Weight) -> Weight:
        return _packed(table, lambda w: _vocab_rows(w, rank, size))

    # (a pipeline stage holds the embedding or the LM head only where it computes it)
    embed = None if params.embed is None else vocab(params.embed)
    lm_head = embed if params.lm_head is params.embed else None if params.lm_head is None else vocab(params.lm_head)
    return dataclasses.replace(params, embed=embed, lm_head=lm_head,
                               layers=tuple(layer(lp) for lp in params.layers))


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """`x` summed over the ranks of `group` (None: the default process group), in place; a CUDA
    graph captures it like any kernel. On the CPU past two ranks the parts add in rank order,
    ((x0 + x1) + x2) + ..., every element alike: gloo's all-reduce adds three or more parts in
    an order that depends on where an element sits in the tensor, so a token's sums depended on
    the rows sharing its step, and through the packed path's int8 rounding of the activations
    so did its greedy text (3 ranks, the default model: a prompt alone or batched parted). Two
    parts add the same in either order."""
    size = dist.get_world_size(group)
    if x.is_cuda or size <= 2:
        dist.all_reduce(x, group=group)
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    x.copy_(parts[0])
    for part in parts[1:]:
        x.add_(part)
    return x


# The default group's sums as ranks 0 and 1.. see them (model.RankSum).
LEAD_SUM, FOLLOWER_SUM = RankSum(all_reduce, True), RankSum(all_reduce, False)


def layer_functions(base: LayerFunctions, shard: Shard, vocab_size: int, group=None, links=None) -> LayerFunctions:
    """`base` with the collectives of rank `shard.rank`: sums after the row-parallel
    projections, the vocab-parallel embedding, the gathered logits. `group`: the process group
    of the shard's ranks where it is not the default one (a pipeline stage's ranks). `links`
    (nanoinfer.backends.cuda.peer_sum.PeerLinks, CUDA): the one-token sums go over peer memory."""
    rank, size = shard
    if group is None and links is not None:
        from nanoinfer.backends.cuda.peer_sum import PeerSum

        reduce = PeerSum(all_reduce, rank == 0, links)
    elif group is None:
        reduce = LEAD_SUM if rank == 0 else FOLLOWER_SUM
    else:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            return all_reduce(x, group)

    def embed(table, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        per = table.shape[0]
        local = ids - rank * per
        inside = (local >= 0) & (local < per)
        x = embedding(table, local.clamp(0, per - 1), dtype) * inside[:, None].to(dtype)
        return reduce(x)

    def gather_logits(shard_logits: torch.Tensor) -> torch.Tensor:
        rows, per = shard_logits.shape
        parts = shard_logits.new_empty(size, rows, per)  # rank r's columns at [r]
        # (the list form: all_gather_into_tensor is deprecated in newer torch, and its
        # successor is missing from older ones)
        dist.all_gather(list(parts.unbind(0)), shard_logits.contiguous(), group=group)
        return parts.permute(1, 0, 2).reshape(rows, size * per)[:, :vocab_size]

    # (a whole-layer call has no seam for the all-reduce: the ranks run the layers' pieces)
    return base._replace(all_reduce=reduce, embed=embed, gather_logits=gather_logits, layer=None)
