"""The packed CPU path computes a token the same way wherever it runs: bit-equal logits whether the
token sits in a prefill chunk of any size, a decode step, a verification row, alone or beside others.

Its matmuls round the activations to int8 per group of 32 (cpu_native.c's block_matmul), so a
last-bit difference between two float routes can move a group's rounding step and then a greedy
token. Here every route is held to bit-equality: the attention kernel alone, a tiny packed model
under every chunking, and the default model through the offline facade (prefix cache, chunked
prefill, batching, speculation), greedy tokens and logprobs.
"""

import shutil

import pytest
import torch

from nanoinfer.backends.cpu import cpu_layers
from nanoinfer.backends.cpu import cpu_native
from nanoinfer.attention.reference import REFERENCE
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.backends.choose import kernels_for
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders.quantize import quantize_params
from nanoinfer.model.decoder import forward
from nanoinfer.quant.quantized import BlockWeight
from nanoinfer.sampling.sampling_params import SamplingParams
from tests.test_cpu_native import block_params
from tests.tiny import random_params, tiny_config


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler here: the CPU path stays in torch ops")
    lib = cpu_native.load(tmp_path_factory.mktemp("native"))
    assert lib is not None, "a C compiler is on PATH but cpu_native.c did not build"
    if not cpu_native.has_block_matmul(lib):
        pytest.skip("no SIMD group dot product on this CPU (the packed path needs x86 AVX2)")
    return cpu_native.CpuNative(lib)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- attention alone -------------------------------------------------------------------------


def attend(native, q, pool, chunks, block, cfg, window):
    backend = cpu_layers.NativeAttention(block, native)
    batch = build_batch(chunks, block)
    return backend.attention(q, pool, backend.prepare(batch, cfg, window)), batch


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (4, 4, 8)])
def test_a_query_row_attends_the_same_in_any_batch(native, window, heads, kv_heads, head_dim):
    """Rows of a 13-token chunk, the same rows as decodes one at a time, and the chunk beside
    other sequences (blocks out of order): bit-equal, and the reference's to fp32 rounding."""
    cfg = tiny_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    block, tokens = 4, 13
    pool = randn(2, 12, block, kv_heads, head_dim, seed=6)
    blocks = [7, 2, 9, 0]
    q = randn(tokens, heads, head_dim, seed=7)
    whole, batch = attend(native, q, pool, [SeqChunk(list(range(tokens)), 0, blocks, True)], block, cfg, window)
    want = REFERENCE.attention(q, pool, REFERENCE.prepare(batch, cfg, window))
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)
    one_by_one = torch.cat([attend(native, q[i:i + 1], pool, [SeqChunk([i], i, blocks, True)], block, cfg, window)[0]
                            for i in range(tokens)])
    assert torch.equal(whole, one_by_one)
    # sevens, and the chunk between a decode and a prefill of other sequences
    sevens = torch.cat([attend(native, q[i:i + 7], pool, [SeqChunk(list(range(i, min(i + 7, tokens))), i, blocks,
                                                                   True)], block, cfg, window)[0]
                        for i in range(0, tokens, 7)])
    assert torch.equal(whole, sevens)
    others = [SeqChunk([1], 8, [3, 10, 5], True), SeqChunk([1, 2, 3], 2, [11, 1], True)]
    beside = torch.cat((randn(1, heads, head_dim, seed=8), q, randn(3, heads, head_dim, seed=9)))
    out, _ = attend(native, beside, pool, [others[0], SeqChunk(list(range(tokens)), 0, blocks, True), others[1]], block,
                    cfg, window)
    assert torch.equal(out[1:1 + tokens], whole)


# -- a tiny packed model ---------------------------------------------------------------------


def run_steps(params, cfg, steps, block=4, blocks=8):
    """Logits of every token of each sequence, the steps given as lists of (seq, start, end)
    chunks of `seqs`' tokens; sequence s owns blocks [s * 4, s * 4 + 4)."""
    kernels = kernels_for(cfg, torch.device("cpu"), block, params=params)
    assert isinstance(kernels.attention, cpu_layers.NativeAttention)
    kv = allocate_kv_pool(cfg, blocks, block, torch.float32, "cpu")
    logits = {}
    for step in steps:
        chunks = [SeqChunk(SEQS[s][a:b], a, list(range(4 * s, 4 * s + 4)), True) for s, a, b in step]
        batch = build_batch(chunks, block)
        batch = batch._replace(logits_indices=torch.arange(batch.num_tokens))
        out = forward(params, kv, batch, cfg, kernels.attention, kernels.layer_fns)
        row = 0
        for s, a, b in step:
            for t in range(a, b):
                logits[s, t] = out[row]
                row += 1
    return logits


