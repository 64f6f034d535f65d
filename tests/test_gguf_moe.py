"""Mixtral and Qwen3-MoE GGUFs written the way llama.cpp's converter lays them out (a Mixtral as architecture llama
with expert_count, its q/k rows permuted; a Qwen3-MoE as qwen3moe; routers as ffn_gate_inp, experts stacked 3-D as
ffn_gate_exps / ffn_up_exps / ffn_down_exps), from tiny random transformers models: F32 files against the model
they came from, a Q8_0 file kept packed (its experts too, each in its blocks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import MODEL_ARCH, GGMLQuantizationType as QT, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize, quantize

from nanoinfer.loaders.gguf import gguf_config, load_gguf_params, open_gguf
from test_gguf_formats import FILE_TYPES, llama_cpp_permute, our_logits, write_shapes, write_tokenizer

FAMILIES = {  # name -> (config class, GGUF architecture, fields)
    # (llama.cpp renormalizes every family's top-k: the Qwen3-MoE made so, as Qwen3-MoE checkpoints are)
    "mixtral": (transformers.MixtralConfig, MODEL_ARCH.LLAMA, dict(num_local_experts=6, num_experts_per_tok=2)),
    "qwen3moe": (transformers.Qwen3MoeConfig, MODEL_ARCH.QWEN3MOE, dict(
        num_experts=5, num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True, head_dim=32)),
}
PROMPT = list(range(3, 128, 4))  # 32 tokens


def moe_model(family: str, *, tied: bool, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    config_cls, _, fields = FAMILIES[family]
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    config = config_cls(**{**shape, **fields, **overrides}, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                        pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


def write_moe_gguf(model, path, family: str, weight_type: QT = QT.F32, rename: dict | None = None,
                   encoded: dict | None = None) -> None:
    """Metadata and tensors as convert_hf_to_gguf.py writes them (LlamaModel with experts; Qwen3MoeModel); `rename`
    writes some tensors under other names; `encoded` gives some tensors' bytes and type (name -> (bytes, type))."""
    cfg, (_, arch, _) = model.config, FAMILIES[family]
    writer = GGUFWriter(path, "llama" if family == "mixtral" else "qwen3moe")
    write_shapes(writer, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(FILE_TYPES[weight_type])
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "mixtral":
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    else:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    write_tokenizer(writer, cfg)
    name_map = get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, tensor in sorted(model.state_dict().items()):
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if ".mlp.experts." in hf_name:  # (stacked [experts, rows, cols]: gate and up apart, as the converter merges)
            block = f"blk.{hf_name.split('.')[2]}."
            if hf_name.endswith("gate_up_proj"):
                inter = array.shape[1] // 2
                tensors = [(block + "ffn_gate_exps.weight", array[:, :inter]), (block + "ffn_up_exps.weight",
                                                                                  array[:, inter:])]
            else:
                tensors = [(block + "ffn_down_exps.weight", array)]
        else:
            name = name_map.get_name(hf_name.replace(".mlp.gate.", ".block_sparse_moe.gate."),
                                     try_suffixes=(".weight",))
            assert name is not None, hf_name
            if family == "mixtral" and name.endswith("attn_q.weight"):
                array = llama_cpp_permute(array, cfg.num_attention_heads)
            elif family == "mixtral" and name.endswith("attn_k.weight"):
                array = llama_cpp_permute(array, cfg.num_key_value_heads)
            tensors = [(name, array)]
        for name, array in tensors:
            qtype = weight_type if array.ndim >= 2 and "ffn_gate_inp" not in name else QT.F32
            data, qtype = (encoded or {}).get(name) or (quantize(array.copy(), qtype), qtype)
            writer.add_tensor((rename or {}).get(name, name), data, raw_dtype=None if qtype == QT.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family,tied", [("mixtral", False), ("mixtral", True), ("qwen3moe", False),
                                         ("qwen3moe", True)])
def test_f32_logits_match_the_transformers_model_it_came_from(family, tied, tmp_path):
    model = moe_model(family, tied=tied)
    path = tmp_path / f"tiny-{family}.gguf"
    write_moe_gguf(model, path, family)
    header = open_gguf(path)
    cfg = gguf_config(header, path)
    assert cfg.architecture == ("mixtral" if family == "mixtral" else "qwen3_moe")
    assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob) == (
        model.config.num_local_experts, model.config.num_experts_per_tok, True)
    params = load_gguf_params(header, cfg, torch.float32, "cpu", path, progress=False)
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0]
    assert (our_logits(cfg, params, PROMPT) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["mixtral", "qwen3moe"])
