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
