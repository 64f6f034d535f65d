"""lm-evaluation-harness as a client: `local-completions` pointed at our server scores a
multiple-choice task through completions' echo + logprobs, and answers every item as
`nanoinfer eval choice` does on the same items."""

import json

import pytest

from runtime.eval.choice import evaluate

# Choices of one token each under the default model's tokenizer (checked below): lm-eval's
# `acc` picks the highest summed logprob and `eval choice` the lowest mean loss, the same
# choice when every choice is one token.
WORDS = ["Paris", "London", "Rome", "Berlin", "Madrid", "water", "fire", "red", "blue", "green", "one", "two"]
QUERIES = ["The capital of France is", "The capital of Italy is", "Ice is frozen", "The sky is",
           "Grass is", "The number after one is", "The capital of Spain is", "The capital of Germany is",
           "A flame is", "The sea is"]

TASK_YAML = """task: nanoinfer_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.mark.slow
def test_lm_eval_local_completions_scores_as_eval_choice(live_server, tiny_chat_model, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")  # (in the test extra: skipped only outside it)
    from lm_eval.tasks import TaskManager

    from runtime.llm import LLM

    tokenizer = tiny_chat_model.tokenizer
    assert all(len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1 for w in WORDS)
    items = [{"query": q, "choices": [WORDS[(i + j) % len(WORDS)] for j in range(4)], "gold": i % 4}
             for i, q in enumerate(QUERIES)]
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "nanoinfer_choice.yaml").write_text(TASK_YAML.format(data=data))
    tokenizer.save_hf(tmp_path / "tokenizer")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["nanoinfer_choice"], task_manager=TaskManager(include_path=str(tasks)),
        model_args={"base_url": live_server.url + "/v1/completions", "model": "tiny-chat",
                    "tokenizer_backend": "huggingface", "tokenizer": str(tmp_path / "tokenizer"),
                    "num_concurrent": 1, "max_retries": 1},
        log_samples=True)
    theirs = [bool(s["acc"]) for s in sorted(results["samples"]["nanoinfer_choice"], key=lambda s: s["doc_id"])]

    llm = LLM.from_loaded(tiny_chat_model, num_blocks=256, block_size=16)
    try:
        accuracy, ours = evaluate(llm, items, "multiple_choice")
    finally:
        llm.close()
    assert theirs == ours and 0 < sum(ours) < len(ours)  # (right and wrong both occur: the check can fail)
    assert results["results"]["nanoinfer_choice"]["acc,none"] == pytest.approx(accuracy.accuracy)
