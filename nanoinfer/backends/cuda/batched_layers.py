"""CUDA layer parts for more than one token: the projections through `linear`, the norms,
residual adds and SwiGLU in nanoinfer.backends.cuda.row_kernels' Triton kernels, with no torch.compile.

Per layer that is an RMSNorm kernel before the QKV projection, the residual add and the MLP's
RMSNorm in one kernel after the output projection, SiLU · up between the MLP's projections and
a residual add after the down projection: what Inductor fused the eager parts into, without
tracing or compiling them at start (issue 35 item 3). Same signatures as nanoinfer.model.decoder's
`qkv_projection` and `attention_output_and_mlp`, which are the reference (tests/test_row_kernels.py,
tests/test_gpu.py). One token runs nanoinfer.backends.cuda.fused_layers, which folds these steps into its GEMVs
and comes here for what it does not take. `reduce` (a sum over tensor-parallel ranks) runs between
a row-parallel projection and the residual add, as in the reference.
"""

from __future__ import annotations

from typing import Callable

import torch

from nanoinfer.model import decoder as model
from nanoinfer.model.config import ModelConfig
from nanoinfer.model.decoder import LayerParams
from nanoinfer.backends.cuda.row_kernels import add_rms_norm, rms_norm, silu_mul


def qkv_projection(x: torch.Tensor, lp: LayerParams, cfg: ModelConfig, linear: Callable) -> torch.Tensor:
    return linear(rms_norm(x, lp.attn_norm, cfg.rms_norm_eps), lp.qkv_proj, lp.qkv_bias)


def attention_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, lp: LayerParams, cfg: ModelConfig,
                             linear: Callable, reduce: Callable = model._same) -> torch.Tensor:
    """With Gemma's sandwich norms each sublayer's output is normed before its residual add (one kernel more
    each), and its GeGLU takes silu_mul's GELU-tanh form."""
    out = reduce(linear(attn.reshape(x.shape[0], cfg.q_size), lp.o_proj))
    if cfg.sandwich_norms:
        out = rms_norm(out, lp.post_attn_norm, cfg.rms_norm_eps)
    x, h = add_rms_norm(x, out, lp.mlp_norm, cfg.rms_norm_eps)
    down = reduce(linear(silu_mul(linear(h, lp.gate_up_proj), cfg.hidden_act), lp.down_proj))
    return x + (rms_norm(down, lp.post_mlp_norm, cfg.rms_norm_eps) if cfg.sandwich_norms else down)
