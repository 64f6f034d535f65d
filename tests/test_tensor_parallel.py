"""Tensor parallelism's sharded forward: two gloo ranks, each with its shard of the weights and
its own KV pool, give the logits of the whole model (fp32), through prefill and decode, for
Llama, Qwen2 (QKV bias) and Qwen3 (q/k norm) tiny configs, with fewer KV heads than ranks,
KV heads the ranks do not divide, tied embeddings and a vocabulary the ranks do not divide;
with quantized weights (per-row int8; GGUF groups packed for the CPU), as close to the exact
model as one rank is; and for the default model, exact and packed."""

import dataclasses
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nanoinfer.attention.reference import REFERENCE
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.backends.choose import kernels_for
from nanoinfer.errors import RequestError
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders.quantize import PROJECTIONS, quantize_params
from nanoinfer.model.decoder import EAGER, forward
from nanoinfer.quant.quantized import BlockWeight, dequantize
from nanoinfer.parallel.shards import Shard, all_reduce, layer_functions, shard_config, shard_params
from tests.tiny import grouped, random_params, tiny_config

CASES = {
    "llama": dict(),
    "llama-one-kv-head": dict(num_kv_heads=1),  # each rank holds the one KV head
    "llama-three-kv-heads": dict(num_heads=9, num_kv_heads=3),  # (the default model's heads) split 1 + 2
    "qwen2-bias": dict(architecture="qwen2", qkv_bias=True),
    "qwen3-qk-norm-tied": dict(architecture="qwen3", qk_norm=True, tie_word_embeddings=True),
    # Quantized weights, in shapes whose heads and units span whole groups of 32:
    "llama-int8": dict(hidden_size=64, head_dim=32, intermediate_size=128),  # per-row int8
    "qwen2-gguf-q8-blocks": dict(architecture="qwen2", qkv_bias=True, hidden_size=64, head_dim=32,
                                 intermediate_size=128),  # GGUF groups, the CPU's packed blocks
}
BS = 4
DENSE = [name for name in CASES if not name.endswith(("int8", "blocks"))]
NATIVE = [name for name in CASES if name.endswith("blocks")]


def steps(cfg, params, kv, layer_fns=EAGER, backend=REFERENCE):
    """A prefill of two prompts (5 and 7 tokens), then two decode steps: every logits row."""
    tables = [[0, 1, 2], [3, 4, 5]]
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26]]
    out = []
    batch = build_batch([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables)], BS)
    logits = forward(params, kv, batch, cfg, backend, layer_fns)
    out.append(logits)
    lens = [len(p) for p in prompts]
    for nxt in ([7, 8], [9, 10]):  # (fixed tokens: a near-tie argmax would otherwise fork the runs)
        batch = build_batch([SeqChunk([t], n, table, True) for t, n, table in zip(nxt, lens, tables)], BS)
        logits = forward(params, kv, batch, cfg, backend, layer_fns)
        out.append(logits)
        lens = [n + 1 for n in lens]
    return torch.cat(out)


def dequantized(params):
    """The exact model a quantized one stands for: every weight dequantized, fp32."""
    layers = tuple(dataclasses.replace(lp, **{n: dequantize(getattr(lp, n)) for n in PROJECTIONS})
                   for lp in params.layers)
    return dataclasses.replace(params, layers=layers, embed=dequantize(params.embed), lm_head=dequantize(params.lm_head))


def model(name):
    cfg = tiny_config(**CASES[name])
    params = random_params(cfg, seed=5)
    if name.endswith("int8"):
        params = quantize_params(params, "int8")
    elif name.endswith("blocks"):  # as a Q8_0 GGUF loads on the CPU: grouped embedding, packed matrices
        def blocks(w):
            return BlockWeight.from_groups(grouped(w, 8))

        layers = tuple(dataclasses.replace(lp, **{n: blocks(getattr(lp, n)) for n in PROJECTIONS})
                       for lp in params.layers)
        params = dataclasses.replace(params, layers=layers, embed=grouped(params.embed, 8),
                                     lm_head=blocks(params.lm_head))
    return cfg, params


