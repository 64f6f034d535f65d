"""The fp8 (e4m3) KV cache on the CPU paths: stores saturate instead of overflowing to NaN,
readers widen exactly what was stored, the batched attention equals the reference on an fp8
pool, and an engine with `kv_cache_dtype="fp8"` holds twice the blocks and decodes like bf16's."""

import pytest
import torch

from nanoinfer.attention.reference import REFERENCE
from nanoinfer.attention.torch_paged import TorchPagedAttention
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.model.kv_cache import FP8, kv_bytes_per_block, to_kv
from nanoinfer.loaders import LoadedModel
from nanoinfer.model.decoder import LayerFunctions, qkv_projection
from nanoinfer.backends.cpu.rope_write_cpu import rope_and_write, rope_tables
from nanoinfer.sampling.sampling_params import SamplingParams
from runtime.async_engine import engine_config
from runtime.engine.engine_core import EngineCore
from tests.tiny import random_params, tiny_config


def test_stores_saturate_and_round_to_nearest():
    x = torch.tensor([1000.0, -1e6, 448.0, 1.0625, 0.0, -3.3])
    got = to_kv(x, FP8)
    assert got.dtype == FP8 and not got.float().isnan().any()
    assert got.float().tolist()[:3] == [448.0, -448.0, 448.0]
    assert got.float()[3] in (1.0, 1.125) and got.float()[5] == -3.25  # e4m3: 3 mantissa bits
    assert to_kv(x, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("window", [None, 5])
def test_fp8_pool_attention_equals_the_reference_on_the_widened_pool(window):
    cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=window)
    g = torch.Generator().manual_seed(0)
    pool = to_kv(torch.randn(2, 12, 4, 2, 8, generator=g) * 3, FP8)
    chunks = [SeqChunk([1] * 6, 0, [1, 2], True), SeqChunk([2], 9, [3, 4, 5], True), SeqChunk([3], 3, [6], True),
              SeqChunk([4], 19, [7, 8, 9, 10, 11, 0, 0, 0], True)]
    batch = build_batch(chunks, 4)
    q = torch.randn(batch.num_tokens, 4, 8, generator=g)
    expected = REFERENCE.attention(q, pool.float(), REFERENCE.prepare(batch, cfg, window))
    for backend in (REFERENCE, TorchPagedAttention(4)):
        got = backend.attention(q, pool, backend.prepare(batch, cfg, window))
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_cpu_rope_and_write_stores_what_the_reference_stores():
    cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=16)
    params = random_params(cfg)
    lp = params.layers[0]
    batch = build_batch([SeqChunk([3, 1, 4, 1, 5], 0, [1, 2], True)], 4)
    x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * 30
    ref, got = torch.zeros(2, 4, 4, 2, 16, dtype=FP8), torch.zeros(2, 4, 4, 2, 16, dtype=FP8)
    cos, sin = LayerFunctions().rope_tables(params.rope_inv_freq, batch.positions, torch.float32)
    _, k, v = LayerFunctions().attention_inputs(x, lp, cos, sin, cfg)
    REFERENCE.write_kv(ref, k, v, batch.slot_mapping)
    cos, sin = rope_tables(params.rope_inv_freq, batch.positions, torch.float32)
    rope_and_write(qkv_projection(x, lp, cfg), None, None, cos, sin, got, batch.slot_mapping, cfg)
    # (RoPE's sums may differ in the last fp32 bit, which can land on either side of an fp8 step)
    assert (got.float() - ref.float()).abs().max() <= 2 ** -3 * ref.float().abs().max()


def test_engine_with_an_fp8_cache_holds_twice_the_blocks_and_decodes_like_fp32():
    cfg = tiny_config(vocab_size=97, num_layers=2)
    model = LoadedModel(cfg, random_params(cfg, seed=3), None, __import__("pathlib").Path("tiny"))
    assert kv_bytes_per_block(cfg, 16, FP8) * 4 == kv_bytes_per_block(cfg, 16, torch.float32)
    outs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        engine = EngineCore(model, engine_config(kv_cache_memory=2**20, kv_cache_dtype=kv_cache_dtype))
        assert engine.executor.kv.dtype == (FP8 if kv_cache_dtype == "fp8" else torch.float32)
        outs[kv_cache_dtype] = engine.executor.num_blocks
        seqs = [engine.add_request([5 + i, 9, 2, 7, 1, 8][: 3 + i], SamplingParams(temperature=0, max_tokens=10,
                                                                                ignore_eos=True)) for i in range(3)]
        while engine.has_unfinished():
            engine.step()
        outs[kv_cache_dtype, "tokens"] = [s.output_token_ids for s in seqs]
    assert outs["fp8"] == 4 * outs["auto"]  # fp32 model: a quarter of the bytes per block
    agree = sum(a == b for x, y in zip(outs["auto", "tokens"], outs["fp8", "tokens"]) for a, b in zip(x, y))
    assert agree >= 0.8 * 30, outs


def test_kv_cache_dtype_is_checked():
    with pytest.raises(RequestError, match="kv_cache_dtype='fp16' is invalid: expected one of \\['auto', 'fp8'\\]"):
        engine_config(kv_cache_dtype="fp16")
