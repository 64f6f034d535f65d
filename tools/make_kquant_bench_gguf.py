"""Write a Llama-3.2-1B-shaped GGUF of random weights in K-quants (our own quantizers) with the default model's tokenizer.

    python tools/make_kquant_bench_gguf.py OUT.gguf [--mix q4_k_m|q5_k_m|q6_k|q4_0] [--layers 16] [--llama-cpp]
        [--shape smol-vocab-1b|llama-3.2-1b|llama-3.1-8b] [--quantize-bin llama-quantize] [--tokenizer SOURCE.gguf]

For timing the K-quant kernels in a whole decode (bench/cpu_decode.py --model OUT.gguf): 16
layers of width 2048, 32/8 heads of 64, FFN 8192, the default model's 49,152-token vocabulary
and tokenizer (`--shape llama-3.2-1b` and `llama-3.1-8b`: those models' own sizes and their 128,256-token
vocabulary, the tokenizer padded with reserved control tokens, as a real file's LM head and embedding are). With
--llama-cpp the weights are written in F16 beside OUT and quantized by
llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`, 2 threads: minutes), the
mix it chooses for `--mix` (Q4_0 too: its head in Q6_K); `--quantize-bin` names llama.cpp's `llama-quantize`
program to run instead (a machine without llama-cpp-python: the GPU's, bench/gguf_cuda.py). `--tokenizer`: the GGUF
whose tokenizer and chat template are copied (default: the default model's; `--tokenizer-only OUT` writes one
with no tensors, a few MB to carry). Without, our own quantizers (tools/kquant_quantize.py, seconds a
matrix): the types follow llama.cpp's Q4_K_M (tools/make_q4_k_m.own_type: Q4_K, attn_v and
ffn_down of even layers Q6_K), Q5_K_M (the same with Q5_K), or all Q6_K; the embedding Q8_0
and the output head Q6_K as llama.cpp writes them. Weights ~N(0, 0.02): text is noise, the
speed is a real file's.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize

from tools.kquant_quantize import quantize as quantize_kquant
from tools.make_q4_k_m import DEFAULT, copy_metadata, own_type, quantize_q4_k_m

SHAPES = {  # (vocab None: the tokenizer's own)
    "smol-vocab-1b": dict(hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64, layers=16, vocab=None,
                          rope_theta=None),
    "llama-3.2-1b": dict(hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64, layers=16, vocab=128256,
                         rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, layers=32, vocab=128256,
                         rope_theta=500000.0),
}
CONTROL = 3  # (gguf's token type of Llama 3's reserved special tokens)


def matrix_type(name: str, cols: int, mix: str) -> QT:
    if name == "output.weight":
        return QT.Q6_K
    qtype = own_type(name, cols)
    if mix == "q6_k" and qtype in (QT.Q4_K, QT.Q6_K):
        return QT.Q6_K
    return QT.Q5_K if mix == "q5_k_m" and qtype == QT.Q4_K else qtype


def tensors(shape: dict, layers: int, vocab: int):
    """(name, [rows, cols] or [n]) of a llama of `shape`."""
    h, f = shape["hidden"], shape["ffn"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    yield "token_embd.weight", (vocab, h)
    for i in range(layers):
        for name, shape in (("attn_norm", (h,)), ("attn_q", (q, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)),
                            ("attn_output", (h, q)), ("ffn_norm", (h,)), ("ffn_gate", (f, h)), ("ffn_up", (f, h)),
                            ("ffn_down", (h, f))):
            yield f"blk.{i}.{name}.weight", shape
    yield "output_norm.weight", (h,)
    yield "output.weight", (vocab, h)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mix", default="q4_k_m", choices=["q4_k_m", "q5_k_m", "q6_k", "q4_0", "f16"],
                        help="q4_0 with --llama-cpp only (its Q6_K head: what llama.cpp writes); f16: the unquantized "
                             "source alone")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--shape", default="smol-vocab-1b", choices=sorted(SHAPES))
    parser.add_argument("--llama-cpp", action="store_true", help="quantize with llama.cpp's quantizer")
    parser.add_argument("--quantize-bin", type=Path, default=None,
                        help="llama.cpp's llama-quantize (implies --llama-cpp)")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT, help="the GGUF whose tokenizer is copied")
    parser.add_argument("--tokenizer-only", action="store_true", help="write OUT as --tokenizer's metadata, no tensors")
    args = parser.parse_args()
    if args.tokenizer_only:
        write(args.out, SHAPES[args.shape], 0, None, args.tokenizer, tensors_too=False)
        print(args.out, f"{args.out.stat().st_size / 2**20:.1f} MiB")
        return
    shape = SHAPES[args.shape]
    layers = shape["layers"] if args.layers is None else args.layers
    llama_cpp = args.llama_cpp or args.quantize_bin is not None
    if args.mix == "f16":
        write(args.out, shape, layers, None, args.tokenizer)
    elif args.mix == "q4_0" and not llama_cpp:
        parser.error("--mix q4_0 is llama.cpp's (--llama-cpp)")
    elif llama_cpp:
        f16 = args.out.with_name(args.out.stem + ".f16-source.gguf")
        write(f16, shape, layers, None, args.tokenizer)
        if args.quantize_bin is None:
            quantize_q4_k_m(f16, args.out, args.mix.upper())
        else:  # (llama.cpp's own program, on every core)
            subprocess.run([str(args.quantize_bin), str(f16), str(args.out), args.mix.upper()], check=True,
                           stdout=subprocess.DEVNULL)
        f16.unlink()
    else:
        write(args.out, shape, layers, args.mix, args.tokenizer)
    print(args.out, f"{args.out.stat().st_size / 2**20:.0f} MiB")


def write(out: Path, shape: dict, layers: int, mix: str | None, tokenizer: Path, tensors_too: bool = True) -> None:
    """The model's GGUF: its matrices in `mix`'s types by our quantizers, or (mix None) all F16."""
    reader = GGUFReader(tokenizer)
    writer = GGUFWriter(out, "llama")
    dims = {"llama.block_count": layers, "llama.embedding_length": shape["hidden"],
            "llama.feed_forward_length": shape["ffn"], "llama.attention.head_count": shape["heads"],
            "llama.attention.head_count_kv": shape["kv_heads"], "llama.rope.dimension_count": shape["head_dim"]}
    vocab = int(reader.get_field("llama.vocab_size").contents())
    padded = shape["vocab"] is not None and shape["vocab"] > vocab
    skip = tuple(dims) + (("llama.vocab_size", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type") if padded else ())
    skip += ("llama.rope.freq_base",) if shape["rope_theta"] else ()
    copy_metadata(reader, writer, {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, None: 1}[mix], skip=skip)
    for key, value in dims.items():
        writer.add_uint32(key, value)
    if shape["rope_theta"]:
        writer.add_rope_freq_base(shape["rope_theta"])
    if padded:  # (the tokenizer's tokens, then reserved control tokens up to the model's vocabulary)
        tokens = list(reader.get_field("tokenizer.ggml.tokens").contents())
        types = list(reader.get_field("tokenizer.ggml.token_type").contents())
        extra = shape["vocab"] - vocab
        writer.add_token_list(tokens + [f"<|reserved_special_token_{i}|>" for i in range(extra)])
        writer.add_token_types(types + [CONTROL] * extra)
        writer.add_uint32("llama.vocab_size", shape["vocab"])
        vocab = shape["vocab"]
    gen = torch.Generator().manual_seed(0)  # (torch's normal draws: all cores, ~10x numpy's on an 8B)
    for name, dims_ in tensors(shape, layers, vocab) if tensors_too else ():
        if len(dims_) == 1:
            writer.add_tensor(name, np.ones(dims_, dtype=np.float32))
            continue
        w = torch.randn(dims_, generator=gen).mul_(0.02)
        if mix is None:
            writer.add_tensor(name, w.half().numpy())
            continue
        w = w.numpy()
        qtype = QT.Q8_0 if name == "token_embd.weight" else matrix_type(name, dims_[1], mix)
        data = quantize(w, qtype) if qtype == QT.Q8_0 else quantize_kquant(w, int(qtype))
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
