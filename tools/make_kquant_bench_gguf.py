"""Write a Llama-3.2-1B-shaped GGUF of random weights in K-quants (our own quantizers) with the default model's tokenizer.

    python tools/make_kquant_bench_gguf.py OUT.gguf [--mix q4_k_m|q5_k_m|q6_k|q4_0] [--layers 16] [--llama-cpp]

For timing the K-quant kernels in a whole decode (bench/cpu_decode.py --model OUT.gguf): 16
layers of width 2048, 32/8 heads of 64, FFN 8192, the default model's 49,152-token vocabulary
and tokenizer. With --llama-cpp the weights are written in F16 beside OUT and quantized by
llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`, 2 threads: minutes), the
mix it chooses for `--mix` (Q4_0 too: its head in Q6_K). Without, our own quantizers (tools/kquant_quantize.py, seconds a
matrix): the types follow llama.cpp's Q4_K_M (tools/make_q4_k_m.own_type: Q4_K, attn_v and
ffn_down of even layers Q6_K), Q5_K_M (the same with Q5_K), or all Q6_K; the embedding Q8_0
and the output head Q6_K as llama.cpp writes them. Weights ~N(0, 0.02): text is noise, the
speed is a real file's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize

from tools.kquant_quantize import quantize as quantize_kquant
from tools.make_q4_k_m import DEFAULT, copy_metadata, own_type, quantize_q4_k_m

SHAPE = dict(hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64)


def matrix_type(name: str, cols: int, mix: str) -> QT:
    if name == "output.weight":
        return QT.Q6_K
    qtype = own_type(name, cols)
    if mix == "q6_k" and qtype in (QT.Q4_K, QT.Q6_K):
        return QT.Q6_K
    return QT.Q5_K if mix == "q5_k_m" and qtype == QT.Q4_K else qtype


def tensors(layers: int, vocab: int):
    """(name, [rows, cols] or [n]) of a llama of SHAPE."""
    h, f, q, kv = SHAPE["hidden"], SHAPE["ffn"], SHAPE["heads"] * SHAPE["head_dim"], SHAPE["kv_heads"] * SHAPE["head_dim"]
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
    parser.add_argument("--mix", default="q4_k_m", choices=["q4_k_m", "q5_k_m", "q6_k", "q4_0"],
                        help="q4_0 with --llama-cpp only (its Q6_K head: what llama.cpp writes)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--llama-cpp", action="store_true", help="quantize with llama.cpp's quantizer")
    args = parser.parse_args()
    if args.mix == "q4_0" and not args.llama_cpp:
        parser.error("--mix q4_0 is llama.cpp's (--llama-cpp)")
    if args.llama_cpp:
        f16 = args.out.with_name(args.out.stem + ".f16-source.gguf")
        write(f16, args.layers, None)
        quantize_q4_k_m(f16, args.out, args.mix.upper())
        f16.unlink()
    else:
        write(args.out, args.layers, args.mix)
    print(args.out, f"{args.out.stat().st_size / 2**20:.0f} MiB")


def write(out: Path, layers: int, mix: str | None) -> None:
    """The model's GGUF: its matrices in `mix`'s types by our quantizers, or (mix None) all F16."""
    reader = GGUFReader(DEFAULT)
    writer = GGUFWriter(out, "llama")
    dims = {"llama.block_count": layers, "llama.embedding_length": SHAPE["hidden"],
            "llama.feed_forward_length": SHAPE["ffn"], "llama.attention.head_count": SHAPE["heads"],
            "llama.attention.head_count_kv": SHAPE["kv_heads"], "llama.rope.dimension_count": SHAPE["head_dim"]}
    copy_metadata(reader, writer, {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, None: 1}[mix], skip=tuple(dims))
    for key, value in dims.items():
        writer.add_uint32(key, value)
    vocab = int(reader.get_field("llama.vocab_size").contents())
    rng = np.random.default_rng(0)
    for name, shape in tensors(layers, vocab):
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
            continue
        w = rng.standard_normal(shape, dtype=np.float32) * 0.02
        if mix is None:
            writer.add_tensor(name, w.astype(np.float16))
            continue
        qtype = QT.Q8_0 if name == "token_embd.weight" else matrix_type(name, shape[1], mix)
        data = quantize(w, qtype) if qtype == QT.Q8_0 else quantize_kquant(w, int(qtype))
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
