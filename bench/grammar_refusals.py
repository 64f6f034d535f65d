"""How often a grammar would refuse an unmasked draw, and how much of the masks' fill such draws would save.

    python bench/grammar_refusals.py [--model MODEL] [--schema bounded|plain] [--num-seqs 8] [--max-tokens 160]

The idea issue 64 names for grammars at many sequences: draw first from the unmasked distribution, and fill the mask
(and draw again) only for the rows whose token the grammar refuses. Exact for greedy rows and plain temperature
draws: a draw over the masked logits with the same noise picks the unmasked draw's token whenever the mask holds
it (llguidance's mask, not validate_tokens, which takes more tokens where the grammar forces bytes). Whether it pays depends on a real model's distributions (random weights draw almost anything), so this
runs bench/structured.py's workload on a real checkpoint (default: the default model) with the engine's masks,
and for each constrained row records: the probability, at the workload's temperature 0.8, that an unmasked draw
falls outside the grammar; whether the unmasked argmax does; whether the grammar allows one token only; and the
row's mask fill time (one row at a time, on the engine thread: `Constraint.fill`, the reference of the threaded
fill), weighted by the chance its draw would be kept (the fill that drawing first would skip).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from bench.structured import SCHEMAS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as LLM takes it (default: the default model)")
    parser.add_argument("--schema", choices=sorted(SCHEMAS), default="bounded")
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()

    from nanoinfer import LLM, SamplingParams
    from nanoinfer.structured.grammars import Constraint, Grammars
    from runtime.executor import grammar_masks

    temperature = 0.8
    fill_s: dict[tuple[int, int], float] = {}  # (bitmask address, row) -> the row's fill time
    rows = refused = greedy_refused = forced = 0.0
    total_fill = kept_fill = 0.0

    def timed_fill(self, bitmask, row, drafts=()):
        start = time.perf_counter()
        fill(self, bitmask, row, drafts)
        fill_s[(bitmask.data_ptr(), row)] = time.perf_counter() - start

    def record(self, logits, device, fused=None):
        nonlocal rows, refused, greedy_refused, forced, total_fill, kept_fill
        masked = applied(self, logits, device, fused)
        for i, row in enumerate(self.at):
            raw, allowed = logits[row].float(), masked[row] > torch.finfo(torch.float32).min
            kept = float(torch.softmax(raw / temperature, -1)[allowed].sum())
            seconds = fill_s.pop((self.bitmask.data_ptr(), i), 0.0)
            rows, refused, forced = rows + 1, refused + 1 - kept, forced + int(allowed.sum() == 1)
            greedy_refused += int(not allowed[raw.argmax()])
            total_fill, kept_fill = total_fill + seconds, kept_fill + seconds * kept
        return masked

    fill, applied = Constraint.fill, grammar_masks.StepMasks.applied
    Constraint.fill = timed_fill
    Grammars.fill = lambda self, items, bitmask, rounds=True: [c.fill(bitmask, r, d) for c, r, d in items]
    grammar_masks.StepMasks.applied = record
    with LLM(args.model, progress=False, async_scheduling=False) as llm:
        prompts = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(args.num_seqs)]
        params = [SamplingParams(temperature=temperature, seed=i, max_tokens=args.max_tokens,
                                 structured_outputs={"json": SCHEMAS[args.schema]}) for i in range(args.num_seqs)]
        llm.generate(prompts, params, use_tqdm=False)
    print(f"model {args.model or 'the default'}  schema {args.schema}  constrained rows {rows:.0f}")
    print(f"P(unmasked draw refused) {refused / rows:.3f}  argmax refused {greedy_refused / rows:.3f}  "
          f"one token allowed {forced / rows:.3f}  fill {total_fill * 1e6 / rows:.0f} us a row, "
          f"of it on draws kept {kept_fill / total_fill:.2f}")


if __name__ == "__main__":
    main()
