"""The offline facade on the default model: batching is invisible, finish reasons, stop strings,
seeds, streaming, errors that leave the engine serving."""

import time

import pytest

from nanoinfer import LLM, RequestError, SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea", "1, 2, 3,",
           "Once upon a time, in a land far far away, there lived a"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    # Without the prefix cache: "alone" after "together" would find the prompts cached and
    # compute only their ends, another split whose rounding int8 activations can turn into
    # another token (tests/test_prefix_cache.py holds the cache to exact equality in fp32).
    with LLM(smollm2_gguf, device="cpu", progress=False, num_blocks=64, block_size=8,
             enable_prefix_caching=False) as llm:
        yield llm


def all_blocks_free(llm, timeout=10.0) -> bool:
    """The worker reports its counts after each step or command: wait for the latest."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.stats()
        if stats["free_blocks"] == 64 and stats["running"] == stats["waiting"] == 0:
            return True
        time.sleep(0.01)
    return False


def test_batch_equals_each_prompt_alone(llm):
    together = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, together):
        alone = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == alone.token_ids and out.text == alone.text
        assert out.prompt == prompt and list(out.prompt_token_ids) == llm.tokenizer.encode(prompt)
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(list(out.token_ids))
    assert all_blocks_free(llm)


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_tokens(smollm2_gguf):
    # The exact path (fp32 weights): the chunks' attention sums in another order, and the
    # packed path's int8 activations can turn such a rounding into another token.
    outputs = []
    for budget in (5, 4096):
        with LLM(smollm2_gguf, device="cpu", progress=False, num_blocks=64, block_size=8, dtype="float32",
                 max_num_batched_tokens=budget, enable_prefix_caching=False) as engine:
            outputs.append([o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)])
    assert outputs[0] == outputs[1]


def test_deterministic_changes_nothing_on_the_cpu(llm, smollm2_gguf):
    """`deterministic=True` (issue 65) asks CUDA for its batch-invariant kernels; the CPU's are batch-invariant
    already, so on the CPU the setting is accepted and the tokens and logprobs are those of the default."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    default = llm.generate(PROMPTS, params, use_tqdm=False)
    with LLM(smollm2_gguf, device="cpu", progress=False, num_blocks=64, block_size=8, enable_prefix_caching=False,
             deterministic=True) as det:
        assert det.engine.core.config.deterministic
        ours = det.generate(PROMPTS, params, use_tqdm=False)
    assert [(o.token_ids, o.outputs[0].logprobs) for o in ours] == [(o.token_ids, o.outputs[0].logprobs)
                                                                    for o in default]


def test_a_streams_per_token_outputs_are_not_tracked_by_the_cyclic_gc(llm):
    """A server front makes a CompletionOutput a token a stream: untracked, they set off no collection."""
    import gc

    stream = llm.stream("The capital of France is", GREEDY)
    out = next(stream)
    stream.close()
    assert not gc.is_tracked(out.outputs[0]) and out.outputs[0].token_ids
    assert all_blocks_free(llm)


def test_stop_token_ids_and_eos(llm):
    base = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    stop_id = base.token_ids[3]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]


def test_stop_strings(llm):
    base = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].text
    stop = base[5:9]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop=stop), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == base[: base.index(stop)]
    kept = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop=[stop, "zzz"],
                                                   include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == base[: base.index(stop) + len(stop)]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    together = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    again = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(PROMPTS[:3], params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in again]
    other_seed = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=10, seed=99, ignore_eos=True),
                              use_tqdm=False)[0]
    assert other_seed.token_ids != together[0].token_ids


def test_stream_deltas_add_up_to_the_whole(llm):
    whole = llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)[0]
    deltas = list(llm.stream(PROMPTS[3], GREEDY))
    assert "".join(d.text for d in deltas) == whole.text
    assert sum((list(d.token_ids) for d in deltas), []) == list(whole.token_ids)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert all(not d.finished for d in deltas[:-1])


def test_breaking_out_of_a_stream_frees_its_blocks(llm):
    stream = llm.stream(PROMPTS[3], SamplingParams(temperature=0, max_tokens=50))
    next(stream)
    stream.close()
    assert all_blocks_free(llm)


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0, max_tokens=8))
    assert out.prompt.startswith("<|im_start|>system") and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids[0] == llm.tokenizer.encode("<|im_start|>")[0]


def test_chat_renders_tools_and_template_variables(llm):
    """vLLM's offline `chat(..., tools=...)`: the tools reach the prompt (here in the system
    message: the default model's template has no tools); the reply is text."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    out = llm.chat([{"role": "user", "content": "Weather?"}], SamplingParams(temperature=0, max_tokens=4),
                   tools=[tool])
    assert '"name": "get_weather"' in out.prompt and "<tool_call>" in out.prompt and out.outputs[0].text
    plain = llm.chat([{"role": "user", "content": "Weather?"}], SamplingParams(temperature=0, max_tokens=4),
                     chat_template_kwargs={"unused_variable": 1})
    assert "get_weather" not in plain.prompt and plain.prompt == llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather?"}])


def test_bad_requests_fail_alone_and_the_engine_keeps_serving(llm):
    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate([[5] * 9000], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="49152"):
        llm.generate([[5, 49152]], GREEDY, use_tqdm=False)
    with pytest.raises(RequestError, match="KV cache"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=5000), use_tqdm=False)
    with pytest.raises(RequestError, match="SamplingParams"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)
    assert all_blocks_free(llm)
    assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].token_ids) == 12


def test_dummy_load_format_needs_only_the_config_and_tokenizer(smollm2_gguf, tmp_path):
    """`load_format="dummy"` (vLLM's name): random weights for a checkpoint's config, with its
    tokenizer, where the weights are not at hand (benchmarks on the GPU machine)."""
    import json

    import transformers

    from nanoinfer import CheckpointError, RequestError
    from nanoinfer.loaders.gguf import open_gguf
    from nanoinfer.text.tokenizer import Tokenizer

    config = transformers.Qwen3Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8).to_dict()
    directory = tmp_path / "qwen3-tiny.dummy"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    Tokenizer.from_gguf(open_gguf(smollm2_gguf), smollm2_gguf).save_hf(directory)
    with pytest.raises(CheckpointError):
        LLM(directory, device="cpu", progress=False)  # no weights to read
    with pytest.raises(RequestError, match="load_format"):
        LLM(directory, device="cpu", progress=False, load_format="random")
    with LLM(directory, device="cpu", progress=False, load_format="dummy") as llm:
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.token_ids) == 5 and llm.model.model_id == "qwen3-tiny.dummy"
