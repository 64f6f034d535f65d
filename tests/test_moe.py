"""The mixture-of-experts layer (nanoinfer/model/moe.py): routing against hand-computed cases, the reference
against transformers' own Mixtral and Qwen3-MoE blocks on the same weights, and a sparse model's rows the same
batched as alone."""

import math

import dataclasses

import pytest
import torch
import transformers

from nanoinfer.model.config import ModelConfig
from nanoinfer.model.moe import MoEParams, experts_reference, moe_mlp, route

LOGITS = [[1.0, 2.0, 3.0, 0.0], [0.5, -1.0, 0.25, 2.0]]


def _softmax(row):
    total = sum(math.exp(v) for v in row)
    return [math.exp(v) / total for v in row]


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_keeps_the_k_most_probable_experts(renormalize):
    weights, experts = route(torch.tensor(LOGITS), 2, renormalize)
    # (largest first; torch.topk leaves ties' order unspecified, so these rows have none)
    assert experts.tolist() == [[2, 1], [3, 0]]
    for row, (logits, chosen) in enumerate(zip(LOGITS, experts.tolist())):
        probs = _softmax(logits)
        want = [probs[e] for e in chosen]
        if renormalize:  # (= a softmax over the k chosen logits: top-k then softmax)
            want = [w / sum(want) for w in want]
            assert want == pytest.approx(_softmax([logits[e] for e in chosen]))
        assert weights[row].tolist() == pytest.approx(want, abs=1e-7)
    assert weights.dtype == torch.float32


def test_routing_in_bfloat16_takes_its_softmax_in_fp32():
    logits = torch.tensor(LOGITS, dtype=torch.bfloat16)
    weights, experts = route(logits, 3, True)
    ref_weights, ref_experts = route(logits.float(), 3, True)
    assert weights.dtype == torch.float32 and torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)


def _config(experts: int, k: int, inter: int, normalize: bool) -> ModelConfig:
    return ModelConfig("mixtral", 64, 32, inter, 1, 4, 2, 8, 1e-6, 1e4, 64, False, num_experts=experts,
                       experts_per_token=k, norm_topk_prob=normalize)


def _their_block(family: str, experts: int, k: int, inter: int, normalize: bool):
    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=32, intermediate_size=inter, num_local_experts=experts,
                                            num_experts_per_tok=k)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=inter, num_experts=experts,
                                             num_experts_per_tok=k, norm_topk_prob=normalize)
        block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.eval()


@pytest.mark.parametrize("family,experts,k,normalize", [("mixtral", 8, 2, True), ("qwen3_moe", 6, 3, False),
                                                       ("qwen3_moe", 5, 2, True)])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_reference_matches_transformers_block(family, experts, k, normalize, tokens):
    block = _their_block(family, experts, k, 24, normalize)
    ours = MoEParams(block.gate.weight.detach(), block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        expected = block(x[None])[0]
    got = moe_mlp(x, ours, _config(experts, k, 24, normalize))
    assert (got - expected).abs().max().item() <= 1e-6
    if tokens == 33:  # (enough tokens that every expert gets some: the loop's every branch)
        assert len(set(route(x @ ours.router.T, k, normalize)[1].flatten().tolist())) == experts


def test_reference_in_bfloat16_is_close_to_fp32():
    block = _their_block("mixtral", 8, 2, 24, True)
    ours = MoEParams(block.gate.weight.detach(), block.experts.gate_up_proj.detach(), block.experts.down_proj.detach())
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1))
    weights, experts = route(x @ ours.router.T, 2, True)
    exact = experts_reference(x, ours, weights, experts)
    half = MoEParams(*(t.bfloat16() for t in (ours.router, ours.gate_up, ours.down)))
    got = experts_reference(x.bfloat16(), half, weights, experts)
    assert got.dtype == torch.bfloat16
    assert (got.float() - exact).abs().max().item() <= 0.05 * exact.abs().max().item()


