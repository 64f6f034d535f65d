"""K-quants kept in their super-blocks (nanoinfer/quant/kquants.py, cpu_native_kquants.h): the blocks read
as gguf-py reads them, the C matmul bit for bit its torch reference on every x86 tier, and whole
layers of K-quant (and mixed) matrices the same through the one-call layer as piece by piece."""

import dataclasses
import platform
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from nanoinfer.backends.cpu import cpu_layers
from nanoinfer.backends.cpu import cpu_native
from nanoinfer.quant import kquants
from nanoinfer.quant import quantized
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.quant.kquants import KQuantWeight, StackedWeight
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.loaders.params import kquant_form
from nanoinfer.model.decoder import forward
from tests.tiny import grouped, random_params, tiny_config
from tools.kquant_quantize import quantize

TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K]
X86 = platform.machine().lower() in ("x86_64", "amd64")
# The tiers' flags: as cpu_native.ISA_FLAGS builds them, AVX-VNNI without AVX-512 (vpdpwssd's
# VEX form, on CPUs that have it), AVX-512 without VNNI (the 512-bit Q4_K/Q5_K dots' vpmaddwd),
# and no AVX2 at all (the plain C loops).
TIERS = {"native": (), "avx2": ("-mno-avx512f", "-mno-avxvnni"), "avx-vnni": ("-mno-avx512f",),
         "avx512": ("-mno-avx512vnni",), "plain": ("-mno-avx2",)}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def kquant(w: torch.Tensor, qtype: QT) -> KQuantWeight:
    return KQuantWeight(torch.from_numpy(quantize(w.numpy(), int(qtype))), int(qtype), w.shape[1])


@pytest.fixture(scope="module", params=list(TIERS))
def tier_lib(request, tmp_path_factory):
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler here")
    if request.param != "native" and not X86:
        pytest.skip("x86 tiers")
    if request.param == "avx-vnni" and "avx_vnni" not in cpu_flags():
        pytest.skip("this CPU has no AVX-VNNI")
    if request.param == "avx512" and "avx512bw" not in cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    lib = cpu_native.load(tmp_path_factory.mktemp(request.param), TIERS[request.param])
    assert lib is not None
    return lib


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_blocks_read_as_gguf_py_reads_them(qtype):
    w = torch.randn(6, 512, generator=torch.Generator().manual_seed(1)) * 0.05
    kq = kquant(w, qtype)
    assert torch.equal(kquants.dequantize(kq), torch.from_numpy(gguf_dequantize(kq.data.numpy(), qtype)))
    error = float((kquants.dequantize(kq) - w).norm() / w.norm())
    assert error < {QT.Q4_K: 0.1, QT.Q5_K: 0.05, QT.Q6_K: 0.03}[qtype]  # (the quantizer is sane)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
# (tokens by 4, 2 and 1 in a pass; 200 of 1,536 columns span two of kquant_matmul_to's token tiles; from 32
# tokens on, x86 takes rows by 16 (cpu_native_kquants_tiles.h): 37 rows are 2 tiles and 5 rows left;
# interleaved (cpu_native_kquants_rows16.h) the rows go 16 a group, up to 4 tokens a pass; the last rows % 16 as stored;
# AVX2 builds take Q4_K's tiles from 256 tokens)
@pytest.mark.parametrize("out, cols, tokens", [(37, 256, 1), (64, 768, 3), (9, 1536, 5), (6, 512, 7), (9, 1536, 200),
                                               (37, 512, 40), (16, 768, 35), (48, 512, 6), (32, 2048, 1),
                                               (17, 256, 259)])
