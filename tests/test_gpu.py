"""GPU-only checks (skipped without CUDA): CUDA-graph replay equals eager bit for bit, the
Triton GEMV against an fp32 matmul, CUDA's fused layer parts against an fp32 oracle, async
scheduling changes no token, and bf16 greedy decoding agrees with transformers up to near-ties."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

import dataclasses  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from nanoinfer.attention.triton_paged import TritonPagedAttention  # noqa: E402
from nanoinfer.model.batch import SeqChunk, build_batch, host_batch  # noqa: E402
from nanoinfer.backends.cuda.graphs import StepGraphs  # noqa: E402
from nanoinfer.backends.choose import cuda_layer_functions, kernels_for  # noqa: E402
from nanoinfer.model.kv_cache import allocate_kv_pool  # noqa: E402
from nanoinfer.model.layers import rms_norm  # noqa: E402
from nanoinfer.model.decoder import EAGER, forward, map_params  # noqa: E402
from nanoinfer.sampling.sampler import SamplingParams  # noqa: E402
from runtime.async_engine import engine_config  # noqa: E402
from runtime.engine.engine_core import EngineConfig, EngineCore  # noqa: E402


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    """A Qwen3-0.6B-shaped model with random weights, saved by transformers, loaded by us."""
    from tests.tiny import qwen3_shaped

    return qwen3_shaped(tmp_path_factory.mktemp("qwen3-shape"))


def tiny_cfg():
    from tests.tiny import tiny_config

    return tiny_config()


def random_pool_and_backend(cfg, bs):
    """A 64-block bf16 KV pool full of random values, and the Triton attention backend."""
    kv = allocate_kv_pool(cfg, 64, bs, torch.bfloat16, "cuda")
    kv.normal_()
    return kv, TritonPagedAttention(cfg, device="cuda")


def test_graph_replay_equals_eager_bit_for_bit(hf_and_ours):
    _, model = hf_and_ours
    cfg, bs = model.config, 16
    kv, backend = random_pool_and_backend(cfg, bs)
    graphs = StepGraphs(lambda b: (forward(model.params, kv, b, cfg, backend),), kv.device, max_batch=8, max_blocks=16,
                        buckets=(1, 2, 4, 8), widths=(4,))
    graphs.capture()
    assert set(graphs.graphs) == {(b, w) for b in (1, 2, 4, 8) for w in (4, 16)}
    # Decode rows at these positions: 5 rows padded to bucket 8, 3 rows to bucket 4; the
    # second batch's tables fit the narrow graphs (3 blocks of 16 <= 4).
    for contexts in ([1, 17, 100, 33, 250], [1, 40, 17]):
        chunks, block = [], 0
        for n in contexts:
            blocks = -(-n // bs)
            chunks.append(SeqChunk([7 + n], n - 1, list(range(block, block + blocks)), True))
            block += blocks
        batch = build_batch(chunks, bs, "cuda")
        assert graphs.can_run(batch)
        with torch.inference_mode():
            eager = forward(model.params, kv, batch, cfg, backend).clone()
            replayed = graphs.run(batch)[0].clone()
            # The same batch built on the host: one staged copy into the graph's inputs.
            staged = graphs.run(host_batch(chunks, bs))[0].clone()
            # Device-side input ids replace the batch's own.
            other = graphs.run(host_batch([c._replace(token_ids=[0]) for c in chunks], bs), batch.input_ids)[0]
        assert torch.equal(eager, replayed), contexts
        assert torch.equal(eager, staged) and torch.equal(eager, other), contexts


def test_cuda_layer_parts_match_eager_and_replay_exactly(hf_and_ours):
    """A mixed step (a 40-token chunk beside a decode: nanoinfer.backends.cuda.batched_layers' row kernels)."""
    _, model = hf_and_ours
    cfg, bs = model.config, 16
    kv, backend = random_pool_and_backend(cfg, bs)
    parts = cuda_layer_functions()
    mixed = build_batch([SeqChunk(list(range(5, 45)), 3, list(range(0, 3)), True),
                         SeqChunk([9], 70, list(range(10, 15)), True)], bs, "cuda")
    with torch.inference_mode():
        eager = forward(model.params, kv, mixed, cfg, backend)
        fused = forward(model.params, kv, mixed, cfg, backend, parts)
        # The oracle: fp32 weights and cache, the reference attention.
        exact = forward(map_params(torch.Tensor.float, model.params), kv.float(), mixed, cfg)
    # Fusion keeps intermediates in fp32 where eager rounds some ops to bf16: the fused path
    # must be about as close to the fp32 oracle as eager is (not bitwise equal to eager).
    eager_err = (eager - exact).abs().max().item()
    fused_err = (fused - exact).abs().max().item()
    assert fused_err <= 1.5 * eager_err + 1e-2, (fused_err, eager_err)
    graphs = StepGraphs(lambda b: (forward(model.params, kv, b, cfg, backend, parts),), kv.device, max_batch=4,
                        max_blocks=16, buckets=(1, 4))
    graphs.capture()
    decode = build_batch([SeqChunk([3], 40, list(range(20, 23)), True)], bs, "cuda")
    with torch.inference_mode():
        assert torch.equal(forward(model.params, kv, decode, cfg, backend, parts).clone(), graphs.run(decode)[0].clone())


@pytest.mark.skipif(torch.cuda.get_device_capability()[0] < 9, reason="programmatic dependent launch: Hopper on")
def test_one_token_steps_launched_early_equal_those_launched_in_turn(hf_and_ours, monkeypatch):
    """nanoinfer.backends.cuda.pdl: the decode kernels started before the ones ahead end (their GEMVs fetching
    weights meanwhile), eager and in graph replays, give what plain launches give, bit for bit."""
    _, model = hf_and_ours
    cfg, bs = model.config, 16
    kv, backend = random_pool_and_backend(cfg, bs)
    parts = cuda_layer_functions()
    batches = [build_batch([SeqChunk([3 + n], n, list(range(0, -(-(n + 1) // bs))), True)], bs, "cuda")
               for n in (0, 40, 200)]
    outputs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("NANOINFER_PDL", setting)
        graphs = StepGraphs(lambda b: (forward(model.params, kv, b, cfg, backend, parts),), kv.device, max_batch=1,
                            max_blocks=16, buckets=(1,))
        graphs.capture()
        with torch.inference_mode():
            outputs[setting] = [(forward(model.params, kv, b, cfg, backend, parts).clone(), graphs.run(b)[0].clone())
                                for b in batches]
    for (plain_eager, plain_graph), (early_eager, early_graph) in zip(outputs["0"], outputs["1"]):
        assert torch.equal(plain_eager, plain_graph)
        assert torch.equal(early_eager, plain_eager) and torch.equal(early_graph, plain_graph)


@pytest.mark.parametrize("layers", ["eager", "cuda"])
def test_mixed_step_graphs_match_eager_and_write_only_the_batch_slots(hf_and_ours, layers):
    """Prefill chunks beside decodes, padded to a token bucket and to the graphs' sequence
    count, replay what the eager forward computes; padding writes no KV. With CUDA's layer
    parts (`cuda`: Triton row kernels at every token count, captured at each bucket)."""
    _, model = hf_and_ours
    cfg, bs = model.config, 16
    kv, backend = random_pool_and_backend(cfg, bs)
    parts = cuda_layer_functions() if layers == "cuda" else EAGER
    graphs = StepGraphs(lambda b: (forward(model.params, kv, b, cfg, backend, parts),), kv.device, max_batch=8,
                        max_blocks=16, buckets=(1, 8), max_tokens=64, token_buckets=(16, 32))
    graphs.capture()
    assert set(graphs.mixed) == {16, 32, 64}
    steps = [  # chunks: (tokens, start, blocks, sample); the last step fills all 8 sequences
        [(9, 0, 1, True), (1, 20, 2, True), (3, 5, 1, False)],
        [(30, 0, 2, True)],
        [(20, 16, 3, True), (1, 100, 7, True), (1, 3, 1, True), (1, 40, 3, True), (5, 0, 1, True)],
        [(2, 0, 1, True)] * 7 + [(50, 0, 4, True)],
    ]
    for chunks in steps:
        blocks = iter(range(64))
        seq_chunks = [SeqChunk(list(range(1, 1 + n)), start, [next(blocks) for _ in range(b)], sample)
                      for n, start, b, sample in chunks]
        batch = build_batch(seq_chunks, bs, "cuda")
        assert graphs.can_run(batch) and batch.num_tokens > batch.num_seqs
        eager_kv = kv.clone()
        with torch.inference_mode():
            eager = forward(model.params, eager_kv, batch, cfg, backend, parts)
            replayed = graphs.run(batch)[0].clone()
            # Staged from the host in one copy: the same inputs, the same outputs.
            assert torch.equal(graphs.run(host_batch(seq_chunks, bs))[0], replayed)
        assert replayed.shape == eager.shape
        assert (replayed - eager).abs().max().item() <= 0.02 * eager.abs().max().item(), chunks
        written = torch.zeros(64 * bs, dtype=torch.bool, device="cuda")
        written[batch.slot_mapping] = True
        flat, eager_flat = kv.view(cfg.num_layers, 2, 64 * bs, -1), eager_kv.view(cfg.num_layers, 2, 64 * bs, -1)
        assert torch.equal(flat[:, :, ~written], eager_flat[:, :, ~written])
        assert (flat[:, :, written].float() - eager_flat[:, :, written].float()).abs().max().item() < 0.1
        kv.copy_(eager_kv)  # (both paths go on from the same cache)


def greedy_with_logprobs(engine, prompts, max_tokens):
    """Run greedy requests to the end; their sequences and each one's top-5 logprobs per token."""
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5))
            for p in prompts]
    logprobs = {s: [] for s in seqs}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.seq].append(out.logprob)
    return seqs, logprobs


def test_bf16_greedy_agrees_with_transformers_up_to_near_ties(hf_and_ours):
    hf, model = hf_and_ours
    prompts = [[151, 2000, 37, 9, 444], list(range(1000, 1040))]
    engine = EngineCore(model, EngineConfig(block_size=16, num_blocks=256, max_model_len=1024))
    seqs, logprobs = greedy_with_logprobs(engine, prompts, 32)
    engine.close()
    for prompt, seq in zip(prompts, seqs):
        ours = seq.output_token_ids
        with torch.inference_mode():
            theirs = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32, min_new_tokens=32,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        if ours == theirs:
            continue
        i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        # At the first divergence each side's token must be among the other's top 5.
        our_top = [t for t, _ in logprobs[seq][i].top]
        with torch.inference_mode():
            ctx = torch.tensor([prompt + ours[:i]], device="cuda")
            their_top = hf(ctx).logits[0, -1].float().topk(5).indices.tolist()
        assert theirs[i] in our_top and ours[i] in their_top, (i, ours[i], theirs[i], our_top, their_top)


def test_engine_on_cuda_with_nvtx_ranges_and_phase_times(hf_and_ours):
    _, model = hf_and_ours
    engine = EngineCore(model, EngineConfig(block_size=16, num_blocks=64, max_model_len=512, nvtx=True))
    seq = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    assert len(seq.output_token_ids) == 4 and engine.timer._phase is None
    assert set(engine.timer.phase_times) == {"schedule", "batch", "forward", "sample", "resolve"}


def test_triton_random_draw_equals_eager():
    """The Triton draw (CUDA's kernels) picks the same token as the eager hash + race, masked
    tokens never win, and rows with a different (seed, step) draw differently; captured in a
    CUDA graph and replayed on new inputs it still does (tests/test_draw_triton.py has the edge cases)."""
    from nanoinfer.sampling.draw import random_draw
    from nanoinfer.backends.cuda.draw_triton import triton_draw

    assert kernels_for(tiny_cfg(), torch.device("cuda"), 16).draw is triton_draw
    g = torch.Generator(device="cuda").manual_seed(0)

    def inputs(rows, vocab):
        probs = torch.rand(rows, vocab, device="cuda", generator=g) ** 8
        probs[:, ::3] = 0.0  # masked tokens
        probs /= probs.sum(dim=-1, keepdim=True)
        seeds = torch.randint(-(1 << 62), 1 << 62, (rows,), device="cuda", generator=g)
        return probs, seeds, torch.randint(0, 5000, (rows,), device="cuda", generator=g)

    for rows, vocab in ((1, 97), (7, 151936), (256, 32000), (70, 49152 + 7)):
        probs, seeds, steps = inputs(rows, vocab)
        eager, fused = random_draw(probs, seeds, steps), triton_draw(probs, seeds, steps)
        assert torch.equal(eager, fused), (rows, vocab)
        assert (probs.gather(1, fused[:, None]) > 0).all()
        assert len(set(fused.tolist())) > rows // 2
    static = inputs(33, 151936)
    triton_draw(*static)  # (compiled before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = triton_draw(*static)
    for _ in range(3):
        for buffer, new in zip(static, inputs(33, 151936)):
            buffer.copy_(new)
        graph.replay()
        assert torch.equal(tokens, random_draw(*static))


@pytest.mark.parametrize("vocab", [7, 4096, 4097, 49152, 128256, 151936])
def test_split_argmax_matches_torch(vocab):
    """nanoinfer/backends/cuda/argmax.py against torch's argmax (first index on ties) and isfinite, per row."""
    from nanoinfer.sampling.sampler import greedy_and_finite

    g = torch.Generator(device="cuda").manual_seed(vocab)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows in (1, 5, 64):
            x = torch.randn(rows, vocab, device="cuda", generator=g).to(dtype)
            top = x.amax(dim=-1)
            x[0, vocab // 3] = x[0, vocab - 1] = top[0] + 1  # a tie across chunks: the first wins
            x[-1, : vocab // 2] = top[-1] + 2  # a run of ties
            if rows > 1:
                x[1, vocab // 2] = float("nan")
                x[2, 0] = float("-inf")
            tokens, finite = greedy_and_finite(x)
            expected = x.float().isfinite().all(dim=-1)
            assert tokens.dtype == torch.int64 and torch.equal(finite, expected)
            assert torch.equal(tokens[expected], x.argmax(dim=-1)[expected]), (dtype, rows)
            assert torch.equal(greedy_and_finite(x[:, : vocab - 1])[0][expected], x[:, : vocab - 1].argmax(-1)[expected])


@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (1000, 1000), (7, 33),
                                 (151936, 1024), (3, 4096)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_gemv_matches_an_fp32_matmul(n, k, rows):
    """Both kernels (one row; 2-16 rows on tensor cores) against fp32, bias through `linear`."""
    from nanoinfer.backends.cuda.gemv import gemv
    from nanoinfer.backends.cuda.linear import linear

    g = torch.Generator(device="cuda").manual_seed(n * k + rows)
    for dtype in (torch.bfloat16, torch.float16):
        w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * k**-0.5
        x = torch.randn(rows, k, device="cuda", dtype=dtype, generator=g)
        out = gemv(x, w)
        ref = x.float() @ w.float().T
        assert out.dtype == dtype and out.shape == (rows, n) and not out.isnan().any()
        # One rounding of the fp32 sum to bf16/fp16, nothing more.
        tol = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
        assert torch.allclose(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        bias = torch.randn(n, device="cuda", dtype=dtype, generator=g)
        assert torch.allclose(linear(x, w, bias).float(), (ref + bias.float()).to(dtype).float(), rtol=2 * tol,
                              atol=2 * tol * ref.abs().max().item())
    # Past 16 rows, and fp32 rows (tl.dot would round them to tf32): cuBLAS.
    for x in (torch.randn(17, k, device="cuda", dtype=dtype, generator=g), x.float()):
        ref = x.float() @ w.float().T
        tol = 2 ** -10 if x.dtype == dtype else 2 ** -16
        assert torch.allclose(linear(x, w.to(x.dtype)).float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("qk_norm,head_dim,kv_heads,dtype", [(True, 128, 8, torch.bfloat16), (False, 64, 8, torch.bfloat16),
                                                              (True, 64, 2, torch.float16), (False, 128, 4, torch.float16),
                                                              (True, 80, 2, torch.bfloat16), (False, 96, 4, torch.float16),
                                                              (True, 96, 8, torch.float16), (False, 80, 4, torch.bfloat16)])
def test_rope_and_write_matches_the_reference_composition(qk_norm, head_dim, kv_heads, dtype):
    from nanoinfer.attention.reference import REFERENCE
    from nanoinfer.model.layers import rope_cos_sin, rope_inv_freq
    from nanoinfer.model.decoder import attention_inputs
    from nanoinfer.backends.cuda.rope_write import rope_and_write
    from tests.tiny import random_params, tiny_config

    cfg = tiny_config(hidden_size=256, num_heads=2 * kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      qk_norm=qk_norm, num_layers=1, rope_theta=1e6)
    params = map_params(lambda t: t.to("cuda", dtype), random_params(cfg, seed=head_dim))
    lp, lp32 = params.layers[0], map_params(torch.Tensor.float, params).layers[0]
    g = torch.Generator(device="cuda").manual_seed(kv_heads)
    tokens, bs = 37, 16
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=dtype, generator=g)
    positions = torch.randint(0, 5000, (tokens,), device="cuda", generator=g)
    slots = torch.randperm(8 * bs, device="cuda", generator=g)[:tokens]
    slots[::5] = -1  # padding rows store nothing
    cos, sin = rope_cos_sin(rope_inv_freq(cfg).cuda(), positions, dtype)
    kv = torch.randn(2, 8, bs, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    ours, theirs = kv.clone(), kv.float()
    q = rope_and_write(F.linear(rms_norm(x, lp.attn_norm, cfg.rms_norm_eps), lp.qkv_proj), lp.q_norm, lp.k_norm,
                       cos, sin, ours, slots, cfg)
    # The oracle: the same composition in fp32 (inputs from the same bf16/fp16 projection).
    qkv = F.linear(rms_norm(x, lp.attn_norm, cfg.rms_norm_eps), lp.qkv_proj).float()
    q_ref, k_ref, v_ref = attention_inputs(x.float(), dataclasses.replace(lp32, qkv_proj=None), cos.float(),
                                           sin.float(), cfg, linear=lambda h, w, b: qkv)
    REFERENCE.write_kv(theirs, k_ref, v_ref, slots)
    tol = 2 ** -6 if dtype == torch.bfloat16 else 2 ** -9
    assert torch.allclose(q.float(), q_ref, rtol=tol, atol=tol)
    assert torch.allclose(ours.float(), theirs, rtol=tol, atol=tol)
    untouched = torch.ones(8 * bs, dtype=torch.bool, device="cuda")
    untouched[slots[slots >= 0]] = False
    assert torch.equal(ours.view(2, 8 * bs, -1)[:, untouched], kv.view(2, 8 * bs, -1)[:, untouched])


def test_batch1_path_with_gemv_is_as_close_to_fp32_as_eager(hf_and_ours):
    _, model = hf_and_ours
    cfg, bs = model.config, 16
    kv, backend = random_pool_and_backend(cfg, bs)
    parts = cuda_layer_functions()
    decode = build_batch([SeqChunk([3], 40, list(range(20, 23)), True)], bs, "cuda")
    with torch.inference_mode():
        eager = forward(model.params, kv.clone(), decode, cfg, backend)
        fused = forward(model.params, kv.clone(), decode, cfg, backend, parts)
        exact = forward(map_params(torch.Tensor.float, model.params), kv.float(), decode, cfg)
    eager_err = (eager - exact).abs().max().item()
    fused_err = (fused - exact).abs().max().item()
    assert fused_err <= 1.5 * eager_err + 1e-2, (fused_err, eager_err)
    graphs = StepGraphs(lambda b: (forward(model.params, kv, b, cfg, backend, parts),), kv.device, max_batch=2,
                        max_blocks=16, buckets=(1, 2))
    graphs.capture()
    with torch.inference_mode():
        assert torch.equal(forward(model.params, kv, decode, cfg, backend, parts).clone(), graphs.run(decode)[0].clone())


def test_async_scheduling_on_cuda_gives_the_same_tokens(hf_and_ours):
    _, model = hf_and_ours
    outs = []
    for overlap in (False, True):
        engine = EngineCore(model, EngineConfig(block_size=16, num_blocks=512, max_model_len=1024,
                                                async_scheduling=overlap))
        assert engine.async_scheduling is overlap
        seqs = [engine.add_request(list(range(100 + i, 130 + 7 * i)),
                                   SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=5 + 3 * i,
                                                  ignore_eos=True, logprobs=2 if i == 3 else None))
                for i in range(8)]
        while engine.has_unfinished():
            engine.step()
        engine.close()
        outs.append([s.output_token_ids for s in seqs])
        assert engine.scheduler.blocks.num_free_blocks == 512
    assert outs[0] == outs[1]


def test_graphs_captured_on_first_use_mid_run_give_the_tokens_of_capturing_all(hf_and_ours):
    """Lazy capture (the default) with async scheduling: buckets first met while earlier steps
    are queued (requests arriving mid-run, sequences finishing one by one, contexts growing past
    the narrow width) are captured between them; every token equals capturing every bucket at
    start, bit for bit, and only the start's buckets and those used are captured."""
    _, model = hf_and_ours
    outs, captured = [], []
    for mode in ("all", "lazy"):
        engine = EngineCore(model, engine_config(block_size=16, num_blocks=512, max_model_len=1024, max_num_seqs=16,
                                                 max_num_batched_tokens=512, cuda_graph_capture=mode))
        assert engine.async_scheduling
        graphs = engine.executor.graphs
        assert (len(graphs.graphs), len(graphs.mixed)) == ((1, 1) if mode == "lazy" else
                                                           (len(graphs.decode_inputs), len(graphs.token_buckets)))
        seqs, steps = [], 0

        def add():  # (prompts of 30 to 534 tokens, 4 to 184 tokens out)
            i = len(seqs)
            seqs.append(engine.add_request(list(range(100 + i, 130 + 37 * i)),
                                           SamplingParams(temperature=0.8 if i % 3 == 1 else 0, seed=i,
                                                          max_tokens=4 + 60 * (i % 4), ignore_eos=True)))

        for _ in range(6):
            add()
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps in (5, 40, 90):
                for _ in range(3):
                    add()
        engine.close()
        outs.append([s.output_token_ids for s in seqs])
        captured.append((set(graphs.graphs), set(graphs.mixed)))
        assert engine.scheduler.blocks.num_free_blocks == 512
    assert outs[1] == outs[0]
    (all_decode, all_mixed), (decode, mixed) = captured
    assert decode < all_decode and mixed < all_mixed and len(decode) + len(mixed) > 2


def test_faults_on_cuda_are_contained(hf_and_ours, monkeypatch):
    """Issue 10 on the GPU path (async scheduling, CUDA graphs): an out-of-memory forward is
    retried, a request whose logits turn NaN fails alone, the others run to their length."""
    from runtime.engine.faults import RequestFailed
    from tests.tiny import patch_forward

    _, model = hf_and_ours
    embed = model.params.embed.clone()
    embed[7] = float("nan")  # a token whose embedding poisons whoever reads it
    poisoned = dataclasses.replace(model, params=dataclasses.replace(model.params, embed=embed))
    calls = {"n": 0}

    def flaky_forward(batch, real):  # (decode steps replay graphs: this runs the prefills)
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(batch)

    engine = EngineCore(poisoned, EngineConfig(block_size=16, num_blocks=512, max_model_len=1024,
                                               async_scheduling=True))
    patch_forward(monkeypatch, flaky_forward)  # (after the graphs are captured)
    good = [engine.add_request(list(range(100 + i, 130 + 7 * i)), SamplingParams(temperature=0.8, seed=i,
                                                                                 max_tokens=12, ignore_eos=True))
            for i in range(6)]
    bad = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.close()
    assert calls["n"] >= 3 and bad.finish_reason == "error" and isinstance(bad.error, RequestFailed)
    assert "non-finite" in str(bad.error)
    assert all(s.finish_reason == "length" and len(s.output_token_ids) == 12 for s in good)
    assert engine.scheduler.blocks.num_free_blocks == 512


# --- one token's layer parts with the norms, SwiGLU and residual adds inside the GEMVs (issue 35) ---

@pytest.mark.parametrize("form", ["bf16", "int8", "fp8", "int4"])
@pytest.mark.parametrize("hidden,inter", [(1024, 3072), (2048, 8192), (576, 1536)])
def test_fused_layer_parts_equal_the_unfused_ones(form, hidden, inter):
    """nanoinfer.backends.cuda.fused_layers at one token against nanoinfer.model.decoder's parts: the same roundings,
    so the same bf16 numbers up to the order of the fp32 sums (one bf16 step at most). (4-bit
    weights: SwiGLU and the last residual in the int4 GEMV's epilogues; under a RankSum only the
    lead rank adds the residual.)"""
    from nanoinfer.backends.cuda import batched_layers
    from nanoinfer.backends.cuda import fused_layers
    from nanoinfer.model import decoder as model
    from nanoinfer.quant import quantized
    from nanoinfer.backends.cuda import row_kernels
    from nanoinfer.model.config import ModelConfig
    from nanoinfer.backends.cuda.linear import linear
    from nanoinfer.loaders.quantize import int4_groups

    g = torch.Generator(device="cuda").manual_seed(hidden + inter)
    heads, d = hidden // 64, 64
    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                      num_layers=1, num_heads=heads, num_kv_heads=heads, head_dim=d, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)

    def weight(n, k):
        dense = torch.randn(n, k, device="cuda", generator=g) * k**-0.5
        if form == "int8":
            return quantized.Int8Weight.quantize(dense, torch.float32)
        if form == "int4":
            return quantized.Int4CudaWeight.from_groups(int4_groups(dense))
        return quantized.Fp8Weight.quantize(dense) if form == "fp8" else dense.bfloat16()

    norm = (torch.rand(hidden, device="cuda", generator=g) + 0.5).bfloat16()
    lp = model.LayerParams(attn_norm=norm, qkv_proj=weight(3 * hidden, hidden), qkv_bias=None, q_norm=None,
                           k_norm=None, o_proj=weight(hidden, hidden),
                           mlp_norm=norm.flip(0).contiguous(), gate_up_proj=weight(2 * inter, hidden),
                           down_proj=weight(hidden, inter))
    x = (torch.randn(1, hidden, device="cuda", generator=g) * 4).bfloat16()
    attn = torch.randn(1, heads, d, device="cuda", generator=g).bfloat16()
    pairs = [(fused_layers.qkv_projection(x, lp, cfg, linear), model.qkv_projection(x, lp, cfg, linear)),
             (fused_layers.attention_output_and_mlp(x, attn, lp, cfg, linear),
              model.attention_output_and_mlp(x, attn, lp, cfg, linear))]
    for got, want in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=2**-7 * want.abs().max().item())
    # Two tokens, or a tensor-parallel sum between a projection and its residual: the row kernels' parts.
    x2 = x.repeat(2, 1)
    assert torch.equal(fused_layers.qkv_projection(x2, lp, cfg, linear),
                       batched_layers.qkv_projection(x2, lp, cfg, linear))
    double = lambda t: t * 2  # noqa: E731
    assert torch.equal(fused_layers.attention_output_and_mlp(x, attn, lp, cfg, linear, double),
                       batched_layers.attention_output_and_mlp(x, attn, lp, cfg, linear, double))
    if form == "int4":
        lead, other = (fused_layers.attention_output_and_mlp(x, attn, lp, cfg, linear, model.RankSum(lambda t: t, lead))
                       for lead in (True, False))
        assert torch.equal(lead, pairs[1][0])
        residual, _ = row_kernels.add_rms_norm(x, linear(attn.reshape(1, hidden), lp.o_proj), lp.mlp_norm, 1e-5)
        assert torch.allclose((other.float() + residual.float()), lead.float(), rtol=2**-7,
                              atol=2**-7 * lead.abs().max().item())


# --- quantized weights (issue 12) ---------------------------------------------------------------

@pytest.mark.parametrize("form,dtype,head_dim,kv_heads,slot", [
    ("bf16", torch.bfloat16, 64, 8, 37), ("bf16", torch.float16, 128, 2, 0), ("int8", torch.bfloat16, 64, 4, 5),
    ("fp8", torch.bfloat16, 128, 8, 100), ("bf16", torch.bfloat16, 64, 4, -1), ("int8", torch.float16, 96, 2, 9),
    ("int4", torch.bfloat16, 64, 8, 37), ("int4", torch.float16, 128, 2, 0), ("int4", torch.bfloat16, 96, 4, -1)])
def test_qkv_rope_and_write_in_one_kernel_equals_the_two(form, dtype, head_dim, kv_heads, slot):
    """QKV's GEMV with RoPE and the KV write in its epilogue against the GEMV, then rope_write's
    kernel (itself checked against the fp32 composition above); untouched slots stay as they were;
    q/k norms and an fp8 pool take the two kernels."""
    from nanoinfer.backends.cuda import fused_layers
    from nanoinfer.model import decoder as model
    from nanoinfer.quant import quantized
    from nanoinfer.backends.cuda.linear import linear
    from nanoinfer.model.layers import rope_cos_sin, rope_inv_freq
    from nanoinfer.loaders.quantize import int4_groups
    from nanoinfer.backends.cuda.rope_write import rope_and_write
    from tests.tiny import tiny_config

    g = torch.Generator(device="cuda").manual_seed(head_dim + slot)
    heads, hidden, bs = 4 * kv_heads, 1024, 16
    cfg = tiny_config(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, num_layers=1)
    dense = torch.randn(cfg.q_size + 2 * cfg.kv_size, hidden, device="cuda", generator=g) * hidden**-0.5
    w = {"int8": lambda: quantized.Int8Weight.quantize(dense, torch.float32),
         "int4": lambda: quantized.Int4CudaWeight.from_groups(int4_groups(dense)),
         "fp8": lambda: quantized.Fp8Weight.quantize(dense)}.get(form, lambda: dense.to(dtype))()
    norm = (torch.rand(hidden, device="cuda", generator=g) + 0.5).to(dtype)
    lp = model.LayerParams(attn_norm=norm, qkv_proj=w, qkv_bias=None, q_norm=None, k_norm=None, o_proj=None,
                           mlp_norm=None, gate_up_proj=None, down_proj=None)
    x = (torch.randn(1, hidden, device="cuda", generator=g) * 3).to(dtype)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg).cuda(), torch.tensor([1234], device="cuda"), dtype)
    slots = torch.tensor([slot], device="cuda")
    kv = torch.randn(2, 8, bs, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    ours, theirs = kv.clone(), kv.clone()
    q = fused_layers.qkv_rope_and_write(x, lp, cfg, linear, cos, sin, ours, slots)
    q_ref = rope_and_write(fused_layers.qkv_projection(x, lp, cfg, linear), None, None, cos, sin, theirs, slots, cfg)
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype
    assert torch.allclose(q.float(), q_ref.float(), rtol=2**-7, atol=2**-7 * q_ref.abs().max().item())
    assert torch.allclose(ours.float(), theirs.float(), rtol=2**-7, atol=2**-7 * theirs.abs().max().item())
    untouched = torch.ones(8 * bs, dtype=torch.bool, device="cuda")
    if slot >= 0:
        untouched[slot] = False
    assert torch.equal(ours.view(2, 8 * bs, -1)[:, untouched], kv.view(2, 8 * bs, -1)[:, untouched])
    # q/k norms (Qwen3), or an fp8 pool: rope_write's kernel after the GEMV, as the reference.
    q_norm = (torch.rand(head_dim, device="cuda", generator=g) + 0.5).to(dtype)
    normed = dataclasses.replace(lp, q_norm=q_norm, k_norm=q_norm.flip(0).contiguous())
    cfg_qk = dataclasses.replace(cfg, qk_norm=True)
    assert torch.equal(fused_layers.qkv_rope_and_write(x, normed, cfg_qk, linear, cos, sin, ours, slots),
                       rope_and_write(fused_layers.qkv_projection(x, normed, cfg_qk, linear), normed.q_norm,
                                      normed.k_norm, cos, sin, theirs, slots, cfg_qk))
    fp8 = kv.to(torch.float8_e4m3fn)
    assert torch.equal(fused_layers.qkv_rope_and_write(x, lp, cfg, linear, cos, sin, fp8.clone(), slots),
                       rope_and_write(fused_layers.qkv_projection(x, lp, cfg, linear), None, None, cos, sin, fp8, slots,
                                      cfg))


@pytest.mark.parametrize("form,rows", [("int8", 1), ("int8", 2), ("int8", 3), ("int8", 16), ("fp8", 1)])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1000, 1000), (7, 64), (151936, 1024), (14336, 4096)])
def test_gemv_of_quantized_weights_matches_its_dequantized_reference(form, rows, n, k):
    """int8 at 1-16 rows (two: on CUDA cores up to 8,192 output rows, past them on tensor
    cores), fp8 at one (several rows of fp8 scale their activations too:
    test_batched_quantized_matmul_matches_the_cpu_reference)."""
    from nanoinfer.quant import quantized
    from nanoinfer.backends.cuda.linear import linear

    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    dense = torch.randn(n, k, device="cuda", generator=g) * k**-0.5
    w = quantized.Int8Weight.quantize(dense, torch.float32) if form == "int8" else quantized.Fp8Weight.quantize(dense)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = x.float() @ quantized.dequantize(w).T
    out = linear(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # The weight widened exactly in registers, fp32 sums: one bf16 rounding of the result.
    assert torch.allclose(out.float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


@pytest.mark.parametrize("form", ["int8", "fp8"])
@pytest.mark.parametrize("tokens", [2, 17, 256])
def test_batched_quantized_matmul_matches_the_cpu_reference(form, tokens):
    from nanoinfer.quant import quantized

    n, k = 3072, 1024
    g = torch.Generator().manual_seed(tokens)
    dense = torch.randn(n, k, generator=g) * k**-0.5
    x = torch.randn(tokens, k, generator=g).bfloat16()
    w = quantized.Int8Weight.quantize(dense, torch.float32) if form == "int8" else quantized.Fp8Weight.quantize(dense)
    ref = quantized.linear(x.float(), w) if form == "fp8" else x.float() @ quantized.dequantize(w).T
    gpu = quantized.linear(x.cuda(), quantized.map_weight(lambda t: t.cuda(), w)).float().cpu()
    tol = 2**-6 * ref.abs().max().item()
    assert torch.allclose(gpu, ref, rtol=2**-6, atol=tol)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 300])
@pytest.mark.parametrize("n,k,group", [(4096, 1024, 128), (1000, 1024, 32), (7, 256, 64), (14336, 4096, 128),
                                       (3072, 1536, 256)])
@pytest.mark.parametrize("halves,reordered", [(True, False), (False, False), (False, True)],
                         ids=["fp16_scales", "fp32_scales", "act_order"])
def test_int4_mm_matches_its_dequantized_reference(rows, n, k, group, halves, reordered):
    """nanoinfer.backends.cuda.int4_gemv's 4-bit kernels (the GEMV at one row, the tensor-core GEMM past it)
    against x @ dequantize(w).T in fp32, with fp16 or fp32 scales and reordered inputs."""
    from nanoinfer.quant import quantized
    from nanoinfer.backends.cuda.linear import linear

    g = torch.Generator().manual_seed(n + k + rows + group)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 / k**0.5 + 1e-3 / k**0.5
    low = -8 * scale if halves else -scale * torch.randint(0, 16, scale.shape, generator=g)
    scale, low = (scale.half().float(), low.half().float()) if halves else (scale, low * (1 + 2**-13))
    cols = torch.randperm(k, generator=g) if reordered else None
    w = quantized.Int4CudaWeight.from_groups(quantized.GroupedWeight(q, scale, low, 4, cols))
    assert (w.scale.dtype == torch.float16) == halves
    w = quantized.map_weight(lambda t: t.cuda(), w)
    x = torch.randn(rows, k, generator=g).bfloat16().cuda()
    ref = x.float() @ quantized.dequantize(w).T
    out = linear(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # One row: exact products summed in fp32 (on CUDA cores, or tensor cores with 128 + q in
    # bf16), one bf16 rounding of the result; more: each weight rounded to bf16 before its product.
    tol = (2**-7 if rows == 1 else 2**-6) * ref.abs().max().item()
    assert torch.allclose(out.float(), ref, rtol=2**-6, atol=tol)


@pytest.mark.parametrize("n,k,group", [(4096, 1024, 128), (1000, 1024, 32), (3072, 1536, 256)])
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda_cores", "tensor_cores"])
def test_int4_gemv_bodies_match_the_reference_in_fp16_and_bf16(n, k, group, tensor_cores):
    """Each body of the one-row kernel (the tuning picks one per shape, so both are run here by
    hand) with fp16 inputs (tensor cores: nibbles as 1024 + q in fp16) and bf16 ones, against the
    fp32 dequantized reference; with the epilogues too (SwiGLU over interleaved rows: 500 units
    leave a partial block; the residual), against the plain product put through the same ops."""
    import triton

    from nanoinfer.backends.cuda import int4_gemv
    from nanoinfer.quant import quantized

    g = torch.Generator().manual_seed(n + k + group)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 / k**0.5 + 1e-3 / k**0.5
    low = -scale * torch.randint(0, 16, scale.shape, generator=g)
    w = quantized.map_weight(lambda t: t.cuda(), quantized.Int4CudaWeight.from_groups(
        quantized.GroupedWeight(q, scale, low, 4)))
    config = (dict(TC=True, BLOCK_N=16, GROUPS=1, SPLIT=4) if tensor_cores
              else dict(TC=False, BLOCK_N=32, GROUPS=4, SPLIT=1))
    for dtype, tol in ((torch.float16, 2**-9), (torch.bfloat16, 2**-7)):
        x = torch.randn(1, k, generator=g).to(dtype).cuda()
        ref = x.float() @ quantized.dequantize(w).T
        out = torch.empty(1, n, dtype=dtype, device="cuda")
        int4_gemv._int4_gemv_kernel.fn[(triton.cdiv(n, config["BLOCK_N"]),)](
            *int4_gemv.int4_gemv_args(x, w.packed, w.scale, w.min, out), GROUP=group, HALF=False, num_warps=4,
            num_stages=3, **config)
        assert torch.allclose(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item()), dtype
        res = torch.randn(1, n, generator=g).to(dtype).cuda()
        for silu, residual, want in ((True, None, F.silu(out[:, :n // 2]) * out[:, n // 2:]), (False, res, out + res)):
            got = torch.empty_like(want)
            int4_gemv._int4_gemv_kernel.fn[(triton.cdiv(n, config["BLOCK_N"]),)](
                *int4_gemv.int4_gemv_args(x, w.packed, w.scale, w.min, got, residual), GROUP=group, HALF=False,
                SILU=silu, RESIDUAL=residual is not None, num_warps=4, num_stages=3, **config)
            assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item()), silu


@pytest.mark.parametrize("form", ["int8", "fp8", "int4"])
def test_quantized_batch1_path_is_as_close_to_its_weights_as_bf16(hf_and_ours, form):
    """The fused batch-1 path over quantized weights (GEMVs, fused RoPE) against the same
    weights dequantized in fp32, as close as the bf16 model is to fp32; CUDA graphs replay it
    exactly. (Token agreement with bf16 is no test here: this random model's quantization error
    alone moves its logits by 11% RMS for int8. Quality on a real model: bench/RESULTS.md.)"""
    from nanoinfer.quant import quantized
    from nanoinfer.loaders.quantize import PROJECTIONS, quantize_params

    _, model = hf_and_ours
    cfg, bs = model.config, 16
    params = quantize_params(model.params, form)
    p32 = map_params(torch.Tensor.float, model.params)
    oracle = dataclasses.replace(p32, lm_head=quantized.dequantize(params.lm_head), layers=tuple(
        dataclasses.replace(lp, **{n: quantized.dequantize(getattr(q, n)) for n in PROJECTIONS})
        for lp, q in zip(p32.layers, params.layers)))
    kv, backend = random_pool_and_backend(cfg, bs)
    parts = cuda_layer_functions()
    decode = build_batch([SeqChunk([3], 40, list(range(20, 23)), True)], bs, "cuda")
    with torch.inference_mode():
        fused = forward(params, kv.clone(), decode, cfg, backend, parts)
        exact = forward(oracle, kv.float(), decode, cfg)
        bf16_err = (forward(model.params, kv.clone(), decode, cfg, backend)
                    - forward(p32, kv.float(), decode, cfg)).abs().max().item()
    err = (fused - exact).abs().max().item()
    assert err <= 1.5 * bf16_err + 1e-2, (err, bf16_err)
    graphs = StepGraphs(lambda b: (forward(params, kv, b, cfg, backend, parts),), kv.device, max_batch=2,
                        max_blocks=16, buckets=(1, 2))
    graphs.capture()
    with torch.inference_mode():
        assert torch.equal(forward(params, kv, decode, cfg, backend, parts).clone(), graphs.run(decode)[0].clone())


@pytest.mark.parametrize("form", ["int8", "fp8", "int4"])
def test_quantized_engine_serves_mixed_batches(hf_and_ours, form):
    """Prefill chunks (batched quantized matmuls of odd row counts), decode graphs (GEMVs at
    batch 1, batched matmuls beyond), sampling: every request finishes, every block comes back."""
    from nanoinfer.loaders.quantize import quantize_params

    _, model = hf_and_ours
    quant = dataclasses.replace(model, params=quantize_params(model.params, form), quantization=form)
    from runtime.async_engine import engine_config

    engine = EngineCore(quant, engine_config(block_size=16, num_blocks=512, max_model_len=1024,
                                             max_num_batched_tokens=96))
    seqs = [engine.add_request(list(range(100 + i, 117 + 13 * i)),
                               SamplingParams(temperature=0.7 if i % 2 else 0, seed=i, max_tokens=3 + 4 * i,
                                              ignore_eos=True)) for i in range(6)]
    while engine.has_unfinished():
        engine.step()
    engine.close()
    assert [len(s.output_token_ids) for s in seqs] == [3 + 4 * i for i in range(6)]
    assert engine.scheduler.blocks.num_free_blocks == 512


def test_rope_and_write_into_an_fp8_pool():
    """The fused kernel stores k and v into an e4m3 pool: what the bf16 kernel stores, rounded
    once more (within one e4m3 step), values past 448 saturated."""
    from nanoinfer.model.kv_cache import FP8, to_kv
    from nanoinfer.model.layers import rope_cos_sin, rope_inv_freq
    from nanoinfer.backends.cuda.rope_write import rope_and_write
    from tests.tiny import tiny_config

    cfg = tiny_config(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=128, num_layers=1)
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, bs = 21, 16
    qkv = torch.randn(tokens, cfg.q_size + 2 * cfg.kv_size, device="cuda", dtype=torch.bfloat16, generator=g) * 300
    positions = torch.randint(0, 5000, (tokens,), device="cuda", generator=g)
    slots = torch.randperm(4 * bs, device="cuda", generator=g)[:tokens]
    slots[::4] = -1
    cos, sin = rope_cos_sin(rope_inv_freq(cfg).cuda(), positions, torch.bfloat16)
    wide = torch.zeros(2, 4, bs, 4, 128, device="cuda", dtype=torch.bfloat16)
    narrow = torch.zeros(2, 4, bs, 4, 128, device="cuda", dtype=FP8)
    q_wide = rope_and_write(qkv, None, None, cos, sin, wide, slots, cfg)
    q_narrow = rope_and_write(qkv, None, None, cos, sin, narrow, slots, cfg)
    assert torch.equal(q_wide, q_narrow)
    assert not narrow.float().isnan().any() and narrow.float().abs().max() == 448
    expected = to_kv(wide, FP8).float()
    assert ((narrow.float() - expected).abs() <= 2**-3 * expected.abs() + 2**-9).all()


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_speculative_decoding_on_cuda_agrees_up_to_near_ties(hf_and_ours, method):
    """Verification steps replay the small mixed graphs, the draft its own graphs; greedy
    tokens equal decoding without speculation up to near-ties (bf16: the verify step sums in
    another order than a decode step). The target drafting for itself accepts nearly all."""
    _, model = hf_and_ours
    prompts = [list(range(1000, 1012)) * 3, [151, 2000, 37, 9, 444] * 4, list(range(300, 340))]
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False} if method == "ngram" else
            {"model": "in-memory", "num_speculative_tokens": 3, "adaptive": False})
    runs = []
    for config in (None, spec):
        engine = EngineCore(model, engine_config(block_size=16, num_blocks=512, max_model_len=1024, max_num_seqs=16,
                                                speculative_config=config),
                            draft_model=model if config and "model" in config else None)
        seqs, logprobs = greedy_with_logprobs(engine, prompts, 40)
        if config is not None and "model" in config:
            assert engine.executor.draft.graphs is not None
        if config is not None:
            assert engine.executor.graphs.token_buckets[0] < 16  # verification steps have graphs
        engine.close()  # (and its graphs with it)
        assert engine.scheduler.blocks.num_free_blocks == 512
        runs.append(([s.output_token_ids for s in seqs], [logprobs[s] for s in seqs], engine.stats()))
    stats = runs[1][2]
    if method == "self-draft":  # (n-gram lookup drafts only where a random model's output repeats)
        # Nearly all: a random model's logits are full of near-ties, which the verify step and
        # the draft's decode steps round differently (more so through the tensor-parallel path,
        # whose all-reduces split the compiled fusions: 84% seen there, 90%+ without).
        assert stats["spec_accepted_tokens"] >= 0.8 * stats["spec_draft_tokens"] > 0
    for ours, theirs, our_lp, their_lp in zip(runs[1][0], runs[0][0], runs[1][1], runs[0][1]):
        if ours == theirs:
            continue
        i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        assert theirs[i] in [t for t, _ in our_lp[i].top] and ours[i] in [t for t, _ in their_lp[i].top]


# --- tensor parallelism (issue 15) -----------------------------------------------------------------

def test_tensor_parallel_world_of_one_over_nccl():
    """The engine's tensor-parallel path on one GPU: NCCL world of one, the gloo control group,
    the batch broadcast, the sharded forward's collectives; its logits are the plain forward's."""
    from nanoinfer.model.batch import SeqChunk, build_batch
    from nanoinfer.model.kv_cache import allocate_kv_pool
    from nanoinfer.model.decoder import EAGER, forward, map_params
    from runtime.executor.tensor_parallel import TensorParallelRanks
    from runtime.executor.tp_orders import RankSetup
    from tests.tiny import random_params, tiny_config

    cfg = tiny_config(num_heads=9, num_kv_heads=3, hidden_size=72)
    params = map_params(lambda t: t.cuda(), random_params(cfg, seed=3))
    ranks = TensorParallelRanks(cfg, params, 1)
    try:
        local_cfg, local = ranks.local(params)
        ranks.setup(RankSetup(8, 0, 4, torch.float32, True, None))
        batch = build_batch([SeqChunk([3, 14, 15, 92, 65], 0, [0, 1], True)], 4, "cuda")
        ranks.forward(batch)
        ranks.copy_blocks([(0, 1)])
        ours = forward(local, allocate_kv_pool(local_cfg, 8, 4, torch.float32, "cuda"), batch, local_cfg,
                       layer_fns=ranks.layer_functions(EAGER))
    finally:
        ranks.close()
    ref = forward(params, allocate_kv_pool(cfg, 8, 4, torch.float32, "cuda"), batch, cfg)
    assert torch.equal(ours, ref)


# --- nanochat (issue 17) ---------------------------------------------------------------------------

def test_nanochat_on_cuda_with_graphs_agrees_with_the_reference(tmp_path):
    """The nanochat forward captured in CUDA graphs (decode and mixed steps), fp32: greedy tokens
    equal the CPU reference's up to near-ties, with chunked prefills and a cached prefix."""
    from nanoinfer.loaders import load_model
    from runtime.async_engine import engine_config
    from tests.nanochat_files import nanochat_state, prompt, reference_logits, write_checkpoint

    sd = nanochat_state()
    write_checkpoint(tmp_path / "d4", sd)
    model = load_model(tmp_path / "d4", device="cuda", dtype="float32", progress=False)
    engine = EngineCore(model, engine_config(block_size=16, num_blocks=64, max_num_batched_tokens=48,
                                             max_model_len=256))
    assert engine.executor.graphs is not None
    first = prompt(140, seed=2)
    prompts = [first, first[:70] + prompt(9, seed=3)]
    outs = greedy_one_after_another(engine, prompts, 10)
    engine.close()
    assert engine.stats()["prefix_cache_hits"] > 0
    for ids, ours in zip(prompts, outs):
        # (each of our tokens' logits, the reference's)
        assert_argmax_up_to_near_ties(reference_logits(sd, ids + ours)[len(ids) - 1:-1], ours)


def greedy_one_after_another(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, run to its end before the next is added (the next may find its prefix cached)."""
    outs = []
    for ids in prompts:
        seq = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        outs.append(seq.output_token_ids)
    return outs


def assert_argmax_up_to_near_ties(ref: torch.Tensor, ours: list[int]) -> None:
    """Each of `ours` is the argmax of its row of the reference's logits `ref`, or within 1e-3 of it."""
    top2 = ref.topk(2, dim=-1)
    for i, token in enumerate(ours):
        assert token == int(top2.indices[i, 0]) or top2.values[i, 0] - ref[i, token] < 1e-3, (i, token)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_on_cuda_with_graphs_agrees_with_transformers(family, tmp_path):
    """Gemma on CUDA: CUDA's layer parts (its sandwich norms and GeGLU in the row kernels) around the Triton
    attention with Gemma 2's soft-cap, windowed and global layers, captured in CUDA graphs; fp32 greedy tokens are
    transformers' (CPU, fp32) up to near-ties, with a chunked prefill and a decode past the window."""
    from nanoinfer.loaders import load_model
    from runtime.async_engine import engine_config
    from tests.test_hf_models import CASES, random_model

    name, config_cls, fields = next(c for c in CASES if c[0].startswith(family))
    hf_model = random_model(name, config_cls, fields)
    hf_model.save_pretrained(tmp_path)
    model = load_model(tmp_path, device="cuda", dtype="float32", progress=False)
    engine = EngineCore(model, engine_config(block_size=16, num_blocks=64, max_num_batched_tokens=32,
                                             max_model_len=256))
    assert engine.executor.graphs is not None and engine.executor.kernels.layer_fns == cuda_layer_functions(model.config)
    prompts = [[5, 17, 33, 9], list(range(3, 60))]  # (the second: two prefill chunks, past the window of 8)
    outs = greedy_one_after_another(engine, prompts, 24)
    engine.close()
    for ids, ours in zip(prompts, outs):
        with torch.no_grad():
            assert_argmax_up_to_near_ties(hf_model(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1], ours)


# --- structured output (issue 18) ------------------------------------------------------------------

def test_structured_output_with_graphs_async_scheduling_and_speculation(hf_and_ours, tmp_path):
    """Constrained rows bypass the graphs' in-graph argmax and mask on the device; a step that
    masked waits before the next is planned. Greedy tokens: the same with and without async
    scheduling; every output follows its grammar, with n-gram verification too."""
    import json
    import re

    from tests.tiny import byte_level_tokenizer

    _, model = hf_and_ours
    model = dataclasses.replace(model, tokenizer=byte_level_tokenizer(tmp_path / "tok"))
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    specs = [{"json": person}, {"regex": "[a-f]{2,5}-[0-9]{1,2}"}, {"choice": ["red", "green", "blue"]}]
    runs = []
    for args in ({"async_scheduling": False}, {"async_scheduling": True},
                 {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}}):
        engine = EngineCore(model, engine_config(block_size=16, num_blocks=512, max_model_len=1024, **args))
        seqs = []
        for i in range(9):
            spec = specs[i % 3] if i < 6 else None  # (the last three free, in the same batches)
            seqs.append(engine.add_request(list(range(100 + i, 120 + 5 * i)), SamplingParams(
                temperature=0 if i % 2 == 0 else 0.9, seed=i, max_tokens=40, ignore_eos=spec is None,
                structured_outputs=spec)))
        while engine.has_unfinished():
            engine.step()
        engine.close()
        assert engine.scheduler.blocks.num_free_blocks == 512
        texts = [model.tokenizer.decode(s.output_token_ids) for s in seqs]
        for i, (s, text) in enumerate(zip(seqs[:6], texts)):
            assert s.finish_reason == "stop", (i, text)
            if i % 3 == 0:
                value = json.loads(text)
                assert set(value) == {"name", "age"} and 0 <= value["age"] <= 99
            elif i % 3 == 1:
                assert re.fullmatch("[a-f]{2,5}-[0-9]{1,2}", text)
            else:
                assert text in ("red", "green", "blue")
        runs.append([s.output_token_ids for s in seqs])
    assert runs[0] == runs[1]


def test_pinned_staging_copies_what_the_allocators_buffers_copy():
    """A step loop's PinnedStaging (its buffers reused in turn, each once its copy has run) against a fresh
    pinned buffer per copy: the same tensors, over more copies than it has buffers, queued behind slow work so
    that a buffer written again too early would corrupt an earlier copy."""
    from nanoinfer.backends.host_copy import PinnedStaging, to_device_packed

    staging, rng = PinnedStaging(torch.device("cuda"), slots=3), torch.Generator().manual_seed(0)
    ours, fresh = [], []
    for step in range(20):
        torch.cuda._sleep(2_000_000)  # (the copies wait behind this on the stream)
        arrays = [torch.randint(0, 1 << 40, (int(n),), generator=rng).numpy()
                  for n in torch.randint(1, 3000, (3,), generator=rng)]
        ours.append(to_device_packed(arrays, torch.int64, "cuda", staging))
        fresh.append(to_device_packed(arrays, torch.int64, "cuda"))
    torch.cuda.synchronize()
    for got, want in zip(ours, fresh):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_closed_engine_gives_the_gpu_memory_back():
    """Issue 64: after `with LLM(...)` a Qwen3-shaped engine (weights, KV pool, CUDA graphs) leaves the GPU's
    memory as it found it, so the next model fits: nothing of it allocated, and the caching allocator's
    segments given back (alone in a process, all of them, measured; here at least 90%: the rest share
    segments with the other tests' tensors)."""
    import gc

    from bench.shapes import random_model
    from nanoinfer import LLM

    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    with LLM.from_loaded(random_model("qwen3-0.6b"), gpu_memory_utilization=0.3) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert torch.cuda.memory_allocated() > before[0] + 2**30
        added = torch.cuda.memory_reserved() - before[1]
    assert torch.cuda.memory_allocated() <= before[0] + 2**20
    assert torch.cuda.memory_reserved() - before[1] <= 0.1 * added
