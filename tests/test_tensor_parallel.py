"""Tensor parallelism's sharded forward: two gloo ranks, each with its shard of the weights and
its own KV pool, give the logits of the whole model (fp32), through prefill and decode, for
Llama, Qwen2 (QKV bias) and Qwen3 (q/k norm) tiny configs, with fewer KV heads than ranks,
KV heads the ranks do not divide, tied embeddings and a vocabulary the ranks do not divide;
with quantized weights (per-row int8; GGUF groups packed for the CPU), as close to the exact
model as one rank is; and for the default model, exact and packed."""

import dataclasses
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from nanoinfer.batch import SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.kv_cache import allocate_kv_pool
from nanoinfer.loaders.quantize import PROJECTIONS, quantize_params
from nanoinfer.model import EAGER, forward
from nanoinfer.quantized import BlockWeight, dequantize
from nanoinfer.tensor_parallel import Shard, layer_functions, shard_config, shard_params
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


def steps(cfg, params, kv, layer_fns=EAGER):
    """A prefill of two prompts (5 and 7 tokens), then two decode steps: every logits row."""
    tables = [[0, 1, 2], [3, 4, 5]]
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26]]
    out = []
    batch = build_batch([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables)], BS)
    logits = forward(params, kv, batch, cfg, layer_fns=layer_fns)
    out.append(logits)
    lens = [len(p) for p in prompts]
    for nxt in ([7, 8], [9, 10]):  # (fixed tokens: a near-tie argmax would otherwise fork the runs)
        batch = build_batch([SeqChunk([t], n, table, True) for t, n, table in zip(nxt, lens, tables)], BS)
        logits = forward(params, kv, batch, cfg, layer_fns=layer_fns)
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


def _rank(rank: int, size: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    try:
        for name in CASES:
            cfg, params = model(name)
            local = shard_config(cfg, rank, size)
            kv = allocate_kv_pool(local, 8, BS, torch.float32, "cpu")
            logits = steps(local, shard_params(params, cfg, rank, size), kv,
                           layer_functions(EAGER, Shard(rank, size), cfg.vocab_size))
            if rank == 0:
                results.put((name, logits))
    finally:
        dist.destroy_process_group()


def test_two_ranks_compute_the_whole_models_logits(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "rendezvous"), results)) for r in range(2)]
    for p in ranks:
        p.start()
    got = dict(results.get(timeout=120) for _ in CASES)
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


def test_what_cannot_be_split_is_named():
    with pytest.raises(RequestError, match="intermediate_size=48 is not divisible by tensor_parallel_size=5"):
        shard_config(tiny_config(), 0, 5)
    with pytest.raises(RequestError, match="num_kv_heads=2 .* cannot be shared evenly by 8 ranks"):
        shard_config(tiny_config(), 0, 8)  # 4 ranks per KV head, 2 query heads each


def test_quantized_groups_are_not_cut():
    """A rank's columns of o_proj (2 heads of 8) would split GGUF groups of 32: named; a form
    that cannot be split at all, too."""
    from nanoinfer.quantized import Int4Weight

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
    from nanoinfer.tensor_parallel import rank_heads

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
            if rank == 0:
                results.put(logits)
    finally:
        dist.destroy_process_group()


def test_default_model_over_two_ranks(smollm2_gguf, tmp_path):
    """SmolLM2-135M: 9 query heads over 3 KV heads, split 3 + 6; its exact weights (fp32) and
    its Q4_1 matrices packed for the CPU."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_default_model_rank, args=(r, 2, str(tmp_path / "rendezvous"), str(smollm2_gguf),
                                                            results)) for r in range(2)]
    for p in ranks:
        p.start()
    got, got_packed = results.get(timeout=300), results.get(timeout=300)
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
