"""`nanoinfer eval`: perplexity over a sliding window equals exp(mean NLL) that transformers
computes on the same tokens and windows; its CLI prints and writes the numbers."""

import json
import math

import pytest
import torch
import transformers

from nanoinfer.errors import RequestError
from runtime.eval.perplexity import windows


def test_windows_score_every_token_after_the_first_once():
    for n, context, stride in ((10, 4, 2), (10, 4, 4), (9, 16, 8), (37, 8, 3), (2, 2, 1)):
        spans = windows(n, context, stride)
        scored = [p for _, end, first in spans for p in range(first, end)]
        starts = {begin for begin, _, _ in spans if begin}
        assert sorted(scored) == [p for p in range(1, n) if stride < context or p not in starts]
        assert all(0 < end - begin <= context and begin < first for begin, end, first in spans)
    assert windows(10, 4, 2)[:2] == [(0, 4, 1), (2, 6, 4)]


@pytest.mark.parametrize("bad, match", [(dict(context=1), "context=1 is too short"),
                                        (dict(stride=0), "stride=0 is invalid"),
                                        (dict(stride=9), "stride=9 is invalid: expected 1 to context \\(8\\)"),
                                        (dict(n=1), "1 token\\(s\\) long")])
def test_bad_windows_are_named(bad, match):
    args = dict(n=10, context=8, stride=4) | bad
    with pytest.raises(RequestError, match=match):
        windows(args["n"], args["context"], args["stride"])


@pytest.mark.parametrize("context, stride", [(64, 64), (16, 8), (16, 5)])
def test_perplexity_equals_transformers(tmp_path, context, stride):
    from nanoinfer import LLM
    from runtime.eval.perplexity import perplexity

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin, end, first in windows(len(ids), context, stride):
            logprobs = hf(torch.tensor([ids[begin:end]])).logits[0].float().log_softmax(-1)
            nll -= sum(logprobs[p - begin - 1, ids[p]].item() for p in range(first, end))
            count += end - first
    with LLM(tmp_path, device="cpu", dtype="float32", progress=False, num_blocks=64) as llm:
        ours = perplexity(llm, ids, context=context, stride=stride, num_bytes=100)
    assert ours.tokens == count
    assert math.isclose(ours.perplexity, math.exp(nll / count), rel_tol=1e-4)
    assert math.isclose(ours.bits_per_byte, nll / math.log(2) / 100, rel_tol=1e-4)


def test_cli_prints_and_writes_perplexity(smollm2_gguf, tmp_path, capsys):
    from runtime.cli import main

    text = tmp_path / "text.txt"
    text.write_text("Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of "
                    "Italy. Madrid is the capital of Spain.\n")
    out = tmp_path / "ppl.json"
    assert main(["eval", "perplexity", str(text), "--model", str(smollm2_gguf), "--device", "cpu", "--dtype",
                 "float32", "--context", "16", "--num-blocks", "64", "--json", str(out)]) == 0
    numbers = json.loads(out.read_text())
    assert numbers["tokens"] > 20 and math.isclose(numbers["perplexity"], math.exp(numbers["nll"] / numbers["tokens"]))
    assert 0 < numbers["bits_per_byte"] < numbers["nll"] / math.log(2)
    assert f"{numbers['perplexity']:.4f}" in capsys.readouterr().out
    assert main(["eval", "perplexity", str(tmp_path / "missing.txt"), "--model", str(smollm2_gguf)]) == 2


# -- eval choice: accuracy by continuation likelihood -------------------------------------------

MC = [{"query": "The capital of France is", "choices": ["Paris", "a banana", "the moon"], "gold": 0},
      {"query": "Two plus two equals", "choices": ["four", "purple", "Tuesday"], "gold": 0},
      {"query": "The opposite of hot is", "choices": ["cold", "seven", "a chair"], "gold": 0},
      {"query": "Water freezes at zero degrees", "choices": ["Celsius", "banana", "elephants"], "gold": 0}]
SCHEMA = [{"context_options": ["The sun is hot.", "The sun is a sandwich."], "continuation": "It gives us light.",
           "gold": 0},
          {"context_options": ["Fish live in water.", "Fish live in the sky."], "continuation": "They swim.",
           "gold": 0}]
LM = [{"context": "The capital of France is", "continuation": "Paris"},
      {"context": "The capital of France is", "continuation": "banana bread"},
      {"context": "One, two, three, four,", "continuation": "five"}]


