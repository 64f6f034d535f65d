"""Quantized weights: each packed CPU kernel against its dequantized reference, GGUF blocks read
without dequantizing against gguf-py's dequantization, a packed model's logits against the
exact path, and the CPU's few-op RoPE + KV write against the reference layer functions."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from nanoinfer.backends.cpu import cpu_native
from nanoinfer.quant import quantized
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders import load_model
from nanoinfer.loaders.gguf import gguf_config, load_gguf_params, open_gguf
from nanoinfer.loaders.gguf_blocks import grouped_weight
from nanoinfer.quant.kquants import KQuantWeight
from nanoinfer.model.decoder import EAGER, LayerFunctions, forward
from nanoinfer.quant.quantized import (BlockWeight, Fp8Weight, GroupedWeight, Int4Weight, Int8Weight, SplitInt8Weight,
                                       concat_rows, pack)
from nanoinfer.backends.cpu.rope_write_cpu import qkv_rope_and_write, rope_tables
from tests.tiny import prefill_logits, relative_rms
from tests.test_gguf_formats import K_QUANTS, hf_model, kquant_encode, make_kquant_representable, write_gguf
from tests.tiny import random_params, tiny_config

# A bf16 scale or activation is off by at most 2^-9 of itself; a dot product of k such terms
# by about that much of the sum of their magnitudes.
BF16 = 2.0**-8


def random_grouped(rows: int, cols: int, bits: int, seed: int) -> GroupedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.1 + 0.01
    low = -(2 ** (bits - 1)) * scale * (1 + 0.3 * torch.randn(rows, cols // 32, generator=g))
    return GroupedWeight(q, scale, low, bits)


def assert_matmul_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got ≈ x @ w.T within bf16 rounding of x and of the scales."""
    exact = x.double() @ w.double().t()
    bound = BF16 * (x.abs().double() @ w.abs().double().t()) + 1e-5
    assert ((got.double() - exact).abs() <= bound).all(), ((got.double() - exact).abs() / bound).max()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, cols, tokens", [(64, 32, 1), (96, 256, 3), (48, 160, 17), (1024, 64, 2), (97, 64, 2)])
def test_packed_grouped_matmul_equals_dequantized_reference(bits, rows, cols, tokens):
    w = random_grouped(rows, cols, bits, seed=rows + cols + bits)
    packed = pack(w)
    assert isinstance(packed, Int4Weight if bits == 4 else SplitInt8Weight) and packed.shape == (rows, cols)
    reference = quantized.dequantize(w)
    # The packed values are the grouped ones up to the bf16 rounding of scales and zeros.
    assert (quantized.dequantize(packed) - reference).abs().max() <= BF16 * reference.abs().max() * 2
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(1))
    y = quantized.linear(x, packed)
    assert y.dtype == torch.float32 and y.shape == (tokens, rows)
    assert_matmul_close(y, x, reference)
    bias = torch.randn(rows)
    torch.testing.assert_close(quantized.linear(x, packed, bias), y + bias)
    # any leading dims, as F.linear takes
    torch.testing.assert_close(quantized.linear(x[None], packed)[0], y)


@pytest.mark.parametrize("rows, cols, tokens", [(64, 32, 1), (100, 200, 5), (7, 48, 3)])
def test_int8_matmul_equals_dequantized_reference(rows, cols, tokens):
    dense = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    w = Int8Weight.quantize(dense)
    reference = quantized.dequantize(w)
    # round to nearest: within half a step of the original
    assert ((reference - dense).abs() <= w.scale.float()[:, None] * 0.5 + 1e-6 + BF16 * dense.abs()).all()
    x = torch.randn(tokens, cols)
    assert_matmul_close(quantized.linear(x, w), x, reference)


def test_rows_concat_and_embedding():
    a, b = random_grouped(32, 64, 4, seed=1), random_grouped(16, 64, 4, seed=2)
    both = concat_rows([a, b])
    assert isinstance(both, GroupedWeight)
    torch.testing.assert_close(quantized.dequantize(both), torch.cat([quantized.dequantize(a), quantized.dequantize(b)]))
    ids = torch.tensor([3, 40, 3, 0])
    torch.testing.assert_close(quantized.embedding(both, ids, torch.float32), quantized.dequantize(both)[ids])
    # Mixed forms (a Q4_K_M file's Q6_K v rows beside Q4_K q/k) meet in per-row int8.
    mixed = concat_rows([a, random_grouped(16, 64, 8, seed=3), torch.randn(8, 64)])
    assert isinstance(mixed, Int8Weight) and mixed.shape == (56, 64)
    torch.testing.assert_close(quantized.dequantize(mixed)[:32], quantized.dequantize(a),
                               atol=float(quantized.dequantize(a).abs().max()) / 127, rtol=0)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K])