def _rank(rank: int, size: int, init_file: str, results, moe: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        for name in MOE_CASES if moe else CASES:
            cfg, params = moe_model(name) if moe else model(name)
            local = shard_config(cfg, rank, size)
            kv = allocate_kv_pool(local, 8, BS, torch.float32, "cpu")
            logits = steps(local, shard_params(params, cfg, rank, size), kv,
                           layer_functions(EAGER, Shard(rank, size), cfg.vocab_size))
            if rank == 0:  # (by value: a shared tensor's memory goes with this process, which may exit first)
                results.put((name, logits.float().numpy()))
            if name in NATIVE:  # the CPU's fused packed layers (cpu_layers), as the engine runs them
                sharded = shard_params(params, cfg, rank, size)
                kernels = kernels_for(local, torch.device("cpu"), BS, params=sharded)
                logits = steps(local, sharded, allocate_kv_pool(local, 8, BS, torch.float32, "cpu"),
                               layer_functions(kernels.layer_fns, Shard(rank, size), cfg.vocab_size), kernels.attention)
                if rank == 0:
                    results.put((name + "-native", logits.float().numpy()))
    finally:
        dist.destroy_process_group()


def test_two_ranks_compute_the_whole_models_logits(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "rendezvous"), results)) for r in range(2)]
    for p in ranks:
        p.start()
    got = {name: torch.from_numpy(logits) for name, logits in (results.get(timeout=120)
                                                               for _ in range(len(CASES) + len(NATIVE)))}
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0
    for name in CASES:
        cfg, params = model(name)
        ref = steps(cfg, params, allocate_kv_pool(cfg, 8, BS, torch.float32, "cpu"))
        assert got[name].shape == ref.shape
        if name in DENSE:
            assert torch.allclose(got[name], ref, atol=1e-5, rtol=1e-5), name
            assert torch.equal(got[name].argmax(-1), ref.argmax(-1))
            continue
        # Quantized kernels sum in fp32 and round each rank's partial sum to bf16: two ranks are
        # as close to the exact model (its weights dequantized, fp32) as one is.
        exact = steps(cfg, dequantized(params), allocate_kv_pool(cfg, 8, BS, torch.float32, "cpu"))
        one, two = (ref - exact).abs().max().item(), (got[name] - exact).abs().max().item()
        assert 0 < two <= 2 * one, name
    for name in NATIVE:  # the fused layers: their partial outputs summed in fp32, as the eager ones'
        cfg, params = model(name)
        kernels = kernels_for(cfg, torch.device("cpu"), BS, params=params)
        ref = steps(cfg, params, allocate_kv_pool(cfg, 8, BS, torch.float32, "cpu"), kernels.layer_fns,
                    kernels.attention)
        exact = steps(cfg, dequantized(params), allocate_kv_pool(cfg, 8, BS, torch.float32, "cpu"))
        one, two = (ref - exact).abs().max().item(), (got[name + "-native"] - exact).abs().max().item()
        assert 0 < two <= 2 * one, name


def moe_model(name: str):
    """A tiny Qwen3-MoE (a dense layer, a sparse one), float or with int8 experts."""
    from nanoinfer.loaders.dummy import dummy_params
    from nanoinfer.loaders.hf import config_from_hf

    cfg = config_from_hf(dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=97, hidden_size=64,
                              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64,
                              mlp_only_layers=[0], max_position_embeddings=512), "config.json")
    params = dummy_params(cfg, torch.float32, "cpu", seed=3)
    return cfg, quantize_params(params, "int8") if name.endswith("int8") else params


MOE_CASES = ("qwen3-moe", "qwen3-moe-int8")


