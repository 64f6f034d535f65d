"""What quantization costs in quality: perplexity and greedy agreement against the exact path.

    python bench/quality.py [--model M] [--tokens 256] [--threads 2] [--modes none int4 ...]

The default model's GGUF, on the CPU, in each mode:
- none: the file dequantized to fp32 (the exact path, the reference);
- gguf: the file's blocks kept packed, as the CPU runs them by default: cpu_native's block
  matmul (activations rounded to int8 per group of 32, as llama.cpp does), or where that does
  not build, torch's int4 kernel (Q8_0 as two int4 halves; bf16 activations);
- gguf, torch int4: the same blocks repacked for torch's int4 kernel (bf16 activations);
- int8 / fp8: the dequantized weights quantized again per row (fp8 also rounds activations
  per token to e4m3; the CPU runs the same arithmetic as the GPU's `_scaled_mm`, in fp32);
- int4: the dequantized weights rounded again to 4 bits per group of 128 (a scale and a min,
  as AWQ/GPTQ checkpoints hold them; torch's int4 kernel here, bf16 activations);
- fp8 KV: the exact weights with an e4m3 KV cache.
Perplexity: `bench/data/quality.txt` as one prefill, every position scored. Greedy agreement:
the exact path generates `--tokens` greedy tokens for a fixed chat prompt; each mode then
predicts every one of them from the exact path's own prefix (teacher-forced top-1 agreement,
which one early near-tie cannot shift out of line), and generates its own tokens greedily
(the position of its first divergence).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoinfer.quant import quantized

TEXT = Path(__file__).parent / "data" / "quality.txt"
PROMPT = [{"role": "user", "content": "Explain in a few paragraphs why lighthouses were built and how they worked."}]


def all_logits(model, ids: list[int], kv_cache_dtype: str) -> torch.Tensor:
    """Logits at every position of `ids` (one prefill; the next token's prediction at each)."""
    from nanoinfer.model.batch import SeqChunk, build_batch
    from nanoinfer.backends.choose import kernels_for
    from nanoinfer.model.kv_cache import allocate_kv_pool, kv_dtype
    from nanoinfer.model.decoder import forward

    cfg, bs = model.config, 16
    blocks = -(-len(ids) // bs)
    kv = allocate_kv_pool(cfg, blocks, bs, kv_dtype(model.params.dtype, kv_cache_dtype), "cpu")
    batch = build_batch([SeqChunk(ids, 0, list(range(blocks)), True)], bs)
    batch = batch._replace(logits_indices=torch.arange(len(ids) - 1))
    kernels = kernels_for(cfg, torch.device("cpu"), bs)
    with torch.inference_mode():
        return forward(model.params, kv, batch, cfg, kernels.attention, kernels.layer_fns).float()


def perplexity(model, ids: list[int], kv_cache_dtype: str) -> float:
    return math.exp(F.cross_entropy(all_logits(model, ids, kv_cache_dtype), torch.tensor(ids[1:])).item())


def llama_cpp_perplexity(path, ids: list[int], threads: int) -> float:
    """llama.cpp's perplexity of the same token ids, every position scored, one evaluation."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=len(ids) + 8,
                          n_batch=len(ids), logits_all=True, verbose=False)
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[:len(ids) - 1], dtype=np.float32))
    return math.exp(F.cross_entropy(logits, torch.tensor(ids[1:])).item())


def greedy(model, prompt_ids: list[int], tokens: int, kv_cache_dtype: str) -> list[int]:
    from nanoinfer.sampling.sampling_params import SamplingParams
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    engine = EngineCore(model, engine_config(num_blocks=64, kv_cache_dtype=kv_cache_dtype))
    seq = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids


def torch_int4(params):
    """Block weights repacked for torch's int4 kernel (the same values, bf16 scales)."""
    def repack(w):
        return quantized.pack(w.groups()) if isinstance(w, quantized.BlockWeight) else w

    fields = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    layers = tuple(dataclasses.replace(lp, **{f: repack(getattr(lp, f)) for f in fields}) for lp in params.layers)
    return dataclasses.replace(params, layers=layers, lm_head=repack(params.lm_head))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also llama.cpp's perplexity on the same file and token ids (llama-cpp-python)")
    parser.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                        help="a subset of the modes (the first is the reference): none, gguf, 'gguf, torch int4', "
                             "int8, fp8, int4, 'none, fp8 KV'")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from nanoinfer.loaders import load_model

    modes = [("none", "auto"), ("gguf", "auto"), ("gguf, torch int4", "auto"), ("int8", "auto"), ("fp8", "auto"),
             ("int4", "auto"), ("none", "fp8")]
    if args.modes:
        named = {(q if kv == "auto" else f"{q}, fp8 KV"): (q, kv) for q, kv in modes}
        modes = [named[m] for m in args.modes]
    rows, reference = [], None
    for quantization, kv_cache_dtype in modes:
        model = load_model(args.model, device="cpu", dtype="float32", progress=False,
                           quantization=quantization.split(",")[0])
        if quantization == "gguf, torch int4":
            model = dataclasses.replace(model, params=torch_int4(model.params))
        ids = model.tokenizer.encode(TEXT.read_text())
        prompt_ids = model.tokenizer.encode(model.tokenizer.apply_chat_template(PROMPT), add_special_tokens=False)
        ppl = perplexity(model, ids, kv_cache_dtype)
        out = greedy(model, prompt_ids, args.tokens, kv_cache_dtype)
        if reference is None:
            reference = (ppl, out)
        target = reference[1]
        predicted = all_logits(model, prompt_ids + target, kv_cache_dtype)[len(prompt_ids) - 1:].argmax(-1)
        agree = (predicted == torch.tensor(target)).float().mean().item()
        same = [a == b for a, b in zip(out, target)]
        first = same.index(False) if False in same else len(same)
        name = f"{quantization} weights" + (", fp8 KV" if kv_cache_dtype == "fp8" else "")
        rows.append((name, ppl, 100 * (ppl / reference[0] - 1), 100 * agree, first))
        print(f"(done: {name})", flush=True)
    if args.llama_cpp:
        rows.append(("llama.cpp", (ppl := llama_cpp_perplexity(model.path, ids, args.threads)),
                     100 * (ppl / reference[0] - 1), float("nan"), -1))
    print(f"model {model.path.name}  text {TEXT.name} ({len(ids)} tokens)  greedy tokens {args.tokens}")
    print(f"{'mode':<24}{'perplexity':>11}{'delta %':>9}{'top-1 agreement %':>19}{'own greedy: first divergence':>31}")
    for name, ppl, delta, agree, first in rows:
        print(f"{name:<24}{ppl:>11.3f}{delta:>+9.2f}{agree:>19.1f}{first:>31}")


if __name__ == "__main__":
    main()
