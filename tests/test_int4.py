"""4-bit checkpoints: AWQ and GPTQ read as their formats define them, `quantization="int4"`, the CUDA form.

The checkpoints are written here, packed from each format's definition (AutoAWQ's and
AutoGPTQ's packing, restated independently of nanoinfer/loaders/int4.py), and what the loader
reads is held to the formula w[o, i] = scale[g, o] * (q[i, o] - zero[g, o]) exactly.
"""

from __future__ import annotations

import json

import pytest
import torch

from nanoinfer.quant import quantized
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.errors import CheckpointError, RequestError
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders import load_model
from nanoinfer.loaders.int4 import Int4Format, read_int4_matrix
from nanoinfer.loaders.quantize import int4_groups, quantize_params
from nanoinfer.model.decoder import forward
from nanoinfer.quant.quantized import GroupedWeight, Int4CudaWeight, Int8Weight
from tests.test_gguf_formats import hf_model

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_words(values: torch.Tensor) -> torch.Tensor:
    """[..., 8] ints in [0, 16) -> int32 words, value k in bits 4k..4k+3 (as numpy's uint32 wraps)."""
    word = torch.zeros(values.shape[:-1], dtype=torch.int64)
    for k in range(8):
        word |= values[..., k].to(torch.int64) << (4 * k)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def awq_tensors(q, zeros, scales):
    """q [in, out], zeros [groups, out] in [0, 16): AutoAWQ's gemm packing (output 8j + AWQ_ORDER[k]
    in nibble k of word j)."""
    def pack(t):
        cols = t.shape[1] // 8
        return pack_words(torch.stack([t[:, [8 * j + AWQ_ORDER[k] for j in range(cols)]] for k in range(8)], -1))
    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales}