def test_two_ranks_split_the_experts_inner_units_and_compute_the_whole_models_logits(tmp_path):
    """A mixture-of-experts model over two ranks: each expert's inner units split as a dense MLP's, the router
    whole on each rank; float experts give one rank's logits (fp32), int8 ones are as close to the exact model
    (their stacks' numbers in fp32) as one rank is."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "rendezvous"), results, True)) for r in range(2)]
    for p in ranks:
        p.start()
    got = {name: torch.from_numpy(logits) for name, logits in (results.get(timeout=120) for _ in MOE_CASES)}
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0
    cfg, params = moe_model("qwen3-moe")
    local = shard_config(cfg, 1, 2)
    assert (local.moe_intermediate_size, local.intermediate_size, local.num_experts) == (32, 48, 6)
    part = shard_params(params, cfg, 1, 2).layers[1].moe
    assert part.gate_up.shape == (6, 64, 64) and part.down.shape == (6, 64, 32)
    assert torch.equal(part.gate_up[4], torch.cat([params.layers[1].moe.gate_up[4][32:64],
                                                   params.layers[1].moe.gate_up[4][96:128]]))
    ref = steps(cfg, params, allocate_kv_pool(cfg, 8, BS, torch.float32, "cpu"))
    assert torch.allclose(got["qwen3-moe"], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got["qwen3-moe"].argmax(-1), ref.argmax(-1))
    cfg, params = moe_model("qwen3-moe-int8")
    part = shard_params(params, cfg, 0, 2).layers[1].moe.down
    assert part.q.dtype == torch.int8 and part.q.shape == (6, 64, 32) and torch.equal(
        part.scale, params.layers[1].moe.down.scale)  # (row scales whole: a rank holds columns)
    one = steps(cfg, params, allocate_kv_pool(cfg, 8, BS, torch.float32, "cpu"))
    exact_layers = tuple(dataclasses.replace(lp, moe=None if lp.moe is None else dataclasses.replace(
        lp.moe, **{n: torch.stack([dequantize(getattr(lp.moe, n)[e]) for e in range(6)]) for n in ("gate_up", "down")}))
        for lp in dequantized_layers(params))
    exact = steps(cfg, dataclasses.replace(params, layers=exact_layers, lm_head=dequantize(params.lm_head)),
                  allocate_kv_pool(cfg, 8, BS, torch.float32, "cpu"))
    err_one, err_two = (one - exact).abs().max().item(), (got["qwen3-moe-int8"] - exact).abs().max().item()
    assert 0 < err_two <= 2 * err_one, (err_one, err_two)


def dequantized_layers(params):
    """Each layer's dense projections dequantized (a sparse layer's are None)."""
    return tuple(dataclasses.replace(lp, **{n: dequantize(getattr(lp, n)) for n in PROJECTIONS
                                            if getattr(lp, n) is not None}) for lp in params.layers)


def _sum_rank(rank: int, size: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        # Parts whose fp32 sum depends on the order: (1e8 - 1e8) + 1 = 1, 1e8 + (-1e8 + 1) = 0.
        x = torch.full((7, 576), (1e8, -1e8, 1.0)[rank])
        results.put((rank, all_reduce(x).numpy()))
    finally:
        dist.destroy_process_group()


def test_three_ranks_add_their_parts_in_rank_order_everywhere(tmp_path):
    """Every element's sum is ((x0 + x1) + x2) on every rank, wherever it sits in the tensor:
    gloo's own all-reduce adds three parts in an order that depends on the element's position,
    and so a token's logits on the rows that shared its step."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_sum_rank, args=(r, 3, str(tmp_path / "rendezvous"), results)) for r in range(3)]
    for p in ranks:
        p.start()
    sums = dict(results.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0
    for rank in range(3):
        assert (sums[rank] == 1.0).all(), (rank, sorted(set(sums[rank].ravel().tolist())))


def test_what_cannot_be_split_is_named():
    with pytest.raises(RequestError, match="intermediate_size=48 is not divisible by tensor_parallel_size=5"):
        shard_config(tiny_config(), 0, 5)
    with pytest.raises(RequestError, match="moe_intermediate_size=64 is not divisible by tensor_parallel_size=3"):
        shard_config(moe_model("qwen3-moe")[0], 0, 3)
    with pytest.raises(RequestError, match="num_kv_heads=2 .* cannot be shared evenly by 8 ranks"):
        shard_config(tiny_config(), 0, 8)  # 4 ranks per KV head, 2 query heads each


def test_quantized_groups_are_not_cut():
    """A rank's columns of o_proj (2 heads of 8) would split GGUF groups of 32: named; a form
    that cannot be split at all, too."""
    from nanoinfer.quant.quantized import Int4Weight

    cfg = tiny_config()
    params = random_params(cfg)
    lp = dataclasses.replace(params.layers[0], o_proj=grouped(params.layers[0].o_proj.repeat(1, 2), 8))
    cut = dataclasses.replace(params, layers=(lp,) + params.layers[1:])
    with pytest.raises(RequestError, match="would cut a group of 32 quantized inputs: columns 0..16"):
        shard_params(cut, cfg, 0, 2)
    g = grouped(params.layers[0].gate_up_proj, 4)  # (32 inputs: one group a row)
    int4 = dataclasses.replace(params.layers[0], gate_up_proj=Int4Weight.from_groups(g.q, g.scale, g.min))
    with pytest.raises(RequestError, match="cannot split a matrix packed for torch's int4 kernel"):
        shard_params(dataclasses.replace(params, layers=(int4,) + params.layers[1:]), cfg, 0, 2)


@pytest.mark.parametrize("heads, kv, size, expected", [
    (9, 3, 2, [(0, 3, 0, 1), (3, 6, 1, 2)]),
    (4, 2, 2, [(0, 2, 0, 1), (2, 2, 1, 1)]),
    (4, 1, 2, [(0, 2, 0, 1), (2, 2, 0, 1)]),
    (8, 2, 4, [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]),
])
def test_rank_heads(heads, kv, size, expected):
    from nanoinfer.parallel.shards import rank_heads

    cfg = tiny_config(num_heads=heads, num_kv_heads=kv)
    assert [rank_heads(cfg, r, size) for r in range(size)] == expected


def test_shards_put_back_together_are_the_weights():
    cfg, params = model("qwen2-bias")
    parts = [shard_params(params, cfg, r, 2) for r in range(2)]
    lp, (a, b) = params.layers[0], (p.layers[0] for p in parts)
    assert torch.equal(torch.cat([a.o_proj, b.o_proj], dim=1), lp.o_proj)
    assert torch.equal(torch.cat([a.down_proj, b.down_proj], dim=1), lp.down_proj)
    assert torch.equal(torch.cat([parts[0].embed, parts[1].embed])[:cfg.vocab_size], params.embed)
    # The query heads, then each rank's KV heads, in the rank order.
    q = cfg.q_size // 2
    assert torch.equal(torch.cat([a.qkv_proj[:q], b.qkv_proj[:q]]), lp.qkv_proj[:cfg.q_size])


def test_cuda_int4_matrices_split_through_their_groups():
    """CUDA's 4-bit words (Int4CudaWeight: `quantization="int4"`, AWQ, GPTQ) are split through
    their exact groups: each rank's part, dequantized, is the slice of the whole's; an act-order
    one is named. (Built on the CPU: the packing is the same.)"""
    from nanoinfer.quant.quantized import Int4CudaWeight

    cfg = tiny_config(**CASES["llama-int8"])  # (heads and units spanning whole groups of 32)
    params = random_params(cfg, seed=5)
    layers = tuple(dataclasses.replace(lp, **{n: Int4CudaWeight.from_groups(grouped(getattr(lp, n), 4))
                                              for n in PROJECTIONS}) for lp in params.layers)
    params = dataclasses.replace(params, layers=layers)
    whole = dequantized(params).layers[0]
    parts = [shard_params(params, cfg, r, 2).layers[0] for r in range(2)]
    assert all(isinstance(getattr(p, n), Int4CudaWeight) for p in parts for n in PROJECTIONS)
    a, b = ([dequantize(getattr(p, n)) for n in PROJECTIONS] for p in parts)
    inter = cfg.intermediate_size // 2
    assert torch.equal(torch.cat([a[1], b[1]], dim=1), whole.o_proj)
    assert torch.equal(torch.cat([a[3], b[3]], dim=1), whole.down_proj)
    assert torch.equal(torch.cat([a[2][:inter], b[2][:inter]]), whole.gate_up_proj[:cfg.intermediate_size])
    q = cfg.q_size // 2
    assert torch.equal(torch.cat([a[0][:q], b[0][:q]]), whole.qkv_proj[:cfg.q_size])
    ordered = dataclasses.replace(layers[0], down_proj=dataclasses.replace(
        layers[0].down_proj, cols=torch.arange(cfg.intermediate_size).flip(0)))
    with pytest.raises(RequestError, match="cannot split a 4-bit matrix stored in act order"):
        shard_params(dataclasses.replace(params, layers=(ordered,) + layers[1:]), cfg, 0, 2)


def default_models(path):
    """The default model's exact weights (fp32), then its Q4_1 matrices packed for the CPU's
    kernels (bf16 activations)."""
    from nanoinfer.loaders import load_model

    yield load_model(path, device="cpu", dtype="float32", quantization="none", progress=False)
    yield load_model(path, device="cpu", quantization="gguf", progress=False)


def _default_model_rank(rank: int, size: int, init_file: str, path: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        for loaded in default_models(path):
            cfg = loaded.config
            local = shard_config(cfg, rank, size)
            logits = steps(local, shard_params(loaded.params, cfg, rank, size),
                           allocate_kv_pool(local, 8, BS, loaded.params.dtype, "cpu"),
                           layer_functions(EAGER, Shard(rank, size), cfg.vocab_size))
            if rank == 0:  # (by value: a shared tensor's memory goes with this process, which may exit first)
                results.put(logits.float().numpy())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_default_model_over_two_ranks(smollm2_gguf, tmp_path):
    """SmolLM2-135M: 9 query heads over 3 KV heads, split 3 + 6; its exact weights (fp32) and
    its Q4_1 matrices packed for the CPU."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_default_model_rank, args=(r, 2, str(tmp_path / "rendezvous"), str(smollm2_gguf),
                                                            results)) for r in range(2)]
    for p in ranks:
        p.start()
    got, got_packed = (torch.from_numpy(results.get(timeout=300)) for _ in range(2))
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0
    ref, ref_packed = (steps(m.config, m.params, allocate_kv_pool(m.config, 8, BS, m.params.dtype, "cpu")).float()
                       for m in default_models(smollm2_gguf))
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # The packed kernels round activations to int8 per group, as llama.cpp does: two ranks of
    # them are as close to the exact weights' logits as one is.
    one, two = (ref_packed - ref).abs().max().item(), (got_packed.float() - ref).abs().max().item()
    assert 0 < two <= 1.5 * one


# -- the engine over two ranks (runtime/executor/tensor_parallel.py) ---------------------------------------

def engine_outputs(model, prompts, params, draft_model=None, **config):
    """Every sequence's tokens, greedy, from an EngineCore with `config`; its ranks are gone
    after close."""
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    core = EngineCore(model, engine_config(**config), draft_model=draft_model)
    try:
        for prompt in prompts:
            core.add_request(prompt, params)
        outs: dict[int, list[int]] = {}
        while core.has_unfinished():
            for out in core.step():
                outs.setdefault(out.seq.seq_id, []).append(out.token_id)
        stats = core.stats()
        if hasattr(core.executor, "tp") and core.executor.tp.size > 1:  # (the orders went over the control channel)
            assert core.executor.tp.channel.count > 0
    finally:
        core.close()
    procs = core.executor.tp.procs if hasattr(core.executor, "tp") else []
    assert all(p.poll() is not None for p in procs)
    return sorted(outs.items()), stats


@pytest.mark.parametrize("case", ["roomy", "preempting-swap", "preempting-recompute", "draft-model"])
def test_engine_over_two_ranks_emits_what_one_rank_does(case):
    """Greedy tokens of an engine whose model is split over two processes (9 query heads over 3
    KV heads: 3 + 6) equal one process's, with forks sharing blocks (copy-on-write copies)
    and, in a pool too small for the batch, preemption by swap (block swaps on every rank) or
    by recompute; and with speculative decoding by a draft model (which runs whole on rank 0)."""
    from nanoinfer.loaders import LoadedModel
    from nanoinfer.sampling.sampler import SamplingParams

    cfg = tiny_config(num_heads=9, num_kv_heads=3, hidden_size=72)
    model = LoadedModel(cfg, random_params(cfg, seed=3), None, Path("tiny"))
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9] * 11, [10, 11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, n=2 if case == "roomy" else 1,
                            seed=1, top_k=2 if case == "roomy" else 0)
    draft = None
    config = {"roomy": dict(num_blocks=64),
              "preempting-swap": dict(num_blocks=12, preemption_mode="swap", swap_space=1 << 20),
              "preempting-recompute": dict(num_blocks=12),
              "draft-model": dict(num_blocks=64, speculative_config={"model": "d", "num_speculative_tokens": 3,
                                                                  "adaptive": False})}[case]  # (timing-free)
    if case == "draft-model":  # (the target itself: its drafts are accepted)
        draft = model
    one, stats_one = engine_outputs(model, prompts, params, draft, block_size=4, **config)
    two, stats_two = engine_outputs(model, prompts, params, draft, block_size=4, tensor_parallel_size=2, **config)
    assert two == one
    assert stats_two["num_preemptions"] == stats_one["num_preemptions"]
    assert (stats_one["num_preemptions"] > 0) == case.startswith("preempting")
    if draft is not None:
        assert stats_two["spec_accepted_tokens"] == stats_one["spec_accepted_tokens"]
        assert stats_one["spec_accepted_tokens"] > 0


def test_an_engine_splits_a_mixture_of_experts_model_over_two_ranks():
    """The engine's ranks (processes) split a Qwen3-MoE's experts: greedy tokens are one process's."""
    from nanoinfer.loaders import LoadedModel
    from nanoinfer.sampling.sampler import SamplingParams

    cfg, params = moe_model("qwen3-moe")
    model = LoadedModel(cfg, params, None, Path("tiny-moe"))
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9] * 11]
    sampling = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    one, _ = engine_outputs(model, prompts, sampling, block_size=4, num_blocks=64)
    two, _ = engine_outputs(model, prompts, sampling, block_size=4, num_blocks=64, tensor_parallel_size=2)
    assert two == one


