"""Assemble a Params pytree from HF-named tensors: check shapes, cast, fuse QKV and gate/up.

Both loaders hand tensors over under transformers' names and layouts, so this is the one
place that knows how a checkpoint's tensors become our parameters. A loader may hand a
matrix over still quantized (nanoinfer.quant.quantized): it keeps its form, fused row-wise, and a
grouped one is packed for its kernel here (the embedding stays grouped: it is looked up).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from tqdm.auto import tqdm

from nanoinfer.backends.cpu import cpu_native
from nanoinfer.backends.cpu.huge_pages import in_huge_pages
from nanoinfer.model.config import ModelConfig
from nanoinfer.errors import CheckpointError
from nanoinfer.model.layers import local_rope_inv_freq, rope_inv_freq
from nanoinfer.model.decoder import LayerParams, Params
from nanoinfer.quant.kquants import Q4_K, KQuantWeight, StackedWeight, interleave
from nanoinfer.quant.quantized import (
    BlockWeight,
    GroupedWeight,
    Int4CudaWeight,
    Int8Weight,
    concat_rows,
    dequantize,
    map_weight,
    pack,
    take_rows,
)

if TYPE_CHECKING:
    from nanoinfer.quant.quantized import Weight

# name -> tensor (or a quantized matrix), or None when the checkpoint does not have it.
TensorSource = Callable[[str], "torch.Tensor | Weight | None"]


def unpermute_rotary_rows(w, num_heads: int):
    """Q or K rows (or bias) in Meta's rotary layout, each head's dimension pairs adjacent
    (rows 0, D/2, 1, D/2+1, ... of HF's; llama.cpp's GGUF and llama2.c keep it so their kernels
    rotate adjacent pairs), regrouped into HF's halves, which we rotate. Any row-wise weight."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    order = torch.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(rows)
    return take_rows(w, order)


def device_form(w: GroupedWeight, device: torch.device, dtype: torch.dtype) -> "Weight":
    """A grouped matrix in the form `device`'s kernels read: on CUDA 4-bit groups packed for
    nanoinfer.backends.cuda.int4_gemv (8-bit ones per-row int8); on the CPU cpu_native's blocks where it builds
    (groups of 32), else torch's int4 kernel's. A reordered GPTQ matrix (act-order) is
    dequantized to `dtype` on the CPU, whose packed kernels read inputs in order."""
    if device.type == "cuda":
        return Int4CudaWeight.from_groups(w) if w.bits == 4 else Int8Weight.quantize(dequantize(w))
    if w.cols is not None:
        return dequantize(w).to(dtype)
    lib = cpu_native.library()  # (built on a machine's first packed load)
    return _blocks(w, lib) if w.group == 32 and cpu_native.has_block_matmul(lib) else pack(w)


def _blocks(w: GroupedWeight, lib) -> BlockWeight:
    """cpu_native's form of groups of 32, in the layout this CPU's one-token kernel streams (rows interleaved where its
    build reads them so, and the rows are whole chunks: BlockWeight.interleave)."""
    blocks = pack(w, blocks=True)
    group = cpu_native.block_interleave_rows(lib, w.bits)
    if group and w.shape[1] % 256 == 0 and w.shape[0] >= group:
        blocks = blocks.interleave(group)
    return dataclasses.replace(blocks, q=in_huge_pages(blocks.q))  # (streamed each token: huge_pages.py)


def kquant_form(w: KQuantWeight | StackedWeight, device: torch.device, dtype: torch.dtype) -> "Weight":
    """K-quant super-blocks (alone or stacked with grouped parts) in the form `device`'s kernels
    read: on a CPU where cpu_native builds they stay as they are (grouped parts packed in
    blocks); elsewhere Q4_K goes to its exact groups of 32 (device_form), anything else per-row int8."""
    lib = cpu_native.library() if device.type == "cpu" else None
    if cpu_native.has_block_matmul(lib):
        def kernel_form(p):
            if isinstance(p, KQuantWeight):  # (in the layout this CPU's one-token kernels stream)
                group = cpu_native.kquant_interleave_rows(lib, p.qtype)
                laid = interleave(p, group) if group and not p.interleaved else p
                return dataclasses.replace(laid, data=in_huge_pages(laid.data))  # (streamed each token)
            return _blocks(p, lib)
        return kernel_form(w) if isinstance(w, KQuantWeight) else StackedWeight(tuple(map(kernel_form, w.parts)))
    if isinstance(w, KQuantWeight) and w.qtype == Q4_K:
        from nanoinfer.loaders.gguf_blocks import grouped_weight  # (GGUF's reader of Q4_K's groups)
        from gguf import GGMLQuantizationType

        groups = grouped_weight(w.data.cpu().numpy(), GGMLQuantizationType.Q4_K, *w.shape)
        return device_form(map_weight(lambda t: t.to(device), groups), device, dtype)  # (read on the host)
    return Int8Weight.quantize(dequantize(w))


