"""The deterministic mode on CUDA (issue 65; skipped without CUDA): a row's bits do not depend on its batch.

Each layer of the claim: the batch-invariant linear layer (every weight form: a row of an M-row product equals the
same row's product at any other M), the attention (a query row alone, in chunks, beside a prefill, beside 99 other
decodes, over a wide block table), and the whole engine through `LLM(deterministic=True)`: greedy tokens, their
logprobs and the prompt's logprobs bit-identical whether a request runs alone or among 63 others, chunked at 7 or 64
tokens, preempted (recompute and swap), from the prefix cache, with CUDA graphs or eagerly; seeded sampling too.
The CPU's twins are tests/test_cpu_determinism.py.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

import dataclasses  # noqa: E402
import random  # noqa: E402


from nanoinfer.attention.triton_paged import TritonPagedAttention  # noqa: E402
from nanoinfer.backends.cuda import invariant  # noqa: E402
from nanoinfer.loaders import LoadedModel  # noqa: E402
from nanoinfer.loaders.quantize import quantize_params  # noqa: E402
from nanoinfer.model.batch import SeqChunk, build_batch  # noqa: E402
from nanoinfer.quant import quantized  # noqa: E402
from nanoinfer.sampling.sampler import SamplingParams  # noqa: E402

FORMS = ["bf16", "int8", "fp8", "int4"]


def weight(form: str, n: int, k: int) -> quantized.Weight:
    torch.manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    if form == "bf16":
        return w
    if form == "int8":
        return quantized.Int8Weight.quantize(w, torch.float32)
    if form == "fp8":
        return quantized.Fp8Weight.quantize(w)
    from nanoinfer.loaders.params import device_form
    from nanoinfer.loaders.quantize import int4_groups

    return device_form(int4_groups(w), w.device, w.dtype)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n,k", [(3072, 1024), (1024, 3072), (1000, 1024), (151936, 1024)])
def test_a_row_of_the_invariant_linear_is_the_same_at_every_row_count(form, n, k):
    w = weight(form, n, k)
    x = torch.randn(1100, k, device="cuda", dtype=torch.bfloat16)
    full = invariant.linear(x, w)
    for m in (1, 2, 3, 15, 16, 17, 63, 64, 65, 300, 513, 1099):
        assert torch.equal(invariant.linear(x[:m], w), full[:m]), m
    for i in (0, 5, 700, 1099):  # a row alone, wherever it sat
        assert torch.equal(invariant.linear(x[i:i + 1], w), full[i:i + 1]), i


@pytest.mark.parametrize("form", ["bf16", "int8", "fp8"])
def test_the_products_epilogues_give_the_unfused_kernels_bits(form):
    """SiLU · up and the residual add folded into the deterministic product (invariant.attention_output_and_mlp)
    round as row_kernels' silu_mul and torch's add after the plain product do, at one row and at many."""
    from nanoinfer.backends.cuda.row_kernels import silu_mul

    w = weight(form, 2 * 1536, 1024)
    q, scale = (w, None) if form == "bf16" else (w.q, w.scale)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    for m in (1, 17, 300):
        plain = invariant.tiled_matmul(x[:m], q, scale)
        assert torch.equal(invariant.tiled_matmul(x[:m], q, scale, silu=True), silu_mul(plain)), m
        residual = torch.randn(m, 2 * 1536, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(invariant.tiled_matmul(x[:m], q, scale, residual=residual), residual + plain), m


@pytest.mark.parametrize("group,head_dim", [(2, 128), (4, 128), (1, 64), (8, 256)])
@pytest.mark.parametrize("pool", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_an_attention_row_is_the_same_in_every_step(group, head_dim, pool):
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    kv_heads, block, length = 4, 16, 700
    cfg = tiny_config(num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim)
    kv = torch.randn(2, 600, block, kv_heads, head_dim, device="cuda").to(pool)
    q = torch.randn(length, kv_heads * group, head_dim, device="cuda", dtype=torch.bfloat16)
    attention = TritonPagedAttention(cfg, device="cuda", deterministic=True)

    def attend(chunks, queries):
        return attention.attention(queries.contiguous(), kv, attention.prepare(build_batch(chunks, block, "cuda"),
                                                                               cfg, None))

    table, wide = list(range(44)), list(range(520))  # (520 blocks: past the 8,192 keys of the long prefill tiles)
    last = length - 1
    whole = attend([SeqChunk([0] * length, 0, table, True)], q)
    ways = {
        "prefill, a wide table": attend([SeqChunk([0] * length, 0, wide, True)], q)[last],
        "a 100-token chunk": attend([SeqChunk([0] * 100, 600, table, True)], q[600:])[-1],
        "a 7-token chunk beside a 300-token prefill": attend(
            [SeqChunk([0] * 300, 0, table, True), SeqChunk([0] * 7, last - 6, table, True)],
            torch.cat([q[:300], q[last - 6:]]))[-1],
        "decode alone": attend([SeqChunk([0], last, table, True)], q[last:])[0],
        "decode beside 99 others": attend([SeqChunk([0], last, table, True)] + [SeqChunk([0], 300, table, True)] * 99,
                                          torch.cat([q[last:]] * 100))[0],
        "decode, a wide table": attend([SeqChunk([0], last, wide, True)], q[last:])[0],
    }
    differ = {name: int((row != whole[last]).sum()) for name, row in ways.items()}
    assert not any(differ.values()), differ
    # every row of the whole prefill as a decode step of its own
    for i in (0, 15, 16, 64, 333):
        assert torch.equal(attend([SeqChunk([0], i, table, True)], q[i:i + 1])[0], whole[i]), i


@pytest.fixture(scope="module")
def qwen3_shape(tmp_path_factory):
    """The issue's repro: a Qwen3-0.6B-shaped model (8 of its 28 layers) with random weights saved by transformers
    (`initializer_range` 0.05: near-ties everywhere, so any difference in a row's sums shows in its tokens)."""
    from tests.tiny import qwen3_shaped

    return qwen3_shaped(tmp_path_factory.mktemp("qwen3-shape"), num_layers=8)[1]


def model_of(base: LoadedModel, form: str) -> LoadedModel:
    if form == "bf16":
        return base
    return dataclasses.replace(base, params=quantize_params(base.params, form), quantization=form)


_rng = random.Random(65)
PROMPTS = [[_rng.randrange(100, 150000) for _ in range(n)] for n in (5, 17, 64, 100, 250, 31, 129, 8)]
FILLERS = [[_rng.randrange(100, 150000) for _ in range(_rng.randint(3, 300))] for _ in range(56)]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True, logprobs=1)


