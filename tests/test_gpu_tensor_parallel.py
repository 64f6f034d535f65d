"""Tensor parallelism on two CUDA GPUs (NCCL ranks): the one-token fused layer parts under a sum
over ranks are as close to the exact model as the unfused parts are, and add each residual
once (the lead rank's partial carries it); their sums over peer memory equal NCCL's. Skipped
with fewer than two GPUs."""

import multiprocessing

import numpy as np
import pytest
import torch
import torch.distributed as dist

from nanoinfer.attention.reference import REFERENCE
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.model.decoder import EAGER, forward, map_params
from nanoinfer.parallel.shards import Shard, layer_functions, shard_config, shard_params
from tests.tiny import random_params, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs")

BS = 16


def _model(arch: str = "qwen3"):
    """Qwen3's q/k norms keep rope_write's kernel after QKV; llama's heads take RoPE and the KV
    write in QKV's GEMV epilogue (nanoinfer.backends.cuda.fused_layers.qkv_rope_and_write)."""
    cfg = tiny_config(architecture=arch, qk_norm=arch == "qwen3", vocab_size=1000, hidden_size=256, intermediate_size=512,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64)
    return cfg, map_params(lambda t: t.to(torch.bfloat16), random_params(cfg, seed=7))


def _steps(cfg, params, kv, layer_fns, backend, device):
    """A 9-token prefill, then four one-token steps: every logits row."""
    table, tokens = [0, 1], [3, 14, 15, 92, 65, 35, 89, 79, 32]
    out = [forward(params, kv, build_batch([SeqChunk(tokens, 0, table, True)], BS, device), cfg, backend, layer_fns)]
    for i, t in enumerate((7, 8, 9, 10)):  # (fixed tokens: no argmax to fork the runs)
        batch = build_batch([SeqChunk([t], len(tokens) + i, table, True)], BS, device)
        out.append(forward(params, kv, batch, cfg, backend, layer_fns))
    return torch.cat(out)


