"""Generated answers scored against references: BLEU (sacrebleu), ROUGE-1/2/L (rouge-score), exact match.

A task is a JSONL file of {"prompt", "reference"} items. Every prompt is submitted at once
(greedy unless the sampling flags say otherwise; `chat` wraps each as a user turn in the chat
template), and the answers are scored by the libraries themselves: corpus BLEU as sacrebleu
computes it (0-100), the mean ROUGE F-measure per type as rouge-score computes it with its
stemmer (0-1), and the share of answers equal to their reference after trimming whitespace.
Both libraries are the `eval` extra (`pip install nanoinfer[eval]`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from nanoinfer.errors import RequestError
from nanoinfer.sampling.sampler import SamplingParams

ROUGE = ("rouge1", "rouge2", "rougeL")


class Scores(NamedTuple):
    bleu: float
    rouge1: float
    rouge2: float
    rougeL: float
    exact_match: float
    n: int


def check_items(items: Sequence[dict]) -> None:
    if not items:
        raise RequestError("the task has no items", param="task")
    for i, item in enumerate(items):
        for field in ("prompt", "reference"):
            if not isinstance(item.get(field), str):
                raise RequestError(f"item {i} has no {field!r} string: an item is {{\"prompt\": ..., "
                                   f"\"reference\": ...}}", param="task")


def score(predictions: Sequence[str], references: Sequence[str]) -> Scores:
    try:
        import sacrebleu
        from rouge_score import rouge_scorer
    except ImportError as exc:
        raise RequestError(f"scoring needs sacrebleu and rouge-score ({exc.name} is missing): "
                           f"pip install 'nanoinfer[eval]'", param="task") from exc
    bleu = sacrebleu.corpus_bleu(list(predictions), [list(references)]).score
    scorer = rouge_scorer.RougeScorer(list(ROUGE), use_stemmer=True)
    rouge = [scorer.score(ref, pred) for pred, ref in zip(predictions, references)]
    n = len(predictions)
    means = [sum(r[kind].fmeasure for r in rouge) / n for kind in ROUGE]
    exact = sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / n
    return Scores(bleu, *means, exact, n)


def evaluate(llm, items: Sequence[dict], params: SamplingParams, *, chat: bool = False,
             use_tqdm: bool = False) -> tuple[Scores, list[str]]:
    """Scores of `llm`'s answers to the items, and the answers."""
    check_items(items)
    prompts = [[{"role": "user", "content": item["prompt"]}] if chat else item["prompt"] for item in items]
    answers = [out.text for out in llm.generate(prompts, params, use_tqdm=use_tqdm)]
    return score(answers, [item["reference"] for item in items]), answers