def reference(model, scored):
    """Per prompt: mean loss over its span and whether greedy predicts every span token, from one
    plain forward over the whole prompt (no engine, no batching with other prompts)."""
    from nanoinfer.model.batch import SeqChunk, build_batch
    from nanoinfer.model.kv_cache import allocate_kv_pool
    from nanoinfer.model.decoder import forward

    out = []
    for tokens, (start, end) in zip(scored.tokens, scored.spans):
        blocks = -(-len(tokens) // 16)
        kv = allocate_kv_pool(model.config, blocks, 16, torch.float32, "cpu")
        batch = build_batch([SeqChunk(tokens, 0, list(range(blocks)), True)], 16, logits_rows=range(len(tokens)))
        with torch.inference_mode():
            logprobs = forward(model.params, kv, batch, model.config).log_softmax(-1)
        rows = range(start - 1, end - 1)
        out.append((-sum(logprobs[r, tokens[r + 1]].item() for r in rows) / (end - start),
                    all(logprobs[r].argmax().item() == tokens[r + 1] for r in rows)))
    return out


@pytest.mark.parametrize("task_type, items, shots", [("multiple_choice", MC, 1), ("schema", SCHEMA, 0),
                                                      ("language_modeling", LM, 1)])
def test_choice_accuracy_is_the_models_preference(smollm2_gguf, task_type, items, shots):
    """The answer each item gets is the one a plain forward prefers; with golds forced to it the
    accuracy is 1, with golds forced off it 0."""
    from nanoinfer import LLM
    from runtime.eval.choice import evaluate, prepare

    with LLM(smollm2_gguf, device="cpu", dtype="float32", progress=False, num_blocks=256) as llm:
        scored = prepare(items, task_type, lambda t: llm.tokenizer.encode(t, add_special_tokens=True), shots=shots)
        refs = [reference(llm.model, s) for s in scored]
        if task_type == "language_modeling":
            acc, right = evaluate(llm, items, task_type, shots=shots)
            assert right == [r[0][1] for r in refs] and any(right) and not all(right)
            assert acc.accuracy == sum(right) / len(items) and acc.n == len(items)
            return
        best = [min(range(len(r)), key=lambda i: r[i][0]) for r in refs]
        forced = [item | {"gold": b} for item, b in zip(items, best)]
        assert evaluate(llm, forced, task_type, shots=shots)[0].accuracy == 1.0
        off = [item | {"gold": (b + 1) % len(r)} for item, b, r in zip(items, best, refs)]
        assert evaluate(llm, off, task_type, shots=shots)[0].accuracy == 0.0


def test_choice_task_errors_are_named():
    from runtime.eval.choice import check_items

    with pytest.raises(RequestError, match="task_type='mc' is invalid"):
        check_items(MC, "mc")
    with pytest.raises(RequestError, match="item 1 has no 'gold'"):
        check_items([MC[0], {"query": "q", "choices": ["a"]}], "multiple_choice")
    with pytest.raises(RequestError, match="no items"):
        check_items([], "schema")


def test_cli_choice(smollm2_gguf, tmp_path, capsys):
    from runtime.cli import main

    task = tmp_path / "task.jsonl"
    task.write_text("\n".join(json.dumps(item) for item in MC) + "\n")
    out = tmp_path / "acc.json"
    assert main(["eval", "choice", str(task), "--model", str(smollm2_gguf), "--device", "cpu", "--shots", "1",
                 "--num-blocks", "256", "--json", str(out)]) == 0
    numbers = json.loads(out.read_text())
    assert numbers["n"] == 4 and 0 <= numbers["accuracy"] <= 1
    assert f"{numbers['accuracy']:.4f}" in capsys.readouterr().out
    task.write_text("{not json\n")
    assert main(["eval", "choice", str(task), "--model", str(smollm2_gguf)]) == 2


# -- eval generate: answers scored with sacrebleu and rouge-score --------------------------------

def test_scores_are_the_libraries_own():
    import sacrebleu
    from rouge_score import rouge_scorer

    from runtime.eval.generate import score

    predictions = ["the cat sat on the mat", "Paris", "a dog barks loudly at night ", "forty-two"]
    references = ["the cat is sitting on the mat", "Paris", "the dog barked at night", "42"]
    got = score(predictions, references)
    assert got.n == 4 and got.exact_match == 0.25
    assert got.bleu == sacrebleu.corpus_bleu(predictions, [references]).score
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    for kind in ("rouge1", "rouge2", "rougeL"):
        direct = [scorer.score(r, p)[kind].fmeasure for p, r in zip(predictions, references)]
        assert math.isclose(getattr(got, kind), sum(direct) / 4)
    assert score(["x"], ["x"]).exact_match == 1.0 and score(["x"], ["x"]).rouge1 == 1.0


def test_cli_generate_scores_the_models_answers(smollm2_gguf, tmp_path):
    """The model's own greedy answers as references score 1 everywhere; other references lower."""
    from nanoinfer import LLM
    from nanoinfer.sampling.sampler import SamplingParams
    from runtime.cli import main

    prompts = ["The capital of France is", "Water is made of", "The first month of the year is"]
    with LLM(smollm2_gguf, device="cpu", progress=False, num_blocks=128) as llm:
        answers = [o.text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12),
                                                use_tqdm=False)]
    task = tmp_path / "task.jsonl"
    out = tmp_path / "scores.json"
    for references, perfect in ((answers, True), (["Berlin is a city in Germany"] * 3, False)):
        task.write_text("\n".join(json.dumps({"prompt": p, "reference": r}) for p, r in zip(prompts, references)))
        assert main(["eval", "generate", str(task), "--model", str(smollm2_gguf), "--device", "cpu",
                     "--max-tokens", "12", "--num-blocks", "128", "--json", str(out)]) == 0
        numbers = json.loads(out.read_text())
        assert numbers["n"] == 3
        if perfect:
            assert numbers["exact_match"] == 1.0 and numbers["rouge1"] == 1.0 and numbers["bleu"] > 99
        else:
            assert numbers["exact_match"] == 0.0 and numbers["bleu"] < 50
    task.write_text('{"prompt": "x"}\n')
    assert main(["eval", "generate", str(task), "--model", str(smollm2_gguf)]) == 2


