"""Load a GGUF file: config from its metadata, tensors dequantized on load or kept packed (exact groups), its tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from nanoinfer.model.config import ModelConfig, RopeScaling, checkpoint_config
from nanoinfer.model.config_checks import (MAX_DIMENSIONS, dimension, heads_share_kv_heads,
                                     positive_number, shown, token_id)
from nanoinfer.errors import CheckpointError
from nanoinfer.model.layers import rope_inv_freq
from nanoinfer.loaders.gguf_blocks import GROUPED_TYPES, KQUANT_TYPES, grouped_weight
from nanoinfer.gguf_file import GGUFFile, TensorInfo, read_gguf
from nanoinfer.loaders.params import build_params, unpermute_rotary_rows
from nanoinfer.model.decoder import Params
from nanoinfer.quant.kquants import KQuantWeight
from nanoinfer.quant.quantized import GroupedWeight, Int8Weight

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3moe")
SUPPORTED_TYPES = frozenset(
    QT[name] for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
)

# GGUF tensor name (per block, after "blk.{i}.") -> transformers' name (after "model.layers.{i}.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's names whose meaning differs from the other families': ffn_norm is the MLP's input norm (its sandwich),
# post_attention_norm the attention output's (nanoinfer/loaders/gguf_gemma.py: their metadata)
GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# The metadata's dimensions (after "{arch}.") -> ModelConfig's fields (whose MAX_DIMENSIONS bound them)
GGUF_DIMENSIONS = {"vocab_size": "vocab_size", "embedding_length": "hidden_size",
                   "feed_forward_length": "intermediate_size", "block_count": "num_layers",
                   "attention.head_count": "num_heads", "attention.head_count_kv": "num_kv_heads",
                   "attention.key_length": "head_dim", "rope.dimension_count": "head_dim",
                   "context_length": "max_position_embeddings"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: Path) -> GGUFFile:
    """The GGUF file's header: its metadata and tensor infos (nanoinfer/gguf_file.py)."""
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    return read_gguf(path)


