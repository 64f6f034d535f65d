"""AWQ and GPTQ checkpoints: which one a directory holds, and its 4-bit tensors read as each format defines them.

Both formats store a linear layer `X` as `X.qweight` (int32 words of eight 4-bit values),
`X.qzeros` (the zero points, packed alike) and `X.scales` (a row per group of inputs), and
GPTQ also `X.g_idx` (each input's group). What they stand for, transposed to our [out, in]:

    w[o, i] = scales[g, o] * (q[i, o] - zeros[g, o]),  g = the group of input i

- AWQ (AutoAWQ's "gemm" version): qweight [in, out / 8]; word j of input row i holds
  outputs 8j .. 8j+7, output 8j + AWQ_ORDER[k] in nibble k (bits 4k up). qzeros
  [groups, out / 8] packed the same way; input i is in group i // group_size.
- GPTQ (AutoGPTQ's and GPTQModel's "gptq" checkpoint format): qweight [in / 8, out]; word
  (r, o) holds inputs 8r .. 8r+7, input 8r + k in nibble k. qzeros [groups, out / 8] with
  output 8j + k in nibble k of word j, holding the zero point less one (the v1 convention
  the format kept; "gptq_v2" stores it whole). With act-order (desc_act) the groups follow
  g_idx rather than i // group_size: the loader reorders the inputs so that each group's
  inputs are contiguous, and the weight says which input each stored column is
  (GroupedWeight.cols).

The result is a GroupedWeight (scale and min = -scale * zero per group): the loader's exact
form, which nanoinfer/loaders/params.py packs for the device (nanoinfer.quant.quantized).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import torch

from nanoinfer.model.config_checks import shown
from nanoinfer.errors import CheckpointError
from nanoinfer.json_files import json_kind, read_json_object
from nanoinfer.quant.quantized import GroupedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ word holds output 8j + AWQ_ORDER[k]
METHODS = ("awq", "gptq")


class Int4Format(NamedTuple):
    """A checkpoint's `quantization_config`, as far as loading it goes."""

    method: str  # "awq" or "gptq"
    group_size: int  # inputs per group; -1: one group per row
    zero_offset: int  # added to a stored zero point: 1 for GPTQ's v1 format, else 0


def read_int4_format(directory: Path) -> Int4Format | None:
    """The AWQ or GPTQ format of an HF directory's `config.json` (`quantization_config`, or
    AutoGPTQ's `quantize_config.json`), None for an unquantized checkpoint; a CheckpointError
    for a quantization this loader does not read."""
    config_file = directory / "config.json"
    qc = read_json_object(config_file).get("quantization_config")
    legacy = directory / "quantize_config.json"
    if qc is None and legacy.is_file():
        qc, config_file = {"quant_method": "gptq", **read_json_object(legacy, "AutoGPTQ's settings")}, legacy
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(config_file, f"quantization_config is {json_kind(qc)}, expected a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        if method in ("fp8", ""):
            return None  # (FP8 checkpoints: nanoinfer/loaders/hf.py)
        raise CheckpointError(config_file, f"quantization_config's quant_method is {shown(method)}: supported are "
                                           f"{list(METHODS)} (4-bit) and fp8")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise CheckpointError(config_file, f"{method} checkpoint of {shown(bits)} bits: supported are 4-bit ones")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or not (group == -1 or group > 0 and group % 8 == 0):
        raise CheckpointError(config_file, f"{method} group_size {shown(group)}: expected -1 or a multiple of 8")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(config_file, f"AWQ version {shown(version)}: supported is 'gemm' (AutoAWQ's default)")
        if qc.get("zero_point", True) is not True:
            raise CheckpointError(config_file, "AWQ without zero points: supported are checkpoints with them")
        return Int4Format("awq", group, 0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(config_file, f"GPTQ checkpoint_format {shown(fmt)}: supported are 'gptq' and 'gptq_v2'")
    return Int4Format("gptq", group, 1 if fmt == "gptq" else 0)


def nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] -> their eight 4-bit values [..., n, 8], nibble k (bits 4k up) at k."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 15).to(torch.uint8)


def _grouped(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, cols=None) -> GroupedWeight:
    """q [out, in]; scales and zeros [groups, out] -> w = scale * q - scale * zero."""
    scale = scales.float().t().contiguous()
    return GroupedWeight(q.contiguous(), scale, (-scale * zeros.float().t()).contiguous(), 4, cols)


def read_int4_matrix(fmt: Int4Format, read: Callable[[str], torch.Tensor | None], prefix: str,
                     where: Path) -> GroupedWeight | None:
    """Linear layer `prefix` (e.g. "model.layers.0.self_attn.q_proj") of a checkpoint in
    `fmt`, through `read` (tensor name -> tensor or None); None where it has no qweight."""
    qweight = read(prefix + ".qweight")
    if qweight is None:
        return None
    qzeros, scales = read(prefix + ".qzeros"), read(prefix + ".scales")
    if qzeros is None or scales is None:
        raise CheckpointError(where, f"{prefix}.qweight has no {prefix}.qzeros and {prefix}.scales beside it")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise CheckpointError(where, f"{prefix}: qweight and qzeros must be int32 ({qweight.dtype}, {qzeros.dtype})")
    groups, out = scales.shape
    if fmt.method == "awq":
        inputs = qweight.shape[0]
        expected = {"qweight": (inputs, out // 8), "qzeros": (groups, out // 8)}
    else:
        inputs = qweight.shape[0] * 8
        expected = {"qweight": (inputs // 8, out), "qzeros": (groups, out // 8)}
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tuple(tensor.shape) != expected[name] or out % 8:
            raise CheckpointError(where, f"{prefix}.{name} has shape {tuple(tensor.shape)}: expected "
                                         f"{expected[name]} for scales of shape {tuple(scales.shape)}")
    if inputs % groups:
        raise CheckpointError(where, f"{prefix}: {inputs} inputs do not split into {groups} groups")
    if fmt.method == "awq":
        inverse = torch.tensor([AWQ_ORDER.index(k) for k in range(8)])
        q = nibbles(qweight)[..., inverse].flatten(1).t()  # [out, in]
        zeros = nibbles(qzeros)[..., inverse].flatten(1)
        return _grouped(q, scales, zeros)
    q = nibbles(qweight).transpose(1, 2).reshape(inputs, out).t()  # input 8r + k is nibble k of row r
    zeros = nibbles(qzeros).flatten(1).to(torch.int32) + fmt.zero_offset
    g_idx = read(prefix + ".g_idx")
    group = inputs // groups
    natural = torch.arange(inputs) // group
    if g_idx is None or torch.equal(g_idx.to(torch.int64), natural):
        return _grouped(q, scales, zeros)
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (inputs,) or not torch.equal(torch.bincount(g_idx, minlength=groups), torch.bincount(natural)):
        raise CheckpointError(where, f"{prefix}.g_idx does not give each of the {groups} groups {group} inputs")
    cols = torch.argsort(g_idx, stable=True)  # stored column j is input cols[j]: groups contiguous
    return _grouped(q[:, cols], scales, zeros, cols)