SEQS = [[5, 20, 33, 9, 60, 64, 1, 17, 8, 41, 2, 2, 50, 12, 3], [7, 7, 30, 44, 9, 1, 61, 13, 26, 5, 40, 38]]


@pytest.mark.parametrize("form", ["blocks", "int8"])
@pytest.mark.parametrize("arch", [dict(), dict(architecture="qwen3", qk_norm=True), dict(sliding_window=3)],
                         ids=["llama", "qwen3", "window"])
def test_a_token_scores_the_same_in_any_chunking(native, arch, form):
    """Each sequence whole, in sevens, prefill then decodes (and several rows at once, as a
    verification), and both sequences interleaved in one batch: bit-equal logits per token,
    with block matmuls (int8 activations) or torch's per-row int8 kernel."""
    cfg = tiny_config(intermediate_size=64, **arch)
    dense = random_params(cfg, seed=3)
    params = block_params(dense) if form == "blocks" else quantize_params(dense, "int8")
    n0, n1 = len(SEQS[0]), len(SEQS[1])
    alone = run_steps(params, cfg, [[(0, 0, n0)], [(1, 0, n1)]])
    variants = {
        "sevens": [[(0, a, min(a + 7, n0))] for a in range(0, n0, 7)]
                  + [[(1, a, min(a + 7, n1))] for a in range(0, n1, 7)],
        "decodes": [[(0, 0, 4)]] + [[(0, t, t + 1)] for t in range(4, n0)] + [[(1, 0, 1)]]
                   + [[(1, t, t + 1)] for t in range(1, n1)],
        "verify": [[(0, 0, 3), (1, 0, 5)], [(0, 3, 8), (1, 5, 6)], [(0, 8, 9), (1, 6, 10)], [(1, 10, n1), (0, 9, n0)]],
    }
    for name, steps in variants.items():
        got = run_steps(params, cfg, steps)
        assert got.keys() == alone.keys()
        differ = [key for key in alone if not torch.equal(got[key], alone[key])]
        assert not differ, f"{name}: tokens {differ} score otherwise than in one prefill"


# -- the default model through the offline facade --------------------------------------------

PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
           "Names: Alice, Bob, Carol, Dave, Erin, Frank, Grace, Heidi, Ivan, Judy, Mallory, Niaj, Olivia, Peggy, "
           "Rupert, Sybil, Trent, Victor, Walter. Their initials: A, B, C, D, E, F, G, H, I, J, M, N, O, P, R, S, T, "
           "V, W. The names again: Alice, Bob,"]  # (longer than a chunk of 64)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def outputs(llm, prompts, together=True):
    """(token ids, logprobs) per prompt, generated in one call or one prompt at a time."""
    outs = llm.generate(prompts, GREEDY, use_tqdm=False) if together else [
        llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def default_model(smollm2_gguf):
    from nanoinfer.loaders import load_model

    model = load_model(smollm2_gguf, device="cpu", progress=False)
    if not isinstance(model.params.layers[0].qkv_proj, BlockWeight):
        pytest.skip("the packed path's block matmuls did not build here")
    return model


@pytest.fixture(scope="module")
def alone(default_model):
    """The reference: each prompt alone, no prefix cache, one prefill chunk."""
    from nanoinfer import LLM

    with LLM.from_loaded(default_model, enable_prefix_caching=False) as llm:
        return outputs(llm, PROMPTS, together=False)


@pytest.mark.slow
def test_default_model_a_request_twice_gives_the_same_tokens_and_logprobs(default_model, alone):
    """The second run reuses the first's prompt blocks from the prefix cache."""
    from nanoinfer import LLM

    with LLM.from_loaded(default_model) as llm:
        first = outputs(llm, PROMPTS[:1])
        second = outputs(llm, PROMPTS[:1])
        assert llm.stats()["prefix_cache_hits"] > 0
    assert first == second == alone[:1]


@pytest.mark.slow
@pytest.mark.parametrize("engine", [dict(max_num_batched_tokens=7), dict(max_num_batched_tokens=64),
                                    dict(max_num_batched_tokens=512), dict()],
                         ids=["chunks-of-7", "chunks-of-64", "chunks-of-512", "batched"])
def test_default_model_chunked_or_batched_gives_the_same_tokens_and_logprobs(default_model, alone, engine):
    from nanoinfer import LLM

    with LLM.from_loaded(default_model, **engine) as llm:
        assert outputs(llm, PROMPTS) == alone


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_default_model_speculation_gives_the_same_tokens_and_logprobs(default_model, alone, smollm2_gguf, method):
    from nanoinfer import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False} if method == "ngram" else {
        "model": str(smollm2_gguf), "num_speculative_tokens": 3, "adaptive": False}
    with LLM.from_loaded(default_model, speculative_config=spec) as llm:
        assert outputs(llm, PROMPTS, together=False) == alone
        assert llm.stats()["spec_accepted_tokens"] > 0
