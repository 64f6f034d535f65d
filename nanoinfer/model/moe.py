"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's k experts, whose SwiGLU outputs add up by weight.

Routing as both families define it: a softmax over the router's logits (in fp32), the k largest
probabilities kept, renormalized to sum to 1 where the family says (Mixtral always; Qwen3-MoE by
`norm_topk_prob`). Softmax over the k largest logits (top-k then softmax) is the renormalized case's
same numbers, so one function serves both. The experts' weights sit stacked per layer, [experts, rows,
cols], the layout a grouped-expert kernel reads in one launch, or, from a quantized GGUF on the CPU, as each
expert's packed matrix (`ExpertWeights`: the file's blocks, read by the packed kernels); `experts_reference`
loops over the experts that got tokens, each computing only its own tokens, and is what runs on every device
for now (a batch-1 step reads only its k experts' weights). This module is imported by a mixture-of-experts
model only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoinfer.model.config import ModelConfig
from nanoinfer.model.layers import swiglu
from nanoinfer.quant import quantized


@dataclass(frozen=True)
class ExpertWeights:
    """A layer's experts' matrices of one kind, each in a quantized form of its own ([rows, cols] each, the
    packed CPU kernels' input), indexed as a stacked [experts, rows, cols] tensor is: a quantized GGUF's experts
    hold their file's bytes, not a float copy (a Mixtral-8x7B Q4_K_M's 26 GB, not 187)."""

    experts: tuple  # of nanoinfer.quant.quantized weights

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.experts), *self.experts[0].shape)

    def __getitem__(self, expert: int):
        return self.experts[expert]

    def nbytes(self) -> int:
        return sum(quantized.nbytes(w) for w in self.experts)


@dataclass(frozen=True)
class MoEParams:
    """A sparse layer's MLP: its router and its experts' SwiGLU matrices — stacked in the model's dtype, or each
    expert's packed (ExpertWeights)."""

    router: torch.Tensor  # [experts, hidden]: each expert's logit of a token
    gate_up: torch.Tensor | ExpertWeights  # [experts, 2 * inter, hidden]: each expert's gate rows then its up rows
    down: torch.Tensor | ExpertWeights  # [experts, hidden, inter]


def route(router_logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] fp32, experts [tokens, k] int64) for router logits [tokens, experts]: softmax in fp32,
    the k most probable experts (largest first; equal ones in torch.topk's order, which it leaves unspecified),
    and their probabilities, divided by their sum where `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def experts_reference(x: torch.Tensor, p: MoEParams, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) for x [tokens, hidden], in x's dtype: the (token, choice)
    pairs sorted by expert, then one pass per expert that has any, over its tokens only. Experts add in ascending
    order, each product weighted in fp32 and rounded to x's dtype before its add (as transformers' experts do)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (pairs grouped by expert, each group in token order)
    counts = torch.bincount(flat, minlength=p.router.shape[0]).tolist()  # (one host sync a layer: the loop's bounds)
    pair_weights = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // k
        h = swiglu(quantized.linear(x[tokens], p.gate_up[expert]))
        y = quantized.linear(h, p.down[expert]) * pair_weights[pairs, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def moe_mlp(x: torch.Tensor, p: MoEParams, cfg: ModelConfig) -> torch.Tensor:
    """A sparse layer's MLP of its normed input x [tokens, hidden]: route, then the experts (the reference)."""
    weights, experts = route(F.linear(x, p.router), cfg.experts_per_token, cfg.norm_topk_prob)
    return experts_reference(x, p, weights, experts)