def test_engine_tensor_parallel_errors_are_named(tmp_path):
    from nanoinfer.loaders import LoadedModel
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    cfg = tiny_config()
    model = LoadedModel(cfg, random_params(cfg), None, Path("tiny"))
    with pytest.raises(RequestError, match="intermediate_size=48 is not divisible by tensor_parallel_size=5"):
        EngineCore(model, engine_config(num_blocks=16, tensor_parallel_size=5))
    with pytest.raises(RequestError, match="tensor_parallel_size=0 is invalid"):
        engine_config(tensor_parallel_size=0)
    from nanoinfer.loaders import load_model
    from tests.nanochat_files import nanochat_state, write_checkpoint

    write_checkpoint(tmp_path / "d4", nanochat_state())
    nanochat = load_model(tmp_path / "d4", device="cpu", progress=False)
    with pytest.raises(RequestError, match="nanochat model does not run under tensor parallelism yet"):
        EngineCore(nanochat, engine_config(num_blocks=16, tensor_parallel_size=2))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "auto"], ids=["exact", "packed"])
def test_default_model_generates_the_same_text_over_two_ranks(smollm2_gguf, dtype):
    """The offline facade, SmolLM2-135M split 3 + 6 heads: the same greedy text as one rank in
    fp32; with its Q4_1 matrices packed for the CPU's fused layers (the default), parting from
    it only at a near-tie."""
    from nanoinfer import LLM
    from nanoinfer.sampling.sampler import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    runs = []
    for size in (1, 2):
        with LLM(smollm2_gguf, device="cpu", dtype=dtype, progress=False, num_blocks=64,
                 tensor_parallel_size=size) as llm:
            runs.append([o.outputs[0] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                                                     logprobs=2), use_tqdm=False)])
    if dtype == "float32":
        assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
        return
    # Packed, the ranks' partial sums add in fp32 in another order than one rank's sum, and the
    # int8 rounding of the activations can turn that into another token where the model
    # hesitates (README: over 5 prompts x 64 tokens, one rank's top two were 0.02 to 0.2 nat
    # apart at the first parting); these two prompts may part only at a near-tie of the same two.
    for one, two in zip(*runs):
        i = next((i for i, (a, b) in enumerate(zip(one.token_ids, two.token_ids)) if a != b), None)
        if i is None:
            continue
        (a, la), (b, lb) = one.logprobs[i].top
        assert {a, b} == {t for t, _ in two.logprobs[i].top} and la - lb < 0.25, (i, one.logprobs[i], two.logprobs[i])


