"""Mixtral and Qwen3-MoE GGUFs: their expert metadata as llama.cpp reads it, their stacked expert tensors.

llama.cpp's converter writes a Mixtral as architecture `llama` with `llama.expert_count` and
`llama.expert_used_count` (its q/k rows permuted as any llama's), a Qwen3-MoE as `qwen3moe` with
`expert_feed_forward_length` besides; each sparse layer's router as `blk.N.ffn_gate_inp` [experts, hidden] and
its experts stacked 3-D: `ffn_gate_exps` and `ffn_up_exps` [experts, inter, hidden], `ffn_down_exps` [experts,
hidden, inter] (numpy's order). llama.cpp runs both with softmax routing renormalized over the k chosen
(`build_moe_ffn`'s norm_w, whatever a Qwen3-MoE's norm_topk_prob was), every layer sparse; so do we.
Where the file's matrices stay packed (a quantized GGUF on the CPU), so do its experts: each expert's rows of the
stacked tensor, its gate's and up's rows joined, as `ExpertWeights` of the packed kernels' forms; a type or
width the packed kernels do not read, and any file loaded unpacked, is dequantized to the model's dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from nanoinfer.errors import CheckpointError
from nanoinfer.gguf_file import GGUFFile, TensorInfo
from nanoinfer.model.config_checks import MAX_DIMENSIONS, dimension
from nanoinfer.model.moe import ExpertWeights
from nanoinfer.quant.quantized import concat_rows, dequantize


def moe_fields(gguf_file: GGUFFile, arch: str, path, *, intermediate: int) -> dict[str, Any]:
    """ModelConfig's expert fields (with the family's name: "mixtral" for a llama with experts, "qwen3_moe");
    {} for a dense llama."""
    experts = gguf_file.scalar(f"{arch}.expert_count", 0)
    if not experts and arch == "llama":
        return {}
    experts = dimension(f"{arch}.expert_count", experts, path, MAX_DIMENSIONS["num_experts"])
    k = dimension(f"{arch}.expert_used_count", gguf_file.scalar(f"{arch}.expert_used_count", 0), path)
    if k > experts:
        raise CheckpointError(path, f"{arch}.expert_used_count {k} is more than the {experts} experts")
    names = {t.name for t in gguf_file.tensors}
    if "blk.0.ffn_gate_up_exps.weight" in names or "blk.0.ffn_gate.0.weight" in names:
        raise CheckpointError(path, "its experts are not stored as ffn_gate_exps/ffn_up_exps/ffn_down_exps (fused "
                                    "gate_up or one tensor per expert): not supported")
    fields = dict(architecture="mixtral" if arch == "llama" else "qwen3_moe", num_experts=experts,
                  experts_per_token=k, norm_topk_prob=True)
    if arch == "qwen3moe":  # (llama.cpp: n_ff / k where the file gives no expert width)
        width = gguf_file.scalar(f"{arch}.expert_feed_forward_length", 0) or intermediate // k
        fields["moe_intermediate_size"] = dimension(f"{arch}.expert_feed_forward_length", width, path,
                                                    MAX_DIMENSIONS["moe_intermediate_size"])
    return fields


def expert_tensors(get: Callable[[str], Any], tensors: dict[str, TensorInfo],
                   dequant: Callable[[TensorInfo], torch.Tensor],
                   pack: Callable[[TensorInfo], Any] | None = None) -> Callable[[str], Any]:
    """`get` with each sparse layer's router (`mlp.gate.weight`) and experts (`mlp.experts.gate_up_proj`: gate then
    up, stacked per expert; `mlp.experts.down_proj`) read from the file's stacked tensors: with `pack` (a 2-D
    tensor's packed matrix, or None where it has none), each expert's packed where every expert's matrix is,
    else dequantized."""

    def read(layer: str, name: str):
        tensor = tensors.get(f"blk.{layer}.{name}")
        if tensor is None:
            return None
        experts = per_expert(tensor, pack) if pack is not None else None
        return experts if experts is not None else dequant(tensor)

    def expert_get(name: str):
        if not name.startswith("model.layers.") or ".mlp." not in name:
            return get(name)
        layer, rest = name.removeprefix("model.layers.").split(".mlp.")
        if rest == "gate.weight":
            return read(layer, "ffn_gate_inp.weight")
        if rest == "experts.gate_up_proj":
            gate, up = read(layer, "ffn_gate_exps.weight"), read(layer, "ffn_up_exps.weight")
            if gate is None or up is None:
                return None
            if isinstance(gate, torch.Tensor) or isinstance(up, torch.Tensor):  # (one of them could not stay packed)
                gate, up = (w if isinstance(w, torch.Tensor) else _dequantized(w) for w in (gate, up))
                return torch.cat([gate, up], dim=1)
            return ExpertWeights(tuple(concat_rows([g, u]) for g, u in zip(gate.experts, up.experts)))
        if rest == "experts.down_proj":
            return read(layer, "ffn_down_exps.weight")
        return get(name)

    return expert_get


def per_expert(tensor: TensorInfo, pack: Callable[[TensorInfo], Any]) -> ExpertWeights | None:
    """A stacked [experts, rows, cols] tensor as each expert's packed matrix (views of the file's bytes, `pack`'s
    form), or None where `pack` has no form for its type or width (a float type among them)."""
    if len(tensor.shape) != 3:
        return None
    cols, rows, experts = (int(d) for d in tensor.shape)
    data = tensor.data.reshape(experts, rows, -1)  # (block types: [experts, rows, bytes per row] uint8)
    matrices = []
    for e in range(experts):
        w = pack(tensor._replace(shape=(cols, rows), n_elements=rows * cols, n_bytes=data[e].nbytes, data=data[e]))
        if w is None:
            return None
        matrices.append(w)
    return ExpertWeights(tuple(matrices))


def _dequantized(w: ExpertWeights) -> torch.Tensor:
    return torch.stack([dequantize(e) for e in w.experts])