def test_kquant_matmul_equals_its_reference_bit_for_bit(tier_lib, qtype, out, cols, tokens):
    g = torch.Generator().manual_seed(out + cols)
    kq = kquant(torch.randn(out, cols, generator=g) * 0.05, qtype)
    x = (torch.randn(tokens, cols, generator=g) * 3).to(torch.bfloat16)
    x[0, :256] = 0  # a super-block of zeros (no scale to divide by)
    x[-1, -256:] *= 100  # and one far larger than the rest
    want = kquants.reference_kquant_matmul(x, kq)
    for w in layouts(kq, tier_lib):
        got = cpu_native.kquant_matmul(x, w, tier_lib, torch.float32)
        assert torch.equal(got, want)
        assert torch.equal(cpu_native.kquant_matmul(x, w, tier_lib), want.to(torch.bfloat16))
        one = [cpu_native.kquant_matmul(x[t:t + 1], w, tier_lib, torch.float32) for t in range(tokens)]
        assert torch.equal(torch.cat(one), got)  # each token by itself: the same bits
    with pytest.raises(TypeError, match="bf16 rows of"):
        cpu_native.kquant_matmul(x.float(), kq, tier_lib)


def layouts(kq: KQuantWeight, lib) -> list[KQuantWeight]:
    """`kq` as the file lays it out, and interleaved where `lib`'s kernels read that (AVX-512 VNNI); elsewhere
    an interleaved weight is refused, not misread."""
    group = cpu_native.kquant_interleave_rows(lib, kq.qtype)
    if not group:
        x = torch.zeros(1, kq.cols, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=f"reads K-quant type {kq.qtype}'s rows interleaved by 0, not by 16"):
            cpu_native.kquant_matmul(x, kquants.interleave(kq), lib)
        return [kq]
    return [kq, kquants.interleave(kq, group)]


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("out, blocks, tokens", [(1, 1, 3), (2, 3, 3), (3, 1, 3), (4, 2, 3), (6, 1, 3), (7, 8, 3),
                                                 (17, 2, 33), (16, 3, 2), (33, 2, 5)])
def test_kquant_matmul_of_any_bytes_at_any_row_count(tier_lib, qtype, out, blocks, tokens):
    """Super-blocks of random bytes (every value, scale and min the format can hold, 63s among
    them) against activations at +-127 (the int16 pairs' largest sums), at row counts around a
    pass's 4 rows (cpu_native_kquants_x86.h) and a tile's 16 (cpu_native_kquants_tiles.h, from 32
    tokens), of one and several super-blocks: the reference's bits."""
    g = torch.Generator().manual_seed(out * 100 + blocks + qtype)
    bytes_ = kquants.BLOCK_BYTES[qtype]
    data = torch.randint(0, 256, (out, blocks, bytes_), generator=g, dtype=torch.uint8)
    # the fp16 factors finite (random bytes may be inf or NaN): d, and dmin where the type has one
    at = (208,) if qtype == QT.Q6_K else (0, 2)
    for offset in at:
        factor = (torch.rand(out, blocks, generator=g) * 0.02 - 0.005).to(torch.float16)
        data[..., offset:offset + 2] = factor.view(torch.uint8).reshape(out, blocks, 2)
    kq = KQuantWeight(data.reshape(out, -1).contiguous(), int(qtype), blocks * 256)
    x = torch.randn(tokens, blocks * 256, generator=g).to(torch.bfloat16)
    x[0] = torch.where(x[0] < 0, -1.0, 1.0)  # every activation at +-127
    x[1] = x[1].abs()  # all at the same sign: the largest sums
    want = kquants.reference_kquant_matmul(x, kq)
    for w in layouts(kq, tier_lib):
        assert torch.equal(cpu_native.kquant_matmul(x, w, tier_lib, torch.float32), want)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_rows_unpacked_in_c_are_the_references_bits(tier_lib, qtype):
    """An embedding's lookup (cpu_native.kquant_rows): rows of random bytes (every value, scale, min and fp16
    factor, NaN and inf among them) in any order and repeated, the bits of kquants.dequantize on those rows
    (NaN where it has NaN)."""
    g = torch.Generator().manual_seed(qtype)
    rows, blocks = 40, 3
    data = torch.randint(0, 256, (rows, blocks * kquants.BLOCK_BYTES[qtype]), generator=g, dtype=torch.uint8)
    kq = KQuantWeight(data, int(qtype), blocks * 256)
    ids = torch.tensor([7, 0, 39, 7, 12])
    got = cpu_native.kquant_rows(kq, ids, tier_lib)
    want = kquants.dequantize(kq.file_rows(ids))
    nan = want.isnan()  # (NaN's payload is torch's own: only where NaNs are is compared)
    assert got.dtype == torch.float32 and nan.any() and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    assert cpu_native.kquant_rows(kq, ids[:0], tier_lib).shape == (0, blocks * 256)
    with pytest.raises(IndexError, match="row id 40 out of range for a table of 40 rows"):
        cpu_native.kquant_rows(kq, torch.tensor([3, 40]), tier_lib)