@pytest.mark.slow
def test_default_model_packed_over_two_ranks_gives_its_own_bits_in_any_batch(smollm2_gguf):
    """What the packed path promises at tensor_parallel_size=2 (README): not one rank's bits (a
    row-parallel projection's two partial sums add in another order than one rank's kernel
    sums its whole row, and two fp32 numbers add the same in either order: no order of the
    ranks' parts gives one rank's sum), but its own, as one rank's are (tests/test_cpu_determinism.py):
    the same tokens and logprobs for a prompt batched with others, alone from the prefix cache,
    or prefilled in chunks of 7."""
    from nanoinfer import LLM
    from nanoinfer.sampling.sampler import SamplingParams

    prompts = ["The capital of France is", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
               "Names: Alice, Bob, Carol, Dave, Erin, Frank, Grace, Heidi, Ivan, Judy. Their initials: A, B,"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)

    def outputs(llm, prompts):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]

    with LLM(smollm2_gguf, device="cpu", progress=False, num_blocks=64, tensor_parallel_size=2) as llm:
        together = outputs(llm, prompts)
        alone = [outputs(llm, [p])[0] for p in prompts]
        assert llm.stats()["prefix_cache_hits"] > 0
    with LLM(smollm2_gguf, device="cpu", progress=False, num_blocks=64, tensor_parallel_size=2,
             max_num_batched_tokens=7) as llm:
        chunked = outputs(llm, prompts)
    assert alone == together == chunked