def test_a_sparse_models_rows_are_the_same_batched_as_alone():
    """Tokens of several sequences share the experts' passes: each sequence's logits as computed alone."""
    from nanoinfer.loaders.dummy import dummy_params
    from nanoinfer.model.batch import SeqChunk, build_batch
    from nanoinfer.model.decoder import forward
    from nanoinfer.model.kv_cache import allocate_kv_pool

    cfg = ModelConfig("qwen3_moe", 96, 32, 48, 2, 4, 2, 8, 1e-6, 1e4, 128, False, qk_norm=True, num_experts=6,
                      experts_per_token=2, moe_intermediate_size=16, sparse_layers=(False, True))
    params = dummy_params(cfg, torch.float32, "cpu", seed=3)
    prompts = [[5, 17, 33, 9, 60], [90, 3, 3, 77, 12, 60, 8, 41, 27], [42]]

    def logits(chunks):
        batch = build_batch(chunks, 16)
        return forward(params, allocate_kv_pool(cfg, 8, 16, torch.float32, "cpu"), batch, cfg)

    together = logits([SeqChunk(p, 0, [i], True) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert (together[i] - logits([SeqChunk(p, 0, [0], True)])[0]).abs().max().item() <= 1e-5


QWEN3_MOE_JSON = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=4, num_attention_heads=4, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32)


@pytest.mark.parametrize("fields,sparse", [
    (dict(), (True,) * 4),
    (dict(decoder_sparse_step=2), (False, True, False, True)),  # (transformers: layer i sparse where (i + 1) % step == 0)
    (dict(decoder_sparse_step=1, mlp_only_layers=[0, 3]), (False, True, True, False)),
    (dict(decoder_sparse_step=2, mlp_only_layers=[3]), (False, True, False, False)),
])
def test_qwen3_moe_dense_layers_follow_transformers(fields, sparse):
    from nanoinfer.loaders.hf import config_from_hf

    cfg = config_from_hf({**QWEN3_MOE_JSON, **fields}, "config.json")
    assert cfg.layer_sparse == sparse and cfg.qk_norm and cfg.expert_intermediate_size == 32
    assert cfg.with_layers(2).layer_sparse == sparse[:2]
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in {**QWEN3_MOE_JSON, **fields}.items() if k != "architectures"})
    model = transformers.Qwen3MoeForCausalLM(config)
    assert tuple(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers) == sparse


@pytest.mark.parametrize("fields,message", [
    (dict(architectures=["Qwen2MoeForCausalLM"]), "Qwen2-MoE's shared expert"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 is more than the 8 experts"),
    (dict(mlp_only_layers="all"), "mlp_only_layers is 'all'"),
])
def test_moe_configs_we_cannot_run_are_refused_by_name(fields, message):
    from nanoinfer.errors import CheckpointError
    from nanoinfer.loaders.hf import config_from_hf

    with pytest.raises(CheckpointError, match=message):
        config_from_hf({**QWEN3_MOE_JSON, **fields}, "config.json")


def test_moe_runs_the_cpus_torch_layers():
    """The CPU runs the reference in its torch layers (CUDA its expert kernels: test_a_moe_model_on_cuda_gives_the_
    cpus_tokens). Tensor parallelism splits the experts: tests/test_tensor_parallel.py."""
    from nanoinfer.backends.choose import fused_layers_lack, kernels_for
    from nanoinfer.loaders.hf import config_from_hf

    cfg = config_from_hf(QWEN3_MOE_JSON, "config.json")
    assert "mixture-of-experts MLP is not in the fused layers" in fused_layers_lack(cfg)
    assert type(kernels_for(cfg, torch.device("cpu"), 16).attention).__name__ == "TorchPagedAttention"


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.2)
    transformers.MixtralForCausalLM(config).eval().save_pretrained(path)
    return path


