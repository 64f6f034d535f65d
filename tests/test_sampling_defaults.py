"""A checkpoint's recommended sampling settings (generation_config.json, a GGUF's general.sampling.*)
are the defaults of requests that name no params of their own, as vLLM applies them."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers

from nanoinfer import CheckpointError, RequestError, SamplingParams
from nanoinfer.loaders import LoadConfig, load_model
from nanoinfer.sampling.sampling_defaults import from_gguf
from runtime.llm import LLM

PROMPT = [5, 9, 13, 2, 7]
RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5,
               "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("recommends")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return path


def llm(path, **kw):
    return LLM(path, device="cpu", progress=False, num_blocks=32, block_size=4, **kw)


def test_the_checkpoints_recommendation_is_the_default(tiny_dir, caplog):
    caplog.set_level("INFO", logger="nanoinfer.sampling.sampling_defaults")
    with llm(tiny_dir) as engine:
        assert "recommended sampling settings {'temperature': 0.6" in caplog.text  # (said once, at load)
        assert dict(engine.model.sampling_defaults) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                        "max_tokens": 5}
        (out,) = engine.generate([PROMPT], use_tqdm=False)  # no params: the model's
        assert len(out.outputs[0].token_ids) == 5 or out.outputs[0].finish_reason == "stop"
        (mine,) = engine.generate([PROMPT], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(mine.outputs[0].token_ids) == 3  # params given: used as they are
        req = engine.engine.new_request(PROMPT)  # (what stream() and chat() build without params)
        assert (req.params.temperature, req.params.top_p, req.params.top_k, req.params.max_tokens) == (0.6, 0.9, 20, 5)


def test_generation_config_none_and_a_folder(tiny_dir, tmp_path):
    with llm(tiny_dir, generation_config="none") as engine:
        assert dict(engine.model.sampling_defaults) == {}
        assert engine.engine.new_request(PROMPT).params == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "repetition_penalty": 1.1}))
    with llm(tiny_dir, generation_config=str(tmp_path)) as engine:
        assert dict(engine.model.sampling_defaults) == {"temperature": 0.2, "repetition_penalty": 1.1}
    with pytest.raises(RequestError, match="generation_config='/nonexistent'.*auto, none, or a folder"):
        LoadConfig(generation_config="/nonexistent")


@pytest.mark.parametrize("content, words", [
    ({"temperature": -1}, ("generation_config.json", "temperature")),
    ({"top_p": "high"}, ("generation_config.json", "top_p")),
    ([1, 2], ("generation_config.json", "holds a list, expected a JSON object")),
])
def test_an_unusable_recommendation_names_the_file_and_field(tiny_dir, tmp_path, content, words):
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(tiny_dir, broken)
    (broken / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(CheckpointError) as info:
        llm(broken)
    assert all(w in str(info.value) for w in words), str(info.value)
    with llm(broken, generation_config="none"):  # (told to ignore it, the model loads)
        pass


def test_a_gguf_files_sampling_keys():
    meta = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.penalty_repeat": 1.1,
            "general.sampling.sequence": "edskypmxt"}
    assert from_gguf(meta.get, "m.gguf") == {"temperature": 0.7, "top_k": 40, "repetition_penalty": 1.1}
    with pytest.raises(CheckpointError, match="m.gguf.*top_p"):
        from_gguf({"general.sampling.top_p": 7.0}.get, "m.gguf")


def recommending_gguf(path, **sampling):
    """A tiny llama GGUF (config, a byte-level vocabulary, an embedding) with `sampling` keys
    (their suffix after "general.sampling." -> (value, GGUF value type, item type or None))."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(48)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i) for i in range(16)])
    for name, (value, value_type, item_type) in sampling.items():
        writer.add_key_value(f"general.sampling.{name}", value, value_type, sub_type=item_type)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_files_sampling_keys_through_load_model(tmp_path):
    """load_model's GGUF branch reads the keys from the file's header: llama.cpp's writers type
    temp as FLOAT32 and top_k as INT32."""
    V = gguf.GGUFValueType
    path = recommending_gguf(tmp_path / "m.gguf", temp=(0.5, V.FLOAT32, None), top_k=(40, V.INT32, None))
    model = load_model(path, device="cpu", load_format="dummy", progress=False)
    assert dict(model.sampling_defaults) == {"temperature": 0.5, "top_k": 40}
    assert dict(load_model(path, device="cpu", load_format="dummy", progress=False,
                           generation_config="none").sampling_defaults) == {}
    bad = recommending_gguf(tmp_path / "bad.gguf", temp=([0.5, 0.7], V.ARRAY, V.FLOAT32))
    with pytest.raises(CheckpointError) as info:
        load_model(bad, device="cpu", load_format="dummy", progress=False)
    message = str(info.value)
    assert "bad.gguf" in message and "'general.sampling.temp'" in message and "\n" not in message, message


@pytest.mark.slow
def test_the_cli_takes_the_recommendation_unless_a_flag_is_given(tiny_dir):
    def tokens(*flags):
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_dir), *flags], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    assert tokens() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 5}
    assert tokens("--max-tokens", "9", "--temperature", "0") == {"temperature": 0.0, "top_p": 0.9, "top_k": 20,
                                                                  "max_tokens": 9}
    assert tokens("--generation-config", "none") == {"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                                     "max_tokens": 256}  # (generate's own defaults)


# The CLI's parsing and its SamplingParams for `generate`, with the model's recommendation (no model run).
SCRIPT = """
import json, sys
from nanoinfer.loaders import load_model
from runtime.cli import _load_kwargs, _recommended, _sampling, parse_args
args = parse_args(["generate", "x", "--model", *sys.argv[1:2], "--device", "cpu", *sys.argv[2:]])
model = load_model(args.model, **{**_load_kwargs(args), "progress": False})
p = _recommended(_sampling(args), args, model.sampling_defaults)
print(json.dumps({k: getattr(p, k) for k in ("temperature", "top_p", "top_k", "max_tokens")}))
"""


def test_a_server_request_takes_the_recommendation_for_each_field_it_leaves_out():
    import msgspec

    from runtime.serve.api_mapping import chat_inputs, completion_params
    from runtime.serve.protocol import ChatCompletionRequest, CompletionRequest

    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 5}
    bare = msgspec.json.decode(b'{"prompt": "x"}', type=CompletionRequest)
    p = completion_params(bare, defaults)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.6, 20, 1.0, 5)
    own = msgspec.json.decode(b'{"prompt": "x", "temperature": 0, "max_tokens": 9}', type=CompletionRequest)
    p = completion_params(own, defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 20, 9)
    chat = msgspec.json.decode(b'{"messages": [{"role": "user", "content": "hi"}]}', type=ChatCompletionRequest)
    p = chat_inputs(chat, None, defaults).params
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 5)
    assert chat_inputs(chat, None, {}).params.max_tokens is None  # (chat's own default: up to the context)