def test_server_streams_over_two_ranks(tiny_chat_model):
    """A streamed chat through the server with the model over two ranks: the text of one."""
    from openai import OpenAI

    from tests.live_server import LiveServer

    messages = [{"role": "user", "content": "one two three"}]
    texts = []
    for size in (1, 2):
        with LiveServer(tiny_chat_model, engine_kw={"tensor_parallel_size": size}) as server:
            client = OpenAI(base_url=server.url + "/v1", api_key="none")
            stream = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=24,
                                                    temperature=0, stream=True)
            texts.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    assert texts[0] == texts[1] and texts[0]


def tiny_split_model():
    from nanoinfer.loaders import LoadedModel

    cfg = tiny_config(num_heads=9, num_kv_heads=3, hidden_size=72)
    return LoadedModel(cfg, random_params(cfg, seed=3), None, Path("tiny"))


def test_a_lost_rank_fails_the_engine_with_a_clear_error():
    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore
    from runtime.engine.faults import EngineDead

    core = EngineCore(tiny_split_model(), engine_config(num_blocks=32, block_size=4, tensor_parallel_size=2))
    try:
        core.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        core.step()
        rank1 = core.executor.tp.procs[0]
        rank1.kill()
        rank1.wait()
        with pytest.raises(EngineDead, match="tensor-parallel rank 1 exited"):
            for _ in range(5):
                core.step()
    finally:
        core.close()  # (no hang with a rank gone)


ORPHAN_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from tests.test_tensor_parallel import tiny_split_model
from runtime.async_engine import engine_config
from runtime.engine.engine_core import EngineCore
if __name__ == "__main__":
    core = EngineCore(tiny_split_model(), engine_config(num_blocks=16, block_size=4, tensor_parallel_size=2))
    print(*(p.pid for p in core.executor.tp.procs), flush=True)
    time.sleep(600)
"""


def test_no_rank_outlives_a_killed_engine(tmp_path):
    """SIGKILL leaves no cleanup to the engine's process: its ranks notice and exit."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "engine.py"
    script.write_text(ORPHAN_SCRIPT.format(root=str(Path(__file__).parent.parent)))
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        ranks = [int(pid) for pid in engine.stdout.readline().split()]
        assert ranks and all(running(pid) for pid in ranks)
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
        deadline = time.monotonic() + 15
        while any(running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(running(pid) for pid in ranks)
    finally:
        if engine.poll() is None:
            engine.kill()


def running(pid: int) -> bool:
    """A live process (a zombie, exited but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_torchrun_starts_the_ranks(smollm2_gguf):
    """`torchrun --nproc-per-node 2 -m runtime.cli generate ... --tensor-parallel-size 2`: every
    rank runs the command line, rank 0 the engine; the text is one process's. (Both ranks on
    this host: the orders go over a control channel whose ring rank 0 names in /dev/shm, and
    removes once mapped.)"""
    import subprocess
    import sys

    flags = ["generate", "The capital of France is", "--model", str(smollm2_gguf), "--device", "cpu",
             "--dtype", "float32", "--max-tokens", "12", "--temperature", "0"]
    root = Path(__file__).parent.parent
    one = subprocess.run([sys.executable, "-m", "runtime.cli", *flags], cwd=root, capture_output=True, text=True,
                         timeout=300)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "runtime.cli", *flags, "--tensor-parallel-size", "2"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and one.stdout.strip()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("nanoinfer-control-")]


def test_a_failed_start_stops_the_ranks_cleanly(monkeypatch):
    """Rank 0 failing after the ranks started (here: its KV pool) stops them before their setup:
    they exit 0, and the error is rank 0's own."""
    from runtime.executor import kv_pools
    from runtime.executor import tensor_parallel
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    started = []
    monkeypatch.setattr(tensor_parallel.TensorParallelRanks, "setup", lambda self, setup: started.append(self))

    def no_pool(*args, **kwargs):
        raise MemoryError("no KV pool for you")

    monkeypatch.setattr(kv_pools, "allocate_kv_pool", no_pool)
    with pytest.raises(MemoryError, match="no KV pool"):
        EngineCore(tiny_split_model(), engine_config(num_blocks=16, block_size=4, tensor_parallel_size=2))
    (ranks,) = started
    assert ranks.closed and [p.returncode for p in ranks.procs] == [0]


