"""CUDA layer parts for one token: the norms, SwiGLU and residual adds folded into the GEMVs.

A batch-1 decode step of a small model is bound by how many kernels run, not by bytes: per
layer the unfused parts launch an RMSNorm before the QKV projection, a residual add + RMSNorm
after the output projection, SiLU * up before the down projection and a residual add after
it, each a few microseconds for a few KB (bench/RESULTS.md). Here each folds into the GEMV
next to it (nanoinfer.backends.cuda.gemv.fused_gemv), and for heads without q/k norms RoPE and the KV write
go into QKV's epilogue (`qkv_rope_and_write`): a layer is four GEMVs and attention. Under
tensor parallelism (a `model.RankSum` between a projection and its residual) the lead rank
adds the residual into its partial output and the others do not, so the sum over ranks is the
new residual stream with no add of its own; with a `peer_sum.PeerSum` the output and down
projections write their partials into the ranks' peer buffers and a pull sums them
(nanoinfer/backends/cuda/peer_sum.py), in place of NCCL's all-reduce. nanoinfer.model.decoder's `qkv_projection`
and `attention_output_and_mlp` (same signatures) and nanoinfer.backends.cuda.rope_write's kernel are the
reference (tests/test_gpu.py, tests/test_gpu_tensor_parallel.py); nanoinfer.backends.cuda.batched_layers' parts run
instead wherever this does not apply: more than one token, a sum over ranks other than a
RankSum, an fp32 model, a weight the GEMV does not read, or Gemma's sandwich norms and GeGLU. 4-bit MLP weights fold SwiGLU and
the last residual add only (`_int4_output_and_mlp`).
"""

from __future__ import annotations

from typing import Callable

import torch

from nanoinfer.backends.cuda import batched_layers
from nanoinfer.model import decoder as model
from nanoinfer.model.config import ModelConfig
from nanoinfer.backends.cuda.gemv import fused_gemv
from nanoinfer.backends.cuda.gemv_epilogues import RopeWrite
from nanoinfer.backends.cuda.int4_gemv import int4_gemv, int4_kernels_take
from nanoinfer.model.decoder import LayerParams, RankSum
from nanoinfer.backends.cuda.peer_sum import PeerLinks, PeerSum
from nanoinfer.quant.quantized import Fp8Weight, Int4CudaWeight, Int8Weight
from nanoinfer.backends.cuda.rope_write import rope_and_write
from nanoinfer.backends.cuda.row_kernels import add_rms_norm, rms_norm