def test_rows_stack_and_map_as_the_dense_matrix():
    g = torch.Generator().manual_seed(2)
    a, b = kquant(torch.randn(8, 256, generator=g), QT.Q4_K), kquant(torch.randn(4, 256, generator=g), QT.Q4_K)
    v = kquant(torch.randn(4, 256, generator=g), QT.Q6_K)
    dense = [quantized.dequantize(p) for p in (a, b, v)]
    same = quantized.concat_rows([a, b])
    assert isinstance(same, KQuantWeight) and torch.equal(quantized.dequantize(same), torch.cat(dense[:2]))
    mixed = quantized.concat_rows([a, b, v])
    assert isinstance(mixed, StackedWeight) and len(mixed.parts) == 2 and mixed.shape == (16, 256)
    assert torch.equal(quantized.dequantize(mixed), torch.cat(dense))
    assert quantized.nbytes(mixed) == 12 * 144 + 4 * 210
    index = torch.tensor([3, 0, 7])
    assert torch.equal(quantized.dequantize(quantized.take_rows(a, index)), dense[0][index])
    moved = quantized.map_weight(lambda t: t.clone(), mixed)
    assert isinstance(moved, StackedWeight) and torch.equal(quantized.dequantize(moved), torch.cat(dense))
    x = torch.randn(2, 256, generator=g)
    want = torch.cat([kquants.reference_kquant_matmul(x.to(torch.bfloat16), p) for p in mixed.parts], dim=1)
    assert torch.equal(quantized.linear(x, mixed), want.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="super-blocks"):
        KQuantWeight(a.data[:, :100], kquants.Q4_K, 256)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_interleaved_layout_keeps_every_byte_and_row(qtype):
    """kquants.interleave: the same bytes in 16-row groups (the last rows % 16 as they were), undone by
    file_layout; rows taken by ids or a slice are the file's rows, in the weight's own layout."""
    g = torch.Generator().manual_seed(qtype)
    rows, blocks = 37, 3
    data = torch.randint(0, 256, (rows, blocks * kquants.BLOCK_BYTES[qtype]), generator=g, dtype=torch.uint8)
    kq = KQuantWeight(data, int(qtype), blocks * 256)
    il = kquants.interleave(kq)
    assert il.interleaved == 16 and il.shape == kq.shape and not torch.equal(il.data[:32], data[:32])
    assert torch.equal(il.data[32:], data[32:]) and torch.equal(kquants.file_layout(il).data, data)
    assert sorted(il.data[:16].flatten().tolist()) == sorted(data[:16].flatten().tolist())
    # the first stored unit of row 1 sits after row 0's; a unit's 16 copies span 64 bytes, then the next unit's
    # (Q6_K's units in kq16_block's reading order: its scales first)
    first, second = (kquants.unit_order(qtype) or (0, 1))[:2]
    assert torch.equal(il.data[0, 4:8], data[1, 4 * first:4 * first + 4])
    assert torch.equal(il.data[0, 64:68], data[0, 4 * second:4 * second + 4])
    ids = torch.tensor([36, 0, 17, 5, 17])
    taken = kquants.file_layout(il.rows(ids))
    assert torch.equal(taken.data, data[ids])
    sliced = il.rows(slice(3, 37))
    assert sliced.interleaved == 16 and torch.equal(kquants.file_layout(sliced).data, data[3:])
    same = dict(rtol=0, atol=0, equal_nan=True)  # (random bytes: some fp16 factors are NaN)
    assert torch.allclose(kquants.dequantize(il), kquants.dequantize(kq), **same)
    assert torch.allclose(quantized.embedding(il, ids, torch.float32), kquants.dequantize(kq)[ids], **same)
    with pytest.raises(ValueError, match="already interleaved"):
        kquants.interleave(il)