def test_only_real_copies_and_swaps_reach_the_other_ranks():
    """A new block for a sequence is an empty copy list: the pools that follow rank 0's (the other
    ranks', each order a round trip over the control group) hear only of copies and swaps that
    move something. Before, every step in which sequences crossed a block boundary sent one
    order per sequence: 2.5 ms of PP=2's 8 ms step on two H100s."""
    from runtime.executor.kv_pools import KVPools

    cfg = tiny_config()
    pools = KVPools(cfg, num_blocks=8, num_cpu_blocks=4, block_size=BS, dtype=torch.float32, device=torch.device("cpu"))
    pools.kv.normal_()
    heard = []

    class Follower:
        def copy_blocks(self, copies):
            heard.append(("copy", copies))

        def swap_out(self, copies):
            heard.append(("swap_out", copies))

        def swap_in(self, copies):
            heard.append(("swap_in", copies))

    pools.followers.append(Follower())
    pools.copy_blocks([])
    pools.swap_out([])
    pools.swap_in([])
    assert heard == []
    pools.copy_blocks([(1, 2)])
    pools.swap_out([(2, 0)])
    pools.swap_in([(0, 3)])
    assert heard == [("copy", [(1, 2)]), ("swap_out", [(2, 0)]), ("swap_in", [(0, 3)])]
    assert torch.equal(pools.kv[:, :, 3], pools.kv[:, :, 1])  # (the copy and the round trip took place here too)


def test_the_profiling_step_runs_on_a_ranks_shard():
    """What sizes a GPU's KV pool runs rank 0's own part of the model (kv_budget.run_peak_step):
    its LM head holds a share of the vocabulary, and the sampler it profiles sees the whole
    vocabulary, as the gathered logits of a real step have it. On two H100s an 8B model with
    tensor_parallel_size=2 and no num_blocks failed to start: "The size of tensor a (128256)
    must match the size of tensor b (64128)"."""
    from nanoinfer.loaders import LoadedModel
    from runtime.async_engine import engine_config
    from runtime.executor.kv_budget import run_peak_step

    cfg = tiny_config(vocab_size=96)  # (48 a rank)
    params = random_params(cfg, seed=3)
    local = shard_config(cfg, 0, 2)
    model = LoadedModel(local, shard_params(params, cfg, 0, 2), None, Path("tiny"))
    run_peak_step(model, engine_config(max_num_batched_tokens=64, max_num_seqs=8), REFERENCE)


def test_every_ranks_kv_pool_fits_the_budget():
    """The KV pool's blocks are counted from a budget of bytes (kv_cache_memory; on a GPU, what
    its memory leaves) and every rank allocates that many blocks of its own heads. With KV
    heads the ranks do not divide (the default model's 3 over 2 ranks: 1 + 2), rank 0 holds
    the fewest: blocks counted at its bytes gave rank 1 a pool of twice the budget (on a GPU,
    more memory than it has), and twice the swap space."""
    from nanoinfer.model.kv_cache import kv_bytes_per_block
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    model = tiny_split_model()
    largest = max(kv_bytes_per_block(shard_config(model.config, rank, 2), BS, torch.float32) for rank in range(2))
    assert largest > kv_bytes_per_block(shard_config(model.config, 0, 2), BS, torch.float32)
    budget = 40 * largest
    core = EngineCore(model, engine_config(block_size=BS, kv_cache_memory=budget, swap_space=10 * largest,
                                           tensor_parallel_size=2))
    try:
        assert core.executor.num_blocks * largest <= budget
        assert core.executor.num_cpu_blocks * largest <= 10 * largest
    finally:
        core.close()


def test_peer_sums_only_where_they_can_run():
    """EngineConfig.peer_sums takes effect for tensor parallelism alone, on CUDA, in a 16-bit
    model; elsewhere (the CPU's gloo ranks, pipeline stages, one rank, fp32) the sums stay
    torch.distributed's, and no peer buffers are made."""
    from runtime.executor.tp_grid import Grid, peer_links

    cfg = tiny_config()
    cuda = torch.device("cuda", 0)
    for grid, dtype, device in ((Grid(2), torch.bfloat16, torch.device("cpu")), (Grid(2, 2), torch.bfloat16, cuda),
                                (Grid(1), torch.bfloat16, cuda), (Grid(2), torch.float32, cuda)):
        assert peer_links(cfg, grid, 0, dtype, device) is None, (grid, dtype, device)


