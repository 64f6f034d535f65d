"""Tiny random HF checkpoints of every supported architecture, saved with transformers and
loaded by our loader, against transformers itself: logits and greedy continuations."""

import pytest
import torch
import transformers

from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.errors import CheckpointError
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders import LoadedModel
from nanoinfer.loaders.hf import config_from_hf, load_hf_params, read_hf_config
from nanoinfer.model.decoder import forward
from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine.engine_core import EngineConfig, EngineCore
from runtime.engine_config import SchedulerConfig

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
              initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)

# (name, config class, fields): GQA ratios 1, 2, 4; tied and untied; llama3 rope scaling;
# Qwen2's QKV bias, Qwen3's q/k norm and a head_dim that is not hidden/heads; Mistral's window.
CASES = [
    ("llama-mha-untied", transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4,
                                                        tie_word_embeddings=False)),
    ("llama-gqa2-tied-llama3rope", transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32))),
    ("mistral-gqa4-window", transformers.MistralConfig, dict(num_attention_heads=8, num_key_value_heads=2,
                                                             sliding_window=16, tie_word_embeddings=False)),
    ("qwen2-gqa2-bias-tied", transformers.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2,
                                                            tie_word_embeddings=True)),
    ("qwen3-gqa4-qknorm", transformers.Qwen3Config, dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                                         tie_word_embeddings=False)),
    # Qwen windows only the layers from max_window_layers on (here layer 1 of 2), or those an
    # explicit layer_types names (here layer 0, against what max_window_layers would say).
    ("qwen2-window-layer1", transformers.Qwen2Config, dict(num_attention_heads=4, num_key_value_heads=2,
                                                           tie_word_embeddings=True, **QWEN_WINDOW)),
    ("qwen3-window-layer1", transformers.Qwen3Config, dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                                           tie_word_embeddings=False, **QWEN_WINDOW)),
    ("qwen2-window-explicit-layer0", transformers.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, **QWEN_WINDOW,
        layer_types=["sliding_attention", "full_attention"])),
    # Phi-3: fused qkv and gate/up matrices, longrope (its attention factor from 256 / 128 positions) and a
    # window over every layer. Its short factors serve contexts within 128 positions (the engines below).
    ("phi3-gqa2-longrope-window", transformers.Phi3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=24,
        original_max_position_embeddings=128, rope_scaling=dict(
            rope_type="longrope", short_factor=[1.0 + 0.25 * i for i in range(8)],
            long_factor=[1.5 + 0.5 * i for i in range(8)]))),
    # Phi-4-mini: RoPE over the first 3/4 of each head (12 of 16 dimensions), longrope's factors for those 6 pairs.
    ("phi4mini-partial-rotary", transformers.Phi3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, partial_rotary_factor=0.75,
        original_max_position_embeddings=128, rope_scaling=dict(
            rope_type="longrope", short_factor=[1.0 + 0.25 * i for i in range(6)],
            long_factor=[1.5 + 0.5 * i for i in range(6)]))),
    # Gemma 2: soft-capped attention scores and logits (caps small enough to bend these models' values), attention
    # scaled by query_pre_attn_scalar, layer 0 windowed and layer 1 global (transformers' default alternation).
    ("gemma2-gqa2-softcap-window", transformers.Gemma2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    # Gemma 3: q/k norms, the windowed layer's RoPE base of its own, the global layer's linear scaling, soft-capped
    # logits, untied.
    ("gemma3-gqa2-qknorm-localrope", transformers.Gemma3TextConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        final_logit_softcapping=8.0, tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Mixtral: top-2 of 8 experts, renormalized, every layer sparse; a window over every layer.
    ("mixtral-gqa2-top2of8-window", transformers.MixtralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
        tie_word_embeddings=False)),
    # Qwen3-MoE: q/k norms, experts of their own width; top-3 of 6 not renormalized with layer 0 dense
    # (mlp_only_layers), and top-2 of 4 renormalized over every layer, tied.
    ("qwen3moe-top3of6-dense-layer0", transformers.Qwen3MoeConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=False)),
    ("qwen3moe-top2of4-normalized-tied", transformers.Qwen3MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True, tie_word_embeddings=True)),
]
# What each case's engine is given: Phi-3's context within its original one (the short factors, as transformers
# uses them for such sequences).
ENGINE_ARGS = {"phi3-gqa2-longrope-window": dict(max_model_len=128), "phi4mini-partial-rotary": dict(max_model_len=128)}
SHARDED = {"mistral-gqa4-window", "qwen3-gqa4-qknorm", "mixtral-gqa2-top2of8-window"}  # an index + several shards