def run(model: LoadedModel, prompts, **engine) -> list:
    """(tokens, logprobs, prompt logprobs) of each prompt's greedy and seeded completions, all prompts submitted
    together (with `alone`, one request at a time)."""
    from nanoinfer import LLM

    alone = engine.pop("alone", False)
    with LLM.from_loaded(model, deterministic=True, max_model_len=1024, **engine) as llm:
        params = [GREEDY] * len(prompts) + [SEEDED] * len(prompts)
        everything = [*prompts, *prompts]
        outs = ([llm.generate([p], [s], use_tqdm=False)[0] for p, s in zip(everything, params)] if alone else
                llm.generate(everything, params, use_tqdm=False))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


VARIANTS = {
    "among 63 others": dict(together=FILLERS),
    "chunks of 7": dict(max_num_batched_tokens=7),
    "chunks of 64": dict(max_num_batched_tokens=64),
    "prefix-cached": dict(twice=True),
    "eager": dict(enforce_eager=True),
    "preempted, recompute": dict(together=FILLERS, num_blocks=48, preemption_mode="recompute"),
    "preempted, swap": dict(together=FILLERS, num_blocks=48, preemption_mode="swap", swap_space=1 << 30),
}


@pytest.mark.parametrize("form", FORMS)
def test_a_request_gives_the_same_tokens_and_logprobs_whatever_runs_beside_it(qwen3_shape, form):
    model = model_of(qwen3_shape, form)
    alone = run(model, PROMPTS, alone=True, enable_prefix_caching=False)
    failures = []
    for name, variant in VARIANTS.items():
        engine = dict(variant)
        others, twice = engine.pop("together", []), engine.pop("twice", False)
        prompts = PROMPTS + others
        if twice:
            run(model, PROMPTS)  # (another engine: its cache is not this one's; the same engine below runs twice)
            from nanoinfer import LLM

            with LLM.from_loaded(model, deterministic=True, max_model_len=1024) as llm:
                llm.generate(PROMPTS, [GREEDY] * len(PROMPTS), use_tqdm=False)
                outs = llm.generate(PROMPTS + PROMPTS, [GREEDY] * len(PROMPTS) + [SEEDED] * len(PROMPTS),
                                    use_tqdm=False)
                assert llm.stats()["prefix_cache_hits"] > 0
            got = [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]
        else:
            everything = run(model, prompts, **engine)
            n = len(prompts)
            got = everything[:len(PROMPTS)] + everything[n:n + len(PROMPTS)]
        for i, (a, b) in enumerate(zip(alone, got)):
            if a != b:  # (which part: tokens, their logprobs, the prompt's)
                failures.append(f"{name}: request {i} ({'greedy' if i < len(PROMPTS) else 'seeded'}) differs in "
                                + ", ".join(part for part, x, y in zip(("tokens", "logprobs", "prompt logprobs"), a, b)
                                            if x != y))
    assert not failures, f"{form}: " + "; ".join(failures)


def test_the_setting_reaches_the_kernels_and_a_model_it_cannot_run_is_refused(qwen3_shape):
    """`deterministic` reaches the attention and the layer parts (graphs unless eager); an fp32 model is refused."""
    from nanoinfer.backends.choose import kernels_for

    kernels = kernels_for(qwen3_shape.config, torch.device("cuda"), 16, deterministic=True, params=qwen3_shape.params)
    assert kernels.attention.deterministic and kernels.layer_fns.linear is invariant.linear and kernels.graphs
    assert not kernels_for(qwen3_shape.config, torch.device("cuda"), 16, deterministic=True, eager=True,
                           params=qwen3_shape.params).graphs
    fp32 = dataclasses.replace(qwen3_shape.params, final_norm=qwen3_shape.params.final_norm.float())
    with pytest.raises(ValueError, match="bf16 or fp16"):
        kernels_for(qwen3_shape.config, torch.device("cuda"), 16, deterministic=True, params=fp32)