def test_rank_0_chooses_peer_sums_where_the_ranks_can_meet(monkeypatch, caplog):
    """Rank 0 alone decides whether an engine sums over peer memory (the ranks follow its
    setup): not where torchrun's ranks span hosts, nor where the GPUs cannot reach each other's
    memory, nor after a rendezvous in this process (a second one hung): then a warning says
    why and the engine sums with NCCL."""
    from runtime.executor import tp_grid
    from runtime.executor.tp_grid import Grid, lead_peer_links

    class Links:  # (nanoinfer.backends.cuda.peer_sum.PeerLinks' part that the choice reads: no GPU, no Triton)
        made = False

        def first_in_process(self):
            return not self.made

    links = Links()
    monkeypatch.setattr(tp_grid, "peer_links", lambda *args: links)
    monkeypatch.setattr(tp_grid, "peers_reach", lambda device, size: True)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cuda, cfg = torch.device("cuda", 0), tiny_config()
    assert lead_peer_links(cfg, Grid(2), torch.bfloat16, cuda) is links
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # (torchrun's ranks: on this host only with its LOCAL_WORLD_SIZE)
    with caplog.at_level("WARNING", logger="nanoinfer.tensor_parallel"):
        assert lead_peer_links(cfg, Grid(2), torch.bfloat16, cuda) is None
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert lead_peer_links(cfg, Grid(2), torch.bfloat16, cuda) is links
        monkeypatch.setattr(tp_grid, "peers_reach", lambda device, size: False)
        assert lead_peer_links(cfg, Grid(2), torch.bfloat16, cuda) is None
        monkeypatch.setattr(tp_grid, "peers_reach", lambda device, size: True)
        links.made = True
        assert lead_peer_links(cfg, Grid(2), torch.bfloat16, cuda) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3 and all(w.endswith("this engine sums with NCCL") for w in warnings), warnings
    assert "not all on this host" in warnings[0] and "reach each other's memory" in warnings[1]
    assert "connected them before" in warnings[2]


def test_rank_0_waits_in_the_peer_sums_rendezvous_only_so_long():
    """Rank 0 connects the peer sums inside `store_timeout(CONNECT)`: a wait on the process
    group's store there (where torch's rendezvous waits for a rank that died) fails after that
    timeout as an error of a maybe lost peer, not after the store's 10 minutes, which come back
    after."""
    import datetime

    from runtime.executor import tp_groups as tp

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=tp.TIMEOUT, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group_store = dist.PrefixStore("peer-test", dist.distributed_c10d._get_process_group_store(dist.group.WORLD))
        start = time.monotonic()
        with pytest.raises(RuntimeError) as failed, tp.store_timeout(datetime.timedelta(seconds=0.5)):
            group_store.get("a-key-no-rank-writes")
        assert time.monotonic() - start < 5 and tp.maybe_a_peer(failed.value)
        assert store.timeout == tp.TIMEOUT
    finally:
        dist.destroy_process_group()


def test_peer_sums_take_a_16_bit_model_split_over_gpus():
    pytest.importorskip("triton")
    from runtime.executor.tp_grid import Grid, peer_links

    cfg = tiny_config()
    links = peer_links(cfg, Grid(2), 1, torch.float16, torch.device("cuda", 0))  # (not connected: no GPU needed)
    assert (links.rank, links.ranks, links.hidden, links.ready) == (1, 2, cfg.hidden_size, False)


def test_a_ranks_part_of_interleaved_blocks_is_laid_out_as_the_whole_was():
    """A rank's rows or columns of a CPU block matrix whose rows are interleaved (BlockWeight.interleave) are the
    whole's values, interleaved again where the part's columns are whole chunks (the one-token kernel's layout)."""
    from nanoinfer.parallel.shards import _packed
    from nanoinfer.quant.quantized import GroupedWeight

    whole = BlockWeight.from_groups(grouped(torch.randn(64, 512, generator=torch.Generator().manual_seed(3)), 4))
    laid = whole.interleave(16)
    rows = _packed(laid, lambda g: g.rows(slice(0, 32)))
    assert rows.interleaved == 16 and torch.equal(dequantize(rows), dequantize(whole)[:32])
    cols = _packed(laid, lambda g: GroupedWeight(g.q[:, 256:], g.scale[:, 8:], g.min[:, 8:], g.bits))
    assert cols.interleaved == 16 and torch.equal(dequantize(cols), dequantize(whole)[:, 256:])
    narrow = _packed(laid, lambda g: GroupedWeight(g.q[:, :96], g.scale[:, :3], g.min[:, :3], g.bits))
    assert narrow.interleaved == 0 and torch.equal(dequantize(narrow), dequantize(whole)[:, :96])