def gguf_config(gguf_file: GGUFFile, path: Path) -> ModelConfig:
    arch = gguf_file.string("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(path, f"GGUF architecture {shown(arch)} is not supported (expected one of "
                                    f"{SUPPORTED_ARCHITECTURES})")

    def key(name, default=None):
        """A single value, not an array (dimension() and the rest check its kind); without a
        default, a missing key is an error."""
        return gguf_file.scalar(f"{arch}.{name}") if default is None else gguf_file.scalar(f"{arch}.{name}", default)

    def whole(name, default=None) -> int:
        """A dimension from the metadata; `default` when the key is absent, if it has one."""
        if default is not None and f"{arch}.{name}" not in gguf_file.fields:
            return default
        return dimension(f"{arch}.{name}", key(name), path, MAX_DIMENSIONS.get(GGUF_DIMENSIONS[name]))

    def number(name, default) -> float:
        return positive_number(f"{arch}.{name}", key(name, default), path)

    num_heads = whole("attention.head_count")
    num_kv_heads = whole("attention.head_count_kv", num_heads)
    heads_share_kv_heads(path, f"{arch}.attention.head_count", num_heads, f"{arch}.attention.head_count_kv",
                         num_kv_heads)
    hidden = whole("embedding_length")
    names = {t.name: t for t in gguf_file.tensors}
    vocab_size = _vocab_size(gguf_file, whole("vocab_size", 0), path)
    head_dim = whole("attention.key_length", 0) or whole("rope.dimension_count", 0)
    if not head_dim and hidden % num_heads:
        raise CheckpointError(path, f"{arch}.embedding_length {hidden} is not a multiple of "
                                    f"{arch}.attention.head_count {num_heads}, and no {arch}.attention.key_length "
                                    "says how wide a head is")
    bos, eos = _special_ids(gguf_file, path)
    family = _family_fields(gguf_file, arch, path, hidden=hidden, num_heads=num_heads,
                            head_dim=head_dim or hidden // num_heads, num_layers=whole("block_count"),
                            intermediate=whole("feed_forward_length"))
    return checkpoint_config(
        path,
        architecture=family.pop("architecture", arch),
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=whole("feed_forward_length"),
        num_layers=whole("block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden // num_heads,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=number("rope.freq_base", 10000.0),
        max_position_embeddings=whole("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=_rope_scaling(gguf_file, arch, path),
        # llama.cpp adds q/k/v biases to a llama whenever the file has them (llamafied Qwen)
        qkv_bias=arch == "qwen2" or any(n.endswith(".attn_q.bias") for n in names),
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),  # (RMSNorm over each head of q and k: attn_q/k_norm)
        **family,
        bos_token_id=bos,
        eos_token_ids=eos,
    )


def _vocab_size(gguf_file: GGUFFile, declared: int, path: Path) -> int:
    """The metadata's vocab_size (0: absent), else the token list's length, else the embedding's rows."""
    embed = next((t for t in gguf_file.tensors if t.name == "token_embd.weight"), None)
    vocab_size = declared or len(gguf_file.strings("tokenizer.ggml.tokens", [])) or (
        int(embed.shape[-1]) if embed is not None else 0)
    if vocab_size <= 0:
        raise CheckpointError(path, "cannot tell the vocabulary size: no vocab_size, tokens or token_embd.weight")
    return vocab_size


def _family_fields(gguf_file: GGUFFile, arch: str, path: Path, *, intermediate: int, **dimensions) -> dict:
    """The fields only some architectures' metadata sets: Gemma's (nanoinfer/loaders/gguf_gemma.py), a mixture of
    experts' (a llama with experts, which is a Mixtral, or a qwen3moe: nanoinfer/loaders/gguf_moe.py, with its
    family's name as `architecture`)."""
    if arch == "qwen3moe" or (arch == "llama" and gguf_file.scalar("llama.expert_count", 0)):
        from nanoinfer.loaders.gguf_moe import moe_fields

        return moe_fields(gguf_file, arch, path, intermediate=intermediate)
    if arch not in ("gemma2", "gemma3"):
        return {}
    from nanoinfer.loaders.gguf_gemma import gemma_fields

    return gemma_fields(gguf_file, arch, path, **dimensions)


def _rope_scaling(gguf_file: GGUFFile, arch: str, path: Path) -> RopeScaling | None:
    """The metadata's RoPE scaling: none, or linear by `rope.scaling.factor`."""
    kind = gguf_file.scalar(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise CheckpointError(path, f"rope scaling type {shown(kind)} is not supported (none, linear)")
    if kind == "none":
        return None
    return RopeScaling("linear", positive_number(f"{arch}.rope.scaling.factor",
                                                 gguf_file.scalar(f"{arch}.rope.scaling.factor", None), path))


def _special_ids(gguf_file: GGUFFile, path: Path) -> tuple[int | None, tuple[int, ...]]:
    """(bos, the ids that end generation: eos, eot, eom) as the metadata names them."""
    bos = gguf_file.scalar("tokenizer.ggml.bos_token_id", None)
    ends = [(f"tokenizer.ggml.{k}_token_id", gguf_file.scalar(f"tokenizer.ggml.{k}_token_id", -1))
            for k in ("eos", "eot", "eom")]
    return (None if bos is None else token_id("tokenizer.ggml.bos_token_id", bos, path),
            # (-1: the key is absent; llama.cpp writes no negative ids)
            tuple(dict.fromkeys(token_id(key, e, path) for key, e in ends if e != -1)))


DENSE_TYPES = frozenset(QT[name] for name in ("F32", "F16", "BF16"))


def is_quantized(gguf_file: GGUFFile) -> bool:
    """Whether any matrix of the file is stored in a quantized type (not F32/F16/BF16)."""
    return any(len(t.shape) == 2 and t.tensor_type not in DENSE_TYPES for t in gguf_file.tensors)


def packed_matrix(tensor: TensorInfo) -> KQuantWeight | GroupedWeight | None:
    """A quantized matrix read as the file holds it, or None for a type or width with no such
    form (`build_params` then puts it in the device's form: params.device_form, kquant_form)."""
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    if tensor.tensor_type in KQUANT_TYPES and cols % 256 == 0:
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))
        return KQuantWeight(data, int(tensor.tensor_type), cols)
    if tensor.tensor_type in GROUPED_TYPES and cols % 32 == 0:
        return grouped_weight(tensor.data, tensor.tensor_type, rows, cols)
    return None


def _refuse_unplaced_biases(tensors, cfg: ModelConfig, path: Path) -> None:
    """llama.cpp applies every bias in the file; one we have no slot for (attn_output, ffn_*) would be dropped
    silently and the outputs come out wrong: refused by name."""
    used_biases = ("attn_q.bias", "attn_k.bias", "attn_v.bias") if cfg.qkv_bias else ()
    for name in tensors:
        if name.endswith(".bias") and name.split(".", 2)[-1] not in used_biases:
            raise CheckpointError(path, f"tensor {shown(name)} is a bias this {cfg.architecture} model has no place "
                                        "for (supported: q/k/v biases)")


def load_gguf_params(gguf_file: GGUFFile, cfg: ModelConfig, dtype: torch.dtype, device, path: Path,
                     progress: bool = True, packed: bool = False, layer_form=None) -> Params:
    """`packed`: quantized matrices stay quantized (nanoinfer.quant.quantized, CPU kernels): Q4_0,
    Q4_1, Q5_0, Q5_1 and Q8_0 in groups, Q4_K, Q5_K and Q6_K in their super-blocks (both exact;
    `build_params` puts them in the device's form); without it every tensor is dequantized to `dtype`."""
    by_hf_name, layer_names = {}, GEMMA_LAYER_NAMES if cfg.sandwich_norms else _LAYER_NAMES
    for tensor in gguf_file.tensors:
        name = tensor.name
        if name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest in layer_names:
                by_hf_name[f"model.layers.{idx}.{layer_names[rest]}"] = tensor
        elif name in _GLOBAL_NAMES:
            by_hf_name[_GLOBAL_NAMES[name]] = tensor
    tensors = {t.name: t for t in gguf_file.tensors}
    _refuse_unplaced_biases(tensors, cfg, path)

    def dequant(tensor: TensorInfo) -> torch.Tensor:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise CheckpointError(path, f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                                        f"supported: {sorted(t.name for t in SUPPORTED_TYPES)}")
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise CheckpointError(path, f"cannot dequantize tensor {tensor.name!r}: {exc!r}") from exc
        # GGUF lists dims innermost first; the array is already [out, in], HF's layout.
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a copy: the file is mapped read-only

    def matrix(tensor: TensorInfo):
        return packed_matrix(tensor) or Int8Weight.quantize(dequant(tensor))

    def get(hf_name: str):
        tensor = by_hf_name.get(hf_name)
        if tensor is None:
            return None
        is_matrix = hf_name.endswith("_proj.weight") or hf_name in ("lm_head.weight", "model.embed_tokens.weight")
        if packed and is_matrix and len(tensor.shape) == 2 and tensor.tensor_type not in DENSE_TYPES:
            w = matrix(tensor)
        else:
            w = dequant(tensor)
        # (a Mixtral GGUF is a llama: its q/k rows permuted likewise)
        if cfg.architecture in ("llama", "mixtral") and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rotary_rows(w, cfg.num_heads)
        elif cfg.architecture in ("llama", "mixtral") and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rotary_rows(w, cfg.num_kv_heads)
        return w

    if cfg.num_experts:  # (a sparse layer's router and experts: packed with the file's other matrices)
        from nanoinfer.loaders.gguf_moe import expert_tensors

        get = expert_tensors(get, tensors, dequant, packed_matrix if packed else None)
    inv_freq = None
    if "rope_freqs.weight" in tensors:
        # Llama-3.1 GGUFs store the llama3 rope scaling as per-frequency divisors.
        inv_freq = rope_inv_freq(cfg) / dequant(tensors["rope_freqs.weight"]).reshape(-1)
    return build_params(get, cfg, dtype, device, path, inv_freq=inv_freq, progress=progress, layer_form=layer_form)