def test_a_q8_0_moe_gguf_runs_packed_as_the_model_it_came_from(family, tmp_path):
    """As a user loads one on the CPU: the attention, the experts and the LM head kept packed (Q8_0 groups), the
    layers torch's. The source model holds the file's values (rounded through gguf-py), so the prompt's
    logprobs are transformers' within the packed matmuls' int8 rounding of activations (0.03-0.07 here), and within
    1e-4 dequantized, where the greedy tokens are transformers' too. (Packed, a near tie may flip a token, and with
    it a later route: the Qwen3-MoE file's 12th token does.)"""
    from nanoinfer import LLM, SamplingParams

    model = moe_model(family, tied=False, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not name.endswith("mlp.gate.weight"):
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy().copy(), QT.Q8_0), QT.Q8_0)))
    path = tmp_path / f"tiny-{family}-Q8_0.gguf"
    write_moe_gguf(model, path, family, QT.Q8_0)
    with torch.no_grad():
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
        expected = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], -1)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    for quantization, tolerance in (("auto", 1.5), ("none", 1e-4)):
        with LLM(path, device="cpu", progress=False, quantization=quantization) as llm:
            layer = llm.model.params.layers[0]
            assert type(layer.qkv_proj).__name__ == ("Tensor" if quantization == "none" else "BlockWeight")
            if quantization == "none":
                assert layer.moe.gate_up.dtype == torch.float32
            else:  # (each expert's matrices kept in the file's blocks: no float copy)
                assert {type(w).__name__ for w in layer.moe.gate_up.experts + layer.moe.down.experts} == {"BlockWeight"}
            out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        got = [lp.logprob for lp in out.prompt_logprobs[1:]]
        assert max(abs(g - expected[i, PROMPT[i + 1]].item()) for i, g in enumerate(got)) <= tolerance
        tokens = list(out.outputs[0].token_ids)
        assert tokens == want if quantization == "none" else len(tokens) == 16


@pytest.mark.parametrize("name", ["blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate.0.weight"])
def test_experts_stored_otherwise_are_refused_by_name(name, tmp_path):
    from nanoinfer.errors import CheckpointError

    path = tmp_path / "tiny-mixtral.gguf"
    write_moe_gguf(moe_model("mixtral", tied=True), path, "mixtral", rename={"blk.0.ffn_gate_exps.weight": name})
    with pytest.raises(CheckpointError, match="experts are not stored as ffn_gate_exps"):
        gguf_config(open_gguf(path), path)


def test_k_quant_experts_stay_in_their_blocks(tmp_path):
    """A Q4_K_M-like file's experts (gate and up in Q4_K, down in Q6_K) load as each expert's K-quant blocks, the
    bytes of the file and no float copy, and run the packed kernels: the prompt's logprobs are transformers' within
    the kernels' Q8_K rounding of activations, as the file's dequantized experts give them within 1e-4."""
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.quant.kquants import KQuantWeight
    from test_gguf_formats import kquant_encode

    hidden, inter, experts = 256, 256, 4
    model = moe_model("qwen3moe", tied=False, seed=5, hidden_size=hidden, moe_intermediate_size=inter,
                      intermediate_size=inter, num_experts=experts, num_experts_per_tok=2, head_dim=64)
    rng, encoded, file_bytes = np.random.default_rng(0), {}, 0
    with torch.no_grad():
        for name, p in model.named_parameters():  # (the other matrices as the file holds them: Q8_0)
            if p.ndim == 2 and not name.endswith("mlp.gate.weight"):
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy().copy(), QT.Q8_0), QT.Q8_0)))
        for i, layer in enumerate(model.model.layers):
            parts = [("ffn_gate_exps", QT.Q4_K, inter, hidden), ("ffn_up_exps", QT.Q4_K, inter, hidden),
                     ("ffn_down_exps", QT.Q6_K, hidden, inter)]
            values = {}
            for name, qtype, rows, cols in parts:
                data, vals = kquant_encode(qtype, experts * rows, cols, cols ** -0.5, rng)
                encoded[f"blk.{i}.{name}.weight"] = (data.reshape(experts, rows, -1), qtype)
                values[name] = torch.from_numpy(vals.reshape(experts, rows, cols).astype(np.float32))
                file_bytes += data.nbytes
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([values["ffn_gate_exps"], values["ffn_up_exps"]], 1))
            layer.mlp.experts.down_proj.copy_(values["ffn_down_exps"])
    path = tmp_path / "tiny-qwen3moe-kquant.gguf"
    write_moe_gguf(model, path, "qwen3moe", QT.Q8_0, encoded=encoded)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0], -1)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for quantization, tolerance in (("auto", 0.15), ("none", 1e-4)):  # (auto: 0.057 here)
        with LLM(path, device="cpu", progress=False, quantization=quantization) as llm:
            moes = [layer.moe for layer in llm.model.params.layers]
            if quantization == "auto":
                held = [w for moe in moes for w in moe.gate_up.experts + moe.down.experts]
                assert {(type(w), w.qtype) for w in held} == {(KQuantWeight, QT.Q4_K), (KQuantWeight, QT.Q6_K)}
                assert sum(moe.gate_up.nbytes() + moe.down.nbytes() for moe in moes) == file_bytes
            out = llm.generate([PROMPT], params, use_tqdm=False)[0]
        got = [lp.logprob for lp in out.prompt_logprobs[1:]]
        assert max(abs(g - expected[i, PROMPT[i + 1]].item()) for i, g in enumerate(got)) <= tolerance
