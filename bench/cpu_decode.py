"""CPU decode speed of the default model: NanoInfer beside transformers, same GGUF, same prompt.

    python bench/cpu_decode.py [--new-tokens 128] [--threads 2] [--repeats 3]

Both run fp32, greedy, one sequence, `--threads` torch threads. Decode tok/s counts the
tokens after the first (the prefill is timed apart), best of `--repeats` runs each.
"""

from __future__ import annotations

import argparse
import time

import torch


def time_ours(model, prompt_ids, new_tokens):
    from nanoinfer.sampling import SamplingParams
    from runtime.engine_core import EngineConfig, EngineCore

    engine = EngineCore(model, EngineConfig(num_blocks=64, block_size=16))
    engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    start = time.perf_counter()
    engine.step()  # prefill + first token
    first = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    end = time.perf_counter()
    return first - start, (new_tokens - 1) / (end - first)


def time_transformers(hf_model, prompt_ids, new_tokens):
    ids = torch.tensor([prompt_ids])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    hf_model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    first = time.perf_counter()
    hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    end = time.perf_counter()
    # The second call repeats the prefill; take it out using the first call's time.
    return first - start, (new_tokens - 1) / ((end - first) - (first - start))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="Write a haiku about the sea")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from nanoinfer.loaders import load_model

    model = load_model(None, device="cpu", dtype="float32", progress=False)
    prompt_ids = model.tokenizer.encode(args.prompt)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model.path.parent, gguf_file=model.path.name, dtype=torch.float32).eval()

    rows = []
    with torch.inference_mode():
        for name, fn, target in (("nanoinfer", time_ours, model), ("transformers", time_transformers, hf_model)):
            fn(target, prompt_ids, 8)  # warm-up
            runs = [fn(target, prompt_ids, args.new_tokens) for _ in range(args.repeats)]
            rows.append((name, min(r[0] for r in runs) * 1e3, max(r[1] for r in runs)))
    base = rows[1][2]
    print(f"model {model.path.name}  prompt {len(prompt_ids)} tokens  new {args.new_tokens}  threads {args.threads}")
    print(f"{'engine':<14}{'prefill ms':>12}{'decode tok/s':>14}{'vs transformers':>17}")
    for name, prefill_ms, tps in rows:
        print(f"{name:<14}{prefill_ms:>12.1f}{tps:>14.1f}{tps / base:>16.2f}x")


if __name__ == "__main__":
    main()
