"""Mixtral and Qwen3-MoE from HF directories: their config's expert fields, their experts' tensors stacked per layer.

A mixture-of-experts model is the shared decoder (nanoinfer/model/decoder.py) whose sparse layers' MLP is
nanoinfer/model/moe.py's. Mixtral (`num_local_experts`, `num_experts_per_tok`, renormalized top-k, every layer
sparse; its experts `block_sparse_moe.experts.N.w1/w3/w2`, its router `block_sparse_moe.gate`) and Qwen3-MoE
(`num_experts`, `moe_intermediate_size`, `norm_topk_prob`, dense layers by `mlp_only_layers` and
`decoder_sparse_step`; `mlp.experts.N.gate_proj/up_proj/down_proj`, `mlp.gate`). transformers 5 holds the experts
fused in memory (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) but writes them per expert, as the Hub's
checkpoints are; a directory holding the fused names is read as it is. (Qwen2-MoE, a shared expert beside the
routed ones, is refused by name in nanoinfer/loaders/hf.py.)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from nanoinfer.errors import CheckpointError
from nanoinfer.model.config_checks import MAX_DIMENSIONS, dimension, shown

MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
# Per family: the router's name and each expert's (gate, up, down) names, after "model.layers.{i}."
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                  "mlp.experts.{j}.down_proj.weight"),
}
# transformers' config defaults of what a config.json may leave out (MixtralConfig, Qwen3MoeConfig)
_DEFAULTS = {"mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
             "qwen3_moe": dict(num_local_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)}


def moe_fields(cfg: Mapping[str, Any], arch: str, path) -> dict[str, Any]:
    """ModelConfig's expert fields as transformers reads config.json (`arch`: "mixtral" or "qwen3_moe")."""
    cfg = {**_DEFAULTS[arch], **{key: value for key, value in cfg.items() if value is not None}}
    num_layers = dimension("num_hidden_layers", cfg.get("num_hidden_layers"), path, MAX_DIMENSIONS["num_layers"])
    experts = cfg.get("num_experts", cfg["num_local_experts"])  # (transformers 5 writes num_local_experts)
    experts = dimension("num_experts", experts, path, MAX_DIMENSIONS["num_experts"])
    k = dimension("num_experts_per_tok", cfg["num_experts_per_tok"], path)
    if k > experts:
        raise CheckpointError(path, f"num_experts_per_tok {k} is more than the {experts} experts")
    if cfg.get("shared_expert_intermediate_size"):
        raise CheckpointError(path, "shared_expert_intermediate_size: a shared expert is not supported")
    if arch == "mixtral":
        return dict(num_experts=experts, experts_per_token=k, norm_topk_prob=True)
    dense = cfg.get("mlp_only_layers") or []
    step = dimension("decoder_sparse_step", cfg.get("decoder_sparse_step", 1), path)
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise CheckpointError(path, f"mlp_only_layers is {shown(dense)}: expected a list of layer indices")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return dict(num_experts=experts, experts_per_token=k, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_intermediate_size=dimension("moe_intermediate_size", cfg.get("moe_intermediate_size"), path,
                                                MAX_DIMENSIONS["moe_intermediate_size"]),
                sparse_layers=None if all(sparse) else sparse)


def expert_tensors(read: Callable[[str], Any], arch: str, num_experts: int, path) -> Callable[[str], Any]:
    """`read` under the shared loader's names, with each sparse layer's router (`mlp.gate.weight`) and stacked
    experts (`mlp.experts.gate_up_proj` [experts, 2 * inter, hidden], `mlp.experts.down_proj`) made from the
    family's per-expert tensors where the directory does not hold them fused."""
    router, gate, up, down = _EXPERT_NAMES[arch]

    def per_expert(prefix: str, names: tuple[str, ...]) -> list[list[torch.Tensor]] | None:
        """[expert][part] tensors, or None where the first is absent (the loader then names the fused one)."""
        if read(prefix + names[0].format(j=0)) is None:
            return None
        found = []
        for j in range(num_experts):
            parts = [read(prefix + n.format(j=j)) for n in names]
            missing = next((prefix + n.format(j=j) for n, t in zip(names, parts) if t is None), None)
            if missing is not None:
                raise CheckpointError(path, f"tensor {missing!r} is missing ({num_experts} experts a layer)")
            if not all(isinstance(t, torch.Tensor) for t in parts):
                raise CheckpointError(path, f"expert tensors under {prefix!r} are quantized: a mixture-of-experts "
                                            "model loads from float16, bfloat16 or float32 tensors")
            found.append(parts)
        return found

    def get(name: str):
        tensor = read(name)
        if tensor is not None or ".mlp." not in name:
            return tensor
        prefix, _, rest = name.partition("mlp.")
        if rest == "gate.weight":
            return read(prefix + router)
        if rest == "experts.gate_up_proj":
            experts = per_expert(prefix, (gate, up))
            return None if experts is None else torch.stack([torch.cat(parts) for parts in experts])
        if rest == "experts.down_proj":
            experts = per_expert(prefix, (down,))
            return None if experts is None else torch.stack([parts[0] for parts in experts])
        return None

    return get