def test_kernel_form_interleaves_where_the_build_reads_it(tier_lib):
    """kquant_form gives the CPU's kernels their layout: interleaved parts of a stack, grouped parts packed;
    a merge of interleaved parts (concat_rows) reads their rows in the file's order."""
    g = torch.Generator().manual_seed(5)
    a = kquant(torch.randn(32, 256, generator=g), QT.Q4_K)
    v = kquant(torch.randn(16, 256, generator=g), QT.Q6_K)
    formed = kquant_form(quantized.concat_rows([a, v]), torch.device("cpu"), torch.float32)
    lib = cpu_native.library()
    assert [p.interleaved for p in formed.parts] == [cpu_native.kquant_interleave_rows(lib, t) for t in (12, 14)]
    assert torch.equal(quantized.dequantize(formed), torch.cat([kquants.dequantize(a), kquants.dequantize(v)]))
    merged = quantized.concat_rows([kquants.interleave(a), a])
    assert merged.interleaved == 0 and torch.equal(merged.data, torch.cat([a.data, a.data]))


def kquant_params(cfg, seed=3):
    """A Q4_K_M-like model: q/k Q4_K with v Q6_K, o Q4_K, gate Q5_K beside 8-bit groups of up
    (a stack of two forms), down Q6_K; the LM head in 4-bit blocks."""
    dense = random_params(cfg, seed=seed)
    cpu = torch.device("cpu")

    def layer(lp):
        q, kv = cfg.q_size + cfg.kv_size, cfg.kv_size
        qkv = quantized.concat_rows([kquant(lp.qkv_proj[:q], QT.Q4_K), kquant(lp.qkv_proj[q:q + kv], QT.Q6_K)])
        inter = cfg.intermediate_size
        gate_up = quantized.concat_rows([kquant(lp.gate_up_proj[:inter], QT.Q5_K), grouped(lp.gate_up_proj[inter:], 8)])
        return dataclasses.replace(lp, qkv_proj=kquant_form(qkv, cpu, torch.float32),
                                   o_proj=kquant(lp.o_proj, QT.Q4_K), gate_up_proj=kquant_form(gate_up, cpu, torch.float32),
                                   down_proj=kquant(lp.down_proj, QT.Q6_K))

    lm_head = quantized.BlockWeight.from_groups(grouped(dense.lm_head, 4))
    return dataclasses.replace(dense, layers=tuple(layer(lp) for lp in dense.layers), lm_head=lm_head)


def in_layout_of(params, lib):
    """The params' K-quants and blocks in the layout `lib`'s kernels read (kquant_form chose the native build's)."""
    def form(w):
        if isinstance(w, StackedWeight):
            return StackedWeight(tuple(map(form, w.parts)))
        if isinstance(w, quantized.BlockWeight):
            group = cpu_native.block_interleave_rows(lib, w.bits)
            return w.file_layout().interleave(group) if group else w.file_layout()
        if not isinstance(w, KQuantWeight):
            return w
        group = cpu_native.kquant_interleave_rows(lib, w.qtype)
        return kquants.interleave(kquants.file_layout(w), group) if group else kquants.file_layout(w)
    return dataclasses.replace(params, layers=tuple(dataclasses.replace(
        lp, **{n: form(getattr(lp, n)) for n in cpu_layers.BLOCK_FIELDS}) for lp in params.layers))


