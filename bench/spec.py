"""Speculative decoding: acceptance rate and speedup over decoding without it, same run.

    python bench/spec.py [--model M] [--k 2 4 8] [--max-tokens 128]           # CPU: n-gram lookup
    python bench/spec.py --shape llama-3.1-8b --draft-shape llama-3.2-1b --device cuda [--k 2 4 6 8] [--int8-draft]

CPU (default model): chat prompts whose answers copy the prompt (rewrite, extract, edit
code), greedy, one request at a time (batch 1) and all at once; n-gram lookup with each k.

GPU (random bf16 weights in real shapes, bench/shapes.py): a draft model in `--draft-shape`,
batch 1, greedy, at the two ends of the acceptance range:
- 0% acceptance: the draft's own random weights, whose proposals the target (almost) never
  accepts: what speculation costs, on every step ("adaptive": false) and with the policy
  that switches it off while it is slower (the default);
- full acceptance: the same draft and verification, then every draft taken as if accepted
  (a random target's own tokens cannot be proposed: its argmax flips with the summation
  order of the verify step): the mechanism's ceiling; also with the draft's weights in int8
  (`"quantization": "int8"` in speculative_config), a cheaper draft pass.
Output tok/s counts generated tokens over the wall time of the decode (prefill excluded).
"""

from __future__ import annotations

import argparse
import time

import torch

CPU_TASKS = [
    ("rewrite", "Rewrite this paragraph with the spelling fixed, changing nothing else:\n\n"
                "The quick brown fox jumpd over the lazy dog. It was a sunny day and the fox was verry happy. "
                "Later the dog woke up and chased the fox acros the field until they were both tired."),
    ("extract", "Copy every line of this list that mentions a city, exactly as written:\n\n"
                "- Paris is the capital of France.\n- Apples are red or green.\n- Tokyo is a very large city.\n"
                "- The sky is blue.\n- Berlin has many museums.\n- Water boils at 100 degrees."),
    ("edit-code", "Rename the variable `x` to `total` in this function and return the whole function:\n\n"
                  "def sum_list(values):\n    x = 0\n    for v in values:\n        x = x + v\n    return x\n"),
]


def cpu(args):
    from nanoinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=False)
    print(f"model {args.model or 'default'}  CPU, {torch.get_num_threads()} threads, greedy, "
          f"max_tokens {args.max_tokens}")
    print(f"{'speculation':<16}{'batch':>6}{'tok/s':>9}{'speedup':>9}{'accepted':>10}{'tokens/step':>13}"
          f"{'same text':>11}")
    reference = {}
    for k in [0, *args.k]:
        spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2}
        with LLM(args.model, device="cpu", progress=False, speculative_config=spec) as llm:
            llm.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0, max_tokens=4),
                         use_tqdm=False)  # warm-up
            for batch in (1, len(CPU_TASKS)):
                chats = [[{"role": "user", "content": text}] for _, text in CPU_TASKS]
                before = llm.stats()
                start = time.perf_counter()
                if batch == 1:
                    outs = [llm.generate([chat], params, use_tqdm=False)[0] for chat in chats]
                else:
                    outs = llm.generate(chats, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                after = llm.stats()
                tokens = sum(len(o.token_ids) for o in outs)
                texts = [o.text for o in outs]
                steps = after["steps"] - before["steps"]
                drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
                accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                reference.setdefault(batch, (tokens / elapsed, texts))
                base, base_texts = reference[batch]
                name = "none" if k == 0 else f"ngram k={k}"
                rate = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
                print(f"{name:<16}{batch:>6}{tokens / elapsed:>9.1f}{tokens / elapsed / base:>8.2f}x{rate:>10}"
                      f"{tokens / max(steps, 1):>13.2f}{str(texts == base_texts):>11}")


def gpu(args):
    from bench.shapes import random_model
    from nanoinfer.sampling.sampler import SamplingParams
    from nanoinfer.sampling.rejection import Verified
    from runtime.executor import model_runner
    from runtime.async_engine import engine_config
    from runtime.engine.engine_core import EngineCore

    target = random_model(args.shape, device=args.device)
    draft = random_model(args.draft_shape, device=args.device)
    prompt = [11, 22, 33, 44, 55, 66, 77, 88]
    n = args.max_tokens
    print(f"target {args.shape}  draft {args.draft_shape}  {torch.cuda.get_device_name()}  batch 1, greedy, "
          f"{n} tokens")

    drafts = {"bf16": draft}
    if args.int8_draft:
        from nanoinfer.loaders import LoadedModel
        from nanoinfer.loaders.quantize import quantize_params

        drafts["int8"] = LoadedModel(draft.config, quantize_params(draft.params, "int8"), None, draft.path)

    def decode(spec, form="bf16"):
        core = EngineCore(target, engine_config(num_blocks=512, max_model_len=4096, speculative_config=spec,
                                                cuda_graph_capture="all"),
                          draft_model=drafts[form] if spec else None)
        for tokens in (16, n):  # (a warm-up request, then the measured one)
            core.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
            core.step()  # the prefill (and the first token)
            torch.cuda.synchronize()
            start, steps = time.perf_counter(), core.step_count
            while core.has_unfinished():
                core.step()
            elapsed = time.perf_counter() - start
        if spec and args.verbose:
            policy = core.speculator.policy
            print(f"    policy rates (tok/s, speculating / not): {policy.rate(True)} / {policy.rate(False)}, "
                  f"drafted {core.stats()['spec_draft_tokens']}")
        return (n - 1) / elapsed, core.stats(), core.step_count - steps

    verify = model_runner.verify

    def accept_all(logits, st, drafts, q=None, draw=None):
        """Verification as it runs, then every draft taken: the mechanism's ceiling."""
        v = verify(logits, st, drafts, q, draw=draw)
        has = drafts >= 0
        return Verified(has, torch.where(has, drafts.clamp_min(0), v.tokens))

    base, _, _ = decode(None)
    print(f"{'speculation':<34}{'tok/s':>9}{'speedup':>9}{'accepted':>10}{'tokens/step':>13}")
    print(f"{'none':<34}{base:>9.1f}{1:>8.2f}x")
    for k in args.k:
        for mode, adaptive, forced, form in (("0% (random draft)", False, False, "bf16"),
                                             ("0%, adaptive", True, False, "bf16"),
                                             ("100% (every draft taken)", False, True, "bf16"),
                                             ("100%, int8 draft", False, True, "int8")):
            if form not in drafts:
                continue
            spec = {"model": args.draft_shape, "num_speculative_tokens": k, "adaptive": adaptive}
            model_runner.verify = accept_all if forced else verify
            tok_s, stats, steps = decode(spec, form)
            model_runner.verify = verify
            drafted, accepted = stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
            rate = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
            print(f"{f'k={k} {mode}':<34}{tok_s:>9.1f}{tok_s / base:>8.2f}x{rate:>10}{(n - 1) / max(steps, 1):>13.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--shape", default=None, help="GPU: the target's shape (bench/shapes.py)")
    parser.add_argument("--draft-shape", default="llama-3.2-1b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--k", type=int, nargs="+", default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="GPU: the speculation policy's measurements")
    parser.add_argument("--int8-draft", action="store_true", help="GPU: full acceptance with the draft in int8 too")
    args = parser.parse_args()
    if args.shape:
        args.k = args.k or [2, 4, 6, 8]
        gpu(args)
    else:
        torch.set_num_threads(args.threads)
        args.k = args.k or [2, 4, 8]
        cpu(args)


if __name__ == "__main__":
    main()
