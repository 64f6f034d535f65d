"""GGUF files written the way llama.cpp's `convert_hf_to_gguf.py` lays them out, from tiny
random transformers models: llama (Q/K rows permuted), qwen2 (QKV bias), qwen3, gemma2 and gemma3 (norms
stored with Gemma's +1, soft-caps and window in the metadata), every supported
tensor type, a Llama-3.1 `rope_freqs` tensor, llama q/k/v biases, and what we refuse (an
unsupported tensor type, a bias we have no place for).

References are independent of our loader: the transformers model the file came from, the
same file loaded by transformers, gguf-py's dequantization, and (for the K-quants, which
gguf-py cannot quantize) block values this file encodes itself."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import transformers
from gguf import (MODEL_ARCH, GGMLQuantizationType as QT, GGUFWriter, LlamaFileType, RopeScalingType, TokenType,
                  get_tensor_name_map)
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.errors import CheckpointError
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders import load_model
from nanoinfer.loaders.gguf import gguf_config, load_gguf_params, open_gguf
from nanoinfer.model.decoder import forward

# hidden and intermediate sizes are multiples of 256 so every matrix row holds whole K-quant
# superblocks; 4 query heads over 2 KV heads (GQA 2), head_dim 64.
VOCAB, HIDDEN, INTER, HEADS, KV_HEADS = 256, 256, 512, 4, 2
HEAD_DIM = HIDDEN // HEADS
QK_K = 256
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)  # gguf-py dequantizes these but cannot quantize them
PROMPTS = [[17], [5, 200, 33, 9, 128, 64, 1], list(range(3, 250, 5))]  # 1, 7 and 50 tokens
ARCHS = {"llama": (transformers.LlamaConfig, MODEL_ARCH.LLAMA), "qwen2": (transformers.Qwen2Config, MODEL_ARCH.QWEN2),
         "qwen3": (transformers.Qwen3Config, MODEL_ARCH.QWEN3),
         "gemma2": (transformers.Gemma2Config, MODEL_ARCH.GEMMA2),
         "gemma3": (transformers.Gemma3TextConfig, MODEL_ARCH.GEMMA3)}
# What llama.cpp's converter keeps of a Gemma (soft-caps, the window) or fixes by architecture (attention scaled by
# head_dim, Gemma 3's windowed layers at base 10,000 unscaled, its global layers' linear scaling): the tiny models
# are made so, caps small enough to bend their values, a window shorter than the longest prompt.
GEMMA_FIELDS = {
    "gemma2": dict(query_pre_attn_scalar=HEAD_DIM, sliding_window=4, attn_logit_softcapping=5.0,
                   final_logit_softcapping=8.0),
    "gemma3": dict(query_pre_attn_scalar=HEAD_DIM, sliding_window=4, final_logit_softcapping=8.0, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


# --- the tiny transformers models ----------------------------------------------------------

def hf_model(arch: str, *, tied: bool, num_layers: int = 2, seed: int = 0, rope_theta: float = 10000.0,
             **fields) -> transformers.PreTrainedModel:
    """A random model whose weights all differ (norms not all ones, biases not zero), so a
    swapped or dropped tensor changes the logits."""
    config_cls, _ = ARCHS[arch]
    if arch == "qwen3":  # (heads wider than hidden / heads, as Qwen3's are: read from attention.key_length)
        fields = {"head_dim": 2 * HIDDEN // HEADS, **fields}
    if arch in GEMMA_FIELDS:
        fields = {"head_dim": HEAD_DIM, **GEMMA_FIELDS[arch], **fields}
    config = config_cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=num_layers,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                        rms_norm_eps=1e-5, rope_theta=rope_theta, tie_word_embeddings=tied,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0, **fields)
    # (Gemma 2's soft-capped attention is transformers' eager one: its SDPA has no cap)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager" if arch == "gemma2" else "sdpa").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model


def rope_theta_of(model) -> float:
    cfg = model.config
    params = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # (Gemma 3's by layer type)
    return float(getattr(cfg, "rope_theta", None) or params["rope_theta"])


# --- K-quant blocks built here (gguf-py can dequantize Q4_K/Q5_K/Q6_K but not quantize them) --

def kquant_encode(qtype: QT, rows: int, cols: int, std: float, rng: np.random.Generator):
    """Random valid superblocks of `qtype` for a [rows, cols] matrix whose values have about
    `std` spread around zero: (bytes [rows, cols // 256 * type_size], values [rows, cols]).
    The values are computed here from the fields, following ggml's block layouts, so they are a
    reference independent of gguf-py's dequantizer."""
    n = rows * cols // QK_K
    f32 = np.float32
    if qtype in (QT.Q4_K, QT.Q5_K):
        qmax = 15 if qtype == QT.Q4_K else 31
        sc = rng.integers(1, 9 if qtype == QT.Q4_K else 5, (n, 8)).astype(np.uint8)  # 6-bit sub-block scales
        mn = np.rint(sc * qmax / 2).astype(np.uint8)  # 6-bit mins: value = d*sc*q - dmin*mn, centred when d == dmin
        q = rng.integers(0, qmax + 1, (n, 8, 32)).astype(np.uint8)
        spread = math.sqrt(float(np.mean(sc.astype(f32) ** 2))) * math.sqrt(((qmax + 1) ** 2 - 1) / 12)
        d = (std / spread * rng.uniform(0.7, 1.3, n)).astype(np.float16)
        d32 = d.astype(f32)
        values = ((d32[:, None] * sc.astype(f32))[:, :, None] * q.astype(f32)
                  - (d32[:, None] * mn.astype(f32))[:, :, None])
        scales = np.concatenate([
            (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),  # bytes 0-3: scales 0-3, top bits of scales 4-7
            (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),  # bytes 4-7: mins 0-3, top bits of mins 4-7
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),  # bytes 8-11: low nibbles of scales/mins 4-7
        ], axis=1)
        low = (q & 0x0F).reshape(n, 4, 2, 32)  # 32 bytes hold sub-blocks 2c (low nibble) and 2c+1 (high)
        qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
        parts = [d.view(np.uint8).reshape(n, 2), d.view(np.uint8).reshape(n, 2), scales]
        if qtype == QT.Q5_K:
            high = q >> 4  # bit 4 of value i of sub-block j is bit j of qh[i]
            parts.append(sum(high[:, j].astype(np.uint8) << j for j in range(8)).astype(np.uint8))
        blocks = np.concatenate(parts + [qs], axis=1)
    elif qtype == QT.Q6_K:
        scale = (rng.integers(8, 32, (n, 16)) * rng.choice([-1, 1], (n, 16))).astype(np.int8)  # per 16 values
        q = rng.integers(0, 64, (n, QK_K)).astype(np.uint8)
        spread = math.sqrt(float(np.mean(scale.astype(f32) ** 2))) * math.sqrt((64 ** 2 - 1) / 12)
        d = (std / spread * rng.uniform(0.7, 1.3, n)).astype(np.float16)
        values = ((d.astype(f32)[:, None] * scale.astype(f32))[:, :, None]
                  * (q.astype(f32) - 32).reshape(n, 16, 16))
        low = (q & 0x0F).reshape(n, 2, 2, 64)  # each half: 64 bytes, low nibble then high nibble
        ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
        high = (q >> 4).reshape(n, 2, 4, 32)  # each half: 32 bytes, 2 bits for each of 4 groups of 32
        qh = sum(high[:, :, g].astype(np.uint8) << (2 * g) for g in range(4)).astype(np.uint8).reshape(n, 64)
        blocks = np.concatenate([ql, qh, scale.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    else:
        raise ValueError(qtype)
    assert blocks.shape == (n, GGML_QUANT_SIZES[qtype][1])
    return blocks.reshape(rows, -1), values.reshape(rows, cols).astype(f32)


def make_kquant_representable(model, qtype: QT, seed: int = 1) -> dict[str, np.ndarray]:
    """Replace every matrix of `model` by values `qtype` holds exactly; returns their bytes by
    transformers name, so the model is an exact reference for the quantized file."""
    rng = np.random.default_rng(seed)
    encoded = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                blocks, values = kquant_encode(qtype, *p.shape, float(p.std()), rng)
                p.copy_(torch.from_numpy(values))
                encoded[name] = blocks
    if model.config.tie_word_embeddings:
        encoded["lm_head.weight"] = encoded["model.embed_tokens.weight"]
    return encoded


# --- writing a GGUF the way convert_hf_to_gguf.py does ---------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's two rotary halves.
    Works on float rows and on quantized byte rows alike (ggml quantizes row by row)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gpt2_byte_tokens() -> list[str]:
    """GPT-2's bytes_to_unicode: the 256 single-byte tokens of a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


FILE_TYPES = {QT.F32: LlamaFileType.ALL_F32, QT.F16: LlamaFileType.MOSTLY_F16, QT.BF16: LlamaFileType.MOSTLY_BF16,
              QT.Q8_0: LlamaFileType.MOSTLY_Q8_0, QT.Q4_0: LlamaFileType.MOSTLY_Q4_0,
              QT.Q4_1: LlamaFileType.MOSTLY_Q4_1, QT.Q5_0: LlamaFileType.MOSTLY_Q5_0, QT.Q5_1: LlamaFileType.MOSTLY_Q5_1,
              QT.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
              QT.Q5_K: LlamaFileType.MOSTLY_Q5_K_M, QT.Q6_K: LlamaFileType.MOSTLY_Q6_K}


def write_gguf(model, path, arch: str, *, weight_type: QT = QT.F32, encoded: dict | None = None,
               type_overrides: dict[str, QT] | None = None, rope_freqs: np.ndarray | None = None,
               leave_out: tuple[str, ...] = ()) -> None:
    """Metadata, tensor names, order, permutation and types as llama.cpp's converter writes
    them: 1-D tensors (norms, biases) in F32, matrices in `weight_type` (or an override by GGUF
    name), the tied lm_head left out, llama's q/k rows permuted. `encoded` holds K-quant bytes
    by transformers name (see make_kquant_representable)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    write_shapes(writer, cfg)
    if arch != "gemma2":  # (Gemma2Model writes none: llama.cpp's default, 10,000)
        writer.add_rope_freq_base(rope_theta_of(model))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(FILE_TYPES.get(weight_type, LlamaFileType.GUESSED))
    if arch == "llama":  # LlamaModel adds these; Qwen2Model leaves vocab size to the token list
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    if getattr(cfg, "head_dim", None) is not None and arch in ("qwen3", "gemma2", "gemma3"):  # (a config's head_dim)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch in GEMMA_FIELDS:
        write_gemma_metadata(writer, cfg, arch)
    write_tokenizer(writer, cfg)

    name_map = get_tensor_name_map(ARCHS[arch][1], cfg.num_hidden_layers)
    if rope_freqs is not None:  # generate_extra_tensors() runs before the checkpoint's tensors
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    state = model.state_dict()
    for hf_name in sorted(state):  # the order of the keys of a safetensors file
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if name in leave_out:
            continue
        array = state[hf_name].float().numpy()
        if arch in GEMMA_FIELDS and hf_name.endswith("norm.weight"):  # (Gemma's norms multiply by 1 + w)
            array = array + 1
        qtype = (type_overrides or {}).get(name, weight_type) if array.ndim == 2 else QT.F32
        if qtype in K_QUANTS:
            data = encoded[hf_name]
        elif qtype == QT.IQ4_NL:  # gguf-py cannot quantize it: random blocks with a finite scale
            rows, cols = array.shape
            data = np.random.default_rng(0).integers(0, 256, (rows, cols // 32 * 18), dtype=np.uint8)
            data.reshape(-1, 18)[:, :2] = np.full((1,), 1e-3, np.float16).view(np.uint8)
        else:
            data = quantize(array, qtype)  # F32/F16 arrays come back as floats, the other types as bytes
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            data = llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = llama_cpp_permute(data, cfg.num_key_value_heads)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_shapes(writer: GGUFWriter, cfg) -> None:
    """The keys every converted model has: its layers, context, widths and heads."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)


def write_tokenizer(writer: GGUFWriter, cfg) -> None:
    """A GPT-2 byte vocabulary cut to the model's size, its BOS and EOS."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(gpt2_byte_tokens()[:cfg.vocab_size])
    writer.add_token_types([int(TokenType.NORMAL)] * cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)


def write_gemma_metadata(writer: GGUFWriter, cfg, arch: str) -> None:
    """Gemma2Model's and Gemma3Model's keys: the soft-caps (Gemma 3's final one only when set), the window, Gemma
    3's global layers' linear scaling (TextModel's, from the full-attention layers' RoPE parameters)."""
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    scaling = cfg.rope_parameters.get("full_attention", {})
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])


# --- running the models ----------------------------------------------------------------------

def our_logits(cfg, params, tokens: list[int]) -> torch.Tensor:
    kv = allocate_kv_pool(cfg, 8, 16, torch.float32, "cpu")
    batch = build_batch([SeqChunk(tokens, 0, list(range(-(-len(tokens) // 16))), True)], 16)
    return forward(params, kv, batch._replace(logits_indices=torch.arange(len(tokens))), cfg)


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def transformers_from_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa").eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# --- 1. architectures, F32 ----------------------------------------------------------------------

ARCH_CASES = [  # (id, arch, tied, layers)
    ("llama-gqa2-untied", "llama", False, 2),
    ("llama-gqa2-tied", "llama", True, 1),
    ("qwen2-gqa2-bias-tied", "qwen2", True, 2),
    ("qwen2-gqa2-bias-untied", "qwen2", False, 1),
    ("qwen3-gqa2-qknorm-tied", "qwen3", True, 2),  # (q/k norms: Qwen3's GGUFs, the year's most downloaded)
    ("qwen3-gqa2-qknorm-untied", "qwen3", False, 1),
    ("gemma2-gqa2-softcap-window-tied", "gemma2", True, 2),  # (layer 0 windowed, layer 1 global)
    ("gemma3-gqa2-qknorm-localrope-tied", "gemma3", True, 6),  # (layers 0-4 windowed at their own base, 5 global)
]


@pytest.fixture(scope="module", params=ARCH_CASES, ids=[c[0] for c in ARCH_CASES])
def f32_file(request, tmp_path_factory):
    case, arch, tied, layers = request.param
    model = hf_model(arch, tied=tied, num_layers=layers)
    path = tmp_path_factory.mktemp(case) / f"{case}.gguf"
    write_gguf(model, path, arch)
    return arch, model, path


def test_f32_logits_match_the_transformers_model_it_came_from(f32_file):
    arch, model, path = f32_file
    loaded = load_model(path, device="cpu", dtype="float32", progress=False)  # the public entry, tokenizer included
    cfg = loaded.config
    assert (cfg.architecture, cfg.vocab_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        arch, VOCAB, model.config.num_hidden_layers, HEADS, KV_HEADS, 2 * HEAD_DIM if arch == "qwen3" else HEAD_DIM)
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.qk_norm == (arch in ("qwen3", "gemma3"))
    for tokens in PROMPTS:
        assert max_diff(our_logits(cfg, loaded.params, tokens), hf_logits(model, tokens)) <= 1e-4


def test_f32_logits_match_transformers_loading_the_same_gguf(f32_file):
    arch, model, path = f32_file
    if arch in GEMMA_FIELDS:
        pytest.skip("transformers' GGUF reader leaves out Gemma's soft-caps and query_pre_attn_scalar (its "
                    "defaults run another model); the test above holds Gemma's files to the model they came from")
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    params = load_gguf_params(reader, cfg, torch.float32, "cpu", path, progress=False)
    theirs = transformers_from_gguf(path)
    assert theirs.config.tie_word_embeddings == model.config.tie_word_embeddings
    for tokens in PROMPTS:
        assert max_diff(our_logits(cfg, params, tokens), hf_logits(theirs, tokens)) <= 1e-4


# --- 2. every supported tensor type ------------------------------------------------------------

# Relative error ||ours - original|| / ||original|| of a matrix quantized from the original
# floats; a wrong row order would give ~1.4. F32 and the K-quants (whose originals are made
# representable) must be exact.
ROUND_TRIP_ERROR = {QT.F32: 1e-7, QT.F16: 1e-3, QT.BF16: 1e-2, QT.Q8_0: 1e-2, QT.Q4_0: 0.15, QT.Q4_1: 0.15,
                    QT.Q5_0: 0.08, QT.Q5_1: 0.08,
                    QT.Q4_K: 1e-7, QT.Q5_K: 1e-7, QT.Q6_K: 1e-7}
TYPES = list(ROUND_TRIP_ERROR)


def test_kquant_blocks_built_here_match_gguf_py():
    """The encoder above against gguf-py's dequantizer: both read ggml's layouts the same way."""
    rng = np.random.default_rng(0)
    for qtype in K_QUANTS:
        blocks, values = kquant_encode(qtype, 6, 512, 0.05, rng)
        np.testing.assert_array_equal(dequantize(blocks, qtype), values)
        assert 0.03 < values.std() < 0.08 and abs(values.mean()) < 0.01


def split_loaded_matrices(params, layer_count) -> dict[str, torch.Tensor]:
    """Our fused parameters cut back into transformers-named matrices [out, in]."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"model.embed_tokens.weight": params.embed, "lm_head.weight": params.lm_head}
    for i, layer in enumerate(params.layers[:layer_count]):
        p = f"model.layers.{i}."
        qkv = layer.qkv_proj
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"], out[p + "self_attn.v_proj.weight"] = (
            qkv[:q], qkv[q:q + kv], qkv[q + kv:])
        out[p + "self_attn.o_proj.weight"] = layer.o_proj
        out[p + "mlp.gate_proj.weight"] = layer.gate_up_proj[:INTER]
        out[p + "mlp.up_proj.weight"] = layer.gate_up_proj[INTER:]
        out[p + "mlp.down_proj.weight"] = layer.down_proj
    return out


def inverse_row_permutation(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama_cpp_permute by scattering rows back to where it took them from (not by
    the reshape trick the loader uses)."""
    taken_from = llama_cpp_permute(np.arange(w.shape[0]), n_head)  # row i of the file is row taken_from[i]
    out = np.empty_like(w)
    out[taken_from] = w
    return out


@pytest.fixture(scope="module")
def llama_untied():
    return hf_model("llama", tied=False, num_layers=2, seed=3)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_every_supported_type(qtype, llama_untied, tmp_path):
    model = copy.deepcopy(llama_untied)  # the K-quants change its weights
    encoded = make_kquant_representable(model, qtype) if qtype in K_QUANTS else None
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(model, path, "llama", weight_type=qtype, encoded=encoded)

    reader = open_gguf(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert {types[n] for n in types if n.endswith("norm.weight")} == {QT.F32}
    assert {types[n] for n in types if not n.endswith("norm.weight")} == {qtype}
    cfg = gguf_config(reader, path)
    params = load_gguf_params(reader, cfg, torch.float32, "cpu", path, progress=False)

    # Shapes, and each matrix equal to gguf-py's dequantization of the file, rows un-permuted.
    ours = split_loaded_matrices(params, cfg.num_layers)
    name_map = get_tensor_name_map(MODEL_ARCH.LLAMA, cfg.num_layers)
    by_name = {t.name: t for t in reader.tensors}
    original = model.state_dict()
    for hf_name, got in ours.items():
        tensor = by_name[name_map.get_name(hf_name, try_suffixes=(".weight",))]
        reference = dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name:
            reference = inverse_row_permutation(reference, HEADS)
        elif ".attn_k." in tensor.name:
            reference = inverse_row_permutation(reference, KV_HEADS)
        assert tuple(got.shape) == tuple(original[hf_name].shape) == reference.shape, hf_name
        assert torch.equal(got, torch.from_numpy(np.array(reference))), hf_name
        error = ((got - original[hf_name]).norm() / original[hf_name].norm()).item()
        assert error <= ROUND_TRIP_ERROR[qtype], (hf_name, error)

    # Logits against transformers loading the same file (it dequantizes with gguf-py and
    # un-permutes with its own code), and for exact types against the original model too.
    theirs = transformers_from_gguf(path)
    for tokens in PROMPTS:
        got = our_logits(cfg, params, tokens)
        assert max_diff(got, hf_logits(theirs, tokens)) <= 1e-3
        if ROUND_TRIP_ERROR[qtype] < 1e-6:
            assert max_diff(got, hf_logits(model, tokens)) <= 1e-3


# --- 3. a type we do not support ----------------------------------------------------------------

@pytest.mark.parametrize("qtype", [QT.IQ4_NL], ids=["IQ4_NL"])
def test_unsupported_type_names_the_tensor_and_the_type(qtype, tmp_path):
    model = hf_model("llama", tied=True, num_layers=2, seed=4)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(model, path, "llama", weight_type=QT.Q8_0, type_overrides={"blk.1.ffn_down.weight": qtype})
    assert {t.name: t.tensor_type for t in open_gguf(path).tensors}["blk.1.ffn_down.weight"] == qtype
    with pytest.raises(CheckpointError) as info:
        load_model(path, device="cpu", dtype="float32", progress=False)
    message = str(info.value)
    assert "blk.1.ffn_down.weight" in message and qtype.name in message and str(path) in message


# --- llama with biases (llama.cpp applies any it finds) -------------------------------------

def test_llama_with_qkv_bias_llamafied_qwen(tmp_path):
    """A llama GGUF with q/k/v biases (a "llamafied" Qwen): the converter permutes the q/k
    biases like their weights, and they must be applied."""
    model = hf_model("llama", tied=True, num_layers=2, seed=6, attention_bias=True)
    layers = range(model.config.num_hidden_layers)
    with torch.no_grad():  # no o_proj bias in this file: zero in the reference
        for layer in model.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    path = tmp_path / "tiny-llama-qkv-bias.gguf"
    write_gguf(model, path, "llama", leave_out=tuple(f"blk.{i}.attn_output.bias" for i in layers))
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    assert cfg.qkv_bias
    params = load_gguf_params(reader, cfg, torch.float32, "cpu", path, progress=False)
    for tokens in PROMPTS:
        assert max_diff(our_logits(cfg, params, tokens), hf_logits(model, tokens)) <= 1e-4


def test_bias_without_a_place_is_refused(tmp_path):
    """An attn_output bias has no slot in our model: refused, not silently dropped."""
    model = hf_model("llama", tied=True, num_layers=1, seed=7, attention_bias=True)
    path = tmp_path / "tiny-llama-o-bias.gguf"
    write_gguf(model, path, "llama")
    reader = open_gguf(path)
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_output\.bias"):
        load_gguf_params(reader, gguf_config(reader, path), torch.float32, "cpu", path, progress=False)


# --- 4. Llama 3.1: llama3 rope scaling stored as a rope_freqs tensor -----------------------------

def llama_cpp_rope_factors(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the divisor of each rotary frequency."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama31_rope_freqs_tensor(tmp_path):
    # A short original context puts head_dim 64's frequencies in all three bands by position ~50.
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    model = hf_model("llama", tied=True, num_layers=2, seed=5, rope_theta=500000.0, rope_scaling=scaling)
    factors = llama_cpp_rope_factors(500000.0, HEAD_DIM, scaling)
    assert (factors == 1).any() and (factors == 8).any() and ((factors > 1) & (factors < 8)).any()
    path = tmp_path / "tiny-llama31.gguf"
    write_gguf(model, path, "llama", rope_freqs=factors)

    reader = open_gguf(path)
    assert reader.tensors[0].name == "rope_freqs.weight"
    cfg = gguf_config(reader, path)
    params = load_gguf_params(reader, cfg, torch.float32, "cpu", path, progress=False)
    unscaled = hf_model("llama", tied=True, num_layers=2, seed=5, rope_theta=500000.0)
    long_prompt = PROMPTS[-1]
    # The scaling matters for this prompt (so the check below can fail)...
    assert max_diff(hf_logits(model, long_prompt), hf_logits(unscaled, long_prompt)) > 1e-2
    # ...and our model from the file is the scaled one.
    for tokens in PROMPTS:
        assert max_diff(our_logits(cfg, params, tokens), hf_logits(model, tokens)) <= 1e-4


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q6_K], ids=["Q8_0", "Q6_K"])
def test_a_qwen3_gguf_runs_packed_as_transformers_runs_the_same_file(qtype, tmp_path):
    """Qwen3's GGUFs (q/k norms, heads wider than hidden / heads) on the CPU's packed path, as a user loads one:
    greedy tokens as transformers' from the same file (which dequantizes it)."""
    from nanoinfer import LLM, SamplingParams

    model = hf_model("qwen3", tied=False, num_layers=2, seed=5)
    encoded = make_kquant_representable(model, qtype) if qtype in K_QUANTS else None
    path = tmp_path / f"tiny-qwen3-{qtype.name}.gguf"
    write_gguf(model, path, "qwen3", weight_type=qtype, encoded=encoded)
    theirs = transformers_from_gguf(path)
    prompt = PROMPTS[1]
    with torch.no_grad():
        want = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    with LLM(path, device="cpu", progress=False) as llm:  # (bf16 activations, the matrices kept packed)
        cfg, layer = llm.model.config, llm.model.params.layers[0]
        assert cfg.qk_norm and cfg.head_dim == 2 * HEAD_DIM
        assert type(layer.qkv_proj).__name__ == ("KQuantWeight" if qtype in K_QUANTS else "BlockWeight")
        got = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert list(got[0].outputs[0].token_ids) == want


# The packed matmuls round activations to int8 per group of 32: on these tiny random models (logits spread ~5-9)
# prompt logprobs move by up to ~0.6 for a llama or qwen3 Q6_K file as for a Gemma's (measured 0.2-1.1); the same
# file dequantized (quantization="none") is held to 1e-4.
PACKED_LOGPROB_ERROR = 1.5


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q6_K], ids=["Q8_0", "Q6_K"])
def test_a_gemma_gguf_runs_packed_as_the_model_it_came_from(arch, qtype, tmp_path):
    """Gemma's GGUFs on the CPU as a user loads one: the matrices kept packed (Q8_0 groups, Q6_K super-blocks), the
    layers torch's (the packed C layer has no soft-caps or sandwich norms). The source model holds the file's values
    exactly (Q6_K: encoded here; Q8_0: rounded through gguf-py), so greedy tokens are transformers', the prompt's
    logprobs within the packed matmuls' rounding, and the file dequantized gives transformers' logprobs."""
    from nanoinfer import LLM, SamplingParams

    model = hf_model(arch, tied=True, num_layers=2 if arch == "gemma2" else 6, seed=5)
    encoded = make_kquant_representable(model, qtype) if qtype in K_QUANTS else None
    if qtype == QT.Q8_0:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 2:
                    p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), qtype), qtype)))
    path = tmp_path / f"tiny-{arch}-{qtype.name}.gguf"
    write_gguf(model, path, arch, weight_type=qtype, encoded=encoded)
    prompt = PROMPTS[2]  # (50 tokens: past the window of 4)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    for quantization, tolerance in (("auto", PACKED_LOGPROB_ERROR), ("none", 1e-4)):
        with LLM(path, device="cpu", progress=False, quantization=quantization) as llm:
            packed = type(llm.model.params.layers[0].qkv_proj).__name__
            assert packed == ("Tensor" if quantization == "none" else "KQuantWeight" if qtype in K_QUANTS
                              else "BlockWeight")
            out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == want
        got = [lp.logprob for lp in out.prompt_logprobs[1:]]
        assert max(abs(g - expected[i, prompt[i + 1]].item()) for i, g in enumerate(got)) <= tolerance


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", K_QUANTS, ids=[t.name for t in K_QUANTS])
def test_kquant_file_runs_on_cuda(qtype, llama_untied, tmp_path):
    """A K-quant GGUF with quantization="gguf" on CUDA: every weight on the GPU in a form its kernels read (Q4_K's
    groups, read on the host, were once left there, and the first step failed on tensors of two devices), and the
    engine serves it."""
    from nanoinfer.loaders import load_model
    from nanoinfer.model.decoder import map_params
    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.engine.engine_core import EngineConfig, EngineCore

    model = copy.deepcopy(llama_untied)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(model, path, "llama", weight_type=qtype, encoded=make_kquant_representable(model, qtype))
    loaded = load_model(path, device="cuda", quantization="gguf", progress=False)
    devices = set()
    map_params(lambda t: devices.add(t.device.type) or t, loaded.params)
    assert devices == {"cuda"}
    engine = EngineCore(loaded, EngineConfig(block_size=16, num_blocks=64, max_model_len=256))
    seq = engine.add_request([5, 200, 33, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    assert len(seq.output_token_ids) == 6