# -- eval speed: throughput and latency per batch size ------------------------------------------

def test_percentile_is_nearest_rank():
    from runtime.eval.speed import percentile

    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == (51, 91, 100)
    assert percentile([3.0], 99) == 3.0 and math.isnan(percentile([], 50))


def test_speed_records_every_request_and_token():
    import asyncio
    from pathlib import Path

    from nanoinfer.loaders import LoadedModel
    from runtime.async_engine import AsyncEngine, engine_config
    from runtime.eval.speed import measure
    from tests.tiny import random_params, tiny_config

    cfg = tiny_config()
    engine = AsyncEngine(LoadedModel(cfg, random_params(cfg), None, Path("tiny")), engine_config(num_blocks=64))

    async def run():
        async with engine:
            return await measure(engine, [1, 3], input_len=5, output_len=4, vocab_size=cfg.vocab_size)

    points = asyncio.run(run())
    assert [p.batch for p in points] == [1, 3]
    for p in points:
        assert len(p.ttfts) == p.batch and len(p.itls) == p.batch * 3 and p.output_tokens_per_s > 0
        assert p.ttft_ms["p50"] <= p.ttft_ms["p90"] <= p.ttft_ms["p99"] == max(p.ttfts)
    with pytest.raises(RequestError, match="expected positive numbers"):
        asyncio.run(measure(engine, [0], 5, 4, cfg.vocab_size))


def test_cli_speed_writes_table_json_and_plot(smollm2_gguf, tmp_path, capsys):
    from runtime.cli import main

    png, out = tmp_path / "speed.png", tmp_path / "speed.json"
    assert main(["eval", "speed", "--model", str(smollm2_gguf), "--device", "cpu", "--batch-sizes", "1", "2",
                 "--input-len", "8", "--output-len", "4", "--num-blocks", "64", "--plot", str(png),
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 2] and set(rows[0]) == {"batch", "output_tokens_per_s", "ttft_ms",
                                                                     "itl_ms"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s" in capsys.readouterr().out


def test_bench_latency_plot_draws_a_png(tmp_path):
    """bench/latency.py --plot: bars per shape and variant (the figures are made up here)."""
    from bench.latency import plot

    png = tmp_path / "latency.png"
    plot({"llama-3.2-1b": {"nanoinfer (eager)": 91.0, "nanoinfer (graphs, overlap)": 792.0,
                           "transformers (eager)": 60.0},
          "llama-3.1-8b": {"nanoinfer (eager)": 39.0, "nanoinfer (graphs, overlap)": 177.0}}, str(png), "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
