"""The CPU's fused layer pieces (nanoinfer/backends/cpu/cpu_native.c, nanoinfer/backends/cpu/cpu_layers.py) against the
torch ops they replace: each call on random shapes, then whole packed models and the engine."""

import dataclasses
import math
import platform
import shutil

import pytest
import torch

from nanoinfer.backends.cpu import cpu_layers
from nanoinfer.backends.cpu import cpu_native
from nanoinfer.quant import kquants
from nanoinfer.backends.cpu import rope_write_cpu
from nanoinfer.attention.reference import REFERENCE
from nanoinfer.attention.torch_paged import TorchPagedAttention
from nanoinfer.model.batch import SeqChunk, build_batch
from nanoinfer.errors import RequestError
from nanoinfer.backends.choose import kernels_for
from nanoinfer.model.kv_cache import allocate_kv_pool
from nanoinfer.model.layers import rms_norm
from nanoinfer.loaders.quantize import quantize_params
from nanoinfer.model.decoder import forward
from nanoinfer.quant.quantized import BlockWeight, GroupedWeight, Int4Weight, reference_block_matmul
from nanoinfer.sampling.sampling_params import SamplingParams
from tests.tiny import grouped, random_params, tiny_config

BF16_ULP = 2.0**-7  # one bf16 rounding step, relative: sums taken in another order may flip one


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler here: the CPU path stays in torch ops (test_without_a_compiler_...)")
    lib = cpu_native.load(tmp_path_factory.mktemp("native"))
    assert lib is not None, "a C compiler is on PATH but cpu_native.c did not build"
    return cpu_native.CpuNative(lib)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)




