"""Real weights: the default model's GGUF (SmolLM2-135M-Instruct, Q4_1) against transformers
loading the same file — logits and greedy tokens, cut to a few layers and whole."""

import dataclasses

import pytest
import torch
import transformers

from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders import LoadedModel
from nanoinfer.loaders.gguf import gguf_config, load_gguf_params, open_gguf
from nanoinfer.model.decoder import forward
from nanoinfer.sampling.sampler import SamplingParams
from runtime.engine.engine_core import EngineConfig, EngineCore

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253],  # short, starts with <|im_start|>
    list(range(100, 160)),  # 60 tokens: several KV blocks
    [504, 3575, 282, 4649, 314],  # "The capital of France is"
]


@pytest.fixture(scope="module")
def models(smollm2_gguf):
    reader = open_gguf(smollm2_gguf)
    cfg = gguf_config(reader, smollm2_gguf)
    ours = LoadedModel(cfg, load_gguf_params(reader, cfg, torch.float32, "cpu", smollm2_gguf, progress=False),
                       None, smollm2_gguf)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    return ours, theirs


def truncated(models, num_layers):
    ours, theirs = models
    if num_layers is None:
        return ours, theirs
    cut = LoadedModel(ours.config.with_layers(num_layers),
                      dataclasses.replace(ours.params, layers=ours.params.layers[:num_layers]), None, ours.path)
    hf_config = theirs.config.__class__(**{**theirs.config.to_dict(), "num_hidden_layers": num_layers})
    hf_cut = transformers.LlamaForCausalLM(hf_config)
    missing, unexpected = hf_cut.load_state_dict(theirs.state_dict(), strict=False)
    assert not missing and all(k.startswith("model.layers.") for k in unexpected)
    return cut, hf_cut.eval()


@pytest.mark.slow
@pytest.mark.parametrize("num_layers", [3, None], ids=["first-3-layers", "full-model"])
def test_logits_match_transformers(models, num_layers):
    ours, theirs = truncated(models, num_layers)
    for tokens in PROMPTS:
        kv = allocate_kv_pool(ours.config, 8, 16, torch.float32, "cpu")
        batch = build_batch([SeqChunk(tokens, 0, [7, 2, 5, 0], True)], 16)
        got = forward(ours.params, kv, batch._replace(logits_indices=torch.arange(len(tokens))), ours.config)
        with torch.no_grad():
            expected = theirs(torch.tensor([tokens])).logits[0]
        assert (got - expected).abs().max().item() <= 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("num_layers", [3, None], ids=["first-3-layers", "full-model"])
def test_greedy_tokens_match_transformers(models, num_layers):
    ours, theirs = truncated(models, num_layers)
    engine = EngineCore(ours, EngineConfig(block_size=16, num_blocks=32))
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    for prompt, seq in zip(PROMPTS, seqs):
        with torch.no_grad():
            expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                       eos_token_id=None, pad_token_id=2)[0, len(prompt):]
        assert seq.output_token_ids == expected.tolist()