def _operands(w, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The GEMV's (weight, per-row scale) for projection weight `w`, or None where it has none."""
    if isinstance(w, (Int8Weight, Fp8Weight)):
        return w.q, w.scale
    if isinstance(w, torch.Tensor) and w.dtype == x.dtype and w.stride(1) == 1:
        return w, None
    return None


def _one_token(x: torch.Tensor) -> bool:
    return x.shape[0] == 1 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _takes(x: torch.Tensor, *weights) -> bool:
    return _one_token(x) and all(_operands(w, x) is not None for w in weights)


def _int4(*weights) -> bool:
    return all(isinstance(w, Int4CudaWeight) and int4_kernels_take(w) for w in weights)


def qkv_projection(x: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear: Callable) -> torch.Tensor:
    if not (_takes(x, lp.qkv_proj) and lp.attn_norm.dtype == x.dtype):
        return batched_layers.qkv_projection(x, lp, cfg, linear)
    w, scale = _operands(lp.qkv_proj, x)
    out = fused_gemv(x.contiguous(), w, scale, lp.attn_norm, cfg.rms_norm_eps, False, None)
    return out if lp.qkv_bias is None else out + lp.qkv_bias


def qkv_rope_and_write(x: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear: Callable, cos: torch.Tensor,
                       sin: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q from `qkv_projection` and nanoinfer.backends.cuda.rope_write's `rope_and_write` (the reference), with
    k and v into the pool: at one token, a head without q/k norms or bias and a pool in the
    model's dtype, RoPE and the KV write in QKV's GEMV epilogue (a 4-bit QKV keeps its norm's
    kernel before it, as `_int4_output_and_mlp` does)."""
    if not (_one_token(x) and lp.attn_norm.dtype == x.dtype and lp.qkv_bias is None and not cfg.qk_norm
            and kv_layer.dtype == x.dtype and (_takes(x, lp.qkv_proj) or _int4(lp.qkv_proj))):
        return rope_and_write(qkv_projection(x, lp, cfg, linear), lp.q_norm, lp.k_norm, cos, sin, kv_layer,
                              slot_mapping, cfg)
    rope = RopeWrite(cos, sin, kv_layer, slot_mapping, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if isinstance(lp.qkv_proj, Int4CudaWeight):
        return int4_gemv(rms_norm(x, lp.attn_norm, cfg.rms_norm_eps), lp.qkv_proj, rope=rope)
    w, scale = _operands(lp.qkv_proj, x)
    return fused_gemv(x.contiguous(), w, scale, lp.attn_norm, cfg.rms_norm_eps, False, None, rope=rope)


def attention_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, lp: LayerParams, cfg: ModelConfig,
                             linear: Callable, reduce: Callable = model._same) -> torch.Tensor:
    one_rank = reduce is model._same
    if cfg.sandwich_norms or cfg.hidden_act != "silu":  # (Gemma's: the GEMVs fold SwiGLU and the plain residuals)
        return batched_layers.attention_output_and_mlp(x, attn, lp, cfg, linear, reduce)
    if ((one_rank or isinstance(reduce, RankSum)) and _one_token(x) and _int4(lp.gate_up_proj, lp.down_proj)
            and lp.mlp_norm.dtype == x.dtype):
        return _int4_output_and_mlp(x, attn, lp, cfg, linear, reduce, one_rank or reduce.lead)
    if not ((one_rank or isinstance(reduce, RankSum)) and _takes(x, lp.o_proj, lp.gate_up_proj, lp.down_proj)
            and lp.mlp_norm.dtype == x.dtype):
        return batched_layers.attention_output_and_mlp(x, attn, lp, cfg, linear, reduce)
    lead = one_rank or reduce.lead
    links = reduce.links if isinstance(reduce, PeerSum) and reduce.links is not None and reduce.links.ready else None
    x = x.contiguous()
    w, scale = _operands(lp.o_proj, x)
    x = _summed(fused_gemv(attn.reshape(1, cfg.q_size).contiguous(), w, scale, None, 0.0, False, x if lead else None,
                           push=links and links.pushes[0]), reduce, links, 0)
    w, scale = _operands(lp.gate_up_proj, x)
    act = fused_gemv(x, w, scale, lp.mlp_norm, cfg.rms_norm_eps, True, None)  # silu(gate) * up
    w, scale = _operands(lp.down_proj, x)
    return _summed(fused_gemv(act, w, scale, None, 0.0, False, x if lead else None, push=links and links.pushes[1]),
                   reduce, links, 1)


def _int4_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear: Callable,
                         reduce: Callable, lead: bool) -> torch.Tensor:
    """4-bit MLP weights: SwiGLU in the gate/up GEMV's epilogue and the residual in the down
    projection's (the lead rank's, under a RankSum), two kernels a layer fewer. The norms keep
    their kernels: inside this GEMV's loop, bound by instructions, they cost more than a kernel
    (bench/RESULTS.md, twenty-second session)."""
    x, h = add_rms_norm(x, reduce(linear(attn.reshape(1, cfg.q_size), lp.o_proj)), lp.mlp_norm, cfg.rms_norm_eps)
    return reduce(int4_gemv(int4_gemv(h, lp.gate_up_proj, silu=True), lp.down_proj, residual=x if lead else None))


def _summed(partial: torch.Tensor | None, reduce: Callable, links: PeerLinks | None, slot: int) -> torch.Tensor:
    """The sum over ranks of a projection's output: NCCL's (`reduce`), or the rows the projection
    pushed into `slot` of the ranks' peer buffers (nanoinfer.backends.cuda.peer_sum)."""
    return reduce(partial) if links is None else links.pull(slot)
