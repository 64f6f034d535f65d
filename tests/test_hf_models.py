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
]
# What each case's engine is given: Phi-3's context within its original one (the short factors, as transformers
# uses them for such sequences).
ENGINE_ARGS = {"phi3-gqa2-longrope-window": dict(max_model_len=128)}
SHARDED = {"mistral-gqa4-window", "qwen3-gqa4-qknorm"}  # saved as an index + several shards


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def checkpoint(request, tmp_path_factory):
    name, config_cls, fields = request.param
    torch.manual_seed(0)
    hf_config = config_cls(**COMMON, **fields)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa").eval()
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
    engine = EngineCore(model, EngineConfig(block_size=4, num_blocks=64))  # (context 256: past 128)
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    while engine.has_unfinished():
        engine.step()
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    got = [lp.logprob for lp in seq.prompt_logprobs[1:]]
    want = [expected[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert max(abs(g - w) for g, w in zip(got, want)) <= 1e-4


@pytest.mark.parametrize("fields,message", [
    (dict(partial_rotary_factor=0.75), "partial_rotary_factor 0.75 is not supported"),
    (dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 3, long_factor=[1.0] * 8),
          original_max_position_embeddings=128), "short_factor has 3 entries: expected head_dim / 2 = 8"),
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