def test_int4_experts_are_refused_by_name(mixtral_dir):
    from nanoinfer.errors import RequestError
    from nanoinfer.loaders import load_model

    with pytest.raises(RequestError, match="quantization='int4' of a mixture-of-experts model"):
        load_model(mixtral_dir, device="cpu", quantization="int4", progress=False)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_int8_and_fp8_experts_stack_per_row_and_keep_the_logits_close(mixtral_dir, quantization, load_format):
    """quantization='int8'/'fp8': each layer's experts an ExpertStack (the dummy loader's made layer by layer), whose
    experts are each an Int8Weight/Fp8Weight of the float expert's rows; the model's logits stay near the float
    model's, as a dense model's do (tests/test_quantized.py's bounds)."""
    from nanoinfer.loaders import load_model
    from nanoinfer.quant.quantized import ExpertStack, Fp8Weight, Int8Weight, dequantize
    from tests.tiny import prefill_logits, relative_rms

    exact = load_model(mixtral_dir, device="cpu", progress=False, load_format=load_format)
    model = load_model(mixtral_dir, device="cpu", progress=False, quantization=quantization, load_format=load_format)
    form = Int8Weight if quantization == "int8" else Fp8Weight
    for lp, float_lp in zip(model.params.layers, exact.params.layers):
        for name in ("gate_up", "down"):
            stack, dense = getattr(lp.moe, name), getattr(float_lp.moe, name)
            assert isinstance(stack, ExpertStack) and stack.shape == tuple(dense.shape)
            assert stack.q.dtype == (torch.int8 if quantization == "int8" else torch.float8_e4m3fn)
            for e in (0, dense.shape[0] - 1):
                want = form.quantize(dense[e], stack.scale.dtype) if form is Int8Weight else form.quantize(dense[e])
                assert isinstance(stack[e], form) and torch.equal(dequantize(stack[e]), dequantize(want))
        assert torch.equal(lp.moe.router, float_lp.moe.router)  # (the router picks the experts: kept as loaded)
    got = prefill_logits(model.params, model.config)
    to_float = relative_rms(got, prefill_logits(exact.params, exact.config))
    # ...and what the quantized stacks' numbers say, in float stacks: up to bf16 activations (int8's CPU kernel)
    as_floats = dataclasses.replace(model.params, layers=tuple(dataclasses.replace(lp, moe=dataclasses.replace(
        lp.moe, gate_up=torch.stack([dequantize(lp.moe.gate_up[e]) for e in range(lp.moe.gate_up.shape[0])]),
        down=torch.stack([dequantize(lp.moe.down[e]) for e in range(lp.moe.down.shape[0])]))) for lp in model.params.layers))
    to_stacks = relative_rms(got, prefill_logits(as_floats, model.config))
    # (measured: int8 0.022-0.034 from the float model and 0.006-0.007 from its stacks' numbers; fp8, whose matmuls
    # round every activation to e4m3 too, 0.19-0.32 and 0.06-0.08: this random model's routes flip more than a
    # dense one's logits move. A scale off by a row or an expert moves them by O(1).)
    assert to_float <= (0.05 if quantization == "int8" else 0.4), to_float
    assert to_stacks <= (0.015 if quantization == "int8" else 0.12), to_stacks


def test_a_bfloat16_moe_model_runs_on_the_cpu(mixtral_dir):
    """dtype='bfloat16' on the CPU through the engine: its prompt logprobs are transformers' bf16 model's with its
    experts' eager loop, within the rounding of the CPU's batched bf16 attention (0.06 here; a flipped route moves
    them by 0.4 or more). (transformers' default grouped_mm experts round otherwise: on this random model their
    bf16 logits sit ~3 from its eager loop's, which ours equal, and from fp32's.)"""
    from nanoinfer.loaders import load_model
    from runtime.engine.engine_core import EngineConfig
    from test_hf_models import prompt_logprob_error

    model = load_model(mixtral_dir, device="cpu", dtype="bfloat16", progress=False)
    assert model.params.layers[0].moe.gate_up.dtype == torch.bfloat16
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.bfloat16).eval()
    hf_model.config._experts_implementation = "eager"
    prompt = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    assert prompt_logprob_error(model, hf_model, prompt, EngineConfig(block_size=4, num_blocks=32)) <= 0.15


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_moe_model_on_cuda_gives_the_cpus_tokens(mixtral_dir):
    """On CUDA (CUDA graphs, nanoinfer/backends/cuda/fused_moe.py's grouped kernels) greedy tokens of the fp32 model
    are the CPU reference's."""
    pytest.importorskip("triton")
    from nanoinfer import LLM, SamplingParams

    prompts = [[5, 9, 17, 33, 2, 71], [100, 3, 3, 8]]
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(mixtral_dir), device=device, dtype="float32", max_model_len=128, progress=False)
        try:
            outs[device] = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
        finally:
            llm.close()
    for cpu, cuda in zip(outs["cpu"], outs["cuda"]):
        assert cuda.outputs[0].token_ids == cpu.outputs[0].token_ids