def _rank(rank: int, size: int, init_file: str, results, arch: str) -> None:
    from nanoinfer.backends.cuda import fused_layers
    from nanoinfer.backends.cuda.linear import linear
    from nanoinfer.backends.choose import kernels_for
    from nanoinfer.backends.cuda.peer_sum import PeerLinks

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=size, device_id=device)
    try:
        cfg, params = _model(arch)
        local = shard_config(cfg, rank, size)
        part = map_params(lambda t: t.to(device), shard_params(params, cfg, rank, size))
        kernels = kernels_for(local, device, BS)
        calls = []

        def counted(*args, **kwargs):
            calls.append((args[6] is not None, kwargs.get("rope") is not None))  # (a residual added; RoPE'd)
            return real(*args, **kwargs)

        real, fused_layers.fused_gemv = fused_layers.fused_gemv, counted
        try:  # (the fused parts as kernels_for gives them, with each GEMV call counted)
            fused = EAGER._replace(qkv_rope_and_write=fused_layers.qkv_rope_and_write, linear=linear,
                                   attention_output_and_mlp=fused_layers.attention_output_and_mlp)
            runs = {"fused-eager": _steps(local, part, allocate_kv_pool(local, 4, BS, torch.bfloat16, device),
                                          layer_functions(fused, Shard(rank, size), cfg.vocab_size),
                                          kernels.attention, device)}
        finally:
            fused_layers.fused_gemv = real
        for name, base in (("unfused", EAGER), ("kernels", kernels.layer_fns)):
            runs[name] = _steps(local, part, allocate_kv_pool(local, 4, BS, torch.bfloat16, device),
                                layer_functions(base, Shard(rank, size), cfg.vocab_size), kernels.attention, device)
        links = PeerLinks(rank, size, cfg.hidden_size, torch.bfloat16, device)
        links.connect(dist.group.WORLD.group_name)
        runs["peer"] = _steps(local, part, allocate_kv_pool(local, 4, BS, torch.bfloat16, device),
                              layer_functions(kernels.layer_fns, Shard(rank, size), cfg.vocab_size, None, links),
                              kernels.attention, device)
        links.close()
        results.put((rank, calls, {name: t.float().cpu().numpy() for name, t in runs.items()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_one_token_parts_under_two_ranks_add_each_residual_once(tmp_path, arch):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "rendezvous"), results, arch)) for r in range(2)]
    for p in ranks:
        p.start()
    got = dict((rank, (calls, runs)) for rank, calls, runs in (results.get(timeout=300) for _ in ranks))
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0
    layers, decode_steps = 3, 4
    # Per layer and one-token step: QKV (norm folded in; with RoPE and the KV write in its epilogue
    # on each rank's heads unless q/k norms keep rope_write's kernel after it), output projection,
    # gate/up, down; the lead rank adds the residual in two of them, the other rank in none.
    lead, follower = got[0][0], got[1][0]
    assert len(lead) == len(follower) == 4 * layers * decode_steps
    assert sum(r for r, _ in lead) == 2 * layers * decode_steps and sum(r for r, _ in follower) == 0
    roped = 0 if arch == "qwen3" else layers * decode_steps
    assert sum(q for _, q in lead) == sum(q for _, q in follower) == roped
    cfg, params = _model(arch)
    exact = _steps(cfg, map_params(torch.Tensor.float, params), allocate_kv_pool(cfg, 4, BS, torch.float32, "cpu"),
                   EAGER, REFERENCE, "cpu")
    runs = {name: torch.from_numpy(t) for name, t in got[0][1].items()}
    err = {name: (t - exact).abs().max().item() for name, t in runs.items()}
    for name in ("fused-eager", "kernels"):
        assert err[name] <= 1.5 * err["unfused"] + 1e-2, err
    assert torch.equal(runs["kernels"].argmax(-1), exact.argmax(-1)), err
    # Sums over NVLink peer memory (nanoinfer.backends.cuda.peer_sum): two bf16 partials added in fp32 and
    # rounded once, as NCCL adds them, so the logits are NCCL's to the bit, on both ranks.
    for rank in (0, 1):
        assert np.array_equal(got[rank][1]["peer"], got[rank][1]["kernels"]), rank


def test_close_over_two_gpus_leaves_no_group_behind():
    """With CUDA graphs that captured NCCL's all-reduces, `close()` destroys the process groups
    on every rank (a graph alive kept NCCL's destroy waiting, and the group was left behind:
    the next engine in the process failed with "initialize the default process group twice"),
    so a second engine over two GPUs runs in the same process and gives the same tokens (this one
    with its KV pool sized by the profiling step, which failed on rank 0's vocabulary share). The first
    sums over peer memory, the second with NCCL (a second rendezvous in one process hung:
    nanoinfer.backends.cuda.peer_sum), as the third, asked to, does."""
    from pathlib import Path

    from nanoinfer.loaders import LoadedModel
    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    cfg, params = _model()
    model = LoadedModel(cfg, map_params(lambda t: t.cuda(), params), None, Path("tiny-tp"))
    outputs = []
    # (the second sizes its pool by profiling a step on rank 0's shard)
    from nanoinfer.backends.cuda.peer_sum import PeerLinks

    first = PeerLinks.first_in_process()  # (no earlier test of this process made the rendezvous)
    for extra, peer in ((dict(num_blocks=64), first), ({}, False), (dict(peer_sums=False), False)):
        core = EngineCore(model, engine_config(block_size=16, max_model_len=256, tensor_parallel_size=2, **extra))
        try:
            assert core.executor.graphs is not None  # (the case at stake: graphs that captured collectives)
            assert (core.executor.tp.links is not None and core.executor.tp.links.ready) == peer
            core.add_request([3, 14, 15, 92, 65], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            tokens = []
            while core.has_unfinished():
                tokens += [out.token_id for out in core.step() if out.token_id is not None]
            outputs.append(tokens)
        finally:
            core.close()
        assert not dist.is_initialized()
        assert all(p.poll() is not None for p in core.executor.tp.procs)
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0]) == 8