def _experts(p: str, cfg: ModelConfig, load, matrix):
    """A sparse layer's router and stacked experts under transformers 5's names (`mlp.gate.weight`,
    `mlp.experts.gate_up_proj` [experts, 2 * inter, hidden], `mlp.experts.down_proj` [experts, hidden, inter]):
    each format's loader hands them over so (nanoinfer/loaders/hf_moe.py stacks a directory's per-expert tensors)."""
    from nanoinfer.model.moe import ExpertWeights, MoEParams

    experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size

    def stacked(name: str, shape: tuple[int, int, int]):
        w = load(name, shape)  # (a packed GGUF's: each expert's matrix in the device's form, as any matrix)
        return w if isinstance(w, torch.Tensor) else ExpertWeights(tuple(matrix(e) for e in w.experts))

    return MoEParams(router=load(p + "mlp.gate.weight", (experts, hidden)),
                     gate_up=stacked(p + "mlp.experts.gate_up_proj", (experts, 2 * inter, hidden)),
                     down=stacked(p + "mlp.experts.down_proj", (experts, hidden, inter)))


def _layer(p: str, cfg: ModelConfig, load, matrix, sparse: bool = False) -> LayerParams:
    """One decoder layer's params, its tensors named from prefix `p`; `sparse`: its MLP the mixture of experts."""
    hidden, inter, head_dim = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    projections = (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size))
    qkv = [load(p + f"self_attn.{n}_proj.weight", (size, hidden)) for n, size in projections]
    qkv_bias = None
    if cfg.qkv_bias:
        qkv_bias = torch.cat([load(p + f"self_attn.{n}_proj.bias", (size,)) for n, size in projections])
    # (Gemma's sandwich: post_attention_layernorm norms the attention's output, pre_feedforward_ the MLP's input)
    mlp_norm = "pre_feedforward_layernorm.weight" if cfg.sandwich_norms else "post_attention_layernorm.weight"
    return LayerParams(
        attn_norm=load(p + "input_layernorm.weight", (hidden,)),
        qkv_proj=matrix(concat_rows(qkv)),
        qkv_bias=qkv_bias,
        q_norm=load(p + "self_attn.q_norm.weight", (head_dim,)) if cfg.qk_norm else None,
        k_norm=load(p + "self_attn.k_norm.weight", (head_dim,)) if cfg.qk_norm else None,
        o_proj=matrix(load(p + "self_attn.o_proj.weight", (hidden, cfg.q_size))),
        mlp_norm=load(p + mlp_norm, (hidden,)),
        gate_up_proj=None if sparse else matrix(concat_rows([load(p + "mlp.gate_proj.weight", (inter, hidden)),
                                                             load(p + "mlp.up_proj.weight", (inter, hidden))])),
        down_proj=None if sparse else matrix(load(p + "mlp.down_proj.weight", (hidden, inter))),
        post_attn_norm=load(p + "post_attention_layernorm.weight", (hidden,)) if cfg.sandwich_norms else None,
        post_mlp_norm=load(p + "post_feedforward_layernorm.weight", (hidden,)) if cfg.sandwich_norms else None,
        moe=_experts(p, cfg, load, matrix) if sparse else None,
    )


def build_params(
    get: TensorSource,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    path: Path,
    *,
    inv_freq: torch.Tensor | None = None,
    progress: bool = True,
    layer_form: Callable[[LayerParams], LayerParams] | None = None,
) -> Params:
    """Params of `cfg` from `get` (HF names and [out, in] layouts). `inv_freq` overrides the
    RoPE frequencies computed from the config (GGUF stores Llama-3.1's as a tensor). `layer_form` (a
    quantization's, nanoinfer.loaders.quantize.quantize_layer) turns each layer as it is read: the float
    weights of one layer at a time on the device, not of the model."""

    def load(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = get(name)
        if tensor is None:
            raise CheckpointError(path, f"tensor {name!r} is missing")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(path, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        if isinstance(tensor, torch.Tensor):
            return tensor.to(device=device, dtype=dtype)
        return map_weight(lambda t: t.to(device), tensor)  # (a quantized matrix keeps its types)

    def matrix(w):
        if isinstance(w, (KQuantWeight, StackedWeight)):
            return kquant_form(w, torch.device(device), dtype)
        return w if not isinstance(w, GroupedWeight) else device_form(w, torch.device(device), dtype)

    hidden = cfg.hidden_size
    bar = tqdm(range(cfg.num_layers), desc=f"loading {path.name}", unit="layer", disable=not progress, leave=False)
    sparse = cfg.layer_sparse
    form = layer_form or (lambda lp: lp)
    layers = [form(_layer(f"model.layers.{i}.", cfg, load, matrix, sparse[i])) for i in bar]
    embed = load("model.embed_tokens.weight", (cfg.vocab_size, hidden))
    lm_head = matrix(embed if cfg.tie_word_embeddings else load("lm_head.weight", (cfg.vocab_size, hidden)))
    if cfg.tie_word_embeddings and isinstance(embed, KQuantWeight) and isinstance(lm_head, KQuantWeight):
        embed = lm_head  # (one copy of a tied table in the kernels' layout: its rows are read in any layout)
    if inv_freq is None:
        inv_freq = rope_inv_freq(cfg)
    local = local_rope_inv_freq(cfg)
    return Params(
        embed=embed,
        layers=tuple(layers),
        final_norm=load("model.norm.weight", (hidden,)),
        lm_head=lm_head,
        rope_inv_freq=inv_freq.to(device=device, dtype=torch.float32),
        rope_local_inv_freq=None if local is None else local.to(device),
    )