def test_gguf_blocks_read_without_dequantizing_are_exact(qtype):
    rows, cols = 8, 512
    rng = np.random.default_rng(0)
    if qtype in K_QUANTS:
        data, _ = kquant_encode(qtype, rows, cols, 0.5, rng)
    else:
        data = gguf_quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    w = grouped_weight(data, qtype, rows, cols)
    assert w.bits == (8 if qtype in (QT.Q8_0, QT.Q5_0, QT.Q5_1) else 4)  # (5 bits in the 8-bit form)
    expected = torch.from_numpy(np.asarray(gguf_dequantize(data, qtype), dtype=np.float32))
    assert torch.equal(quantized.dequantize(w), expected)


PACKED_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.fixture(scope="module")
def tiny_llama():
    return hf_model("llama", tied=True, num_layers=2, seed=5)


@pytest.mark.parametrize("blocks", [True, False], ids=["block-matmul", "torch-int4"])
@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=[t.name for t in PACKED_TYPES])
def test_packed_gguf_model_matches_the_dequantized_model(qtype, blocks, tiny_llama, tmp_path, monkeypatch):
    if blocks and not cpu_native.has_block_matmul(cpu_native.library()):
        pytest.skip("cpu_native's block_matmul does not build here (no compiler, or neither x86 AVX2 nor ARM NEON)")
    monkeypatch.setattr(cpu_native, "has_block_matmul", lambda lib: blocks)
    model = copy.deepcopy(tiny_llama)
    encoded = make_kquant_representable(model, qtype) if qtype in K_QUANTS else None
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(model, path, "llama", weight_type=qtype, encoded=encoded)
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    exact = load_gguf_params(reader, cfg, torch.float32, "cpu", path, progress=False)
    packed = load_gguf_params(reader, cfg, torch.float32, "cpu", path, progress=False, packed=True)
    # K-quants stay in their super-blocks where cpu_native builds; elsewhere Q4_K goes to groups, Q5_K/Q6_K to int8.
    kind = (KQuantWeight if blocks and qtype in K_QUANTS else Int8Weight if qtype in (QT.Q5_K, QT.Q6_K)
            else BlockWeight if blocks else SplitInt8Weight if qtype == QT.Q8_0 else Int4Weight)
    assert isinstance(packed.layers[0].qkv_proj, kind) and isinstance(packed.lm_head, kind)
    # Each matrix: the file's values (q/k rows un-permuted), up to bf16 (fp16) scales, or int8 rounding.
    tolerance = 1 / 127 if kind is Int8Weight else 2 * BF16
    for lp, lp_exact in zip(packed.layers, exact.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            want = getattr(lp_exact, name)
            got = quantized.dequantize(getattr(lp, name))
            assert (got - want).abs().max() <= tolerance * want.abs().max(), name
    torch.testing.assert_close(quantized.embedding(packed.embed, torch.arange(cfg.vocab_size), torch.float32),
                               exact.embed, atol=tolerance * exact.embed.abs().max(), rtol=0)

    tokens = [5, 200, 33, 9, 128, 64, 1]
    kv = allocate_kv_pool(cfg, 4, 16, torch.float32, "cpu")
    batch = build_batch([SeqChunk(tokens, 0, [0], True)], 16)
    batch = batch._replace(logits_indices=torch.arange(len(tokens)))
    want = forward(exact, kv.clone(), batch, cfg)
    got = forward(packed, kv.clone(), batch, cfg)
    # bf16 (or per group int8) activations into every matmul: a few parts in a thousand of the logits' spread;
    # K-quants' int8 activations have one scale per 256 (llama.cpp's Q8_K), a coarser step: twice the bound.
    bound = 0.04 if kind is KQuantWeight else 0.02
    assert (got - want).abs().max() <= bound * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85


def test_quantization_choices_are_checked(tmp_path):
    with pytest.raises(RequestError, match="quantization='int3' is invalid.*'auto', 'none', 'gguf', 'int8', 'fp8', "
                                           "'int4', 'awq', 'gptq'"):
        load_model(tmp_path, quantization="int3")
    cfg_dir = tmp_path / "hf"
    hf_model("llama", tied=True, num_layers=1).save_pretrained(cfg_dir)
    with pytest.raises(RequestError, match="quantized GGUF.*not a GGUF file"):
        load_model(cfg_dir, device="cpu", quantization="gguf", progress=False)
    model = load_model(cfg_dir, device="cpu", quantization="int8", progress=False)
    assert model.quantization == "int8" and isinstance(model.params.layers[0].down_proj, Int8Weight)
    assert isinstance(model.params.lm_head, Int8Weight) and isinstance(model.params.embed, torch.Tensor)
    assert load_model(cfg_dir, device="cpu", progress=False).quantization == "none"


def test_a_quantized_gguf_runs_packed_on_the_cpu_unless_a_dtype_is_asked_for(smollm2_gguf):
    assert load_model(smollm2_gguf, device="cpu", progress=False).quantization == "gguf"
    exact = load_model(smollm2_gguf, device="cpu", dtype="float32", progress=False)
    assert exact.quantization == "none" and isinstance(exact.params.layers[0].qkv_proj, torch.Tensor)
    from nanoinfer.loaders import _resolve_quantization

    # On CUDA a GGUF stays packed when asked (its 4-bit matrices in nanoinfer.backends.cuda.int4_gemv's kernels); auto dequantizes.
    assert _resolve_quantization("gguf", torch.device("cuda"), gguf=True, quantized_file=True) == "gguf"
    assert _resolve_quantization("auto", torch.device("cuda"), gguf=True, quantized_file=True) == "none"


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rope_and_write_equals_reference_layer_functions(qk_norm, dtype):
    cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=qk_norm)
    params = random_params(cfg, dtype=dtype)
    lp = params.layers[0]
    chunks = [SeqChunk([3, 1, 4, 1, 5], 0, [1, 2], True), SeqChunk([9], 6, [3, 0], True)]
    batch = build_batch(chunks, 4)
    slots = batch.slot_mapping.clone()
    slots[2] = -1  # a padding row writes nothing
    x = torch.randn(batch.num_tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    kv_ref = torch.full((2, 5, 4, 2, 16), float("nan"), dtype=dtype)
    kv_got = kv_ref.clone()

    cos, sin = EAGER.rope_tables(params.rope_inv_freq, batch.positions, dtype)
    q_ref, k, v = EAGER.attention_inputs(x, lp, cos, sin, cfg)
    valid = slots >= 0
    kv_ref[0].view(-1, 2, 16)[slots[valid]] = k[valid]
    kv_ref[1].view(-1, 2, 16)[slots[valid]] = v[valid]

    cpu = LayerFunctions(qkv_rope_and_write=qkv_rope_and_write, rope_tables=rope_tables)
    cos, sin = cpu.rope_tables(params.rope_inv_freq, batch.positions, dtype)
    q = cpu.qkv_rope_and_write(x, lp, cfg, cpu.linear, cos, sin, kv_got, slots)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(kv_got, kv_ref, equal_nan=True, **tol)


# --- fp8 (e4m3) weights: the CPU runs their reference arithmetic -----------------------------

E4M3 = 2.0**-3  # e4m3 keeps 3 mantissa bits: rounding is within 2^-4 of a value, 2^-3 to be safe


@pytest.mark.parametrize("rows, cols, tokens", [(64, 32, 1), (48, 160, 5)])
def test_fp8_matmul_reference(rows, cols, tokens):
    g = torch.Generator().manual_seed(rows)
    dense = torch.randn(rows, cols, generator=g)
    w = Fp8Weight.quantize(dense)
    assert w.q.dtype == torch.float8_e4m3fn and w.scale.shape == (rows,)
    reference = quantized.dequantize(w)
    assert ((reference - dense).abs() <= E4M3 * dense.abs() + w.scale[:, None] * 2**-9).all()
    x = torch.randn(tokens, cols, generator=g)
    y = quantized.linear(x, w)
    exact = x.double() @ reference.double().t()
    assert ((y.double() - exact).abs() <= E4M3 * (x.abs().double() @ reference.abs().double().t()) + 1e-6).all()


def fp8_checkpoint(model, directory, per_row: bool) -> None:
    """`model` saved the way llm-compressor / fbgemm_fp8 save FP8: each projection an e4m3
    `weight` with a `weight_scale` (one per tensor, or one per row) beside it."""
    from safetensors.torch import save_file

    model.save_pretrained(directory)
    state = {k: v.clone() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    for name in list(state):
        if name.endswith("_proj.weight"):
            w = state[name].float()
            scale = w.abs().amax(dim=1, keepdim=True) / 448 if per_row else w.abs().amax() / 448
            state[name] = (w / scale).to(torch.float8_e4m3fn)
            state[name + "_scale"] = scale.float()
    save_file(state, str(directory / "model.safetensors"))


@pytest.mark.parametrize("per_row", [False, True], ids=["per_tensor", "per_row"])
def test_fp8_checkpoint_loads_as_fp8_weights(per_row, tmp_path):
    model = hf_model("llama", tied=False, num_layers=2, seed=7)
    fp8_checkpoint(model, tmp_path, per_row)
    loaded = load_model(tmp_path, device="cpu", progress=False)
    assert loaded.quantization == "fp8"
    qkv = loaded.params.layers[0].qkv_proj
    assert isinstance(qkv, Fp8Weight) and qkv.q.dtype == torch.float8_e4m3fn
    exact = load_model(tmp_path, device="cpu", progress=False, quantization="none")
    assert exact.quantization == "none" and isinstance(exact.params.layers[0].qkv_proj, torch.Tensor)
    torch.testing.assert_close(quantized.dequantize(qkv), exact.params.layers[0].qkv_proj)

    tokens = [5, 200, 33, 9, 128, 64, 1]
    batch = build_batch([SeqChunk(tokens, 0, [0], True)], 16)._replace(logits_indices=torch.arange(len(tokens)))
    kv = allocate_kv_pool(loaded.config, 4, 16, torch.float32, "cpu")
    want = forward(exact.params, kv.clone(), batch, exact.config)
    got = forward(loaded.params, kv.clone(), batch, loaded.config)
    # The activations are rounded to e4m3 too: a few percent of the logits' spread.
    assert (got - want).abs().max() <= 0.1 * want.abs().max()


def test_fp8_checkpoint_problems_name_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    model = hf_model("llama", tied=True, num_layers=1, seed=7)
    fp8_checkpoint(model, tmp_path, per_row=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    state[name + "_scale"] = torch.ones(2, 2)  # block-wise scales
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match=r"down_proj.weight_scale.*per tensor or per row"):
        load_model(tmp_path, device="cpu", progress=False)
    del state[name + "_scale"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match=r"fp8 tensor 'model.layers.0.mlp.down_proj.weight' has no"):
        load_model(tmp_path, device="cpu", progress=False)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantize_at_load_keeps_the_logits_close(quantization, tmp_path):
    hf_model("llama", tied=True, num_layers=2, seed=9).save_pretrained(tmp_path)
    exact = load_model(tmp_path, device="cpu", progress=False)
    model = load_model(tmp_path, device="cpu", progress=False, quantization=quantization)
    form = Int8Weight if quantization == "int8" else Fp8Weight
    assert all(isinstance(getattr(lp, n), form) for lp in model.params.layers
               for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert isinstance(model.params.lm_head, form) and isinstance(model.params.embed, torch.Tensor)
    got = prefill_logits(model.params, model.config)
    # int8 weights alone stay within a percent or two; fp8 rounds every activation to 3 mantissa
    # bits as well, which a random model (no outliers tamed by training) amplifies layer by layer.
    error = relative_rms(got, prefill_logits(exact.params, exact.config))
    # (measured: int8 0.022, fp8 0.104; the real model's perplexities are in bench/RESULTS.md)
    assert error <= (0.03 if quantization == "int8" else 0.15), error
    # ...and the packed path computes what its dequantized weights say, up to bf16 activations.
    dequantized = dataclasses.replace(model.params, lm_head=quantized.dequantize(model.params.lm_head), layers=tuple(
        dataclasses.replace(lp, **{n: quantized.dequantize(getattr(lp, n))
                                   for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")})
        for lp in model.params.layers))
    if quantization == "int8":
        assert relative_rms(got, prefill_logits(dequantized, model.config)) <= 0.01


@pytest.mark.parametrize("quantization", ["int8", "fp8", "int4"])
def test_each_layer_is_quantized_as_it_is_read_into_what_quantizing_after_gives(quantization, tmp_path, monkeypatch):
    """A checkpoint loaded with `quantization` has each layer quantized as the loader reads it (so a model whose
    float weights would not fit the device loads): the same weights as quantizing the float model afterwards."""
    import nanoinfer.loaders.hf as hf
    from nanoinfer.loaders.quantize import quantize_params

    hf_model("llama", tied=False, num_layers=2, seed=11).save_pretrained(tmp_path)
    after = quantize_params(load_model(tmp_path, device="cpu", progress=False).params, quantization)
    forms, build = [], hf.build_params
    monkeypatch.setattr(hf, "build_params", lambda *a, layer_form=None, **k: (
        forms.append(layer_form), build(*a, layer_form=layer_form, **k))[1])
    read = load_model(tmp_path, device="cpu", progress=False, quantization=quantization).params
    assert len(forms) == 1 and forms[0] is not None  # (the loader quantized as it read)
    for got, want in zip(read.layers, after.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert type(getattr(got, name)) is type(getattr(want, name))
            assert torch.equal(quantized.dequantize(getattr(got, name)), quantized.dequantize(getattr(want, name)))
    assert torch.equal(quantized.dequantize(read.lm_head), quantized.dequantize(after.lm_head))