@pytest.fixture(scope="module", params=["native", "avx2"])
def block_lib(request, native, tmp_path_factory):
    """The library as built here, and with the VNNI dot products off (the AVX2 path)."""
    extra = () if request.param == "native" else ("-mno-avx512vnni", "-mno-avxvnni")
    lib = cpu_native.load(tmp_path_factory.mktemp(request.param), extra)
    if not cpu_native.has_block_matmul(lib):
        pytest.skip("no SIMD group dot product on this CPU (block_matmul needs x86 AVX2 or ARM NEON)")
    assert request.param == "native" or lib.block_dot_isa() == 1
    return lib


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out, cols, tokens", [(37, 32, 1), (64, 256, 3), (16, 288, 2), (40, 576, 1), (9, 1536, 5)])
def test_block_matmul_equals_its_reference(block_lib, bits, out, cols, tokens):
    g = torch.Generator().manual_seed(out + cols + bits)
    q = torch.randint(0, 2**bits, (out, cols), generator=g, dtype=torch.uint8)  # every value, 255 included
    scale = torch.rand(out, cols // 32, generator=g) * 0.1 + 0.01
    w = GroupedWeight(q, scale, -(2 ** (bits - 1)) * scale * (1 + 0.3 * torch.randn(out, cols // 32, generator=g)), bits)
    blocks = BlockWeight.from_groups(w)
    assert blocks.shape == (out, cols) and torch.equal(blocks.groups().q, q)  # the tile order undone
    x = randn(tokens, cols, seed=cols, dtype=torch.bfloat16) * 3
    x[0, :32] = 0  # a group of zeros (no scale to divide by)
    x[-1, -32:] *= 100  # and one far larger than the rest
    got = cpu_native.block_matmul(x, blocks, block_lib)
    want = reference_block_matmul(x, blocks)
    # The same integer dot products; fp32 sums in another order, then one bf16 rounding.
    torch.testing.assert_close(got.float(), want, rtol=BF16_ULP, atol=1e-5 * float(want.abs().max()))
    # fp32 out (a tensor-parallel rank's part): the same sums before their bf16 rounding
    assert torch.equal(cpu_native.block_matmul(x, blocks, block_lib, torch.float32).to(torch.bfloat16), got)
    with pytest.raises(TypeError, match="bf16 rows of"):
        cpu_native.block_matmul(x.float(), blocks, block_lib)
    with pytest.raises(TypeError, match="bf16 or fp32, not torch.float16"):
        cpu_native.block_matmul(x, blocks, block_lib, torch.float16)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("cols", [256, 288, 1536])
def test_block_matmul_tokens_together_equal_one_at_a_time(block_lib, bits, cols):
    """A step's tokens share each unpacked weight chunk; every token keeps the single-token bits. From 32 tokens
    on, AVX-512 VNNI takes rows 16 at a time (cpu_native_groups_tiles.h: 24 rows are a tile and 8 rows left)."""
    g = torch.Generator().manual_seed(cols + bits)
    q = torch.randint(0, 2**bits, (24, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(24, cols // 32, generator=g) * 0.1 + 0.01
    blocks = BlockWeight.from_groups(GroupedWeight(q, scale, -scale * torch.rand(24, cols // 32, generator=g), bits))
    x = randn(40, cols, seed=cols + 1, dtype=torch.bfloat16) * 3
    x[1] = 0  # (a row of zeros: -0.0 sums keep their sign as one token's do)
    one = [cpu_native.block_matmul(x[t : t + 1], blocks, block_lib, torch.float32) for t in range(40)]
    for tokens in [*range(1, 10), 33, 40]:
        assert torch.equal(cpu_native.block_matmul(x[:tokens], blocks, block_lib, torch.float32), torch.cat(one[:tokens]))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_interleaved_blocks_give_the_file_layouts_bits(block_lib, bits, symmetric):
    """Rows interleaved 16 at a time (BlockWeight.interleave, cpu_native_groups_rows16.h at one token and the tiles
    from 32) give the file layout's bits, at any token count, with the last rows % 16 left in the file's layout; a
    symmetric format's mins (Q4_0's -8 d) are derived, not stored. A build that does not read the layout refuses it."""
    g = torch.Generator().manual_seed(bits + symmetric)
    out, cols = 37, 512
    q = torch.randint(0, 2**bits, (out, cols), generator=g, dtype=torch.uint8)
    scale = (torch.rand(out, cols // 32, generator=g) * 0.1 + 0.01).half().float()
    mins = -(2 ** (bits - 1)) * scale if symmetric else -scale * torch.rand(out, cols // 32, generator=g)
    blocks = BlockWeight.from_groups(GroupedWeight(q, scale, mins, bits))
    laid = blocks.interleave(16)
    assert laid.shape == blocks.shape and (laid.min is None) == symmetric
    back = laid.file_layout()
    assert all(torch.equal(getattr(back, f), getattr(blocks, f)) for f in ("q", "scale", "min"))
    assert torch.equal(laid.groups().q, q)
    with pytest.raises(ValueError, match="whole chunks of 256 columns"):
        BlockWeight.from_groups(GroupedWeight(q[:, :288], scale[:, :9], mins[:, :9], bits)).interleave(16)
    x = randn(40, cols, seed=bits, dtype=torch.bfloat16) * 3
    x[1] = 0  # (a row of zeros: the sums' -0.0 as the file layout's)
    if cpu_native.block_interleave_rows(block_lib, bits) != 16:
        with pytest.raises(ValueError, match="interleaved by 0, not by 16"):
            cpu_native.block_matmul(x, laid, block_lib)
        return
    for tokens in (1, 2, 5, 33, 40):
        want = cpu_native.block_matmul(x[:tokens], blocks, block_lib, torch.float32)
        assert torch.equal(cpu_native.block_matmul(x[:tokens], laid, block_lib, torch.float32), want)


@pytest.mark.parametrize("rows, dim", [(1, 576), (3, 32), (2, 100)])
def test_norms_and_swiglu_equal_their_torch_ops(native, rows, dim):
    x, w, eps = randn(rows, dim, seed=1) * 3, 1 + 0.1 * randn(dim, seed=2), 1e-5
    y = randn(rows, dim, seed=3, dtype=torch.bfloat16)
    tol = dict(atol=1e-6, rtol=BF16_ULP)
    torch.testing.assert_close(native.rms_norm_bf16(x, w, eps).float(),
                               cpu_native.reference_rms_norm_bf16(x, w, eps).float(), **tol)
    x_out, h = native.add_rms_norm_bf16(x, y, w, eps)
    want_x, want_h = cpu_native.reference_add_rms_norm_bf16(x, y, w, eps)
    assert torch.equal(x_out, want_x)
    torch.testing.assert_close(h.float(), want_h.float(), **tol)
    gate_up = randn(rows, 2 * dim, seed=4, dtype=torch.bfloat16) * 4  # (silu's tails: up to e^±20)
    torch.testing.assert_close(native.silu_mul_bf16(gate_up).float(),
                               cpu_native.reference_silu_mul_bf16(gate_up).float(), **tol)


def test_the_avx2_builds_swiglu_gives_the_native_builds_bits(native, tmp_path_factory):
    """Without AVX-512, cpu_native.c is compiled so that SwiGLU's exp loop vectorizes (its no-trapping-math pragma):
    an element-wise loop, so the bits of the build as this CPU compiles it, NaN and the exp's clamped tails included.
    (The norms' sums of squares are reductions: their order follows the vector width, as torch's does.)"""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("an x86 tier")
    avx2 = cpu_native.CpuNative(cpu_native.load(tmp_path_factory.mktemp("avx2"), cpu_native.ISA_FLAGS["avx2"]))
    gate_up = randn(3, 2 * 8192, seed=7, dtype=torch.bfloat16) * 30  # (past the clamp at e^+-87)
    gate_up[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert torch.equal(native.silu_mul_bf16(gate_up).view(torch.int16), avx2.silu_mul_bf16(gate_up).view(torch.int16))


@pytest.mark.parametrize("qk_norm, qkv_dtype", [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float32)])
def test_rope_write_equals_the_torch_path(native, qk_norm, qkv_dtype):
    cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=qk_norm)
    lp = random_params(cfg).layers[0]
    batch = build_batch([SeqChunk([3, 1, 4, 1, 5], 0, [1, 2], True), SeqChunk([9], 6, [3, 0], True)], 4)
    slots = batch.slot_mapping.clone()
    slots[2] = -1  # a padding row writes nothing
    qkv = randn(batch.num_tokens, cfg.q_size + 2 * cfg.kv_size, seed=5, dtype=qkv_dtype)
    kv_want = torch.full((2, 5, 4, 2, 16), float("nan"))
    kv_got = kv_want.clone()
    cos, sin = rope_write_cpu.rope_tables(params_inv_freq := random_params(cfg).rope_inv_freq, batch.positions,
                                          torch.float32)
    q_want = rope_write_cpu.rope_and_write(qkv.float(), lp.q_norm, lp.k_norm, cos, sin, kv_want, slots, cfg)
    fns = cpu_layers.layer_functions(native)
    cos, sin = fns.rope_tables(params_inv_freq, batch.positions, torch.float32)
    q = native.rope_write(qkv.contiguous(), lp.q_norm, lp.k_norm, cfg.rms_norm_eps, cos, sin, slots, kv_got,
                          cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)  # (cpu_layers' rope_and_write)
    torch.testing.assert_close(q, q_want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_got, kv_want, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (9, 3, 64), (4, 4, 8)])
def test_native_attention_equals_torch_paged(native, window, heads, kv_heads, head_dim):
    cfg = tiny_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    block = 4
    pool = randn(2, 12, block, kv_heads, head_dim, seed=6)
    # A prefill chunk among decodes, contexts of 1 to 23 keys, and blocks out of order.
    chunks = [SeqChunk([1], 22, [7, 2, 9, 0, 11, 4], True), SeqChunk([5, 6, 7], 2, [3, 10], True),
              SeqChunk([2], 0, [5], True), SeqChunk([8], 9, [1, 6, 8], True)]
    batch = build_batch(chunks, block)
    q = randn(batch.num_tokens, heads, head_dim, seed=7)
    torch_paged, ours = TorchPagedAttention(block), cpu_layers.NativeAttention(block, native)
    want = torch_paged.attention(q, pool, torch_paged.prepare(batch, cfg, window))
    got = ours.attention(q, pool, ours.prepare(batch, cfg, window))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Rows of a wider block table (as the runner's are), and padding rows past the last
    # sequence's, which come out zero.
    decodes = build_batch([chunks[0], chunks[2], chunks[3]], block)
    wide = torch.cat((decodes.block_tables, torch.full((3, 5), 99, dtype=torch.int32)), dim=1)
    decodes = decodes._replace(block_tables=wide[:, :decodes.block_tables.shape[1]])
    q = torch.cat((q[[0, 4, 5]], randn(2, heads, head_dim, seed=8)))
    got = ours.attention(q, pool, ours.prepare(decodes, cfg, window))
    torch.testing.assert_close(got[:3], torch_paged.attention(q[:3], pool, torch_paged.prepare(decodes, cfg, window)),
                               atol=1e-5, rtol=1e-5)
    assert not got[3:].any()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_chunks_attention_is_the_same_on_any_threads(native, threads):
    """A chunk large enough for the rows to go to threads: the same bits as on one."""
    cfg = tiny_config(num_heads=9, num_kv_heads=3, head_dim=64)
    pool = randn(2, 20, 16, 3, 64, seed=2)
    batch = build_batch([SeqChunk(list(range(300)), 0, list(range(19, -1, -1)), True)], 16)
    q = randn(300, 9, 64, seed=3)
    ours = cpu_layers.NativeAttention(16, native)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = ours.attention(q, pool, ours.prepare(batch, cfg, None))
        torch.set_num_threads(1)
        assert torch.equal(got, ours.attention(q, pool, ours.prepare(batch, cfg, None)))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, REFERENCE.attention(q, pool, REFERENCE.prepare(batch, cfg, None)),
                               atol=1e-5, rtol=1e-5)


def block_params(params):
    """Every projection and the LM head as 4-bit BlockWeights (the CPU's form of a GGUF file)."""
    def blocks(w):
        return BlockWeight.from_groups(grouped(w, 4))

    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    layers = tuple(dataclasses.replace(lp, **{n: blocks(getattr(lp, n)) for n in names}) for lp in params.layers)
    return dataclasses.replace(params, layers=layers, lm_head=blocks(params.lm_head))


@pytest.mark.parametrize("form", ["int8", "blocks"])
@pytest.mark.parametrize("arch", [dict(), dict(architecture="qwen2", qkv_bias=True), dict(architecture="qwen3", qk_norm=True),
                                  dict(sliding_window=3)], ids=["llama", "qwen2", "qwen3", "window"])
def test_packed_model_layers_equal_the_torch_path(native, arch, form):
    cfg = tiny_config(intermediate_size=64, **arch)
    if form == "blocks" and not cpu_native.has_block_matmul(native.lib):
        pytest.skip("no block_matmul on this CPU")
    dense = random_params(cfg, seed=3)
    params = quantize_params(dense, "int8") if form == "int8" else block_params(dense)
    chunks = [SeqChunk([5, 20, 33, 9, 60, 64, 1], 0, [0, 1], True), SeqChunk([7], 9, [2, 3, 4], True)]
    batch = build_batch(chunks, 4)._replace(logits_indices=torch.arange(8))
    kv = allocate_kv_pool(cfg, 5, 4, torch.float32, "cpu")
    kv_want, kv_got = kv.clone(), kv.clone()
    torch_path = kernels_for(cfg, torch.device("cpu"), 4, eager=True, params=params)
    ours = kernels_for(cfg, torch.device("cpu"), 4, params=params)
    assert isinstance(ours.attention, cpu_layers.NativeAttention)
    assert not isinstance(torch_path.attention, cpu_layers.NativeAttention)
    want = forward(params, kv_want, batch, cfg, torch_path.attention, torch_path.layer_fns)
    got = forward(params, kv_got, batch, cfg, ours.attention, ours.layer_fns)
    # The same bf16 matmuls; norms summed in another order may flip a bf16 rounding between them.
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(kv_got, kv_want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("arch", [dict(), dict(architecture="qwen2", qkv_bias=True), dict(architecture="qwen3", qk_norm=True),
                                  dict(sliding_window=3)], ids=["llama", "qwen2", "qwen3", "window"])
def test_a_whole_layer_call_equals_the_calls_one_piece_at_a_time(block_lib, arch):
    """cpu_native.c's block_layer_forward composes the same functions as cpu_layers' pieces: bit
    for bit the same logits and KV pool, on either dot product (VNNI, AVX2)."""
    cfg = tiny_config(intermediate_size=64, **arch)
    params = block_params(random_params(cfg, seed=3))
    chunks = [SeqChunk([5, 20, 33, 9, 60, 64, 1], 0, [0, 1], True), SeqChunk([7], 9, [2, 3, 4], True)]
    batch = build_batch(chunks, 4)._replace(logits_indices=torch.arange(8))
    native = cpu_native.CpuNative(block_lib)
    whole = cpu_layers.layer_functions(native)
    pieces = whole._replace(layer=None)
    assert whole.layer is not None
    out = []
    for fns in (whole, pieces):
        kv = allocate_kv_pool(cfg, 5, 4, torch.float32, "cpu")
        out.append((forward(params, kv, batch, cfg, cpu_layers.NativeAttention(4, native), fns), kv))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    with pytest.raises(ValueError, match="the step's 8 contiguous rows"):
        meta = cpu_layers.NativeAttention(4, native).prepare(batch, cfg, None)
        native.block_layer_forward(cpu_native.block_layer(params.layers[0]), meta.step, *([torch.zeros(1)] * 3),
                                   torch.zeros(3, cfg.hidden_size))


@pytest.mark.parametrize("head", ["q4", "q8", "q6_k"])
@pytest.mark.parametrize("eager", [False, True], ids=["fused", "eager"])
def test_a_packed_lm_head_returns_its_fp32_sums(native, head, eager):
    """The logits are the head kernel's fp32 sums as they are (issue 59): rounded to bf16 they
    sat on a grid, 1/16 nat apart at logits of 8 to 16, so logprobs lost their resolution and
    near-ties became exact ties that greedy broke by token id. Against the reference: the final
    norm's rows (the kernel's bf16 input) times the dequantized head, the activations rounded
    to int8 as the kernel rounds them; for the fused layers and the torch path alike."""
    from tests.test_kquants import QT, kquant

    cfg = tiny_config(hidden_size=256, head_dim=64, intermediate_size=64, vocab_size=300)
    if not cpu_native.has_block_matmul(native.lib):
        pytest.skip("no block_matmul on this CPU")
    dense = random_params(cfg, seed=3)
    params = block_params(dense)
    heads = {"q4": params.lm_head,
             "q8": BlockWeight.from_groups(grouped(dense.lm_head, 8)),  # (the default model's)
             "q6_k": kquant(dense.lm_head, QT.Q6_K)}  # (a Q4_K_M file's output.weight)
    params = dataclasses.replace(params, lm_head=heads[head])
    batch = build_batch([SeqChunk([5, 20, 33, 9, 60, 64, 1], 0, [0, 1], True), SeqChunk([7], 9, [2, 3, 4], True)],
                        4)._replace(logits_indices=torch.arange(8))
    kernels = kernels_for(cfg, torch.device("cpu"), 4, eager=eager, params=params)
    assert isinstance(kernels.attention, cpu_layers.NativeAttention) is not eager

    def run(p):
        return forward(p, allocate_kv_pool(cfg, 5, 4, torch.float32, "cpu"), batch, cfg, kernels.attention,
                       kernels.layer_fns)

    logits = run(params)
    hidden = run(dataclasses.replace(params, lm_head=None))  # (a stage without the head returns its rows)
    rows = rms_norm(hidden[batch.logits_indices], params.final_norm, cfg.rms_norm_eps).to(torch.bfloat16)
    if head == "q6_k":  # (its torch reference is the C kernel's arithmetic, bit for bit)
        want = kquants.reference_kquant_matmul(rows, params.lm_head)
        assert logits.dtype == torch.float32 and torch.equal(logits, want)
    else:
        want = reference_block_matmul(rows, params.lm_head).double()
        assert logits.dtype == torch.float32
        # fp32 sums in another order: ~2^-20 of the largest, where one bf16 step is 2^-8 of a value
        assert (logits.double() - want).abs().max() <= 2.0**-16 * want.abs().max()
    assert 4 <= want.abs().max() <= 64  # (where a bf16 step is 1/32 to 1/2)
    on_bf16_grid = logits.to(torch.bfloat16).float() == logits
    assert on_bf16_grid.float().mean() < 0.1


def test_the_chosen_kernels_are_logged_once_and_named(native, monkeypatch, caplog):
    """`library()` says which kernels run, once per process; NANOINFER_CPU_ISA=avx2 builds the
    AVX2 tier on a CPU with more, and a tier it does not know is named in the error."""
    caplog.set_level("INFO", logger="nanoinfer")
    cpu_native.library.cache_clear()
    monkeypatch.delenv(cpu_native.ISA_VARIABLE, raising=False)
    try:
        lib = cpu_native.library()
        assert cpu_native.library() is lib
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu kernels:")]
        assert lines == [f"cpu kernels: {cpu_native.describe(lib)}"]
        if cpu_native.has_block_matmul(lib):
            name = {1: "avx2", 2: "avx-vnni", 3: "avx512-vnni"}[lib.block_dot_isa()]
            assert cpu_native.describe(lib).startswith(f"{name} (q4_0, q4_1, q5_0, q5_1, q8_0 packed")
            assert "q4_k, q5_k, q6_k in their super-blocks" in cpu_native.describe(lib)
            monkeypatch.setenv(cpu_native.ISA_VARIABLE, "avx2")
            cpu_native.library.cache_clear()
            assert cpu_native.library().block_dot_isa() == 1
            assert cpu_native.describe(cpu_native.library()).startswith("avx2 (")
        monkeypatch.setenv(cpu_native.ISA_VARIABLE, "sse9")
        cpu_native.library.cache_clear()
        with pytest.raises(RequestError, match="NANOINFER_CPU_ISA='sse9' is not a CPU tier: expected one of native"):
            cpu_native.library()
    finally:
        cpu_native.library.cache_clear()
    assert cpu_native.describe(None).startswith("torch ops")


def test_tensor_parallel_ranks_sum_the_packed_layers_outputs_in_fp32(native):
    """The row-parallel projections' partial outputs reach the all-reduce in fp32, unrounded (a
    bf16 sum would round again at every rank's add), and their sum rounds to bf16 once: one
    rank's output."""
    cfg = tiny_config(intermediate_size=64)
    if not cpu_native.has_block_matmul(native.lib):
        pytest.skip("no block_matmul on this CPU")
    lp = block_params(random_params(cfg, seed=3)).layers[0]
    fns = cpu_layers.layer_functions(native)
    x, attn = randn(3, cfg.hidden_size, seed=1), randn(3, cfg.num_heads, cfg.head_dim, seed=2)
    summed = []

    def all_reduce(t):  # one rank: the sum is the rank's own part
        summed.append(t.dtype)
        return t

    alone = fns.attention_output_and_mlp(x, attn, lp, cfg)
    assert torch.equal(fns.attention_output_and_mlp(x, attn, lp, cfg, None, all_reduce), alone)
    assert summed == [torch.float32, torch.float32]


def test_the_fused_layers_take_only_packed_fp32_models(native):
    cfg = tiny_config()
    dense = random_params(cfg)
    packed = quantize_params(dense, "int8")
    cpu = torch.device("cpu")

    def fused(**kw):
        return isinstance(kernels_for(cfg, cpu, 4, **kw).attention, cpu_layers.NativeAttention)

    assert fused(params=packed) and fused(params=packed, kv_dtype=torch.float32)
    assert not fused(params=dense)  # the exact path stays exact
    assert not fused(params=packed, kv_dtype=torch.float8_e4m3fn)  # an fp8 pool: torch's RoPE/write
    assert not fused(params=packed, eager=True)
    assert not fused()
    assert kernels_for(cfg, cpu, 4, params=packed).draw is not None  # cpu_native's random_draw
    assert kernels_for(cfg, cpu, 4, params=packed, eager=True).draw is None  # draw.random_draw, the oracle
    assert kernels_for(cfg, cpu, 4, params=packed).greedy is not None  # cpu_native's greedy_rows
    assert kernels_for(cfg, cpu, 4, params=packed, eager=True).greedy is None  # sampler.greedy_and_finite


# Seeds as SamplingParams.with_seed wraps them into int64 (negative ones feed ones into the key's
# arithmetic shift), and a step past 2**32 (the hash keeps its low half).
EDGE_SEEDS = [0, 1, -1, 2**32, 2**32 - 1, -(2**32), 2**63 - 1, -(2**63), -123456789012345]


@pytest.mark.parametrize("vocab", [1, 1000, 49152, 151936])
def test_random_draw_equals_its_reference(native, vocab):
    """cpu_native's draw against nanoinfer.sampling.draw.random_draw: the same token per row. Flat rows
    (every token equally likely) are won by the largest uniform, so they check the hash bit for
    bit; sharp random rows with top-k zeros check the race and its skipped logs; then a row with
    one token, one whose only token is the last, one all zeros (token 0, as torch's argmax)."""
    from nanoinfer.sampling.draw import random_draw

    g = torch.Generator().manual_seed(vocab)
    rows = 3 * len(EDGE_SEEDS)
    seeds = torch.tensor(EDGE_SEEDS * 3)
    steps = torch.randint(0, 5000, (rows,), generator=g)
    steps[-1] = 2**40 + 3
    sharp = (torch.randn(rows, vocab, generator=g) * 4).softmax(-1)
    kth = sharp.sort(dim=-1, descending=True).values[:, min(vocab, 50) - 1:min(vocab, 50)]
    sharp[len(EDGE_SEEDS):] = torch.where(sharp >= kth, sharp, 0.0)[len(EDGE_SEEDS):]  # (top-50 rows)
    flat = torch.full((rows, vocab), 1.0 / vocab)
    for probs in (flat, sharp):
        assert torch.equal(native.random_draw(probs, seeds, steps), random_draw(probs, seeds, steps))
    edge = torch.zeros(3, vocab)
    edge[0, vocab // 3], edge[1, -1] = 0.5, 1.0
    assert torch.equal(native.random_draw(edge, seeds[:3], steps[:3]), random_draw(edge, seeds[:3], steps[:3]))


@pytest.mark.parametrize("vocab", [1, 7, 1000, 49152])
def test_greedy_rows_equal_their_reference(native, vocab):
    """cpu_native's greedy tokens and finite flags against nanoinfer.sampling.sampler.greedy_and_finite: random
    rows; rows of ties (the first wins), of -inf, +inf, NaN (torch's argmax takes the first NaN), all -inf, all
    NaN; -0.0 beside 0.0 at the max."""
    from nanoinfer.sampling.sampler import greedy_and_finite

    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=g) * 5 for _ in range(4)]
    at = [int(torch.randint(0, vocab, (1,), generator=g)) for _ in range(3)]
    tied = torch.zeros(vocab)
    tied[at[0]] = tied[at[1]] = 3.0
    rows.append(tied)
    for value in (-math.inf, math.inf, math.nan):
        row = torch.randn(vocab, generator=g)
        row[at[2]] = value
        rows.append(row)
    both = torch.randn(vocab, generator=g)
    both[at[0]], both[at[1]] = math.inf, math.nan
    rows += [both, torch.full((vocab,), -math.inf), torch.full((vocab,), math.nan)]
    signed = torch.full((vocab,), -1.0)
    signed[at[1]], signed[at[0]] = -0.0, 0.0
    rows.append(signed)
    logits = torch.stack(rows)
    tokens, finite = native.greedy_and_finite(logits)
    want_tokens, want_finite = greedy_and_finite(logits)
    assert torch.equal(tokens, want_tokens) and torch.equal(finite, want_finite)
    assert tokens.dtype == want_tokens.dtype and finite.dtype == want_finite.dtype


@pytest.mark.parametrize("bits", [4, 8])
def test_group_rows_are_the_references_bits(native, bits):
    """An embedding's lookup of a grouped table (cpu_native.group_rows): rows in any order and repeated, the bits of
    quantized.dequantize on those rows, scales and mins of every size (products that round, inf, NaN among them);
    a table of reordered columns (GPTQ's act-order) left to the reference; an id past the table refused."""
    from nanoinfer.quant.grouped import GroupedWeight
    from nanoinfer.quant.quantized import dequantize

    g = torch.Generator().manual_seed(bits)
    rows, cols, group = 40, 96, 32
    q = torch.randint(0, 2**bits, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.randn(rows, cols // group, generator=g) * 10.0 ** torch.randint(-30, 30, (rows, cols // group),
                                                                                 generator=g)
    minimum = torch.randn(rows, cols // group, generator=g) * 1e3
    scale[3, 1], scale[5, 0], minimum[7, 2] = math.inf, math.nan, -math.inf
    table = GroupedWeight(q, scale, minimum, bits)
    ids = torch.tensor([7, 0, 39, 7, 3, 5, 12])
    got, want = cpu_native.group_rows(table, ids, native.lib), dequantize(table.rows(ids))
    nan = want.isnan()
    assert nan.any() and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    permuted = GroupedWeight(q, scale, minimum, bits, cols=torch.randperm(cols, generator=g))
    assert cpu_native.takes_group_rows(table) and not cpu_native.takes_group_rows(permuted)
    with pytest.raises(ValueError, match="columns in order"):
        cpu_native.group_rows(permuted, ids[:3], native.lib)
    with pytest.raises(IndexError, match="row id 40 out of range for a table of 40 rows"):
        cpu_native.group_rows(table, torch.tensor([3, 40]), native.lib)


def test_without_a_compiler_the_cpu_path_stays_in_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_native.load(tmp_path / "cache") is None
    assert "cannot build cpu_native.c" in caplog.text
    monkeypatch.setattr(cpu_native, "library", lambda: cpu_native.load(tmp_path / "cache"))  # (not this process's)
    assert not cpu_native.has_block_matmul(cpu_native.library())  # a GGUF file packs for torch's int4 kernel
    params = quantize_params(random_params(tiny_config()), "int8")
    kernels = kernels_for(tiny_config(), torch.device("cpu"), 4, params=params)
    assert isinstance(kernels.attention, TorchPagedAttention)
    assert not isinstance(kernels.attention, cpu_layers.NativeAttention)
    assert kernels.layer_fns.qkv_rope_and_write is rope_write_cpu.qkv_rope_and_write


def test_a_compiler_that_refuses_march_native_still_builds_it(native, monkeypatch, tmp_path):
    picky = tmp_path / "picky-cc"
    picky.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -march=native ] && exit 1; done\n'
                     f'exec {shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")} "$@"\n')
    picky.chmod(0o755)
    monkeypatch.setenv("CC", str(picky))
    lib = cpu_native.load(tmp_path / "cache")
    assert lib is not None
    x, w = randn(2, 64), torch.ones(64)
    torch.testing.assert_close(cpu_native.CpuNative(lib).rms_norm_bf16(x, w, 1e-6).float(),
                               cpu_native.reference_rms_norm_bf16(x, w, 1e-6).float(), atol=1e-6, rtol=BF16_ULP)


@pytest.mark.slow
def test_default_model_greedy_text_is_the_torch_paths(native, smollm2_gguf, monkeypatch):
    """With torch's int4 kernel for the matmuls (the same bf16 products either way), the fused
    layers' greedy text is the torch path's, token for token."""
    from nanoinfer.loaders import load_model
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    monkeypatch.setattr(cpu_native, "has_block_matmul", lambda lib: False)
    model = load_model(smollm2_gguf, device="cpu", progress=False)
    assert isinstance(model.params.layers[0].qkv_proj, Int4Weight)
    outputs = []
    for eager in (True, False):
        engine = EngineCore(model, engine_config(num_blocks=32, enforce_eager=eager))
        assert isinstance(engine.executor.attention, cpu_layers.NativeAttention) is not eager
        seqs = [engine.add_request(model.tokenizer.encode(p), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                for p in ("The capital of France is", "Write a haiku about the sea")]
        while engine.has_unfinished():
            engine.step()
        outputs.append([s.output_token_ids for s in seqs])
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_default_model_with_block_matmuls_keeps_the_torch_paths_logits(native, smollm2_gguf):
    """With int8 activations (BlockWeight, the default here) a bf16 rounding that differs
    between the two paths can move a group's int8 step, so greedy text may part where the
    model hesitates; teacher-forced, the logits stay close and their argmaxes agree."""
    if not cpu_native.has_block_matmul(native.lib):
        pytest.skip("no block_matmul on this CPU")
    from nanoinfer.loaders import load_model

    model = load_model(smollm2_gguf, device="cpu", progress=False)
    assert isinstance(model.params.layers[0].qkv_proj, BlockWeight)
    tokens = model.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. Write a haiku "
                                    "about the sea, and then count from one to ten: one, two, three")
    cfg, cpu = model.config, torch.device("cpu")
    batch = build_batch([SeqChunk(tokens, 0, [0, 1, 2], True)], 16)._replace(logits_indices=torch.arange(len(tokens)))
    logits = []
    for eager in (True, False):
        kernels = kernels_for(cfg, cpu, 16, eager=eager, params=model.params)
        kv = allocate_kv_pool(cfg, 3, 16, torch.float32, "cpu")
        logits.append(forward(model.params, kv, batch, cfg, kernels.attention, kernels.layer_fns))
    want, got = logits
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
def test_default_model_logprobs_are_not_on_a_bf16_grid(native, smollm2_gguf):
    """Issue 59: the top logprobs of a step were all 1/16 nat apart or a multiple of it (logits
    of 8 to 16 rounded to bf16), exact ties among them broken by token id."""
    from nanoinfer import LLM

    with LLM(smollm2_gguf, device="cpu", progress=False, num_blocks=16) as llm:
        out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=1, logprobs=6),
                           use_tqdm=False)[0].outputs[0]
    top = [logprob for _, logprob in out.logprobs[0].top]
    gaps = [a - b for a, b in zip(top, top[1:])]
    assert len(gaps) == 5 and all(gap > 0 for gap in gaps)  # (no ties)
    assert any(abs(16 * gap - round(16 * gap)) > 1e-3 for gap in gaps), gaps
