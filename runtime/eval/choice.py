"""Accuracy by continuation likelihood, in the CORE task formats (DCLM; nanochat's core_eval).

A task is a JSONL file of items of one type:
- `multiple_choice`: {"query", "choices", "gold"}: the prompts are the query followed by each
  choice; the choice whose tokens have the lowest mean loss is the model's answer;
- `schema`: {"context_options", "continuation", "gold"}: each context followed by the one
  continuation; the context under which it has the lowest mean loss is the answer;
- `language_modeling`: {"context", "continuation"}: right when the model's greedy prediction
  is every token of the continuation.
Prompts render as nanochat renders them: `shots` examples (drawn per item with a fixed seed,
never the item itself) each followed by a blank line, then the item; the continuation joins
its context through `delimiter`. Each prompt is one request for its prompt logprobs, all
submitted at once; the scored tokens are those after the prompts' common prefix (multiple
choice) or before their common suffix (schema).
"""

from __future__ import annotations

import random
from typing import NamedTuple, Sequence

from nanoinfer.errors import RequestError
from nanoinfer.sampling.sampler import SamplingParams

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
DELIMITER, SHOTS = " ", 0  # nanochat's defaults: a space before the continuation, no examples
FIELDS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
          "language_modeling": ("context", "continuation")}


class Accuracy(NamedTuple):
    accuracy: float
    n: int


class Scored(NamedTuple):
    """One item's prompts as token ids, and the token span [start, end) scored in each."""

    tokens: list[list[int]]
    spans: list[tuple[int, int]]


def check_items(items: Sequence[dict], task_type: str) -> None:
    if task_type not in TASK_TYPES:
        raise RequestError(f"task_type={task_type!r} is invalid: expected one of {list(TASK_TYPES)}",
                           param="task_type")
    if not items:
        raise RequestError("the task has no items", param="task")
    for i, item in enumerate(items):
        missing = [f for f in FIELDS[task_type] if f not in item]
        if missing:
            raise RequestError(f"item {i} has no {missing[0]!r}: a {task_type} item needs {list(FIELDS[task_type])}",
                               param="task")


def fewshot(items: Sequence[dict], index: int, shots: int) -> list[dict]:
    """The examples shown before item `index`: drawn from the others, seeded by the index."""
    if shots <= 0:
        return []
    others = [i for i in range(len(items)) if i != index]
    return [items[i] for i in random.Random(1234 + index).sample(others, min(shots, len(others)))]


def render(item: dict, task_type: str, delimiter: str, examples: Sequence[dict]) -> list[str]:
    """The item's prompts (language modeling: the context alone, then with its continuation)."""
    if task_type == "multiple_choice":
        head = "".join(f"{e['query']}{delimiter}{e['choices'][e['gold']]}\n\n" for e in examples)
        return [f"{head}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        head = "".join(f"{e['context_options'][e['gold']]}{delimiter}{e['continuation']}\n\n" for e in examples)
        return [f"{head}{context}{delimiter}{item['continuation']}" for context in item["context_options"]]
    head = "".join(f"{e['context'].strip()}{delimiter}{e['continuation']}\n\n" for e in examples)
    without = f"{head}{item['context'].strip()}{delimiter}"
    return [without.strip(), without + item["continuation"]]


def common_length(seqs: Sequence[Sequence[int]], from_end: bool = False) -> int:
    """Length of the prefix (or suffix) every sequence shares."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        at = -1 - i if from_end else i
        if any(s[at] != seqs[0][at] for s in seqs):
            return i
    return n


def score_spans(tokens: list[list[int]], task_type: str) -> Scored:
    # (Each span keeps at least one token: a choice that is all shared prefix, or contexts
    # whose continuation tokenizes differently under each, still get a score.)
    if task_type == "multiple_choice":
        start = min(common_length(tokens), min(len(t) for t in tokens) - 1)
        return Scored(tokens, [(start, len(t)) for t in tokens])
    if task_type == "schema":
        suffix = max(1, common_length(tokens, from_end=True))
        return Scored(tokens, [(len(t) - suffix, len(t)) for t in tokens])
    without, with_ = tokens
    if with_[:len(without)] != without or len(with_) == len(without):
        raise RequestError("a language_modeling item's context does not tokenize as a prefix of context + "
                           "continuation (or the continuation is empty)", param="task")
    return Scored([with_], [(len(without), len(with_))])


def prepare(items: Sequence[dict], task_type: str, encode, *, delimiter: str = DELIMITER,
            shots: int = SHOTS) -> list[Scored]:
    """Every item's prompts tokenized (`encode(text) -> ids`, with the model's BOS) and spans."""
    check_items(items, task_type)
    return [score_spans([encode(p) for p in render(item, task_type, delimiter, fewshot(items, i, shots))], task_type)
            for i, item in enumerate(items)]


def evaluate(llm, items: Sequence[dict], task_type: str, *, delimiter: str = DELIMITER, shots: int = SHOTS,
             use_tqdm: bool = False) -> tuple[Accuracy, list[bool]]:
    """The accuracy of `llm`'s model on the task, and whether each item was answered right."""
    scored = prepare(items, task_type, lambda text: llm.tokenizer.encode(text, add_special_tokens=True),
                     delimiter=delimiter, shots=shots)
    prompts = [t for s in scored for t in s.tokens]
    wants_top = task_type == "language_modeling"
    outs = iter(llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1 if wants_top else 0),
                             use_tqdm=use_tqdm))
    right = []
    for item, s in zip(items, scored):
        logprobs = [next(outs).prompt_logprobs for _ in s.tokens]
        if wants_top:
            (start, end), (ids,), (lps,) = s.spans[0], s.tokens, logprobs
            right.append(all(lps[p].top[0][0] == ids[p] for p in range(start, end)))
            continue
        losses = [-sum(lp[p].logprob for p in range(a, b)) / (b - a) for lp, (a, b) in zip(logprobs, s.spans)]
        right.append(losses.index(min(losses)) == item["gold"])
    return Accuracy(sum(right) / len(right), len(right)), right