def test_whole_layer_call_runs_mixed_kquant_layers_as_the_pieces_do(tier_lib):
    if not cpu_native.has_block_matmul(tier_lib):
        pytest.skip("no SIMD group dot product on this build: the layer call is not used")
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
    params = in_layout_of(kquant_params(cfg), tier_lib)
    assert isinstance(params.layers[0].qkv_proj, StackedWeight)
    assert isinstance(params.layers[0].gate_up_proj.parts[1], quantized.BlockWeight)
    native = cpu_native.CpuNative(tier_lib)
    whole = cpu_layers.layer_functions(native)
    chunks = [SeqChunk([5, 20, 33, 9, 60, 64, 1], 0, [0, 1], True), SeqChunk([7], 9, [2, 3, 4], True)]
    batch = build_batch(chunks, 4)._replace(logits_indices=torch.arange(8))
    out = []
    for fns in (whole, whole._replace(layer=None)):
        kv = allocate_kv_pool(cfg, 5, 4, torch.float32, "cpu")
        out.append((forward(params, kv, batch, cfg, cpu_layers.NativeAttention(4, native), fns), kv))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    # and near the dequantized model (int8 activations, per 256 for K-quants and per 32 for groups)
    dense = dataclasses.replace(params, layers=tuple(dataclasses.replace(
        lp, **{n: quantized.dequantize(getattr(lp, n)) for n in cpu_layers.BLOCK_FIELDS}) for lp in params.layers))
    want = forward(dense, allocate_kv_pool(cfg, 5, 4, torch.float32, "cpu"), batch, cfg)
    assert (out[0][0] - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.slow
def test_default_model_with_kquant_layers_keeps_the_dequantized_paths_logits(smollm2_gguf):
    """The default model (hidden 576: only ffn_down's rows are whole super-blocks, as in
    llama.cpp's Q4_K_M of it) with every down projection in Q4_K or Q6_K (alternating, from
    its own weights), the rest in its Q4_1 blocks: teacher-forced through the packed path (one
    C call a layer) against the
    same weights dequantized to fp32. The packed path rounds activations to int8 (per 256 for
    K-quants, per 32 for groups), so the logits differ by a few parts in a hundred of their
    spread, not bit for bit; their argmaxes agree (each matmul is its reference's bits: above)."""
    from nanoinfer.backends.choose import kernels_for
    from nanoinfer.loaders import load_model

    model = load_model(smollm2_gguf, device="cpu", progress=False)
    if not cpu_native.has_block_matmul(cpu_native.library()):
        pytest.skip("no block_matmul on this CPU: K-quants go to int8 there")
    layers = []
    for i, lp in enumerate(model.params.layers):
        down = kquant(quantized.dequantize(lp.down_proj), QT.Q4_K if i % 2 else QT.Q6_K)
        layers.append(dataclasses.replace(lp, down_proj=down))
    params = dataclasses.replace(model.params, layers=tuple(layers))
    dense = dataclasses.replace(params, layers=tuple(dataclasses.replace(
        lp, **{n: quantized.dequantize(getattr(lp, n)) for n in cpu_layers.BLOCK_FIELDS}) for lp in params.layers))
    cfg, cpu = model.config, torch.device("cpu")
    tokens = model.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. Write a haiku "
                                    "about the sea, and then count from one to ten: one, two, three")
    batch = build_batch([SeqChunk(tokens, 0, [0, 1, 2], True)], 16)._replace(logits_indices=torch.arange(len(tokens)))
    logits = []
    for p in (params, dense):
        kernels = kernels_for(cfg, cpu, 16, params=p)
        if p is params:
            assert isinstance(kernels.attention, cpu_layers.NativeAttention)
        logits.append(forward(p, allocate_kv_pool(cfg, 3, 16, torch.float32, "cpu"), batch, cfg, kernels.attention,
                              kernels.layer_fns))
    got, want = logits
    # (measured 0.059 here, every argmax the same; the Q4_1-only model: under 0.05, test_cpu_native.py. The
    # down projections' input, SwiGLU's heavy-tailed output, loses more to one int8 scale per 256 than per 32.)
    assert (got - want).abs().max() <= 0.08 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