def random_model(name: str, config_cls, fields: dict, seed: int = 0) -> transformers.PreTrainedModel:
    """transformers' model of a case, its weights random. Gemma's norms (zeros: 1 + w) made random too, so a lost
    +1 or a swapped norm shows; Gemma 2 runs transformers' eager attention (its SDPA has no soft-capping)."""
    torch.manual_seed(seed)
    gemma = name.startswith("gemma")
    hf_model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**COMMON, **fields), attn_implementation="eager" if gemma else "sdpa").eval()
    with torch.no_grad():
        for key, p in hf_model.named_parameters():
            if gemma and key.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return hf_model


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def checkpoint(request, tmp_path_factory):
    name, config_cls, fields = request.param
    hf_model = random_model(name, config_cls, fields)
    path = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(path, max_shard_size="100KB" if name in SHARDED else "50MB")
    assert (path / "model.safetensors.index.json").exists() == (name in SHARDED)
    cfg = read_hf_config(path)
    params = load_hf_params(path, cfg, torch.float32, "cpu", progress=False)
    return hf_model, LoadedModel(cfg, params, None, path), ENGINE_ARGS.get(name, {})


def our_logits(model: LoadedModel, tokens: list[int]) -> torch.Tensor:
    cfg = model.config
    kv = allocate_kv_pool(cfg, 8, 16, torch.float32, "cpu")
    batch = build_batch([SeqChunk(tokens, 0, list(range(-(-len(tokens) // 16))), True)], 16)
    batch = batch._replace(logits_indices=torch.arange(len(tokens)))
    return forward(model.params, kv, batch, cfg)


@pytest.mark.parametrize("length", [1, 5, 17, 50])
def test_logits_match_transformers(checkpoint, length):
    hf_model, model, _ = checkpoint
    tokens = torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    got = our_logits(model, tokens)
    assert (got - expected).abs().max().item() <= 1e-4


def test_greedy_continuation_matches_transformers_generate(checkpoint):
    hf_model, model, engine_args = checkpoint
    prompts = [[5, 17, 33, 9], [100, 3, 3, 77, 12, 60, 8, 41, 27, 90, 14]]
    engine = EngineCore(model, EngineConfig(block_size=4, num_blocks=64, **engine_args))
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    for prompt, seq in zip(prompts, seqs):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        assert seq.output_token_ids == expected.tolist()
        assert seq.finish_reason == "length"
    assert engine.scheduler.blocks.num_free_blocks == 64


def test_prompt_logprobs_match_transformers(checkpoint):
    """A 40-token prompt's logprobs through the engine (the CPU's batched attention and fused RoPE + KV write,
    prefilled 16 tokens a step) against transformers': past the windows, Gemma's soft-caps bending them."""
    hf_model, model, engine_args = checkpoint
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    config = EngineConfig(block_size=4, num_blocks=64, scheduler=SchedulerConfig(max_num_batched_tokens=16),
                          **engine_args)
    assert prompt_logprob_error(model, hf_model, prompt, config) <= 1e-4


def prompt_logprob_error(model: LoadedModel, hf_model, prompt: list[int], config: EngineConfig) -> float:
    """The largest |our prompt logprob - transformers'| over `prompt`, ours through an engine of `config`."""
    engine = EngineCore(model, config)
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    while engine.has_unfinished():
        engine.step()
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    got = [lp.logprob for lp in seq.prompt_logprobs[1:]]
    want = [expected[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    return max(abs(g - w) for g, w in zip(got, want))


QWEN_JSON = dict(architectures=["Qwen2ForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=96,
                 num_hidden_layers=4, num_attention_heads=4, sliding_window=8, max_window_layers=2)


@pytest.mark.parametrize("fields,windows", [
    (dict(), (None,) * 4),  # Qwen carries a window it does not use unless asked
    (dict(use_sliding_window=True), (None, None, 8, 8)),  # a config.json from before layer_types
    (dict(use_sliding_window=True, max_window_layers=0), (8,) * 4),
    (dict(use_sliding_window=True, layer_types=["sliding_attention", "full_attention"] * 2), (8, None, 8, None)),
    (dict(use_sliding_window=True, max_window_layers=4), (None,) * 4),
    (dict(architectures=["MistralForCausalLM"], max_window_layers=None), (8,) * 4),  # every layer
    (dict(architectures=["LlamaForCausalLM"], max_window_layers=None), (None,) * 4),  # Llama has no window
])
def test_layer_windows_follow_transformers(fields, windows):
    cfg = config_from_hf({**QWEN_JSON, **fields}, "config.json")
    assert cfg.layer_windows == windows
    assert cfg.sliding_window == (8 if 8 in windows else None)
    assert cfg.with_layers(3).layer_windows == windows[:3]


@pytest.mark.parametrize("layer_types,problem", [(["full_attention"] * 3, "4 layers"),
                                                 (["chunked_attention"] * 4, "chunked_attention")])
def test_bad_layer_types_are_a_checkpoint_error(layer_types, problem):
    with pytest.raises(CheckpointError, match=problem):
        config_from_hf({**QWEN_JSON, "use_sliding_window": True, "layer_types": layer_types}, "config.json")


def test_phi3_past_its_original_context_uses_the_long_factors(tmp_path):
    """Longrope's long factors serve an engine whose context passes the original one: a 150-token prompt's
    logits (positions past 128) as transformers computes them for a sequence that long (its long factors;
    the attention factor of 256 / 128 positions in both)."""
    name, config_cls, fields = next(c for c in CASES if c[0].startswith("phi3"))
    torch.manual_seed(1)
    hf_model = transformers.AutoModelForCausalLM.from_config(config_cls(**COMMON, **fields),
                                                             attn_implementation="sdpa").eval()
    hf_model.save_pretrained(tmp_path)
    cfg = read_hf_config(tmp_path)
    assert cfg.rope_scaling.kind == "longrope" and cfg.rope_scaling.attention_factor == pytest.approx((1 + 1 / 7) ** 0.5)  # ln 2 / ln 128
    model = LoadedModel(cfg, load_hf_params(tmp_path, cfg, torch.float32, "cpu", progress=False), None, tmp_path)
    prompt = torch.randint(3, 128, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    # (context 256: past 128)
    assert prompt_logprob_error(model, hf_model, prompt, EngineConfig(block_size=4, num_blocks=64)) <= 1e-4


@pytest.mark.parametrize("fields,message", [
    (dict(partial_rotary_factor=0.1), "partial_rotary_factor 0.1 gives a rotated width of 1 of head_dim 16"),
    (dict(partial_rotary_factor=1.5), "partial_rotary_factor 1.5 gives a rotated width of 0"),
    (dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 3, long_factor=[1.0] * 8),
          original_max_position_embeddings=128), "short_factor has 3 entries: expected the rotated dimensions / 2 = 8"),
    (dict(partial_rotary_factor=0.5, rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8,
                                                       long_factor=[1.0] * 8), original_max_position_embeddings=128),
     "short_factor has 8 entries: expected the rotated dimensions / 2 = 4"),
    (dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 8),
          original_max_position_embeddings=1), "original_max_position_embeddings=1 is too small"),
])
def test_phi3_configs_we_cannot_run_are_refused_by_name(fields, message):
    raw = dict(architectures=["Phi3ForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256, **fields)
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(raw, "config.json")


def test_an_fp8_phi3_checkpoint_is_refused_by_name(tmp_path):
    """Phi-3's fused matrices in fp8 (their scales beside the fused name, not the parts'): one line naming them,
    not a KeyError."""
    from safetensors.torch import save_file

    name, config_cls, fields = next(c for c in CASES if c[0].startswith("phi3"))
    hf_model = transformers.AutoModelForCausalLM.from_config(config_cls(**COMMON, **fields))
    hf_model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    for key in [k for k in state if k.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        state[key] = state[key].to(torch.float8_e4m3fn)
        state[key + "_scale"] = torch.ones(1)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="Phi-3's fused matrices in float8_e4m3fn are not supported"):
        load_hf_params(tmp_path, read_hf_config(tmp_path), torch.float32, "cpu", progress=False)


def test_a_gemma3_multimodal_directory_loads_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration directory (a vision tower beside the language model): its text_config and
    its language_model. tensors, and text-only logits as transformers' multimodal model gives them."""
    from nanoinfer.loaders import load_model

    name, _, fields = next(c for c in CASES if c[0].startswith("gemma3"))
    # (no final soft-capping: transformers' multimodal model leaves it out, as real Gemma 3 checkpoints have none)
    text = random_model(name, transformers.Gemma3TextConfig, {**fields, "final_logit_softcapping": None})
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text.config.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                                       tie_word_embeddings=False)  # (the whole model's setting decides)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    hf_model.model.language_model.load_state_dict(text.model.state_dict())
    hf_model.lm_head.load_state_dict(text.lm_head.state_dict())
    hf_model.save_pretrained(tmp_path)
    model = load_model(tmp_path, device="cpu", dtype="float32", progress=False)
    assert model.config.architecture == "gemma3" and model.config.rope_local_theta == 10000.0
    tokens = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor([tokens])).logits[0]
    assert (our_logits(model, tokens) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("fields,message", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention is not supported"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "scaling of the windowed layers' RoPE is not supported"),
])
def test_gemma3_configs_we_cannot_run_are_refused_by_name(fields, message):
    raw = dict(architectures=["Gemma3ForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, head_dim=16, **fields)
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(raw, "config.json")


@pytest.mark.parametrize("arch,feature", [("Gemma2ForCausalLM", "attention logit soft-capping"),
                                          ("Gemma3ForCausalLM", "sandwich norms and GeGLU MLP")])
def test_what_the_fused_layers_lack_of_gemma_is_named(arch, feature):
    """The CPU's packed C layers (and CUDA's batch-invariant parts) lack Gemma's soft-capping and sandwich norms,
    named in one line: on the CPU Gemma runs its layers' torch parts with its torch attention (CUDA's own layer
    parts take both: tests/test_row_kernels.py, tests/test_gpu.py)."""
    from nanoinfer.backends.choose import fused_layers_lack, kernels_for

    cfg = config_from_hf(dict(architectures=[arch], vocab_size=128, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, head_dim=16), "config.json")
    assert feature in fused_layers_lack(cfg)
    assert type(kernels_for(cfg, torch.device("cpu"), 16).attention).__name__ == "TorchPagedAttention"
