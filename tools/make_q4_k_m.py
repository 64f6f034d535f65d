"""Write a GGUF model as Q4_K_M (Q4_K, Q6_K for some tensors) for the K-quant tests and benches.

The default model is cached as Q4_1 and no F16 source is at hand: its tensors are dequantized
to an F16 GGUF (gguf's writer, the metadata copied), then that is quantized by llama.cpp's own
quantizer (llama-cpp-python's `llama_model_quantize`, importable with PYTHONPATH=/work/llamacpp
here). llama.cpp keeps K-quants only where a row is a multiple of 256: for SmolLM2-135M (hidden
576) that is ffn_down; the other matrices fall back to Q5_0/Q5_1/Q8_0 as llama.cpp decides.
Without llama-cpp-python, our own simpler mix (`write_own_q4_k_m`): rows of whole super-blocks
in Q4_K, attn_v and ffn_down of even layers in Q6_K (llama.cpp's Q4_K_M gives half of them more bits), others in
Q5_0, the embedding in Q8_0 (gguf-py's quantizers for those; tools/kquant_quantize.py for the
K-quants, round to nearest: a little less accurate than llama.cpp's search).

    python tools/make_q4_k_m.py [SOURCE.gguf] [OUT.gguf]     (from the repository's root)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from tools.kquant_quantize import quantize as quantize_kquant

DEFAULT = Path("/root/.cache/nanoinfer/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")


def write_f16(source: Path, target: Path) -> None:
    """`source` with every quantized tensor dequantized: 2-D ones to F16, the rest F32."""
    reader = GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    writer = GGUFWriter(target, arch)
    copy_metadata(reader, writer, 1)  # MOSTLY_F16
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        writer.add_tensor(t.name, w.astype(np.float16) if w.ndim == 2 else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_metadata(reader: GGUFReader, writer: GGUFWriter, file_type: int, skip: tuple[str, ...] = ()) -> None:
    """`reader`'s key/values into `writer`, but the header's, the architecture, the file type and `skip`."""
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type", *skip):
            continue
        kind = f.types[0]
        writer.add_key_value(f.name, f.contents(), kind, sub_type=f.types[-1] if kind == GGUFValueType.ARRAY else None)
    writer.add_file_type(file_type)


def own_type(name: str, cols: int) -> QT:
    """Our Q4_K_M-like choice for a matrix (see the module's docstring)."""
    if name == "token_embd.weight":
        return QT.Q8_0
    if cols % 256:
        return QT.Q5_0
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    more_bits = name.endswith(("attn_v.weight", "ffn_down.weight")) and layer % 2 == 0
    return QT.Q6_K if more_bits else QT.Q4_K


def write_own_q4_k_m(source: Path, target: Path) -> None:
    """`source` requantized by our own quantizers, no llama.cpp."""
    reader = GGUFReader(source)
    writer = GGUFWriter(target, reader.get_field("general.architecture").contents())
    copy_metadata(reader, writer, 15)  # MOSTLY_Q4_K_M
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if w.ndim != 2:
            writer.add_tensor(t.name, w)
            continue
        qtype = own_type(t.name, w.shape[1])
        data = quantize_kquant(w, int(qtype)) if qtype in (QT.Q4_K, QT.Q6_K) else quantize(w, qtype)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_q4_k_m(f16: Path, target: Path, ftype: str = "Q4_K_M") -> None:
    """llama.cpp's quantizer, type Q4_K_M or another `ftype` it names (2 threads: the machine is shared)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(target).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {f16}")


def main(argv: list[str]) -> None:
    source = Path(argv[0]) if argv else DEFAULT
    target = Path(argv[1]) if len(argv) > 1 else source.with_name(source.name.split(".Q")[0] + ".Q4_K_M.gguf")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not importable: our own quantizers")
        write_own_q4_k_m(source, target)
    else:
        f16 = target.with_name(target.stem + ".f16-source.gguf")
        write_f16(source, f16)
        quantize_q4_k_m(f16, target)
        f16.unlink()
    types = {}
    for t in GGUFReader(target).tensors:
        types.setdefault(QT(t.tensor_type).name, []).append(t.name)
    for name, tensors in sorted(types.items()):
        print(f"{name}: {len(tensors)} tensors, e.g. {tensors[:3]}")
    print(target)


if __name__ == "__main__":
    main(sys.argv[1:])