def gptq_tensors(q, zeros, scales, g_idx, v1=True):
    """AutoGPTQ's packing: qweight words hold 8 consecutive inputs of one output; qzeros 8
    consecutive outputs, each zero less one in the v1 format."""
    inputs, out = q.shape
    qweight = pack_words(q.reshape(inputs // 8, 8, out).transpose(1, 2))
    stored = zeros - 1 if v1 else zeros
    return {"qweight": qweight, "qzeros": pack_words((stored & 15).reshape(zeros.shape[0], -1, 8)),
            "scales": scales, "g_idx": g_idx.to(torch.int32)}


def reference(q, zeros, scales, g_idx) -> torch.Tensor:
    """The formula, [out, in], fp32."""
    return (scales.float()[g_idx] * (q.float() - zeros.float()[g_idx])).t()


def random_layer(inputs=256, out=48, group=64, seed=0, act_order=False, zero_low=1):
    g = torch.Generator().manual_seed(seed)
    groups = inputs // group
    q = torch.randint(0, 16, (inputs, out), generator=g)
    zeros = torch.randint(zero_low, 16, (groups, out), generator=g)
    scales = (torch.rand(groups, out, generator=g) * 0.02 + 0.001).half()
    g_idx = torch.arange(inputs) // group
    if act_order:
        g_idx = g_idx[torch.randperm(inputs, generator=g)]
    return q, zeros, scales, g_idx


def read(tensors, fmt):
    return read_int4_matrix(fmt, lambda name: tensors.get(name.removeprefix("x.")), "x", "test")


def test_awq_reads_as_defined():
    q, zeros, scales, g_idx = random_layer()
    w = read(awq_tensors(q, zeros, scales), Int4Format("awq", 64, 0))
    assert isinstance(w, GroupedWeight) and w.bits == 4 and w.group == 64 and w.cols is None
    assert torch.equal(quantized.dequantize(w), reference(q, zeros, scales, g_idx))


@pytest.mark.parametrize("v1", [True, False], ids=["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in_order", "act_order"])
def test_gptq_reads_as_defined(v1, act_order):
    q, zeros, scales, g_idx = random_layer(seed=3, act_order=act_order)
    w = read(gptq_tensors(q, zeros, scales, g_idx, v1), Int4Format("gptq", 64, 1 if v1 else 0))
    assert (w.cols is not None) == act_order
    assert torch.equal(quantized.dequantize(w), reference(q, zeros, scales, g_idx))
    # Reordered, each group's inputs are contiguous: the kernels' form keeps the order.
    cuda_form = Int4CudaWeight.from_groups(w)
    assert torch.equal(quantized.dequantize(cuda_form), reference(q, zeros, scales, g_idx))
    if act_order:
        assert torch.equal(g_idx[w.cols], torch.arange(256) // 64)


def test_int4_cuda_form_round_trips_and_keeps_exact_halves():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (24, 512), generator=g, dtype=torch.uint8)
    halves = torch.rand(24, 16, generator=g).half().float()
    w = GroupedWeight(q, halves, -8 * halves, 4)  # Q4_0: every scale and min an fp16
    packed = Int4CudaWeight.from_groups(w)
    assert packed.packed.dtype == torch.int32 and packed.scale.dtype == torch.float16 and packed.group == 32
    assert torch.equal(packed.groups().q, q) and torch.equal(quantized.dequantize(packed), quantized.dequantize(w))
    odd = GroupedWeight(q, halves * (1 + 2**-14), -halves, 4)  # not fp16: kept fp32, exact
    assert Int4CudaWeight.from_groups(odd).scale.dtype == torch.float32
    assert torch.equal(quantized.dequantize(Int4CudaWeight.from_groups(odd)), quantized.dequantize(odd))
    x = torch.randn(3, 512, generator=g)
    torch.testing.assert_close(quantized.linear(x, packed), x @ quantized.dequantize(w).t())


def test_int4_groups_round_to_nearest():
    w = torch.randn(40, 384, generator=torch.Generator().manual_seed(2))
    grouped = int4_groups(w)
    assert grouped.group == 128 and grouped.q.max() <= 15
    # Scales and mins are fp16 values (CUDA stores them in 2 bytes each: 4.25 bits a weight, not
    # 4.5), and q is rounded on that grid: half a step, past the grid's ends the fp16 roundings.
    assert all(torch.equal(t.half().float(), t) for t in (grouped.scale, grouped.min))
    assert Int4CudaWeight.from_groups(grouped).scale.dtype == torch.float16
    error = (quantized.dequantize(grouped) - w).abs().unflatten(1, (-1, 128))
    ends = 2**-11 * (grouped.min.abs() + 15 * grouped.scale)
    assert (error <= grouped.scale[..., None] / 2 + ends[..., None] + 1e-6).all()
    assert int4_groups(torch.randn(4, 100)) is None  # no group size divides 100 inputs
    # A matrix whose scales or mins fp16 cannot hold keeps them in fp32.
    tiny = int4_groups(w * 1e-7)
    assert not torch.equal(tiny.scale.half().float(), tiny.scale)
    error = (quantized.dequantize(tiny) - w * 1e-7).abs().unflatten(1, (-1, 128))
    assert (error <= tiny.scale[..., None] / 2 + 1e-12).all()


def int4_checkpoint(model, directory, method: str, group: int = 32, act_order: bool = False) -> dict:
    """`model` saved as AutoAWQ / AutoGPTQ save it: every projection round-to-nearest 4-bit
    (zero points), packed per the format; returns each projection's reference matrix."""
    from safetensors.torch import save_file

    model.save_pretrained(directory)
    state = {k: v.clone() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    references = {}
    for name in [n for n in state if n.endswith("_proj.weight")]:
        w = state.pop(name).float().t()  # [in, out]
        inputs, out = w.shape
        g_idx = torch.arange(inputs) // group
        if act_order:
            g_idx = g_idx[torch.randperm(inputs, generator=torch.Generator().manual_seed(len(name)))]
        groups = inputs // group
        low = torch.stack([w[g_idx == i].amin(0) for i in range(groups)])
        high = torch.stack([w[g_idx == i].amax(0) for i in range(groups)])
        scales = ((high - low) / 15).clamp_min(1e-4).half()
        zeros = torch.round(-low / scales.float()).clamp(1, 15).long()
        q = torch.round(w / scales.float()[g_idx] + zeros[g_idx]).clamp(0, 15).long()
        prefix = name.removesuffix(".weight")
        packed = awq_tensors(q, zeros, scales) if method == "awq" else gptq_tensors(q, zeros, scales, g_idx)
        state.update({f"{prefix}.{k}": v for k, v in packed.items()})
        references[name] = reference(q, zeros, scales, g_idx)
    save_file(state, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                      "version": "gemm"} if method == "awq" else
                                     {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                                      "sym": False, "checkpoint_format": "gptq"})
    (directory / "config.json").write_text(json.dumps(config))
    return references


@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", False), ("gptq", True)],
                         ids=["awq", "gptq", "gptq_act_order"])
def test_int4_checkpoint_loads_packed_and_exact(method, act_order, tmp_path):
    model = hf_model("llama", tied=False, num_layers=2, seed=5)
    references = int4_checkpoint(model, tmp_path, method, act_order=act_order)
    packed = load_model(tmp_path, device="cpu", progress=False)
    assert packed.quantization == method
    exact = load_model(tmp_path, device="cpu", progress=False, quantization="none")
    layer = exact.params.layers[0]
    assert isinstance(layer.o_proj, torch.Tensor)
    assert torch.equal(layer.o_proj, references["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(layer.down_proj, references["model.layers.0.mlp.down_proj.weight"])
    if not act_order:  # (reordered inputs run dense on the CPU: its packed kernels read inputs in order)
        assert not isinstance(packed.params.layers[0].o_proj, torch.Tensor)

    tokens = [5, 200, 33, 9, 128, 64, 1]
    batch = build_batch([SeqChunk(tokens, 0, [0], True)], 16)._replace(logits_indices=torch.arange(len(tokens)))
    kv = allocate_kv_pool(exact.config, 4, 16, torch.float32, "cpu")
    want = forward(exact.params, kv.clone(), batch, exact.config)
    got = forward(packed.params, kv.clone(), batch, packed.config)
    # The packed CPU kernels round the activations (cpu_native: int8 per group; torch's int4 kernel: bf16).
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_int4_quantization_of_any_checkpoint(tmp_path):
    model = hf_model("llama", tied=False, num_layers=2, seed=9)
    model.save_pretrained(tmp_path)
    int4 = load_model(tmp_path, device="cpu", progress=False, quantization="int4")
    assert int4.quantization == "int4" and not isinstance(int4.params.layers[0].qkv_proj, torch.Tensor)
    again = quantize_params(int4.params, "int4")  # (already 4-bit: kept)
    assert again.layers[0].qkv_proj is int4.params.layers[0].qkv_proj
    assert again.lm_head is int4.params.lm_head


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_int4_quantization_keeps_the_lm_head_in_int8(tied, tmp_path):
    # The LM head is a batch-1 step's largest read; 8 bits per row halve it and cost the
    # logits about what int8 costs any projection (4 bits there: bench/RESULTS.md's quality table).
    hf_model("llama", tied=tied, num_layers=2, seed=9).save_pretrained(tmp_path)
    exact = load_model(tmp_path, device="cpu", progress=False)
    int4 = load_model(tmp_path, device="cpu", progress=False, quantization="int4")
    head = int4.params.lm_head
    assert isinstance(head, Int8Weight) and isinstance(int4.params.embed, torch.Tensor)
    assert torch.equal(int4.params.embed, exact.params.embed)  # looked up, not multiplied: as loaded
    want = Int8Weight.quantize(exact.params.lm_head)  # round to nearest, the row's largest at 127
    assert torch.equal(head.q, want.q) and torch.equal(head.scale, want.scale)


def test_int4_format_problems_are_named(tmp_path):
    model = hf_model("llama", tied=False, num_layers=1, seed=1)
    int4_checkpoint(model, tmp_path, "awq")
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(RequestError, match="quantization='gptq'.*AWQ checkpoint"):
        load_model(tmp_path, device="cpu", progress=False, quantization="gptq")
    for change, message in (({"bits": 8}, "8 bits"), ({"version": "gemv"}, "version 'gemv'"),
                            ({"quant_method": "bitsandbytes"}, "'bitsandbytes'")):
        (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {
            **config["quantization_config"], **change}}))
        with pytest.raises(CheckpointError, match=message):
            load_model(tmp_path, device="cpu", progress=False)


@pytest.mark.parametrize("file, text, words", [
    ("quantize_config.json", "[1]", ["quantize_config.json", "holds a list"]),
    ("quantize_config.json", "{not json", ["quantize_config.json", "not valid JSON"]),
    ("config.json", None, ["config.json", "quantization_config", "a list"]),
])
def test_int4_config_files_of_the_wrong_shape_are_named(file, text, words, tmp_path):
    """AutoGPTQ's quantize_config.json and config.json's quantization_config: one line naming the
    file, never a traceback nor a silent unquantized load."""
    hf_model("llama", tied=False, num_layers=1, seed=1).save_pretrained(tmp_path)
    if text is None:
        config = json.loads((tmp_path / "config.json").read_text())
        text = json.dumps({**config, "quantization_config": [4]})
    (tmp_path / file).write_text(text)
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path, device="cpu", progress=False)
    message = str(info.value)
    assert all(w in message for w in words) and "\n" not in message, message


def test_int4_error_lines_stay_short(tmp_path):
    hf_model("llama", tied=False, num_layers=1, seed=1).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "q" * 10**6}}))
    with pytest.raises(CheckpointError, match="quant_method is 'qqq") as info:
        load_model(tmp_path, device="cpu", progress=False)
    assert len(str(info.value)) < 400 + len(str(tmp_path)), str(info.value)[:1000]
